"""The Kubernetes backend on real containers: the agent out of the policy's reach, no
network, limits from the pod spec, the reset inside the container, and the interpreter
fallback (a kubelet + containerd + runc node; see hack/cluster/realnode.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from pathlib import Path

import pytest

from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.conformance import check_backend
from sandpool.core.reset import record_pristine, reset_in_place

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

LIMITS = {"requests": {"cpu": "100m", "memory": "128Mi"},
          "limits": {"cpu": "500m", "memory": "384Mi"}}


def real_backend(cluster, namespace, real_node, **kw) -> KubernetesBackend:
    kw.setdefault("resources", LIMITS)
    return KubernetesBackend(
        cluster.kubeconfig, namespace=namespace, mode="pods", run_id=uuid.uuid4().hex[:8],
        node_selector=real_node.node_selector, tolerations=list(real_node.tolerations),
        ready_timeout=180, disk_bytes=64 << 20, agent_entrypoint=True, **kw)


@pytest.fixture
async def real_sandbox(cluster, namespace, real_node, real_images):
    backend = real_backend(cluster, namespace, real_node)
    sb = await backend.create(real_images["swe"])
    try:
        yield sb
    finally:
        await backend.aclose()


async def answering(sb) -> bool:
    res = await sb.exec("echo alive", timeout=60)
    return res.text == "alive\n"


async def test_the_agent_is_the_containers_pid_1_and_survives_kill_9_of_1_and_of_minus_1(
    real_sandbox,
):
    sb = real_sandbox
    res = await sb.exec("tr '\\0' ' ' < /proc/1/cmdline", timeout=30)
    assert "sandpool-agent" in res.text or "-I -u -c" in res.text, res.text
    for cmd in ("kill -9 1", "kill -STOP 1", "kill -9 -1", "kill -TERM -1; kill -9 -1"):
        await sb.exec(cmd, timeout=30)
        assert sb.alive() and await answering(sb), f"the agent stopped answering after {cmd!r}"


async def test_the_policy_cannot_ptrace_the_agent_or_read_its_channel(real_sandbox):
    sb = real_sandbox
    probe = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             "r = libc.ptrace(16, 1, 0, 0); print(r, ctypes.get_errno())")  # PTRACE_ATTACH
    res = await sb.exec(["python3", "-c", probe], timeout=30)
    assert res.text.split() == ["-1", "1"], res.text  # EPERM
    res = await sb.exec("ls /proc/1/fd; cat /proc/1/environ", timeout=30)
    assert res.exit_code != 0 and "Permission denied" in res.err_text, res
    assert await answering(sb)


async def test_a_fork_bomb_and_a_memory_bomb_leave_the_agent_answering(real_sandbox):
    sb = real_sandbox
    # The bomb fills the pod's pid limit; the command's timeout kills all of it (its group,
    # its setsid escapees, whatever carries its marker), and the agent, pid 1, answers again.
    bomb = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 60", timeout=5)
    assert bomb.timed_out
    assert await answering(sb)
    assert await sb.processes() == []
    mem = await sb.exec(["python3", "-c", "x = []\nwhile True: x.append(bytearray(32 << 20))"],
                        timeout=120)
    assert mem.exit_code == 137, mem  # OOM-killed by the pod's memory limit, not the agent
    assert await answering(sb)
    spin = await sb.exec("for i in 1 2 3 4; do (while :; do :; done) & done; echo spun", timeout=30)
    assert spin.text == "spun\n"
    assert await answering(sb)  # throttled to the pod's CPU limit, still served
    assert await sb.kill_strays() >= 4


_IDLE_PROBE = """import os
print(os.sched_getscheduler(0) == os.SCHED_IDLE)
try:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    print("left SCHED_IDLE")
except OSError as exc:
    print("stays", exc.errno)
