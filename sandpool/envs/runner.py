"""Run N tasks x k rollouts on a pool and report: the main job behind ``sandpool run``.

Rollouts are scheduled in lanes per image: the strategy splits the concurrency across images,
and each lane runs its image's rollouts back to back, so a reused sandbox goes straight to the
next rollout of its own image. Every result is appended to ``results_path`` as it lands, so a
run killed with SIGKILL keeps what it finished and ``resume=True`` continues from there.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from sandpool.core.base import Backend
from sandpool.core.metrics import RejectedTask, Report, RolloutResult, Workload
from sandpool.core.pool import Lease, PoolLimits, SandboxPool
from sandpool.core.rollout import run_rollout
from sandpool.core.strategies import Strategy, get_strategy
from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.envs.policies import Policy

__all__ = ["run_batch"]


async def run_batch(
    tasks: Sequence[Task],
    policies: Sequence[Policy],
    backend: Backend,
    *,
    rollouts_per_task: int = 4,
    concurrency: int = 8,
    strategy: str | Strategy = "reuse",
    limits: PoolLimits = PoolLimits(),
    retries: int = 2,
    grade_timeout: float = 300.0,
    results_path: Path | None = None,
    resume: bool = False,
    rejected: list[RejectedTask] | None = None,
    on_result: Callable[[RolloutResult], None] | None = None,
) -> Report:
    """Run every task ``rollouts_per_task`` times and return the report.

    Rollout ``i`` of a task uses ``policies[i % len(policies)]``. Tasks whose image is missing
    are rejected (kept in the report), not run.

    Args:
        tasks: The tasks.
        policies: At least one policy.
        backend: Where sandboxes run; the pool closes it at the end.
        rollouts_per_task: k, rollouts per task.
        concurrency: Rollouts at once.
        strategy: ``cold``, ``warm``, ``reuse`` or a :class:`Strategy`.
        limits: Pool limits.
        retries: Infra retries per rollout.
        grade_timeout: Seconds for the grading test run.
        results_path: JSONL file each result is appended to as it completes.
        resume: Skip rollouts already in ``results_path`` and include them in the report.
        rejected: Tasks rejected before the run (bad rows), carried into the report.
        on_result: Called with every result as it completes (progress bars).

    Returns:
        The :class:`Report` (``rollouts`` holds every result, in completion order).

    Raises:
        BackendUnavailable: The backend cannot run here.
        ValueError: No policy given.
    """
    if not policies:
        raise ValueError("run_batch needs at least one policy")
    strat = get_strategy(strategy)
    rejected = list(rejected or [])
    results: list[RolloutResult] = []
    done: set[tuple[str, int]] = set()
    if resume and results_path is not None and results_path.exists():
        for line in results_path.read_text().splitlines():
            if line.strip():
                r = RolloutResult.model_validate_json(line)
                results.append(r)
                done.add((r.task_id, r.rollout))
    t0 = time.monotonic()
    async with SandboxPool(backend, strat, limits) as pool:
        runnable: list[Task] = []
        for task in tasks:
            try:
                await pool.hydrate(task.image)
                runnable.append(task)
            except Exception as exc:  # noqa: BLE001 - an input error of one task is kept, not fatal
                rejected.append(RejectedTask(task_id=task.instance_id, reason=str(exc)))
        lanes: dict[str, deque[tuple[Task, int]]] = {}
        for task in runnable:
            for i in range(rollouts_per_task):
                if (task.instance_id, i) not in done:
                    lanes.setdefault(task.image, deque()).append((task, i))
        todo = [t for t in runnable
                if any((t.instance_id, i) not in done for i in range(rollouts_per_task))]
        slots = await pool.prepare(todo, concurrency, rollouts_per_task=rollouts_per_task)
        gate = asyncio.Semaphore(concurrency)
        sink = results_path.open("a") if results_path is not None else None

        def episode_for(task: Task, policy: Policy):
            async def episode(lease: Lease) -> float:
                await policy.act(lease, task)
                return (await grade(lease, task, timeout=grade_timeout)).reward
            return episode

        async def lane(queue: deque[tuple[Task, int]]) -> None:
            async with gate:
                while queue:
                    task, i = queue.popleft()
                    policy = policies[i % len(policies)]
                    result = await run_rollout(pool, task, episode_for(task, policy), rollout=i,
                                               retries=retries, policy=policy.name)
                    results.append(result)
                    if sink is not None:
                        sink.write(result.model_dump_json() + "\n")
                        sink.flush()
                    if on_result is not None:
                        on_result(result)

        try:
            await asyncio.gather(*(lane(q) for image, q in lanes.items()
                                   for _ in range(slots.get(image, 1))))
        finally:
            if sink is not None:
                sink.close()
        workload = Workload(tasks=len(tasks), images=len({t.image for t in tasks}),
                            rollouts=len(tasks) * rollouts_per_task, concurrency=concurrency,
                            backend=backend.name, strategy=strat.name,
                            policies=sorted({p.name for p in policies}))
        return pool.report(workload, results, time.monotonic() - t0, rejected)
