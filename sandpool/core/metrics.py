"""Rollout outcomes, pool counters and the run report (text and JSON with the same fields)."""

from __future__ import annotations

import enum
import statistics
from pathlib import Path

from pydantic import BaseModel, Field, computed_field

from sandpool.core.rate import RateTrace

__all__ = [
    "ClusterStats",
    "Outcome",
    "PoolCounters",
    "RejectedTask",
    "Report",
    "RewardSummary",
    "RolloutResult",
    "TTFCStats",
    "Workload",
]


class Outcome(str, enum.Enum):
    """How a rollout ended; every rollout ends as exactly one of these.

    After every run, requested rollouts = completed + infra_failed + task_failed + rejected
    (see :attr:`Report.unaccounted`). Which one an error gives is decided by
    :func:`sandpool.core.classify.classify`.
    """

    COMPLETED = "completed"  #: ran to the end and was graded
    INFRA_FAILED = "infra_failed"  #: infrastructure failed after all retries; never a reward
    TASK_FAILED = "task_failed"  #: the policy's own error or its command's timeout
    REJECTED = "rejected"  #: the task could not run at all (bad row, base commit, image); never a reward


class RolloutResult(BaseModel):
    """One rollout's end state.

    Attributes:
        task_id: The task's ``instance_id``.
        rollout: Index of this rollout among the task's rollouts (0-based).
        outcome: See :class:`Outcome`.
        reward: 1.0/0.0 for ``completed`` and ``task_failed``; ``None`` for ``infra_failed``
            and ``rejected``.
        attempts: Claims made (1 + infra retries).
        ttfc_s: Time to first command of the attempt that finished, in seconds.
        duration_s: Wall time of the whole rollout including retries, in seconds.
        error_kind: ``SandpoolError.kind`` of the last error, if any.
        error: Its message.
        policy: Name of the policy that acted.
        sandbox_id: The sandbox of the last attempt.
        row: 1-based row of the task in its tasks file, when known (kept for rejected rows).
        recoveries: Times the episode's sandbox failed and the episode went on in one
            restored from its last checkpoint (``checkpoint="step"``).
    """

    task_id: str
    rollout: int = 0
    outcome: Outcome
    reward: float | None = None
    attempts: int = 1
    ttfc_s: float | None = None
    duration_s: float = 0.0
    error_kind: str | None = None
    error: str | None = None
    policy: str | None = None
    sandbox_id: str | None = None
    row: int | None = None
    recoveries: int = 0


class TTFCStats(BaseModel):
    """Time-to-first-command statistics, in seconds (``max`` is what stalls a synchronous batch)."""

    n: int = 0
    mean_s: float | None = None
    p50_s: float | None = None
    p95_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None

    @classmethod
    def from_samples(cls, samples: list[float]) -> TTFCStats:
        """Compute the statistics of ``samples`` (seconds); empty input gives ``n=0``."""
        if not samples:
            return cls()
        if len(samples) == 1:
            q = [samples[0]] * 99
        else:
            q = statistics.quantiles(samples, n=100, method="inclusive")
        return cls(n=len(samples), mean_s=statistics.fmean(samples), p50_s=q[49], p95_s=q[94],
                   p99_s=q[98], max_s=max(samples))


class PoolCounters(BaseModel):
    """Counters a pool keeps over its life.

    Attributes:
        claims: Claims served: each returned a lease (one rejected at its checkout did
            not), and each sandbox :meth:`Lease.reset <sandpool.core.pool.Lease.reset>`
            swapped in.
        warm_hits: Of ``claims``, those a sandbox already idle served (never more than
            ``claims``).
        created: Sandboxes started.
        create_failures: Sandbox starts that failed.
        deleted: Sandboxes deleted.
        evicted: Idle sandboxes deleted to make room for another image.
        resets: In-place resets that passed verification.
        quarantines: Sandboxes that failed reset verification and were removed.
        lost: Sandboxes found dead while idle.
        reset_total_s: Seconds spent in in-place resets and their verification, summed.
        reset_max_s: The slowest in-place reset, in seconds.
        infra_errors: Infra errors seen by leases and creations, by ``SandpoolError.kind``.
        quarantine_reasons: Last reasons for quarantine (bounded list).
        recoveries: Episodes that went on in a sandbox restored from their last checkpoint
            after theirs failed (see :mod:`sandpool.core.checkpoint`).
    """

    claims: int = 0
    warm_hits: int = 0
    created: int = 0
    create_failures: int = 0
    deleted: int = 0
    evicted: int = 0
    resets: int = 0
    quarantines: int = 0
    lost: int = 0
    reset_total_s: float = 0.0
    reset_max_s: float = 0.0
    infra_errors: dict[str, int] = Field(default_factory=dict)
    quarantine_reasons: list[str] = Field(default_factory=list)
    recoveries: int = 0

    def reset_time(self, seconds: float) -> None:
        """Record the duration of one in-place reset attempt."""
        self.reset_total_s += seconds
        self.reset_max_s = max(self.reset_max_s, seconds)

    def infra_error(self, kind: str) -> None:
        """Count one infra error of ``kind``."""
        self.infra_errors[kind] = self.infra_errors.get(kind, 0) + 1


