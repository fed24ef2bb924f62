"""The run report of a pool: :func:`build_report`, from its counters, its TTFC samples and its
backend's control-plane figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandpool.core.metrics import (
    Outcome,
    RejectedTask,
    Report,
    RewardSummary,
    RolloutResult,
    TTFCStats,
    Workload,
)

if TYPE_CHECKING:
    from sandpool.core.pool.pool import SandboxPool

__all__ = ["build_report"]


def build_report(
    pool: SandboxPool,
    workload: Workload,
    results: list[RolloutResult],
    wall_time_s: float,
    rejected: list[RejectedTask] | None = None,
) -> Report:
    """:meth:`SandboxPool.report <sandpool.core.pool.SandboxPool.report>`: the run
    :class:`Report` from ``pool``'s counters and ``results`` (``wall_time_s`` in seconds)."""
    failures = {o.value: 0 for o in Outcome}
    for r in results:
        failures[r.outcome.value] += 1
    return Report(
        workload=workload,
        ttfc=TTFCStats.from_samples(pool._ttfc),
        sandboxes_created=pool.counters.created,
        api_writes=pool.backend.api_writes,
        api_execs=pool.backend.api_execs,
        resets=pool.counters.resets,
        quarantines=pool.counters.quarantines,
        failures=failures,
        infra_errors_by_kind=dict(pool.counters.infra_errors),
        reward=RewardSummary.from_results(results),
        wall_time_s=wall_time_s,
        pool=pool.counters.model_copy(deep=True),
        rejected=rejected or [],
        rollouts=results,
        write_rates=[r.trace() for r in pool.backend.write_rates.values()],
        clusters=pool.backend.cluster_stats,
    )
