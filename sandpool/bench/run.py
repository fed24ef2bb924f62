"""``sandpool bench`` on the local backend: sandpool's strategies and the Docker baselines, one
run, one workload, one concurrency, side by side.

Each strategy in turn runs every task ``rollouts`` times (:mod:`sandpool.bench.workload`):
sandpool's ``cold``, ``warm`` and ``reuse`` through :func:`sandpool.envs.runner.run_batch` on
the local backend, ``docker-run`` and ``docker-exec`` in containers of a Docker daemon the
bench starts for them and stops after (:mod:`sandpool.bench.containers`), on the same OCI
images. Host CPU is metered per strategy (:mod:`sandpool.bench.cpu`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from sandpool.bench.containers import MODES, run_containers
from sandpool.bench.cpu import CpuMeter
from sandpool.bench.report import BenchReport, StrategyResult, load_now
from sandpool.bench.workload import BenchTasks, Probed, Probes, load_bench_tasks, policies
from sandpool.core.base import ResourceLimits
from sandpool.core.errors import ConfigError

__all__ = ["SANDPOOL_STRATEGIES", "BenchConfig", "run_local"]

SANDPOOL_STRATEGIES = ("cold", "warm", "reuse")


def _own_cpu() -> float:
    """CPU seconds this process (every thread) has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class BenchConfig(BaseModel):
    """What ``sandpool bench`` runs.

    Usage: ``BenchConfig(strategies=("cold", "warm", "reuse", "docker-run"), tasks="oci")``.

    Attributes:
        backend: ``local`` or ``kubernetes``.
        strategies: In run order; local: ``cold``, ``warm``, ``reuse``, ``docker-run``,
            ``docker-exec``; Kubernetes: ``pods``, ``warm``, ``reuse``.
        tasks: ``oci``, ``default`` or a task file (see :mod:`sandpool.bench.workload`).
        limit: Tasks (spread over their images).
        rollouts: Rollouts per task.
        concurrency: Rollouts at once, the same for every strategy.
        grade_timeout: Seconds each grading test run may take.
        out: Directory for the reports.
        kubeconfig: Kubernetes: the cluster's kubeconfig (default: ``$KUBECONFIG``,
            ``~/.kube/config``).
    """

    backend: Literal["local", "kubernetes"] = "local"
    strategies: tuple[str, ...] = (*SANDPOOL_STRATEGIES, *MODES)
    tasks: str = "oci"
    limit: int = Field(8, ge=1)
    rollouts: int = Field(4, ge=1)
    concurrency: int = Field(8, ge=1)
    grade_timeout: float = Field(300.0, gt=0)
    out: Path = Path("reports/bench")
    kubeconfig: Path | None = None

    @field_validator("strategies")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("give at least one strategy")
        if len(set(value)) != len(value):
            raise ValueError(f"a strategy is named twice in {','.join(value)}")
        return value


async def _sandpool(name: str, bt: BenchTasks, cfg: BenchConfig, meter: CpuMeter) -> StrategyResult:
    from sandpool.core.backends.local import LocalBackend
    from sandpool.envs.runner import run_batch

    probes = Probes()
    backend = LocalBackend(store=bt.store) if bt.store is not None else LocalBackend()
    load0, cpu0, dock0, own0 = load_now()[0], meter.read(), meter.read("docker"), _own_cpu()
    report = await run_batch(bt.tasks, [Probed(p, probes) for p in policies()], backend,
                             rollouts_per_task=cfg.rollouts, concurrency=cfg.concurrency, strategy=name,
                             grade_timeout=cfg.grade_timeout)
    cpu1, dock1 = meter.read(), meter.read("docker")
    cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) - ((dock1 or 0) - (dock0 or 0))
    return StrategyResult.from_results(
        name, report.rollouts, probes, sandboxes_created=report.sandboxes_created, resets=report.resets,
        quarantines=report.quarantines, wall_s=report.wall_time_s, cpu_s=cpu,
        cpu_client_s=_own_cpu() - own0, load=(load0, load_now()[0]), report=report)


