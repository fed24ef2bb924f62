"""The Kubernetes exec channel against a failing cluster and a cheating policy (real
kube-apiserver, agent-sandbox controller and kwok nodes from hack/cluster).

Faults the API cannot be asked for are made by killing cluster components
(``hack/cluster/cluster_faults.py``): kwok down is a node whose kubelet the API server
cannot dial (it upgrades pod exec, then ends it with a 500 ``InternalError`` status), and
killing kwok or kube-apiserver under an open agent session resets its stream. A
PriorityLevelConfiguration with no seats throttles a test user's REST requests with real 429s;
its exec upgrades are exempt from APF (long-running requests), so a 429 on an exec upgrade,
which a proxy or gateway in front of the API server can send, is tested against a loopback
server in ``tests/test_kubernetes_unit.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import cluster_faults  # hack/cluster (on sys.path: conftest.py)
import pytest
import yaml
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry

from sandpool.core import Outcome, SandboxPool, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.telemetry import PoolMetrics
from tests.cluster.kwok_images import workdir_image
from tests.cluster.test_kubernetes_backend import backend, eventually, make_task, repo  # noqa: F401

pytestmark = pytest.mark.cluster

IMAGE = "sandpool.test/calc:1"
CHANNELS = pytest.mark.parametrize("channel", ["agent", "exec"])


def _api_answers(cluster) -> bool:
    try:
        cluster.core.list_namespace(limit=1)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


async def _until_api_answers(cluster) -> None:
    await eventually(lambda: _api_answers(cluster), 120, "kube-apiserver to answer again")


def _retries(metrics: PoolMetrics, status: str) -> float:
    return metrics.registry.get_sample_value("sandpool_kube_api_retries_total",
                                             {"status": status}) or 0.0


@CHANNELS
async def test_commands_to_a_node_the_api_server_cannot_reach_are_retried_then_run(
    cluster, namespace, repo, channel
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, agent=channel == "agent")
    metrics = PoolMetrics(CollectorRegistry())
    task = make_task(IMAGE, first)
    async with SandboxPool(be, "warm", metrics=metrics) as pool:
        await pool.prepare([task], concurrency=1)  # a Ready warm pod: the claim needs no kwok
        before = be.api_stats["retried"]
        await asyncio.to_thread(cluster_faults.kill, cluster.run_dir, "kwok")
        try:

            async def rollout() -> tuple[str, str]:
                async with pool.claim(task) as lease:  # agent: its session opens here
                    res = await lease.exec("echo $((6 * 7))")
                    return res.text, lease.sandbox.channel

            running = asyncio.create_task(rollout())
            # The API server answers 500 "dial tcp ... connection refused" while kwok is down.
            await eventually(lambda: be.api_stats["retried"] >= before + 2, 60, "two retries")
        finally:
            await asyncio.to_thread(cluster_faults.start, cluster.run_dir, "kwok")
        assert await running == ("42\n", channel)
    assert be.api_stats["agent_fallbacks"] == 0  # a failing node never costs the image its agent
    assert _retries(metrics, "5xx") >= 2


@CHANNELS
async def test_commands_past_the_retry_budget_are_infra_failed_never_scored(
    cluster, namespace, repo, channel
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, agent=channel == "agent", api_retries=1)
    task = make_task(IMAGE, first)

    async def episode(lease) -> float:
        return float((await lease.exec("echo ok")).text == "ok\n")

    async with SandboxPool(be, "warm") as pool:
        await pool.prepare([task], concurrency=1)
        await asyncio.to_thread(cluster_faults.kill, cluster.run_dir, "kwok")
        try:
            failed = await run_rollout(pool, task, episode, retries=0)
        finally:
            await asyncio.to_thread(cluster_faults.start, cluster.run_dir, "kwok")
        assert (failed.outcome, failed.reward, failed.error_kind) == (
            Outcome.INFRA_FAILED, None, "exec_transport")
        assert "could not reach the pod's node after 1 retries" in failed.error
        # Once the node is back the image still runs its commands over the agent session.
        ok = await run_rollout(pool, task, episode, retries=1)
        assert (ok.outcome, ok.reward) == (Outcome.COMPLETED, 1.0)
    assert be.api_stats["agent_fallbacks"] == 0
    assert be.api_stats["fallback_sandboxes"] == (0 if channel == "agent" else 2)


@pytest.mark.parametrize("component", ["apiserver", "kwok"])
async def test_a_session_stream_that_drops_mid_rollout_is_infra_failed_and_retried_on_a_new_sandbox(
    cluster, namespace, repo, component
):
    """kube-apiserver restarted, or the node's kwok killed (the stream is reset at the node),
    while a rollout holds its sandbox: the rollout is retried, never scored; the sandbox with
    the dead session is not reused; the new sandbox's session is one more stream."""
    path, first, _ = repo
    be = backend(cluster, namespace, path)
    task = make_task(IMAGE, first)
    hit: list = []
    streams: list[int] = []

    async def episode(lease) -> float:
        await lease.exec("echo dirty >> calc.py")
        if not hit:
            hit.append(lease.sandbox)
            streams.append(be.api_stats["execs"])
            await asyncio.to_thread(cluster_faults.restart, cluster.run_dir, component)
        res = await lease.exec("git diff --stat | tail -1; echo ok")
        return float(res.text.endswith("ok\n"))

    try:
        async with SandboxPool(be, "reuse") as pool:
            await pool.prepare([task], concurrency=1)
            result = await run_rollout(pool, task, episode, retries=2)
            assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 2)
            assert pool.counters.infra_errors.get("exec_transport") == 1
            dropped = hit[0]
            assert not dropped.alive()  # its session is dead: never handed to a rollout again
            assert result.sandbox_id != dropped.id
            assert be.api_stats["execs"] >= streams[0] + 1  # the new sandbox's own stream
            again = await run_rollout(pool, task, episode, retries=0)
            assert (again.outcome, again.reward) == (Outcome.COMPLETED, 1.0)
            assert again.sandbox_id != dropped.id
    finally:
        await _until_api_answers(cluster)


