"""Go builds for hack/cluster: the toolchain, the pins, the module cache, one `go` step.

Shared by the control plane's build (``cpbuild.py``) and the real node's
(``nodebuild.py``). Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
#: Lines of versions.env from this one on pin the real node; the control plane's cache key
#: hashes only the lines above it, so pinning the node never invalidates that build.
NODE_PINS_MARKER = "# ---- real node"


def versions_text() -> str:
    return (HERE / "versions.env").read_text()


def control_plane_pins() -> bytes:
    """versions.env up to the real node's section: what the control plane's key hashes."""
    return versions_text().split(NODE_PINS_MARKER, 1)[0].encode()


def read_versions() -> dict[str, str]:
    """Every ``KEY=VALUE`` of versions.env (comments and blank lines skipped)."""
    out = {}
    for line in versions_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def cache_root() -> Path:
    if os.environ.get("SANDPOOL_CLUSTER_CACHE"):
        return Path(os.environ["SANDPOOL_CLUSTER_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "sandpool" / "cluster"


def find_go() -> str:
    for cand in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if cand and Path(cand).exists():
            return cand
    sys.exit("cluster: no Go toolchain found (set GO=/path/to/go)")


def go_version(go: str) -> str:
    return subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()


def go(go_bin: str, args: list[str], cwd: Path, logf: IO[str], **extra_env: str) -> None:
    """Run one static (``CGO_ENABLED=0``, ``-trimpath``) go command; exit naming the log on failure."""
    env = dict(
        os.environ, CGO_ENABLED="0", GOFLAGS="-buildvcs=false -trimpath", GOWORK="off", **extra_env
    )
    logf.write(f"\n$ (cd {cwd}) go {' '.join(args)}\n")
    logf.flush()
    res = subprocess.run(
        [go_bin, *args], check=False, cwd=cwd, env=env, stdout=logf, stderr=subprocess.STDOUT
    )
    if res.returncode:
        sys.exit(f"cluster: `go {' '.join(args[:3])} ...` failed; see {logf.name}")


def module_dir(go_bin: str, module: str, version: str, cwd: Path) -> Path:
    """Download ``module@version`` into the module cache; return its directory."""
    res = subprocess.run(
        [go_bin, "mod", "download", "-json", f"{module}@{version}"],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, GOWORK="off", GOFLAGS="-mod=mod"),
    )
    if res.returncode:
        sys.exit(f"cluster: go mod download {module}@{version} failed:\n{res.stdout}{res.stderr}")
    return Path(json.loads(res.stdout)["Dir"])


def write_module(d: Path, name: str, gomod_tail: str, tools: list[str] | None = None) -> None:
    """A main module of ours, ``sandpool.local/cluster/<name>``, importing ``tools`` (so
    ``go mod tidy`` keeps their requirements)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "go.mod").write_text(f"module sandpool.local/cluster/{name}\n\ngo 1.26.0\n\n{gomod_tail}")
    if tools:
        imports = "\n".join(f'\t_ "{t}"' for t in tools)
        (d / "tools.go").write_text(
            f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n"
        )


def build_kubernetes(
    go_bin: str, v: dict[str, str], src: Path, out_dir: Path, cmds: tuple[str, ...], logf: IO[str]
) -> None:
    """Build ``k8s.io/kubernetes/cmd/<c>`` for each of ``cmds`` into ``out_dir``, in one
    ``go build`` (they share most packages).

    ``k8s.io/kubernetes`` replaces its ``k8s.io/*`` staging modules by relative paths; a
    module of ours replaces them with their published versions instead (the list read from
    that module's own go.mod), as upstream's release builds resolve them.
    """
    kv, sv = v["KUBERNETES_VERSION"], v["KUBERNETES_STAGING_VERSION"]
    src.mkdir(parents=True, exist_ok=True)
    kdir = module_dir(go_bin, v["KUBERNETES_MODULE"], kv, src)
    staging = [
        line.split("=>")[0].strip()
        for line in (kdir / "go.mod").read_text().splitlines()
        if "=> ./staging/src/" in line
    ]
    replaces = "".join(f"\t{m} => {m} {sv}\n" for m in staging)
    pkgs = [f"{v['KUBERNETES_MODULE']}/cmd/{c}" for c in cmds]
    write_module(
        src,
        "kubernetes",
        f"godebug default=go1.26\n\nrequire {v['KUBERNETES_MODULE']} {kv}\n\nreplace (\n{replaces})\n",
        tools=pkgs,
    )
    go(go_bin, ["mod", "tidy"], src, logf)
    major, minor = kv.lstrip("v").split(".")[:2]
    ldflags = " ".join(
        [
            "-s -w",
            f"-X k8s.io/component-base/version.gitVersion={kv}",
            f"-X k8s.io/component-base/version.gitMajor={major}",
            f"-X k8s.io/component-base/version.gitMinor={minor}",
            "-X k8s.io/component-base/version.gitTreeState=clean",
            f"-X k8s.io/client-go/pkg/version.gitVersion={kv}",
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    go(go_bin, ["build", f"-ldflags={ldflags}", "-o", f"{out_dir}/", *pkgs], src, logf)
