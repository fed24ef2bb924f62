"""Real nodes beside the kwok nodes: a kubelet, containerd, runc and CNI, and a local registry.

``cluster.py up --real-nodes N`` calls :func:`start`; ``down`` calls :func:`stop` first. A
real node ``real-node-<i>`` runs real containers, so what kwok cannot show (pid 1, file
systems, limits, pulls, network namespaces) is tested there, while kwok keeps the scale runs:

* it carries the label ``sandpool.io/node=real`` and the taint
  ``sandpool.io/real-node=true:NoSchedule``, so only pods that select it (the backend's
  ``node_selector`` and ``tolerations``) land there;
* images come from a registry (Debian's ``docker-registry``, on 127.0.0.1) under the name
  ``sandpool.test/...``: each node's containerd resolves that host to the run's registry
  (``certs.d/sandpool.test/hosts.toml``), as a cluster resolves a registry mirror. The pod
  sandbox image (``sandpool.test/pause:3.10``) is pushed there at ``up``;
  :func:`push` adds more (``cluster.py push``);
* pods get a network namespace from Debian's CNI ``ptp`` plugin and no network: the node
  rejects every packet from the node's pod subnet (iptables ``INPUT`` and ``FORWARD``), and
  the ``tuning`` plugin disables IPv6 in the pod, as a cluster whose default NetworkPolicy
  denies all traffic;
* the kubelet's ``podPidsLimit`` caps every pod's processes (Kubernetes has no per-pod field);
  CPU and memory come from each pod's ``resources.limits``;
* ``RuntimeClass`` ``sandpool-runc`` maps to a second containerd runtime handler that is runc
  (where a cluster would map ``gvisor`` to runsc, which this machine cannot have).

Everything a node makes lives under ``<run>/nodes/<node>/``, ``/run/sandpool-cluster/<id>/``
(sockets and network namespaces: short paths), its cgroup root ``/sandpool-<id>`` in every
cgroup v1 hierarchy, its iptables rules (comment ``sandpool-<id>``) and its sysctl changes;
:func:`stop` removes all of it and :func:`leftovers` says what remains. Standard library only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kubeapi import ApiError, Kube, condition
from nodeconfig import NODE_TAINT, RUNTIME_CLASS, containerd_toml, kubelet_yaml
from pki import issue_cert, write_kubeconfig
from procs import alive, free_port, is_ours, log, run_dir, save_state, spawn, wait_for
from registry import REGISTRY_HOST, push, push_pause, start_registry

__all__ = ["REGISTRY_HOST", "leftovers", "push", "start", "status_lines", "stop"]

NODE_LABEL = ("sandpool.io/node", "real")
SHORT_ROOT = Path("/run/sandpool-cluster")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# What the kubelet sets on start (setupKernelTunables); put back at `down`. ptp turns on
# forwarding for its pods' addresses.
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward")


def node_name(i: int) -> str:
    return f"real-node-{i}"


def _rid() -> str:
    """A short id of this run directory: names the node's cgroups, rules and short paths."""
    return hashlib.sha256(str(run_dir().resolve()).encode()).hexdigest()[:8]


def _node(i: int) -> dict[str, Any]:
    rid = _rid()
    base = run_dir() / "nodes" / node_name(i)
    short = SHORT_ROOT / f"{rid}-{i}"
    return {
        "name": node_name(i),
        "base": str(base),
        "short": str(short),
        "socket": str(short / "containerd.sock"),
        "cgroup": f"sandpool-{rid}-{i}",
        "comment": f"sandpool-{rid}-{i}",
    }


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


