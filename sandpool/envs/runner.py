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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from sandpool.core import errors
from sandpool.core.base import Backend
from sandpool.core.metrics import Outcome, RejectedTask, Report, RolloutResult, Workload
from sandpool.core.pool import Lease, PoolLimits, SandboxPool
from sandpool.core.outcome import repeat_result, unrun_result
from sandpool.core.rollout import Grader, run_rollout
from sandpool.core.strategies import Strategy, get_strategy
from sandpool.core.task import Task
from sandpool.core.telemetry import PoolMetrics
from sandpool.envs.policies import Policy
from sandpool.envs.scoring import default_grader

__all__ = ["read_journal", "run_batch"]


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
    grader: Grader | None = None,
    results_path: Path | None = None,
    resume: bool = False,
    rejected: list[RejectedTask] | None = None,
    rows: Mapping[str, int] | None = None,
    on_result: Callable[[RolloutResult], None] | None = None,
    metrics: PoolMetrics | CollectorRegistry | bool | None = None,
) -> Report:
    """Run every task ``rollouts_per_task`` times and return the report.

    Rollout ``i`` of a task uses ``policies[i % len(policies)]``; the rollout accountant
    (:func:`~sandpool.core.rollout.run_rollout`) grades it and decides its end. Every requested
    rollout ends as exactly one result (``completed``, ``infra_failed``, ``task_failed`` or
    ``rejected``): a task whose row was bad,
    whose image is missing or whose base commit is not in its image is rejected with its
    reason, each of its rollouts counted as ``rejected``, and the batch goes on. So after the
    run ``report.unaccounted == 0``.

    Args:
        tasks: The valid tasks.
        policies: At least one policy.
        backend: Where sandboxes run; the pool closes it at the end.
        rollouts_per_task: k, rollouts per task.
        concurrency: Rollouts at once.
        strategy: ``cold``, ``warm``, ``reuse`` or a :class:`Strategy`.
        limits: Pool limits.
        retries: Infra retries per rollout.
        grade_timeout: Seconds for the grading test run (of the default grader).
        grader: The grader (default :func:`sandpool.envs.scoring.default_grader`).
        results_path: JSONL journal each result is appended to as it completes.
        resume: Keep the results already in ``results_path`` and run only the missing
            rollouts. Journaled results this run does not request (other tasks, rollout
            indexes from ``rollouts_per_task`` on) stay in the file but are not counted, and
            ``report.warnings`` says how many. A torn or malformed line (a run killed
            mid-write) is dropped, kept in ``<results_path>.torn`` and named in
            ``report.warnings``.
        rejected: Rows rejected before the run (bad rows): each counts as ``rollouts_per_task``
            rejected rollouts, and as a task of the workload.
        rows: 1-based row number of each task id in its tasks file, for the report.
        on_result: Called with every result as it lands, resumed ones included (progress bars).
        metrics: Prometheus series for the pool (see :class:`~sandpool.core.pool.SandboxPool`);
            every result of this run, rejected ones included, counts once in
            ``sandpool_rollouts_total`` (resumed results do not: they ran before).

    Returns:
        The :class:`Report` (``rollouts`` holds every result, in completion order).

    Raises:
        FatalError: The backend cannot run here (``BackendUnavailable``) or the pool closed.
        ValueError: No policy given.
    """
    if not policies:
        raise ValueError("run_batch needs at least one policy")
    strat = get_strategy(strategy)
    rows = dict(rows or {})
    rejected = list(rejected or [])
    k = rollouts_per_task
    results: list[RolloutResult] = []
    warnings: list[str] = []
    done: set[tuple[str, int]] = set()
    if resume and results_path is not None and results_path.exists():
        # Only what this run requests counts: a journal of a run of another shape (other
        # tasks, more rollouts) must not inflate the report past what was asked for.
        requested = ({t.instance_id for t in tasks} | {rt.task_id for rt in rejected if rt.task_id}
                     | {f"<row {rt.row}>" for rt in rejected})
        outside: list[RolloutResult] = []
        for r in read_journal(results_path, warnings):
            if r.task_id not in requested or r.rollout >= k:
                outside.append(r)
                continue
            results.append(r)
            done.add((r.task_id, r.rollout))
        if outside:
            warnings.append(
                f"{results_path.name}: {len(outside)} journaled result(s) are not part of this run "
                f"(e.g. rollout {outside[0].rollout} of {outside[0].task_id}: another task, or a "
                f"rollout index beyond --rollouts {k}); kept in the file, not counted")
    sink = results_path.open("a") if results_path is not None else None
    grader = grader or default_grader(grade_timeout)

    def land(result: RolloutResult) -> None:
        results.append(result)
        done.add((result.task_id, result.rollout))
        if sink is not None:
            sink.write(result.model_dump_json() + "\n")
            sink.flush()
        if on_result is not None:
            on_result(result)

    if on_result is not None:
        for r in results:
            on_result(r)
    t0 = time.monotonic()
    try:
        pre_rejected = len(rejected)
        async with SandboxPool(backend, strat, limits, metrics=metrics) as pool:
            tel = pool.telemetry
            valid = {t.instance_id for t in tasks}
            for rt in list(rejected):  # a bad row's id may repeat a valid row's: never mix their rollouts
                tid = rt.task_id if rt.task_id and rt.task_id not in valid else f"<row {rt.row}>"
                valid.add(tid)
                bad_row = errors.TaskValidationError(rt.reason, row=rt.row)
                for i in range(k):
                    if (tid, i) not in done:
                        land(unrun_result(tid, bad_row, rollout=i, row=rt.row, telemetry=tel))
            runnable: list[Task] = []
            for task in tasks:
                try:
                    await pool.hydrate(task.image)
                    runnable.append(task)
                except Exception as exc:  # noqa: BLE001 - the accountant places it (fatal re-raised)
                    row = rows.get(task.instance_id)
                    if unrun_result(task.instance_id, exc).outcome is Outcome.REJECTED:
                        rejected.append(RejectedTask(task_id=task.instance_id, row=row, reason=str(exc)))
                    for i in range(k):
                        if (task.instance_id, i) not in done:
                            land(unrun_result(task.instance_id, exc, rollout=i, row=row, telemetry=tel))
            lanes: dict[str, deque[tuple[Task, int]]] = {}
            for task in runnable:
                for i in range(k):
                    if (task.instance_id, i) not in done:
                        lanes.setdefault(task.image, deque()).append((task, i))
            todo = [t for t in runnable if any((t.instance_id, i) not in done for i in range(k))]
            slots = await pool.prepare(todo, concurrency, rollouts_per_task=k)
            gate = asyncio.Semaphore(concurrency)
            bad: dict[str, RolloutResult] = {}  # task id -> the rollout that found it unusable

            def episode_for(task: Task, policy: Policy):
                async def episode(lease: Lease) -> None:
                    await policy.act(lease, task)
                return episode

            async def lane(queue: deque[tuple[Task, int]]) -> None:
                async with gate:
                    while queue:
                        task, i = queue.popleft()
                        row = rows.get(task.instance_id)
                        if (first := bad.get(task.instance_id)) is not None:  # rejected already
                            land(repeat_result(first, i, telemetry=tel))
                            continue
                        policy = policies[i % len(policies)]
                        result = await run_rollout(pool, task, episode_for(task, policy), grader=grader,
                                                   rollout=i, retries=retries, policy=policy.name)
                        result = result.model_copy(update={"row": row})
                        if result.outcome is Outcome.REJECTED and task.instance_id not in bad:
                            bad[task.instance_id] = result
                            rejected.append(RejectedTask(task_id=task.instance_id, row=row,
                                                         reason=result.error or "rejected"))
                        land(result)

            await asyncio.gather(*(lane(q) for image, q in lanes.items()
                                   for _ in range(slots.get(image, 1))))
            n_tasks = len(tasks) + pre_rejected
            workload = Workload(tasks=n_tasks, images=len({t.image for t in tasks}),
                                rollouts=n_tasks * k, concurrency=concurrency,
                                backend=backend.name, strategy=strat.name,
                                policies=sorted({p.name for p in policies}))
            report = pool.report(workload, results, time.monotonic() - t0, rejected)
    finally:
        if sink is not None:
            sink.close()
    return report.model_copy(update={"warnings": warnings})


