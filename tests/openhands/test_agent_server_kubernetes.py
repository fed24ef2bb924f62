"""OpenHands' agent-server in Kubernetes pods: ``Conversation(agent, SandpoolWorkspace(pool, task))``.

The real local cluster (kube-apiserver, the agent-sandbox controller, kwok nodes; see
``hack/cluster``): each warm pod starts the agent-server while the pool fills, and the
workspace reaches it through the API server's ``pods/portforward`` (kwok's ``PortForward``
on the node side) behind the 127.0.0.1 relay. The LLM is the scripted litellm provider
loaded into the server process, as in ``test_agent_server.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sandpool.core import errors
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.classify import Verdict, classify
from sandpool.core.paths import sandpool_home
from sandpool.core.pool import PoolLimits, SandboxPool
from sandpool.core.task import Task
from sandpool.integrations.openhands.pod_server import agent_server_pod_service
from sandpool.integrations.openhands.server import agent_server_env
from sandpool.integrations.openhands.workspace import SandpoolWorkspace
from tests.cluster.kwok_images import local_pack_image_map
from tests.cluster.conftest import RUN_ID, RUN_ID_LABEL, cluster, wait_until  # noqa: F401
from tests.openhands.test_agent_server import SERVER_MODULES, gold_steps, run_episode
from tests import waiting
from tests.waiting import until

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def k8s_namespace(cluster):  # noqa: F811 - the session fixture imported above
    core = cluster.core
    name = f"t-{RUN_ID}-openhands"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={RUN_ID_LABEL: RUN_ID})))
    wait_until(lambda: _exists(lambda: core.read_namespaced_service_account("default", name)), 60,
               "the namespace's default service account")
    try:
        yield name
    finally:
        core.delete_namespace(name)


def _exists(read) -> bool:  # type: ignore[no-untyped-def]
    try:
        read()
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


def _pod_visible(src: Path) -> Path:
    """``src`` where a kwok pod can read it: a kwok pod's processes see the host's files except
    ``/tmp``, which is the pod's own (``hack/cluster/container.sh``), so a checkout under
    /tmp (a CI clone) is copied under sandpool's home, keyed by its content."""
    digest = hashlib.sha256()
    for f in sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(f.relative_to(src)).encode() + b"\0" + f.read_bytes())
    dest = sandpool_home() / "openhands" / f"pod-python-path-{digest.hexdigest()[:16]}"
    if not dest.exists():
        tmp = dest.with_name(dest.name + f".{os.getpid()}")
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("__pycache__"))
        os.replace(tmp, dest)
    return dest


def _backend(cluster, namespace: str, images_root: Path, **service_kw) -> KubernetesBackend:  # noqa: F811
    service = agent_server_pod_service(agent_server_env(), **service_kw)
    return KubernetesBackend(cluster.kubeconfig, namespace=namespace, image_map=local_pack_image_map(images_root),
                             service=service, ready_timeout=300)


