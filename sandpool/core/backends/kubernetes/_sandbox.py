"""The sandbox side of the Kubernetes backend: one pod spoken to over exec.

:class:`KubernetesSandbox` runs commands, file reads and writes and process listing through
its agent session (:mod:`._session`: one exec stream for the sandbox's lifetime, the local
backend's agent), or, where the agent cannot run, through one pod exec per command
(:mod:`._exec`). Its death is set by the backend's shared pod watch.
"""

from __future__ import annotations

import base64
import errno
import itertools
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.backends.kubernetes._exec import PROCS, ExecTarget, build_argv, run_exec
from sandpool.core.backends.kubernetes._portforward import PortStream, open_port
from sandpool.core.backends._service import RunningService
from sandpool.core.backends.kubernetes._service import restore_service, service_problems
from sandpool.core.backends.kubernetes._session import AgentSession
from sandpool.core.base import ExecResult, Sandbox

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._http import KubeHttp

__all__ = ["KubernetesSandbox"]

_FILE_CHUNK = 48 << 10  # bytes per write_file exec (base64 in one argv element < 128 KiB)
# The per-command fallback's read_file exit codes for the errnos a policy's path can cause.
_READ = (
    '[ -e "$1" ] || exit 44; [ ! -d "$1" ] || exit 45; [ -r "$1" ] || exit 46; exec cat -- "$1"'
)
_READ_ERRNO = {44: errno.ENOENT, 45: errno.EISDIR, 46: errno.EACCES}
_STDERR_ERRNO = (
    ("Read-only file system", errno.EROFS),
    ("Permission denied", errno.EACCES),
    ("Is a directory", errno.EISDIR),
    ("Not a directory", errno.ENOTDIR),
    ("No space left on device", errno.ENOSPC),
    ("Disk quota exceeded", errno.EDQUOT),
    ("File name too long", errno.ENAMETOOLONG),
    ("File exists", errno.ENOTDIR),  # mkdir -p over a file in the path
)


def _stderr_errno(text: str) -> int | None:
    """The errno a coreutils/sh message in ``text`` names (its strerror text), else None."""
    return next((code for needle, code in _STDERR_ERRNO if needle in text), None)


