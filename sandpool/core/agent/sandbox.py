"""The base of every sandbox run by sandpool's agent.

:class:`AgentSandbox` does the :class:`~sandpool.core.base.Sandbox` contract's work through the
agent (:class:`~.client.AgentOps`, usually an :class:`~.client.AgentClient` over one channel):
commands, files, process listing, the kill of strays, the in-place restore of repo paths, and
the service (:mod:`.service`). It also maps a death to an error, in one place: a request to a
sandbox its backend knows is gone raises that death (:meth:`AgentSandbox._gone`), and so does
a request whose answer arrived after the death (the answer is void); otherwise the channel's
own error stands (``SandboxDied``, ``SandboxExhausted`` or ``ExecTransportError``).

A backend's sandbox adds only its lifecycle: how its agent is started and reached
(:meth:`~AgentSandbox._ops`), its evidence of death, and where its service lives.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Awaitable, Callable, Mapping
from pathlib import PurePosixPath
from typing import TypeVar

from sandpool.core import errors
from sandpool.core.agent import service
from sandpool.core.agent.client import AgentClient, AgentOps, AgentStarved
from sandpool.core.base import ExecResult, Sandbox
from sandpool.core.service import ServiceSpec

__all__ = ["AgentSandbox"]

T = TypeVar("T")


class AgentSandbox(Sandbox):
    """A sandbox whose work is done by sandpool's agent.

    Subclasses set ``id``, ``image`` and ``workdir`` and implement :meth:`_ops`; they may
    override :meth:`_gone` (evidence of death the channel cannot see, e.g. a pod deleted) and
    the service hooks.
    """

    #: Where the service's commands run (its directory when the backend can name it).
    _service_cwd: str | None = None
    _service: service.RunningService | None = None
    #: The scratch directories' own metadata when fresh (:meth:`record_scratch`); None: not
    #: recorded (the reset then empties them the generic way).
    _scratch_record: dict[str, dict] | None = None

    @abc.abstractmethod
    def _ops(self) -> AgentOps:
        """What does the work: the agent's client, or a backend's degraded stand-in."""

    def _gone(self) -> errors.SandpoolError | None:
        """The error for a sandbox its backend knows is dead, else None (default: the
        channel is the only evidence)."""
        return None

    async def _ended(self) -> errors.SandpoolError | None:
        """After a request's channel failed: the error for a sandbox its backend knows, or
        learns soon, is dead (default: :meth:`_gone` as it stands)."""
        return self._gone()

    def _evidence(self) -> list[str]:
        """What shows the sandbox's own processes spent its budget, one sentence each (default:
        the backend cannot tell, none)."""
        return []

    def _starved_evidence(self, exc: AgentStarved) -> list[str]:
        """What shows the agent was refused a thread because the sandbox's own processes spent
        its budget (default: :meth:`_evidence`, the backend's own reading)."""
        return self._evidence()

    def alive(self) -> bool:
        """False once the sandbox is known dead or its agent's channel ended (no round trip)."""
        return self._gone() is None and self._ops().alive()

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.workdir) / p)

    async def _guarded(self, op: Callable[[AgentOps], Awaitable[T]]) -> T:
        """Run ``op`` on the agent; a death the backend knows of wins over what the channel
        says, before, during and after the request."""
        if (err := self._gone()) is not None:
            raise err
        try:
            res = await op(self._ops())
        except (errors.ExecTransportError, errors.SandboxDied) as exc:
            err = self._gone() if isinstance(exc, AgentStarved) else await self._ended()
            if err is not None:  # the channel broke because the sandbox died
                raise err from None
            if isinstance(exc, AgentStarved) and (evidence := self._starved_evidence(exc)):
                raise errors.SandboxExhausted(
                    f"sandbox {self.id}: its agent could not serve {exc.op!r} ({exc.detail}): "
                    f"{'; '.join(evidence)}") from None
            raise
        if (err := self._gone()) is not None:  # it died while the request ran: the answer is void
            raise err
        return res

    def _client(self) -> AgentClient:
        """The agent's client, for what only the agent can do (restore, services).

        Raises:
            ConfigError: The sandbox runs in a degraded mode without the agent.
        """
        ops = self._ops()
        if not isinstance(ops, AgentClient):
            raise errors.ConfigError(f"sandbox {self.id} runs without sandpool's agent "
                                     f"({type(ops).__name__}): restores and services need it")
        return ops

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox; see :meth:`Sandbox.exec`."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"exec: timeout must be a finite number of seconds > 0; got {timeout!r}")
        where = self._abs(cwd or self.workdir)
        return await self._guarded(lambda a: a.exec(cmd, timeout=timeout, cwd=where, env=env or {},
                                                    max_output=max_output))

    async def read_file(self, path: str) -> bytes:
        """Return the bytes of ``path``; see :meth:`Sandbox.read_file`."""
        return await self._guarded(lambda a: a.read_file(self._abs(path), path))

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path``; see :meth:`Sandbox.write_file`."""
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise ValueError(f"write_file: mode must be a permission int in 0..0o7777, e.g. "
                             f"0o644; got {mode!r}")
        await self._guarded(lambda a: a.write_file(self._abs(path), path, data, mode))

    async def processes(self) -> list[str]:
        """Command lines of every process in the sandbox but its agent (and init)."""
        return await self._guarded(lambda a: a.processes())

    async def kill_strays(self) -> int:
        """SIGKILL every process but the agent (and init); return how many were signalled."""
        return await self._guarded(lambda a: a.kill_strays())

    async def _call(self, op: str, wait_s: float, **fields: object) -> dict:
        """One agent request by name (an op without a typed helper); its answer."""
        return await self._guarded(lambda _: self._client().call(op, wait_s, **fields))

    async def _restore_paths(self, image: str, changes: list[list[str]], pinned: dict[str, dict],
                             timeout: float) -> dict:
        """Have the agent make each repo path of ``changes`` what it is in the image's repo
        (read-only at ``image`` inside the sandbox), or the ``pinned`` bytes; its answer
        (``failed``, ``errnos``: :meth:`AgentClient.restore`)."""
        return await self._guarded(
            lambda _: self._client().restore(self.workdir, image, changes, pinned, timeout))

    async def repo_meta(self, restore: Mapping[str, dict] | None = None, *,
                        skip: tuple[str, ...] = (), timeout: float = 60.0) -> dict | None:
        """Through the agent's ``meta`` op (directories listed with O_NOATIME where it may);
        see :meth:`Sandbox.repo_meta`. None in a degraded mode without the agent."""
        if not isinstance(self._ops(), AgentClient):
            return None
        msg = await self._call("meta", timeout, root=self.workdir, skip=list(skip),
                               restore=dict(restore or {}))
        return msg["meta"]

    # -- the scratch directories -------------------------------------------------------------

    async def record_scratch(self, *, timeout: float = 30.0) -> None:
        """Record the scratch directories' own metadata as pristine; the backend calls it once,
        as soon as the agent is ready (no command of any rollout has run).

        Raises:
            SandboxStartError: A scratch directory could not be read.
        """
        meta = (await self._call("scratch", timeout, paths=list(self.scratch)))["meta"]
        bad = {p: m["error"] for p, m in meta.items() if "error" in m}
        if bad:
            raise errors.SandboxStartError(f"sandbox {self.id}: cannot read its scratch directories: {bad}")
        self._scratch_record = meta

    async def restore_scratch(self, *, timeout: float = 60.0) -> list[str] | None:
        """Empty the scratch directories (any depth) and set their mode, times and extended
        attributes back to those recorded fresh (:meth:`record_scratch`), through the agent's
        ``scratch`` op, then compare what it reads back with the record (the owner too); see
        :meth:`Sandbox.restore_scratch`. None when nothing was recorded."""
        record = self._scratch_record
        if record is None:
            return None
        msg = await self._call("scratch", timeout, paths=list(record), restore=record)
        got, left = msg["meta"], msg.get("left", {})
        problems = [f"scratch space not empty: {p} holds {names}" for p, names in left.items() if names]
        for path, want in record.items():
            now = got.get(path) or {"error": "not read"}
            if "error" in now:
                problems.append(f"scratch directory {path} could not be restored: {now['error']}")
            elif diff := [f"{k} {now.get(k)!r} (fresh {v!r})" for k, v in want.items()
                          if now.get(k) not in (v, "refreshed", "unwritable")]:  # see the op
                problems.append(f"scratch directory {path} is not as fresh: {', '.join(diff)}")
        return problems

    # -- the service -------------------------------------------------------------------------

    async def _agent_start_service(self, spec: ServiceSpec, env: dict[str, str]) -> int:
        """Start the service's process through the agent; its pid."""
        return await self._guarded(
            lambda _: self._client().start_service(self._service_argv(spec), env, self._service_cwd))

    def _service_argv(self, spec: ServiceSpec) -> list[str]:
        """The argv the agent starts (default: ``spec.argv``, run in :attr:`_service_cwd`)."""
        return list(spec.argv)

    def _service_log(self) -> str:
        """The end of the service's output, to explain a failed start (default: none)."""
        return ""

    async def _service_tree(self) -> dict[str, tuple[str, ...]]:
        """The service directory's :func:`.service.tree`, read where the policy cannot forge it."""
        raise errors.ConfigError(f"sandbox {self.id}: this backend cannot read a service directory")

    async def start_service(self, spec: ServiceSpec) -> None:
        """Start ``spec`` and record its fresh state (see :func:`.service.start`)."""
        self._service = await service.start(self, spec)

    async def restore_service(self, *, timeout: float = 60.0) -> list[str]:
        """Bring the service back to its fresh state and verify it; see
        :meth:`Sandbox.restore_service` and :func:`.service.restore`. [] without a service."""
        svc = self._service
        return [] if svc is None else await service.restore(self, svc, timeout)

    async def service_problems(self, *, timeout: float = 30.0) -> list[str]:
        """Why the service is not running as it started, one sentence each; [] when it is, or
        without a service. The same check the in-place reset makes first."""
        svc = self._service
        return [] if svc is None else await service.running(self, svc, timeout)
