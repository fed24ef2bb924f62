"""A local sandbox's service directory, held to its fresh state by the in-place reset.

The service (:class:`~sandpool.core.backends.local.ServiceSpec`) runs as the policy's uid, so
the policy can write its directory. :func:`tree` records the directory on the host (never
through the sandbox) when the service is fresh, and :func:`tree_diff` says what a later walk
finds different; :meth:`LocalSandbox.restore_service
<sandpool.core.backends.local.LocalSandbox.restore_service>` quarantines on any difference.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandpool.core.backends.local import ServiceSpec

__all__ = ["RunningService", "proc_argv", "proc_state", "running_problems", "tree", "tree_diff"]


@dataclass
class RunningService:
    """A sandbox's running service: its spec, pid and start time inside the sandbox (clock
    ticks, ``/proc/<pid>/stat`` field 22), what :func:`proc_state` read of it when fresh, and
    its directory's pristine tree (:func:`tree`)."""

    spec: ServiceSpec
    pid: int
    start: str
    attrs: str
    pristine: dict[str, tuple[str, ...]]


def proc_argv(pid: int) -> list[str]:
    """A command (run in the sandbox) printing what the reset compares of process ``pid``."""
    p = f"/proc/{pid}"
    return ["/bin/sh", "-c", f"cat {p}/stat && cat {p}/limits && grep ^Cpus_allowed_list {p}/status"]


def proc_state(text: str) -> tuple[str, str, str] | None:
    """``(state, start time, attributes)`` from :func:`proc_argv`'s output, None if unreadable.

    The attributes are what a process of the same uid can change in another without ptrace
    (so a non-dumpable service is still exposed), and its children inherit: its nice value
    (``setpriority``), resource limits (``prlimit --pid``: a tiny ``RLIMIT_FSIZE`` or
    ``RLIMIT_NOFILE`` would break the next rollout's terminals) and CPU affinity.
    """
    first, _, rest = text.partition("\n")
    fields = first.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or not rest:
        return None
    return fields[0], fields[19], f"nice {fields[16]}\n{rest}"


def running_problems(svc: RunningService, output: str | None) -> list[str]:
    """Why ``svc`` is not running as it started, one sentence each; [] when it is.

    Args:
        svc: The service as recorded when fresh.
        output: What :func:`proc_argv` printed in the sandbox, or None if it failed.
    """
    got = proc_state(output) if output is not None else None
    if got is None or got[1] != svc.start:
        return [f"its service (pid {svc.pid}) is gone: killed or exited during the rollout"]
    state, _, attrs = got
    if state in ("T", "t", "Z", "X"):
        return [f"its service (pid {svc.pid}) is stopped or dead (state {state})"]
    if attrs != svc.attrs:
        return [f"its service's (pid {svc.pid}) priority, resource limits or CPU affinity "
                "were changed during the rollout"]
    return []


_TREE_MAX = 10_000  # paths; a service directory holding more is not pristine anyway


def tree(root: Path) -> dict[str, tuple[str, ...]]:
    """Every path under ``root``, relative, mapped to its type and mode plus a file's sha256
    or a link's target (symlinks are not followed). Directory sizes and all mtimes are left
    out: tmux and the kernel change them without changing what a service reads. Stops after
    a little over ``_TREE_MAX`` paths (:func:`tree_diff` reports that)."""
    out: dict[str, tuple[str, ...]] = {}
    todo = [root]
    while todo and len(out) <= _TREE_MAX:
        top = todo.pop()
        with os.scandir(top) as entries:
            for e in entries:
                st = e.stat(follow_symlinks=False)
                rel = str(Path(e.path).relative_to(root))
                mode = oct(st.st_mode)
                if stat.S_ISDIR(st.st_mode):
                    out[rel] = ("dir", mode)
                    todo.append(Path(e.path))
                elif stat.S_ISLNK(st.st_mode):
                    out[rel] = ("link", mode, os.readlink(e.path))
                elif stat.S_ISREG(st.st_mode):
                    out[rel] = ("file", mode, _sha256(e.path))
                else:  # sockets, fifos, devices: their presence and mode
                    out[rel] = ("special", mode)
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    # O_NOFOLLOW|O_NONBLOCK: the path was a regular file when listed; never block on a swap.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tree_diff(want: dict[str, tuple[str, ...]], now: dict[str, tuple[str, ...]]) -> list[str]:
    """What differs between two :func:`tree` records, one sentence (empty: identical)."""
    if len(now) > _TREE_MAX:
        return [f"its service directory holds over {_TREE_MAX} paths (fresh: {len(want)})"]
    added = sorted(now.keys() - want.keys())
    missing = sorted(want.keys() - now.keys())
    changed = sorted(p for p in want.keys() & now.keys() if want[p] != now[p])
    if not (added or missing or changed):
        return []
    return [f"its service directory differs from its fresh state: added {added[:5]}, "
            f"changed {changed[:5]}, missing {missing[:5]}"]