# ---- node configuration --------------------------------------------------------------------
def node_ip() -> str:
    """This machine's own non-loopback IPv4 address (the one its default route leaves from):
    the kubelet serves, and the node advertises, on it (a node's InternalIP cannot be a
    loopback address)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # sends nothing: only picks the route's source address
            ip = s.getsockname()[0]
        except OSError as e:
            raise SystemExit(f"cluster: real nodes need a non-loopback IPv4 address: {e}") from e
    if ip.startswith("127."):
        raise SystemExit("cluster: real nodes need a non-loopback IPv4 address; found none")
    return ip


def _free_subnet() -> str:
    """A /24 in 10.89.0.0/16 that no route on this machine uses yet."""
    used = _sh("ip", "-4", "route", "show").stdout
    for x in range(256):
        net = f"10.89.{x}.0/24"
        if net not in used and f"10.89.{x}." not in used:
            return net
    raise SystemExit("cluster: no free /24 left in 10.89.0.0/16 for a real node's pods")


def _cgroup_dirs(cgroup: str, unified: bool = True) -> list[Path]:
    """The node's cgroup root in every mounted cgroup hierarchy: the v1 ones, and the
    unified (v2) one of a hybrid host, where runc mirrors the same paths."""
    return [d / cgroup for d in sorted(CGROUP_ROOT.iterdir())
            if d.is_dir() and not d.is_symlink() and (unified or d.name != "unified")
            and (d / "cgroup.procs").exists()]


def _make_cgroups(cgroup: str) -> None:
    """Create the kubelet's ``cgroupRoot`` in every v1 hierarchy (it must exist)."""
    for d in _cgroup_dirs(cgroup, unified=False):
        d.mkdir(exist_ok=True)
        if d.parent.name == "cpuset":
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((d.parent / f).read_text())


# ---- start ---------------------------------------------------------------------------------
def start(state: dict[str, Any], n: int, bins: Path, pki: Path, server: str, kube: Kube,
          *, pod_pids: int) -> None:
    """Start the registry and ``n`` real nodes; return once every node is Ready.

    Raises:
        SystemExit: A tool is missing, a component exited or a node did not become Ready.
    """
    for tool in ("runc", "skopeo", "umoci", "iptables"):
        if shutil.which(tool) is None:
            raise SystemExit(f"cluster: real nodes need {tool} (apt-get install {tool})")
    if not Path("/usr/lib/cni/ptp").exists():
        raise SystemExit("cluster: real nodes need the CNI plugins "
                         "(apt-get install containernetworking-plugins)")
    state["real_nodes"] = []
    state["sysctls"] = {k: Path("/proc/sys", k).read_text().strip() for k in SYSCTLS}
    save_state(state)
    start_registry(state)
    push_pause(state, bins)
    env = dict(os.environ, PATH=f"{bins}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}")
    for i in range(n):
        node = _node(i)
        state["real_nodes"].append(node)
        save_state(state)
        _start_node(state, node, bins, pki, server, env, pod_pids)
    kube.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", {
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": RUNTIME_CLASS[0]}, "handler": RUNTIME_CLASS[1]})

    def ready() -> bool:
        for node in state["real_nodes"]:
            if condition(kube.request("GET", f"/api/v1/nodes/{node['name']}"), "Ready") != "True":
                return False
        return True

    for node in state["real_nodes"]:
        wait_for(f"{node['name']} Ready", ready, 120, state, f"kubelet-{node['name']}")