class Workload(BaseModel):
    """What a run was asked to do."""

    tasks: int
    images: int
    rollouts: int
    concurrency: int
    backend: str
    strategy: str
    policies: list[str] = Field(default_factory=list)


class RewardSummary(BaseModel):
    """Reward over scored rollouts (``completed`` and ``task_failed``; never ``infra_failed``
    or ``rejected``)."""

    scored: int = 0
    mean: float | None = None
    resolved: int = 0
    by_policy: dict[str, dict[str, float]] = Field(default_factory=dict)

    @classmethod
    def from_results(cls, results: list[RolloutResult]) -> RewardSummary:
        """Summarise the rewards of ``results``; infra failures are excluded by construction."""
        scored = [r for r in results if r.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED)
                  and r.reward is not None]
        by: dict[str, list[float]] = {}
        for r in scored:
            by.setdefault(r.policy or "-", []).append(r.reward or 0.0)
        return cls(
            scored=len(scored),
            mean=statistics.fmean([r.reward or 0.0 for r in scored]) if scored else None,
            resolved=sum(1 for r in scored if r.reward == 1.0),
            by_policy={k: {"n": len(v), "mean": statistics.fmean(v), "resolved": sum(x == 1.0 for x in v)}
                       for k, v in sorted(by.items())},
        )


class RejectedTask(BaseModel):
    """A task that was not run because its input was wrong (kept and reported, not dropped).

    Attributes:
        task_id: The row's ``instance_id`` when it has one.
        row: 1-based row number in the tasks file, when known.
        reason: What is wrong and the fix.
    """

    task_id: str | None
    row: int | None = None
    reason: str

    def describe(self) -> str:
        """One line naming the row and task once: ``row 4 (calc-ghost): <reason>``; the reason
        alone when it starts with its row already (as a task loader's errors do)."""
        where = " ".join(filter(None, (f"row {self.row}" if self.row is not None else "",
                                       f"({self.task_id})" if self.task_id and self.row is not None
                                       else self.task_id or "")))
        if not where or (self.row is not None and self.reason.startswith(f"row {self.row}")):
            return self.reason
        return f"{where}: {self.reason}"


class ClusterStats(BaseModel):
    """One cluster of a pool over several (:mod:`sandpool.core.backends.multi`).

    Attributes:
        cluster: Its name.
        capacity: Its placement weight.
        created: Sandboxes created on it.
        live: Its sandboxes not deleted yet.
        failed_creates: Creations on it that failed.
        failovers: Of those, creations placed on another cluster because it was unreachable.
        lost: Its sandboxes found dead when deleted (a rollout on one fails as infra and is
            retried, on another cluster once this one is down).
        down: Why it went down, if it did.
        down_at_s: When, in seconds after the backend was made.
    """

    cluster: str
    capacity: float = 1.0
    created: int = 0
    live: int = 0
    failed_creates: int = 0
    failovers: int = 0
    lost: int = 0
    down: str | None = None
    down_at_s: float | None = None

    def describe(self) -> str:
        """One line: what was placed there and whether it went down."""
        line = (f"{self.cluster}: created {self.created}, lost {self.lost}, failed "
                f"{self.failed_creates}, live {self.live}")
        if self.down is not None:
            line += (f"; DOWN at {self.down_at_s or 0:.0f} s, {self.failovers} creations failed "
                     f"over ({self.down})")
        return line


