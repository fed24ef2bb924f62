"""A fresh upper layer over a local sandbox's repo: the in-place reset without a trace.

A reset that copies the paths a rollout changed back from the image leaves each of them a new
inode of the overlay's upper layer: the image's bytes, mode and times, but another device and
inode number (chosen by the filesystem as the rollout left it), listed first in its directory,
counted in the quota filesystem's used inodes. The next rollout on the sandbox can read all of
that, one bit per repo path and more. So the whole repo is reset by swapping the upper layer
instead: a new, empty upper directory (and work directory) on the same quota filesystem,
holding only sandpool's pinned files (git's refreshed index), is mounted over the image's repo,
and the old one is deleted. Every path is then the image's own inode again.

The sandbox sees the swap as it sees a snapshot's stacked overlay (``_snapshot``): its repo is
a slave of a shared mount point of the host (an empty directory bound onto itself), which the
sandbox binds before anything is mounted on it, so every overlay mounted there later, and
every unmount, shows inside. The backend swaps in the first fresh layer before any command
runs. Both kinds of sandbox work this way: an OCI sandbox's repo is an overlay of its own over
its root's (``_oci``).

``/dev/shm`` the same way (:func:`tmpfs`): a tmpfs numbers its files in turn from its mount
on, so one emptied in place hands the next rollout the count of files the last one made; the
sandbox binds a shared mount point of the host there, on which each reset mounts a new tmpfs.
(``/tmp`` lives on the quota filesystem, where ext4 allocates inode numbers from its bitmap;
``/dev/mqueue`` numbers from a counter of the whole machine, which no remount resets.)
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from sandpool.core.mounts import mount_overlay, mount_tmpfs, umount

__all__ = ["swap", "tmpfs"]


def swap(lower: Path, old: tuple[Path, Path] | None, disk: Path, pins: Mapping[str, Path],
         merged: Path) -> tuple[Path, Path]:
    """Mount a fresh upper layer over ``lower`` on ``merged`` in place of ``old``. Blocking; call
    it with no process of a rollout left.

    Args:
        lower: The image's repo as the sandbox's id range owns it (the overlay's lower layer).
        old: The upper and work directories of the fresh layer mounted now, unmounted and
            deleted here; None for the first swap (nothing is mounted on ``merged`` yet).
        disk: Where the new directories go (the sandbox's quota filesystem).
        pins: Repo-relative paths -> host files whose bytes, mode and times the new upper holds
            for them (owner and parent directories: the image's).
        merged: The host's mount point of the repo.

    Returns:
        The new upper and work directories.

    Raises:
        OSError: A directory could not be made or the overlay mounted.
    """
    # Two names in turn: the new layer is made while the old one still holds its inodes, so
    # none the rollout freed is taken or skipped (ext4 without a journal skips recent ones).
    name = "1" if old is not None and old[0].name == "upper-0" else "0"
    upper, work = disk / f"upper-{name}", disk / f"work-{name}"
    try:
        _build(lower, upper, work, pins)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or old is None:
            raise
        # The rollout filled the disk: the old layer goes first to make room.
        umount(merged)
        _remove(old)
        old = None
        _build(lower, upper, work, pins)
    if old is not None:
        umount(merged)  # the old fresh layer's overlay; the shared mount point below stays
    mount_overlay([lower], upper, work, merged)
    if old is not None:
        _remove(old)
    return upper, work


def _remove(dirs: tuple[Path, ...]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _build(lower: Path, upper: Path, work: Path, pins: Mapping[str, Path]) -> None:
    """Make ``upper`` the image's repo root holding only the pinned files, ``work`` empty."""
    _remove((upper, work))
    upper.mkdir()
    work.mkdir()
    for rel, pin in sorted(pins.items()):
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if not (upper / "/".join(parts[:i])).is_dir():
                (upper / "/".join(parts[:i])).mkdir()
        dst = upper / rel
        fd = os.open(pin, os.O_RDONLY | os.O_NOATIME)  # its atime is the reference
        with os.fdopen(fd, "rb") as src, open(dst, "xb") as out:
            out.write(src.read())
        owner = os.lstat(lower / rel) if os.path.lexists(lower / rel) else os.lstat(lower)
        os.chown(dst, owner.st_uid, owner.st_gid)
        _copy_attrs(pin, dst, owner=False)
        for i in range(len(parts) - 1, 0, -1):  # after their children: a write moves mtime
            _copy_attrs(lower / "/".join(parts[:i]), upper / "/".join(parts[:i]))
    _copy_attrs(lower, upper)  # the merged root takes the upper root's attributes


def _copy_attrs(src: Path, dst: Path, *, owner: bool = True) -> None:
    """Give ``dst`` the mode, times, extended attributes (``owner``: and owner) of ``src``."""
    st = os.lstat(src)
    if owner:
        os.chown(dst, st.st_uid, st.st_gid)
    for name in os.listxattr(src, follow_symlinks=False):
        if not name.startswith("trusted.overlay."):
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False))
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def tmpfs(target: Path, opts: str) -> None:
    """Mount a new, empty tmpfs with ``opts`` on the shared mount point ``target`` in place of
    the one there (if any); the sandbox's bind of it sees the new one. Blocking.

    Raises:
        OSError: The mount failed.
    """
    if os.path.ismount(target):
        umount(target)  # the tmpfs only: the shared bind of itself below is no mount ismount sees
    mount_tmpfs(target, opts)
