"""Snapshots of local sandboxes of OCI images: their change set against the image, replayed.

An OCI sandbox's root is its overlay, and a root cannot be stacked under a running sandbox
(``_snapshot`` stacks an image directory's repo instead). So its snapshot is its *change set*:
the paths where its root differs from the image, found as the in-place reset finds them
(``_overlay.diff`` of its upper layer against the image's read-only view, git's refreshed
index counted by its pinned copy), with the sandbox frozen meanwhile:

* a path changed or added is copied from the sandbox's merged root into a layer of the
  store (``_layers.copy_entry``, owners shifted to the image store's range), with everything
  below it when it is a directory the sandbox replaced;
* a path deleted is listed;
* a directory whose own mode, mtime or xattrs changed keeps its attributes
  (``_layers.root_record``).

A restore replays that into a pristine sandbox of the same image through its merged root on
the host (as root: writes there land in its upper layer, as the policy's would): deletions and
replaced paths removed, the copies put in, then the directories' attributes, deepest first;
the directories the replay wrote into without a change of their own get their times back.
Cost: the bytes changed, never the image. The state hash is the sha256 of the change set's
records (each path as the merged root shows it, ``_layers.entry_records``), so a restored
sandbox shows the snapshot's; the root directory's own attributes are the sandbox's, not
state.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.backends.local import _layers, _overlay
from sandpool.core.backends.local._memo import FileMemo
from sandpool.core.backends.local._snapshot import Store, _set_root
from sandpool.core.images import ID_BASE
from sandpool.core.snapshot import Snapshot

if TYPE_CHECKING:
    from sandpool.core.backends.local.sandbox import LocalSandbox

__all__ = ["capture", "load", "state_hash"]

_BACKEND = "local"


def _changes(sb: LocalSandbox) -> list[_overlay.Change]:
    assert sb.upper is not None and sb.view is not None
    repo = sb.workdir.strip("/")
    pins = {f"{repo}/{rel}": str(p) for rel, p in sb._pins.items()}
    return [c for c in _overlay.diff(sb.view, sb.upper, "", pins) if c.path]


def _lines(sb: LocalSandbox, changes: list[_overlay.Change], memo: FileMemo) -> list[bytes]:
    assert sb.ids is not None and sb.root is not None
    out = []
    for c in changes:
        path = sb.root / c.path
        if c.kind == "meta":
            out.append(f"{c.path}\0meta\0{_layers.root_record(path, sb.ids.base)}".encode())
        elif not os.path.lexists(path):
            out.append(f"{c.path}\0deleted\n".encode())
        else:
            out += _layers.entry_records(path, c.path, base=sb.ids.base, memo=memo)
    return out


def _digest(image_id: str, lines: list[bytes]) -> str:
    h = hashlib.sha256(image_id.encode() + b"\n")
    for ln in lines:
        h.update(ln)
    return h.hexdigest()


def state_hash(sb: LocalSandbox, store: Store) -> str:
    """The hash of the sandbox's change set against its image now (see the module). Blocking."""
    assert sb.oci is not None
    return _digest(sb.oci.digest, _lines(sb, _changes(sb), store.memo))


async def capture(sb: LocalSandbox, store: Store) -> Snapshot:
    """Take a snapshot of the OCI sandbox ``sb`` (see the module docstring).

    Raises:
        InfraTimeout: Its processes could not be frozen.
        InfraError: A copy failed on the host.
    """
    assert sb.oci is not None
    await sb.freezer(True)
    try:
        made = await asyncio.to_thread(_copy_changes, sb, store)
    finally:
        await sb.freezer(False)
    layer, detail, lines, size = made
    rel = str(layer.relative_to(store.root))
    return Snapshot(id=Snapshot.new_id(), image=sb.image, image_id=sb.oci.digest, backend=_BACKEND,
                    content_hash=_digest(sb.oci.digest, lines), size_bytes=size, parts=(rel,),
                    location=store.root, detail=MappingProxyType({**detail, "own": [rel]}))


def _copy_changes(sb: LocalSandbox, store: Store) -> tuple[Path, dict, list[bytes], int]:
    assert sb.ids is not None and sb.root is not None
    layer = store.new_dir("layers")
    try:
        changes = _changes(sb)
        lines = _lines(sb, changes, store.memo)
        os.mkdir(layer, 0o700)
        copied, deleted, metas, size = [], [], {}, 0
        for c in changes:
            src = sb.root / c.path
            if c.kind == "meta":
                metas[c.path] = _layers.root_record(src, sb.ids.base)
            elif not os.path.lexists(src):
                deleted.append(c.path)
            else:
                dst = layer / c.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                _layers.copy_entry(src, dst, src_base=sb.ids.base, dst_base=ID_BASE)
                copied.append(c.path)
                size += _layers.hash_tree(dst, base=ID_BASE).size_bytes if dst.is_dir() else dst.lstat().st_size
    except OSError as exc:
        shutil.rmtree(layer, ignore_errors=True)
        raise errors.InfraError(f"sandbox {sb.id}: copying its changes for a snapshot failed: {exc}") from exc
    detail = {"kind": "oci", "copied": copied, "deleted": deleted, "metas": metas}
    return layer, detail, lines, size


async def load(sb: LocalSandbox, snap: Snapshot, store: Store) -> None:
    """Replay ``snap`` into the pristine OCI sandbox ``sb`` (see the module docstring); verify
    with :func:`state_hash` after.

    Raises:
        ConfigError: Another image, build or backend, or its data is gone.
        InfraError: A write failed on the host.
    """
    assert sb.oci is not None
    snap.check_target(sb.image, sb.oci.digest, _BACKEND)
    snap = await asyncio.to_thread(snap.unpacked, store.root / "loaded")
    try:
        await asyncio.to_thread(_replay, sb, snap)
    except OSError as exc:
        raise errors.InfraError(f"sandbox {sb.id}: restoring snapshot {snap.id} failed: {exc}") from exc


def _replay(sb: LocalSandbox, snap: Snapshot) -> None:
    assert sb.ids is not None and sb.root is not None
    d = snap.detail
    layer = snap.location / snap.parts[0]
    root = sb.root
    touched: dict[str, tuple[int, int]] = {}  # parent directory -> its times before the replay

    def note_parent(rel: str) -> None:
        parent = os.path.dirname(rel)
        if parent and parent not in touched and os.path.isdir(root / parent):
            st = os.lstat(root / parent)
            touched[parent] = (st.st_atime_ns, st.st_mtime_ns)

    for rel in sorted([*d["deleted"], *d["copied"]]):
        note_parent(rel)
        _remove(root / rel)
    for rel in d["copied"]:
        _layers.copy_entry(layer / rel, root / rel, src_base=ID_BASE, dst_base=sb.ids.base)
    for rel, (atime, mtime) in touched.items():
        if rel not in d["metas"] and os.path.isdir(root / rel):
            os.utime(root / rel, ns=(atime, mtime), follow_symlinks=False)
    for rel in sorted(d["metas"], key=lambda r: r.count("/"), reverse=True):
        _set_root(root / rel, d["metas"][rel], sb.ids.base)


def _remove(path: Path) -> None:
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
