"""The real nodes' registry: Debian's ``docker-registry`` on 127.0.0.1, and pushes to it.

Pods name their images ``sandpool.test/<path>:<tag>``; each real node's containerd resolves
that host to this registry (``realnode.py``), as a cluster resolves a registry mirror.
Standard library, ``skopeo``, ``umoci`` and ``tar``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from procs import free_port, run_dir, save_state, spawn, wait_for

__all__ = ["PAUSE_IMAGE", "REGISTRY_HOST", "push", "push_pause", "start_registry"]

REGISTRY_HOST = "sandpool.test"
PAUSE_IMAGE = f"{REGISTRY_HOST}/pause:3.10"


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def start_registry(state: dict[str, Any]) -> None:
    if shutil.which("docker-registry") is None:
        raise SystemExit("cluster: real nodes need docker-registry (apt-get install docker-registry)")
    rd = run_dir()
    port = free_port()
    cfg = rd / "registry.yml"
    cfg.write_text(
        "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {rd / 'registry'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    spawn(state, "registry", [shutil.which("docker-registry"), "serve", str(cfg)])
    state["registry"] = f"127.0.0.1:{port}"
    save_state(state)
    import urllib.request

    wait_for("registry /v2/", lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{port}/v2/", timeout=2).status == 200, 30, state, "registry")


def push(state: dict[str, Any], source: str, image: str) -> None:
    """Copy ``source`` (any skopeo transport: ``oci:<layout>:<tag>``, ``docker-archive:...``)
    to the run's registry as ``image`` (``sandpool.test/<path>:<tag>``), which every real
    node pulls from.

    Raises:
        SystemExit: ``image`` is not under ``sandpool.test/``, or skopeo failed.
    """
    if not image.startswith(REGISTRY_HOST + "/"):
        raise SystemExit(f"cluster: push: {image!r} must start with {REGISTRY_HOST}/")
    dest = f"docker://{state['registry']}/{image[len(REGISTRY_HOST) + 1:]}"
    res = _sh("skopeo", "copy", "--quiet", "--dest-tls-verify=false", source, dest, check=False)
    if res.returncode:
        raise SystemExit(f"cluster: skopeo copy {source} {dest} failed: {res.stderr.strip()}")


def push_pause(state: dict[str, Any], bins: Path) -> None:
    lay = run_dir() / "pause-layout"
    shutil.rmtree(lay, ignore_errors=True)
    rootfs = run_dir() / "pause-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir()
    shutil.copy2(bins / "pause", rootfs / "pause")
    layer = run_dir() / "pause-layer.tar"
    _sh("tar", "-C", str(rootfs), "--owner=0", "--group=0", "-cf", str(layer), "pause")
    _sh("umoci", "init", "--layout", str(lay))
    _sh("umoci", "new", "--image", f"{lay}:3.10")
    _sh("umoci", "raw", "add-layer", "--image", f"{lay}:3.10", str(layer))
    _sh("umoci", "config", "--image", f"{lay}:3.10", "--config.entrypoint=/pause",
        "--config.user=65535:65535")
    push(state, f"oci:{lay}:3.10", PAUSE_IMAGE)
    for p in (rootfs, lay):
        shutil.rmtree(p)
    layer.unlink()
