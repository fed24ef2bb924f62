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


async def test_relay_answers_410_once_the_sandbox_is_gone_and_cuts_open_connections(tmp_path):
    held = asyncio.Event()

    async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.set()
        await r.read()  # never answers: a stream into a sandbox that stopped
        w.close()

    server = await asyncio.start_unix_server(hold, str(tmp_path / "s.sock"))
    why: list[str] = []
    relay = UnixRelay(tmp_path / "s.sock", gone=lambda: why[0] if why else None)
    port = await relay.start()
    try:
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
        await w1.drain()
        await held.wait()
        why.append("sandbox sb-1 died")
        try:  # the open connection is cut (a close or a reset), not left hanging
            assert await r1.read() == b""
        except ConnectionResetError:
            pass
        w1.close()
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"GET /api/conversations HTTP/1.1\r\nHost: x\r\n\r\n")
        await w2.drain()
        answer = await r2.read()
        assert answer.startswith(b"HTTP/1.1 410 Gone\r\n") and answer.endswith(b"sandbox sb-1 died\n")
        w2.close()
    finally:
        await relay.aclose()
        server.close()