async def test_a_policy_cannot_kill_or_signal_the_agent_that_carries_its_commands(
    cluster, namespace, repo
):
    """A cheating policy tries to end the channel (to turn a failing rollout into an infra
    retry): on kwok the agent is pid 1 of the session's pid namespace, which drops every
    signal from inside that it has no handler for."""
    path, first, _ = repo
    be = backend(cluster, namespace, path, mode="pods")
    async with SandboxPool(be, "cold") as pool:
        async with pool.claim(make_task(IMAGE, first)) as lease:
            streams = be.api_stats["execs"]
            init = await lease.exec("tr '\\0' ' ' < /proc/1/cmdline")
            assert init.text.split()[1:4] == ["-I", "-u", "-c"]  # pid 1 is the agent itself
            for attack in ("kill -9 -1", "kill -9 1", "kill -STOP 1", "kill -TERM 1",
                           "kill -INT 1", "kill -HUP 1", "kill -9 $PPID",
                           "for p in $(ls /proc | grep -x '[0-9]*'); do kill -9 $p; done"):
                await lease.exec(f"{attack}; echo tried", timeout=10)
                res = await lease.exec("echo still here", timeout=10)
                assert res.text == "still here\n", attack
            assert lease.sandbox.alive() and lease.sandbox.channel == "agent"
            assert be.api_stats["execs"] == streams  # the same stream carried every command


_FLOW = "flowcontrol.apiserver.k8s.io"