def read_journal(path: Path, warnings: list[str] | None = None) -> list[RolloutResult]:
    """Read a results journal (``rollouts.jsonl``), keeping every good line.

    A line that does not parse (the torn last line of a run killed mid-write, or a corrupted
    one) is dropped and named in ``warnings``; the file is rewritten without it (atomically)
    and the bad text kept in ``<path>.torn``, so later appends start on a clean line. A
    rollout journaled twice is kept once.

    Args:
        path: The journal.
        warnings: Receives one sentence per dropped line.

    Returns:
        The results, in journal order.
    """
    good: list[RolloutResult] = []
    keep: list[str] = []
    torn: list[str] = []
    seen: set[tuple[str, int]] = set()
    raw = path.read_bytes()
    for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            r = RolloutResult.model_validate_json(line)
        except ValidationError as exc:
            torn.append(line)
            if warnings is not None:
                warnings.append(f"{path.name} line {n} dropped (torn or malformed: "
                                f"{exc.errors()[0]['msg']}): {line[:80]!r}")
            continue
        if (r.task_id, r.rollout) in seen:
            if warnings is not None:
                warnings.append(f"{path.name} line {n}: rollout {r.rollout} of {r.task_id} journaled twice; kept once")
            continue
        seen.add((r.task_id, r.rollout))
        good.append(r)
        keep.append(line)
    if torn or not raw.endswith(b"\n") and raw:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(path)
        if torn:
            with path.with_name(path.name + ".torn").open("a") as f:
                f.writelines(x + "\n" for x in torn)
    return good
