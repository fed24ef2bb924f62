"""A small tree search: from one state in the middle of an episode, 4 branches try different
commands, and each branch's reward is printed.

The episode looks around first (the shared prefix), then ``env.unwrapped.fork(4)`` gives 4
envs that go on from that state, each in a sandbox of its own restored from one snapshot of
the parent's, and each graded on its own by the task's tests. The parent goes on too.

    .venv/bin/python examples/tree_search.py [--tasks tasks.jsonl] [--task-id ID]

Without ``--tasks`` it uses the default task pack (built on first use) and its first task.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gymnasium as gym

import sandpool  # noqa: F401 - registers sandpool/SWE-v0
from sandpool.core import PoolLimits
from sandpool.core.task import Task
from sandpool.envs.tasks import load_tasks


def branches(task: Task) -> dict[str, str]:
    """The four commands the branches try (the gold patch is at /tmp/gold.patch)."""
    changed = next((ln[6:] for ln in task.patch.splitlines() if ln.startswith("+++ b/")), "")
    return {
        "apply the fix": "git apply /tmp/gold.patch",
        "change nothing": "true",
        "delete the file the fix touches": f"git rm -q -- {changed}" if changed else "true",
        "apply the fix, then revert it": "git apply /tmp/gold.patch && git apply -R /tmp/gold.patch",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, help="tasks.jsonl (default: the default task pack)")
    ap.add_argument("--task-id", help="the task to search on (default: the first)")
    ap.add_argument("--images-root", type=Path, help="local image directory root")
    args = ap.parse_args()
    if args.tasks is None:
        from sandpool.envs.taskpack import build_default_pack

        args.tasks = build_default_pack()
    tasks = load_tasks(args.tasks)
    task = next(t for t in tasks if args.task_id in (None, t.instance_id))
    extra = {"backend_options": {"images_root": str(args.images_root)}} if args.images_root else {}

    env = gym.make("sandpool/SWE-v0", tasks=[task], max_steps=10, limits=PoolLimits(max_live=8), **extra)
    kids = []
    try:
        env.unwrapped.pool.prepare([task] * 5, 5)  # warm sandboxes for the parent and 4 branches
        env.reset(options={"task_id": task.instance_id})
        # The shared prefix: look around, and put the fix where a branch can apply it.
        for command in ("git status --short && git log --oneline -1", "ls"):
            env.step(command)
        env.unwrapped.write_file("/tmp/gold.patch", task.patch)
        t0 = time.monotonic()
        kids = env.unwrapped.fork(4)
        print(f"task {task.instance_id}: forked 4 branches after 2 steps in "
              f"{(time.monotonic() - t0) * 1000:.0f} ms")
        for kid, (what, command) in zip(kids, branches(task).items(), strict=True):
            obs, *_ = kid.step(command)
            _, reward, _, _, info = kid.step("submit")
            verdict = "resolved" if info.get("resolved") else "not resolved"
            print(f"  branch {what:34} exit {int(obs['exit_code']):3}  reward {reward:.0f}  ({verdict})")
        _, reward, *_ = env.step("submit")
        print(f"  parent (went on unchanged)           reward {reward:.0f}")
        print()
        print(env.unwrapped.report().render_text())
    finally:
        for kid in kids:
            kid.close()
        env.close()


if __name__ == "__main__":
    main()