@pytest.fixture(scope="module")
async def k8s_pool(cluster, k8s_namespace, test_images_root, calc_commits, calc_task):  # noqa: F811
    backend = _backend(cluster, k8s_namespace, test_images_root, preload=("sandpool_scripted_llm",),
                       python_path=(str(_pod_visible(SERVER_MODULES)),))
    # A server takes seconds to start, and much longer on a loaded CI machine.
    async with SandboxPool(backend, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        await pool.prepare([calc_task], concurrency=2, rollouts_per_task=2)
        yield pool


def _pod_workdir(cluster, namespace: str, pod: str) -> Path:  # noqa: F811
    ann = cluster.core.read_namespaced_pod(pod, namespace).metadata.annotations
    return Path(ann["sandpool.io/workdir"])


async def test_pod_server_answers_through_the_port_forward_without_starting_at_claim(k8s_pool, calc_task):
    assert k8s_pool.counters.created == 2, k8s_pool.counters  # both pods started their server

    def claim_and_ping() -> tuple[str, str]:
        with SandpoolWorkspace(k8s_pool, calc_task) as ws:
            assert ws.alive  # /health through the relay and the port-forward
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", ws.host)
            res = ws.execute_command("pwd && git rev-parse HEAD")
            assert res.exit_code == 0, res
            return res.stdout.split()[0], ws.lease.sandbox.pod

    cwd, pod = await asyncio.to_thread(claim_and_ping)
    assert cwd == calc_task.workdir and pod
    assert k8s_pool.counters.created == 2  # the claim took a warm pod and its running server


async def test_gold_patch_conversation_in_a_pod_scores_one(k8s_pool, calc_task):
    reward = await asyncio.to_thread(run_episode, k8s_pool, calc_task, gold_steps(calc_task))
    assert reward == 1.0


async def test_conversation_in_a_pod_that_does_nothing_scores_zero(k8s_pool, calc_task):
    reward = await asyncio.to_thread(run_episode, k8s_pool, calc_task, [{"text": "I give up."}])
    assert reward == 0.0


async def test_reset_keeps_the_pod_server_and_the_next_rollout_starts_clean(k8s_pool, calc_task):
    assert await asyncio.to_thread(run_episode, k8s_pool, calc_task, gold_steps(calc_task)) == 1.0
    assert await asyncio.to_thread(run_episode, k8s_pool, calc_task, [{"text": "noop"}]) == 0.0
    assert k8s_pool.counters.created == 2 and k8s_pool.counters.quarantines == 0


async def test_a_file_planted_in_the_pod_server_dir_quarantines_the_pod(k8s_pool, calc_task):
    quarantined = k8s_pool.counters.quarantines
    plant = 'echo planted > "${SANDPOOL_POD_RUN:-/run/sandpool}/service/planted" && echo ok'
    steps = [{"tool": "terminal", "arguments": {"command": plant}}, {"text": "done"}]
    assert await asyncio.to_thread(run_episode, k8s_pool, calc_task, steps) == 0.0
    # The release resets the pod in place; the planted file fails its service's check.
    await until(lambda: k8s_pool.counters.quarantines == quarantined + 1,
                "the in-place reset to quarantine the pod", timeout=300)
    assert "planted" in str(k8s_pool.counters.quarantine_reasons[-1]), k8s_pool.counters.quarantine_reasons


async def test_concurrent_workspaces_get_separate_pods(k8s_pool, calc_task):
    both_hold_one = threading.Barrier(2, timeout=300)

    def one(name: str) -> tuple[str, str]:
        with SandpoolWorkspace(k8s_pool, calc_task) as ws:
            ws.execute_command(f"echo {name} >> owner.txt")
            both_hold_one.wait()
            return ws.lease.sandbox.pod, ws.execute_command("cat owner.txt").stdout

    (a_pod, a_out), (b_pod, b_out) = await asyncio.gather(asyncio.to_thread(one, "alpha"),
                                                          asyncio.to_thread(one, "beta"))
    assert a_pod != b_pod and a_out == "alpha\n" and b_out == "beta\n"


async def test_pod_deleted_mid_conversation_is_infra(cluster, k8s_pool, k8s_namespace, calc_task):  # noqa: F811
    steps = [{"tool": "terminal", "arguments": {"command": "touch started && sleep 120"}},
             {"tool": "terminal", "arguments": {"command": "echo never"}},
             {"text": "done"}]

    def delete_once_started(ws: SandpoolWorkspace) -> None:
        pod = ws.lease.sandbox.pod
        marker = _pod_workdir(cluster, k8s_namespace, pod) / "started"

        def watch() -> None:
            wait_until(marker.exists, 300, "the first command to start in the pod")
            cluster.core.delete_namespaced_pod(pod, k8s_namespace, grace_period_seconds=0)

        threading.Thread(target=watch, daemon=True).start()

    with pytest.raises(errors.InfraError):
        await asyncio.to_thread(run_episode, k8s_pool, calc_task, steps, delete_once_started)


async def test_a_pod_server_killed_from_inside_is_the_policys_failure_not_infra(k8s_pool, calc_task):
    # As on the local backend: the pod lives, so only a process of the rollout can have sent
    # the SIGKILL; as infra, a failing policy would turn its reward 0 into a retried rollout.
    # (Driven through the lease, not a conversation: on kwok a port-forward to a port nobody
    # listens on stays open instead of failing, so OpenHands' client would wait out its timeout.)
    def kill_and_judge() -> tuple[list[str], errors.SandpoolError | None]:
        with SandpoolWorkspace(k8s_pool, calc_task) as ws:
            pid = ws.lease.sandbox._service.pid  # as the pod's processes see it
            assert ws._run(ws.lease.sandbox.service_problems()) == []
            assert ws._run(ws.lease.exec(f"kill -9 {pid}")).ok
            # SIGKILL of a many-threaded process takes a moment: its threads exit one by one.
            problems = waiting.wait_until(lambda: ws._run(ws.lease.sandbox.service_problems()),
                                          "the killed server to be gone", interval=0.1)
            return problems, ws._server_killed()

    problems, err = await asyncio.to_thread(kill_and_judge)
    assert problems and ("gone" in problems[0] or "dead" in problems[0]), problems
    assert isinstance(err, errors.ServiceKilled) and classify(err) is Verdict.POLICY


async def test_nothing_left_running_after_close(cluster, k8s_namespace, test_images_root, calc_commits,  # noqa: F811
                                                calc_task):
    backend = _backend(cluster, k8s_namespace, test_images_root)
    async with SandboxPool(backend, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        await pool.prepare([calc_task], concurrency=1)

        def use() -> tuple[str, int]:
            with SandpoolWorkspace(pool, calc_task) as ws:
                assert ws.execute_command("true").exit_code == 0
                return ws.lease.sandbox.pod, ws._relay.port  # type: ignore[union-attr]

        pod, relay_port = await asyncio.to_thread(use)
        workdir = str(_pod_workdir(cluster, k8s_namespace, pod))
        assert any("agent_server" in c or "uvicorn" in c for c in _pod_processes(workdir)), \
            _pod_processes(workdir)
    # The relay no longer listens, the pod is deleted, none of its processes (agent, server,
    # port-forward bridges) is left on the node.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", relay_port), timeout=5).close()
    wait_until(lambda: not _exists(lambda: cluster.core.read_namespaced_pod(pod, k8s_namespace)), 120,
               "the pod to be deleted")
    wait_until(lambda: not _pod_processes(workdir), 60, "the pod's processes to end")
    bridges = subprocess.run(["pgrep", "-f", f"{workdir}.run/ports"], capture_output=True, text=True)
    assert bridges.stdout == ""


def _pod_processes(workdir: str) -> list[str]:
    """Command lines of the host processes of a kwok pod (its exec'd processes carry
    ``SANDPOOL_WORKDIR=<workdir>``)."""
    needle = f"SANDPOOL_WORKDIR={workdir}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out
