"""Snapshot layers of local sandboxes: an overlay upper layer copied to the host, and its hash.

A snapshot of a local sandbox is what its repo overlay's upper layer holds (what changed since
the image) plus its ``/tmp`` or, for an OCI sandbox, its root's change set outside the repo
(``_outside``). :func:`copy_tree` copies such a tree into a *layer* of the backend's
snapshot store (under its run directory, out of every sandbox's reach), shifting owners from
the sandbox's id range to the image store's (``ID_BASE + n``), as image layers are stored; a
sandbox restored from it sees the layer through an idmapped mount in its own range. A layer
is never written again once made, so it can be a read-only lower layer of any number of
sandboxes at once.

The content hash of a tree (:func:`hash_tree`; :func:`copy_tree` returns the same one) is the
sha256 of one canonical record per entry, in a pre-order walk with names sorted: its path,
type (directory, file, symlink, fifo, whiteout), permission bits (setuid included), owner and
group relative to the tree's id base, mtime (ns), user extended attributes and overlay's
``opaque`` mark, and a file's content hash or a symlink's target. A whiteout records
only its path. Sockets and device nodes other than whiteouts are not state a snapshot keeps
(no process can recreate their meaning); they are skipped. The tree's root directory's own
attributes are not part of the tree's hash (the caller records the root separately).

A file's content hash is one sha256 over, for each 1 MiB chunk of it (at offsets counted from
0) that is not all zeros, the chunk's offset and bytes, then the file's size. Holes read as zeros and are never
read: a file of holes costs its sandbox's disk quota nothing, so reading, hashing or copying
them would cost the host what the quota never charged. :func:`copy_tree` writes only the
runs of data the source holds, so a copy takes no more blocks than its source.

Cost: every file's data is read once, when first seen, and an unchanged file's earlier copy
is hard-linked instead of copied (``_memo.FileMemo``): a snapshot costs O(entries) plus
O(bytes changed since the last snapshot), and so does hashing a stack of layers again.

Nothing here follows a symlink: entries are ``lstat``-ed, files opened with ``O_NOFOLLOW``, and
directories walked by name. A tree may be deeper than a host path can name (a policy makes one
``cd`` at a time): its deep entries are reached from an open descriptor of an ancestor
(``_walk.Tree``), so a snapshot holds it as it is.
"""

from __future__ import annotations

import base64
import bisect
import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sandpool.core.backends.local._memo import FileMemo
from sandpool.core.backends.local._walk import Tree, through_fd, walk
from sandpool.core.images import ID_COUNT

__all__ = ["TreeHash", "copy_entry", "copy_tree", "entry_records", "hash_tree",
           "root_record", "set_root"]

_OPAQUE = "trusted.overlay.opaque"
_NOBODY = 65534  # an owner outside the tree's range (none should be) is counted as nobody
_CHUNK = 1 << 20
_ZERO = bytes(_CHUNK)


@dataclass(frozen=True)
class TreeHash:
    """What a tree holds, hashed.

    Attributes:
        digest: sha256 hex of the tree's canonical records (see the module docstring).
        size_bytes: Bytes of its regular files.
        entries: Entries below its root.
    """

    digest: str
    size_bytes: int
    entries: int


def _kind(st: os.stat_result) -> str | None:
    m = st.st_mode
    if stat.S_ISDIR(m):
        return "d"
    if stat.S_ISREG(m):
        return "f"
    if stat.S_ISLNK(m):
        return "l"
    if stat.S_ISFIFO(m):
        return "p"
    if stat.S_ISCHR(m) and st.st_rdev == 0:
        return "w"
    return None  # sockets, devices: not kept


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for n in names:
        if n.startswith("user.") or n == _OPAQUE:
            try:
                out[n] = os.getxattr(path, n, follow_symlinks=False)
            except OSError:
                continue
    return out


def _record(rel: str, kind: str, st: os.stat_result, base: int, xattrs: dict[str, bytes],
            payload: str) -> bytes:
    if kind == "w":
        return f"{rel}\0w\n".encode("utf-8", "surrogateescape")
    xa = ",".join(f"{n}={base64.b64encode(v).decode()}" for n, v in sorted(xattrs.items()))
    return (f"{rel}\0{kind}\0{stat.S_IMODE(st.st_mode):o}\0{_rel(st.st_uid, base)}\0{_rel(st.st_gid, base)}\0"
            f"{st.st_mtime_ns}\0{xa}\0{payload}\n").encode("utf-8", "surrogateescape")


def _rel(host_id: int, base: int) -> int:
    rel = host_id - base
    return rel if 0 <= rel < ID_COUNT else _NOBODY


def root_record(path: Path | str, base: int) -> str:
    """The canonical record of a directory's own attributes (mode, owner relative to ``base``,
    mtime, xattrs), as one line: what a tree's hash leaves out for its root.

    Raises:
        OSError: The directory cannot be read.
    """
    st = os.lstat(path)
    return _record(".", "d", st, base, _xattrs(str(path)), "").decode("utf-8", "surrogateescape")


