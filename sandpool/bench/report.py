"""What a benchmark reports: one :class:`StrategyResult` per strategy, side by side, with its
baselines and targets, as text, JSON (the same fields) and a TTFC CDF plot."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from sandpool.core.errors import BackendUnavailable
from sandpool.bench.workload import Probes
from sandpool.core.metrics import Report, RolloutResult, TTFCStats

__all__ = ["BenchReport", "StrategyResult", "Target", "load_now"]


def load_now() -> tuple[float, float, float]:
    """The machine's load averages (1, 5, 15 min) now."""
    return os.getloadavg()


class StrategyResult(BaseModel):
    """One strategy's run of the workload.

    Attributes:
        name: ``cold``, ``warm``, ``reuse``, ``docker-run`` or ``docker-exec`` (or a
            Kubernetes mode).
        ttfc: TTFC statistics (seconds).
        ttfc_samples: Every rollout's TTFC (seconds), for the CDF.
        round_trip: Statistics of the first command re-run in the claimed sandbox (seconds).
        claim / first_command: TTFC's two parts (seconds): from the claim request until the
            first command is sent, and that command's own round trip.
        rollouts: Rollouts requested.
        outcomes: Rollouts by outcome (``completed``, ``infra_failed``, ...).
        reward_mean: Mean reward over scored rollouts.
        sandboxes_created: Sandboxes (or containers) started.
        resets / quarantines: In-place resets that passed / failed verification.
        wall_s: Wall time of the strategy's run, start to last rollout, seconds.
        cpu_s: Host CPU seconds of the bench process, its sandboxes and (for Docker) the
            daemon and its containers during the run; None when not measurable.
        cpu_client_s: Of it, the bench process's own (sandpool's host side, or the docker
            SDK client's).
        load: Load averages (1 min) at the start and the end of the run.
        report: sandpool's own run report, for sandpool's strategies.
        extra: Backend-specific figures (Kubernetes API writes, exec streams, ...); scalars are
            table rows, except keys starting with ``_`` (bookkeeping, kept in the JSON).
    """

    name: str
    ttfc: TTFCStats
    ttfc_samples: list[float] = Field(default_factory=list)
    round_trip: TTFCStats = Field(default_factory=TTFCStats)
    claim: TTFCStats = Field(default_factory=TTFCStats)
    first_command: TTFCStats = Field(default_factory=TTFCStats)
    rollouts: int = 0
    outcomes: dict[str, int] = Field(default_factory=dict)
    reward_mean: float | None = None
    sandboxes_created: int = 0
    resets: int = 0
    quarantines: int = 0
    wall_s: float = 0.0
    cpu_s: float | None = None
    cpu_client_s: float | None = None
    load: tuple[float, float] = (0.0, 0.0)
    report: Report | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_results(cls, name: str, results: list[RolloutResult], probes: Probes | None = None,
                     **kw: Any) -> StrategyResult:
        """Build one from per-rollout results (TTFC, outcomes, reward), the workload's
        ``probes`` (round trip, TTFC's parts) and the rest in ``kw``."""
        ttfc = [r.ttfc_s for r in results if r.ttfc_s is not None]
        outcomes: dict[str, int] = {}
        for r in results:
            outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
        scored = [r.reward for r in results if r.reward is not None]
        if probes is not None:
            kw |= {"round_trip": TTFCStats.from_samples(probes.round_trip),
                   "claim": TTFCStats.from_samples(probes.claim),
                   "first_command": TTFCStats.from_samples(probes.first)}
        return cls(name=name, ttfc=TTFCStats.from_samples(ttfc), ttfc_samples=ttfc,
                   rollouts=len(results), outcomes=outcomes,
                   reward_mean=statistics.fmean(scored) if scored else None, **kw)

    @property
    def completed(self) -> int:
        """Rollouts that ran to their grade."""
        return self.outcomes.get("completed", 0)

    @property
    def rollouts_per_min(self) -> float | None:
        """Completed rollouts per minute of wall time."""
        return self.completed * 60 / self.wall_s if self.wall_s > 0 else None

    @property
    def cpu_per_rollout(self) -> float | None:
        """Host CPU seconds per requested rollout."""
        return self.cpu_s / self.rollouts if self.cpu_s is not None and self.rollouts else None


