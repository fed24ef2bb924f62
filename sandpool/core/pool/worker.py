"""The pool's I/O: creations, in-place resets and deletes, each in a task of its own.

:class:`PoolWorker` starts what :meth:`Entries.assign <sandpool.core.pool.entries.Entries.assign>`
decides and reports each result back to the entries (``Entries.move``); it never decides.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiolimiter import AsyncLimiter

from sandpool.core import errors
from sandpool.core.base import Backend, Sandbox, SandboxState
from sandpool.core.metrics import PoolCounters
from sandpool.core.pool.entries import Entries, Entry
from sandpool.core.pool.limits import PoolLimits
from sandpool.core.reset import record_pristine, reset_in_place
from sandpool.core.telemetry import Telemetry

__all__ = ["PoolWorker"]

S = SandboxState


class PoolWorker:
    """Runs a pool's creations, resets and deletes, rate-limited and counted.

    Args:
        backend: Where sandboxes run.
        entries: The pool's state; results are reported to it.
        limits: Creation rate and timeouts.
        counters: The pool's counters (created, deleted, resets, quarantines, ...).
        telemetry: The pool's metrics and spans.
        is_open: Whether the pool is open; after close, work that lands deletes its sandbox
            and nothing new is decided.
    """

    def __init__(self, backend: Backend, entries: Entries, limits: PoolLimits,
                 counters: PoolCounters, telemetry: Telemetry, is_open: Callable[[], bool]) -> None:
        self.backend = backend
        self.entries = entries
        self.limits = limits
        self.counters = counters
        self.telemetry = telemetry
        self.is_open = is_open
        #: Set whenever the entries may have changed (``wait_warm`` waits on it).
        self.changed = asyncio.Event()
        self._limiter = AsyncLimiter(limits.create_burst, limits.create_burst / limits.create_rate)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- deciding, then starting the I/O decided ---------------------------------------------

    def assign(self) -> None:
        """Let the entries decide (:meth:`Entries.assign`) and start the work decided."""
        if not self.is_open():
            return
        work = self.entries.assign(time.monotonic())
        self.counters.evicted += len(work.evict)
        for entry in work.evict:
            self.spawn(self.delete(entry))
        for entry, warm_up in work.create:
            self.spawn(self._create(entry, warm_up))
        self.changed.set()

    def drop(self, entry: Entry) -> None:
        """Delete ``entry``'s sandbox in the background (it holds its room until then)."""
        self.entries.move(entry, S.DELETED)
        self.spawn(self.delete(entry))
        self.assign()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as one of the pool's tasks (waited for, then cancelled, on close)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Let tasks in flight finish (up to ``create_timeout``), then cancel the rest: a
        cancelled delete would leave mounts behind, and work that lands after close deletes
        its own sandbox."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.limits.create_timeout)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def infra_error(self, kind: str) -> None:
        """Count an infra error of ``kind`` (``SandpoolError.kind``)."""
        self.counters.infra_error(kind)
        self.telemetry.infra_error(kind)

    # -- creations ---------------------------------------------------------------------------

    async def _create(self, entry: Entry, warm_up: bool) -> None:
        with Telemetry.span("sandpool.create", image=entry.image, warm_up=warm_up):
            try:
                sandbox = await self._start(entry.image, warm_up)
            except errors.SandpoolError as exc:
                self._create_failed(entry, exc)
                return
            except asyncio.CancelledError:
                self.entries.move(entry, None)  # the pool is closing
                raise
        self.counters.created += 1
        self.telemetry.created(ok=True)
        if not self.is_open():
            entry.sandbox = sandbox
            self.entries.move(entry, S.DELETED)
            await self.delete(entry)
            return
        self.entries.created(entry, sandbox)
        self.assign()

    async def _start(self, image: str, warm_up: bool) -> Sandbox:
        """Create a sandbox of ``image`` and record its pristine state; every failure is a
        ``SandpoolError`` (a backend bug too: it must not leak a ``CREATING`` entry)."""
        try:
            async with self._limiter:
                sandbox = await asyncio.wait_for(self.backend.create(image),
                                                 self.limits.create_timeout)
            try:
                # What the in-place reset and grading restore to, recorded while it is fresh;
                # warming includes git's index (off the claim path).
                if not sandbox.recorded:
                    await record_pristine(sandbox, refresh_index=warm_up,
                                          timeout=self.limits.create_timeout)
            except BaseException:
                try:
                    await self.backend.delete(sandbox)
                finally:
                    self.counters.deleted += 1
                raise
        except TimeoutError:
            raise errors.SandboxStartError(f"creating a sandbox of {image!r} took over "
                                           f"{self.limits.create_timeout:.0f} s") from None
        except errors.SandpoolError:
            raise
        except Exception as exc:  # a backend bug is a failed start, counted
            raise errors.SandboxStartError(
                f"creating a sandbox of {image!r} failed: {type(exc).__name__}: {exc}") from exc
        return sandbox

    def _create_failed(self, entry: Entry, exc: errors.SandpoolError) -> None:
        self.counters.create_failures += 1
        self.telemetry.created(ok=False)
        if isinstance(exc, errors.InfraError):
            self.infra_error(exc.kind)
        delay = self.entries.creation_failed(entry, exc, time.monotonic())
        if delay is not None:
            # The loop may run a timer up to its clock resolution early: wake a little late.
            asyncio.get_running_loop().call_later(delay + 0.01, self.assign)
        self.changed.set()

    # -- resets ------------------------------------------------------------------------------

    async def reset(self, entry: Entry, commit: str) -> None:
        """Reset a released ``RESETTING`` entry in place: idle (first in line) once verified
        pristine at ``commit``, else quarantined."""
        problems, head = await self.reset_checked(entry, commit)
        if not self.is_open():
            self.entries.move(entry, S.DELETED)
            await self.delete(entry)
            return
        if problems:
            self.quarantine(entry, problems)
            self.drop(entry)
            return
        self.counters.resets += 1
        entry.head = head
        self.entries.move(entry, S.IDLE, front=True)
        self.assign()

    async def reset_checked(self, entry: Entry, commit: str) -> tuple[list[str], str | None]:
        """Reset ``entry``'s sandbox in place and verify it; return its problems (empty:
        pristine) and the commit it is at. Counts its time; raises nothing but a cancellation."""
        assert entry.sandbox is not None
        t0 = time.monotonic()
        quarantine = None
        sid = entry.sandbox.id
        with Telemetry.span("sandpool.reset", image=entry.image, sandbox_id=sid) as span:
            try:
                outcome = await asyncio.wait_for(
                    reset_in_place(entry.sandbox, commit, timeout=self.limits.reset_timeout),
                    self.limits.reset_timeout * 2,
                )
                problems, head = list(outcome.problems), outcome.head
                quarantine = "not_pristine" if problems else None
            except Exception as exc:  # noqa: BLE001 - any failure quarantines; none leaks `resetting`
                problems, head = [f"reset failed: {type(exc).__name__}: {exc}"], None
                quarantine = "reset_error"
            span.set_attribute("sandpool.quarantine", quarantine or "")
        self.counters.reset_time(time.monotonic() - t0)
        self.telemetry.reset_done(time.monotonic() - t0, quarantine=quarantine)
        return problems, head

    def quarantine(self, entry: Entry, problems: list[str]) -> None:
        """Mark ``entry`` quarantined for ``problems`` and count it (the caller drops it)."""
        assert entry.sandbox is not None
        entry.quarantined = True
        self.counters.quarantines += 1
        self.counters.quarantine_reasons = (self.counters.quarantine_reasons
                                            + [f"{entry.sandbox.id}: {'; '.join(problems)}"])[-20:]

    # -- deletes -----------------------------------------------------------------------------

    async def delete(self, entry: Entry) -> None:
        """Delete a ``DELETED`` entry's sandbox; the entry leaves the pool when it returns."""
        assert entry.sandbox is not None
        try:
            await self.backend.delete(entry.sandbox)
        finally:
            self.counters.deleted += 1
            self.entries.move(entry, None)
            self.assign()  # its room is free now
