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
before any venv exists, CI's first step). This file is the command line and ``status``; its
parts: cpbuild.py (the control plane's build, on gobuild.py), controlplane.py (``up`` and
``down``), kwoknodes.py (kwok, its nodes and provisioner.py), procs.py (processes and
state), pki.py, and for real nodes nodebuild.py and realnode.py. See hack/cluster/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import realnode
from controlplane import down, running, up
from cpbuild import build
from kubeapi import ApiError, Kube
from kwoknodes import ready_nodes
from procs import load_state, run_dir


def status(_: argparse.Namespace) -> None:
    """Print the run's processes, endpoints and log files; exit 1 unless all is healthy."""
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
        print(f"nodes:       {ready_nodes(nodes)}/{len(nodes)} Ready")
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
    p_build.set_defaults(fn=lambda a: build(check=a.check))
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
