"""What a local sandbox leaves on the host, and its removal: for a sandbox deleted by its
run, and for the leftovers of runs that died (a kill -9 of the runner)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from sandpool.core.backends.local import _cgroup, _idmap, _oci, _quota, _views
from sandpool.core.mounts import umount as _umount

__all__ = ["make_run_dir", "reap_stale", "unmount_sandbox"]


def unmount_sandbox(run_id: str, sid: str, state: Path) -> None:
    """Unmount sandbox ``sid``'s overlays, image views and quota filesystem (idempotent)."""
    # The overlays first (they sit on the quota filesystem and the image's views), then the
    # views, then the quota filesystem.
    merged = state / "merged"
    for _ in range(8):  # a snapshot's stacked overlay, then the sandbox's own
        if not os.path.ismount(merged):
            break
        _umount(merged)
    _umount(merged)  # the shared bind of itself below them (ismount cannot see a self-bind)
    _umount(state / "shm")  # its tmpfs, then the shared bind of itself
    _umount(state / "shm")
    for view in (state / "snap-views").glob("*"):
        _umount(view)
    _umount(state / "lower")
    root = _oci.public_dir(run_id) / sid
    _oci.unmount_views(root)
    _views.unmount(root)
    if _idmap.unpublish(root):  # never recursively through a bind still mounted
        shutil.rmtree(root, ignore_errors=True)
    _quota.detach(state / "disk", state / "disk.img")


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` holding ``owner.pid`` (this process), in one rename: a concurrent
    run's :func:`reap_stale` never sees it without its owner and reaps it."""
    if run_dir.is_dir():  # an earlier preflight of this run made it
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}-", dir=run_dir.parent))
    (tmp / "owner.pid").write_text(str(os.getpid()))
    tmp.rename(run_dir)


def reap_stale(state_base: Path) -> list[str]:
    """Remove what dead runs left behind: overlay mounts, cgroups and state directories.

    A run is dead when the pid in its ``owner.pid`` no longer exists (a kill -9 of the
    runner). Returns the run ids reaped.
    """
    reaped = []
    if not state_base.is_dir():
        return reaped
    for run in state_base.iterdir():
        try:
            owner = int((run / "owner.pid").read_text())
        except (OSError, ValueError):
            owner = -1
        if owner > 0 and Path(f"/proc/{owner}").exists():
            continue
        if owner < 0 and run.name.startswith("."):  # being made by make_run_dir
            continue
        driver = _cgroup.detect(f"sandpool/{run.name}")
        for sb in run.glob("sb-*"):
            if driver is not None:
                driver.kill_and_remove(sb.name)
            unmount_sandbox(run.name, sb.name, sb)
        if driver is not None:
            driver.remove_parent()
        _oci.release_host(_oci.public_dir(run.name))
        shutil.rmtree(run, ignore_errors=True)
        reaped.append(run.name)
    return reaped