def _start_node(state: dict[str, Any], node: dict[str, Any], bins: Path, pki: Path, server: str,
                env: dict[str, str], pod_pids: int) -> None:
    base, short = Path(node["base"]), Path(node["short"])
    if base.exists():
        shutil.rmtree(base)
    for d in (base / "cni" / "net.d", base / "pki", short):
        d.mkdir(parents=True, exist_ok=True)
    # PKI: the kubelet's client identity (the Node authorizer's system:node:<name>) and its
    # serving certificate (the apiserver checks it against the cluster CA on exec and logs).
    npki = base / "pki"
    for f in ("ca.crt", "ca.key"):
        shutil.copy2(pki / f, npki / f)
    issue_cert(npki, "node", f"/O=system:nodes/CN=system:node:{node['name']}", "clientAuth", None)
    node["ip"] = node_ip()
    issue_cert(npki, "kubelet", f"/CN={node['name']}", "serverAuth",
               f"IP:{node['ip']},IP:127.0.0.1,DNS:localhost")
    (npki / "ca.key").unlink()
    write_kubeconfig(base / "kubeconfig", server, npki, user="node")
    # Registry: the images' host name resolves to the run's registry, over plain HTTP.
    hosts = base / "certs.d" / REGISTRY_HOST
    hosts.mkdir(parents=True)
    reg = state["registry"]
    (hosts / "hosts.toml").write_text(
        f'server = "http://{reg}"\n\n[host."http://{reg}"]\n  capabilities = ["pull", "resolve"]\n')
    # Network: ptp gives each pod a veth and an address; the node rejects the subnet.
    node["subnet"] = _free_subnet()
    (base / "cni" / "net.d" / "10-sandpool.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "sandpool", "plugins": [{
            "type": "ptp", "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": node["subnet"]}]],
                     "dataDir": str(base / "cni" / "ipam")}},
            # No IPv6 on the pod's veth (loopback keeps ::1): its link-local address would
            # reach the node round the IPv4 rules below.
            {"type": "tuning", "sysctl": {"net.ipv6.conf.default.disable_ipv6": "1",
                                          "net.ipv6.conf.eth0.disable_ipv6": "1"}}]}, indent=2))
    for chain in ("INPUT", "FORWARD"):
        _sh("iptables", "-I", chain, "-s", node["subnet"], "-m", "comment", "--comment",
            node["comment"], "-j", "REJECT")
    _make_cgroups(node["cgroup"])
    save_state(state)
    (base / "containerd.toml").write_text(containerd_toml(node))
    spawn(state, f"containerd-{node['name']}",
          [str(bins / "containerd"), f"--config={base / 'containerd.toml'}"], env=env)
    wait_for(f"containerd of {node['name']}", lambda: _crictl(node, bins, "info").returncode == 0,
             60, state, f"containerd-{node['name']}")
    ports = {"kubelet": free_port(), "healthz": free_port()}
    node["ports"] = ports
    (base / "kubelet.yaml").write_text(kubelet_yaml(node, npki, ports, pod_pids))
    spawn(state, f"kubelet-{node['name']}", [
        str(bins / "kubelet"), f"--config={base / 'kubelet.yaml'}",
        f"--kubeconfig={base / 'kubeconfig'}", f"--root-dir={base / 'kubelet'}",
        f"--cert-dir={npki}", f"--hostname-override={node['name']}", f"--node-ip={node['ip']}",
        f"--node-labels={NODE_LABEL[0]}={NODE_LABEL[1]}", "--v=1",
    ], env=env)
    save_state(state)


def _crictl(node: dict[str, Any], bins: Path, *args: str) -> subprocess.CompletedProcess[str]:
    ep = f"unix://{node['socket']}"
    return subprocess.run([str(bins / "crictl"), "--runtime-endpoint", ep, "--image-endpoint", ep,
                           "--timeout", "30s", *args], capture_output=True, text=True, check=False)


