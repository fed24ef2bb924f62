"""Files a local backend's snapshots have seen: each one's sha256 and its immutable copy.

Every file's bytes are read once, when first seen. :class:`FileMemo` remembers, per source file
(an upper layer's, a ``/tmp``'s), its sha256 and the immutable copy made of it in the snapshot
store, keyed by (device, inode, ctime, mtime, size): any write, chmod, chown, xattr or utime
moves a file's ctime, which no process in a sandbox can set, so a file found in the memo is
unchanged and its earlier copy is hard-linked instead of copied (store layers share one
filesystem, ``_layers``).
"""

from __future__ import annotations

import os
from collections import OrderedDict

__all__ = ["FileMemo"]

_MEMO_ENTRIES = 200_000

Key = tuple[int, ...]


class FileMemo:
    """Per file seen: its sha256, and for a source file the immutable copy made of it; least
    recently used entries go past :data:`_MEMO_ENTRIES`.

    A source file (an upper layer's, a ``/tmp``'s) is known by (device, inode, ctime, mtime,
    size). A copy in the store is known without its ctime: the store's files are never
    written after they are made, only linked into later layers, which moves the ctime; its
    mode, owner and xattrs are read again each time (the hash's records), its content by
    (device, inode, mtime, size).
    """

    def __init__(self) -> None:
        self._d: OrderedDict[Key, tuple[str, str | None, Key | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    @staticmethod
    def key(st: os.stat_result, *, store: bool = False) -> Key:
        if store:
            return ("store", st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        return (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size)

    def sha(self, st: os.stat_result, *, store: bool = False) -> str | None:
        """The sha256 of the file ``st`` describes (a copy in the store: ``store``), if seen
        unchanged."""
        hit = self._d.get(self.key(st, store=store))
        return hit[0] if hit is not None else None

    def copy(self, st: os.stat_result) -> str | None:
        """The path of the store's copy of the source file ``st`` describes, if it still
        exists as it was made."""
        hit = self._d.get(self.key(st))
        if hit is None or hit[1] is None:
            return None
        try:
            now = os.lstat(hit[1])
        except OSError:
            return None
        return hit[1] if self.key(now, store=True) == hit[2] else None

    def put(self, st: os.stat_result, sha: str, copy: str | None = None, *, store: bool = False) -> None:
        """Record a file's sha256 (and the path of its copy in the store, recorded too)."""
        ck = None
        if copy is not None:
            ck = self.key(os.lstat(copy), store=True)
            self._d[ck] = (sha, copy, ck)
            self._d.move_to_end(ck)
        k = self.key(st, store=store)
        self._d[k] = (sha, copy, ck)
        self._d.move_to_end(k)
        while len(self._d) > _MEMO_ENTRIES:
            self._d.popitem(last=False)
