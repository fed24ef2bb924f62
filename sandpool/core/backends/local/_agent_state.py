"""The agent's own process state a command may set, read and set back from the host.

A command runs as the agent's uid, so it may set the agent's scheduling policy (``SCHED_IDLE``),
nice, CPU affinity and I/O priority (each thread's), and, where the kernel lets it, the
agent's OOM score adjustment and core dump filter. The agent cannot set the first ones back
(that needs CAP_SYS_NICE in the initial user namespace) and no file the reset compares holds
them: unset, they carry bits from one rollout to the next on the same sandbox. The host
(root, in the initial namespaces) can: :func:`read` records them when the sandbox is fresh,
:func:`restore` sets every thread back and compares.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

__all__ = ["AgentState", "read", "restore"]

#: ``ioprio_get`` / ``ioprio_set`` numbers (no Python binding exists), per machine.
_IOPRIO = {"x86_64": (252, 251), "aarch64": (31, 30)}
_IOPRIO_WHO_PROCESS = 1
_PROC_FILES = ("oom_score_adj", "coredump_filter")


@dataclass(frozen=True)
class Thread:
    """One thread's settings: policy (``SCHED_RESET_ON_FORK`` included), real-time priority,
    nice, CPU affinity and I/O priority (None where the machine's syscall is unknown)."""

    policy: int
    priority: int
    nice: int
    cpus: frozenset[int]
    ioprio: int | None


@dataclass(frozen=True)
class AgentState:
    """The agent's main thread's settings and its ``/proc`` files' contents."""

    thread: Thread
    files: tuple[str, ...]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(nr: int, *args: int) -> int:
    res = _libc().syscall(nr, *args)
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def _thread(tid: int) -> Thread:
    nr = _IOPRIO.get(os.uname().machine)
    return Thread(os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
                  os.getpriority(os.PRIO_PROCESS, tid), frozenset(os.sched_getaffinity(tid)),
                  None if nr is None else _syscall(nr[0], _IOPRIO_WHO_PROCESS, tid))


def _files(pid: int) -> tuple[str, ...]:
    out = []
    for name in _PROC_FILES:
        with open(f"/proc/{pid}/{name}") as f:
            out.append(f.read().strip())
    return tuple(out)


def read(pid: int) -> AgentState:
    """The state of the agent at host pid ``pid`` (its main thread's). Blocking.

    Raises:
        OSError: The process is gone or could not be read.
    """
    return AgentState(_thread(pid), _files(pid))


def restore(pid: int, fresh: AgentState) -> list[str]:
    """Set every thread of the agent at host pid ``pid`` and its ``/proc`` files back to
    ``fresh``, then read them again; return what differs or could not be set, one sentence
    each (empty: as fresh). Blocking; needs CAP_SYS_NICE and CAP_SYS_RESOURCE (root).

    Threads that end meanwhile are skipped; one started meanwhile inherits its creator's
    settings, which are set back too or differ when read back (then reported).
    """
    want = fresh.thread
    nr = _IOPRIO.get(os.uname().machine)
    problems = []
    try:
        for name, value in zip(_PROC_FILES, fresh.files, strict=True):
            with open(f"/proc/{pid}/{name}", "w") as f:  # the filter is read back as hex
                f.write(value if name == "oom_score_adj" else f"0x{value}")
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError as exc:
        return [f"the agent's OOM score or core dump filter could not be set back: {exc}"]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, want.policy, os.sched_param(want.priority))
            os.setpriority(os.PRIO_PROCESS, tid, want.nice)
            os.sched_setaffinity(tid, want.cpus)
            if nr is not None and want.ioprio is not None:
                _syscall(nr[1], _IOPRIO_WHO_PROCESS, tid, want.ioprio)
        except ProcessLookupError:
            continue  # a request's thread that ended
        except OSError as exc:
            problems.append(f"the agent's thread {tid} could not be set back: {exc}")
    try:
        listed, files = os.listdir(f"/proc/{pid}/task"), _files(pid)
    except OSError as exc:
        return [*problems, f"the agent's state could not be read back: {exc}"]
    now = []
    for tid in listed:
        try:
            now.append((tid, _thread(int(tid))))
        except ProcessLookupError:
            continue
    problems += [f"the agent's thread {tid} is not as fresh: {got} (fresh {want})"
                 for tid, got in now if got != want]
    if files != fresh.files:
        problems.append(f"the agent's {'/'.join(_PROC_FILES)} are {files} (fresh {fresh.files})")
    return problems
