"""Another process's resource limits, and kernel keyrings, attacked from a real pod's commands.

The agent (its container's pid 1) runs as the policy's uid, and the pod's ``RuntimeDefault``
seccomp profile allows ``prlimit``: a command could give the agent a file limit of 3 (it then
fails every request) or a CPU limit (the kernel's SIGKILL reaches even a pid 1), turning the
policy's failure into an infra error. The attack is first shown to work against the agent as
the pod alone protects it (the entrypoint attached without sandpool's session), then to fail
in a sandbox of the backend, whose agent installs sandpool's seccomp filter
(``sandpool.core.agent.seccomp``, the local sandboxes' filter) before any command.
"""

from __future__ import annotations

import platform
import uuid

import pytest

from sandpool.core import errors
from sandpool.core.agent.client import AgentClient
from sandpool.core.agent.seccomp import _ABIS
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.backends.kubernetes._channel import PROTOCOLS, PodExecChannel
from sandpool.core.backends.kubernetes._entrypoint import boot_payload, entrypoint
from sandpool.core.backends.kubernetes._http import KubeHttp, Throttle
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._manifests import PodImage
from sandpool.core.classify import Verdict, classify
from tests.cluster.conftest import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

LIMITS = {"requests": {"cpu": "100m", "memory": "128Mi"},
          "limits": {"cpu": "500m", "memory": "384Mi"}}
ADD_KEY = _ABIS[platform.machine()][0].keyring[0]
# Each prints what the kernel answered: 0 when the limit was set, else the errno.
LIMIT_THE_AGENT = [
    "prlimit --pid 1 --nofile=3:3; echo prlimit-nofile=$?",
    "python3 -c 'import resource\ntry:\n resource.prlimit(1, resource.RLIMIT_CPU, (1, 1));"
    " print(\"python-cpu=0\")\nexcept OSError as e:\n print(\"python-cpu=%d\" % e.errno)'",
]


def running(cluster, namespace: str, name: str):
    pod = cluster.core.read_namespaced_pod(name, namespace)
    return pod if pod.status.phase == "Running" else None


async def test_under_runtime_default_alone_a_command_can_limit_the_agent_and_stop_its_service(
    cluster, namespace, real_node, real_images
):
    """The backend's own pod spec and entrypoint, attached without sandpool's session (so
    without its filter): one command sets the agent's file limit to 3, and the agent then
    fails every request, each an infra error the policy caused."""
    images = PodImages(None, container="sandbox", command=("sleep", "infinity"), resources=LIMITS,
                       runtime_class=None, node_selector=real_node.node_selector,
                       tolerations=list(real_node.tolerations), service_port=None,
                       disk_bytes=64 << 20, entrypoint=entrypoint("python3"))
    spec = images.spec(PodImage(real_images["swe"]))
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    cluster.core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare"}, "spec": spec})
    wait_until(lambda: running(cluster, namespace, "bare"), 180, "the pod Running")
    http = KubeHttp(None, Throttle(10, 10, 8), kubeconfig=str(cluster.kubeconfig))
    await http.open()
    try:
        ws = await http.ws_connect(
            f"/api/v1/namespaces/{namespace}/pods/bare/attach",
            [("container", "sandbox"), ("stdin", "true"), ("stdout", "true"), ("stderr", "true")],
            PROTOCOLS)
        agent = AgentClient(PodExecChannel(ws, "bare"), "bare")
        await agent.channel.write(boot_payload())
        await agent.ready(120)
        res = await agent.exec(LIMIT_THE_AGENT[0], timeout=30, cwd="/testbed", env={},
                               max_output=1 << 16)
        assert res.text.strip() == "prlimit-nofile=0", res
        for _ in range(3):  # every later request fails in the agent: an infra error each time
            with pytest.raises(errors.ExecTransportError, match="Too many open files") as caught:
                await agent.exec("echo hi", timeout=30, cwd="/testbed", env={}, max_output=1 << 16)
            assert classify(caught.value) is Verdict.INFRA
        await agent.aclose()
    finally:
        await http.aclose()


async def test_a_sandboxs_commands_cannot_limit_the_agent_nor_reach_a_keyring(
    cluster, namespace, real_node, real_images
):
    backend = KubernetesBackend(
        cluster.kubeconfig, namespace=namespace, mode="pods", run_id=uuid.uuid4().hex[:8],
        node_selector=real_node.node_selector, tolerations=list(real_node.tolerations),
        resources=LIMITS, ready_timeout=180, disk_bytes=64 << 20, agent_entrypoint=True)
    try:
        sb = await backend.create(real_images["swe"])
        for attack in LIMIT_THE_AGENT:
            res = await sb.exec(attack, timeout=60)
            assert res.text.strip().endswith("=1"), (attack, res)  # EPERM
            assert (await sb.exec("echo hi", timeout=60)).text == "hi\n"
        # The agent's limits are the container's still; a command may lower its own.
        limits = await sb.exec("grep 'open files' /proc/1/limits; ulimit -n 64 && ulimit -n",
                               timeout=60)
        assert limits.text.split()[-1] == "64" and " 3 " not in limits.text, limits
        keys = await sb.exec(["python3", "-c", (
            "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            f"r = libc.syscall({ADD_KEY}, b'user', b'leak', b'gold', 4, -4); "
            "print(r, ctypes.get_errno())")], timeout=60)
        assert keys.text.split() == ["-1", "38"], keys  # ENOSYS: no keyring can be reached
        status = await sb.exec("grep -E '^(NoNewPrivs|Seccomp_filters)' /proc/self/status",
                               timeout=60)
        assert status.text.split() == ["NoNewPrivs:", "1", "Seccomp_filters:", "2"], status
        assert sb.alive()
    finally:
        await backend.aclose()