def set_root(path: Path | str, record: str, base: int) -> None:
    """Give directory ``path`` the attributes ``record`` (:func:`root_record`) names, owners
    counted from ``base``.

    Raises:
        OSError: They could not be set.
    """
    _, _, mode, uid, gid, mtime, xattrs, _ = record.rstrip("\n").split("\0")
    os.chown(path, int(uid) + base, int(gid) + base)
    for item in filter(None, xattrs.split(",")):
        name, _, value = item.partition("=")
        os.setxattr(path, name, base64.b64decode(value))
    os.chmod(path, int(mode, 8))
    os.utime(path, ns=(int(mtime), int(mtime)))


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of the file's data below ``size``, as ``SEEK_DATA`` /
    ``SEEK_HOLE`` find them (a filesystem that keeps no holes reports all of it)."""
    out, off = [], 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only holes past ``off``
                break
            raise
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end))
        off = end
    return out


def _hash_file(path: str, dst_fd: int | None = None) -> str:
    """The file's content hash (see the module docstring), reading only its data; with
    ``dst_fd``, its data is also written there at the same offsets and the copy given the
    file's size, so the copy's holes are the file's."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        extents = _extents(fd, size)
        starts = [a for a, _ in extents]
        done = 0  # the chunks below this offset are hashed
        for start, end in extents:
            for off in range(max(done, start - start % _CHUNK), end, _CHUNK):
                chunk = os.pread(fd, _CHUNK, off)
                if chunk != _ZERO[:len(chunk)]:
                    h.update(off.to_bytes(8, "big"))
                    h.update(chunk)
                if dst_fd is not None:  # only what the file holds, not the holes in its chunk
                    for a, b in extents[max(0, bisect.bisect_right(starts, off) - 1):]:
                        if a >= off + len(chunk):
                            break
                        lo, hi = max(a, off), min(b, off + len(chunk))
                        if lo < hi:
                            _write_all(dst_fd, memoryview(chunk)[lo - off:hi - off], lo)
                done = off + _CHUNK
        h.update(b"size" + size.to_bytes(8, "big"))
        if dst_fd is not None:
            os.ftruncate(dst_fd, size)
    finally:
        os.close(fd)
    return h.hexdigest()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _leaf_payload(kind: str, path: str, st: os.stat_result, memo: FileMemo | None, store: bool) -> str:
    if kind == "l":
        return os.readlink(path)
    if kind != "f":
        return ""
    hit = memo.sha(st, store=store) if memo is not None else None
    if hit is not None:
        return hit
    digest = _hash_file(path)
    if memo is not None:
        memo.put(st, digest, store=store)
    return digest


def _records(root: str, base: int, memo: FileMemo | None, store: bool,
             prefix: str = "") -> Iterator[tuple[bytes, os.stat_result]]:
    for rel, path, st in walk(Tree(root)):
        kind = _kind(st)
        if kind is None:
            continue
        payload = _leaf_payload(kind, path, st, memo, store)
        yield _record(prefix + rel, kind, st, base, _xattrs(path) if kind != "w" else {}, payload), st


def hash_tree(root: Path | str, *, base: int, memo: FileMemo | None = None,
              store: bool = False) -> TreeHash:
    """The content hash of the tree at host path ``root`` (see the module docstring).

    Args:
        root: The tree's root directory.
        base: The host id that owners are counted from (the tree's id range).
        memo: Reuses the sha256 of files seen unchanged, and records the ones read.
        store: ``root`` is a layer of the store (its files are known as copies, see
            ``_memo.FileMemo``).

    Raises:
        OSError: The tree cannot be read.
    """
    h, size, n = hashlib.sha256(), 0, 0
    for record, st in _records(str(root), base, memo, store):
        h.update(record)
        n += 1
        size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return TreeHash(h.hexdigest(), size, n)


def entry_records(path: Path | str, name: str, *, base: int, memo: FileMemo | None = None) -> list[bytes]:
    """The canonical records of the entry at host path ``path``, named ``name``, and of every
    entry below it when it is a directory (named ``name/...``); its own attributes included.

    Raises:
        OSError: It cannot be read.
    """
    path = str(path)
    st = os.lstat(path)
    kind = _kind(st)
    if kind is None:
        return []
    own = _record(name, kind, st, base, _xattrs(path) if kind != "w" else {},
                  _leaf_payload(kind, path, st, memo, False))
    if kind != "d":
        return [own]
    return [own, *(r for r, _ in _records(path, base, memo, False, prefix=name + "/"))]


def copy_entry(src: Path | str, dst: Path | str, *, src_base: int, dst_base: int) -> None:
    """Copy the entry at ``src`` (a directory with everything below it, or one file, symlink
    or fifo) to ``dst``, which must not exist, as :func:`copy_tree` copies.

    Raises:
        OSError: A read or a write failed.
    """
    src, dst = str(src), str(dst)
    st = os.lstat(src)
    kind = _kind(st)
    if kind == "d":
        copy_tree(src, dst, src_base=src_base, dst_base=dst_base)
        return
    if kind == "f":
        _copy_file(src, os.path.basename(dst), Tree(os.path.dirname(dst)), st, None, {})
    elif kind == "l":
        os.symlink(os.readlink(src), dst)
    elif kind == "p":
        os.mkfifo(dst, 0o600)
    else:
        return
    _set_attrs(dst, st, _xattrs(src), src_base, dst_base)


