"""Build the control plane: etcd, the kube binaries, kwok and the agent-sandbox controller.

``cluster.py build`` and ``up`` call :func:`build`. The binaries land in
``<cache>/<versions-key>/bin`` (:func:`build_dir`), the CRDs and kwok's node stages, copied
from the downloaded modules, in ``crds/`` and ``stages/`` beside them. The real node's
build is nodebuild.py's. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from gobuild import (
    build_kubernetes,
    cache_root,
    control_plane_pins,
    find_go,
    go,
    go_version,
    module_dir,
    read_versions,
    write_module,
)
from procs import log

RECIPE = "1"  # bump when the build recipe below changes in a way that changes the binaries
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
BINARIES = ("etcd", *KUBE_BINARIES, "kwok", "agent-sandbox-controller")
SANDBOX_CRDS = (
    "agents.x-k8s.io_sandboxes.yaml",
    "extensions.agents.x-k8s.io_sandboxclaims.yaml",
    "extensions.agents.x-k8s.io_sandboxtemplates.yaml",
    "extensions.agents.x-k8s.io_sandboxwarmpools.yaml",
)
KWOK_CRDS = (
    "kwok.x-k8s.io_execs.yaml",
    "kwok.x-k8s.io_clusterexecs.yaml",
    "kwok.x-k8s.io_portforwards.yaml",
)
KWOK_NODE_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
)


def build_dir(go_bin: str | None = None) -> Path:
    """`<cache>/<versions-key>/`: the key names the versions and hashes the pin file + toolchain."""
    v = read_versions()
    go_bin = go_bin or find_go()
    digest = hashlib.sha256(
        control_plane_pins() + go_version(go_bin).encode() + RECIPE.encode()
    ).hexdigest()
    key = (
        f"k8s-{v['KUBERNETES_VERSION']}_etcd-{v['ETCD_VERSION']}_kwok-{v['KWOK_VERSION']}"
        f"_agent-sandbox-{v['AGENT_SANDBOX_VERSION']}_{digest[:10]}"
    )
    return cache_root() / key


def crd_files(out: Path) -> list[Path]:
    """The CRDs of build ``out``, in the order they are installed."""
    return [out / "crds" / f for f in (*SANDBOX_CRDS, *KWOK_CRDS)]


def stage_files(out: Path) -> list[Path]:
    """kwok's node stages in build ``out``."""
    return [out / "stages" / Path(f).name for f in KWOK_NODE_STAGES]


