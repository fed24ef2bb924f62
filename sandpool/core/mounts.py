"""Mount helpers shared by image hydration and the local backend (root only, via libc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from pathlib import Path

__all__ = ["MAX_OVERLAY_OPTS", "bind_idmapped", "bind_ro", "bind_rw", "make_shared", "mount_overlay",
           "mount_tmpfs", "umount"]

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_MS_NOATIME = 1024
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
# The new mount API (linux/mount.h): the same numbers on every architecture (asm-generic).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_EMPTY_PATH, _AT_FDCWD = 1, 0o2000000, 0x1000, -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
_libc.syscall.restype = ctypes.c_long
#: mount(2) copies at most one page of options; overlay's lowerdir list must fit in it.
MAX_OVERLAY_OPTS = 4000


def mount_overlay(lowers: list[Path | str], upper: Path | None, work: Path | None, target: Path,
                  *, readonly: bool = False) -> None:
    """Mount an overlayfs on ``target``: ``lowers`` top first, ``upper``/``work`` or none.

    Always ``nodev`` and ``nosuid``: an image's device nodes and setuid bits never act; and
    ``noatime``: reading a file never moves its access time, so an access time differs from
    the image's only where someone set it (which the in-place reset compares and restores).

    Raises:
        OSError: The kernel refused (the message has the errno text), or the lower
            directory list does not fit in one page (too many or too long paths).
    """
    opts = "lowerdir=" + ":".join(str(p) for p in lowers)
    if upper is not None:
        # No metacopy and no redirects: each upper entry then holds its full data and name,
        # and the host can compare it with the lower layers (see backends/local/_overlay).
        opts += f",upperdir={upper},workdir={work},redirect_dir=off,metacopy=off"
    if len(opts) > MAX_OVERLAY_OPTS:
        raise OSError(7, f"overlay on {target}: {len(lowers)} lower layers do not fit in one "
                         f"mount option page ({len(opts)} bytes); move the store to a shorter path")
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOATIME | (_MS_RDONLY if readonly else 0)
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", flags, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"overlay mount on {target}: {os.strerror(err)}")


def mount_tmpfs(target: Path | str, opts: str) -> None:
    """Mount a new, empty tmpfs on ``target``, ``nosuid`` and ``nodev``, with options ``opts``
    (``mode=``, ``uid=``, ``gid=``, ``size=``...).

    Raises:
        OSError: The kernel refused (the message has the errno text).
    """
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"tmpfs mount on {target}: {os.strerror(err)}")


def umount(path: Path | str) -> None:
    """Detach the mount on ``path`` (lazily, so busy mounts go once unused); never raises."""
    _libc.umount2(str(path).encode(), _MNT_DETACH)


def bind_ro(source: Path | str, target: Path | str) -> None:
    """Bind ``source`` on ``target`` read-only, ``nosuid``, ``nodev``.

    Raises:
        OSError: A mount call failed.
    """
    for flags in (_MS_BIND | _MS_REC,
                  _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV):
        if _libc.mount(str(source).encode(), str(target).encode(), None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"bind of {source} on {target}: {os.strerror(err)}")


def bind_rw(source: Path | str, target: Path | str) -> None:
    """Bind ``source`` on ``target`` writable, ``nosuid``, ``nodev``.

    Raises:
        OSError: A mount call failed.
    """
    for flags in (_MS_BIND | _MS_REC, _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV):
        if _libc.mount(str(source).encode(), str(target).encode(), None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"bind of {source} on {target}: {os.strerror(err)}")


def make_shared(path: Path | str) -> None:
    """Make directory ``path`` a shared mount point (a bind of itself):
    what is mounted on it later propagates to every bind of it made after this, in any mount
    namespace that receives propagation (a sandbox's, whose mounts are slaves of the host's).

    Raises:
        OSError: A mount call failed.
    """
    p = str(path).encode()
    for src, flags in ((p, _MS_BIND), (None, _MS_SHARED)):
        if _libc.mount(src, p, None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"making {path} a shared mount: {os.strerror(err)}")


def bind_idmapped(source: Path | str, target: Path | str, userns_fd: int) -> None:
    """Bind ``source`` on ``target`` read-only, ``nosuid``, ``nodev``, with its owners mapped
    through the user namespace ``userns_fd``: a file owned by host id ``k`` is seen (and
    checked) as owned by the id that namespace's map gives ``k`` (its ``uid_map`` line
    ``k0 h0 n`` shows ids ``k0..k0+n-1`` as ``h0..h0+n-1``; ids outside it show as the
    overflow id). Nothing on disk changes. Linux 5.12 or later, on a filesystem that allows
    idmapped mounts (ext4, xfs, btrfs, tmpfs from 6.3, overlayfs layers).

    Raises:
        OSError: The kernel refused (EINVAL: no idmapped mounts for that filesystem).
    """
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, str(source).encode(),
                       _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree of {source}: {os.strerror(err)}")
    try:
        # struct mount_attr {u64 attr_set, attr_clr, propagation, userns_fd}
        attr = struct.pack("=QQQQ", _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID
                           | _MOUNT_ATTR_NODEV, 0, 0, userns_fd)
        for call, args, what in (
                (_SYS_MOUNT_SETATTR, (fd, b"", _AT_EMPTY_PATH, attr, len(attr)), "idmapping"),
                (_SYS_MOVE_MOUNT, (fd, b"", _AT_FDCWD, str(target).encode(), _MOVE_MOUNT_F_EMPTY_PATH),
                 "attaching")):
            if _libc.syscall(call, *args) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{what} the bind of {source} on {target}: {os.strerror(err)}")
    finally:
        os.close(fd)
