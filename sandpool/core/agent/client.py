"""The host side of the sandbox agent's JSON-lines protocol (:mod:`._agent`), over any byte
channel.

:class:`AgentClient` multiplexes requests by ``id`` over one channel and decodes the
answers into sandpool's types; it does not know how the bytes travel. The Kubernetes
backend feeds it from one pod-exec stream (:mod:`sandpool.core.backends.kubernetes._session`); the agent itself,
and so every exec semantic (exit codes, process-group timeouts, escapee kill, output caps,
process listing, kill of strays), is the one :mod:`._agent` the local backend runs.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from sandpool.core import errors
from sandpool.core.base import ExecResult

__all__ = ["AGENT_PATH", "AgentClient", "agent_source", "exec_result"]

#: The agent's source file, run unchanged in every sandbox of every backend.
AGENT_PATH = Path(__file__).with_name("_agent.py")
#: Seconds an answer may take past a command's own timeout before the channel counts as broken.
TRANSPORT_GRACE_S = 10.0


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


def _retrieve(fut: asyncio.Future) -> None:
    if fut.done() and not fut.cancelled():
        fut.exception()


class AgentClient:
    """Requests to one agent over one channel; answers matched by ``id``.

    Usage: the transport calls :meth:`feed` with the agent's stdout bytes as they arrive
    and :meth:`fail` once the channel ends; callers use :meth:`ready`, :meth:`call` and the
    typed helpers.

    Args:
        name: The sandbox id (for messages).
        send: Coroutine writing bytes to the agent's stdin.
    """

    def __init__(self, name: str, send: Callable[[bytes], Awaitable[None]]) -> None:
        self.name = name
        self._send = send
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict]] = {}
        self._buf = bytearray()
        self._ready: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._ready.add_done_callback(_retrieve)
        self.error: errors.SandpoolError | None = None
        self.calls = 0

    def feed(self, data: bytes) -> None:
        """Take bytes of the agent's stdout; dispatch every complete line.

        A garbled line ends the channel (:meth:`fail` with ``ExecTransportError``).
        """
        self._buf += data
        while (i := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:i])
            del self._buf[: i + 1]
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                self.fail(errors.ExecTransportError(
                    f"sandbox {self.name}: garbled frame from the agent: {line[:80]!r}"
                ))
                return
            rid = msg.get("id")
            if rid == 0:
                if not self._ready.done():
                    self._ready.set_result(msg)
                continue
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def fail(self, err: errors.SandpoolError) -> None:
        """The channel ended: every pending and later call raises ``err``."""
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
            SandpoolError: The error the channel failed with.
        """
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    async def call(self, op: str, wait_s: float, **fields: object) -> dict:
        """Send one request and return its answer.

        Raises:
            ExecTransportError: No answer within ``wait_s``, or the agent failed the op.
            SandpoolError: The channel's error (e.g. ``SandboxDied``) when it ended.
        """
        if self.error is not None:
            raise self.error
        rid = next(self._ids)
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.calls += 1
        try:
            await self._send(json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n")
            msg = await asyncio.wait_for(fut, wait_s)
        except TimeoutError:
            raise errors.ExecTransportError(
                f"sandbox {self.name}: no answer to {op!r} within {wait_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            _retrieve(fut)
        if msg.get("error") in ("agent_exception", "exhausted"):
            raise errors.ExecTransportError(
                f"sandbox {self.name}: agent failed {op!r}: {msg['message']}"
            )
        return msg

    def _raise_os_error(self, msg: dict, path: str) -> None:
        if msg.get("error") == "os_error":
            raise errors.sandbox_file_error(int(msg["errno"]), path, f"in sandbox {self.name}")

    async def exec(
        self, cmd: str | list[str], *, timeout: float, cwd: str, env: dict[str, str],
        max_output: int,
    ) -> ExecResult:
        """Run ``cmd`` (see :meth:`Sandbox.exec`); ``cwd`` is absolute."""
        msg = await self.call(
            "exec", timeout + TRANSPORT_GRACE_S, cmd=cmd, timeout=timeout, cwd=cwd, env=env,
            max_output=max_output,
        )
        return exec_result(msg)

    async def read_file(self, abs_path: str, shown: str) -> bytes:
        """The bytes of ``abs_path``; raises the errno's ``SandboxFileError`` (named ``shown``)."""
        msg = await self.call("read_file", 60.0, path=abs_path)
        self._raise_os_error(msg, shown)
        return base64.b64decode(msg["data"])

    async def write_file(self, abs_path: str, shown: str, data: bytes, mode: int) -> None:
        """Write ``data`` to ``abs_path``; raises the errno's ``SandboxFileError``."""
        msg = await self.call(
            "write_file", 60.0, path=abs_path, data=base64.b64encode(data).decode(), mode=mode
        )
        self._raise_os_error(msg, shown)

    async def processes(self) -> list[str]:
        """Command lines of every process in the sandbox but its agent and init."""
        return list((await self.call("ps", 30.0))["procs"])

    async def kill_strays(self) -> int:
        """SIGKILL every process but the agent (and init); return how many were signalled."""
        return int((await self.call("kill_strays", 30.0))["killed"])
