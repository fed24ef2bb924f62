"""One long-lived agent session per sandbox over a single pod-exec stream.

After a sandbox is claimed, :class:`AgentSession` opens ONE exec stream (stdin, stdout and
stderr) running sandpool's agent (:mod:`sandpool.core.agent._agent`, the same file the
local backend runs) with ``python3 -I -u -c <source>``; every later command, file read and
write, process listing and kill of strays of the sandbox is a JSON line on that stream
(:class:`~sandpool.core.agent.client.AgentClient`). The API server then sees the
one stream per sandbox lifetime, not one per command.

Frames (``v5``/``v4.channel.k8s.io``): the client sends stdin as binary frames prefixed by
channel byte 0, in chunks of :data:`_CHUNK` bytes; stdout (1) feeds the agent client,
stderr (2) is kept (the last 4 KiB) to explain a failed start, status (3) ends the session.

A session that ends while its sandbox lives (API server restart, reset connection, the node's
kubelet gone) fails every pending and later call with ``ExecTransportError`` (infra: the
rollout is retried, never scored) and makes the sandbox not ``alive()``, so the pool deletes
it instead of reusing it; its replacement opens its own stream (counted in ``execs``). A
stream that the API server could not even connect to the node (:func:`._exec.unreached`) is
retried within the HTTP layer's budget; only an agent that itself exited with a status (no
interpreter) makes the image fall back to per-command exec.

Who can signal the agent. The policy's commands are the agent's children: if they can kill
it they end the channel, which turns a rollout they are failing into an infra retry. On the
kwok test cluster the session is started by ``unshare --pid --fork --mount-proc``
(``hack/cluster/container.sh``) and the agent is pid 1 of that pid namespace, as
under the local backend's ``bwrap --as-pid-1``: the kernel drops every signal sent to it from
inside that it has no handler for (SIGKILL and SIGSTOP too, even from root), so
``kill -9 -1`` and ``kill -9 1`` leave it running. On a real cluster a pod exec joins the
container's pid namespace, whose pid 1 is the container's entrypoint, so the agent is an
ordinary process there. ``KubernetesBackend(agent_entrypoint=True)`` gives the same
guarantee there: the agent is the container's pid 1 (its command, :mod:`._entrypoint`), and
this session reaches it over ``pods/attach`` instead of ``pods/exec`` (``attach=True``). Ptrace of the agent and reading
its ``/proc/<pid>/fd`` need ``CAP_SYS_PTRACE``, which a container lacks by default (the agent
is non-dumpable). On kwok, commands run as root on the node host: the signal path is closed,
ptrace is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import TYPE_CHECKING

import aiohttp

from sandpool.core import errors
from sandpool.core.agent.client import AgentClient, agent_source
from sandpool.core.backends.kubernetes._entrypoint import boot_payload
from sandpool.core.backends.kubernetes._errors import Channel, translate
from sandpool.core.backends.kubernetes._exec import PROTOCOLS, ExecTarget, parse_status, unreached

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._http import KubeHttp

__all__ = ["AgentSession", "AgentUnavailable"]

log = logging.getLogger("sandpool.kubernetes")

_STDIN, _STDOUT, _STDERR, _STATUS, _CLOSE = 0, 1, 2, 3, 255
_CHUNK = 32 << 10


class AgentUnavailable(Exception):
    """The agent could not start in the pod (no ``python3``, or it never said ready); the
    sandbox falls back to one pod exec per command."""


class AgentSession:
    """The agent of one sandbox, spoken to over one exec stream.

    Args:
        http: The backend's HTTP layer.
        target: The pod.
        sandbox_id: For messages.
        python: The interpreter command in the image.

    Attributes:
        client: The :class:`AgentClient` (requests and answers).
        stderr_tail: The last bytes the agent wrote to stderr.
    """

    def __init__(self, http: KubeHttp, target: ExecTarget, sandbox_id: str, python: str,
                 attach: bool = False) -> None:
        self._http = http
        self._target = target
        self.client: AgentClient = AgentClient(sandbox_id, self._send)
        self.stderr_tail = bytearray()
        #: True once the agent's process ended with an exit status on the status channel
        #: (as opposed to the stream breaking under it).
        self.exited = False
        #: The status message when the API server could not reach the node (never started).
        self.unreached: str | None = None
        self._sandbox_id = sandbox_id
        # attach: the agent is the container's pid 1 (._entrypoint), reached on its stdio.
        self._attach = attach
        self._argv = [] if attach else [python, "-I", "-u", "-c", agent_source()]
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._what = f"agent session in {target.namespace}/{target.pod}"

    @property
    def protocol(self) -> str | None:
        """The negotiated channel protocol (``v5.channel.k8s.io``...), once open."""
        return self._ws.protocol if self._ws is not None else None

    @property
    def alive(self) -> bool:
        """True until the stream ended."""
        return self.client.error is None and self._reader is not None and not self._reader.done()

    async def start(self, timeout: float) -> None:
        """Open the stream and wait for the agent's ready line.

        Raises:
            AgentUnavailable: The agent did not start: its process ended with an exit status
                (no ``python3``, a failed prctl) or said nothing within ``timeout``; the
                stream is closed.
            SandboxDied: The pod is gone.
            ExecTransportError, BackendUnavailable: The handshake failed, or the API server
                could not reach the node (:func:`._exec.unreached`), after the HTTP layer's
                retries; or the stream broke before the ready line without an exit status:
                infra errors, never a reason to give up the agent for the image.
        """
        query = [("container", self._target.container), ("stdin", "true"),
                 ("stdout", "true"), ("stderr", "true")]
        query += [("command", a) for a in self._argv]
        sub = "attach" if self._attach else "exec"
        path = f"/api/v1/namespaces/{self._target.namespace}/pods/{self._target.pod}/{sub}"
        for attempt in itertools.count(1):
            self._ws = await self._http.ws_connect(path, query, PROTOCOLS)
            self._reader = asyncio.create_task(self._read_loop(), name=f"sandpool-{self._what}")
            try:
                if self._attach:
                    await self._send(boot_payload())
                hello = await self.client.ready(timeout)
            except (TimeoutError, errors.SandpoolError) as exc:
                await self.aclose()
                if self.unreached is not None:
                    # The API server could not reach the node: the agent never started.
                    # Retried within the HTTP layer's budget, like a refused handshake.
                    if await self._http.retry_wait(attempt, 500):
                        self._reset()
                        continue
                    raise errors.ExecTransportError(
                        f"{self._what}: the API server could not reach the pod's node after "
                        f"{attempt - 1} retries: {self.unreached[:300]}"
                    ) from None
                if isinstance(exc, errors.SandpoolError) and not self.exited:
                    # The stream broke (API server restart, reset connection, pod gone) before
                    # the agent could answer: the cluster's failure, not the image's; the next
                    # sandbox of the image tries the agent again.
                    raise exc
                tail = bytes(self.stderr_tail[-300:]).decode("utf-8", "replace").strip()
                why = "no ready line within {:.0f} s".format(timeout) if isinstance(
                    exc, TimeoutError) else str(exc)
                raise AgentUnavailable(f"{why}{': ' + tail if tail else ''}") from None
            if hello.get("ready") is not True:  # the entrypoint found no usable interpreter
                await self.aclose()
                raise AgentUnavailable(str(hello.get("error") or hello))
            return

    def _reset(self) -> None:
        """Forget a stream that never reached the agent, before opening the next one."""
        self.client = AgentClient(self._sandbox_id, self._send)
        self.stderr_tail.clear()
        self.exited, self.unreached = False, None
        self._ws = self._reader = None

    async def _send(self, data: bytes) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            raise self.client.error or errors.ExecTransportError(f"{self._what}: closed")
        try:
            async with self._send_lock:
                for i in range(0, len(data), _CHUNK):
                    await ws.send_bytes(bytes([_STDIN]) + data[i : i + _CHUNK])
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            raise translate(exc, self._what, channel=Channel.EXEC) from exc

    async def _read_loop(self) -> None:
        assert self._ws is not None
        status: bytes | None = None
        err: errors.SandpoolError | None = None
        try:
            async for msg in self._ws:
                if msg.type is aiohttp.WSMsgType.ERROR:
                    err = translate(msg.data, self._what, channel=Channel.EXEC)
                    break
                if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    continue
                data = msg.data if msg.type is aiohttp.WSMsgType.BINARY else msg.data.encode()
                if not data:
                    continue
                ch, payload = data[0], data[1:]
                if ch == _STDOUT:
                    self.client.feed(payload)
                elif ch == _STDERR:
                    self.stderr_tail += payload
                    del self.stderr_tail[:-4096]
                elif ch == _STATUS:
                    status = (status or b"") + payload
        except Exception as exc:  # noqa: BLE001 - translated at this one boundary
            err = translate(exc, self._what, channel=Channel.EXEC)
        if status is not None:
            self.unreached = unreached(status)
            self.exited = self.unreached is None
        if err is None:
            try:
                code, message = parse_status(status)
            except ValueError:
                code, message = None, repr(status)
            err = errors.ExecTransportError(
                f"{self._what}: the agent ended (exit {code}, {message or 'no status'})"
            )
        self.client.fail(err)

    async def aclose(self) -> None:
        """Close the agent's stdin (``v5``: it reads EOF and exits), then the stream; idempotent."""
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(Exception):
                if self._ws.protocol == "v5.channel.k8s.io":
                    async with self._send_lock:
                        await self._ws.send_bytes(bytes([_CLOSE, _STDIN]))
                    # The agent's exit ends the stream with its status; do not wait long.
                    await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 5.0)
        self.client.fail(errors.SandboxDied(f"{self._what}: closed by sandpool"))
