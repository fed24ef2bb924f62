"""Benchmark: the native vector env vs ``SyncVectorEnv`` over the same single envs.

Both sides run ``--envs`` sub-envs (default 8) on the same tasks with the same scripted
actions, in two workloads: (A) quick shell commands inside long episodes (what most agent
steps are), and (B) whole episodes: ``--steps`` commands including a test run, then
``submit`` (graded). Steps that are CPU-bound (test runs, grading, resets) cannot overlap
beyond the machine's cores, so (B) is bounded by the CPU count; the load average is printed. Autoreset is
Gymnasium's default (``NEXT_STEP``) on both sides. Each side is warmed first (one reset, not
timed); the timed part is every step including autoresets and grading. Prints wall time per
side and the ratio ``sync / vector`` (higher is better for the vector env).

    .venv/bin/python bench/gym_vector_vs_sync.py [--envs 8] [--episodes 2] [--steps 6]
        [--tasks path/to/tasks.jsonl] [--images-root DIR]

Without ``--tasks`` it uses the default task pack (built on first use).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

import sandpool  # noqa: F401 - registers sandpool/SWE-v0
from sandpool.core.task import Task
from sandpool.envs.tasks import load_tasks
from sandpool.integrations.gymnasium import ENV_ID

#: What every sub-env runs each episode, in order, before ``submit``: the shape of a short
#: agent episode (look around, read code, run the failing tests once).
SCRIPT = [
    "git status --short && ls",
    "git log --oneline -3",
    "grep -rn 'def ' --include=*.py . | head -50",
    "cat $(git ls-files '*.py' | head -1) | head -60",
    "sed -n 1,40p {first_test}",
    "python -m pytest -q -x -p no:cacheprovider {tests} 2>&1 | tail -3",
]


def _actions(task: Task, step: int, steps: int) -> str:
    if step == steps:
        return "submit"
    files = sorted({t.split("::")[0] for t in task.FAIL_TO_PASS})
    return SCRIPT[step % len(SCRIPT)].format(tests=" ".join(files), first_test=files[0])


def run(envs: gym.vector.VectorEnv, tasks: list[Task], episodes: int, steps: int) -> tuple[float, list[float]]:
    """Warm up with one reset, then time ``episodes`` scripted episodes per sub-env.

    Returns:
        ``(wall seconds, rewards of finished episodes)``.
    """
    n = envs.num_envs
    by_id = {t.instance_id: t for t in tasks}
    _, info = envs.reset(seed=0)
    current = [by_id[info["task_id"][i]] for i in range(n)]
    step_in_episode = [0] * n
    finished = [0] * n
    rewards: list[float] = []
    ended = np.zeros(n, dtype=bool)
    t0 = time.perf_counter()
    while min(finished) < episodes:
        actions = []
        for i in range(n):
            actions.append("true" if ended[i] else _actions(current[i], step_in_episode[i], steps))
        _, rew, term, trunc, info = envs.step(tuple(actions))
        for i in range(n):
            if ended[i]:  # this step was the autoreset: a new task
                current[i] = by_id[info["task_id"][i]]
                step_in_episode[i] = 0
            else:
                step_in_episode[i] += 1
        ended = term | trunc
        for i in np.flatnonzero(ended):
            finished[i] += 1
            rewards.append(float(rew[i]))
    return time.perf_counter() - t0, rewards


def run_commands(envs: gym.vector.VectorEnv, tasks: list[Task], rounds: int) -> float:
    """Warm up with one reset, then time ``rounds`` passes over the quick commands of
    :data:`SCRIPT` (no test run, no grading) inside one long episode. Returns wall seconds."""
    by_id = {t.instance_id: t for t in tasks}
    _, info = envs.reset(seed=0)
    current = [by_id[info["task_id"][i]] for i in range(envs.num_envs)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        for step in range(len(SCRIPT) - 1):
            envs.step(tuple(_actions(t, step, 10**6) for t in current))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="commands per episode before submit")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the quick commands (A)")
    ap.add_argument("--tasks", type=Path, help="tasks.jsonl (default: the default task pack)")
    ap.add_argument("--images-root", type=Path, help="local image directory root")
    args = ap.parse_args()
    if args.tasks is None:
        from sandpool.envs.taskpack import build_default_pack

        args.tasks = build_default_pack()
    tasks = load_tasks(args.tasks)
    kw = {"tasks": tasks, "max_steps": args.steps + 1, "step_timeout": 120.0}
    if args.images_root:
        kw["backend_options"] = {"images_root": str(args.images_root)}

    results, commands = {}, {}
    for mode in ("vector_entry_point", "sync"):
        envs = gym.make_vec(ENV_ID, num_envs=args.envs, vectorization_mode=mode,
                            **{**kw, "max_steps": 10**6})
        try:
            commands[mode] = run_commands(envs, tasks, args.rounds)
        finally:
            envs.close()
        envs = gym.make_vec(ENV_ID, num_envs=args.envs, vectorization_mode=mode, **kw)
        try:
            results[mode] = run(envs, tasks, args.episodes, args.steps)
        finally:
            envs.close()
    vec_s, vec_r = results["vector_entry_point"]
    sync_s, sync_r = results["sync"]
    print(f"{args.envs} envs, {len(tasks)} tasks, local backend, reuse, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"A. commands: {args.rounds} x {len(SCRIPT) - 1} quick commands per env (no tests, no grading)")
    print(f"  native vector env : {commands['vector_entry_point']:7.2f} s")
    print(f"  SyncVectorEnv     : {commands['sync']:7.2f} s")
    print(f"  ratio sync/vector : {commands['sync'] / commands['vector_entry_point']:.2f}x")
    print(f"B. episodes: {args.episodes} per env x ({args.steps} commands incl. a test run + submit "
          "with grading), autoreset")
    print(f"  native vector env : {vec_s:7.2f} s  mean reward {np.mean(vec_r):.3f} over {len(vec_r)}")
    print(f"  SyncVectorEnv     : {sync_s:7.2f} s  mean reward {np.mean(sync_r):.3f} over {len(sync_r)}")
    print(f"  ratio sync/vector : {sync_s / vec_s:.2f}x")


if __name__ == "__main__":
    main()
