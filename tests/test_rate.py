"""The adaptive write rate (AIMD token bucket) of one cluster, on its own clock."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration
from prometheus_client import CollectorRegistry

from sandpool.core import errors
from sandpool.core.rate import AdaptiveRate, RateControl


def drain(rate: AdaptiveRate, now: float) -> int:
    """Take every token available at ``now``; return how many."""
    n = 0
    while rate.take(now) == 0.0:
        n += 1
    return n


def test_a_fixed_rate_ignores_every_answer():
    rate = AdaptiveRate(RateControl(10, 5, adaptive=False), now=0.0)
    for t in range(10):
        rate.answered(float(t), 429, 0.01, retry_after=3.0)
        rate.answered(t + 0.5, None, 5.0)
    assert rate.rate == 10 and rate.back_offs == {} and rate.hold_until == 0.0
    assert drain(rate, 10.0) == 5


def test_a_burst_of_429s_is_one_back_off_and_empties_the_bucket():
    rate = AdaptiveRate(RateControl(40, 40), now=0.0)
    for i in range(30):  # thirty requests sent at t=0, rejected one after the other
        rate.answered(0.1 + i * 0.001, 429, 0.1 + i * 0.001)
    assert rate.rate == 20 and rate.back_offs == {"429": 1}
    assert rate.capacity == 20 and drain(rate, 0.16) == 1  # 1.2 tokens refilled since: no burst
    rate.answered(0.25, 429, 0.04)  # a request sent after the back-off is rejected: again
    assert rate.rate == 10 and rate.back_offs == {"429": 2}


def test_each_cause_backs_off_down_to_the_floor():
    rate = AdaptiveRate(RateControl(8, 8, min_rate=1.0, slow_s=0.5), now=0.0)
    rate.answered(1.0, 503, 0.01)
    rate.answered(2.0, None, 0.01)  # a refused or reset connection
    rate.answered(3.0, 201, 0.9)  # a write slower than slow_s
    rate.answered(4.0, 429, 0.01)
    rate.answered(5.0, 429, 0.01)
    assert rate.back_offs == {"5xx": 1, "connection": 1, "slow": 1, "429": 2}
    assert rate.rate == 1.0 and rate.lowest == 1.0


def test_retry_after_holds_every_write_until_it_has_passed():
    rate = AdaptiveRate(RateControl(100, 100), now=0.0)
    rate.answered(1.0, 429, 0.01, retry_after=2.0)
    assert rate.take(1.5) > 1.5  # no token before t=3, whoever asks
    assert rate.take(2.99) > 0
    assert rate.take(3.05) == 0.0  # tokens accrue only after the hold


def test_fast_answers_bring_the_rate_back_linearly_to_the_configured_rate():
    rate = AdaptiveRate(RateControl(20, 20, increase=2.0), now=0.0)
    rate.answered(0.0, 429, 0.01)
    assert rate.rate == 10
    rate.answered(0.5, 201, 0.6)  # sent before the back-off: says nothing of the new rate
    assert rate.rate == 10
    rate.answered(2.0, 201, 0.01)  # 2 s after the back-off at +2/s per s
    assert rate.rate == pytest.approx(14)
    rate.answered(3.0, 201, 0.01)
    assert rate.rate == pytest.approx(16)
    rate.answered(60.0, 201, 0.01)
    assert rate.rate == 20  # never above the configured rate
    trace = rate.trace()
    assert trace.points[0] == (0.0, 20) and trace.points[-1] == (60.0, 20)
    assert trace.min_rate == 10 and trace.back_offs == {"429": 1}
    assert "lowest 10/s" in trace.describe()


def test_nonsense_controls_are_refused_naming_the_field():
    with pytest.raises(errors.ConfigError, match="min_rate"):
        RateControl(5, 5, min_rate=10)
    with pytest.raises(errors.ConfigError, match="decrease"):
        RateControl(5, 5, decrease=1.5)
    with pytest.raises(errors.ConfigError, match="burst"):
        RateControl(5, 0)


async def test_writes_waiting_for_a_token_slow_down_when_the_rate_backs_off(monkeypatch):
    # The bucket reads the event loop's clock: freeze it, so what is asserted is the
    # bucket's behaviour, not how fast a loaded machine runs (no timed assertion).
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    monkeypatch.setattr(loop, "time", lambda: now[0])
    rate = AdaptiveRate(RateControl(10, 1))
    await rate.acquire()
    rate.release()
    waiting = asyncio.ensure_future(rate.acquire())
    await asyncio.sleep(0)
    rate.answered(now[0], 429, 0.01)  # the rate halves while the write waits
    now[0] += 0.11  # a token's worth at 10/s, not at 5/s
    for _ in range(100):
        await asyncio.sleep(0)
    assert not waiting.done()
    now[0] += 0.1
    for _ in range(500):
        if waiting.done():
            break
        await asyncio.sleep(0)
    assert waiting.done()


@pytest.fixture
async def throttling_server():
    """A loopback API server that rejects the first ``n`` writes with 429 (``Retry-After``)."""
    state = {"reject": 0, "seen": 0}

    async def handler(request: web.Request) -> web.Response:
        state["seen"] += 1
        if state["reject"] > 0:
            state["reject"] -= 1
            return web.json_response({"kind": "Status", "code": 429}, status=429,
                                     headers={"Retry-After": "0"})
        return web.json_response({"kind": "Status", "code": 201}, status=201)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = ApiClient(configuration=Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        yield client, state
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_cluster_that_answers_429_backs_off_its_writes_in_the_report_and_metrics(
    throttling_server,
):
    from sandpool.core import PoolLimits, SandboxPool, Workload
    from sandpool.core.backends.kubernetes import KubernetesBackend
    from sandpool.core.telemetry import PoolMetrics

    client, state = throttling_server
    be = KubernetesBackend(qps=50, burst=50, cluster="east")
    be._http.api_client = client
    metrics = PoolMetrics(CollectorRegistry())
    pool = SandboxPool(be, "cold", PoolLimits(), metrics=metrics)
    state["reject"] = 3
    await be._http.request("POST", "/api/v1/namespaces/ns/pods", body={})
    assert be.write_rates["east"].rate < 50 and be.write_rates["east"].back_offs["429"] >= 1
    report = pool.report(Workload(tasks=0, images=0, rollouts=0, concurrency=1,
                                  backend="kubernetes", strategy="cold"), [], 0.0)
    (trace,) = report.write_rates
    assert trace.cluster == "east" and trace.min_rate < 50
    assert "write rate   east: 50/s, lowest" in report.render_text()
    get = metrics.registry.get_sample_value
    assert get("sandpool_kube_write_rate", {"cluster": "east"}) == be.write_rates["east"].rate
    assert get("sandpool_kube_write_back_offs_total", {"cluster": "east", "cause": "429"}) >= 1
    be._http.api_client = None  # the fixture closes its client


def test_a_back_off_caps_the_writes_in_flight_and_fast_answers_lift_the_cap():
    rate = AdaptiveRate(RateControl(100, 8, increase=1.0), now=0.0)
    assert drain(rate, 0.0) == 8 and rate.inflight == 8  # no cap before a back-off
    rate.answered(0.1, 429, 0.05)
    assert rate.window == 4  # half the writes in flight then
    for _ in range(8):
        rate.release()
    assert drain(rate, 5.0) == 4 and rate.take(5.5) == float("inf")  # full until a release
    rate.release()
    assert rate.take(5.5) == 0.0  # a token had come: the release was what it waited for
    for t in range(40):  # fast answers to writes sent after the back-off: +1/window each
        rate.answered(6.0 + t, 201, 0.01)
        rate.release()
        rate.take(6.0 + t)
    assert rate.window == float("inf")  # past the burst the cap is lifted
    assert rate.trace().min_window == 4 and "(4 in flight)" in rate.trace().describe()
