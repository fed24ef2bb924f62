"""The host's one agent client over a channel: framing, answers matched to requests, and how
a channel's end reaches the callers. The real agent runs here as a plain process over a
:class:`PipeChannel` (no sandbox: the framing and the end are the subject); the conformance
suite runs it in sandboxes over every channel (test_conformance*.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys

import pytest

from sandpool.core import errors
from sandpool.core.agent.channel import Channel, PipeChannel
from sandpool.core.agent.client import AGENT_PATH, AgentClient

from .waiting import until


class QueueChannel(Channel):
    """A channel whose agent is the test: what the client writes is in ``sent``, what the test
    puts in ``inbox`` is what the client reads (``b""`` ends the stream)."""

    def __init__(self) -> None:
        self.name = "queue"
        self.sent: asyncio.Queue[bytes] = asyncio.Queue()
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = False

    async def read(self) -> bytes:
        return await self.inbox.get()

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise errors.ExecTransportError("queue: closed")
        await self.sent.put(data)

    async def ended(self, *, started: bool) -> errors.SandpoolError:
        return errors.SandboxDied(f"queue ended (started: {started})")

    def alive(self) -> bool:
        return not self.closed

    async def aclose(self) -> None:
        self.closed = True
        await self.inbox.put(b"")


def _exec_answer(rid: int, stdout: bytes) -> bytes:
    import base64

    return json.dumps({"id": rid, "exit_code": 3, "stdout": base64.b64encode(stdout).decode(),
                       "stderr": "", "stdout_truncated": False, "stderr_truncated": False,
                       "timed_out": False, "duration_s": 0.1}).encode() + b"\n"


async def test_answers_split_anywhere_are_matched_to_their_requests_and_garble_ends_the_channel():
    ch = QueueChannel()
    c = AgentClient(ch, "sb")
    await ch.inbox.put(b'{"id": 0, "ready": true}\n')
    assert (await c.ready(5))["ready"]
    first = asyncio.create_task(c.exec("echo a", timeout=5, cwd="/testbed", env={}, max_output=9))
    second = asyncio.create_task(c.exec("echo b", timeout=5, cwd="/testbed", env={}, max_output=9))
    reqs = [json.loads(await ch.sent.get()) for _ in range(2)]
    by_cmd = {r["cmd"]: r for r in reqs}
    assert (by_cmd["echo a"]["op"], by_cmd["echo a"]["cwd"], by_cmd["echo a"]["max_output"]) == (
        "exec", "/testbed", 9)
    # The second request's answer first, and both cut at arbitrary points.
    stream = _exec_answer(by_cmd["echo b"]["id"], b"b\n") + _exec_answer(by_cmd["echo a"]["id"], b"a\n")
    for i in range(0, len(stream), 7):
        await ch.inbox.put(stream[i : i + 7])
    assert (await first).stdout == b"a\n" and (await second).stdout == b"b\n"
    pending = asyncio.create_task(c.processes())
    await ch.sent.get()
    await ch.inbox.put(b"not json\n")
    with pytest.raises(errors.ExecTransportError, match="garbled"):
        await pending
    with pytest.raises(errors.ExecTransportError, match="garbled"):
        await c.kill_strays()  # the channel stays failed
    assert not c.alive()


async def test_the_channels_account_of_its_end_reaches_pending_and_later_calls():
    ch = QueueChannel()
    c = AgentClient(ch, "sb")
    await ch.inbox.put(b'{"id": 0, "ready": true}\n')
    await c.ready(5)
    pending = asyncio.create_task(c.processes())
    await ch.sent.get()
    await ch.inbox.put(b"")  # the stream ends under the request
    with pytest.raises(errors.SandboxDied, match="queue ended \\(started: True\\)"):
        await pending
    with pytest.raises(errors.SandboxDied, match="queue ended"):
        await c.exec("true", timeout=5, cwd="/", env={}, max_output=9)


async def _agent() -> tuple[asyncio.subprocess.Process, AgentClient]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-u", str(AGENT_PATH), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    client = AgentClient(PipeChannel(proc, "sandbox plain"), "plain")
    await client.ready(60)
    return proc, client


async def test_the_agent_over_a_pipe_answers_large_outputs_and_file_errnos(tmp_path):
    proc, c = await _agent()
    try:
        res = await c.exec(["head", "-c", str(3 << 20), "/dev/zero"], timeout=60, cwd=str(tmp_path),
                           env={}, max_output=4 << 20)
        assert res.ok and res.stdout == bytes(3 << 20)  # one answer line of 4 MiB, read in parts
        with pytest.raises(errors.SandboxFileError) as err:
            await c.read_file(str(tmp_path / "missing"), "missing")
        assert isinstance(err.value, FileNotFoundError)
        await c.write_file(str(tmp_path / "f"), "f", b"\x00\xff", 0o600)
        assert await c.read_file(str(tmp_path / "f"), "f") == b"\x00\xff"
    finally:
        await c.aclose()
        await proc.wait()
    with pytest.raises(errors.SandboxDied, match="sandbox plain"):
        await c.processes()


async def test_an_agent_killed_under_a_request_fails_it_as_a_dead_sandbox(tmp_path):
    proc, c = await _agent()
    try:
        sleeping = asyncio.create_task(c.exec("echo $$ > pid.tmp && mv pid.tmp pid && exec sleep 60",
                                              timeout=90, cwd=str(tmp_path), env={}, max_output=9))
        await until(lambda: (tmp_path / "pid").exists(), "the command to start")
        proc.kill()
        with pytest.raises(errors.SandboxDied, match="sandbox plain: the sandbox process exited"):
            await sleeping
        assert not c.alive()
    finally:
        await c.aclose()
        await proc.wait()
        with contextlib.suppress(OSError, ValueError):  # no sandbox here to take it down
            os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
