"""One TCP connection to a port of a pod, through the API server's ``pods/portforward``.

:func:`open_port` opens a WebSocket to ``/api/v1/namespaces/<ns>/pods/<pod>/portforward
?ports=<port>`` with the ``v4.channel.k8s.io`` subprotocol; the API server hands it to the
node's kubelet (kwok on the test cluster), which connects to the port inside the pod's
network namespace. Each WebSocket carries one connection. Frames (the kubelet's
``portforward`` websocket protocol, k8s.io/cri-streaming 0.36): channel byte 0 is data,
1 is errors; the first frame on each channel is the port as two bytes, little-endian.

Neither kubernetes_asyncio (36.x; its ``WsApiClient`` frames exec output only) nor the sync
``kubernetes`` client (threads) offers an asyncio port-forward, so this module frames it over
the backend's own WebSocket (:meth:`KubeHttp.ws_connect`: throttling, retries, one error
translation).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import aiohttp

from sandpool.core import errors
from sandpool.core.backends.kubernetes._errors import Channel, translate

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._http import KubeHttp

__all__ = ["PROTOCOL", "PortStream", "open_port"]

PROTOCOL = "v4.channel.k8s.io"
_DATA, _ERROR = 0, 1


class PortStream:
    """One connection to a pod's port: bytes in, bytes out.

    Made by :func:`open_port`. Not safe for two concurrent readers.

    Attributes:
        error: The text the kubelet sent on the error channel (e.g. nothing listens on the
            port), once the stream ended; empty otherwise.
    """

    half_close = False  # the v4 protocol has no way to end one direction only

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, what: str) -> None:
        self._ws = ws
        self._what = what
        self._skip = {_DATA: 2, _ERROR: 2}  # the port prefix of each channel
        self.error = ""

    async def read(self) -> bytes:
        """The next bytes from the pod's port; ``b""`` once the connection ended.

        Raises:
            ExecTransportError: The WebSocket failed (not a plain close).
        """
        while True:
            msg = await self._ws.receive()
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                            aiohttp.WSMsgType.CLOSED):
                return b""
            if msg.type is aiohttp.WSMsgType.ERROR:
                raise translate(msg.data, self._what, channel=Channel.EXEC)
            if msg.type is not aiohttp.WSMsgType.BINARY or not msg.data:
                continue
            ch, payload = msg.data[0], msg.data[1:]
            if ch in self._skip and self._skip[ch]:
                cut = min(self._skip[ch], len(payload))
                self._skip[ch] -= cut
                payload = payload[cut:]
            if ch == _DATA and payload:
                return bytes(payload)
            if ch == _ERROR and payload:
                self.error += payload.decode("utf-8", "replace")

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the pod's port.

        Raises:
            ExecTransportError: The WebSocket is closed or failed.
        """
        try:
            await self._ws.send_bytes(bytes([_DATA]) + data)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            raise translate(exc, self._what, channel=Channel.EXEC) from exc

    async def write_eof(self) -> None:
        """Nothing to do: see :attr:`half_close`."""

    async def aclose(self) -> None:
        """Close the WebSocket (the kubelet closes the pod-side connection); idempotent.

        Waits at most 2 s for the close handshake (a dead node never answers it)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._ws.close(), 2.0)


async def open_port(http: KubeHttp, namespace: str, pod: str, port: int) -> PortStream:
    """Open one connection to ``port`` of ``pod``.

    Args:
        http: The backend's HTTP layer.
        namespace: The pod's namespace.
        pod: The pod name.
        port: The port inside the pod (1-65535).

    Returns:
        The open stream; the kubelet connects to the port when it opens (so a port nothing
        listens on shows as an :attr:`PortStream.error` and an immediate end).

    Raises:
        SandboxDied: The pod is gone (404).
        ExecTransportError, BackendUnavailable: The handshake failed.
    """
    if not 0 < port < 65536:
        raise errors.ConfigError(f"port={port} is not a TCP port (1-65535)")
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}/portforward"
    ws = await http.ws_connect(path, [("ports", str(port))], (PROTOCOL,), accept="*/*")
    return PortStream(ws, f"port-forward {namespace}/{pod}:{port}")