"""


async def test_a_policy_keeping_the_cpu_busy_cannot_starve_the_agent(real_sandbox):
    # The agent and the commands share the pod's half core: commands run SCHED_IDLE, which an
    # unprivileged process cannot leave, so 100 spinners do not keep the agent from answering
    # (without it, it got a 101st of the quota and four 8 MiB reads outlasted the 60 s wait).
    sb = real_sandbox
    spin = await sb.exec("head -c 8M /dev/urandom > /tmp/at; for i in $(seq 100); do"
                         " sh -c 'while :; do :; done' >/dev/null 2>&1 & done; echo spun", timeout=120)
    assert spin.text == "spun\n", spin
    got = await asyncio.gather(*(sb.read_file("/tmp/at") for _ in range(4)))
    assert {len(g) for g in got} == {8 << 20}
    out = await sb.exec("cat /tmp/at", timeout=30, max_output=16 << 20)
    assert len(out.stdout) == 8 << 20 or out.timed_out, out.exit_code
    assert await answering(sb)
    assert await sb.kill_strays() >= 100
    res = await sb.exec(["python3", "-c", _IDLE_PROBE], timeout=30)
    assert res.text.split("\n")[:2] == ["True", "stays 1"], res


async def test_commands_have_no_network(real_sandbox, real_node):
    """A listener on the node, on every address; the pod can reach none of them."""
    sb = real_sandbox
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    peers: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, peer = srv.accept()
            except OSError:  # closed
                return
            peers.append(peer[0])
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the listener works
            pass
        node = next(n for n in real_node.state["real_nodes"] if n["name"] == real_node.name)
        gateway = node["subnet"].rsplit(".", 1)[0] + ".1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet: the kernel picks the node's own address
            node_ip = s.getsockname()[0]
        for host in (gateway, node_ip):
            probe = (f"import socket; socket.create_connection(({host!r}, {port}), timeout=10); "
                     "print('connected')")
            res = await sb.exec(["python3", "-c", probe], timeout=60)
            assert res.exit_code != 0 and "connected" not in res.text, (host, res)
        assert peers == ["127.0.0.1"], peers
    finally:
        srv.close()


#: Run in the pod after an IPv4 packet to its gateway (the node's side of its veth): the
#: pod's IPv6 addresses, whether it may open a raw socket, and a TCP connect to the node's
#: side over IPv6 link-local (its EUI-64 address, from the gateway's MAC in the ARP cache).
_IPV6_PROBE = """
import socket, sys
print("v6:", sorted(ln.split()[-1] for ln in open("/proc/net/if_inet6")))
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
    print("raw: yes")
except OSError as exc:
    print("raw:", exc.strerror)
gw = sys.argv[1]
mac = next(ln.split()[3] for ln in open("/proc/net/arp").read().splitlines()[1:]
           if ln.split()[0] == gw).split(":")
mac[0] = "%02x" % (int(mac[0], 16) ^ 2)
peer = "fe80::%s%s:%sff:fe%s:%s%s%%eth0" % tuple(mac)
try:
    socket.create_connection((peer, int(sys.argv[2])), timeout=10)
    print("v6 node: connected")
except OSError as exc:
    print("v6 node:", exc.strerror)
"""


async def test_commands_have_no_ipv6_and_no_raw_sockets(real_sandbox, real_node):
    """The node rejects the pod subnet's IPv4; IPv6 link-local (an address every veth has,
    that no IPv4 rule sees) and raw frames (a forged source address) must not get round it:
    the pod's veth has no IPv6 address (loopback keeps ::1) and the pod no CAP_NET_RAW."""
    sb = real_sandbox
    srv = socket.socket(socket.AF_INET6)
    srv.bind(("::", 0))  # every address of the node, link-local ones included
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        node = next(n for n in real_node.state["real_nodes"] if n["name"] == real_node.name)
        gateway = node["subnet"].rsplit(".", 1)[0] + ".1"
        poke = f"import socket; socket.create_connection(({gateway!r}, {port}), timeout=10)"
        assert (await sb.exec(["python3", "-c", poke], timeout=60)).exit_code != 0
        res = await sb.exec(["python3", "-c", _IPV6_PROBE, gateway, str(port)], timeout=60)
        lines = res.text.splitlines()
        assert lines[:2] == ["v6: ['lo']", "raw: Operation not permitted"], res
        assert lines[2].startswith("v6 node: ") and "connected" not in lines[2], res
    finally:
        srv.close()


