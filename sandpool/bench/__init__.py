"""``sandpool bench``: sandpool's strategies measured beside what users run today, in one run.

Usage::

    report = await run_bench(BenchConfig(strategies=("cold", "warm", "reuse", "docker-run")))
    print(report.render_text())
    report.write(Path("reports/bench"), "bench_local")

Modules:

* :mod:`~sandpool.bench.workload`: the tasks and what every rollout does, on every side;
* :mod:`~sandpool.bench.run`: the local backend's run (sandpool's strategies and Docker's);
* :mod:`~sandpool.bench.containers`: the Docker baselines, a container per rollout;
* :mod:`~sandpool.bench.docker`: a Docker daemon of the benchmark's own (Debian's docker.io);
* :mod:`~sandpool.bench.cpu`: host CPU of the benchmark and all it starts;
* :mod:`~sandpool.bench.report`: the side-by-side table, targets, JSON and plots;
* :mod:`~sandpool.bench.kubernetes`: a burst of rollouts on a Kubernetes cluster, three ways,
  and what :mod:`~sandpool.bench.kubemonitor` samples beside it;
* :mod:`~sandpool.bench.predict` (``--simulate``): the model's predictions and its error
  against measured runs, over :mod:`~sandpool.bench.simulate` (a burst's rollouts) and
  :mod:`~sandpool.bench.simcluster` (the simulated clusters and their parameters).
"""

from __future__ import annotations

from collections.abc import Callable

from sandpool.bench.report import BenchReport, StrategyResult
from sandpool.bench.run import BenchConfig

__all__ = ["BenchConfig", "BenchReport", "StrategyResult", "run_bench"]


async def run_bench(config: BenchConfig, *, say: Callable[[str], None] = print) -> BenchReport:
    """Run the benchmark ``config`` describes and return its report (not yet written).

    Args:
        config: What to run.
        say: Receives one progress line per finished step.

    Raises:
        ConfigError: An unknown strategy, or Docker asked for on tasks it cannot run.
        BackendUnavailable: bubblewrap, docker.io or the cluster is not there.
    """
    if config.backend == "kubernetes":
        from sandpool.bench.kubernetes import run_kubernetes

        return await run_kubernetes(config, say=say)
    from sandpool.bench.run import run_local

    return await run_local(config, say=say)
