"""The long-lived service a local sandbox runs beside the policy's commands."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.backends._service import RunningService, proc_argv, proc_state, tree
from sandpool.core.backends.local._bwrap import SCRATCH, SERVICE_DIR

if TYPE_CHECKING:
    from sandpool.core.backends.local.sandbox import LocalSandbox

__all__ = ["SERVICE_DIR", "ServiceSpec", "start_service"]


@dataclass(frozen=True)
class ServiceSpec:
    """A long-lived process every sandbox of a backend runs beside the policy's commands.

    Usage: ``LocalBackend(service=ServiceSpec(argv=("/opt/srv/bin/python", "-m", "srv")))``.

    Attributes:
        argv: The command, run in :data:`SERVICE_DIR` with the sandbox's environment plus ``env``,
            in the policy's work cgroup (what it runs for the policy counts there); its output
            goes to the sandbox's ``stderr.log`` on the host (``LocalSandbox.state_dir``), out
            of the policy's reach: a log inside the sandbox would carry one rollout's words
            to the next.
        env: Extra environment variables.
        binds: ``(host path, sandbox path)`` pairs bind-mounted read-only (the service's code).
        ready_argv: A command run once after the start that exits 0 when the service is ready
            (it waits itself, e.g. for a socket to answer; ``$SANDPOOL_SERVICE_PID`` is the
            service's pid, so it can give up when the service dies); creation fails if it
            does not exit 0.
        ready_timeout: Seconds ``ready_argv`` may take.
        secret_env: Names of variables set to a fresh random secret for each sandbox's service
            (e.g. the key its clients must present); the values are in
            ``LocalSandbox.service_env``.
        reset_argv: A command the in-place reset runs (after the rollout's processes are
            killed, with ``env``, the secrets and ``$SANDPOOL_SERVICE_PID``) that makes the
            service drop what the rollout left in it (e.g. an agent-server's conversations,
            through its own API); it must exit 0. It also runs once when the service is
            ready, before the service directory's pristine state is recorded.

    The service directory is the service's state, and the policy (same uid) can write it, so
    the in-place reset holds it to its pristine state (see :meth:`LocalSandbox.restore_service`):
    the same service process, running, and after ``reset_argv`` a directory identical to the
    one recorded when the sandbox was fresh; anything else quarantines the sandbox. The
    service's own memory is its business: a service holding secrets or per-rollout state in
    memory should make itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so the policy's
    processes, which lack ``CAP_SYS_PTRACE``, cannot ptrace it or read its ``/proc`` files.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    binds: tuple[tuple[str, str], ...] = ()
    ready_argv: tuple[str, ...] | None = None
    ready_timeout: float = 60.0
    secret_env: tuple[str, ...] = ()
    reset_argv: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # A bind under a scratch directory would leave a mount point there, which the in-place
        # reset finds and quarantines for: every reused sandbox would be lost.
        for _, dest in self.binds:
            where = PurePosixPath(dest)
            if not where.is_absolute() or any(where.is_relative_to(d) for d in SCRATCH):
                raise errors.ConfigError(
                    f"ServiceSpec.binds: sandbox path {dest!r} must be absolute and outside "
                    f"{', '.join(SCRATCH)} (scratch the in-place reset empties); "
                    "bind it under /opt instead")


async def start_service(sandbox: LocalSandbox, spec: ServiceSpec, host_dir: Path) -> None:
    """Start ``spec`` in ``sandbox`` (its directory ``host_dir`` on the host), wait until it is
    ready, reset it once and record its pristine state.

    Raises:
        SandboxStartError: It did not become ready, exited, or its first reset failed.
    """
    env = {**spec.env, **{name: secrets.token_urlsafe(24) for name in spec.secret_env}}
    # No log path: its output goes to the agent's stderr, the host's stderr.log.
    started = await sandbox._call("service", 30.0, argv=list(spec.argv), env=env, cwd=SERVICE_DIR)
    pid = int(started["pid"])
    sandbox.service_dir, sandbox.service_env = host_dir, env
    if spec.ready_argv is not None:
        res = await sandbox.exec(list(spec.ready_argv), timeout=spec.ready_timeout, cwd=SERVICE_DIR,
                                 env={"SANDPOOL_SERVICE_PID": str(pid)})
        if not res.ok:
            log = (sandbox.state_dir / "stderr.log").read_text(errors="replace")[-1500:]
            raise errors.SandboxStartError(
                f"sandbox {sandbox.id}: its service did not become ready (exit {res.exit_code}, "
                f"timed out: {res.timed_out}): {log.strip() or res.err_text[-500:]}")
    got = proc_state((await sandbox.exec(proc_argv(pid), timeout=30.0)).text)
    if got is None:
        raise errors.SandboxStartError(f"sandbox {sandbox.id}: its service (pid {pid}) exited at start")
    svc = RunningService(spec, pid, got[1], got[2], {})
    # The pristine state is the fresh service's after one reset: what every reset restores.
    problems = await sandbox._service_reset(svc, spec.ready_timeout)
    if problems:
        raise errors.SandboxStartError(f"sandbox {sandbox.id}: {problems[0]}")
    svc.pristine = await asyncio.to_thread(tree, host_dir)
    sandbox._service = svc
