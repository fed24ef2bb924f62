"""A host-side TCP relay to a unix socket: how a sandbox's agent-server is reached.

The agent-server inside a local sandbox listens on a unix socket in the sandbox's service
directory (the sandbox has no network). :class:`UnixRelay` listens on ``127.0.0.1`` only, on
an ephemeral port, and pipes each connection's bytes both ways to the socket, so HTTP and
websocket clients (OpenHands' ``RemoteWorkspace`` and ``RemoteConversation``) connect as to any
agent-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

__all__ = ["UnixRelay"]

_CHUNK = 1 << 16
_SUN_PATH_MAX = 108  # bytes in sockaddr_un.sun_path (Linux), the terminating NUL included


class UnixRelay:
    """Relays ``127.0.0.1:<port>`` to the unix socket ``path``.

    Usage::

        relay = UnixRelay(sandbox.service_dir / "agent-server.sock")
        port = await relay.start()          # http://127.0.0.1:{port}
        ...
        await relay.aclose()

    Args:
        path: The unix socket on the host.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._dir_fd: int | None = None
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}

    def __repr__(self) -> str:
        return f"<UnixRelay 127.0.0.1:{self.port} -> {self.path} conns={len(self._conns)}>"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` once started."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> int:
        """Listen on 127.0.0.1 (ephemeral port) and return the port."""
        if len(self.path.encode()) >= _SUN_PATH_MAX:
            # A socket path longer than sockaddr_un holds is reached through its directory.
            self._dir_fd = os.open(os.path.dirname(self.path), os.O_PATH | os.O_DIRECTORY)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        writers = self._conns[task] = [writer]
        try:
            try:
                up_r, up_w = await asyncio.open_unix_connection(self._connect_path)
            except OSError:
                return  # the sandbox (or its server) is gone: the client sees a closed connection
            writers.append(up_w)
            upload = asyncio.create_task(_pipe(reader, up_w))
            try:
                # The server closing its end (a response sent, or the sandbox died) ends the
                # connection for the client too, even while the client's side is still open.
                await _pipe(up_r, writer)
            finally:
                upload.cancel()
                await asyncio.gather(upload, return_exceptions=True)
        finally:
            for w in writers:
                w.close()
            self._conns.pop(task, None)

    @property
    def _connect_path(self) -> str:
        if self._dir_fd is None:
            return self.path
        return f"/proc/self/fd/{self._dir_fd}/{os.path.basename(self.path)}"

    async def aclose(self) -> None:
        """Stop listening and cut every open connection. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        # Aborting the transports ends both pipes of every connection; its task then finishes.
        for writers in list(self._conns.values()):
            for w in writers:
                w.transport.abort()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
