"""Walking a host directory tree however deep it goes, never following a symlink.

A sandbox's tree may be deeper than a host path can name: inside it a policy makes
directories one ``cd`` at a time, and below the host's directory of its upper layer 25 levels
of 200-byte names pass the 4096 bytes a path may have. :class:`Tree` names each entry by a
path the kernel resolves (a deep one through a descriptor of an ancestor directory), and
:func:`walk` visits every entry with it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["Tree", "through_fd", "walk"]

#: Host paths this long or longer are taken from a descriptor of an ancestor.
_SHORT = 2048
_FD = "/proc/self/fd/"


def through_fd(path: str) -> bool:
    """Whether ``path`` (from :meth:`Tree.path`) names its entry through a descriptor: it is
    good only while that descriptor is open."""
    return path.startswith(_FD)


class Tree:
    """Host paths of the entries of the tree at ``root``, however deep it goes.

    A path of :data:`_SHORT` bytes or more (the kernel's limit is 4096) is taken from an open
    descriptor of an ancestor directory, ``/proc/self/fd/<fd>/<rest>``, the rest under
    :data:`_SHORT` + 256 bytes. Descriptors are opened when first needed and closed by
    :meth:`leave` once the walk has left their directory, so only the branch it is on holds
    any. A path it returned may name a descriptor that :meth:`leave` closes: use it at once.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = str(root)
        self._fds: dict[str, int] = {}  # an ancestor's rel -> its open descriptor

    def path(self, rel: str) -> str:
        """A host path of the entry ``rel`` (relative to the root; ``""``: the root).

        Raises:
            OSError: An ancestor on the way could not be opened.
        """
        if not rel:
            return self.root
        if len(rel) < _SHORT:
            return f"{self.root}/{rel}"
        # The deepest ancestor at most a multiple of _SHORT long: names are at most 255 bytes,
        # so it is less than 256 short of it.
        cut = rel.rfind("/", 0, _SHORT * ((len(rel) - 1) // _SHORT) + 1)
        anchor = rel[:cut]
        fd = self._fds.get(anchor)
        if fd is None:
            fd = os.open(self.path(anchor), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            self._fds[anchor] = fd
        return f"{_FD}{fd}/{rel[cut + 1:]}"

    def leave(self, rel: str) -> None:
        """The walk is done with directory ``rel`` and everything below it."""
        for anchor in [a for a in self._fds if a == rel or a.startswith(rel + "/")]:
            os.close(self._fds.pop(anchor))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def walk(tree: Tree, leave: Callable[[str], None] | None = None) -> Iterator[tuple[str, str, os.stat_result]]:
    """Pre-order, names sorted, never following a symlink: ``(rel, path, lstat)`` of every
    entry below ``tree``'s root (``path`` valid until the next step); ``leave(rel)`` once
    each directory's entries, all of them below it, were walked."""
    todo: list[tuple[str, bool]] = [("", False)]
    try:
        while todo:
            rel, done = todo.pop()
            if done:
                if leave is not None:
                    leave(rel)
                tree.leave(rel)
                continue
            with os.scandir(tree.path(rel)) as it:
                names = sorted(e.name for e in it)
            if rel:
                todo.append((rel, True))
            kids = []
            for name in names:
                r = f"{rel}/{name}" if rel else name
                p = tree.path(r)
                st = os.lstat(p)
                yield r, p, st
                if stat.S_ISDIR(st.st_mode):
                    kids.append(r)
            todo.extend((k, False) for k in reversed(kids))
    finally:
        tree.close()
