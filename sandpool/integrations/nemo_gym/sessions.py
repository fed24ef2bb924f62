"""NeMo Gym sessions mapped to leased sandboxes, with idle reclaim.

A session is keyed by NeMo Gym's session id (the value its session cookie carries). It holds
one :class:`~sandpool.core.pool.Lease` from ``/seed_session`` until ``/verify`` releases it,
or until it sits idle longer than ``idle_timeout_s``; then the reaper releases the sandbox
(reset in place for reuse) and the session expires.

A session whose sandbox hit an infra error is *failed*: its lease is released for deletion at
once, and every later request on it answers with that error, so ``/verify`` can never turn it
into a reward. This module knows nothing of HTTP or NeMo Gym.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from sandpool.core import errors
from sandpool.core.pool import Lease, SandboxPool
from sandpool.core.task import Task

__all__ = ["Session", "SessionExpired", "SessionState", "SessionTable", "UnknownSession"]

#: The first command of a session: proves the sandbox answers and sits at the base commit.
_PROBE = "git rev-parse HEAD"
_PROBE_TIMEOUT_S = 30.0


class SessionState(enum.Enum):
    """Lifecycle of one session."""

    ACTIVE = "active"
    FAILED = "failed"  # an infra error; the sandbox was dropped
    EXPIRED = "expired"  # reclaimed after the idle timeout
    CLOSED = "closed"  # verified (or closed) and released


class UnknownSession(errors.InputError):
    """No ``/seed_session`` was made for this session id (or it was already verified)."""

    kind = "unknown_session"


class SessionExpired(errors.InfraError):
    """The session sat idle past ``idle_timeout_s`` and its sandbox was reclaimed.

    It is an infra-side outcome for the rollout: the episode cannot be graded, so it must be
    retried or dropped, never scored.
    """

    kind = "session_expired"


@dataclass(eq=False)
class Session:
    """One NeMo Gym session and the sandbox leased for it.

    Attributes:
        id: NeMo Gym's session id.
        task: The task the session runs.
        lease: The leased sandbox (released once the session leaves ``ACTIVE``).
        state: Where the session is in its lifecycle.
        error: The infra error that failed or expired the session.
        last_used: ``time.monotonic()`` of the end of the last request, in seconds.
        busy: Requests in flight; an idle session has none.
    """

    id: str
    task: Task
    lease: Lease
    state: SessionState = SessionState.ACTIVE
    error: errors.InfraError | None = None
    last_used: float = 0.0
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionTable:
    """Sessions by id over one open pool.

    Usage::

        table = SessionTable(pool, idle_timeout_s=600)
        table.start_reaper()
        await table.open(session_id, task)              # claim + in-place reset + first command
        async with table.use(session_id) as session:    # infra errors fail the session
            await session.lease.exec("ls", timeout=30)
        await table.close(session_id)                   # release for reuse
        await table.aclose()

    Args:
        pool: An open :class:`SandboxPool`.
        idle_timeout_s: Seconds without a request after which a session is reclaimed.
        clock: Monotonic clock in seconds (for tests).
    """

    def __init__(self, pool: SandboxPool, *, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.reclaimed = 0
        self.failed = 0

    def __repr__(self) -> str:
        by_state = {s: 0 for s in SessionState}
        for sess in self._sessions.values():
            by_state[sess.state] += 1
        counts = " ".join(f"{s.value}={n}" for s, n in by_state.items())
        return f"<SessionTable {counts} reclaimed={self.reclaimed} idle_timeout={self.idle_timeout_s}s>"

    def counts(self) -> dict[str, int]:
        """Sessions by state, plus ``reclaimed`` and ``failed`` totals since start."""
        out = {s.value: 0 for s in SessionState}
        for sess in self._sessions.values():
            out[sess.state.value] += 1
        return out | {"reclaimed": self.reclaimed, "failed": self.failed}

    def get(self, session_id: str) -> Session | None:
        """Return the session, in any state, or ``None``."""
        return self._sessions.get(session_id)

    def active(self) -> list[Session]:
        """Return the active sessions, oldest first."""
        return [s for s in self._sessions.values() if s.state is SessionState.ACTIVE]

    async def open(self, session_id: str, task: Task) -> Session:
        """Claim a sandbox for ``task`` under ``session_id`` and run its first command.

        The claim takes a warm sandbox when there is one; the pool checks out
        ``task.base_commit`` (a sandbox released by an earlier session was already reset in
        place, off this path). Seeding an id that is still active for the same task returns
        the existing session; for another task, the old sandbox is released first.

        Returns:
            The active session.

        Raises:
            InfraError: No sandbox could be claimed, or it failed its first command.
            InputError: The task cannot run (unknown image, bad base commit).
            PoolClosed: The pool is closed.
        """
        old = self._sessions.get(session_id)
        if old is not None and old.state is SessionState.ACTIVE:
            if old.task.instance_id == task.instance_id:
                old.last_used = self._clock()
                return old
            await self.close(session_id)
        lease = await self.pool.acquire(task)
        try:
            res = await lease.exec(_PROBE, timeout=_PROBE_TIMEOUT_S)
            if not res.ok or res.text.strip() != task.base_commit:
                raise errors.SandboxStartError(
                    f"sandbox {lease.id} is not at {task.base_commit[:12]} after its claim "
                    f"(git says {(res.text or res.err_text).strip()[:80]!r})"
                )
        except BaseException:
            await self.pool.release(lease, reusable=False)
            raise
        session = Session(session_id, task, lease, last_used=self._clock())
        self._sessions[session_id] = session
        return session

    def _check(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.state is SessionState.CLOSED:
            raise UnknownSession(
                f"session {session_id[:8]}... has no sandbox: call /seed_session first "
                "(a session is closed by /verify)"
            )
        if session.state is not SessionState.ACTIVE:
            assert session.error is not None
            raise session.error
        return session

    @contextlib.asynccontextmanager
    async def use(self, session_id: str) -> AsyncIterator[Session]:
        """Hold the session for one request; requests on one session run one at a time.

        An :class:`~sandpool.core.errors.InfraError` inside the block fails the session: its
        sandbox is released for deletion and the error is kept for later requests.

        Raises:
            UnknownSession: No active session under this id.
            InfraError: The session failed or expired earlier (the original error).
        """
        session = self._check(session_id)
        session.busy += 1
        try:
            async with session.lock:
                self._check(session_id)
                try:
                    yield session
                except errors.InfraError as exc:
                    await self._fail(session, exc)
                    raise
        finally:
            session.busy -= 1
            session.last_used = self._clock()

    async def _fail(self, session: Session, exc: errors.InfraError) -> None:
        if session.state is not SessionState.ACTIVE:
            return
        session.state = SessionState.FAILED
        session.error = exc
        self.failed += 1
        await self.pool.release(session.lease, reusable=False)

    async def close(self, session_id: str) -> None:
        """Release the session's sandbox (for reuse unless it is broken) and forget it.

        Closing an unknown or already closed session is a no-op.
        """
        session = self._sessions.pop(session_id, None)
        if session is None or session.state is not SessionState.ACTIVE:
            return
        session.state = SessionState.CLOSED
        await self.pool.release(session.lease, reusable=session.lease.broken is None)

    async def reap_idle(self) -> list[str]:
        """Reclaim every session idle for longer than ``idle_timeout_s``.

        Its sandbox goes back to the pool (reset in place for reuse); the session stays
        known as ``EXPIRED`` so that a late request gets :class:`SessionExpired`, not a
        reward.

        Returns:
            The ids of the sessions reclaimed.
        """
        now = self._clock()
        reaped = []
        for session in list(self._sessions.values()):
            if session.state is SessionState.ACTIVE:
                if session.busy or now - session.last_used <= self.idle_timeout_s:
                    continue
                session.state = SessionState.EXPIRED
                session.error = SessionExpired(
                    f"session {session.id[:8]}... was idle for over {self.idle_timeout_s:g} s and "
                    f"its sandbox {session.lease.id} was reclaimed; raise idle_timeout_s if "
                    "episodes pause that long"
                )
                self.reclaimed += 1
                reaped.append(session.id)
                await self.pool.release(session.lease, reusable=session.lease.broken is None)
            elif now - session.last_used > 4 * self.idle_timeout_s:
                del self._sessions[session.id]  # forget tombstones eventually
        return reaped

    def start_reaper(self) -> None:
        """Start the background task that calls :meth:`reap_idle` periodically."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(),
                                                                   name="sandpool-session-reaper")

    async def _reap_forever(self) -> None:
        period = min(max(self.idle_timeout_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap_idle()
            except errors.SandpoolError:
                continue  # the pool counts release failures; keep reaping

    async def aclose(self) -> None:
        """Stop the reaper and release every active session's sandbox. Idempotent."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for sid in list(self._sessions):
            session = self._sessions.pop(sid)
            if session.state is SessionState.ACTIVE:
                session.state = SessionState.CLOSED
                await self.pool.release(session.lease, reusable=False)
