#!/usr/bin/env python3
"""Build, start and stop the local Kubernetes control plane for tests and benchmarks.

Usage:
    python3 hack/cluster/cluster.py build            # compile into the cache (no-op when cached)
    python3 hack/cluster/cluster.py up [--nodes 10] [--real-nodes 1]
                                                     # build if needed, start, wait until ready
    python3 hack/cluster/cluster.py status           # processes, endpoints, log files
    python3 hack/cluster/cluster.py push SRC IMAGE   # an image into the real nodes' registry
    python3 hack/cluster/cluster.py down             # stop every process `up` started

The real components are built with the machine's Go toolchain from the Go module
proxy, at the versions pinned in hack/cluster/versions.env. Standard library only (it runs
before any venv exists, CI's first step); its parts: gobuild.py (Go builds), procs.py
(processes and state), pki.py, and for real nodes nodebuild.py and realnode.py.
See hack/cluster/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nodebuild
import realnode
from gobuild import (
    build_kubernetes,
    cache_root,
    control_plane_pins,
    find_go,
    go_version,
    module_dir,
    read_versions,
    write_module,
)
from gobuild import go as _go
from kubeapi import ApiError, Kube, split_yaml_documents
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

RECIPE = "1"  # bump when the build recipe below changes in a way that changes the binaries
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "agent-sandbox-controller",
)
SANDBOX_CRDS = (
    "agents.x-k8s.io_sandboxes.yaml",
    "extensions.agents.x-k8s.io_sandboxclaims.yaml",
    "extensions.agents.x-k8s.io_sandboxtemplates.yaml",
    "extensions.agents.x-k8s.io_sandboxwarmpools.yaml",
)
KWOK_CRDS = ("kwok.x-k8s.io_execs.yaml", "kwok.x-k8s.io_clusterexecs.yaml")
# Installed at `up`, copied from the module cache when a build made before they were used
# lacks them (the binaries do not change, so the build key does not either).
KWOK_LATE_CRDS = ("kwok.x-k8s.io_portforwards.yaml",)
KWOK_NODE_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
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


# ---- configuration -------------------------------------------------------------------
def build_dir(go: str | None = None) -> Path:
    """`<cache>/<versions-key>/`: the key names the versions and hashes the pin file + toolchain."""
    v = read_versions()
    go = go or find_go()
    digest = hashlib.sha256(
        control_plane_pins() + go_version(go).encode() + RECIPE.encode()
    ).hexdigest()
    key = (
        f"k8s-{v['KUBERNETES_VERSION']}_etcd-{v['ETCD_VERSION']}_kwok-{v['KWOK_VERSION']}"
        f"_agent-sandbox-{v['AGENT_SANDBOX_VERSION']}_{digest[:10]}"
    )
    return cache_root() / key


# ---- build -------------------------------------------------------------------------------
def build(args: argparse.Namespace | None = None) -> Path:
    """Compile every binary and collect the CRDs; return the versions directory."""
    go = find_go()
    out = build_dir(go)
    bin_dir = out / "bin"
    stamp = out / "build.json"
    if stamp.exists() and all((bin_dir / b).exists() for b in BINARIES):
        log(f"build: cache hit, {out}")
        return out
    if args is not None and getattr(args, "check", False):
        sys.exit(f"cluster: not built yet ({out})")
    v = read_versions()
    t0 = time.monotonic()
    for d in (bin_dir, out / "src", out / "crds", out / "stages"):
        d.mkdir(parents=True, exist_ok=True)
    logpath = out / "build.log"
    log(f"build: into {out} with {go_version(go)} (log: {logpath})")
    timings: dict[str, float] = {}
    with open(logpath, "a") as logf:
        # etcd: the server module's own go.mod replaces its siblings by relative paths,
        # so build it from a module of ours that requires them at the same version.
        if not (bin_dir / "etcd").exists():
            t = time.monotonic()
            ev = v["ETCD_VERSION"]
            src = out / "src" / "etcd"
            reqs = "".join(
                f"\t{m} {ev}\n"
                for m in (
                    v["ETCD_MODULE"],
                    "go.etcd.io/etcd/api/v3",
                    "go.etcd.io/etcd/client/pkg/v3",
                    "go.etcd.io/etcd/client/v3",
                    "go.etcd.io/etcd/pkg/v3",
                )
            )
            write_module(src, "etcd", f"require (\n{reqs})\n")
            log(f"build: etcd {ev}")
            _go(go, ["get", f"{v['ETCD_MODULE']}@{ev}"], src, logf)
            _go(
                go,
                ["build", "-ldflags=-s -w", "-o", str(bin_dir / ".etcd.tmp"), v["ETCD_MODULE"]],
                src,
                logf,
            )
            (bin_dir / ".etcd.tmp").rename(bin_dir / "etcd")
            timings["etcd"] = time.monotonic() - t
        # kwok: its go.mod has no replace, so `go install pkg@version` builds it as upstream does.
        if not (bin_dir / "kwok").exists():
            t = time.monotonic()
            kv = v["KWOK_VERSION"]
            log(f"build: kwok {kv}")
            gobin = out / "src" / "kwok-gobin"
            ldflags = f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={kv.lstrip('v')}"
            _go(
                go,
                ["install", f"-ldflags={ldflags}", f"{v['KWOK_MODULE']}/cmd/kwok@{kv}"],
                out,
                logf,
                GOBIN=str(gobin),
            )
            (gobin / "kwok").rename(bin_dir / "kwok")
            timings["kwok"] = time.monotonic() - t
        # agent-sandbox: `go install pkg@version` needs the module's version list, which the
        # proxy refuses for it; build a copy of the module as the main module instead (the
        # same go.mod and go.sum, so the same result).
        if not (bin_dir / "agent-sandbox-controller").exists():
            t = time.monotonic()
            av = v["AGENT_SANDBOX_VERSION"]
            log(f"build: agent-sandbox-controller {av}")
            src = out / "src" / "agent-sandbox"
            if src.exists():
                shutil.rmtree(src)
            subprocess.run(
                ["cp", "-r", str(module_dir(go, v["AGENT_SANDBOX_MODULE"], av, out)), str(src)],
                check=True,
            )
            subprocess.run(["chmod", "-R", "u+w", str(src)], check=True)
            ldflags = f"-s -w -X sigs.k8s.io/agent-sandbox/internal/version.gitVersion={av}"
            _go(
                go,
                [
                    "build",
                    f"-ldflags={ldflags}",
                    "-o",
                    str(bin_dir / ".agent-sandbox-controller.tmp"),
                    "./cmd/agent-sandbox-controller",
                ],
                src,
                logf,
            )
            (bin_dir / ".agent-sandbox-controller.tmp").rename(bin_dir / "agent-sandbox-controller")
            timings["agent-sandbox-controller"] = time.monotonic() - t
        # kube-apiserver, -controller-manager, -scheduler from k8s.io/kubernetes: a module of
        # ours replaces the k8s.io/* staging modules (the list in kubernetes' own go.mod) with
        # their published versions, then one `go build` shares the compile work of all three.
        kube_bins = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
        if not all((bin_dir / b).exists() for b in kube_bins):
            t = time.monotonic()
            log(f"build: kube-apiserver, kube-controller-manager, kube-scheduler "
                f"{v['KUBERNETES_VERSION']} (slow)")
            tmp = out / "src" / "kube-out"
            build_kubernetes(go, v, out / "src" / "kubernetes", tmp, kube_bins, logf)
            for b in kube_bins:
                (tmp / b).rename(bin_dir / b)
            timings["kubernetes"] = time.monotonic() - t
        # CRDs and kwok's node stages, from the downloaded modules.
        asdir = module_dir(go, v["AGENT_SANDBOX_MODULE"], v["AGENT_SANDBOX_VERSION"], out)
        kwdir = module_dir(go, v["KWOK_MODULE"], v["KWOK_VERSION"], out)
        for f in SANDBOX_CRDS:
            shutil.copyfile(asdir / "k8s" / "crds" / f, out / "crds" / f)
        for f in (*KWOK_CRDS, *KWOK_LATE_CRDS):
            shutil.copyfile(kwdir / "kustomize" / "crd" / "bases" / f, out / "crds" / f)
        for f in KWOK_NODE_STAGES:
            shutil.copyfile(kwdir / "kustomize" / "stage" / f, out / "stages" / Path(f).name)
    total = time.monotonic() - t0
    stamp.write_text(
        json.dumps(
            {
                "versions": v,
                "go": go_version(go),
                "seconds": round(total, 1),
                "step_seconds": {k: round(x, 1) for k, x in timings.items()},
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
    )
    log(f"build: done in {total:.0f} s ({', '.join(f'{k} {x:.0f} s' for k, x in timings.items())})")
    return out


# ---- up / down / status ----------------------------------------------------------------------
def running(state: dict[str, Any] | None) -> list[str]:
    if not state:
        return []
    return [n for n, p in state.get("processes", {}).items() if is_ours(p)]


def node_manifest(i: int, cpu: str, memory: str, pods: str) -> dict[str, Any]:
    name = f"kwok-node-{i}"
    capacity = {"cpu": cpu, "memory": memory, "pods": pods, "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
                "node-role.kubernetes.io/agent": "",
            },
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def image_model_params(args: argparse.Namespace) -> dict[str, float] | None:
    """The seed image model's parameters (imagemodel.py), or None for the flat model."""
    if args.image_model == "flat":
        return None
    return {
        "min_gb": args.image_min_gb,
        "median_gb": args.image_median_gb,
        "sigma": args.image_sigma,
        "disk_gb": args.node_image_disk_gb,
        "bandwidth_mbps": args.node_bandwidth_mbps,
    }


