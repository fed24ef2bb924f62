"""The host side of the agent's JSON-lines protocol (``_agent.py``), over any :class:`Channel`.

:class:`AgentClient` frames requests as lines, matches answers to requests by ``id``, and
decodes them into sandpool's types; how the bytes travel is its channel's business
(:mod:`.channel`). Every exec semantic (exit codes, process-group timeouts, escapee kill,
output caps, process listing, kill of strays, in-place restore) is the agent's, the same in
every sandbox of every backend.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
from pathlib import Path
from typing import Protocol

from sandpool.core import errors
from sandpool.core.agent.channel import Channel
from sandpool.core.base import ExecResult

__all__ = ["AGENT_PATH", "MAX_OUTPUT", "READ_MAX", "AgentClient", "AgentOps", "AgentStarved",
           "agent_source", "exec_result"]

#: The agent's source file, run unchanged in every sandbox of every backend.
AGENT_PATH = Path(__file__).with_name("_agent.py")
#: Seconds an answer may take past a command's own timeout before the channel counts as broken.
TRANSPORT_GRACE_S = 10.0
#: Bytes a ``read_file`` returns at most; a larger file is the policy's result, ``EFBIG``
#: (its base64 stays far below :data:`MAX_FRAME`, its copies within the agent's memory margin).
READ_MAX = 32 << 20
#: Bytes of each of a command's stdout and stderr the agent returns at most, whatever cap the
#: caller asks for (the largest sandpool asks for is a Kubernetes snapshot's change set): the
#: policy sizes its output, and an answer past :data:`MAX_FRAME` would end the channel, an
#: infra failure.
MAX_OUTPUT = 160 << 20
#: Bytes one answer line may take: both streams of a command at :data:`MAX_OUTPUT`, base64,
#: with room for the rest of the answer (a read_file answer, at most :data:`READ_MAX`, is less).
MAX_FRAME = 2 * (MAX_OUTPUT * 4 // 3) + (16 << 20)
#: Seconds a failed write waits for the channel's account of its end.
_END_WAIT_S = 10.0


def agent_source() -> str:
    """The agent's source text (for ``python3 -c``), read once per process."""
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = AGENT_PATH.read_text()
    return _SOURCE


_SOURCE: str | None = None


def exec_result(msg: dict) -> ExecResult:
    """The :class:`ExecResult` of an agent ``exec`` answer (stdout/stderr base64-decoded)."""
    return ExecResult(
        exit_code=msg["exit_code"],
        stdout=base64.b64decode(msg["stdout"]),
        stderr=base64.b64decode(msg["stderr"]),
        stdout_truncated=msg["stdout_truncated"],
        stderr_truncated=msg["stderr_truncated"],
        timed_out=msg["timed_out"],
        duration_s=msg["duration_s"],
    )