def build(check: bool = False) -> Path:
    """Compile every binary missing from the cache and copy the manifests; return the build dir.

    On a cache hit only manifests missing from it are copied (a build made before one was
    used lacks it; the binaries, and so the key, are the same). ``check``: only report,
    exiting with an error naming the directory when a binary is missing.

    Raises:
        SystemExit: Not built (``check``), or a Go step failed (the message names the log).
    """
    go_bin = find_go()
    out = build_dir(go_bin)
    bin_dir = out / "bin"
    stamp = out / "build.json"
    if stamp.exists() and all((bin_dir / b).exists() for b in BINARIES):
        log(f"build: cache hit, {out}")
        if not check:
            copy_manifests(go_bin, out, missing_only=True)
        return out
    if check:
        sys.exit(f"cluster: not built yet ({out})")
    v = read_versions()
    t0 = time.monotonic()
    for d in (bin_dir, out / "src", out / "crds", out / "stages"):
        d.mkdir(parents=True, exist_ok=True)
    logpath = out / "build.log"
    log(f"build: into {out} with {go_version(go_bin)} (log: {logpath})")
    steps = (
        ("etcd", ("etcd",), _build_etcd),
        ("kwok", ("kwok",), _build_kwok),
        ("agent-sandbox-controller", ("agent-sandbox-controller",), _build_agent_sandbox),
        ("kubernetes", KUBE_BINARIES, _build_kubernetes),
    )
    timings: dict[str, float] = {}
    with open(logpath, "a") as logf:
        for name, bins, step in steps:
            if all((bin_dir / b).exists() for b in bins):
                continue
            t = time.monotonic()
            step(go_bin, v, out, logf)
            timings[name] = time.monotonic() - t
        copy_manifests(go_bin, out)
    total = time.monotonic() - t0
    stamp.write_text(
        json.dumps(
            {
                "versions": v,
                "go": go_version(go_bin),
                "seconds": round(total, 1),
                "step_seconds": {k: round(x, 1) for k, x in timings.items()},
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
    )
    log(f"build: done in {total:.0f} s ({', '.join(f'{k} {x:.0f} s' for k, x in timings.items())})")
    return out


def copy_manifests(go_bin: str, out: Path, missing_only: bool = False) -> None:
    """Copy the CRDs and kwok's node stages from the downloaded modules into build ``out``."""
    v = read_versions()
    wanted = [
        *((f"crds/{f}", "AGENT_SANDBOX", f"k8s/crds/{f}") for f in SANDBOX_CRDS),
        *((f"crds/{f}", "KWOK", f"kustomize/crd/bases/{f}") for f in KWOK_CRDS),
        *((f"stages/{Path(f).name}", "KWOK", f"kustomize/stage/{f}") for f in KWOK_NODE_STAGES),
    ]
    modules: dict[str, Path] = {}
    for name, mod, rel in wanted:
        dest = out / name
        if missing_only and dest.exists():
            continue
        if mod not in modules:
            modules[mod] = module_dir(go_bin, v[f"{mod}_MODULE"], v[f"{mod}_VERSION"], out)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(modules[mod] / rel, dest)


def _build_etcd(go_bin: str, v: dict[str, str], out: Path, logf: IO[str]) -> None:
    """etcd: the server module's own go.mod replaces its siblings by relative paths, so build
    it from a module of ours that requires them at the same version."""
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
    bin_dir = out / "bin"
    go(go_bin, ["get", f"{v['ETCD_MODULE']}@{ev}"], src, logf)
    go(go_bin, ["build", "-ldflags=-s -w", "-o", str(bin_dir / ".etcd.tmp"), v["ETCD_MODULE"]],
       src, logf)
    (bin_dir / ".etcd.tmp").rename(bin_dir / "etcd")


def _build_kwok(go_bin: str, v: dict[str, str], out: Path, logf: IO[str]) -> None:
    """kwok: its go.mod has no replace, so `go install pkg@version` builds it as upstream does."""
    kv = v["KWOK_VERSION"]
    log(f"build: kwok {kv}")
    gobin = out / "src" / "kwok-gobin"
    ldflags = f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={kv.lstrip('v')}"
    go(go_bin, ["install", f"-ldflags={ldflags}", f"{v['KWOK_MODULE']}/cmd/kwok@{kv}"], out, logf,
       GOBIN=str(gobin))
    (gobin / "kwok").rename(out / "bin" / "kwok")


def _build_agent_sandbox(go_bin: str, v: dict[str, str], out: Path, logf: IO[str]) -> None:
    """agent-sandbox: `go install pkg@version` needs the module's version list, which the proxy
    refuses for it; build a copy of the module as the main module instead (the same go.mod
    and go.sum, so the same result)."""
    av = v["AGENT_SANDBOX_VERSION"]
    log(f"build: agent-sandbox-controller {av}")
    src = out / "src" / "agent-sandbox"
    if src.exists():
        shutil.rmtree(src)
    subprocess.run(
        ["cp", "-r", str(module_dir(go_bin, v["AGENT_SANDBOX_MODULE"], av, out)), str(src)],
        check=True,
    )
    subprocess.run(["chmod", "-R", "u+w", str(src)], check=True)
    ldflags = f"-s -w -X sigs.k8s.io/agent-sandbox/internal/version.gitVersion={av}"
    tmp = out / "bin" / ".agent-sandbox-controller.tmp"
    go(go_bin, ["build", f"-ldflags={ldflags}", "-o", str(tmp), "./cmd/agent-sandbox-controller"],
       src, logf)
    tmp.rename(out / "bin" / "agent-sandbox-controller")


def _build_kubernetes(go_bin: str, v: dict[str, str], out: Path, logf: IO[str]) -> None:
    """kube-apiserver, -controller-manager, -scheduler in one `go build` (gobuild.py)."""
    log(f"build: {', '.join(KUBE_BINARIES)} {v['KUBERNETES_VERSION']} (slow)")
    tmp = out / "src" / "kube-out"
    build_kubernetes(go_bin, v, out / "src" / "kubernetes", tmp, KUBE_BINARIES, logf)
    for b in KUBE_BINARIES:
        (tmp / b).rename(out / "bin" / b)
