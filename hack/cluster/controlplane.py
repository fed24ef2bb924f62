"""Start and stop the cluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
the agent-sandbox controller, then the kwok nodes (kwoknodes.py) and, with
``--real-nodes``, the real ones (realnode.py).

:func:`up` and :func:`down` are ``cluster.py up`` and ``down``; what they started (pids,
ports, logs) is recorded in the run directory's ``state.json`` (procs.py). Standard
library only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kwoknodes
import nodebuild
import realnode
from cpbuild import build, crd_files
from kubeapi import Kube, condition, split_yaml_documents
from pki import make_pki, write_kubeconfig
from procs import (
    alive,
    free_port,
    group_members,
    is_ours,
    kubeconfig_path,
    load_state,
    log,
    run_dir,
    save_state,
    spawn,
    wait_for,
)

# What `up` writes into the run directory (and clears at the next `up`).
RUN_ENTRIES = (
    "state.json",
    "pki",
    "etcd",
    "logs",
    "pods",
    "meta",
    "kubeconfig",
    "kwok.yaml",
    "provisioner.json",
    "pod-bin",
    "nodes",
    "registry",
    "registry.yml",
)
# Start order; `down` stops in reverse.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "agent-sandbox-controller",
    "provisioner",
    "kwok",
)


def running(state: dict[str, Any] | None) -> list[str]:
    """The components of ``state`` whose recorded process is still ours and alive."""
    if not state:
        return []
    return [n for n, p in state.get("processes", {}).items() if is_ours(p)]


def up(args: argparse.Namespace) -> None:
    """Build if needed, start every component in a fresh run directory, wait until ready.

    ``args`` are cluster.py's ``up`` flags. On any failure what was started is stopped.

    Raises:
        SystemExit: Already running, or a component failed to start (the message names its log).
    """
    t_start = time.monotonic()
    if running(load_state()):
        sys.exit(f"cluster: already running ({', '.join(running(load_state()))}); run `down` first")
    out = build()
    if args.real_nodes:
        nodebuild.build_node()
    if (old := load_state()) and old.get("real_nodes"):  # an earlier run that did not get to `down`
        realnode.stop(old, None)
    for attempt in range(1, _UP_ATTEMPTS + 1):
        try:
            _up_once(args, out, t_start)
            return
        except SystemExit as e:
            # Another program can take a drawn port before our server listens on it: new ports.
            if "address already in use" not in str(e) or attempt == _UP_ATTEMPTS:
                raise
            log(f"up: a port was taken before a component listened (try {attempt}); new ports")


_UP_ATTEMPTS = 3


def _up_once(args: argparse.Namespace, out: Path, t_start: float) -> None:
    t_up = time.monotonic()
    rd = run_dir()
    # A fresh cluster each time: clear what an earlier `up` left (and nothing else).
    for entry in RUN_ENTRIES:
        path = rd / entry
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    rd.mkdir(parents=True, exist_ok=True)
    make_pki(rd / "pki")
    ports = {
        k: free_port()
        for k in (
            "etcd_client",
            "etcd_peer",
            "apiserver",
            "kwok",
            "sandbox_metrics",
            "sandbox_probe",
        )
    }
    server = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfig = kubeconfig_path()
    state: dict[str, Any] = {
        "build_dir": str(out),
        "run_dir": str(rd),
        "server": server,
        "kubeconfig": str(kubeconfig),
        "ports": ports,
        "nodes": args.nodes,
        "real_nodes": [],
        "processes": {},
        "pod_root": str(rd / "pods"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save_state(state)
    try:
        _start(state, args, out)
    except BaseException:
        log("up failed; stopping what was started")
        down(None)
        raise
    state["up_seconds"] = round(time.monotonic() - t_up, 1)
    save_state(state)
    log(
        f"up: ready in {state['up_seconds']} s after the build ({time.monotonic() - t_start:.1f} s in all)"
    )
    log(f"kubeconfig: {kubeconfig}")


def _start(state: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    bins = out / "bin"
    pki = Path(state["run_dir"]) / "pki"
    ports = state["ports"]
    _start_etcd(state, bins)
    kube = _start_apiserver(state, bins, pki, args.apiserver_arg)
    write_kubeconfig(Path(state["kubeconfig"]), state["server"], pki)
    common = [f"--kubeconfig={state['kubeconfig']}", "--leader-elect=false", "--secure-port=0"]
    spawn(
        state,
        "kube-controller-manager",
        [
            str(bins / "kube-controller-manager"),
            *common,
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
        ],
    )
    spawn(state, "kube-scheduler", [str(bins / "kube-scheduler"), *common])
    _install_crds(kube, out)
    _start_sandbox_controller(state, args, bins)
    kwoknodes.start(state, args, out, pki, kube)
    # Default service account in `default` (the controller-manager creates one per namespace).
    wait_for(
        "service account default/default",
        lambda: (
            kube.request("GET", "/api/v1/namespaces/default/serviceaccounts/default") is not None
        ),
        30,
    )
    wait_for(
        "agent-sandbox-controller /readyz",
        lambda: (
            urllib.request.urlopen(
                f"http://127.0.0.1:{ports['sandbox_probe']}/readyz", timeout=2
            ).status
            == 200
        ),
        30,
        state,
        "agent-sandbox-controller",
    )
    if args.real_nodes:
        realnode.start(state, args.real_nodes, nodebuild.build_node() / "bin", pki,
                       state["server"], kube, pod_pids=args.real_node_pod_pids)
    for name in COMPONENTS:
        if not alive(state["processes"][name]["pid"]):
            raise SystemExit(
                f"cluster: {name} is not running; see {state['processes'][name]['log']}"
            )


def _start_etcd(state: dict[str, Any], bins: Path) -> None:
    ec, ep = state["ports"]["etcd_client"], state["ports"]["etcd_peer"]
    spawn(
        state,
        "etcd",
        [
            str(bins / "etcd"),
            "--name=node0",
            f"--data-dir={run_dir() / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{ec}",
            f"--advertise-client-urls=http://127.0.0.1:{ec}",
            f"--listen-peer-urls=http://127.0.0.1:{ep}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ep}",
            f"--initial-cluster=node0=http://127.0.0.1:{ep}",
            "--auto-compaction-retention=1",
            "--quota-backend-bytes=8589934592",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
    )
    wait_for(
        "etcd",
        lambda: (
            b'"health":"true"'
            in urllib.request.urlopen(f"http://127.0.0.1:{ec}/health", timeout=2).read()
        ),
        30,
        state,
        "etcd",
    )


def _start_apiserver(
    state: dict[str, Any], bins: Path, pki: Path, extra_args: list[str]
) -> Kube:
    """Start kube-apiserver (with ``extra_args`` last); return a client once it is ready."""
    spawn(
        state,
        "kube-apiserver",
        [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{state['ports']['etcd_client']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={state['ports']['apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={pki / 'admin.crt'}",
            f"--kubelet-client-key={pki / 'admin.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
            *extra_args,
        ],
    )
    kube = Kube.from_pki(state["server"], pki)
    wait_for(
        "kube-apiserver /readyz",
        lambda: kube.request("GET", "/readyz", timeout=3) == "ok",
        60,
        state,
        "kube-apiserver",
    )
    return kube


def _install_crds(kube: Kube, out: Path) -> None:
    """Create the build's CRDs (the apiserver parses YAML bodies itself); wait until Established."""
    names = []
    for f in crd_files(out):
        for doc in split_yaml_documents(f.read_text()):
            obj = kube.request(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                doc,
                content_type="application/yaml",
            )
            names.append(obj["metadata"]["name"])

    def established() -> bool:
        return all(
            condition(
                kube.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{n}"),
                "Established",
            )
            == "True"
            for n in names
        )

    wait_for("CRDs Established", established, 30)


