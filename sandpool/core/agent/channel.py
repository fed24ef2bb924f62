"""Channels: the byte stream between the host and one sandbox's agent.

A :class:`Channel` carries bytes and nothing else: the agent's requests one way (its stdin),
its answers the other (its stdout). It does not know the protocol; :class:`~.client.AgentClient`
speaks it over any channel, as httpcore's ``HTTP11Connection`` speaks HTTP/1.1 over any
``NetworkStream``. What a channel adds to a plain stream is its account of its own end
(:meth:`Channel.ended`): whether the agent's process exited, was killed, or the transport
under it broke, as a sandpool error.

Implementations:

* :class:`PipeChannel`: the stdio pipes of a local process (the local backend's bubblewrap
  process, whose pid 1 is the agent);
* ``PodExecChannel`` (:mod:`sandpool.core.backends.kubernetes._session`): one pod-exec
  WebSocket stream; it lives with the Kubernetes backend, whose HTTP layer opens it and whose
  extra dependencies (aiohttp) it needs.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Callable

from sandpool.core import errors

__all__ = ["Channel", "PipeChannel"]

_READ_CHUNK = 1 << 20  # bytes per read; the client reassembles lines


class Channel(abc.ABC):
    """One byte stream to an agent.

    Attributes:
        name: What the channel reaches, for messages (e.g. ``sandbox sb-1``).
    """

    name: str

    @abc.abstractmethod
    async def read(self) -> bytes:
        """The next bytes the agent wrote; ``b""`` once the stream ended, for any reason
        (then :meth:`ended` says why). Never raises for the stream's end or failure."""

    @abc.abstractmethod
    async def write(self, data: bytes) -> None:
        """Send ``data`` to the agent.

        Raises:
            SandpoolError: The stream is closed or broken (``SandboxDied`` or
                ``ExecTransportError``, by transport).
        """

    @abc.abstractmethod
    async def ended(self, *, started: bool) -> errors.SandpoolError:
        """Why the stream ended, once :meth:`read` returned ``b""``.

        Args:
            started: Whether the agent said it was ready before the end (a death before it is
                a failed start, never the policy's doing).
        """

    @abc.abstractmethod
    def alive(self) -> bool:
        """Cheap check, no round trip: False once the stream or the agent's process ended."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the host's end (the agent reads EOF and exits); idempotent."""


class PipeChannel(Channel):
    """The stdin and stdout of a local process: the sandbox's bubblewrap process, whose pid 1
    is the agent (so its stdio is the agent's).

    The process is the sandbox: when the stream ends, the sandbox is dead, and whose doing
    that was is for ``evidence`` to say (:meth:`ended`).

    Args:
        proc: The process, started with ``stdin`` and ``stdout`` pipes.
        name: For messages (``sandbox <id>``).
        evidence: What shows the sandbox's own processes exhausted its budget, one sentence
            each (the local backend reads its cgroup's OOM and pid events); empty: none.

    Attributes:
        host_killed: Set by the backend before it kills the process: the end is the host's.
    """

    def __init__(self, proc: asyncio.subprocess.Process, name: str,
                 evidence: Callable[[], list[str]] = list) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.name = name
        self.host_killed = False
        self._evidence = evidence
        self._proc = proc
        self._stdin = proc.stdin
        self._stdout = proc.stdout
        self._failure: str | None = None

    async def read(self) -> bytes:
        """The next bytes of the agent's stdout; ``b""`` at EOF or a pipe error."""
        try:
            return await self._stdout.read(_READ_CHUNK)
        except (ValueError, OSError) as exc:
            self._failure = f"agent channel failed: {exc}"
            return b""

    async def write(self, data: bytes) -> None:
        """Write ``data`` to the agent's stdin.

        Raises:
            SandboxDied: The pipe is closed (the process exited).
        """
        try:
            self._stdin.write(data)
            await self._stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise errors.SandboxDied(f"{self.name}: channel closed ({exc})") from exc

    async def ended(self, *, started: bool) -> errors.SandpoolError:
        """``SandboxExhausted`` when the agent died after it started and ``evidence`` shows the
        sandbox's own processes spent its budget; else ``SandboxDied``.

        The policy cannot signal the agent (its pid 1), so how it died (bubblewrap exits with
        ``128 + N`` when signal ``N`` killed it) says nothing of whose doing it was; a death
        without the evidence came from outside (the host's OOM killer, an operator, the node).
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 2.0)
        rc = self._proc.returncode
        reason = self._failure or "the sandbox process exited"
        if rc is not None and rc > 128:  # bubblewrap outlived its agent: the signal that killed it
            reason = f"its agent was killed by signal {rc - 128}"
        evidence = [] if self.host_killed else self._evidence()
        if evidence and started:
            return errors.SandboxExhausted(f"{self.name}: {reason}, and {'; '.join(evidence)}")
        return errors.SandboxDied(f"{self.name}: {reason}" + (
            "" if self.host_killed else " (no OOM or pid-limit event in its cgroup: not its "
            "processes' doing)"))

    def alive(self) -> bool:
        """True while the process runs."""
        return self._proc.returncode is None

    async def aclose(self) -> None:
        """Close the agent's stdin; idempotent."""
        if not self._stdin.is_closing():
            self._stdin.close()