def _wait_digested(cluster, name: str, timeout: float = 60.0) -> None:
    """Wait until the apiserver's APF config controller has taken FlowSchema ``name`` in: it
    writes the schema's ``Dangling`` condition once the new configuration is in effect, so a
    request sent before that is still classified by the old one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fs = cluster.custom.get_cluster_custom_object(_FLOW, "v1", "flowschemas", name)
        conds = (fs.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Dangling" and c.get("status") == "False" for c in conds):
            return
        time.sleep(0.2)  # polling the condition; nothing to watch for in this sync client
    raise AssertionError(f"FlowSchema {name} not taken in by APF within {timeout} s")


def _throttled_user(cluster, namespace: str, dest, shares: int = 0) -> tuple:
    """A ServiceAccount with cluster-admin whose every request API Priority and Fairness puts
    in a priority level of ``shares`` nominal concurrency shares (0: no seats; 1: a few of
    the server's) that rejects what it cannot seat (429 with ``Retry-After``); returns its
    kubeconfig and a cleanup function."""
    name = f"throttled-{namespace}"[:63]
    core, rbac = cluster.core, k8s.RbacAuthorizationV1Api(cluster.api_client)
    core.create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="throttled")))
    rbac.create_cluster_role_binding(k8s.V1ClusterRoleBinding(
        metadata=k8s.V1ObjectMeta(name=name),
        role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole",
                               name="cluster-admin"),
        subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name="throttled", namespace=namespace)]))
    plc = {"apiVersion": f"{_FLOW}/v1", "kind": "PriorityLevelConfiguration",
           "metadata": {"name": name},
           "spec": {"type": "Limited", "limited": {
               "nominalConcurrencyShares": shares, "lendablePercent": 0, "borrowingLimitPercent": 0,
               "limitResponse": {"type": "Reject"}}}}
    fs = {"apiVersion": f"{_FLOW}/v1", "kind": "FlowSchema", "metadata": {"name": name},
          "spec": {"priorityLevelConfiguration": {"name": name}, "matchingPrecedence": 500,
                   "distinguisherMethod": {"type": "ByUser"},
                   "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                       "name": "throttled", "namespace": namespace}}],
                       "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                          "namespaces": ["*"], "clusterScope": True}],
                       "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}
    cluster.custom.create_cluster_custom_object(_FLOW, "v1", "prioritylevelconfigurations", plc)
    cluster.custom.create_cluster_custom_object(_FLOW, "v1", "flowschemas", fs)
    _wait_digested(cluster, name)
    tok = core.create_namespaced_service_account_token(
        "throttled", namespace,
        k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[])))
    cfg = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    ctx = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])["context"]
    cfg["users"] = [{"name": "throttled", "user": {"token": tok.status.token}}]
    ctx["user"] = "throttled"
    dest.write_text(yaml.safe_dump(cfg))

    def cleanup() -> None:
        cluster.custom.delete_cluster_custom_object(_FLOW, "v1", "flowschemas", name)
        cluster.custom.delete_cluster_custom_object(_FLOW, "v1", "prioritylevelconfigurations",
                                                    name)
        rbac.delete_cluster_role_binding(name)

    return dest, cleanup


async def test_a_user_throttled_by_api_priority_and_fairness_gets_429s_retried_and_its_commands_run(
    cluster, namespace, repo, tmp_path
):
    """The real kube-apiserver's APF: the throttled user's REST requests are rejected with
    429 and ``Retry-After``, retried, counted, and answered; its pod exec upgrades are exempt
    (long-running requests), so its rollouts' commands, one pod exec each here, all run."""
    path, first, _ = repo
    kubeconfig, cleanup = _throttled_user(cluster, namespace, tmp_path / "throttled.kubeconfig")
    metrics = PoolMetrics(CollectorRegistry())
    be = KubernetesBackend(kubeconfig, namespace=namespace, mode="pods", agent=False,
                           image_map=lambda name: workdir_image(name, path))

    async def episode(lease) -> float:
        before = be.api_stats["retried"]
        results = await asyncio.gather(*(lease.exec(f"echo {i}") for i in range(15)))
        assert [r.text for r in results] == [f"{i}\n" for i in range(15)]
        assert be.api_stats["retried"] == before  # no exec upgrade was throttled
        return 1.0

    try:
        async with SandboxPool(be, "cold", metrics=metrics) as pool:
            http = await be._client()
            # APF rejects what overlaps on the level's seat; a loaded machine can serialize a
            # batch, so batches go on (at most 10) until one is rejected.
            for _ in range(10):
                lists = await asyncio.gather(*(http.request("GET", f"/api/v1/namespaces/{namespace}/pods")
                                               for _ in range(20)))
                assert all(body["kind"] == "PodList" for body in lists)
                if _retries(metrics, "429") >= 1:
                    break
            assert _retries(metrics, "429") >= 1  # APF rejected some, each retried and answered
            result = await run_rollout(pool, make_task(IMAGE, first), episode, retries=1)
            assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result.error
    finally:
        await be.aclose()
        cleanup()


async def test_a_sandbox_whose_session_dropped_while_idle_is_replaced_before_a_rollout_sees_it(
    cluster, namespace, repo
):
    """The node's kwok killed and started again while a reused sandbox waits between rollouts:
    the next claim gets a new sandbox with a live session on its first attempt."""
    path, first, _ = repo
    be = backend(cluster, namespace, path)
    task = make_task(IMAGE, first)
    seen: list = []

    async def episode(lease) -> float:
        seen.append(lease.sandbox)
        return float((await lease.exec("echo ok")).text == "ok\n")

    async with SandboxPool(be, "reuse") as pool:
        await pool.prepare([task], concurrency=1)
        assert (await run_rollout(pool, task, episode, retries=0)).reward == 1.0
        await eventually(lambda: pool.counters.resets == 1, 60, "the in-place reset")
        idle = seen[-1]
        assert idle.alive()
        await asyncio.to_thread(cluster_faults.restart, cluster.run_dir, "kwok")
        await eventually(lambda: not idle.alive(), 30, "the idle sandbox's session to end")
        result = await run_rollout(pool, task, episode, retries=0)
        assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 1)
        assert seen[-1] is not idle and seen[-1].channel == "agent"
        assert pool.counters.lost == 1  # the dead idle sandbox, dropped at the claim
