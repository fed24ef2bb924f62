"""Inodes of its own for everything a sandbox sees of the host: no file lock crosses sandboxes.

A file lock (``flock``, POSIX ``fcntl``, open-file-description locks) lives on an inode, and a
read-only open is enough to take one (``flock`` even exclusively). Bound into every sandbox
as they are, the host's ``/usr``, ``/etc`` files and device nodes, the image's interpreter,
venv and repo (at ``/opt/sandpool/image``) and the agent would share their inodes between all
sandboxes and the host: a lock one sandbox holds on ``/usr/bin/env`` is seen by every other
(``flock -n`` fails), one bit per file, thousands of files, which is enough for concurrent
siblings to pass a fix to each other. So:

* each read-only tree is bound from a read-only overlay of its own (:func:`mount`): the same
  bytes and page cache, but an overlay's files are its own inodes, and locks are taken on
  them, so a lock never reaches another sandbox;
* the device nodes bubblewrap binds from the host's ``/dev`` are replaced by nodes made for
  the sandbox (:func:`devices`);
* the kernel's table of all locks, ``/proc/locks``, which lists every namespace's
  open-file-description locks with their byte ranges (63 bits each, exact), is masked
  (:data:`MASKED`).

What stays shared is not a kernel object a sandbox can name but a resource whose state it
can sense: the page cache of the image's files (residency), CPU and memory pressure, and the
system-wide counts of AIO contexts, ptys and open files. Those channels are the machine's;
closing them takes a machine (or a VM) per sandbox.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from sandpool.core.mounts import mount_overlay, umount

__all__ = ["MASKED", "devices", "mount", "unmount"]

#: Files of ``/proc`` hidden from the sandbox (an empty file is bound over each).
MASKED = ("/proc/locks",)
#: The device nodes bubblewrap's ``--dev`` binds from the host's ``/dev``.
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _public(where: Path) -> None:
    # bubblewrap resolves bind sources as the sandbox's unprivileged host uid: every directory
    # from /run/sandpool down must be searchable (see _oci.public_dir).
    for d in (where.parent.parent, where.parent, where):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)


def _within(path: str, top: str) -> bool:
    """``path`` is ``top`` or below it with no mount point between (an overlay's lower layer
    shows one filesystem: what is mounted below it is not seen through it)."""
    if path == top:
        return True
    if not path.startswith(top.rstrip("/") + "/"):
        return False
    p = path
    while p != top:
        if os.path.ismount(p):
            return False
        p = os.path.dirname(p)
    return True


def mount(where: Path, sources: Iterable[str]) -> dict[str, str]:
    """Mount a read-only overlay (``nodev``, ``nosuid``) of each directory holding one of
    ``sources`` (host paths: directories, or files whose directory is used) under ``where``
    (a sandbox's public directory, world-searchable); a source inside another's directory,
    with no mount point between, shares its overlay. Missing sources are left out. Blocking.

    Returns:
        Each source's path as seen through its overlay, to bind instead of the source;
        also an ``"empty"`` entry: an empty regular file, bound over :data:`MASKED`.

    Raises:
        OSError: A mount failed (what was mounted stays for :func:`unmount`).
    """
    _public(where)
    real = {s: os.path.realpath(s) for s in sources if os.path.exists(s)}
    roots: list[str] = []
    dirs = {p if os.path.isdir(p) else os.path.dirname(p) for p in real.values()}
    for r in sorted(dirs, key=len):
        if not any(_within(r, top) for top in roots):
            roots.append(r)
    empty = where / "empty"
    empty.mkdir(mode=0o755, exist_ok=True)
    out: dict[str, str] = {}
    seen: dict[str, Path] = {}
    for i, root in enumerate(roots):
        target = where / f"v{i}"
        target.mkdir(exist_ok=True)
        mount_overlay([root, empty], None, None, target, readonly=True)
        seen[root] = target
    for src, r in real.items():
        root = max((top for top in roots if _within(r, top)), key=len)
        out[src] = str(seen[root] / os.path.relpath(r, root)) if r != root else str(seen[root])
    blank = where / "blank"
    blank.touch(mode=0o444, exist_ok=True)
    out["empty"] = str(blank)
    return out


def devices(where: Path) -> list[str]:
    """Make the sandbox's own device nodes under ``where`` (as the host's, same numbers and
    modes) and return the bubblewrap options binding them over ``--dev``'s. Blocking.

    Raises:
        OSError: A node could not be made.
    """
    d = where / "dev"
    d.mkdir(mode=0o755, exist_ok=True)
    argv = []
    for name in _DEVICES:
        host = os.stat(f"/dev/{name}")
        node = d / name
        with contextlib.suppress(FileNotFoundError):
            node.unlink()
        os.mknod(node, stat.S_IFCHR | stat.S_IMODE(host.st_mode), host.st_rdev)
        os.chmod(node, stat.S_IMODE(host.st_mode))
        argv += ["--dev-bind", str(node), f"/dev/{name}"]
    return argv


def unmount(where: Path) -> None:
    """Unmount every overlay :func:`mount` made under ``where``; never raises."""
    with contextlib.suppress(OSError):
        for child in where.iterdir():
            if child.name.startswith("v") and child.name[1:].isdigit():
                umount(child)
                with contextlib.suppress(OSError):
                    child.rmdir()
