"""Benchmark: the first claims of an RL step's second batch, with and without prefetch.

Two batches of ``--tasks`` tasks x ``--group`` rollouts (GRPO groups) run one after the
other on the local backend (reuse strategy, the default task pack: each batch's tasks on
images of their own). Batch 1 is prepared (warm) and runs for ``--think`` seconds per
rollout. With ``--prefetch`` on, ``pool.prefetch(batch2, rollouts_per_task=G)`` is called as
batch 1 starts; without it, batch 2's claims start their sandboxes themselves. Prints batch
2's TTFC (mean, max: the max stalls the step) both ways, batch 1's as the warm baseline from
the same run, and the load average.

    .venv/bin/python bench/prefetch.py --tasks 4 --group 4 --think 10
"""

from __future__ import annotations

import argparse
import asyncio
import os

from sandpool.core import PoolLimits, SandboxPool, TTFCStats, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.taskpack import abuild_default_pack
from sandpool.envs.tasks import load_tasks


async def step(tasks, group: int, think: float, prefetch: bool) -> tuple[TTFCStats, TTFCStats]:
    batch1, batch2 = tasks[: len(tasks) // 2], tasks[len(tasks) // 2:]

    async def episode(lease) -> float:
        await lease.exec("git status --short")
        await asyncio.sleep(think)  # the policy's time on the batch
        return 1.0

    concurrency = len(batch1) * group
    limits = PoolLimits(max_live=2 * concurrency + 2)
    async with SandboxPool(LocalBackend(), "reuse", limits) as pool:
        await pool.prepare(batch1, concurrency, rollouts_per_task=group)

        async def run(batch) -> TTFCStats:
            rs = await asyncio.gather(*(run_rollout(pool, t, episode, rollout=k)
                                        for t in batch for k in range(group)))
            return TTFCStats.from_samples([r.ttfc_s for r in rs if r.ttfc_s is not None])

        if prefetch:
            await pool.prefetch(batch2, rollouts_per_task=group, concurrency=concurrency)
        first = await run(batch1)
        second = await run(batch2)
    return first, second


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=4, help="tasks per batch")
    ap.add_argument("--group", type=int, default=4, help="rollouts per task (G)")
    ap.add_argument("--think", type=float, default=10.0)
    args = ap.parse_args()
    tasks = load_tasks(await abuild_default_pack())
    by_image = list({t.image: t for t in tasks}.values())[: 2 * args.tasks]
    print(f"2 batches of {args.tasks} tasks x {args.group} rollouts, think {args.think:g} s, "
          f"local backend, reuse")
    for prefetch in (False, True):
        load0 = os.getloadavg()[0]
        b1, b2 = await step(by_image, args.group, args.think, prefetch)
        print(f"prefetch {'on ' if prefetch else 'off'}: batch 2 TTFC mean {b2.mean_s * 1000:8.1f} ms "
              f"max {b2.max_s * 1000:8.1f} ms | batch 1 (warm) mean {b1.mean_s * 1000:6.1f} ms "
              f"max {b1.max_s * 1000:6.1f} ms | load {load0:.0f}->{os.getloadavg()[0]:.0f}",
              flush=True)


if __name__ == "__main__":
    asyncio.run(main())