class Report(BaseModel):
    """The report every run and benchmark writes, as text and as JSON with the same fields.

    ``failures`` counts every outcome, ``rejected`` included; ``workload.rollouts`` is what the
    run was asked for, so ``unaccounted`` (requested minus the sum of ``failures``) is 0 after
    a run that lost nothing. ``write_rates`` is each cluster's write rate over the run, and
    ``clusters`` what a pool over several clusters placed on each.
    """

    workload: Workload
    ttfc: TTFCStats
    sandboxes_created: int
    api_writes: int
    api_execs: int = 0
    resets: int
    quarantines: int
    failures: dict[str, int]
    infra_errors_by_kind: dict[str, int]
    reward: RewardSummary
    wall_time_s: float
    pool: PoolCounters
    rejected: list[RejectedTask] = Field(default_factory=list)
    rollouts: list[RolloutResult] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    write_rates: list[RateTrace] = Field(default_factory=list)
    clusters: list[ClusterStats] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reuse(self) -> float | None:
        """Claims served per sandbox created (rollouts per sandbox; None before any)."""
        return self.pool.claims / self.sandboxes_created if self.sandboxes_created else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def unaccounted(self) -> int:
        """Requested rollouts (``workload.rollouts``) minus those accounted for in ``failures``:
        0 when nothing was lost or doubled, negative when something was counted twice."""
        return self.workload.rollouts - sum(self.failures.values())

    def render_text(self) -> str:
        """Render the report as aligned plain text (the same fields as the JSON)."""
        w, t = self.workload, self.ttfc

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1000:.1f} ms"

        lines = [
            "sandpool report",
            f"  workload     {w.tasks} tasks, {w.images} images, {w.rollouts} rollouts, "
            f"concurrency {w.concurrency}, backend {w.backend}, strategy {w.strategy}"
            + (f", policies {','.join(w.policies)}" if w.policies else ""),
            f"  TTFC         n={t.n} mean {ms(t.mean_s)}  p50 {ms(t.p50_s)}  p95 {ms(t.p95_s)}  "
            f"p99 {ms(t.p99_s)}  max {ms(t.max_s)}",
            f"  sandboxes    created {self.sandboxes_created}, warm hits {self.pool.warm_hits}/"
            f"{self.pool.claims} claims, evicted {self.pool.evicted}, lost {self.pool.lost}"
            + (f", {self.reuse:.2f} rollouts per sandbox" if self.reuse is not None else ""),
            f"  k8s writes   {self.api_writes}, exec streams {self.api_execs}",
            *(f"  write rate   {r.describe()}" for r in self.write_rates),
            *(f"  cluster      {c.describe()}" for c in self.clusters),
            f"  resets       {self.resets} ok, {self.quarantines} quarantined"
            + (f" (mean {ms(self.pool.reset_total_s / n_resets)}, max {ms(self.pool.reset_max_s)})"
               if (n_resets := self.resets + self.quarantines) else ""),
            *([f"  recoveries   {self.pool.recoveries} (episodes resumed from a checkpoint)"]
              if self.pool.recoveries else []),
            "  outcomes     " + ", ".join(f"{k} {v}" for k, v in self.failures.items())
            + f" = {sum(self.failures.values())} of {w.rollouts} requested"
            + (f" (UNACCOUNTED {self.unaccounted})" if self.unaccounted else ""),
            "  infra errors " + (", ".join(f"{k} {v}" for k, v in sorted(self.infra_errors_by_kind.items())) or "none"),
            f"  reward       mean {'-' if self.reward.mean is None else f'{self.reward.mean:.3f}'} over "
            f"{self.reward.scored} scored, {self.reward.resolved} resolved",
        ]
        # A caller that names no policy (Gymnasium, NeMo Gym) gets no breakdown repeating the mean.
        for pol, s in self.reward.by_policy.items() if list(self.reward.by_policy) != ["-"] else ():
            lines.append(f"    {pol:<10} n={int(s['n'])} mean {s['mean']:.3f} resolved {int(s['resolved'])}")
        if self.rejected:
            lines.append(f"  rejected     {len(self.rejected)} tasks (input errors):")
            lines += [f"    {r.describe()}" for r in self.rejected[:10]]
        lines += [f"  warning      {w}" for w in self.warnings]
        lines.append(f"  wall time    {self.wall_time_s:.1f} s")
        return "\n".join(lines)

    def write(self, directory: Path | str, stem: str = "report") -> tuple[Path, Path]:
        """Write ``<stem>.json`` and ``<stem>.txt`` into ``directory``; return both paths."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        js, txt = d / f"{stem}.json", d / f"{stem}.txt"
        js.write_text(self.model_dump_json(indent=2))
        txt.write_text(self.render_text() + "\n")
        return js, txt
