"""A batched rollout loop over 8 sandpool SWE envs with a scripted policy.

``gym.make_vec`` gives the native vector env: 8 sub-envs on one sandbox pool, stepping
concurrently. The env warms the first batch's sandboxes before its claims (as ``sandpool
run`` does), and draws each sub-env's next task one episode ahead and warms it meanwhile. The scripted policy looks around, applies the task's gold patch on even
sub-envs (an oracle) and leaves odd ones untouched (a noop), then submits; the reward comes
from the task's tests. Each finished episode prints its reward and TTFC.

    .venv/bin/python examples/gymnasium_rollouts.py [--tasks tasks.jsonl] [--episodes 16]

Without ``--tasks`` it uses the default task pack (built on first use).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gymnasium as gym
import numpy as np

import sandpool  # noqa: F401 - registers sandpool/SWE-v0
from sandpool.core.task import Task
from sandpool.envs.tasks import load_tasks

NUM_ENVS = 8


def policy(i: int, step: int, task: Task) -> str:
    """The scripted policy: sub-env ``i``'s command at ``step`` of its episode on ``task``."""
    if step == 0:
        return "git status --short && ls"
    if step == 1 and i % 2 == 0:  # oracle: the gold patch, as a heredoc, then git apply
        return f"cat > /tmp/fix.patch <<'PATCH_EOF'\n{task.patch}PATCH_EOF\ngit apply /tmp/fix.patch"
    return "submit"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, help="tasks.jsonl (default: the default task pack)")
    ap.add_argument("--images-root", type=Path, help="local image directory root")
    ap.add_argument("--episodes", type=int, default=16, help="episodes to finish in total")
    args = ap.parse_args()
    if args.tasks is None:
        from sandpool.envs.taskpack import build_default_pack

        args.tasks = build_default_pack()
    tasks = load_tasks(args.tasks)
    by_id = {t.instance_id: t for t in tasks}
    extra = {"backend_options": {"images_root": str(args.images_root)}} if args.images_root else {}

    envs = gym.make_vec("sandpool/SWE-v0", num_envs=NUM_ENVS, tasks=tasks, max_steps=5, **extra)
    try:
        _, info = envs.reset(seed=0)
        task = [by_id[t] for t in info["task_id"]]
        ttfc = list(info["ttfc_s"])
        step = [0] * NUM_ENVS
        ended = np.zeros(NUM_ENVS, dtype=bool)
        done = 0
        while done < args.episodes:
            actions = tuple("" if ended[i] else policy(i, step[i], task[i]) for i in range(NUM_ENVS))
            _, reward, terminated, truncated, info = envs.step(actions)
            for i in range(NUM_ENVS):
                if ended[i]:  # autoreset step (NEXT_STEP): a new episode began
                    task[i], ttfc[i], step[i] = by_id[info["task_id"][i]], info["ttfc_s"][i], 0
                    continue
                step[i] += 1
                if terminated[i] or truncated[i]:
                    done += 1
                    kind = "oracle" if i % 2 == 0 else "noop"
                    if info["infra_failed"][i]:
                        outcome = f"infra_failed ({info['error_kind'][i]}), not scored"
                    else:
                        outcome = f"reward {reward[i]:.0f}"
                    print(f"env {i} {kind:6} {task[i].instance_id:40} {outcome:14} "
                          f"TTFC {ttfc[i] * 1000:7.1f} ms")
            ended = terminated | truncated
        print()
        print(envs.report().render_text())
    finally:
        envs.close()


if __name__ == "__main__":
    main()