def _start_sandbox_controller(state: dict[str, Any], args: argparse.Namespace, bins: Path) -> None:
    ports = state["ports"]
    spawn(
        state,
        "agent-sandbox-controller",
        [
            str(bins / "agent-sandbox-controller"),
            f"--kubeconfig={state['kubeconfig']}",
            "--leader-elect=false",
            "--extensions=true",
            f"--metrics-bind-address=127.0.0.1:{ports['sandbox_metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{ports['sandbox_probe']}",
            f"--sandbox-warm-pool-max-refill-rate={args.warm_pool_max_refill_rate}",
            f"--sandbox-warm-pool-replenish-delay={args.warm_pool_replenish_delay}",
            *args.controller_arg,
        ],
        env=dict(os.environ, KUBECONFIG=state["kubeconfig"]),
    )


def down(_: argparse.Namespace | None) -> None:
    """Stop every process ``up`` started (real nodes first), SIGTERM then SIGKILL per group.

    Raises:
        SystemExit: A process, or something a real node made, is left.
    """
    state = load_state()
    if not state:
        log("down: nothing recorded as running")
        return
    if state.get("real_nodes"):
        node_bins = nodebuild.node_build_dir() / "bin"
        realnode.stop(state, node_bins if node_bins.exists() else None)
    procs = state.get("processes", {})
    order = [n for n in reversed(COMPONENTS) if n in procs] + [
        n for n in procs if n not in COMPONENTS
    ]
    pgids = {p["pid"] for p in procs.values()}  # each was started as its own session/group leader
    for name in order:
        p = procs[name]
        if not is_ours(p):
            continue
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 10
        while alive(p["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    # Whatever is left in those process groups (exec'd commands, stragglers): kill.
    deadline = time.monotonic() + 5
    while (left := group_members(pgids)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    left = group_members(pgids)
    state["processes"] = {}
    state["stopped"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save_state(state)
    if left:
        sys.exit(f"cluster: down: processes still alive: {left}")
    if remains := realnode.leftovers(state):
        sys.exit("cluster: down: the real nodes left:\n  " + "\n  ".join(remains))
    log("down: all cluster processes stopped")
