"""The adaptive write rate against the real kube-apiserver's API Priority and Fairness.

A test user's requests are put in a priority level of one nominal share (a few seats) that
rejects what it cannot seat with 429 and ``Retry-After``. The same cold rollouts (``LANES``
at once, each lane running ``PER_LANE`` back to back, so the load is sustained) run twice,
with a fixed write bucket and with the adaptive one; every rollout is accounted for both
times, and the adaptive run meets fewer 429s.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from sandpool.core import Outcome, PoolLimits, SandboxPool, Workload, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.telemetry import PoolMetrics
from tests.cluster.kwok_images import workdir_image
from tests.cluster.test_kubernetes_backend import make_task, repo  # noqa: F401
from tests.cluster.test_kubernetes_exec_channel import _throttled_user

pytestmark = pytest.mark.cluster

IMAGE = "sandpool.test/calc:1"
LANES, PER_LANE = 40, 4
ROLLOUTS = LANES * PER_LANE


async def _burst(kubeconfig, namespace: str, path, first: str, *, adaptive: bool) -> dict:
    """Run the lanes of cold rollouts; return the 429s met and the report."""
    metrics = PoolMetrics(CollectorRegistry())
    be = KubernetesBackend(kubeconfig, namespace=namespace, mode="pods", agent=False,
                           qps=100, burst=100, adaptive_rate=adaptive, cluster="throttled",
                           image_map=lambda name: workdir_image(name, path))

    async def episode(lease) -> float:
        return float((await lease.exec("echo ok")).text == "ok\n")

    async def lane(i: int) -> list:
        return [await run_rollout(pool, make_task(IMAGE, first, i), episode, rollout=j,
                                  retries=3) for j in range(PER_LANE)]

    limits = PoolLimits(max_live=2 * LANES)
    t0 = time.monotonic()
    async with SandboxPool(be, "cold", limits, metrics=metrics) as pool:
        results = [r for rs in await asyncio.gather(*(lane(i) for i in range(LANES)))
                   for r in rs]
        report = pool.report(Workload(tasks=LANES, images=1, rollouts=ROLLOUTS,
                                      concurrency=LANES, backend="kubernetes",
                                      strategy="cold"), results, time.monotonic() - t0)
    got = metrics.registry.get_sample_value
    return {"429": got("sandpool_kube_api_retries_total", {"status": "429"}) or 0.0,
            "report": report}


async def test_an_adaptive_write_rate_meets_fewer_429s_than_a_fixed_one_and_loses_no_rollout(
    cluster, namespace, repo, tmp_path
):
    path, first, _ = repo
    kubeconfig, cleanup = _throttled_user(cluster, namespace, tmp_path / "throttled.kubeconfig",
                                          shares=1)
    try:
        fixed = await _burst(kubeconfig, namespace, path, first, adaptive=False)
        adaptive = await _burst(kubeconfig, namespace, path, first, adaptive=True)
    finally:
        cleanup()
    for run in (fixed, adaptive):
        report = run["report"]
        print(report.render_text())
        assert report.unaccounted == 0
    (trace,) = adaptive["report"].write_rates
    assert trace.back_offs.get("429", 0) >= 1 and trace.min_rate < 100
    assert fixed["report"].write_rates[0].back_offs == {}  # the fixed bucket never moved
    print(f"429s met: fixed {fixed['429']:.0f}, adaptive {adaptive['429']:.0f}")
    assert fixed["429"] >= 1  # the limit bit the fixed rate
    assert adaptive["report"].failures[Outcome.COMPLETED.value] == ROLLOUTS
    assert adaptive["429"] < fixed["429"]
