"""Build what a real node runs: the kubelet, containerd and its runc shim, crictl, and pause.

Cached apart from the control plane, in ``<cache>/node-<versions>_<digest>/`` (the digest
hashes all of versions.env, the Go version and :data:`NODE_RECIPE`), so adding or changing
the node never invalidates the control plane's build. runc and the CNI plugins are Debian's
(``runc``, ``containernetworking-plugins``). Standard library only.

    python3 hack/cluster/nodebuild.py [--check]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gobuild import (
    build_kubernetes,
    cache_root,
    find_go,
    go,
    go_version,
    read_versions,
    versions_text,
    write_module,
)
from procs import log

NODE_RECIPE = "1"  # bump when the recipe below changes what is built
NODE_BINARIES = ("kubelet", "containerd", "containerd-shim-runc-v2", "crictl", "pause")
# The sandbox ("pause") container's process: holds the pod's namespaces, reaps orphans, and
# exits on SIGINT/SIGTERM, as the upstream pause does (build/pause/linux/pause.c).
_PAUSE_GO = """package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, _ := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	}
}
"""


def node_build_dir(go_bin: str | None = None) -> Path:
    v = read_versions()
    go_bin = go_bin or find_go()
    digest = hashlib.sha256(
        versions_text().encode() + go_version(go_bin).encode() + NODE_RECIPE.encode()
    ).hexdigest()
    key = (
        f"node-k8s-{v['KUBERNETES_VERSION']}_containerd-{v['CONTAINERD_VERSION']}"
        f"_crictl-{v['CRI_TOOLS_VERSION']}_{digest[:10]}"
    )
    return cache_root() / key


def built(out: Path) -> bool:
    return (out / "build.json").exists() and all((out / "bin" / b).exists() for b in NODE_BINARIES)


def build_node(check: bool = False) -> Path:
    """Compile the node's binaries into the cache (a no-op when cached); return the directory.

    With ``check``, only report: exit 1 when not built."""
    go_bin = find_go()
    out = node_build_dir(go_bin)
    if built(out):
        log(f"node build: cache hit, {out}")
        return out
    if check:
        sys.exit(f"cluster: real node not built yet ({out})")
    v = read_versions()
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    logpath = out / "build.log"
    log(f"node build: into {out} with {go_version(go_bin)} (log: {logpath})")
    with open(logpath, "a") as logf:
        gobin = out / "src" / "gobin"
        if not all((bin_dir / b).exists() for b in ("containerd", "containerd-shim-runc-v2")):
            t = time.monotonic()
            cv = v["CONTAINERD_VERSION"]
            log(f"node build: containerd {cv}")
            mod = v["CONTAINERD_MODULE"]
            ldflags = f"-s -w -X {mod}/version.Version={cv}"
            go(go_bin, ["install", "-tags=no_btrfs no_devmapper no_zfs", f"-ldflags={ldflags}",
                        f"{mod}/cmd/containerd@{cv}", f"{mod}/cmd/containerd-shim-runc-v2@{cv}"],
               out, logf, GOBIN=str(gobin))
            for b in ("containerd", "containerd-shim-runc-v2"):
                (gobin / b).rename(bin_dir / b)
            timings["containerd"] = time.monotonic() - t
        if not (bin_dir / "crictl").exists():
            t = time.monotonic()
            tv = v["CRI_TOOLS_VERSION"]
            log(f"node build: crictl {tv}")
            ldflags = f"-s -w -X {v['CRI_TOOLS_MODULE']}/pkg/version.Version={tv}"
            go(go_bin, ["install", f"-ldflags={ldflags}", f"{v['CRI_TOOLS_MODULE']}/cmd/crictl@{tv}"],
               out, logf, GOBIN=str(gobin))
            (gobin / "crictl").rename(bin_dir / "crictl")
            timings["crictl"] = time.monotonic() - t
        if not (bin_dir / "pause").exists():
            src = out / "src" / "pause"
            write_module(src, "pause", "")
            (src / "main.go").write_text(_PAUSE_GO)
            go(go_bin, ["build", "-ldflags=-s -w", "-o", str(bin_dir / "pause"), "."], src, logf)
        if not (bin_dir / "kubelet").exists():
            t = time.monotonic()
            log(f"node build: kubelet {v['KUBERNETES_VERSION']} (slow)")
            tmp = out / "src" / "kube-out"
            build_kubernetes(go_bin, v, out / "src" / "kubernetes", tmp, ("kubelet",), logf)
            (tmp / "kubelet").rename(bin_dir / "kubelet")
            timings["kubelet"] = time.monotonic() - t
    total = time.monotonic() - t0
    (out / "build.json").write_text(json.dumps({
        "versions": v, "go": go_version(go_bin), "seconds": round(total, 1),
        "step_seconds": {k: round(x, 1) for k, x in timings.items()},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }, indent=2))
    shutil.rmtree(gobin, ignore_errors=True)
    log(f"node build: done in {total:.0f} s ({', '.join(f'{k} {x:.0f} s' for k, x in timings.items())})")
    return out


if __name__ == "__main__":
    build_node(check="--check" in sys.argv[1:])
