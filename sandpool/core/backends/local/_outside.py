"""What an OCI sandbox changed outside its repo: its root's change set, captured and replayed.

An OCI sandbox's root is an overlay over the image (``_oci``), which cannot be stacked under a
running sandbox as its repo's layers are (``_snapshot``). So a snapshot keeps what the root
changed outside the repo (its ``/tmp``, a ``pip install``, a file under ``/root``: usually
little) as a *change set*: the paths where the root differs from the image, found as the
in-place reset finds them (``_overlay.diff`` of the root's upper layer against the image's
read-only view), with the sandbox frozen meanwhile:

* a path changed or added is copied from the sandbox's root into a directory of the snapshot
  store (``_layers.copy_entry``, owners shifted to the image store's range), with everything
  below it when it is a directory the sandbox replaced;
* a path deleted is listed;
* a directory whose own mode, mtime or xattrs changed keeps its attributes
  (``_layers.root_record``).

A restore replays that into a pristine sandbox of the same image through its root on the host
(as root: writes there land in its upper layer, as the policy's would): deletions and
replaced paths removed, the copies put in, then the directories' attributes, deepest first;
the directories the replay wrote into without a change of their own get their times back.
Cost: the bytes changed outside the repo. Its hash (:func:`digest`) is the sha256 of the
change set's records (each path as the root shows it, ``_layers.entry_records``), so a
restored sandbox shows the snapshot's; the root directory's own attributes are the sandbox's,
not state. The repo, when it has an overlay of its own, is not in the root's change set (its
layers are the snapshot's, ``_snapshot``); when it has none (no git checkout), it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandpool.core.backends.local import _layers, _overlay
from sandpool.core.backends.local._memo import FileMemo
from sandpool.core.images import ID_BASE

if TYPE_CHECKING:
    from sandpool.core.backends.local.sandbox import LocalSandbox

__all__ = ["capture", "digest", "replay"]


def _changes(sb: LocalSandbox) -> list[_overlay.Change]:
    assert sb.root_upper is not None and sb.view is not None
    return [c for c in _overlay.diff(sb.view, sb.root_upper, "") if c.path]


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


def _digest(lines: list[bytes]) -> str:
    h = hashlib.sha256()
    for ln in lines:
        h.update(ln)
    return h.hexdigest()


def digest(sb: LocalSandbox, memo: FileMemo) -> str:
    """The hash of the OCI sandbox's change set outside its repo now (see the module).
    Blocking.

    Raises:
        OSError: Its root cannot be read.
    """
    return _digest(_lines(sb, _changes(sb), memo))


def capture(sb: LocalSandbox, dst: Path, memo: FileMemo) -> dict[str, Any]:
    """Copy the OCI sandbox's change set outside its repo into the new directory ``dst`` (of
    the snapshot store); call it with the sandbox frozen. Blocking.

    Returns:
        Its description: ``hash`` (:func:`digest`'s), ``size`` (bytes of files copied),
        ``copied``, ``deleted`` (root-relative paths) and ``metas`` (path -> record).

    Raises:
        OSError: A read or a write failed (``dst`` is removed).
    """
    assert sb.ids is not None and sb.root is not None
    try:
        changes = _changes(sb)
        lines = _lines(sb, changes, memo)
        os.mkdir(dst, 0o700)
        copied, deleted, metas, size = [], [], {}, 0
        for c in changes:
            src = sb.root / c.path
            if c.kind == "meta":
                metas[c.path] = _layers.root_record(src, sb.ids.base)
            elif not os.path.lexists(src):
                deleted.append(c.path)
            else:
                out = dst / c.path
                out.parent.mkdir(parents=True, exist_ok=True)
                _layers.copy_entry(src, out, src_base=sb.ids.base, dst_base=ID_BASE)
                copied.append(c.path)
                size += (_layers.hash_tree(out, base=ID_BASE).size_bytes if out.is_dir()
                         else out.lstat().st_size)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return {"hash": _digest(lines), "size": size, "copied": copied, "deleted": deleted, "metas": metas}


def replay(sb: LocalSandbox, src: Path, detail: dict[str, Any]) -> None:
    """Replay the change set :func:`capture` copied to ``src`` (described by ``detail``) into
    the pristine OCI sandbox ``sb``'s root. Blocking.

    Raises:
        OSError: A write failed.
    """
    assert sb.ids is not None and sb.root is not None
    root = sb.root
    touched: dict[str, tuple[int, int]] = {}  # parent directory -> its times before the replay

    def note_parent(rel: str) -> None:
        parent = os.path.dirname(rel)
        if parent and parent not in touched and os.path.isdir(root / parent):
            st = os.lstat(root / parent)
            touched[parent] = (st.st_atime_ns, st.st_mtime_ns)

    for rel in sorted([*detail["deleted"], *detail["copied"]]):
        note_parent(rel)
        _remove(root / rel)
    for rel in detail["copied"]:
        _layers.copy_entry(src / rel, root / rel, src_base=ID_BASE, dst_base=sb.ids.base)
    for rel, (atime, mtime) in touched.items():
        if rel not in detail["metas"] and os.path.isdir(root / rel):
            os.utime(root / rel, ns=(atime, mtime), follow_symlinks=False)
    for rel in sorted(detail["metas"], key=lambda r: r.count("/"), reverse=True):
        _layers.set_root(root / rel, detail["metas"][rel], sb.ids.base)


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