async def test_cpu_memory_and_pid_limits_come_from_the_pod_spec(real_sandbox, real_node, cluster,
                                                               namespace):
    sb = real_sandbox
    res = await sb.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes "
                        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us",
                        timeout=30)
    assert res.text.split() == [str(384 << 20), "50000", "100000"], res.text
    uid = cluster.core.read_namespaced_pod(sb.pod, namespace).metadata.uid
    node = real_node.state["real_nodes"][0]
    pod_cg = list(Path("/sys/fs/cgroup/pids", node["cgroup"]).rglob(f"pod{uid}"))
    assert len(pod_cg) == 1, pod_cg
    assert (pod_cg[0] / "pids.max").read_text().strip() == "1024"  # the kubelet's podPidsLimit


async def test_the_reset_inside_the_container_undoes_a_rollout_or_cannot_be_escaped(
    real_sandbox, real_images
):
    """A planted hook, a leftover process and edits are undone and verified against the
    image; a change outside the repo and /tmp cannot be made (the root is read-only)."""
    sb = real_sandbox
    task = json.loads(Path(real_images["task"]).read_text())
    await record_pristine(sb)
    mess = ("printf '#!/bin/sh\\necho planted\\n' > .git/hooks/pre-commit; "
            "chmod +x .git/hooks/pre-commit; echo x >> calcpkg/__init__.py; echo t > /tmp/t; "
            "(setsid sleep 600 &); echo done")
    assert (await sb.exec(mess, timeout=30)).text == "done\n"
    outside = await sb.exec("echo x > /etc/sandpool-outside; echo x >> /usr/lib/os-release",
                            timeout=30)
    assert outside.exit_code != 0 and "Read-only file system" in outside.err_text, outside
    outcome = await reset_in_place(sb, task["base_commit"])
    assert outcome.ok, outcome.problems
    assert outcome.killed >= 1
    res = await sb.exec("ls .git/hooks | grep -v sample; git status --porcelain; ls -A /tmp; "
                        "test -e /etc/sandpool-outside && echo outside", timeout=30)
    assert res.text == "", res.text
    assert await sb.processes() == []


async def test_an_image_without_a_usable_python_falls_back_to_per_command_exec_and_says_so(
    cluster, namespace, real_node, old_python_image, caplog
):
    for python in ("python3", old_python_image["python27"]):  # missing; too old
        backend = real_backend(cluster, namespace, real_node, agent_python=python)
        try:
            sb = await backend.create(old_python_image["image"])
            assert (await sb.exec("echo hi; exit 3", timeout=30)).exit_code == 3
            assert backend.api_stats["agent_fallbacks"] == 1
            assert backend.api_stats["fallback_sandboxes"] == 1
        finally:
            await backend.aclose()
        said = [r.getMessage() for r in caplog.records if "fall back" in r.getMessage()]
        assert any(f"no {python} >= 3.6" in m for m in said), said
        caplog.clear()


async def test_the_agent_runs_on_python_3_6_the_oldest_it_supports(
    cluster, namespace, real_node, real_images, old_python_image
):
    """The whole conformance suite with the agent run by Python 3.6 (the image is the SWE
    test image's, so its repo is at the task's commit)."""
    task = json.loads(Path(real_images["task"]).read_text())
    backend = real_backend(cluster, namespace, real_node, agent_python=old_python_image["python36"])

    def delete_pod(sb) -> None:
        cluster.core.delete_namespaced_pod(sb.pod, sb._target.namespace, grace_period_seconds=0)

    try:
        report = await check_backend(backend, old_python_image["image"],
                                     commit=task["base_commit"], disk_bytes=64 << 20,
                                     kill=lambda sb: asyncio.to_thread(delete_pod, sb))
    finally:
        await backend.aclose()
    print(report.render_text())
    assert backend.api_stats["fallback_sandboxes"] == 0
    assert report.ok, report.failed
