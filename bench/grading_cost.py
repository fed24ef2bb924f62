"""Benchmark: what grading the diff costs against grading in place, on the default pack.

Each rollout claims a sandbox from a ``reuse`` pool on the local backend and applies the task's
gold patch (the "policy", not timed); then it is graded one of two ways, interleaved rollout
by rollout so that machine load hits both alike:

* ``in place`` (before): :func:`sandpool.envs.grading.grade` on the sandbox the policy left;
* ``diff`` (after): :func:`~sandpool.envs.grading.capture.capture_patch` on that sandbox,
  :meth:`~sandpool.core.pool.Lease.reset` (the verified in-place reset, or a fresh sandbox),
  then :func:`~sandpool.envs.grading.diff.grade_patch` on the pristine sandbox.

The release's own reset, which both pay, is not timed. The baseline from the same run is the
task's tests alone: the harness's ``pytest`` command run bare in a sandbox. Prints the median
and p95 of each, the diff flow's parts, and the ratios.

    .venv/bin/python bench/grading_cost.py [--rollouts 8] [--tasks 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandpool.core.backends.local import LocalBackend  # noqa: E402
from sandpool.core.pool import SandboxPool  # noqa: E402
from sandpool.envs.grading import grade  # noqa: E402
from sandpool.envs.grading.capture import capture_patch  # noqa: E402
from sandpool.envs.grading.diff import grade_patch  # noqa: E402
from sandpool.envs.grading.harness import plan_for  # noqa: E402
from sandpool.envs.taskpack import abuild_default_pack  # noqa: E402
from sandpool.envs.tasks import load_tasks  # noqa: E402


async def _gold(lease, task) -> None:
    await lease.write_file("/tmp/gold.patch", task.patch.encode())
    res = await lease.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=60)
    assert res.ok, res.err_text


async def _in_place(pool, task) -> dict[str, float]:
    async with pool.claim(task) as lease:
        await _gold(lease, task)
        t0 = time.perf_counter()
        result = await grade(lease, task, timeout=300)
        total = time.perf_counter() - t0
    assert result.reward == 1.0, result
    return {"total": total}


async def _diff(pool, task) -> dict[str, float]:
    async with pool.claim(task) as lease:
        await _gold(lease, task)
        t0 = time.perf_counter()
        patch = await capture_patch(lease, task)
        t1 = time.perf_counter()
        await lease.reset()
        t2 = time.perf_counter()
        result = await grade_patch(lease, task, patch, timeout=300)
        t3 = time.perf_counter()
    assert result.reward == 1.0, result
    return {"total": t3 - t0, "capture": t1 - t0, "reset": t2 - t1, "score": t3 - t2}


async def _tests_alone(pool, task) -> dict[str, float]:
    async with pool.claim(task) as lease:
        await _gold(lease, task)
        t0 = time.perf_counter()
        await lease.exec(plan_for(task).command, timeout=300, max_output=64 << 20)
        return {"total": time.perf_counter() - t0}


def _row(name: str, xs: list[float], base: float) -> str:
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
    med = statistics.median(xs)
    return f"{name:<28} {med * 1000:>8.0f} {p95 * 1000:>8.0f} {med / base:>9.2f}x"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=8, help="rollouts per task and flow")
    ap.add_argument("--tasks", type=int, default=4, help="tasks, one per package of the pack")
    args = ap.parse_args()
    tasks, seen = [], set()
    for t in load_tasks(await abuild_default_pack()):
        if t.repo not in seen and len(tasks) < args.tasks:
            seen.add(t.repo)
            tasks.append(t)
    samples: dict[str, list[dict[str, float]]] = {"tests alone": [], "in place": [], "diff": []}
    async with SandboxPool(LocalBackend(), "reuse") as pool:
        await pool.prepare(tasks, concurrency=1)
        for task in tasks:  # warm each image's sandbox and its page cache before timing
            await _tests_alone(pool, task)
        for _ in range(args.rollouts):
            for task in tasks:
                samples["tests alone"].append(await _tests_alone(pool, task))
                samples["in place"].append(await _in_place(pool, task))
                samples["diff"].append(await _diff(pool, task))
    base = statistics.median(s["total"] for s in samples["tests alone"])
    print(f"grading cost: {len(tasks)} tasks of the default pack x {args.rollouts} rollouts per flow, "
          "gold patch, local backend, reuse")
    print(f"{'':<28} {'p50 ms':>8} {'p95 ms':>8} {'vs tests':>10}")
    print(_row("tests alone (baseline)", [s["total"] for s in samples["tests alone"]], base))
    print(_row("in place (before)", [s["total"] for s in samples["in place"]], base))
    print(_row("diff (after)", [s["total"] for s in samples["diff"]], base))
    for part in ("capture", "reset", "score"):
        print(_row(f"  diff: {part}", [s[part] for s in samples["diff"]], base))
    before = statistics.median(s["total"] for s in samples["in place"])
    after = statistics.median(s["total"] for s in samples["diff"])
    print(f"diff / in place (p50): {after / before:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
