"""The host-side relay from 127.0.0.1 to a unix socket (no sandbox needed)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from sandpool.integrations.openhands.relay import UnixRelay


async def _echo_server(path: Path) -> asyncio.Server:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"echo:" + await r.readline())
        await w.drain()
        w.close()

    return await asyncio.start_unix_server(serve, str(path))


async def test_relay_carries_bytes_both_ways_on_loopback_only(tmp_path):
    server = await _echo_server(tmp_path / "s.sock")
    relay = UnixRelay(tmp_path / "s.sock")
    port = await relay.start()
    try:
        assert relay.url == f"http://127.0.0.1:{port}"
        assert relay._server.sockets[0].getsockname()[0] == "127.0.0.1"
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"hello\n")
        await w.drain()
        assert await r.read() == b"echo:hello\n"  # the server's close ends the client's connection
        w.close()
    finally:
        await relay.aclose()
        server.close()


async def test_relay_reaches_a_socket_path_longer_than_sockaddr_holds(tmp_path):
    deep = tmp_path.joinpath(*["d" * 20] * 5)
    deep.mkdir(parents=True)
    sock = deep / "agent-server.sock"
    assert len(str(sock)) > 108
    # Bind through a short relative path (the kernel limit applies to what bind() is given).
    cwd = os.getcwd()
    os.chdir(deep)
    try:
        server = await _echo_server(Path("agent-server.sock"))
    finally:
        os.chdir(cwd)
    relay = UnixRelay(sock)
    port = await relay.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"deep\n")
        await w.drain()
        assert await r.read() == b"echo:deep\n"
        w.close()
    finally:
        await relay.aclose()
        server.close()


async def test_relay_closes_the_client_when_the_socket_is_gone(tmp_path):
    relay = UnixRelay(tmp_path / "missing.sock")
    port = await relay.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await r.read() == b""
        w.close()
    finally:
        await relay.aclose()