async def _docker(mode: str, bt: BenchTasks, cfg: BenchConfig, daemon, meter: CpuMeter) -> StrategyResult:
    load0, cpu0, own0 = load_now()[0], meter.read(), _own_cpu()
    client = daemon.client()
    try:
        results, probes, created, wall = await asyncio.to_thread(
            run_containers, client, mode, bt.tasks, rollouts=cfg.rollouts, concurrency=cfg.concurrency,
            limits=ResourceLimits(), grade_timeout=cfg.grade_timeout)
    finally:
        client.close()
    cpu1 = meter.read()
    return StrategyResult.from_results(
        mode, results, probes, sandboxes_created=created,
        wall_s=wall, cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        cpu_client_s=_own_cpu() - own0, load=(load0, load_now()[0]))


def _load_images(daemon, bt: BenchTasks) -> None:
    """Put every task image into the daemon under its own name (skopeo once per digest, then tags)."""
    first: dict[str, str] = {}
    for image in bt.images:
        source, digest = bt.oci_source(image)
        if digest in first:
            daemon.tag(first[digest], image)
        else:
            daemon.load(source, image)
            first[digest] = image


async def run_local(cfg: BenchConfig, *, say: Callable[[str], None] = print) -> BenchReport:
    """Run ``cfg`` on the local backend and return the report (also written to ``cfg.out``).

    Raises:
        ConfigError: A strategy is unknown, or a Docker strategy was asked for on tasks whose
            images are image directories.
        BackendUnavailable: bubblewrap or docker.io is missing.
    """
    unknown = [s for s in cfg.strategies if s not in (*SANDPOOL_STRATEGIES, *MODES)]
    if unknown:
        raise ConfigError(f"--strategies: {','.join(unknown)} not known on the local backend; pick from "
                          f"{','.join((*SANDPOOL_STRATEGIES, *MODES))}")
    bt = await load_bench_tasks(cfg.tasks, cfg.limit)
    from sandpool.envs.grading.harness import plan_for

    for t in bt.tasks:  # the harness rules load once here (swebench's import takes seconds),
        plan_for(t)     # not inside the first strategy's first grading
    docker_modes = [s for s in cfg.strategies if s in MODES]
    for image in bt.images if docker_modes else []:
        bt.oci_source(image)  # fail before anything runs
    title = (f"sandpool bench, local backend: {len(bt.tasks)} tasks ({cfg.tasks}) x {cfg.rollouts} rollouts, "
             f"{len(bt.images)} images, concurrency {cfg.concurrency}")
    report = BenchReport(title=title, machine={"cpus": os.cpu_count(),
                                               "load_start": [round(x, 1) for x in load_now()]})
    with contextlib.ExitStack() as stack:
        meter = stack.enter_context(CpuMeter())
        if not meter.available:
            report.notes.append(meter.why_not)
        daemon = None
        for name in cfg.strategies:
            t0 = time.monotonic()
            if name in MODES:
                if daemon is None:
                    from sandpool.bench.docker import DockerDaemon

                    daemon = DockerDaemon(cgroup_parent=meter.docker_parent if meter.available else None)
                    await asyncio.to_thread(daemon.start)
                    stack.callback(daemon.stop)
                    await asyncio.to_thread(_load_images, daemon, bt)
                    say(f"docker: daemon up, {len(bt.images)} images loaded in {time.monotonic() - t0:.0f} s")
                result = await _docker(name, bt, cfg, daemon, meter)
            else:
                result = await _sandpool(name, bt, cfg, meter)
            report.results[name] = result
            say(f"{name}: {result.completed}/{result.rollouts} completed in {result.wall_s:.1f} s "
                f"(load {result.load[0]:.1f} -> {result.load[1]:.1f})")
    report.machine["load_end"] = [round(x, 1) for x in load_now()]
    report.check_targets(cfg.concurrency)
    return report
