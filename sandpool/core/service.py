"""A sandbox's long-lived service: what to run beside the policy's commands, and a
connection to it.

A backend given a :class:`ServiceSpec` starts it in every sandbox it creates (the sandbox's
agent does, :mod:`sandpool.core.agent.service`); :meth:`Sandbox.connect_service
<sandpool.core.base.Sandbox.connect_service>` opens a :class:`ServiceStream` to it, and the
in-place reset holds it to its fresh state (:meth:`Sandbox.restore_service
<sandpool.core.base.Sandbox.restore_service>`).
"""

from __future__ import annotations

import asyncio

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Protocol

from sandpool.core import errors

__all__ = ["ServiceSpec", "ServiceStream", "SocketStream"]


#: Every backend's scratch directories (:attr:`~sandpool.core.base.Sandbox.scratch`), where no bind may go.
_SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")


@dataclass(frozen=True)
class ServiceSpec:
    """A long-lived process every sandbox of a backend runs beside the policy's commands
    (e.g. an agent-server), started while the sandbox is created and reached with
    :meth:`~sandpool.core.base.Sandbox.connect_service`.

    Usage: ``LocalBackend(service=ServiceSpec(argv=(py, "-m", "srv"), socket="srv.sock"))``,
    ``KubernetesBackend(..., service=ServiceSpec(argv=("/opt/srv/bin/srv",), port=8000))``.

    Attributes:
        argv: The command, run in the sandbox's service directory (outside the repo and the
            scratch directories; the local backend's ``SERVICE_DIR``, a pod's
            ``$SANDPOOL_POD_RUN/service``) with the sandbox's environment plus ``env``, in its
            own session, spared by ``processes``/``kill_strays`` and so by the in-place reset.
            Its output goes to the host (the local sandbox's ``stderr.log``, a pod session's
            stderr), out of the policy's reach: a log inside would carry one rollout's words to
            the next.
        env: Extra environment variables.
        ready_argv: A command run once after the start that exits 0 when the service is ready
            (it waits itself, e.g. for a socket to answer; ``$SANDPOOL_SERVICE_PID`` is the
            service's pid, so it can give up when the service dies); creation fails if it
            does not exit 0.
        ready_timeout: Seconds ``ready_argv`` (and the first ``reset_argv``) may take.
        secret_env: Names of variables set to a fresh random secret for each sandbox's service
            (e.g. the key its clients must present); the values are in
            :attr:`~sandpool.core.base.Sandbox.service_env`.
        reset_argv: A command the in-place reset runs (after the rollout's processes are
            killed, with ``env``, the secrets and ``$SANDPOOL_SERVICE_PID``) that makes the
            service drop what the rollout left in it (e.g. an agent-server's conversations,
            through its own API); it must exit 0. It also runs once when the service is
            ready, before the service directory's fresh state is recorded.
        socket: The file name of a unix socket the service listens on in its directory:
            what :meth:`~sandpool.core.base.Sandbox.connect_service` reaches on the local backend.
        port: The TCP port the service listens on inside the sandbox (1-65535): what
            :meth:`~sandpool.core.base.Sandbox.connect_service` reaches on Kubernetes (``pods/portforward``; it
            is declared as the container's port).
        binds: ``(host path, sandbox path)`` pairs bind-mounted read-only (the service's code);
            local backend only: no host directory is bound into a pod.

    The service directory is the service's state, and the policy (same uid) can write it, so
    the in-place reset holds it to its fresh state (:meth:`~sandpool.core.base.Sandbox.restore_service`): the same
    service process, running, and after ``reset_argv`` a directory identical to the one
    recorded when the sandbox was fresh; anything else quarantines the sandbox. The service's
    own memory is its business: a service holding secrets or per-rollout state in memory should
    make itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so the policy's processes, which
    lack ``CAP_SYS_PTRACE``, cannot ptrace it or read its ``/proc`` files.

    Raises:
        ConfigError: ``argv`` is empty, ``port`` is not a TCP port, ``socket`` is not a plain
            file name, or a bind's sandbox path is not absolute or is under a scratch directory.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    ready_argv: tuple[str, ...] | None = None
    ready_timeout: float = 60.0
    secret_env: tuple[str, ...] = ()
    reset_argv: tuple[str, ...] | None = None
    socket: str | None = None
    port: int | None = None
    binds: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.argv:
            raise errors.ConfigError("ServiceSpec.argv is empty; give the service's command")
        if self.port is not None and not 0 < self.port < 65536:
            raise errors.ConfigError(f"ServiceSpec.port={self.port} is not a TCP port (1-65535)")
        if self.socket is not None and (not self.socket or "/" in self.socket):
            raise errors.ConfigError(f"ServiceSpec.socket={self.socket!r}: give a file name in the "
                                     "service's directory, without '/'")
        # A bind under a scratch directory would leave a mount point there, which the in-place
        # reset finds and quarantines for: every reused sandbox would be lost.
        for _, dest in self.binds:
            where = PurePosixPath(dest)
            if not where.is_absolute() or any(where.is_relative_to(d) for d in _SCRATCH):
                raise errors.ConfigError(
                    f"ServiceSpec.binds: sandbox path {dest!r} must be absolute and outside "
                    f"{', '.join(_SCRATCH)} (scratch the in-place reset empties); bind it under "
                    "/opt instead")


class ServiceStream(Protocol):
    """One connection to a sandbox's service (:meth:`~sandpool.core.base.Sandbox.connect_service`)."""

    #: True when :meth:`write_eof` ends one direction only (a socket); False when the
    #: transport cannot (a port-forward WebSocket), so ending the client's side ends both.
    half_close: bool

    async def read(self) -> bytes:
        """The next bytes from the service; ``b""`` at the end."""

    async def write(self, data: bytes) -> None:
        """Send bytes to the service."""

    async def write_eof(self) -> None:
        """End the client-to-service direction."""

    async def aclose(self) -> None:
        """Close the connection; idempotent."""


class SocketStream:
    """A :class:`ServiceStream` over an asyncio socket connection (a unix socket: reads of at
    most 64 KiB, :meth:`write_eof` ends one direction)."""

    half_close = True

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._r, self._w = reader, writer

    async def read(self) -> bytes:
        return await self._r.read(1 << 16)

    async def write(self, data: bytes) -> None:
        self._w.write(data)
        await self._w.drain()

    async def write_eof(self) -> None:
        if self._w.can_write_eof():
            self._w.write_eof()

    async def aclose(self) -> None:
        self._w.close()
