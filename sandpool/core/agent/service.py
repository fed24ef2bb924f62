"""A sandbox's service (:class:`~sandpool.core.base.ServiceSpec`): started through the agent,
held to its fresh state by the in-place reset.

The service runs as the policy's uid, so the policy can signal it, change its limits and write
its directory. :func:`start` records what it was when fresh: its process (pid, start time,
:func:`proc_state`) and its directory's :func:`tree`, read by the sandbox's backend (on the
host for a local sandbox, never through the sandbox). :func:`restore` runs the service's
``reset_argv`` and says what differs from that record; the reset quarantines on any
difference.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.service import ServiceSpec

if TYPE_CHECKING:
    from sandpool.core.agent.sandbox import AgentSandbox

__all__ = ["RunningService", "host_tree", "proc_argv", "proc_state", "restore", "running",
           "running_problems", "start", "tree", "tree_diff"]


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


async def start(sb: AgentSandbox, spec: ServiceSpec) -> RunningService:
    """Start ``spec`` in ``sb`` through its agent, wait until it is ready, reset it once and
    record its fresh state; sets ``sb.service_env``.

    Raises:
        SandboxStartError: The service did not become ready, exited, or its first reset
            failed (the message has its output).
        SandboxDied, ExecTransportError: The sandbox or its channel failed.
    """
    env = {**spec.env, **{name: secrets.token_urlsafe(24) for name in spec.secret_env}}
    pid = await sb._agent_start_service(spec, env)
    sb.service_env = env
    if spec.ready_argv is not None:
        res = await sb.exec(list(spec.ready_argv), timeout=spec.ready_timeout, cwd=sb._service_cwd,
                            env={**env, "SANDPOOL_SERVICE_PID": str(pid)})
        if not res.ok:
            raise errors.SandboxStartError(
                f"sandbox {sb.id}: its service did not become ready (exit {res.exit_code}, "
                f"timed out: {res.timed_out}): {sb._service_log() or res.err_text[-500:]}")
    got = proc_state((await sb.exec(proc_argv(pid), timeout=30.0, cwd=sb._service_cwd)).text)
    if got is None or got[0] in ("Z", "X"):
        raise errors.SandboxStartError(f"sandbox {sb.id}: its service (pid {pid}) exited at start")
    svc = RunningService(spec, pid, got[1], got[2], {})
    # The fresh state is the service's after one reset: what every reset restores.
    problems = await _reset(sb, svc, spec.ready_timeout)
    if problems:
        raise errors.SandboxStartError(f"sandbox {sb.id}: {problems[0]}")
    svc.pristine = await sb._service_tree()
    return svc


async def restore(sb: AgentSandbox, svc: RunningService, timeout: float) -> list[str]:
    """Bring ``sb``'s service back to its fresh state and verify it (the reset's hook).

    Checks, in order: the service is the process started with the sandbox (same pid and start
    time), alive, not stopped, with the priority, resource limits and CPU affinity it started
    with; its ``reset_argv`` exits 0; its directory's tree is the fresh one; the process once
    more (a fatal signal sent just before the reset may take effect during it). Run it with no
    process of the rollout left.

    Returns:
        What differs, one sentence each (empty: pristine).
    """
    problems = await running(sb, svc, timeout)
    problems = problems or await _reset(sb, svc, timeout)
    if not problems:
        problems = tree_diff(svc.pristine, await sb._service_tree())
    return problems or await running(sb, svc, timeout)


async def running(sb: AgentSandbox, svc: RunningService, timeout: float) -> list[str]:
    """Why ``svc`` is not running as it started, one sentence each; [] when it is."""
    res = await sb.exec(proc_argv(svc.pid), timeout=timeout, cwd=sb._service_cwd)
    return running_problems(svc, res.text if res.ok else None)


async def _reset(sb: AgentSandbox, svc: RunningService, timeout: float) -> list[str]:
    if svc.spec.reset_argv is None:
        return []
    res = await sb.exec(list(svc.spec.reset_argv), timeout=timeout, cwd=sb._service_cwd,
                        env={**sb.service_env, "SANDPOOL_SERVICE_PID": str(svc.pid)})
    if res.ok:
        return []
    return [f"its service's reset failed (exit {res.exit_code}, timed out: {res.timed_out}): "
            f"{(res.err_text or res.text).strip()[-300:]}"]


async def host_tree(root: Path) -> dict[str, tuple[str, ...]]:
    """:func:`tree` of ``root`` read on the host, off the event loop."""
    return await asyncio.to_thread(tree, root)
