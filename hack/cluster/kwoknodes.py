"""The simulated nodes: the provisioner, kwok, and the ``kwok-node-<i>`` Node objects.

controlplane.py's ``up`` calls :func:`start` once the API server, the CRDs and the
agent-sandbox controller are up. kwok plays every node's kubelet; the provisioner
(provisioner.py) gives each pod on them a working directory and an exec target first, and
kwok's pod stages (pod-stages.yaml) wait for it. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import realnode
from cpbuild import stage_files
from kubeapi import Kube, condition
from procs import run_dir, save_state, spawn, wait_for

HERE = Path(__file__).resolve().parent


def node_manifest(i: int, cpu: str, memory: str, pods: str) -> dict[str, Any]:
    """The Node object ``kwok-node-<i>``, which kwok manages (its annotation selects it)."""
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


def start(
    state: dict[str, Any], args: argparse.Namespace, out: Path, pki: Path, kube: Kube
) -> None:
    """Start the provisioner and kwok, create ``args.nodes`` nodes; return once all are Ready.

    ``out`` is the build (cpbuild.py), ``pki`` the run's certificates; the provisioner's
    start-latency parameters come from ``args`` (cluster.py's ``up`` flags).

    Raises:
        SystemExit: A component exited, or the nodes were not Ready in time.
    """
    rd = run_dir()
    kubeconfig = state["kubeconfig"]
    prov_cfg = {
        "server": state["server"],
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

    # kwok's pod stages wait for the provisioner's annotation.
    stages = [f.read_text() for f in stage_files(out)]
    stages.append((HERE / "pod-stages.yaml").read_text())
    (rd / "kwok.yaml").write_text("\n---\n".join(s.strip() + "\n" for s in stages))
    # A pod's exec is a kwok child process: container.sh, first on kwok's PATH as `sh` and
    # `python3`, gives it the pod's filesystem view (and the agent its pid namespace).
    pod_bin = rd / "pod-bin"
    pod_bin.mkdir()
    for name in ("sh", "python3"):
        (pod_bin / name).symlink_to(HERE / "container.sh")
    port = state["ports"]["kwok"]
    path = os.environ.get("PATH", "/usr/bin:/bin")
    spawn(
        state,
        "kwok",
        [
            str(out / "bin" / "kwok"),
            f"--kubeconfig={kubeconfig}",
            f"--config={rd / 'kwok.yaml'}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=127.0.0.1",
            f"--node-port={port}",
            f"--server-address=127.0.0.1:{port}",
            f"--tls-cert-file={pki / 'kwok.crt'}",
            f"--tls-private-key-file={pki / 'kwok.key'}",
            "--cidr=10.244.0.1/16",
            "--node-lease-duration-seconds=40",
            "--enable-crds=Exec,ClusterExec,PortForward",
        ],
        env=dict(os.environ, KUBECONFIG=kubeconfig, PATH=f"{pod_bin}:{path}"),
    )
    for i in range(args.nodes):
        kube.request(
            "POST",
            "/api/v1/nodes",
            node_manifest(i, args.node_cpu, args.node_memory, args.node_pods),
        )

    def nodes_ready() -> bool:
        return ready_nodes(kube.request("GET", "/api/v1/nodes")["items"]) >= args.nodes

    wait_for(f"{args.nodes} nodes Ready", nodes_ready, 60, state, "kwok")


def ready_nodes(nodes: list[dict[str, Any]]) -> int:
    """How many of the Node objects ``nodes`` are Ready."""
    return sum(condition(n, "Ready") == "True" for n in nodes)