def _set_attrs(path: str, st: os.stat_result, xattrs: dict[str, bytes], src_base: int,
               dst_base: int) -> None:
    # Owner first (chown clears setuid bits), then xattrs and mode, mtime last.
    os.chown(path, dst_base + _rel(st.st_uid, src_base), dst_base + _rel(st.st_gid, src_base),
             follow_symlinks=False)
    for n, v in xattrs.items():
        os.setxattr(path, n, v, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def copy_tree(src: Path | str, dst: Path | str, *, src_base: int, dst_base: int,
              memo: FileMemo | None = None, into: bool = False) -> TreeHash:
    """Copy the tree at ``src`` into the new directory ``dst`` and return its hash.

    Owners move from ``src_base + n`` to ``dst_base + n``; everything else is kept (types,
    modes with setuid bits, mtimes, user xattrs, overlay's ``opaque`` mark, whiteouts, hard
    links within the tree). ``dst``'s own attributes are ``src``'s (with ``into``: ``dst``
    exists, empty, and keeps its own). The hash is
    :func:`hash_tree`'s of ``src`` (counted from ``src_base``), which is the copy's (counted
    from ``dst_base``). Nothing may write ``src`` meanwhile (the caller freezes its sandbox).

    Args:
        src: The tree to copy (an upper layer, a ``/tmp``).
        dst: Where the copy goes; it must not exist (but with ``into``); its parent must.
        src_base: The host id base of ``src``'s owners.
        dst_base: The host id base of the copy's owners.
        memo: Files seen unchanged are hard-linked from their earlier copy (when it is on the
            same filesystem) instead of read again; the files copied are recorded.

    Raises:
        OSError: A read or a write failed (``dst`` is left for the caller to remove).
    """
    src, dst = str(src), str(dst)
    if not into:
        os.mkdir(dst, 0o700)
    h, size, n = hashlib.sha256(), 0, 0
    links: dict[tuple[int, int], str] = {}  # a file's (device, inode) -> the rel of its copy
    out = Tree(dst)
    dirs: dict[str, tuple[os.stat_result, dict[str, bytes]]] = {}  # on the walk's branch

    def left(rel: str) -> None:  # its entries are made: its own attributes, mtime last
        st, xattrs = dirs.pop(rel)
        _set_attrs(out.path(rel), st, xattrs, src_base, dst_base)
        out.leave(rel)

    try:
        for rel, path, st in walk(Tree(src), left):
            kind = _kind(st)
            if kind is None:
                continue
            n += 1
            xattrs = _xattrs(path) if kind != "w" else {}
            payload = ""
            if kind == "d":
                os.mkdir(out.path(rel), 0o700)
                dirs[rel] = (st, xattrs)
            elif kind == "w":
                os.mknod(out.path(rel), stat.S_IFCHR | 0o600, 0)
            elif kind == "p":
                os.mkfifo(out.path(rel), 0o600)
            elif kind == "l":
                payload = os.readlink(path)
                os.symlink(payload, out.path(rel))
            else:
                size += st.st_size
                payload, fresh = _copy_file(path, rel, out, st, memo, links)
                if fresh:  # a new copy: its attributes, then the memo (after its ctime settled)
                    copy = out.path(rel)
                    _set_attrs(copy, st, xattrs, src_base, dst_base)
                    if memo is not None:  # a copy named through a descriptor is not kept
                        memo.put(st, payload, None if through_fd(copy) else copy)
            if kind in ("l", "p"):  # a whiteout is overlayfs's, owned as it made it
                _set_attrs(out.path(rel), st, xattrs, src_base, dst_base)
            h.update(_record(rel, kind, st, src_base, xattrs, payload))
    finally:
        out.close()
    if not into:
        _set_attrs(dst, os.lstat(src), _xattrs(src), src_base, dst_base)
    return TreeHash(h.hexdigest(), size, n)


def _copy_file(path: str, rel: str, out: Tree, st: os.stat_result, memo: FileMemo | None,
               links: dict[tuple[int, int], str]) -> tuple[str, bool]:
    """Copy one file to ``rel`` under ``out``, or link it to an earlier copy of it; its
    sha256 and whether it is a new copy (whose attributes the caller sets)."""
    ident = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and ident in links:  # a hard link within the tree stays one
        os.link(out.path(links[ident]), out.path(rel))
        copy = out.path(rel)
        sha = memo.sha(os.lstat(copy), store=True) if memo is not None else None
        return sha or _hash_file(copy), False
    earlier = memo.copy(st) if memo is not None else None
    sha = memo.sha(st) if memo is not None else None
    if earlier is not None and sha is not None:
        try:
            os.link(earlier, out.path(rel))  # the earlier copy is immutable, its attributes the same
            links[ident] = rel
            return sha, False
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EXDEV, errno.EMLINK, errno.EPERM):
                raise
    fd = os.open(out.path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        sha = _hash_file(path, fd)
    finally:
        os.close(fd)
    links[ident] = rel
    return sha, True
