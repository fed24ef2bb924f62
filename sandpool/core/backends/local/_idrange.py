"""Each local sandbox in its own range of host ids: no per-user kernel object is shared.

Namespaces do not separate everything the kernel keeps per user. Some objects are keyed by
the host uid of a process, across every namespace:

* the per-user accounting of ``struct user_struct``: pipe buffer pages (past
  ``fs.pipe-user-pages-soft`` every new pipe of that uid gets a single page), epoll watches,
  file descriptors in flight over unix sockets, locked memory;
* the per-user counts (``ucounts``) charged to a user namespace's owner at the host level:
  inotify instances and watches (``fs.inotify.max_user_instances``: 128), POSIX message queue
  bytes, pending signals, processes;
* the kernel keyrings (which the seccomp filter, :mod:`sandpool.core.agent.seccomp`, also puts out of reach).

When every sandbox's uid 1000 was host uid 101000, one sandbox could exhaust these for its
concurrent siblings (hold the 128 inotify instances: a sibling's ``inotify_init`` fails) or
signal through them to a sibling of the same task (hold pipe pages or not: the sibling's new
pipes are one page or sixteen), a channel no file comparison sees.

So every sandbox gets a range of :data:`ID_COUNT` host ids of its own, taken from
:data:`RANGES` ranges starting at :data:`FIRST` (:func:`allocate`; an ``flock`` on a file in
``/run/sandpool/ids`` keeps concurrent runners on one machine apart, and the kernel releases
it if the holder dies). The sandbox's user namespace maps ids ``0..ID_COUNT-1`` inside onto
it, bubblewrap runs as the sandbox's own id, and what the sandbox writes is owned by ids of
its range. The image's files, stored once with ``ID_BASE``'s shift (OCI layers, the shifted
repo of an image directory), are seen through idmapped mounts (:meth:`IdRange.view`) that
show host id ``ID_BASE + n`` as ``base + n``: nothing is copied or changed on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sandpool.core import errors
from sandpool.core.images import ID_BASE, ID_COUNT
from sandpool.core.mounts import bind_idmapped, umount

__all__ = ["FIRST", "RANGES", "IdRange", "allocate", "check"]

#: The first host id of the first range: above the ids of the image store (``ID_BASE``),
#: systemd's dynamic users and machined's container ranges (below 0x70000000), and the signed
#: 32-bit limit some tools assume (2**31), as every range is.
FIRST = 2_000_000_000
#: How many ranges exist, so how many local sandboxes a machine runs at once.
RANGES = (2**31 - FIRST) // ID_COUNT
_LOCKS = Path("/run/sandpool/ids")


@dataclass
class IdRange:
    """Host ids ``base .. base + ID_COUNT - 1``, one sandbox's, until :meth:`release`.

    Attributes:
        index: Which of the :data:`RANGES` it is.
        base: The host id of id 0 inside the sandbox.
    """

    index: int
    base: int
    _lock: int = -1

    def host(self, inside: int) -> int:
        """The host id of id ``inside`` of the sandbox."""
        return self.base + inside

    def view(self, mounts: Sequence[tuple[Path, Path]]) -> None:
        """Mount each ``(source, target)``: ``source``, whose files are owned by ids of the
        store's shift (``ID_BASE + n``), read-only at ``target`` with them shown as
        ``base + n``. Unmount the targets before :meth:`release`.

        Raises:
            OSError: The kernel refused an idmapped mount (Linux 5.12 or later and a
                filesystem that allows them are needed).
        """
        userns = _userns(ID_BASE, self.base)
        try:
            for source, target in mounts:
                bind_idmapped(source, target, userns)
        finally:
            os.close(userns)  # each mount holds its own reference

    def release(self) -> None:
        """Give the range back (idempotent). Nothing of the sandbox may run or be mounted."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def allocate() -> IdRange:
    """Take a range no other sandbox on this machine holds.

    Raises:
        SandboxStartError: Every range is taken (:data:`RANGES` sandboxes run already).
    """
    _LOCKS.mkdir(parents=True, exist_ok=True)
    start = random.randrange(RANGES)  # concurrent runners rarely contend for the same file
    for i in range(RANGES):
        index = (start + i) % RANGES
        fd = os.open(_LOCKS / str(index), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return IdRange(index, FIRST + index * ID_COUNT, fd)
    raise errors.SandboxStartError(f"all {RANGES} host id ranges for local sandboxes are in use; "
                                   "delete sandboxes or run fewer at once")


def check(scratch: Path) -> None:
    """Check once that this host makes idmapped mounts, in directory ``scratch``.

    Raises:
        BackendUnavailable: It does not (the message names the kernel error and the fix).
    """
    probe = Path(tempfile.mkdtemp(prefix=".idmap-probe-", dir=scratch))
    src, dst = probe / "src", probe / "dst"
    src.mkdir()
    dst.mkdir()
    ids = allocate()
    try:
        ids.view([(src, dst)])
        umount(dst)
    except OSError as exc:
        raise errors.BackendUnavailable(
            f"idmapped mounts failed ({exc}): each local sandbox sees its image through one, in "
            "its own host id range; run on Linux 5.12 or later with the images and the state "
            "on ext4, xfs or btrfs") from None
    finally:
        ids.release()
        for d in (dst, src, probe):
            with contextlib.suppress(OSError):
                d.rmdir()


def _userns(inside: int, outside: int) -> int:
    """A file descriptor of a new user namespace mapping ids ``inside + n`` to host ids
    ``outside + n`` (``n < ID_COUNT``): what an idmapped mount is made with.

    A helper process (``unshare --user``) owns the namespace until its fd is open; the host
    (root) writes the maps, as for every sandbox.

    Raises:
        OSError: unshare failed or the maps could not be written.
    """
    proc = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "echo ready; exec cat"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise OSError(f"unshare --user failed: {proc.stderr.read().decode(errors='replace')[-300:]}"
                          if proc.stderr else "unshare --user failed")
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{proc.pid}/{kind}", "w") as f:
                f.write(f"{inside} {outside} {ID_COUNT}\n")
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.communicate()