# ---- stop ----------------------------------------------------------------------------------
def _stop_process(state: dict[str, Any], name: str) -> None:
    p = state.get("processes", {}).get(name)
    if not p or not is_ours(p):
        return
    os.killpg(p["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 15
    while alive(p["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(p["pid"]):
        os.killpg(p["pid"], signal.SIGKILL)
    state["processes"].pop(name, None)


def _mounts_under(prefixes: list[str]) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == p or mp.startswith(p.rstrip("/") + "/") for p in prefixes):
            out.append(mp)
    return out


def _procs_of(node: dict[str, Any]) -> list[int]:
    """Processes of the node outside its components' process groups: shims (named by the
    node's socket) and whatever is still in its cgroups."""
    pids: set[int] = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if node["socket"].encode() in (d / "cmdline").read_bytes():
                    pids.add(int(d.name))
            except OSError:
                pass
    for root in _cgroup_dirs(node["cgroup"]):
        if root.exists():
            for procs in root.rglob("cgroup.procs"):
                try:
                    pids |= {int(x) for x in procs.read_text().split()}
                except OSError:
                    pass
    return sorted(p for p in pids if alive(p))


def stop(state: dict[str, Any], bins: Path | None) -> None:
    """Stop every real node and the registry and remove what they made (see the module doc).

    Order: the kubelet (so it starts nothing more), every pod through the CRI (which stops
    the containers and tears down their network namespaces with CNI), containerd, then
    whatever is left: stray processes, mounts, cgroups, rules, the bridge-less veths' netns
    files, and the kubelet's sysctls put back.
    """
    nodes = state.get("real_nodes") or []
    for node in nodes:
        _stop_process(state, f"kubelet-{node['name']}")
        if bins is not None and Path(node["socket"]).exists():
            _crictl(node, bins, "rmp", "--all", "--force")
        _stop_process(state, f"containerd-{node['name']}")
        deadline = time.monotonic() + 10
        while (pids := _procs_of(node)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for mp in sorted(_mounts_under([node["base"], node["short"]]), key=len, reverse=True):
            _sh("umount", "-l", mp, check=False)
        for d in _cgroup_dirs(node["cgroup"]):
            if d.exists():
                for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    sub.rmdir()
                d.rmdir()
        for rule in _sh("iptables", "-S").stdout.splitlines():
            if f"--comment {node['comment']}" in rule:
                _sh("iptables", *rule.replace("-A ", "-D ", 1).split(), check=False)
        shutil.rmtree(node["short"], ignore_errors=True)
        save_state(state)
    _stop_process(state, "registry")
    # The shims' sockets live in a directory containerd does not let one move; left empty.
    for d in (Path("/run/containerd/s"), Path("/run/containerd"), SHORT_ROOT):
        try:
            d.rmdir()
        except OSError:
            pass  # not empty: another cluster's
    for k, v in (state.get("sysctls") or {}).items():
        try:
            Path("/proc/sys", k).write_text(v)
        except OSError as e:
            log(f"down: could not put back {k}={v}: {e}")
    save_state(state)


def leftovers(state: dict[str, Any]) -> list[str]:
    """What the real nodes of ``state`` left on this machine: processes, mounts, cgroups,
    iptables rules, network namespaces and veths of their pods. Empty after a clean ``down``."""
    out = []
    for node in state.get("real_nodes") or []:
        out += [f"process {p} of {node['name']}" for p in _procs_of(node)]
        out += [f"mount {m}" for m in _mounts_under([node["base"], node["short"]])]
        out += [f"cgroup {d}" for d in _cgroup_dirs(node["cgroup"]) if d.exists()]
        out += [f"iptables rule {r}" for r in _sh("iptables", "-S").stdout.splitlines()
                if f"--comment {node['comment']}" in r]
        short = Path(node["short"])
        out += [f"network namespace {p}" for d in (short.rglob("netns") if short.exists() else [])
                for p in d.iterdir()]
        net = ipaddress.ip_network(node.get("subnet") or "10.89.255.0/24")
        for line in _sh("ip", "-4", "-o", "addr", "show").stdout.splitlines():
            m = re.search(r"inet (\S+)/", line)
            if m and ipaddress.ip_address(m.group(1)) in net:
                out.append(f"interface {line.split()[1]} with {m.group(1)}")
    return out


def status_lines(state: dict[str, Any], kube: Kube) -> list[str]:
    """One line per real node: Ready, kubelet and runtime versions, pods, and the registry."""
    lines = []
    for node in state.get("real_nodes") or []:
        try:
            obj = kube.request("GET", f"/api/v1/nodes/{node['name']}", timeout=5)
        except (ApiError, OSError) as e:
            lines.append(f"  {node['name']:14} unknown ({e})")
            continue
        info = obj.get("status", {}).get("nodeInfo", {})
        ready = "Ready" if condition(obj, "Ready") == "True" else "NotReady"
        lines.append(
            f"  {node['name']:14} {ready:8} "
            f"kubelet {info.get('kubeletVersion', '?')}  runtime {info.get('containerRuntimeVersion', '?')}"
            f"  pods {node.get('subnet', '?')}  ({NODE_LABEL[0]}={NODE_LABEL[1]}, taint {NODE_TAINT})")
    if state.get("registry"):
        lines.append(f"  registry       {state['registry']} (pods pull {REGISTRY_HOST}/...)")
    return lines
