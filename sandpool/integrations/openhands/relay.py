"""The host-side relay on 127.0.0.1: how a sandbox's agent-server is reached.

The agent-server inside a sandbox is never on the host's network. :class:`Relay` listens on
``127.0.0.1`` only, on an ephemeral port, and pipes each connection's bytes both ways to one
upstream connection into the sandbox, so HTTP and websocket clients (OpenHands'
``RemoteWorkspace`` and ``RemoteConversation``) connect as to any agent-server. The upstream
differs by backend, the relay does not:

* :class:`UnixRelay`: a local sandbox's server listens on a unix socket in its service
  directory;
* ``Relay(lambda: sandbox.open_port(port))``: a Kubernetes pod's server listens on a port
  inside the pod, reached through the API server's ``pods/portforward`` (one WebSocket per
  connection, :meth:`KubernetesSandbox.open_port
  <sandpool.core.backends.kubernetes.KubernetesSandbox.open_port>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from sandpool.core import errors
from sandpool.core.service import SocketStream

__all__ = ["Relay", "UnixRelay", "Upstream"]

log = logging.getLogger("sandpool.openhands")

_CHUNK = 1 << 16
#: Seconds between checks of the sandbox's death (a cheap in-process flag).
GONE_CHECK_S = 0.25
_SUN_PATH_MAX = 108  # bytes in sockaddr_un.sun_path (Linux), the terminating NUL included


class Upstream(Protocol):
    """One connection into the sandbox, as the relay uses it."""

    #: True when :meth:`write_eof` ends one direction only (a socket); False when the
    #: transport cannot (a port-forward WebSocket), so the client's EOF ends the connection.
    half_close: bool

    async def read(self) -> bytes:
        """The next bytes from the server; ``b""`` at the end."""

    async def write(self, data: bytes) -> None:
        """Send bytes to the server."""

    async def write_eof(self) -> None:
        """End the client-to-server direction."""

    async def aclose(self) -> None:
        """Close the connection; idempotent."""


class Relay:
    """Relays ``127.0.0.1:<port>`` to upstream connections made by ``connect``.

    Usage::

        relay = Relay(lambda: sandbox.open_port(8000), "pod p:8000")
        port = await relay.start()          # http://127.0.0.1:{port}
        ...
        await relay.aclose()

    Args:
        connect: Opens one upstream connection per client connection; an ``OSError`` or
            ``SandpoolError`` it raises closes that client connection (the sandbox or its
            server is gone).
        what: Names the upstream in logs and ``repr``.
        gone: Says why the sandbox is gone (its death), or None while it lives. Once it is
            gone, every open connection is cut (checked every :data:`GONE_CHECK_S`) and
            new ones are answered ``410 Gone`` with the reason, as a gateway answers for a
            backend that no longer exists: OpenHands' client retries connection errors and
            5xx until its run timeout (an hour), and stops on a 4xx.
    """

    def __init__(self, connect: Callable[[], Awaitable[Upstream]], what: str,
                 gone: Callable[[], str | None] = lambda: None) -> None:
        self._connect = connect
        self.what = what
        self._gone = gone
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._closing = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} 127.0.0.1:{self.port} -> {self.what} conns={len(self._conns)}>"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` once started."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> int:
        """Listen on 127.0.0.1 (ephemeral port) and return the port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._monitor = asyncio.create_task(self._watch_gone(), name=f"sandpool-relay-{self.port}")
        return self.port

    async def _watch_gone(self) -> None:
        while self._gone() is None:
            await asyncio.sleep(GONE_CHECK_S)
        for task in list(self._conns):  # a dead sandbox's streams may never end by themselves
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            if not self._closing and self._gone() is None:
                raise
            # Cut by aclose() or the sandbox's death: the connection's end, not an error.

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        up: Upstream | None = None
        try:
            if (why := self._gone()) is not None:
                await _answer_gone(reader, writer, why)
                return
            try:
                up = await self._connect()
            except (OSError, errors.SandpoolError) as exc:
                log.debug("relay %s: no upstream: %s", self.what, exc)
                if (why := self._gone()) is not None:
                    await _answer_gone(reader, writer, why)
                return  # else the client sees a closed connection
            upload = asyncio.create_task(_upload(reader, up))
            download = asyncio.create_task(_download(up, writer))
            # The server closing its end (a response sent, or the sandbox died) ends the
            # connection for the client too, even while the client's side is still open; a
            # client's EOF ends it when the upstream cannot half-close.
            waits = {download} if up.half_close else {download, upload}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (upload, download):
                    t.cancel()
                await asyncio.gather(upload, download, return_exceptions=True)
        finally:
            if up is not None:
                await up.aclose()
            writer.close()
            self._conns.discard(task)

    async def aclose(self) -> None:
        """Stop listening and cut every open connection. Idempotent."""
        self._closing = True
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)


class UnixRelay(Relay):
    """Relays ``127.0.0.1:<port>`` to the unix socket ``path`` on the host.

    Usage::

        relay = UnixRelay(sandbox.service_dir / "agent-server.sock")
        port = await relay.start()

    Args:
        path: The unix socket; one longer than a socket address holds (108 bytes) is
            reached through its directory.
        gone: See :class:`Relay`.
    """

    def __init__(self, path: Path | str, gone: Callable[[], str | None] = lambda: None) -> None:
        super().__init__(self._open, str(path), gone)
        self.path = str(path)
        self._dir_fd: int | None = None

    async def start(self) -> int:
        """Listen on 127.0.0.1 (ephemeral port) and return the port."""
        if len(self.path.encode()) >= _SUN_PATH_MAX and self._dir_fd is None:
            self._dir_fd = os.open(os.path.dirname(self.path), os.O_PATH | os.O_DIRECTORY)
        return await super().start()

    async def _open(self) -> Upstream:
        path = self.path
        if self._dir_fd is not None:
            path = f"/proc/self/fd/{self._dir_fd}/{os.path.basename(self.path)}"
        return SocketStream(*await asyncio.open_unix_connection(path))

    async def aclose(self) -> None:
        """Stop listening, cut every open connection. Idempotent."""
        await super().aclose()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None



async def _answer_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, why: str) -> None:
    body = f"sandpool: the sandbox is gone: {why}\n".encode()
    writer.write(b"HTTP/1.1 410 Gone\r\nContent-Type: text/plain; charset=utf-8\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    # A lingering close: closing with the request still unread would reset the connection
    # and could drop the answer, so read until the client closes (briefly).
    with contextlib.suppress(OSError, TimeoutError):
        await writer.drain()
        writer.write_eof()
        async with asyncio.timeout(2.0):
            while await reader.read(_CHUNK):
                pass


async def _upload(src: asyncio.StreamReader, up: Upstream) -> None:
    with contextlib.suppress(OSError, errors.SandpoolError):
        while data := await src.read(_CHUNK):
            await up.write(data)
        await up.write_eof()


async def _download(up: Upstream, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, errors.SandpoolError):
        while data := await up.read():
            dst.write(data)
            await dst.drain()
