"""The pod-exec stream: the exec subresource's WebSocket channel protocol, and the agent's
:class:`~sandpool.core.agent.channel.Channel` over it.

Protocols: ``v5.channel.k8s.io`` where the server offers it, else ``v4.channel.k8s.io``.
Every binary frame starts with a channel byte: 0 stdin (client to server), 1 stdout, 2 stderr,
3 status (a JSON ``Status`` when the command ends), 255 close (v5: ``[255, 0]`` closes the
command's stdin). Frames are bytes, so output is binary-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal

import aiohttp

from sandpool.core import errors
from sandpool.core.agent.channel import Channel
from sandpool.core.backends.kubernetes import _errors

__all__ = ["PROTOCOLS", "PodExecChannel", "parse_status", "unreached"]

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
STDIN, STDOUT, STDERR, STATUS, CLOSE = 0, 1, 2, 3, 255
_CHUNK = 32 << 10  # bytes of stdin per frame
_STDERR_KEPT = 4096  # bytes of the agent's stderr kept to explain a failed start
_EXIT_STATUS = re.compile(r"exit status (\d+)")
_SIGNALLED = re.compile(r"signal: (\w[\w ]*)")
_UNREACHED = re.compile(r"error dialing backend|error sending request|dial tcp")
_WS_END = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED)


def parse_status(raw: bytes | None) -> tuple[int | None, str]:
    """Exit code and message from the status channel's ``Status`` JSON.

    ``Success`` is 0; a failure carries the code in ``details.causes[reason=ExitCode]``
    (kubelet) or as ``exit status N`` in its message (kwok); ``signal: killed`` gives
    ``128 + 9``. Returns ``(None, message)`` when no exit code can be read.

    Raises:
        ValueError: ``raw`` is not JSON.
    """
    if not raw:
        return None, "no status frame"
    st = json.loads(raw)
    if st.get("status") == "Success":
        return 0, ""
    msg = st.get("message", "")
    for cause in (st.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"]), msg
    if m := _EXIT_STATUS.search(msg):
        return int(m.group(1)), msg
    if m := _SIGNALLED.search(msg):
        name = "SIG" + m.group(1).strip().upper().split()[0]
        aliases = {"SIGKILLED": "SIGKILL", "SIGTERMINATED": "SIGTERM", "SIGINTERRUPT": "SIGINT"}
        try:
            return 128 + signal.Signals[aliases.get(name, name)].value, msg
        except KeyError:
            return None, msg
    return None, msg


def unreached(raw: bytes | None) -> str | None:
    """The message of a status frame saying the API server could not reach the pod's node.

    With the node's kubelet down or unreachable, kube-apiserver still upgrades the exec
    stream, then ends it with a ``Failure`` status (``InternalError``, code 500: "error
    dialing backend: dial tcp ..."; kwok's "error sending request: ... dial tcp ...") and no
    exit code: the command never started, so running it again cannot run it twice.

    Returns:
        The status message, or None for any other status (an exit code, a failure after the
        command started, no or garbled status).
    """
    try:
        st = json.loads(raw or b"")
    except ValueError:
        return None
    if not isinstance(st, dict) or st.get("status") != "Failure":
        return None
    if any(c.get("reason") == "ExitCode" for c in (st.get("details") or {}).get("causes") or []):
        return None
    msg = str(st.get("message", ""))
    return msg if _UNREACHED.search(msg) else None


class PodExecChannel(Channel):
    """The agent's stdio over one pod-exec WebSocket stream (stdin, stdout and stderr).

    Stdin goes out as frames of at most 32 KiB; stdout is what :meth:`read` returns; stderr is
    kept (its last 4 KiB, :attr:`stderr_tail`) to explain a failed start; the status frame ends
    the stream. The stream is not the sandbox: when it ends, the pod may live on (the backend's
    pod watch says whether it does), so its end is an ``ExecTransportError`` unless the API
    server said the pod is gone.

    Args:
        ws: The open WebSocket (:meth:`KubeHttp.ws_connect` on the exec subresource).
        name: For messages (``agent session in <ns>/<pod>``).

    Attributes:
        stderr_tail: The last bytes the agent wrote to stderr.
        exited: True once the agent's process ended with a status (as opposed to the stream
            breaking under it).
        unreached: The status message when the API server could not reach the node: the
            agent never started (:func:`unreached`).
    """

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, name: str) -> None:
        self.name = name
        self.stderr_tail = bytearray()
        self.exited = False
        self.unreached: str | None = None
        self._ws = ws
        self._send_lock = asyncio.Lock()
        self._status: bytes | None = None
        self._error: errors.SandpoolError | None = None
        self._done = asyncio.Event()

    @property
    def protocol(self) -> str | None:
        """The negotiated channel protocol (``v5.channel.k8s.io``...)."""
        return self._ws.protocol

    async def read(self) -> bytes:
        """The next stdout bytes; ``b""`` once the stream ended (status, close or failure)."""
        while not self._done.is_set():
            try:
                msg = await self._ws.receive()
            except Exception as exc:  # noqa: BLE001 - translated at this one boundary
                self._error = _errors.translate(exc, self.name, channel=_errors.Channel.EXEC)
                break
            if msg.type in _WS_END:
                break
            if msg.type is aiohttp.WSMsgType.ERROR:
                self._error = _errors.translate(msg.data, self.name, channel=_errors.Channel.EXEC)
                break
            if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            data = msg.data if msg.type is aiohttp.WSMsgType.BINARY else msg.data.encode()
            if not data:
                continue
            ch, payload = data[0], data[1:]
            if ch == STDOUT and payload:
                return bytes(payload)
            if ch == STDERR:
                self.stderr_tail += payload
                del self.stderr_tail[:-_STDERR_KEPT]
            elif ch == STATUS:
                self._status = (self._status or b"") + payload
        if not self._done.is_set() and self._status is not None:
            self.unreached = unreached(self._status)
            self.exited = self.unreached is None
        self._done.set()
        return b""

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the agent's stdin.

        Raises:
            ExecTransportError, SandboxDied: The stream is closed or failed (translated).
        """
        ws = self._ws
        if ws.closed:
            raise self._error or errors.ExecTransportError(f"{self.name}: closed")
        try:
            async with self._send_lock:
                for i in range(0, len(data), _CHUNK):
                    await ws.send_bytes(bytes([STDIN]) + data[i : i + _CHUNK])
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            raise _errors.translate(exc, self.name, channel=_errors.Channel.EXEC) from exc

    async def ended(self, *, started: bool) -> errors.SandpoolError:
        """The translated transport error, else ``ExecTransportError`` naming the agent's exit
        status (whether or not it had ``started``)."""
        if self._error is not None:
            return self._error
        try:
            code, message = parse_status(self._status)
        except ValueError:
            code, message = None, repr(self._status)
        return errors.ExecTransportError(
            f"{self.name}: the agent ended (exit {code}, {message or 'no status'})")

    def alive(self) -> bool:
        """True until the stream ended."""
        return not self._done.is_set() and not self._ws.closed

    @property
    def ended_cleanly(self) -> bool:
        """True once the stream ended without a transport error: the server closed it (as it
        does when the agent's process, or its container, ended) or sent the command's status."""
        return self._done.is_set() and self._error is None and self.unreached is None

    async def aclose(self) -> None:
        """Close the agent's stdin (``v5``: it reads EOF and exits, and the stream ends with its
        status, waited for at most 2 s), then the WebSocket; idempotent."""
        if not self._ws.closed:
            with contextlib.suppress(Exception):
                if self._ws.protocol == "v5.channel.k8s.io":
                    async with self._send_lock:
                        await self._ws.send_bytes(bytes([CLOSE, STDIN]))
                    await asyncio.wait_for(self._done.wait(), 2.0)
            with contextlib.suppress(Exception):
                await self._ws.close()
