"""Per-sandbox disk quota: every writable place of a local sandbox lives on its own filesystem.

Each sandbox gets a sparse file holding an ext4 filesystem of ``ResourceLimits.disk_bytes``,
loop-mounted ``nodev,nosuid,noatime``; the upper and work directories of its overlays (its
repo's layers, an OCI sandbox's root) and an image directory sandbox's ``/tmp`` are on it. A
rollout that writes more than its quota gets ``ENOSPC`` ("No space left on device") from the
kernel, at the write that crossed it, and the sandbox keeps working: the host disk is never
filled past the quota, and the in-place reset frees what the rollout wrote.
The file costs host disk only for what is written (sparse).

Why a loop filesystem: a size-limited tmpfs would charge the files to the sandbox's memory
limit (RAM), and project quotas need a host filesystem formatted for them. A mkfs per sandbox
would put a format on every start, so an empty filesystem is formatted once per size (a
*template*) and each sandbox copies it sparsely and mounts it; the benchmark reports the cold
start with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
from pathlib import Path

from sandpool.core import errors
from sandpool.core.mounts import umount
from sandpool.core.paths import sandpool_home

__all__ = ["attach", "detach", "template"]

_VERSION = "quota-v1"


def template(size_bytes: int) -> Path:
    """Return an empty ext4 image file of ``size_bytes`` (made once, then reused).

    Raises:
        BackendUnavailable: ``mkfs.ext4`` is missing (Debian package ``e2fsprogs``) or failed.
    """
    d = sandpool_home() / _VERSION
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"ext4-{size_bytes}.img"
    if path.is_file():
        return path
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if path.is_file():
            return path
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        # No journal (the filesystem dies with its sandbox), no reserved blocks, lazy init.
        res = subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0",
                              "-E", "nodiscard,lazy_itable_init=1", str(tmp), str(size_bytes // 1024) + "k"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise errors.BackendUnavailable(f"mkfs.ext4 for the sandbox disk quota failed: "
                                            f"{res.stderr.strip()[-300:]}; install e2fsprogs")
        os.replace(tmp, path)
        return path
    except FileNotFoundError:
        raise errors.BackendUnavailable("mkfs.ext4 is not installed (apt-get install e2fsprogs); it "
                                        "makes each sandbox's disk quota") from None
    finally:
        os.close(fd)


async def attach(tpl: Path, image: Path, mountpoint: Path) -> None:
    """Copy ``tpl`` sparsely to ``image`` and loop-mount it on ``mountpoint`` (``noatime``:
    the host's reads of an upper layer never move the access times the reset compares), empty.

    Raises:
        OSError: The copy or the mount failed (message has mount's output).
    """
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", 'cp --sparse=always "$1" "$2" && mount -o loop,nodev,nosuid,noatime "$2" "$3"',
        "sh", str(tpl), str(image), str(mountpoint),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise OSError(f"disk quota filesystem for {mountpoint}: {err.decode(errors='replace').strip()}")
    with contextlib.suppress(OSError):
        (mountpoint / "lost+found").rmdir()


def detach(mountpoint: Path, image: Path) -> None:
    """Unmount the quota filesystem (lazily) and delete its file; never raises."""
    umount(mountpoint)
    with contextlib.suppress(OSError):
        image.unlink()