class AgentStarved(errors.ExecTransportError):
    """The agent answered ``exhausted``: the kernel refused it a thread for ``op``. Infra as it
    stands; the sandbox maps it to ``SandboxExhausted`` when there is evidence that the
    sandbox's own processes spent the budget (:meth:`AgentSandbox._starved_evidence`).

    Attributes:
        op: The request refused.
        detail: The agent's message.
        refused: What the agent read in its own cgroup (a container's): True when the pid
            controller counted the refusal in its group, False when it did not (the machine,
            not the group, was out of pids or memory), None when it cannot read one.
        tasks: The group's tasks then (processes and threads), when read.
        agent_tasks: The agent's own threads then, when read.
    """

    def __init__(self, op: str, detail: str, message: str, *, refused: bool | None = None,
                 tasks: int | None = None, agent_tasks: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.detail = detail
        self.refused = refused
        self.tasks = tasks
        self.agent_tasks = agent_tasks

    def evidence(self) -> list[str]:
        """The agent's own account as evidence that the sandbox's processes spent its pid
        budget, one sentence (empty: none). It is, when the pid controller refused the agent's
        thread in its group and the group's other tasks (the commands' processes) outnumber
        the agent's threads: the budget is the sandbox's, and its processes hold it."""
        if not self.refused or self.tasks is None or self.agent_tasks is None:
            return []
        others = self.tasks - self.agent_tasks
        if others <= self.agent_tasks:
            return []
        return [(f"its pid limit was reached: the kernel's pid controller refused the agent a "
                 f"thread while {others} of its group's {self.tasks} tasks were its processes'")]


def _retrieve(fut: asyncio.Future) -> None:
    # Mark a failed future's exception as seen; the caller got (or will get) its own error.
    if fut.done() and not fut.cancelled():
        fut.exception()


class AgentOps(Protocol):
    """The agent's operations as a sandbox calls them: :class:`AgentClient`, or a backend's
    degraded stand-in where the agent cannot run (the Kubernetes per-command exec)."""

    def alive(self) -> bool:
        """False once the channel to the agent ended."""

    async def exec(self, cmd: str | list[str], *, timeout: float, cwd: str, env: dict[str, str],
                   max_output: int) -> ExecResult:
        """Run ``cmd`` (see :meth:`Sandbox.exec`); ``cwd`` is absolute."""

    async def read_file(self, abs_path: str, shown: str) -> bytes:
        """The bytes of ``abs_path``; raises the errno's ``SandboxFileError`` naming ``shown``."""

    async def write_file(self, abs_path: str, shown: str, data: bytes, mode: int) -> None:
        """Write ``data`` to ``abs_path``; raises the errno's ``SandboxFileError``."""

    async def processes(self) -> list[str]:
        """Command lines of every process in the sandbox but the agent's own."""

    async def kill_strays(self) -> int:
        """SIGKILL every process but the agent's own; return how many were signalled."""


class AgentClient:
    """Requests to one agent over one channel; answers matched by ``id``.

    Created with its channel open; reads it until it ends, then fails every pending and later
    call with the channel's account of the end (:meth:`Channel.ended`), or with
    ``ExecTransportError`` for a garbled or oversized answer.

    Args:
        channel: The byte stream to the agent.
        name: The sandbox id, for messages; may be changed (a session adopted by a sandbox).

    Attributes:
        error: Why the channel ended, once it has.
        calls: Requests sent.
    """

    def __init__(self, channel: Channel, name: str) -> None:
        self.channel = channel
        self.name = name
        self.error: errors.SandpoolError | None = None
        self.calls = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict]] = {}
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no newline
        self._ready: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._ready.add_done_callback(_retrieve)
        self._reader = asyncio.create_task(self._read_loop(), name=f"sandpool-agent-{name}")

    def __repr__(self) -> str:
        state = f"ended: {self.error}" if self.error else "open"
        return f"<AgentClient {self.name} {state} pending={len(self._pending)}>"

    def alive(self) -> bool:
        """True until the channel ended (no round trip)."""
        return self.error is None and not self._reader.done() and self.channel.alive()

    async def _read_loop(self) -> None:
        err: errors.SandpoolError | None = None
        while err is None:
            data = await self.channel.read()
            if not data:
                break
            err = self._feed(data)
        if err is None:
            err = await self.channel.ended(started=self._ready.done())
        self._fail(err)

    def _feed(self, data: bytes) -> errors.SandpoolError | None:
        """Take bytes of the agent's stdout; dispatch every complete line. Returns the error
        that ends the channel: a line that is not JSON, or longer than :data:`MAX_FRAME`."""
        self._buf += data
        while (i := self._buf.find(b"\n", self._scanned)) >= 0:
            line = bytes(self._buf[:i])
            del self._buf[: i + 1]
            self._scanned = 0
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                return errors.ExecTransportError(
                    f"sandbox {self.name}: garbled frame from the agent: {line[:80]!r}")
            rid = msg.get("id")
            if rid == 0:
                if not self._ready.done():
                    self._ready.set_result(msg)
                continue
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        self._scanned = len(self._buf)
        if self._scanned > MAX_FRAME:
            return errors.ExecTransportError(
                f"sandbox {self.name}: an answer from the agent is over {MAX_FRAME >> 20} MiB")
        return None

    def _fail(self, err: errors.SandpoolError) -> None:
        if self.error is None:
            self.error = err
        if not self._ready.done():
            self._ready.set_exception(self.error)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.error)
        self._pending.clear()

    async def ready(self, timeout: float) -> dict:
        """Wait for the agent's ready line; return it.

        Raises:
            TimeoutError: Not within ``timeout`` seconds.
            SandpoolError: Why the channel ended first.
        """
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    async def call(self, op: str, wait_s: float, **fields: object) -> dict:
        """Send one request and return its answer.

        Raises:
            ExecTransportError: No answer within ``wait_s``, or the agent failed the op
                (:class:`AgentStarved`: it could not get a thread for it).
            SandpoolError: Why the channel ended, when it did (e.g. ``SandboxDied``).
        """
        if self.error is not None:
            raise self.error
        rid = next(self._ids)
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.calls += 1
        try:
            try:
                await self.channel.write(json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n")
            except errors.SandpoolError as exc:
                # The stream broke under the write: the channel's account of its end says
                # whether the agent died, and how.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._reader), _END_WAIT_S)
                raise (self.error or exc) from exc
            msg = await asyncio.wait_for(fut, wait_s)
        except TimeoutError:
            raise errors.ExecTransportError(
                f"sandbox {self.name}: no answer to {op!r} within {wait_s:.0f} s") from None
        finally:
            self._pending.pop(rid, None)
            _retrieve(fut)  # the reader may have failed it while we were raising something else
        if msg.get("error") == "exhausted":
            raise AgentStarved(op, msg["message"], f"sandbox {self.name}: agent failed {op!r}: "
                               f"{msg['message']}", refused=msg.get("refused"),
                               tasks=msg.get("tasks"), agent_tasks=msg.get("agent_tasks"))
        if msg.get("error") == "agent_exception":
            raise errors.ExecTransportError(f"sandbox {self.name}: agent failed {op!r}: {msg['message']}")
        return msg

    async def aclose(self, why: str = "closed by sandpool") -> None:
        """Close the channel and wait (briefly) for its end; later calls raise ``SandboxDied``
        naming ``why``. Idempotent."""
        await self.channel.aclose()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._reader), 5.0)
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._fail(errors.SandboxDied(f"sandbox {self.name}: {why}"))

    def _raise_os_error(self, msg: dict, path: str) -> None:
        if msg.get("error") == "os_error":
            raise errors.sandbox_file_error(int(msg["errno"]), path, f"in sandbox {self.name}")

    async def exec(self, cmd: str | list[str], *, timeout: float, cwd: str, env: dict[str, str],
                   max_output: int) -> ExecResult:
        """Run ``cmd`` (see :meth:`Sandbox.exec`); ``cwd`` is absolute. Each stream is cut at
        ``max_output`` bytes, and at :data:`MAX_OUTPUT` whatever ``max_output`` says."""
        msg = await self.call("exec", timeout + TRANSPORT_GRACE_S, cmd=cmd, timeout=timeout,
                              cwd=cwd, env=env, max_output=min(max_output, MAX_OUTPUT))
        return exec_result(msg)

    async def read_file(self, abs_path: str, shown: str) -> bytes:
        """The bytes of ``abs_path``; raises the errno's ``SandboxFileError`` (named ``shown``),
        ``EFBIG`` for a file over :data:`READ_MAX`."""
        msg = await self.call("read_file", 60.0, path=abs_path, max_bytes=READ_MAX)
        self._raise_os_error(msg, shown)
        return base64.b64decode(msg["data"])

    async def write_file(self, abs_path: str, shown: str, data: bytes, mode: int) -> None:
        """Write ``data`` to ``abs_path``; raises the errno's ``SandboxFileError``."""
        msg = await self.call("write_file", 60.0, path=abs_path,
                              data=base64.b64encode(data).decode(), mode=mode)
        self._raise_os_error(msg, shown)

    async def processes(self) -> list[str]:
        """Command lines of every process in the sandbox but its agent and init."""
        return list((await self.call("ps", 30.0))["procs"])

    async def kill_strays(self) -> int:
        """SIGKILL every process but the agent (and init); return how many were signalled."""
        return int((await self.call("kill_strays", 30.0))["killed"])

    async def restore(self, root: str, image: str, changes: list[list[str]],
                      pinned: dict[str, dict], timeout: float) -> dict:
        """Make each repo-relative path of ``changes`` under ``root`` what it is under
        ``image`` (the agent's ``restore`` op); its answer: ``failed`` (one message each) and
        ``errnos`` (those the failures had)."""
        return await self.call("restore", timeout, root=root, image=image, changes=changes,
                               pinned=pinned)

    async def start_service(self, argv: list[str], env: dict[str, str], cwd: str | None) -> int:
        """Start a long-lived service process, spared by ``ps`` and ``kill_strays``; its pid."""
        return int((await self.call("service", 30.0, argv=argv, env=env, cwd=cwd))["pid"])