class Target(BaseModel):
    """One target: its sentence with the measured figure, and whether it is met."""

    text: str
    met: bool

    def line(self) -> str:
        return f"{'PASS' if self.met else 'MISS'}  {self.text}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


class BenchReport(BaseModel):
    """A benchmark run: the workload, every strategy's result, the targets.

    Attributes:
        title: One line saying what ran (tasks, images, rollouts, concurrency, backend).
        machine: CPUs and load averages when the run started and ended.
        results: By strategy name, in run order.
        targets: The targets checked, with their figures.
        notes: Sentences a reader needs (what was not measurable, and why).
    """

    title: str
    machine: dict[str, Any] = Field(default_factory=dict)
    results: dict[str, StrategyResult] = Field(default_factory=dict)
    targets: list[Target] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    def check_targets(self, concurrency: int) -> None:
        """Fill :attr:`targets` from the strategies present (a target needs both its sides)."""
        r = self.results
        out: list[Target] = []

        def p50(n: str) -> float | None:
            return r[n].ttfc.p50_s if n in r else None

        if "reuse" in r and "docker-run" in r:
            x = _ratio(p50("docker-run"), p50("reuse"))
            out.append(Target(text=f"reuse TTFC p50 {x or 0:.1f}x below docker-run's (target >= 50x)",
                              met=x is not None and x >= 50))
            y = _ratio(r["reuse"].rollouts_per_min, r["docker-run"].rollouts_per_min)
            out.append(Target(text=f"reuse rollouts/min {y or 0:.2f}x docker-run's (target >= 3x)",
                              met=y is not None and y >= 3))
        for name, bound in (("reuse", 1.5), ("warm", 2.0)):
            if name in r and r[name].round_trip.p50_s:
                x = _ratio(p50(name), r[name].round_trip.p50_s)
                out.append(Target(text=f"{name} TTFC p50 {_ms(p50(name))} ms = {x or 0:.2f}x the exec round "
                                       f"trip in a claimed sandbox ({_ms(r[name].round_trip.p50_s)} ms) "
                                       f"(target <= {bound}x)", met=x is not None and x <= bound))
        if "reuse" in r and "cold" in r:
            x = _ratio(r["cold"].ttfc.max_s, r["reuse"].ttfc.max_s)
            out.append(Target(text=f"reuse TTFC max {x or 0:.1f}x below cold max (target >= 10x)",
                              met=x is not None and x >= 10))
        if "reuse" in r and r["reuse"].report is not None:
            n = r["reuse"].sandboxes_created
            out.append(Target(text=f"reuse created {n} sandboxes <= concurrency {concurrency}",
                              met=n <= concurrency))
        self.targets = out

    def table(self) -> str:
        """The side-by-side table (milliseconds for latencies, seconds for CPU and wall time)."""
        rows: list[tuple[str, Any]] = [
            ("TTFC mean (ms)", lambda s: _ms(s.ttfc.mean_s)),
            ("TTFC p50 (ms)", lambda s: _ms(s.ttfc.p50_s)),
            ("TTFC p99 (ms)", lambda s: _ms(s.ttfc.p99_s)),
            ("TTFC max (ms)", lambda s: _ms(s.ttfc.max_s)),
            ("  claim part p50 (ms)", lambda s: _ms(s.claim.p50_s)),
            ("  first command p50 (ms)", lambda s: _ms(s.first_command.p50_s)),
            ("exec round trip p50 (ms)", lambda s: _ms(s.round_trip.p50_s)),
            ("exec round trip max (ms)", lambda s: _ms(s.round_trip.max_s)),
            ("TTFC p50 / round trip", lambda s: "-" if (x := _ratio(s.ttfc.p50_s, s.round_trip.p50_s))
             is None else f"{x:.2f}x"),
            ("rollouts / min", lambda s: "-" if s.rollouts_per_min is None else f"{s.rollouts_per_min:.1f}"),
            ("host CPU-s / rollout", lambda s: "-" if s.cpu_per_rollout is None else f"{s.cpu_per_rollout:.2f}"),
            ("  of which bench process", lambda s: "-" if s.cpu_client_s is None or not s.rollouts
             else f"{s.cpu_client_s / s.rollouts:.2f}"),
            ("sandboxes created", lambda s: str(s.sandboxes_created)),
            ("resets / quarantines", lambda s: f"{s.resets} / {s.quarantines}"),
            ("completed/infra/task/rej", lambda s: "/".join(str(s.outcomes.get(k, 0)) for k in
                                                           ("completed", "infra_failed", "task_failed",
                                                            "rejected"))),
            ("reward mean", lambda s: "-" if s.reward_mean is None else f"{s.reward_mean:.3f}"),
            ("wall time (s)", lambda s: f"{s.wall_s:.1f}"),
            ("load avg 1m start/end", lambda s: f"{s.load[0]:.1f}/{s.load[1]:.1f}"),
        ]
        extra_keys = list(dict.fromkeys(k for s in self.results.values() for k in s.extra
                                        if not k.startswith("_") and not isinstance(s.extra[k], (list, dict))))
        rows += [(k, lambda s, k=k: str(s.extra.get(k, "-"))) for k in extra_keys]
        names = list(self.results)
        # A row no strategy has a figure for (host CPU on a cluster that is not this machine's).
        rows = [(label, fn) for label, fn in rows if any(fn(self.results[n]) != "-" for n in names)]
        width = max(12, *(len(n) + 2 for n in names))
        lines = [f"{'':<26}" + "".join(f"{n:>{width}}" for n in names)]
        lines += [f"{label:<26}" + "".join(f"{fn(self.results[n]):>{width}}" for n in names)
                  for label, fn in rows]
        return "\n".join(lines)

    def render_text(self) -> str:
        """The title, the machine, the table, the targets and the notes, as plain text."""
        m = self.machine
        head = [self.title,
                f"machine: {m.get('cpus')} CPUs, load avg (1/5/15 min) {m.get('load_start')} at start, "
                f"{m.get('load_end')} at end"]
        return "\n".join([*head, self.table(), "", *(t.line() for t in self.targets),
                          *([""] + self.notes if self.notes else [])])

    def write(self, out: Path, stem: str) -> list[Path]:
        """Write ``<stem>.txt``, ``<stem>.json`` and ``<stem>_ttfc_cdf.png`` into ``out``, and
        ``<stem>_timeline.png`` when the results carry a timeline (Kubernetes)."""
        out.mkdir(parents=True, exist_ok=True)
        txt, js, png = out / f"{stem}.txt", out / f"{stem}.json", out / f"{stem}_ttfc_cdf.png"
        txt.write_text(self.render_text() + "\n")
        js.write_text(self.model_dump_json(indent=1))
        ttfc_cdf({n: s.ttfc_samples for n, s in self.results.items()}, png, f"TTFC CDF: {self.title}")
        paths = [txt, js, png]
        if any(s.extra.get("timeline") for s in self.results.values()):
            timeline_plot(self, out / f"{stem}_timeline.png")
            paths.append(out / f"{stem}_timeline.png")
        return paths


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BackendUnavailable("the plots need matplotlib: pip install 'sandpool[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttfc_cdf(samples: dict[str, list[float]], path: Path, title: str) -> None:
    """Draw the CDF of per-rollout TTFC (log-scale milliseconds), one line per strategy.

    Raises:
        BackendUnavailable: matplotlib is not installed.
    """
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, s in samples.items():
        xs = sorted(x * 1000 for x in s)
        if xs:
            p50 = (TTFCStats.from_samples(list(s)).p50_s or 0) * 1000  # as the table gives it
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{name} (p50 {p50:.0f} ms, max {xs[-1]:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first command (ms, log scale)")
    ax.set_ylabel("fraction of rollouts")
    ax.set_title(title, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline_plot(report: BenchReport, path: Path) -> None:
    """Draw each mode's timeline (pods by phase, and any series its cluster adds) to ``path``."""
    plt = _pyplot()

    runs = list(report.results.items())
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 * max(1, len(runs))), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs, strict=True):
        points = sorted(r.extra.get("timeline", []), key=lambda p: p[0])
        keys = sorted({k for _, s in points for k in s})
        for k in keys:
            ts = [t - r.extra.get("_t0", 0) for t, s in points if k in s]
            ax.step(ts, [s[k] for _, s in points if k in s], where="post", label=k)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("seconds since the mode started")
        if keys:
            ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"timeline: {report.title}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
