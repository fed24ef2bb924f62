"""What a sandbox changed in its repo, read from the host: its overlay's upper layer vs the image.

The repo of a local sandbox is an overlayfs: the image's repo is the read-only lower layer and
every change a rollout makes (a write, a chmod, a new file, a deletion as a *whiteout*, a
replaced directory as an *opaque* directory) lands in the sandbox's private upper layer. So the
upper layer lists exactly what changed, and comparing each of its entries with the lower layer
tells whether the repo, ``.git`` included, is identical to the image: the cost is O(paths
changed), not O(repo).

This module only reads (the upper layer of a mounted overlay must not be written behind the
kernel's back); the sandbox's agent does the restore through the merged view. Nothing here
follows a symlink: every entry is ``lstat``-ed and files are opened with ``O_NOFOLLOW``, since
the upper layer holds whatever the policy made.

"Identical" compares, per path: type, permission bits (``S_IMODE``, setuid included), mtime
and atime (ns), every extended attribute (POSIX ACLs included), and content (regular files)
or target (symlinks); a regular file of the upper layer must also have one link. Ownership is
not compared (inside the sandbox one uid exists), nor ctime, which no caller can set. The
atime is the owner's to set (``touch -a``, 62 bits per file that would otherwise outlive the
reset); nothing else moves it, since the overlay is mounted ``noatime`` and every read here
is ``O_NOATIME``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Change", "count_at_least", "diff", "diff_merged", "tree_equal"]

_OVL = "trusted.overlay."
_CHUNK = 1 << 20


@dataclass(frozen=True, order=True)
class Change:
    """One path that differs from the image.

    Attributes:
        path: Relative to the repo root, ``/``-separated (``""`` is the root itself).
        kind: ``"replace"``: make the path the image's, recursively (remove it when the image
            has none); ``"meta"``: a directory present in both whose own mode, mtime or
            xattrs differ (its children are listed separately).
    """

    path: str
    kind: str


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for n in names:
        if n.startswith(_OVL):
            continue
        try:
            out[n] = os.getxattr(path, n, follow_symlinks=False)
        except OSError:
            out[n] = b"?"
    return out


_NOATIME = os.O_RDONLY | os.O_NOFOLLOW | os.O_NOATIME


def _names(path: str) -> list[str]:
    """The entries of directory ``path``, read without moving its access time."""
    fd = os.open(path, _NOATIME | os.O_DIRECTORY)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, _OVL + "opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None


def _same_bytes(a: str, b: str, size: int) -> bool:
    fa = os.open(a, _NOATIME)
    try:
        fb = os.open(b, _NOATIME)
        try:
            left = size
            while left > 0:
                x, y = os.read(fa, _CHUNK), os.read(fb, _CHUNK)
                if x != y or not x:
                    return False
                left -= len(x)
            return not os.read(fa, 1) and not os.read(fb, 1)
        finally:
            os.close(fb)
    finally:
        os.close(fa)


def _same_attrs(u: str, ust: os.stat_result, lo: str, lst: os.stat_result, atime: bool = True) -> bool:
    return (stat.S_IFMT(ust.st_mode) == stat.S_IFMT(lst.st_mode)
            and stat.S_IMODE(ust.st_mode) == stat.S_IMODE(lst.st_mode)
            and ust.st_mtime_ns == lst.st_mtime_ns
            and (not atime or ust.st_atime_ns == lst.st_atime_ns)
            and _xattrs(u) == _xattrs(lo))


def _same_leaf(u: str, ust: os.stat_result, lo: str, lst: os.stat_result, atime: bool = True) -> bool:
    if not _same_attrs(u, ust, lo, lst, atime):
        return False
    if stat.S_ISLNK(ust.st_mode):
        return os.readlink(u) == os.readlink(lo)
    if stat.S_ISREG(ust.st_mode):
        return ust.st_nlink == 1 and ust.st_size == lst.st_size and _same_bytes(u, lo, ust.st_size)
    return False  # fifos, sockets, devices: never part of an image's repo


def tree_equal(a: str, b: str, *, whiteouts_absent: bool = True, atime: bool = True) -> bool:
    """True when the trees at host paths ``a`` and ``b`` are identical (see module docstring;
    ``atime=False``: but for access times, e.g. of two copies read at different times).

    Whiteouts under ``a`` count as absent entries (``a`` is an opaque upper directory).
    Iterative: it descends only where both trees have a directory of the same name, so ``b``
    (the image's) bounds the depth; the upper side's extra levels end the walk unequal.
    """
    todo = [(a, b)]
    while todo:
        x, y = todo.pop()
        xst, yst = _lstat(x), _lstat(y)
        if xst is None or yst is None:
            if xst is not None or yst is not None:
                return False
            continue
        if not stat.S_ISDIR(xst.st_mode) or not stat.S_ISDIR(yst.st_mode):
            if not _same_leaf(x, xst, y, yst, atime):
                return False
            continue
        if not _same_attrs(x, xst, y, yst, atime):
            return False
        names_x = {n for n in _names(x)
                   if not (whiteouts_absent and _whiteout(os.lstat(os.path.join(x, n))))}
        names_y = set(_names(y))
        if names_x != names_y:
            return False
        todo.extend((os.path.join(x, n), os.path.join(y, n)) for n in sorted(names_x, reverse=True))
    return True


def count_at_least(root: Path | str, n: int) -> bool:
    """True when the tree at host path ``root`` (a part of an upper layer) holds at least ``n``
    entries. Iterative, never follows a symlink, and stops at ``n``: the cost is bounded
    whatever the rollout made; a directory that cannot be read (a path past PATH_MAX) counts
    as its entry only."""
    seen, todo = 0, [str(root)]
    while todo:
        top = todo.pop()
        try:
            for name in _names(top):
                seen += 1
                if seen >= n:
                    return True
                path = os.path.join(top, name)
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    todo.append(path)
        except OSError:
            continue
    return False


def diff(lower: Path | str, upper: Path | str, under: str = "",
         pinned: Mapping[str, str] | None = None,
         seen: dict[str, tuple[int, int, int]] | None = None) -> list[Change]:
    """List what differs between the merged view of ``lower`` + ``upper`` and ``lower``.

    Args:
        lower: The image's repo directory (the overlay's lower layer), on the host.
        upper: The sandbox's upper layer directory, on the host.
        under: Only report paths at or below this repo-relative path (``""``: the whole repo).
        pinned: Repo-relative file paths whose reference is not the lower layer's file but
            this host file (git's index after sandpool refreshed its stat cache on a verified
            tree); a pinned path must lie below a directory the upper layer does not replace.
        seen: Per-sandbox memo of upper-layer files already found identical, by (inode,
            ctime, size): a file restored once stays in the upper layer, and its bytes are
            not compared again until it changes. Any write, chmod, xattr or utime moves a
            file's ctime, which no process in the sandbox can set, so the memo cannot be
            fooled from inside.

    Returns:
        The changes, sorted by path: ``replace`` for a path added, removed, or different;
        ``meta`` for a directory whose own attributes differ. Empty means identical.
    """
    lower, upper = str(lower), str(upper)
    out: list[Change] = []
    rel = under.strip("/")
    _entry(lower, upper, rel, out, dict(pinned or {}), {} if seen is None else seen)
    return sorted(out)


def _entry(lower: str, upper: str, top: str, out: list[Change], pinned: dict[str, str],
           seen: dict[str, tuple[int, int, int]]) -> None:
    # Iterative: it descends only into directories both layers have (an added directory is one
    # change, however deep), so the image bounds the depth.
    todo = [top]
    while todo:
        rel = todo.pop()
        u = os.path.join(upper, rel) if rel else upper
        lo = pinned.get(rel) or (os.path.join(lower, rel) if rel else lower)
        ust = _lstat(u)
        if ust is None:
            continue  # untouched: the merged view shows the lower entry as it is
        lst = _lstat(lo)
        if _whiteout(ust):
            if lst is not None:
                out.append(Change(rel, "replace"))
            continue
        if lst is None:
            out.append(Change(rel, "replace"))
            continue
        if not (stat.S_ISDIR(ust.st_mode) and stat.S_ISDIR(lst.st_mode)):
            key = (ust.st_ino, ust.st_ctime_ns, ust.st_size)
            if rel not in pinned and seen.get(rel) == key:
                continue
            seen.pop(rel, None)
            if not _same_leaf(u, ust, lo, lst):
                out.append(Change(rel, "replace"))
            elif rel not in pinned:
                seen[rel] = key
            continue
        if _opaque(u):  # the policy removed and recreated it: the whole lower dir is hidden
            if not tree_equal(u, lo):
                out.append(Change(rel, "replace"))
            continue
        if not _same_attrs(u, ust, lo, lst):
            out.append(Change(rel, "meta"))
        names = sorted(_names(u))
        todo.extend(f"{rel}/{name}" if rel else name for name in reversed(names))
        for p in pinned:  # a pinned file absent from the upper layer shows the lower's: not pinned
            if os.path.dirname(p) == rel and os.path.basename(p) not in names:
                out.append(Change(p, "replace"))


def diff_merged(lower: Path | str, layers: list[Path | str], merged: Path | str,
                under: str = "") -> list[Change]:
    """List what differs from ``lower`` in the merged view ``merged`` of an overlay stacked
    over it with ``layers`` (its upper directory, then snapshot layers; see
    ``_snapshot``), for every path at or below ``under`` that any of ``layers`` holds.

    Only those paths can differ from the image; each is compared through the merged view
    (host path of the mounted overlay), as :func:`diff` compares an upper entry. A directory
    that a layer makes opaque is compared whole (:func:`tree_equal`). O(paths the layers hold).

    Returns:
        The changes, sorted by path, as :func:`diff` gives them.
    """
    lower, merged = str(lower), str(merged)
    top = under.strip("/")
    found: set[str] = set()
    opaque: set[str] = set()
    for layer in layers:
        start = os.path.join(str(layer), top) if top else str(layer)
        if _lstat(start) is None:
            continue
        found.add(top)
        todo = [top]
        while todo:
            rel = todo.pop()
            path = os.path.join(str(layer), rel) if rel else str(layer)
            st = _lstat(path)
            if st is None or not stat.S_ISDIR(st.st_mode):
                continue
            if _opaque(path):
                opaque.add(rel)
                continue
            for name in _names(path):
                r = f"{rel}/{name}" if rel else name
                found.add(r)
                todo.append(r)
    out: list[Change] = []
    replaced: list[str] = []
    for rel in sorted(found):
        if any(rel == r or rel.startswith(r + "/") for r in replaced if r) or "" in replaced:
            continue
        m = os.path.join(merged, rel) if rel else merged
        lo = os.path.join(lower, rel) if rel else lower
        mst, lst = _lstat(m), _lstat(lo)
        if mst is None and lst is None:
            continue
        if mst is None or lst is None:
            changed = True
        elif stat.S_ISDIR(mst.st_mode) and stat.S_ISDIR(lst.st_mode):
            if rel in opaque:
                changed = not tree_equal(m, lo, whiteouts_absent=False)
            else:
                if not _same_attrs(m, mst, lo, lst):
                    out.append(Change(rel, "meta"))
                continue
        else:
            changed = not _same_leaf(m, mst, lo, lst)
        if changed:
            out.append(Change(rel, "replace"))
            replaced.append(rel)
    return sorted(out)
