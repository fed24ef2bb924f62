"""The claim path: a live sandbox of a task's image at its commit, and swaps under a lease.

* :func:`entry_at`: what :meth:`SandboxPool.acquire <sandpool.core.pool.SandboxPool.acquire>`
  waits on: an entry handed over by :class:`~sandpool.core.pool.entries.Entries` (warm, or
  created or reset for this claim), alive and checked out at ``task.base_commit``;
* :func:`reset_lease`: :meth:`Lease.reset <sandpool.core.pool.Lease.reset>`, the in-place
  reset of a held sandbox;
* :func:`replace_sandbox`: a fresh sandbox swapped in under a lease whose own one left.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.base import SandboxState
from sandpool.core.reset import checkout

if TYPE_CHECKING:
    from sandpool.core.pool.entries import Entry
    from sandpool.core.pool.lease import Lease
    from sandpool.core.pool.pool import SandboxPool
    from sandpool.core.task import Task

__all__ = ["entry_at", "replace_sandbox", "reset_lease", "wait_for_entry"]

S = SandboxState


async def entry_at(pool: SandboxPool, task: Task, deadline: float) -> tuple[Entry, bool]:
    """A live sandbox of ``task.image`` leased to the caller, at ``task.base_commit``, and
    whether it was a warm hit. A failed checkout deletes the sandbox and raises."""
    while True:
        entry, warm = await wait_for_entry(pool, task, deadline)
        assert entry.sandbox is not None
        if entry.sandbox.alive():
            break
        pool.counters.lost += 1  # died while idle: not this rollout's failure
        pool._worker.drop(entry)
    if entry.head != task.base_commit:
        try:
            await checkout(entry.sandbox, task.base_commit, timeout=pool.limits.reset_timeout)
        except BaseException as exc:
            if isinstance(exc, errors.InfraError):
                pool._infra_error(exc.kind)
            if entry.state is S.LEASED:  # else the pool closed and took it
                pool._worker.drop(entry)
            raise
        entry.head = task.base_commit
    return entry, warm


async def wait_for_entry(pool: SandboxPool, task: Task, deadline: float) -> tuple[Entry, bool]:
    """Wait for a sandbox of ``task.image``; return it and whether it was a warm hit."""
    fut: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
    waiter = pool._entries.wait(task.image, task.base_commit, fut)
    pool._worker.assign()
    warm = fut.done() and not fut.cancelled() and fut.exception() is None
    try:
        return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic())), warm
    except BaseException as exc:  # cancelled, timed out or failed: never leak a slot
        pool._entries.give_up(waiter)
        pool._worker.assign()
        if isinstance(exc, TimeoutError):
            pool._infra_error(errors.InfraTimeout.kind)
            raise errors.InfraTimeout(
                f"no sandbox of {task.image!r} within the claim timeout; raise "
                "PoolLimits.claim_timeout or max_live"
            ) from None
        raise


async def reset_lease(pool: SandboxPool, lease: Lease) -> None:
    """:meth:`Lease.reset`: reset the leased sandbox in place, verified, or quarantine it and
    swap a fresh one in (:func:`replace_sandbox`)."""
    pool._check_open()
    entry, task = lease.entry, lease.task
    assert entry.sandbox is not None
    lease.restored_from = None
    if lease.broken is None and entry.sandbox.alive():
        problems, head = await pool._worker.reset_checked(entry, task.base_commit)
        pool._check_open()
        if not problems:
            pool.counters.resets += 1
            if head == task.base_commit:
                entry.head = head
                return
            problems = [f"could not check out {task.base_commit[:12]} after the reset"]
        pool._worker.quarantine(entry, problems)
    await replace_sandbox(pool, lease)


async def replace_sandbox(pool: SandboxPool, lease: Lease, *, dropped: bool = False) -> None:
    """Swap a fresh sandbox of the lease's image, at its task's commit, in under ``lease``;
    the old one leaves (deleted, or already ``dropped``). If none can be had the lease is
    released and the error raised."""
    # The old sandbox leaves the lease (deleted as on a release of a broken one, or
    # quarantined); its delete frees its room under the live cap.
    if not dropped:
        pool._worker.drop(lease.entry)
    try:
        fresh, warm = await entry_at(pool, lease.task,
                                     time.monotonic() + pool.limits.claim_timeout)
    except BaseException:
        lease.released = True  # nothing is leased any more
        pool._leases.discard(lease)
        raise
    pool._claimed(warm, lease.task.image)  # a claim of its own: a warm hit counts as one
    lease.swap(fresh)
