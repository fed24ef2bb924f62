"""Kubernetes backend pieces that need no cluster: error translation, exit status parsing,
the write throttle and the retry loop (against a loopback HTTP server)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time

import aiohttp
import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import ConfigException
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._errors import Channel, for_status, translate
from sandpool.core.backends.kubernetes._channel import parse_status
from sandpool.core.backends.kubernetes._exec import ExecTarget, build_argv
from sandpool.core.backends.kubernetes._http import (
    KubeHttp,
    Throttle,
    backoff_delay,
    parse_retry_after,
)


def _request_info() -> aiohttp.RequestInfo:
    url = URL("https://127.0.0.1:6443/api/v1/namespaces/ns/pods/p/exec")
    return aiohttp.RequestInfo(url, "GET", CIMultiDictProxy(CIMultiDict()), url)


# Every lower-layer exception the backend can see, and what it must become, per channel.
LOWER_LAYER = [
    (aiohttp.ClientConnectionError("refused"), errors.ApiError, errors.ExecTransportError),
    (aiohttp.ServerDisconnectedError(), errors.ApiError, errors.ExecTransportError),
    (aiohttp.ClientOSError(104, "reset"), errors.ApiError, errors.ExecTransportError),
    (aiohttp.ClientPayloadError("cut"), errors.ApiError, errors.ExecTransportError),
    (aiohttp.WebSocketError(1006, "abnormal close"), errors.ApiError, errors.ExecTransportError),
    (
        aiohttp.WSServerHandshakeError(_request_info(), (), status=404, message="not found"),
        errors.ApiError,
        errors.SandboxDied,
    ),
    (
        aiohttp.WSServerHandshakeError(_request_info(), (), status=403, message="forbidden"),
        errors.BackendUnavailable,
        errors.BackendUnavailable,
    ),
    (
        aiohttp.WSServerHandshakeError(_request_info(), (), status=500, message="boom"),
        errors.ApiError,
        errors.ExecTransportError,
    ),
    (
        aiohttp.ClientResponseError(_request_info(), (), status=503, message="busy"),
        errors.ApiError,
        errors.ExecTransportError,
    ),
    (
        aiohttp.WSMessageTypeError("unexpected TEXT frame"),
        errors.ApiError,
        errors.ExecTransportError,
    ),
    (ConnectionResetError("reset"), errors.ApiError, errors.ExecTransportError),
    (OSError("no route"), errors.ApiError, errors.ExecTransportError),
    (TimeoutError(), errors.InfraTimeout, errors.ExecTransportError),
    (ssl.SSLError("bad certificate"), errors.BackendUnavailable, errors.BackendUnavailable),
    (ConfigException("no current context"), errors.BackendUnavailable, errors.BackendUnavailable),
    (FileNotFoundError("kubeconfig"), errors.BackendUnavailable, errors.BackendUnavailable),
    (json.JSONDecodeError("bad", "{", 0), errors.ApiError, errors.ExecTransportError),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), errors.ApiError, errors.ExecTransportError),
]


@pytest.mark.parametrize(("exc", "rest", "exec_"), LOWER_LAYER, ids=lambda v: type(v).__name__)
def test_every_lower_layer_exception_is_translated(exc, rest, exec_):
    got_rest = translate(exc, "GET /x", channel=Channel.REST)
    got_exec = translate(exc, "exec", channel=Channel.EXEC)
    assert type(got_rest) is rest, got_rest
    assert type(got_exec) is exec_, got_exec
    assert str(got_rest) and str(got_exec)


def test_every_aiohttp_error_class_falls_in_a_translated_family():
    families = (
        aiohttp.ClientError,
        aiohttp.WebSocketError,
        aiohttp.WSMessageTypeError,
        OSError,
        TimeoutError,
        ValueError,
    )
    classes = [getattr(aiohttp, n) for n in dir(aiohttp) if n.endswith("Error")]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) > 10
    assert [c.__name__ for c in classes if not issubclass(c, families)] == []


def test_an_unknown_exception_is_not_silently_mapped():
    with pytest.raises(TypeError, match="no sandpool mapping"):
        translate(KeyError("x"), "GET /x")


def test_sandpool_errors_pass_through_unchanged():
    exc = errors.SandboxDied("gone")
    assert translate(exc, "exec", channel=Channel.EXEC) is exc


@pytest.mark.parametrize(
    ("status", "channel", "cls"),
    [
        (401, Channel.REST, errors.BackendUnavailable),
        (403, Channel.REST, errors.BackendUnavailable),
        (400, Channel.REST, errors.ConfigError),
        (422, Channel.REST, errors.ConfigError),
        (409, Channel.REST, errors.ApiError),
        (429, Channel.REST, errors.ApiError),
        (500, Channel.REST, errors.ApiError),
        (503, Channel.WATCH, errors.ApiError),
        (404, Channel.EXEC, errors.SandboxDied),
        (500, Channel.EXEC, errors.ExecTransportError),
        (403, Channel.EXEC, errors.BackendUnavailable),
    ],
)
def test_http_statuses_map_by_what_the_caller_should_do(status, channel, cls):
    got = for_status(status, "POST /apis/x", '{"message": "m"}', channel=channel)
    assert type(got) is cls
    if cls is errors.ApiError:
        assert got.status == status


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b'{"status": "Success"}', 0),
        (
            b'{"status": "Failure", "message": "command terminated with non-zero exit code: '
            b'error executing command [sh -c exit 3], exit status 3"}',
            3,
        ),
        (
            b'{"status": "Failure", "reason": "NonZeroExitCode", "details": {"causes": '
            b'[{"reason": "ExitCode", "message": "7"}]}}',
            7,
        ),
        (b'{"status": "Failure", "message": "error executing command: signal: killed"}', 137),
    ],
)
def test_exit_code_is_read_from_the_status_channel(raw, code):
    assert parse_status(raw)[0] == code


def test_no_status_frame_has_no_exit_code():
    assert parse_status(None)[0] is None
    assert parse_status(b'{"status": "Failure", "message": "container not found"}')[0] is None


def test_exec_argv_carries_the_markers_the_output_cap_and_the_environment():
    t = ExecTarget("ns", "pod", "sandbox", "run1-c1", "/testbed")
    argv = build_argv(t, "run1-c1.4", "echo hi", timeout=5, cwd="/testbed", env={"A": "1"})
    assert argv[:2] == ["sh", "-c"]  # the container's own shell, found on its PATH
    i = argv.index("sandpool-exec")
    assert argv[i + 4 : i + 8] == ["run1-c1.4", "run1-c1", str(1 << 20), "1"]  # markers, cap, env
    assert argv[i + 8 :] == ["A=1", "/bin/bash", "-c", "echo hi"]
    plain = build_argv(t, "run1-c1.5", ["ls"], timeout=5, cwd="/testbed", env={})
    assert plain[-2:] == ["0", "ls"]


def test_manifests_carry_the_run_id_everywhere():
    pi = m.PodImage("example.invalid/x:1", annotations={"example.invalid/a": "b"})
    spec = m.pod_spec(
        pi,
        container="sandbox",
        command=["sleep", "infinity"],
        resources={},
        runtime_class="gvisor",
        node_selector={"a": "b"},
        tolerations=[{"key": "k"}],
    )
    tpl = m.template("t", "run1", "img", pi, spec)
    assert tpl["metadata"]["labels"][m.RUN_ID_LABEL] == "run1"
    assert tpl["spec"]["podTemplate"]["metadata"]["labels"][m.RUN_ID_LABEL] == "run1"
    assert tpl["spec"]["podTemplate"]["metadata"]["annotations"] == {"example.invalid/a": "b"}
    assert tpl["spec"]["podTemplate"]["spec"]["runtimeClassName"] == "gvisor"
    # No kernel keyring in a pod: the runtime's default seccomp profile denies the calls.
    assert tpl["spec"]["podTemplate"]["spec"]["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert m.warm_pool("p", "run1", "img", "t", 3)["spec"] == {
        "replicas": 3,
        "sandboxTemplateRef": {"name": "t"},
    }
    assert m.claim("c", "run1", "img", "p")["spec"] == {"warmPoolRef": {"name": "p"}}


def test_retry_after_and_backoff():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("120") == 30.0  # capped
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after(None) is None
    assert all(1.5 <= backoff_delay(3, retry_after=1.5) <= 2.25 for _ in range(50))
    assert backoff_delay(1, retry_after=0.0) == 0.0
    for attempt in range(1, 10):
        assert 0 < backoff_delay(attempt, base=0.1, cap=2.0) <= 2.0


def test_throttle_rejects_nonsense():
    with pytest.raises(errors.ConfigError):
        Throttle(0, 1, 1)


async def test_throttle_paces_writes_after_the_burst_and_not_reads(monkeypatch):
    # The token bucket reads the event loop's clock: freeze it, so what is asserted is the
    # bucket's behaviour, not how fast a loaded machine runs (no timed assertion).
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    monkeypatch.setattr(loop, "time", lambda: now[0])
    th = Throttle(qps=20, burst=5, max_inflight=100)
    for _ in range(5):  # the bucket starts full: five writes need no clock time at all
        async with th.slot(write=True):
            pass
    for _ in range(50):  # reads take no write token
        async with th.slot(write=False):
            pass
    sixth = th.slot(write=True)
    entered = asyncio.ensure_future(sixth.__aenter__())
    for _ in range(50):
        await asyncio.sleep(0)
    assert not entered.done()  # the bucket is empty until it leaks a token
    now[0] += 1 / 20 + 1e-3  # one token's worth of time at 20 writes/s
    for _ in range(200):
        if entered.done():
            break
        await asyncio.sleep(0)
    assert entered.done() and entered.exception() is None
    await sixth.__aexit__(None, None, None)


async def test_throttle_bounds_requests_in_flight():
    th = Throttle(qps=1000, burst=1000, max_inflight=3)

    async def one() -> None:
        async with th.slot(write=False):
            await asyncio.sleep(0.02)

    await asyncio.gather(*(one() for _ in range(12)))
    assert th.inflight_peak == 3


@pytest.fixture
async def flaky_server():
    """A loopback HTTP server answering 429 (Retry-After) and 503 before a 201."""
    answers: list[tuple[int, dict[str, str]]] = []
    seen: list[float] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        status, headers = answers.pop(0) if answers else (201, {})
        return web.json_response({"kind": "Status", "code": status}, status=status, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = Configuration(host=f"http://127.0.0.1:{port}")
    client = ApiClient(configuration=cfg)
    try:
        yield client, answers, seen
    finally:
        await client.close()
        await runner.cleanup()


async def test_writes_are_retried_on_429_and_5xx_honouring_retry_after(flaky_server):
    client, answers, seen = flaky_server
    answers += [(429, {"Retry-After": "0.3"}), (503, {})]
    http = KubeHttp(client, Throttle(100, 100, 10), retries=3)
    body = await http.request("POST", "/api/v1/namespaces/ns/pods", body={"a": 1})
    assert body == {"kind": "Status", "code": 201}
    assert http.writes == 3 and http.retried == 2  # every attempt is a write sent
    assert seen[1] - seen[0] >= 0.3  # Retry-After was honoured


async def test_retries_end_in_api_error_with_the_last_status(flaky_server):
    client, answers, _ = flaky_server
    answers += [(503, {})] * 5
    http = KubeHttp(client, Throttle(100, 100, 10), retries=2)
    with pytest.raises(errors.ApiError) as info:
        await http.request("DELETE", "/api/v1/namespaces/ns/pods/p")
    assert info.value.status == 503 and http.writes == 3


async def test_a_refused_connection_becomes_api_error_after_retries():
    client = ApiClient(configuration=Configuration(host="http://127.0.0.1:9"))
    try:
        http = KubeHttp(client, Throttle(100, 100, 10), retries=1)
        with pytest.raises(errors.ApiError, match="cannot reach"):
            await http.request("GET", "/version")
    finally:
        await client.close()


@pytest.mark.parametrize(
    "version,buggy",
    [("v0.5.0rc1", True), ("v0.5.3", True), ("0.4.6", True), ("v0.5.4", False),
     ("v1.0.3", False), ("latest", False)],
)
def test_preflight_names_controllers_with_the_warm_pool_over_creation_bug(version, buggy):
    from sandpool.core.backends.kubernetes._preflight import overcreation_warning

    warning = overcreation_warning(version)
    assert (warning is not None) == buggy
    if buggy:
        assert "issue 1215" in warning and version in warning


@pytest.mark.parametrize("how", ["argument", "env"])
async def test_a_missing_kubeconfig_names_its_path(tmp_path, monkeypatch, how):
    from sandpool.core.backends.kubernetes import KubernetesBackend

    missing = tmp_path / "nowhere" / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(missing) if how == "env" else str(tmp_path / "other"))
    backend = KubernetesBackend(str(missing) if how == "argument" else None)
    with pytest.raises(errors.BackendUnavailable, match=f"kubeconfig {missing} does not exist"):
        await backend.preflight()
    await backend.aclose()


async def test_an_unusable_kubeconfig_names_its_path(tmp_path):
    from sandpool.core.backends.kubernetes import KubernetesBackend

    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\n")
    backend = KubernetesBackend(str(bad))
    with pytest.raises(errors.BackendUnavailable, match=f"loading kubeconfig {bad}"):
        await backend.preflight()
    await backend.aclose()


def test_placement_fits_each_window_in_the_node_disks_and_pipelines_when_the_corpus_does_not_fit():
    from sandpool.core.backends.kubernetes._placement import NodeCapacity, plan

    nodes = [NodeCapacity(f"n{i}", 10e9, 110) for i in range(3)]
    sizes = {f"img{i}": 2e9 + i * 1e8 for i in range(30)}  # 63.5 GB > 30 GB of disk
    p = plan(list(sizes), sizes, nodes, slots_per_image=4)
    assert p.fraction == 0.5 and len(p.windows) > 1
    assert sorted(img for w in p.windows for img in w) == sorted(sizes)  # each image once
    for w in p.windows:
        for n in nodes:
            on = [img for img, node in w.items() if node == n.name]
            assert sum(sizes[i] for i in on) <= n.disk_bytes * 0.5  # room for the next window
    order = [img for w in p.windows for img in w]
    assert order == list(sizes)  # windows follow rollout order
    assert "window 1" in p.describe() and p.as_dict()["windows"] == p.windows

    small = {k: sizes[k] for k in list(sizes)[:6]}
    one = plan(list(small), small, nodes)
    assert len(one.windows) == 1 and one.fraction == 1.0
    assert {n for n in one.windows[0].values()} == {"n0", "n1", "n2"}  # spread by free disk


def test_placement_refuses_an_image_no_node_can_hold():
    from sandpool.core.backends.kubernetes._placement import NodeCapacity, plan

    with pytest.raises(errors.ConfigError, match="fits on no node"):
        plan(["big", "b2", "b3"], {"big": 8e9, "b2": 8e9, "b3": 8e9},
             [NodeCapacity("n0", 10e9, 110)])
    with pytest.raises(errors.ConfigError, match="no size"):
        plan(["x"], {}, [NodeCapacity("n0", 10e9, 110)])


def test_template_pods_require_their_planned_node():
    spec = m.pod_spec(m.PodImage("x:1"), container="c", command=["sleep"], resources={},
                      runtime_class=None, node_selector=None, tolerations=None, node="kwok-node-3")
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["kwok-node-3"]}
    ]


@pytest.mark.parametrize("disk_bytes", [None, 64 << 20])
def test_a_read_only_root_puts_repo_tmp_and_service_dir_on_one_volume(disk_bytes):
    spec = m.pod_spec(m.PodImage("x:1", workdir="/testbed"), container="c", command=["sleep"],
                      resources={}, runtime_class=None, node_selector=None, tolerations=None,
                      disk_bytes=disk_bytes, read_only_root=True)
    c = spec["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert [(v["mountPath"], v["subPath"]) for v in c["volumeMounts"]] == [
        ("/testbed", "repo"), ("/tmp", "tmp"), ("/run/sandpool", "run")]
    # A cap makes the volume a tmpfs of that size (ENOSPC inside); none leaves it on disk.
    want = {"medium": "Memory", "sizeLimit": str(disk_bytes)} if disk_bytes else {}
    assert spec["volumes"] == [{"name": m.SCRATCH_VOLUME, "emptyDir": want}]
    assert spec["initContainers"][0]["volumeMounts"][0]["name"] == m.SCRATCH_VOLUME
    plain = m.pod_spec(m.PodImage("x:1"), container="c", command=["sleep"], resources={},
                       runtime_class=None, node_selector=None, tolerations=None)
    assert "volumes" not in plain
    assert plain["containers"][0]["securityContext"] == {"capabilities": {"drop": ["NET_RAW"]}}


@pytest.fixture
async def flaky_exec_server():
    """A loopback API server whose pod-exec upgrades are answered by ``answers`` (status,
    headers) first, then upgraded to a ``v5.channel.k8s.io`` WebSocket that ends at once with
    a ``Success`` status frame."""
    answers: list[tuple[int, dict[str, str]]] = []
    seen: list[float] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(time.monotonic())
        if answers:
            status, headers = answers.pop(0)
            return web.json_response({"kind": "Status", "code": status}, status=status,
                                     headers=headers)
        ws = web.WebSocketResponse(protocols=("v5.channel.k8s.io",))
        await ws.prepare(request)
        await ws.send_bytes(b"\x03" + json.dumps({"status": "Success"}).encode())
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = ApiClient(configuration=Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        yield client, answers, seen
    finally:
        await client.close()
        await runner.cleanup()


_EXEC_PATH = "/api/v1/namespaces/ns/pods/p/exec"


async def test_exec_handshakes_are_retried_on_429_and_5xx_honouring_retry_after_and_counted(
    flaky_exec_server,
):
    from prometheus_client import CollectorRegistry

    from sandpool.core.telemetry import PoolMetrics, Telemetry

    client, answers, seen = flaky_exec_server
    answers += [(429, {"Retry-After": "0.3"}), (503, {}), (500, {})]
    http = KubeHttp(client, Throttle(100, 100, 10), retries=3)
    metrics = PoolMetrics(CollectorRegistry())
    http.telemetry = Telemetry(metrics, backend="kubernetes", strategy="reuse")
    ws = await http.ws_connect(_EXEC_PATH, [("command", "true")], ("v5.channel.k8s.io",))
    try:
        assert ws.protocol == "v5.channel.k8s.io"
    finally:
        await ws.close()
    assert len(seen) == 4 and seen[1] - seen[0] >= 0.3  # Retry-After was the first wait
    assert http.retried == 3 and http.execs == 1  # only the opened stream counts as one
    value = metrics.registry.get_sample_value
    assert value("sandpool_kube_api_retries_total", {"status": "429"}) == 1
    assert value("sandpool_kube_api_retries_total", {"status": "5xx"}) == 2


async def test_exec_handshakes_past_the_retry_budget_are_an_infra_error_never_the_policys(
    flaky_exec_server,
):
    from sandpool.core.classify import Verdict, classify

    client, answers, seen = flaky_exec_server
    answers += [(429, {"Retry-After": "0"})] * 3
    http = KubeHttp(client, Throttle(100, 100, 10), retries=2)
    with pytest.raises(errors.ExecTransportError, match=r"HTTP 429.*after 2 retries") as info:
        await http.ws_connect(_EXEC_PATH, [("command", "true")], ("v5.channel.k8s.io",))
    assert len(seen) == 3 and http.execs == 0
    assert classify(info.value) is Verdict.INFRA and not classify(info.value).scored


async def test_a_pod_gone_on_the_exec_handshake_is_not_retried(flaky_exec_server):
    client, answers, seen = flaky_exec_server
    answers += [(404, {})]
    http = KubeHttp(client, Throttle(100, 100, 10), retries=3)
    with pytest.raises(errors.SandboxDied):
        await http.ws_connect(_EXEC_PATH, [("command", "true")], ("v5.channel.k8s.io",))
    assert len(seen) == 1 and http.retried == 0


def test_a_claim_whose_pod_the_api_server_refuses_as_invalid_fails_at_once():
    """The agent-sandbox controller retries an invalid pod forever (Ready=False,
    ReconcilerError): the claim's wait treats it as terminal instead of waiting out its
    timeout. Message as the v1.0.3 controller wrote it on a real node."""
    from sandpool.core.backends.kubernetes._claims import _invalid_pod

    refused = {"type": "Ready", "status": "False", "reason": "ReconcilerError", "message": (
        'Error seen: Pod "sp-74139929-c1" is invalid: [spec.containers[0].resources.requests: '
        'Invalid value: "64Mi": must be less than or equal to memory limit of 48Mi]')}
    assert _invalid_pod(refused)
    assert not _invalid_pod({**refused, "message": "Error seen: the server is currently unable"})
    assert not _invalid_pod({**refused, "reason": "SandboxNotReady"})


def test_a_pod_whose_init_container_cannot_pull_its_image_will_never_start():
    """The scratch volume's filler runs the task image first; its pull failure is the pod's
    (seen on a real node: the pod stays Pending, its container PodInitializing)."""
    from sandpool.core.backends.kubernetes._pods import pod_start_failure

    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}
    pod = {"metadata": {}, "status": {"phase": "Pending", "initContainerStatuses": [
        {"name": "sandpool-fill", "state": waiting}], "containerStatuses": [
        {"name": "sandbox", "state": {"waiting": {"reason": "PodInitializing"}}}]}}
    assert "sandpool-fill: ImagePullBackOff" in pod_start_failure(pod)
    done = {"terminated": {"reason": "Completed", "exitCode": 0}}
    pod["status"]["initContainerStatuses"][0]["state"] = done
    assert pod_start_failure(pod) is None
    pod["status"]["initContainerStatuses"][0]["state"] = {"terminated": {"reason": "Error",
                                                                         "exitCode": 1}}
    assert "sandpool-fill terminated: Error (exit 1)" in pod_start_failure(pod)
