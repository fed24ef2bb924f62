"""NeMo Gym sessions mapped to rollouts on leased sandboxes, with idle reclaim.

A session is keyed by NeMo Gym's session id (the value its session cookie carries). It holds
one rollout (:class:`~sandpool.core.rollout.Rollout`, the accountant every adapter uses) from
``/seed_session`` until ``/verify`` grades it, or until it sits idle longer than
``idle_timeout_s``; then the reaper ends it ``infra_failed`` (:class:`SessionExpired`: never
a reward) and the session expires.

Each request's work runs as one of the rollout's guarded actions: an error that ends the
rollout (infra, or the policy's own failure such as a fork bomb) ends it as the accountant
records it, the session is *ended*, and every later request on it answers with that error,
so ``/verify`` returns the recorded end and can never turn it into a new reward. A file
errno on the policy's path is a result, and the session goes on. This module knows nothing
of HTTP or NeMo Gym.

Every change to one session id (seed, request, close, idle reclaim) runs under that id's own
lock, so two seeds racing on one id claim one sandbox, not two, and a close cannot release a
sandbox a request is still using. Different ids never wait on each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from sandpool.core import errors
from sandpool.core.metrics import RolloutResult
from sandpool.core.pool import Lease, SandboxPool
from sandpool.core.rollout import Grader, Rollout
from sandpool.core.task import Task

__all__ = ["Session", "SessionClosed", "SessionExpired", "SessionState", "SessionTable", "UnknownSession"]

class SessionState(enum.Enum):
    """Lifecycle of one session."""

    ACTIVE = "active"
    FAILED = "failed"  # its rollout ended before /verify (infra, or the policy's failure)
    EXPIRED = "expired"  # reclaimed after the idle timeout (its rollout ended infra_failed)
    CLOSED = "closed"  # verified (or closed) and released


class UnknownSession(errors.InputError):
    """No ``/seed_session`` was made for this session id (or it was already verified)."""

    kind = "unknown_session"


class SessionClosed(errors.InputError):
    """A seed named a session id that was already closed (NeMo Gym 0.7's ``/close_session``).

    0.7's session contract: a seed that arrives after its close must not create the session
    again. The caller uses a fresh id for a new attempt.
    """

    kind = "session_closed"


class SessionExpired(errors.InfraError):
    """The session sat idle past ``idle_timeout_s`` and its sandbox was reclaimed.

    It is an infra-side outcome for the rollout: the episode cannot be graded, so it must be
    retried or dropped, never scored.
    """

    kind = "session_expired"


@dataclass(eq=False)
class Session:
    """One NeMo Gym session and its rollout.

    Attributes:
        id: NeMo Gym's session id.
        task: The task the session runs.
        rollout: The rollout's accountant (its lease, then its record).
        state: Where the session is in its lifecycle.
        last_used: ``time.monotonic()`` of the end of the last request, in seconds.
    """

    id: str
    task: Task
    rollout: Rollout
    state: SessionState = SessionState.ACTIVE
    last_used: float = 0.0

    @property
    def lease(self) -> Lease:
        """The leased sandbox of an active session.

        Raises:
            PoolClosed: The session's rollout has ended.
        """
        if self.rollout.lease is None:
            raise errors.PoolClosed(f"session {self.id[:8]}... holds no sandbox")
        return self.rollout.lease

    @property
    def error(self) -> Exception | None:
        """The error that ended the session's rollout, if one did."""
        return self.rollout.error

    @property
    def result(self) -> RolloutResult | None:
        """The rollout's record, once it ended."""
        return self.rollout.result


class _IdLocks:
    """One :class:`asyncio.Lock` per session id, kept only while someone holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def held(self, key: str) -> bool:
        """Whether a request holds, or waits for, ``key``'s lock."""
        return key in self._locks

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class SessionTable:
    """Sessions by id over one open pool.

    Usage::

        table = SessionTable(pool, idle_timeout_s=600, grader=grader)
        table.start_reaper()
        await table.open(session_id, task)              # claim + first command
        async with table.use(session_id) as session:    # one guarded action of the rollout
            await session.lease.exec("ls", timeout=30)
        session, result = await table.verify(session_id)  # grade, record, release
        await table.aclose()

    Args:
        pool: An open :class:`SandboxPool`.
        idle_timeout_s: Seconds without a request after which a session is reclaimed.
        grader: Scores each session's rollout at :meth:`verify`.
        clock: Monotonic clock in seconds (for tests).
        max_closed_ids: How many ids closed with ``refuse_reseed`` are remembered (oldest
            forgotten first), so the memory of closed ids stays bounded over a long run.
    """

    def __init__(self, pool: SandboxPool, *, idle_timeout_s: float, grader: Grader | None = None,
                 clock: Callable[[], float] = time.monotonic, max_closed_ids: int = 100_000) -> None:
        self.pool = pool
        self.grader = grader
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._locks = _IdLocks()
        self._closed_ids: OrderedDict[str, None] = OrderedDict()
        self._max_closed_ids = max_closed_ids
        self._reaper: asyncio.Task[None] | None = None
        self.reclaimed = 0
        self.failed = 0

    def __repr__(self) -> str:
        counts = " ".join(f"{k}={v}" for k, v in self.counts().items())
        return f"<SessionTable {counts} idle_timeout={self.idle_timeout_s}s>"

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
        """Start a rollout of ``task`` under ``session_id``: claim a sandbox, run its first command.

        The claim takes a warm sandbox when there is one; the pool checks out
        ``task.base_commit`` (a sandbox released by an earlier session was already reset in
        place, off this path). Seeding an id that is still active for the same task returns
        the existing session (two seeds racing on one id get one sandbox); for another task,
        the old rollout is given up first (unrecorded).

        Returns:
            The active session.

        Raises:
            SessionClosed: The id was closed with ``refuse_reseed`` (a late seed).
            InfraError: No sandbox could be claimed, or it failed its first command; the
                rollout is recorded and the session kept ``FAILED`` with that record.
            InputError: The task cannot run (unknown image, bad base commit); the same.
            PoolClosed: The pool is closed.
        """
        async with self._locks.hold(session_id):
            if session_id in self._closed_ids:
                raise SessionClosed(f"session {session_id[:24]!r} was closed; seed a new session id")
            old = self._sessions.get(session_id)
            if old is not None and old.state is SessionState.ACTIVE:
                if old.task.instance_id == task.instance_id:
                    old.last_used = self._clock()
                    return old
                await self._release(old, SessionState.CLOSED)
            session = Session(session_id, task, Rollout(self.pool, task, grader=self.grader),
                              last_used=self._clock())
            try:
                await session.rollout.claim()
            except Exception:
                if session.result is not None:  # recorded: later requests answer with its end
                    session.state = SessionState.FAILED
                    self._sessions[session_id] = session
                    self.failed += 1
                raise
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
        """Hold the session for one request, as one guarded action of its rollout
        (:meth:`Rollout.action <sandpool.core.rollout.Rollout.action>`); requests on one
        session run one at a time.

        An error inside the block that ends the rollout (infra, or the policy's own failure)
        ends it as the accountant records it; the session is ``FAILED`` and keeps the error
        for later requests. A file errno on the policy's path leaves it active.

        Raises:
            UnknownSession: No active session under this id.
            SandpoolError: The session's rollout ended earlier (the error that ended it).
        """
        self._check(session_id)
        async with self._locks.hold(session_id):
            session = self._check(session_id)
            try:
                async with session.rollout.action():
                    yield session
            finally:
                if session.rollout.ended and session.state is SessionState.ACTIVE:
                    session.state = SessionState.FAILED
                    self.failed += session.result is not None
                session.last_used = self._clock()

    async def verify(self, session_id: str) -> tuple[Session, RolloutResult]:
        """End the session's rollout: grade it (capture, reset, score), record it, release
        its sandbox, and forget the session. A session whose rollout already ended (failed
        or expired) answers with that record, never graded anew.

        Returns:
            The session and its rollout's record (the grader's score on
            ``session.rollout.score``).

        Raises:
            UnknownSession: No session under this id (never seeded, or already verified).
            FatalError: The pool cannot run sandboxes (nothing recorded).
        """
        async with self._locks.hold(session_id):
            session = self._sessions.get(session_id)
            if session is None or session.state is SessionState.CLOSED:
                self._check(session_id)  # raises UnknownSession
            assert session is not None
            try:
                result = session.result or await session.rollout.finish()
            finally:
                if session.rollout.ended:
                    session.state = SessionState.CLOSED
                    if self._sessions.get(session_id) is session:
                        del self._sessions[session_id]
            return session, result

    async def _release(self, session: Session, state: SessionState) -> None:
        """Give up an active session's rollout, unrecorded (caller holds its lock), and leave it
        in ``state``. The session keeps its state until the release returned, so a release
        that raises leaves it active for the caller to retry.
        """
        if session.state is not SessionState.ACTIVE:
            return
        await session.rollout.abandon()
        session.state = state
        if state is SessionState.CLOSED and self._sessions.get(session.id) is session:
            del self._sessions[session.id]

    async def close(self, session_id: str, *, refuse_reseed: bool = False) -> None:
        """Release the session's sandbox (for reuse unless it is broken) and forget it.

        Closing an unknown or already closed session is a no-op, as NeMo Gym 0.7's
        ``/close_session`` contract asks.

        Args:
            session_id: The session.
            refuse_reseed: Remember the id so a later :meth:`open` of it raises
                :class:`SessionClosed` (0.7's contract: a seed arriving after its close,
                or after a close of an id never seeded, must not create the session).

        Raises:
            SandpoolError: Releasing the sandbox failed; the session stays open, so the
                caller can retry the close.
        """
        async with self._locks.hold(session_id):
            session = self._sessions.get(session_id)
            if session is not None:
                await self._release(session, SessionState.CLOSED)
                self._sessions.pop(session_id, None)
            if refuse_reseed:
                self._closed_ids[session_id] = None
                self._closed_ids.move_to_end(session_id)
                while len(self._closed_ids) > self._max_closed_ids:
                    self._closed_ids.popitem(last=False)

    async def reap_idle(self) -> list[str]:
        """Reclaim every session idle for longer than ``idle_timeout_s``.

        Its sandbox goes back to the pool (reset in place for reuse); the session stays
        known as ``EXPIRED`` so that a late request gets :class:`SessionExpired`, not a
        reward. A session with a request in flight (or waiting) is never idle.

        Returns:
            The ids of the sessions reclaimed.
        """
        reaped = []
        for session in list(self._sessions.values()):
            if self._locks.held(session.id):
                continue
            async with self._locks.hold(session.id):
                now = self._clock()
                if session.state is SessionState.ACTIVE:
                    if now - session.last_used <= self.idle_timeout_s:
                        continue
                    # Its sandbox goes back to the pool (reset in place): nothing failed in it.
                    await session.rollout.fail(SessionExpired(
                        f"session {session.id[:8]}... was idle for over {self.idle_timeout_s:g} s "
                        f"and its sandbox {session.lease.id} was reclaimed; raise idle_timeout_s "
                        "if episodes pause that long"
                    ))
                    session.state = SessionState.EXPIRED
                    self.reclaimed += 1
                    reaped.append(session.id)
                elif now - session.last_used > 4 * self.idle_timeout_s:
                    self._sessions.pop(session.id, None)  # forget tombstones eventually
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
                await session.rollout.abandon(reusable=False)