class KubernetesSandbox(Sandbox):
    """One pod (claimed through a SandboxClaim, or created directly) spoken to over exec.

    Created by :meth:`KubernetesBackend.create`; not constructed directly.

    Attributes:
        pod: The pod name.
        pod_uid: The pod's UID when it became Ready (a pod re-created under the same name is
            a different sandbox: this one counts as dead).
        claim: The SandboxClaim name (agent-sandbox mode), else None.
        protocol: The exec channel protocol last negotiated (``v5.channel.k8s.io``...).
        channel: ``"agent"`` (one long-lived exec stream) or ``"exec"`` (one per command).
    """

    def __init__(
        self,
        http: KubeHttp,
        sid: str,
        image: str,
        target: ExecTarget,
        pod_uid: str,
        claim: str | None,
        *,
        agent_python: str = "python3",
    ) -> None:
        self.id = sid
        self.image = image
        self.workdir = target.workdir
        self.pod = target.pod
        self.pod_uid = pod_uid
        self.claim = claim
        self.protocol: str | None = None
        self._http = http
        #: The interpreter command that runs sandpool's code in the pod (agent, service tree).
        self.agent_python = agent_python
        self._target = target
        self._seq = itertools.count(1)
        self._dead: str | None = None
        self._session: AgentSession | None = None
        #: (resource, name) deleted to end this sandbox: its claim, Sandbox object or pod.
        self.owner: tuple[str, str] = ("pods", target.pod)
        #: The environment the backend's service was started with (its secrets included),
        #: and the port it serves in the pod (:mod:`._service`); empty / None without one.
        self.service_env: dict[str, str] = {}
        self.service_port: int | None = None
        self._service: RunningService | None = None

    @property
    def channel(self) -> str:
        """``"agent"`` when commands go over the agent session, else ``"exec"``."""
        return "agent" if self._session is not None else "exec"

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.aclose()

    async def _agent(self, op: str, *args: object, **kw: object) -> object:
        """Call ``op`` on the agent client; a channel that ended because the pod went away
        raises ``SandboxDied``."""
        if self._dead is not None:
            raise self._died()
        assert self._session is not None
        try:
            res = await getattr(self._session.client, op)(*args, **kw)
        except (errors.ExecTransportError, errors.SandboxDied):
            if self._dead is not None:
                raise self._died() from None
            raise
        if self._dead is not None:  # the pod died while the request ran: its answer is void
            raise self._died()
        return res

    async def restore_service(self, *, timeout: float = 60.0) -> list[str]:
        """Bring the pod's service back to its fresh state and verify it; see
        :meth:`Sandbox.restore_service` and :func:`._service.restore_service`.

        Returns:
            What differs (empty: pristine); [] without a service.
        """
        return await restore_service(self, timeout)

    async def service_problems(self, *, timeout: float = 30.0) -> list[str]:
        """Why the pod's service is not running as it started, one sentence each; [] when it
        is, or without a service (as :meth:`LocalSandbox.service_problems`).

        Raises:
            SandboxDied, ExecTransportError: As :meth:`exec`.
        """
        return await service_problems(self, timeout)

    async def open_port(self, port: int) -> PortStream:
        """Open one connection to ``port`` inside the pod (``pods/portforward``).

        Raises:
            SandboxDied: The pod is gone.
            ExecTransportError, BackendUnavailable: The handshake failed.
        """
        if self._dead is not None:
            raise self._died()
        return await open_port(self._http, self._target.namespace, self.pod, port)

    def __repr__(self) -> str:
        state = f"dead: {self._dead}" if self._dead else "alive"
        return f"<KubernetesSandbox {self.id} pod={self.pod} claim={self.claim} {state}>"

    def alive(self) -> bool:
        """False once the shared pod watch saw the pod deleted, evicted, failed or replaced, or
        once its agent session's stream ended (an API server restart, a reset connection): a
        sandbox whose session is half-dead is never reused; the pool replaces it."""
        if self._session is not None and not self._session.alive:
            return False
        return self._dead is None

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason

    def _died(self) -> errors.SandboxDied:
        return errors.SandboxDied(
            f"sandbox {self.id} (pod {self._target.namespace}/{self.pod}): {self._dead}"
        )

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.workdir) / p)

    async def _run(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        cwd: str | None,
        env: dict[str, str] | None,
        max_output: int,
    ) -> tuple[ExecResult, str]:
        if self._dead is not None:
            raise self._died()
        exec_id = f"{self.id}.{next(self._seq)}"
        argv = build_argv(
            self._target,
            exec_id,
            cmd,
            timeout=timeout,
            cwd=self._abs(cwd or self.workdir),
            env=env or {},
            max_output=max_output,
        )
        try:
            res, self.protocol = await run_exec(
                self._http, self._target, argv, timeout=timeout, max_output=max_output
            )
        except errors.ExecTransportError:
            if self._dead is not None:  # the stream broke because the pod went away
                raise self._died() from None
            raise
        if self._dead is not None:  # the pod died while the command ran: its result is void
            raise self._died()
        return res, exec_id

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        """Run ``cmd`` in the pod (agent session, else one exec); see :meth:`Sandbox.exec`.

        Raises:
            SandboxDied: The pod was deleted, evicted, OOM-killed or replaced.
            ExecTransportError: The WebSocket failed or ended without an exit status.
        """
        if self._session is not None:
            return await self._agent(  # type: ignore[return-value]
                "exec", cmd, timeout=timeout, cwd=self._abs(cwd or self.workdir),
                env=env or {}, max_output=max_output,
            )
        return (await self._run(cmd, timeout=timeout, cwd=cwd, env=env, max_output=max_output))[0]

    async def read_file(self, path: str) -> bytes:
        """Return the bytes of ``path`` (``cat`` over binary frames); see :meth:`Sandbox.read_file`.

        Raises:
            SandboxFileError: ``ENOENT``, ``EISDIR``, ``EACCES``, ... on the path (the policy's).
            SandboxDied, ExecTransportError: As :meth:`exec`.
        """
        if self._session is not None:
            return await self._agent("read_file", self._abs(path), path)  # type: ignore[return-value]
        res = await self.exec(
            ["/bin/sh", "-c", _READ, "sh", self._abs(path)], timeout=120.0, max_output=1 << 31
        )
        if res.exit_code in _READ_ERRNO:
            raise errors.sandbox_file_error(_READ_ERRNO[res.exit_code], path, f"in sandbox {self.id}")
        if not res.ok:
            raise errors.ExecTransportError(
                f"reading {path} in sandbox {self.id} failed "
                f"(exit {res.exit_code}): {res.err_text.strip()[:200]}"
            )
        return res.stdout

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` as base64 chunks over exec, then rename into place.

        Raises:
            SandboxFileError: The pod refused the write for the path's sake (EROFS, EACCES,
                EISDIR, ENOTDIR, ENOSPC): the policy's result.
            SandboxDied, ExecTransportError: As :meth:`exec`.
        """
        dest = self._abs(path)
        if self._session is not None:
            await self._agent("write_file", dest, path, data, mode)
            return
        chunks = [data[i : i + _FILE_CHUNK] for i in range(0, len(data), _FILE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            script = (
                'set -e; [ ! -d "$1" ] || { echo "$1: Is a directory" >&2; exit 1; }; '
                'mkdir -p "$(dirname "$1")"; '
                if i == 0
                else "set -e; "
            )
            script += 'printf %s "$2" | base64 -d ' + (
                '> "$1.sp-part"' if i == 0 else '>> "$1.sp-part"'
            )
            if last:
                script += '; chmod "$3" "$1.sp-part"; mv -f "$1.sp-part" "$1"'
            res = await self.exec(
                [
                    "/bin/sh",
                    "-c",
                    script,
                    "sh",
                    dest,
                    base64.b64encode(chunk).decode(),
                    f"{mode:o}",
                ],
                timeout=120.0,
            )
            if not res.ok:
                code = _stderr_errno(res.err_text)
                if code is not None:  # the policy's path: a result, not a broken channel
                    raise errors.sandbox_file_error(code, path, f"in sandbox {self.id}")
                raise errors.ExecTransportError(
                    f"writing {path} in sandbox {self.id} failed (exit {res.exit_code}): "
                    f"{res.err_text.strip()[:200]}"
                )

    async def processes(self) -> list[str]:
        """Command lines of the processes started by this sandbox's execs, except the asking one.

        Only processes carrying this sandbox's ``SANDPOOL_SANDBOX`` marker are seen: on kwok
        the pod's exec runs on the host, and host processes are never listed or touched.
        With the agent session: every process of the pod but its agent and init (the local
        backend's semantics).
        """
        if self._session is not None:
            return await self._agent("processes")  # type: ignore[return-value]
        res = await self._run(
            ["/bin/sh", "-c", PROCS, "sh", self.id, "list"],
            timeout=30.0,
            cwd="/",
            env=None,
            max_output=1 << 20,
        )
        return [line for line in res[0].text.splitlines() if line.strip()]

    async def kill_strays(self) -> int:
        """SIGKILL every process carrying this sandbox's marker but the asking exec (with the
        agent session: every process but the agent and init); return how many."""
        if self._session is not None:
            return await self._agent("kill_strays")  # type: ignore[return-value]
        res = await self._run(
            ["/bin/sh", "-c", PROCS, "sh", self.id, "kill"],
            timeout=30.0,
            cwd="/",
            env=None,
            max_output=1 << 20,
        )
        try:
            return int(res[0].text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise errors.ExecTransportError(
                f"kill_strays in sandbox {self.id}: unexpected answer {res[0].text[:100]!r}"
            ) from None

