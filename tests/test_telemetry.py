"""Prometheus series and OpenTelemetry spans of real local runs (bubblewrap sandboxes).

The series are scraped from the real HTTP endpoint (``PoolMetrics.serve``) during and after
a run and parsed with prometheus-client's own parser; every count must equal the run's
report. Spans go to the OpenTelemetry SDK's in-memory exporter.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sandpool.core import Outcome, PoolMetrics, SandboxPool
from sandpool.core.backends.local import LocalBackend
from sandpool.core.metrics import RejectedTask
from sandpool.envs.policies import NoopPolicy, OraclePolicy
from sandpool.envs.runner import run_batch

_STATES = {"idle", "leased", "creating", "resetting", "quarantined"}


def scrape(url: str) -> dict[str, dict[frozenset, float]]:
    """GET ``url`` and parse it: sample name -> {frozenset(labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[frozenset, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][frozenset(s.labels.items())] = s.value
    return out


def total(series: dict[str, dict[frozenset, float]], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for k, v in series.get(name, {}).items() if want <= k)


def by_label(series: dict[str, dict[frozenset, float]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for k, v in series.get(name, {}).items():
        out[dict(k)[label]] += v
    return {key: v for key, v in out.items() if v}


async def test_scraped_series_match_the_run_report_exactly(test_images_root, calc_task):
    metrics = PoolMetrics(CollectorRegistry())
    url = f"http://127.0.0.1:{metrics.serve(0)}/metrics"
    ghost = calc_task.model_copy(update={"instance_id": "ghost-1", "image": "sandpool.local/ghost:0"})
    during: list[dict] = []

    def on_result(r) -> None:
        if r.outcome is Outcome.COMPLETED and not during:
            during.append(scrape(url))  # mid-run, from the real endpoint (its own thread)

    try:
        report = await run_batch(
            [calc_task, ghost], [OraclePolicy(), NoopPolicy()], LocalBackend(test_images_root),
            rollouts_per_task=4, concurrency=2, metrics=metrics, on_result=on_result,
            rejected=[RejectedTask(task_id=None, row=3, reason="base_commit: missing")])
        after = scrape(url)
    finally:
        metrics.shutdown()
    [mid] = during
    assert total(mid, "sandpool_claims_total") >= 1
    sizes = mid["sandpool_sandboxes"]
    assert {dict(k)["state"] for k in sizes} == _STATES
    assert sum(v for k, v in sizes.items() if dict(k)["image"] == calc_task.image) >= 1

    pool = report.pool
    assert total(after, "sandpool_claims_total") == pool.claims
    assert total(after, "sandpool_claims_total", warm="true") == pool.warm_hits
    assert total(after, "sandpool_sandbox_creations_total", result="ok") == report.sandboxes_created
    assert total(after, "sandpool_sandbox_creations_total", result="failed") == pool.create_failures
    assert total(after, "sandpool_resets_total", result="clean") == report.resets
    assert total(after, "sandpool_resets_total", result="quarantined") == report.quarantines
    assert total(after, "sandpool_quarantines_total") == report.quarantines
    assert total(after, "sandpool_reset_duration_seconds_count") == report.resets + report.quarantines
    assert by_label(after, "sandpool_rollouts_total", "outcome") == {
        k: v for k, v in report.failures.items() if v}
    assert report.failures == {"completed": 4, "infra_failed": 0, "task_failed": 0, "rejected": 8}
    assert by_label(after, "sandpool_failures_total", "kind") == report.infra_errors_by_kind
    assert total(after, "sandpool_ttfc_seconds_count") == report.ttfc.n == 4
    assert total(after, "sandpool_ttfc_seconds_sum") == pytest.approx(report.ttfc.mean_s * report.ttfc.n)
    # Small, bounded label sets: the pool's own labels, never a sandbox id.
    sandbox_ids = {r.sandbox_id for r in report.rollouts if r.sandbox_id}
    for name, samples in after.items():
        if name.startswith("sandpool_") and not name.startswith("sandpool_kube"):
            for labels in samples:
                got = dict(labels)
                assert (got["backend"], got["strategy"]) == ("local", "reuse"), name
                assert not set(got.values()) & sandbox_ids, name


async def test_pools_share_a_users_registry_and_a_pool_without_metrics_records_nothing(
        test_images_root, calc_task):
    registry = CollectorRegistry()
    for _ in range(2):  # one PoolMetrics per registry, however many pools
        async with SandboxPool(LocalBackend(test_images_root), "warm", metrics=registry) as pool:
            async with pool.claim(calc_task) as lease:
                await lease.exec("true", timeout=30)
    async with SandboxPool(LocalBackend(test_images_root), "warm") as quiet:
        assert quiet.telemetry.metrics is None
        async with quiet.claim(calc_task) as lease:
            await lease.exec("true", timeout=30)
    assert registry.get_sample_value("sandpool_claims_total", {
        "backend": "local", "strategy": "warm", "warm": "false"}) == 2
    with pytest.raises(TypeError, match="metrics"):
        SandboxPool(LocalBackend(test_images_root), metrics="yes")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """The SDK's in-memory exporter behind the process's tracer provider (set once)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


async def test_rollout_span_parents_claim_exec_grade_and_reset(exporter, test_images_root, calc_task):
    exporter.clear()
    await run_batch([calc_task], [OraclePolicy()], LocalBackend(test_images_root),
                    rollouts_per_task=2, concurrency=1)
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    rollouts = [s for s in spans if s.name == "sandpool.rollout"]
    assert len(rollouts) == 2
    for r in rollouts:
        assert r.parent is None
        assert r.attributes["sandpool.task_id"] == calc_task.instance_id
        assert r.attributes["sandpool.image"] == calc_task.image
        assert r.attributes["sandpool.outcome"] == "completed"
        children = [s for s in spans if s.parent is not None and s.parent.span_id == r.context.span_id]
        names = [s.name for s in children]
        assert names.count("sandpool.claim") == 1 and names.count("sandpool.grade") == 1, names
        assert "sandpool.exec" in names and "sandpool.reset" in names, names
        [grade] = [s for s in children if s.name == "sandpool.grade"]
        assert any(s.name == "sandpool.exec" and s.parent.span_id == grade.context.span_id for s in spans)
        assert all(s.context.trace_id == r.context.trace_id for s in children)
    claims = sorted((s for s in spans if s.name == "sandpool.claim"), key=lambda s: s.start_time)
    assert [c.attributes["sandpool.warm"] for c in claims] == [True, True]  # prepare filled the pool
    # Warm fills started by prepare are root spans of their own; no span is orphaned.
    creates = [s for s in spans if s.name == "sandpool.create"]
    assert creates and all(s.parent is None for s in creates)
    assert all(s.parent is None or s.parent.span_id in by_id for s in spans)


def test_gymnasium_env_records_into_the_same_pool_series(test_images_root, calc_task):
    import gymnasium as gym
    from sandpool.integrations.gymnasium import BackgroundPool

    registry = CollectorRegistry()
    env = gym.make("sandpool/SWE-v0", tasks=[calc_task], grade_timeout=120.0,
                   pool=BackgroundPool(backend_options={"images_root": str(test_images_root)},
                                       metrics=registry))
    try:
        env.reset(options={"task_id": calc_task.instance_id})
        env.unwrapped.write_file("/tmp/gold.patch", calc_task.patch)
        env.step("git apply /tmp/gold.patch")
        _, reward, *_ = env.step("submit")
        report = env.unwrapped.report()
    finally:
        env.close()
    labels = {"backend": "local", "strategy": "reuse"}
    assert reward == 1.0
    assert registry.get_sample_value("sandpool_rollouts_total", labels | {"outcome": "completed"}) == 1
    assert registry.get_sample_value("sandpool_ttfc_seconds_count", labels) == report.ttfc.n == 1
    assert sum(registry.get_sample_value("sandpool_claims_total", labels | {"warm": w}) or 0
               for w in ("true", "false")) == report.pool.claims


def test_grafana_dashboard_queries_only_series_the_pool_exports():
    import json
    import re
    from pathlib import Path

    registry = CollectorRegistry()
    PoolMetrics(registry)
    # Labelled series have no sample before their first event: take the names from the families.
    exported = set()
    for fam in registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
        exported |= {fam.name + suffix for suffix in suffixes}
    dash = json.loads((Path(__file__).parents[1] / "examples/grafana/sandpool-dashboard.json").read_text())
    queried = {m for p in dash["panels"] for t in p["targets"]
               for m in re.findall(r"sandpool_[a-z_]+", t["expr"])}
    assert queried and queried <= exported, queried - exported
    assert {"sandpool_ttfc_seconds_bucket", "sandpool_rollouts_total", "sandpool_sandboxes",
            "sandpool_kube_api_retries_total"} <= queried


async def test_kube_api_writes_and_retries_are_counted_by_verb_resource_and_status():
    from aiohttp import web
    from kubernetes_asyncio.client import ApiClient, Configuration

    from sandpool.core.backends.kubernetes._http import KubeHttp, Throttle, resource_of
    from sandpool.core.telemetry import Telemetry

    answers = [429, 503]  # then 201 for every request

    async def handler(request: web.Request) -> web.Response:
        status = answers.pop(0) if answers else 201
        return web.json_response({"code": status}, status=status, headers={"Retry-After": "0"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = ApiClient(configuration=Configuration(host=f"http://127.0.0.1:{port}"))
    registry = CollectorRegistry()
    try:
        http = KubeHttp(client, Throttle(100, 100, 10), retries=3)
        http.telemetry = Telemetry(PoolMetrics(registry), backend="kubernetes", strategy="reuse")
        await http.request("POST", "/apis/agents.x-k8s.io/v1alpha1/namespaces/ns/sandboxclaims", body={})
        await http.request("DELETE", "/api/v1/namespaces/ns/pods/p-1")
        await http.request("GET", "/api/v1/namespaces/ns/pods")  # a read: not a write
    finally:
        await client.close()
        await runner.cleanup()
    get = registry.get_sample_value
    assert get("sandpool_kube_api_writes_total", {"verb": "POST", "resource": "sandboxclaims"}) == 3
    assert get("sandpool_kube_api_writes_total", {"verb": "DELETE", "resource": "pods"}) == 1
    assert get("sandpool_kube_api_retries_total", {"status": "429"}) == 1
    assert get("sandpool_kube_api_retries_total", {"status": "5xx"}) == 1
    assert http.writes == 4 and http.retried == 2  # the same counts the report reads
    assert resource_of("/api/v1/namespaces/ns/pods/p-1/exec") == "pods/exec"
    assert resource_of("/api/v1/namespaces") == "namespaces"


def test_sandpool_run_serves_metrics_while_it_runs(tmp_path):
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.error

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sandpool.cli", "run", "--limit", "1", "--rollouts", "2",
           "--concurrency", "1", "--metrics-port", str(port), "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = None
    try:
        while proc.poll() is None:  # the endpoint itself is the event: scrape until it counts
            try:
                got = scrape(f"http://127.0.0.1:{port}/metrics")
            except (urllib.error.URLError, ConnectionError):
                continue
            if total(got, "sandpool_claims_total") >= 1:
                seen = got
                break
            time.sleep(0.05)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert seen is not None, "the run ended before its endpoint counted a claim"
    report = json.loads((tmp_path / "report.json").read_text())
    assert 1 <= total(seen, "sandpool_claims_total") <= report["pool"]["claims"] == 2