def up(args: argparse.Namespace) -> None:
    t_start = time.monotonic()
    if running(load_state()):
        sys.exit(f"cluster: already running ({', '.join(running(load_state()))}); run `down` first")
    out = build()
    if args.real_nodes:
        nodebuild.build_node()
    if (old := load_state()) and old.get("real_nodes"):  # an earlier run that did not get to `down`
        realnode.stop(old, None)
    t_up = time.monotonic()
    bins = out / "bin"
    rd = run_dir()
    # A fresh cluster each time: clear what an earlier `up` left (and nothing else).
    for entry in RUN_ENTRIES:
        path = rd / entry
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    rd.mkdir(parents=True, exist_ok=True)
    pki = rd / "pki"
    make_pki(pki)
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
        _start(state, args, bins, out, pki, server, kubeconfig)
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


def _start(state, args, bins: Path, out: Path, pki: Path, server: str, kubeconfig: Path) -> None:
    rd = run_dir()
    ports = state["ports"]
    ec, ep = ports["etcd_client"], ports["etcd_peer"]
    spawn(
        state,
        "etcd",
        [
            str(bins / "etcd"),
            "--name=node0",
            f"--data-dir={rd / 'etcd'}",
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
    import urllib.request

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
    spawn(
        state,
        "kube-apiserver",
        [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ec}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}",
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
            *args.apiserver_arg,
        ],
    )
    kube = Kube.from_pki(server, pki)
    wait_for(
        "kube-apiserver /readyz",
        lambda: kube.request("GET", "/readyz", timeout=3) == "ok",
        60,
        state,
        "kube-apiserver",
    )
    write_kubeconfig(kubeconfig, server, pki)
    common = [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0"]
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

    # CRDs: the apiserver parses YAML bodies itself.
    missing = [f for f in KWOK_LATE_CRDS if not (out / "crds" / f).exists()]
    if missing:
        v = read_versions()
        kwdir = module_dir(find_go(), v["KWOK_MODULE"], v["KWOK_VERSION"], out)
        for f in missing:
            shutil.copyfile(kwdir / "kustomize" / "crd" / "bases" / f, out / "crds" / f)
    crd_names = []
    for f in (*SANDBOX_CRDS, *KWOK_CRDS, *KWOK_LATE_CRDS):
        for doc in split_yaml_documents((out / "crds" / f).read_text()):
            obj = kube.request(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                doc,
                content_type="application/yaml",
            )
            crd_names.append(obj["metadata"]["name"])

    def established() -> bool:
        for n in crd_names:
            crd = kube.request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{n}"
            )
            conds = {c["type"]: c["status"] for c in crd.get("status", {}).get("conditions", [])}
            if conds.get("Established") != "True":
                return False
        return True

    wait_for("CRDs Established", established, 30)

    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    spawn(
        state,
        "agent-sandbox-controller",
        [
            str(bins / "agent-sandbox-controller"),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--extensions=true",
            f"--metrics-bind-address=127.0.0.1:{ports['sandbox_metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{ports['sandbox_probe']}",
            f"--sandbox-warm-pool-max-refill-rate={args.warm_pool_max_refill_rate}",
            f"--sandbox-warm-pool-replenish-delay={args.warm_pool_replenish_delay}",
            *args.controller_arg,
        ],
        env=env,
    )

    # The provisioner, then kwok (whose pod stages wait for the provisioner's annotation).
    prov_cfg = {
        "server": server,
        "pki": str(pki),
        "root": str(rd),
        "pull_ms": args.pull_ms,
        "cached_pull_ms": args.cached_pull_ms,
        "boot_ms": args.boot_ms,
        "jitter": args.jitter,
        "preload_images": [i for i in args.preload_images.split(",") if i],
        "image_model": image_model_params(args),
        # pods on real nodes are the kubelet's, not the provisioner's
        "real_nodes": [realnode.node_name(i) for i in range(args.real_nodes)],
    }
    state["image_model"] = prov_cfg["image_model"]
    save_state(state)
    (rd / "provisioner.json").write_text(json.dumps(prov_cfg, indent=2))
    spawn(
        state,
        "provisioner",
        [sys.executable, "-u", str(HERE / "provisioner.py"), f"--config={rd / 'provisioner.json'}"],
    )

    stages = [(out / "stages" / Path(f).name).read_text() for f in KWOK_NODE_STAGES]
    stages.append((HERE / "pod-stages.yaml").read_text())
    (rd / "kwok.yaml").write_text("\n---\n".join(s.strip() + "\n" for s in stages))
    # A pod's exec is a kwok child process: container.sh, first on kwok's PATH as `sh` and
    # `python3`, gives it the pod's filesystem view (and the agent its pid namespace).
    pod_bin = rd / "pod-bin"
    pod_bin.mkdir()
    for name in ("sh", "python3"):
        (pod_bin / name).symlink_to(HERE / "container.sh")
    spawn(
        state,
        "kwok",
        [
            str(bins / "kwok"),
            f"--kubeconfig={kubeconfig}",
            f"--config={rd / 'kwok.yaml'}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=127.0.0.1",
            f"--node-port={ports['kwok']}",
            f"--server-address=127.0.0.1:{ports['kwok']}",
            f"--tls-cert-file={pki / 'kwok.crt'}",
            f"--tls-private-key-file={pki / 'kwok.key'}",
            "--cidr=10.244.0.1/16",
            "--node-lease-duration-seconds=40",
            "--enable-crds=Exec,ClusterExec,PortForward",
        ],
        env=dict(env, PATH=f"{pod_bin}:{env.get('PATH', '/usr/bin:/bin')}"),
    )
    for i in range(args.nodes):
        kube.request(
            "POST",
            "/api/v1/nodes",
            node_manifest(i, args.node_cpu, args.node_memory, args.node_pods),
        )

    def nodes_ready() -> bool:
        items = kube.request("GET", "/api/v1/nodes")["items"]
        ready = [
            n
            for n in items
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
        return len(ready) >= args.nodes

    wait_for(f"{args.nodes} nodes Ready", nodes_ready, 60, state, "kwok")
    # Default service account in `default` (the controller-manager creates one per namespace).
    wait_for(
        "service account default/default",
        lambda: (
            kube.request("GET", "/api/v1/namespaces/default/serviceaccounts/default") is not None
        ),
        30,
    )
    import urllib.request as ur

    wait_for(
        "agent-sandbox-controller /readyz",
        lambda: (
            ur.urlopen(f"http://127.0.0.1:{ports['sandbox_probe']}/readyz", timeout=2).status == 200
        ),
        30,
        state,
        "agent-sandbox-controller",
    )
    if args.real_nodes:
        realnode.start(state, args.real_nodes, nodebuild.build_node() / "bin", pki, server, kube,
                       pod_pids=args.real_node_pod_pids)
    for name in COMPONENTS:
        if not alive(state["processes"][name]["pid"]):
            raise SystemExit(
                f"cluster: {name} is not running; see {state['processes'][name]['log']}"
            )


def down(_: argparse.Namespace | None) -> None:
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


def status(_: argparse.Namespace) -> None:
    state = load_state()
    if not state:
        print("cluster: never started (no state in", run_dir(), ")")
        sys.exit(1)
    up_names = running(state)
    print(f"run dir:     {state['run_dir']}")
    print(f"binaries:    {state['build_dir']}")
    print(f"apiserver:   {state['server']}  (metrics: {state['server']}/metrics)")
    print(f"kubeconfig:  {state['kubeconfig']}")
    print(f"pod workdirs:{state['pod_root']}/<namespace>/<pod>/")
    if state.get("image_model"):
        print(f"image model: seed {state['image_model']} (log: {state['run_dir']}/image-model.jsonl)")
    if "up_seconds" in state:
        print(f"up took:     {state['up_seconds']} s")
    print("processes:")
    for name, p in state.get("processes", {}).items():
        print(
            f"  {name:26} {'running' if name in up_names else 'DEAD':8} pid {p['pid']:<8} log {p['log']}"
        )
    if not state.get("processes"):
        print("  (none: the cluster is down)")
        print(f"logs:        {state['run_dir']}/logs/")
        sys.exit(1)
    try:
        kube = Kube.from_pki(state["server"], Path(state["run_dir"]) / "pki")
        nodes = kube.request("GET", "/api/v1/nodes", timeout=5)["items"]
        ready = sum(
            any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n["status"].get("conditions", [])
            )
            for n in nodes
        )
        print(f"nodes:       {ready}/{len(nodes)} Ready")
        if state.get("real_nodes"):
            print("real nodes:")
            print("\n".join(realnode.status_lines(state, kube)))
    except (ApiError, OSError) as e:
        print(f"apiserver:   unreachable ({e})")
        sys.exit(1)
    if len(up_names) != len(state["processes"]):
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser(
        "build", help="compile the binaries into the cache (no-op when cached)"
    )
    p_build.add_argument("--check", action="store_true", help="only report: exit 1 if not built")
    p_build.set_defaults(fn=build)
    p_up = sub.add_parser("up", help="build if needed, start the cluster, wait until it is ready")
    env = os.environ.get
    p_up.add_argument("--nodes", type=int, default=int(env("SANDPOOL_CLUSTER_NODES", "10")))
    p_up.add_argument(
        "--real-nodes",
        type=int,
        default=int(env("SANDPOOL_CLUSTER_REAL_NODES", "0")),
        help="real nodes (kubelet, containerd, runc, CNI) beside the kwok nodes; see realnode.py",
    )
    p_up.add_argument(
        "--real-node-pod-pids",
        type=int,
        default=int(env("SANDPOOL_CLUSTER_REAL_NODE_POD_PIDS", "1024")),
        help="the real nodes' podPidsLimit (processes and threads per pod)",
    )
    p_up.add_argument("--node-cpu", default="32")
    p_up.add_argument("--node-memory", default="256Gi")
    p_up.add_argument("--node-pods", default="110")
    p_up.add_argument(
        "--pull-ms",
        type=float,
        default=float(env("SANDPOOL_CLUSTER_PULL_MS", "3000")),
        help="simulated pull of an image not cached on the node",
    )
    p_up.add_argument(
        "--cached-pull-ms",
        type=float,
        default=float(env("SANDPOOL_CLUSTER_CACHED_PULL_MS", "100")),
        help="simulated start cost of an image already cached on the node",
    )
    p_up.add_argument(
        "--boot-ms",
        type=float,
        default=float(env("SANDPOOL_CLUSTER_BOOT_MS", "400")),
        help="simulated sandbox boot after the image is present",
    )
    p_up.add_argument(
        "--jitter",
        type=float,
        default=float(env("SANDPOOL_CLUSTER_JITTER", "0.2")),
        help="each delay is scaled by uniform(1-j, 1+j)",
    )
    p_up.add_argument(
        "--image-model",
        choices=("flat", "seed"),
        default=env("SANDPOOL_CLUSTER_IMAGE_MODEL", "flat"),
        help="flat: --pull-ms per uncached image; seed: sizes, disk, LRU, shared bandwidth",
    )
    for flag, default, what in (
        ("--image-min-gb", "1.2", "seed model: smallest image (GB)"),
        ("--image-median-gb", "2.5", "seed model: median image size (GB)"),
        ("--image-sigma", "0.6", "seed model: lognormal sigma of size above the minimum"),
        ("--node-image-disk-gb", "100", "seed model: image disk per node (GB), LRU-evicted"),
        ("--node-bandwidth-mbps", "400", "seed model: pull bandwidth per node (MB/s), shared"),
    ):
        var = "SANDPOOL_CLUSTER_" + flag.lstrip("-").replace("-", "_").upper()
        p_up.add_argument(flag, type=float, default=float(env(var, default)), help=what)
    p_up.add_argument(
        "--preload-images",
        default=env("SANDPOOL_CLUSTER_PRELOAD_IMAGES", ""),
        help="comma-separated images cached on every node from the start",
    )
    p_up.add_argument(
        "--warm-pool-max-refill-rate",
        default=env("SANDPOOL_CLUSTER_WARM_POOL_MAX_REFILL_RATE", "0"),
        help="agent-sandbox --sandbox-warm-pool-max-refill-rate (sandboxes/s per pool; 0 = unpaced)",
    )
    p_up.add_argument(
        "--warm-pool-replenish-delay",
        default=env("SANDPOOL_CLUSTER_WARM_POOL_REPLENISH_DELAY", "0s"),
        help="agent-sandbox --sandbox-warm-pool-replenish-delay (Go duration)",
    )
    p_up.add_argument(
        "--controller-arg", action="append", default=[], help="extra agent-sandbox-controller flag"
    )
    p_up.add_argument(
        "--apiserver-arg", action="append", default=[], help="extra kube-apiserver flag"
    )
    p_up.set_defaults(fn=up)
    sub.add_parser("down", help="stop every process `up` started").set_defaults(fn=down)
    p_push = sub.add_parser("push", help="copy an image to the real nodes' registry")
    p_push.add_argument("source", help="skopeo source, e.g. oci:/path/layout:tag")
    p_push.add_argument("image", help=f"{realnode.REGISTRY_HOST}/<path>:<tag>")
    p_push.set_defaults(fn=lambda a: realnode.push(load_state() or {}, a.source, a.image))
    sub.add_parser("status", help="show processes, endpoints and log files").set_defaults(fn=status)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
