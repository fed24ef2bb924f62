"""One long-lived agent session per sandbox over a single pod-exec stream.

After a sandbox is claimed, :class:`AgentSession` opens ONE exec stream (stdin, stdout and
stderr) running sandpool's agent (:mod:`sandpool.core.backends._agent`, the same file the
local backend runs) with ``python3 -I -u -c <source>``; every later command, file read and
write, process listing and kill of strays of the sandbox is a JSON line on that stream
(:class:`~sandpool.core.backends._agent_client.AgentClient`). The API server then sees the
one stream per sandbox lifetime, not one per command.

Frames (``v5``/``v4.channel.k8s.io``): the client sends stdin as binary frames prefixed by
channel byte 0, in chunks of :data:`_CHUNK` bytes; stdout (1) feeds the agent client,
stderr (2) is kept (the last 4 KiB) to explain a failed start, status (3) ends the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import aiohttp

from sandpool.core import errors
from sandpool.core.backends._agent_client import AgentClient, agent_source
from sandpool.core.backends.kubernetes._errors import Channel, translate
from sandpool.core.backends.kubernetes._exec import PROTOCOLS, ExecTarget, parse_status

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
        target: The pod (``session_prefix`` is put before the agent's argv).
        sandbox_id: For messages.
        python: The interpreter command in the image.

    Attributes:
        client: The :class:`AgentClient` (requests and answers).
        stderr_tail: The last bytes the agent wrote to stderr.
    """

    def __init__(self, http: KubeHttp, target: ExecTarget, sandbox_id: str, python: str) -> None:
        self._http = http
        self._target = target
        self.client: AgentClient = AgentClient(sandbox_id, self._send)
        self.stderr_tail = bytearray()
        self._argv = [*target.session_prefix, python, "-I", "-u", "-c", agent_source()]
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
            AgentUnavailable: The agent did not start (the stream ended first, or no ready
                line within ``timeout``); the stream is closed.
            SandboxDied: The pod is gone.
            ExecTransportError, BackendUnavailable: The handshake failed.
        """
        query = [("container", self._target.container), ("stdin", "true"),
                 ("stdout", "true"), ("stderr", "true")]
        query += [("command", a) for a in self._argv]
        path = f"/api/v1/namespaces/{self._target.namespace}/pods/{self._target.pod}/exec"
        self._ws = await self._http.ws_connect(path, query, PROTOCOLS)
        self._reader = asyncio.create_task(self._read_loop(), name=f"sandpool-{self._what}")
        try:
            await self.client.ready(timeout)
        except (TimeoutError, errors.SandpoolError) as exc:
            await self.aclose()
            tail = bytes(self.stderr_tail[-300:]).decode("utf-8", "replace").strip()
            why = "no ready line within {:.0f} s".format(timeout) if isinstance(
                exc, TimeoutError) else str(exc)
            raise AgentUnavailable(f"{why}{': ' + tail if tail else ''}") from None

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
