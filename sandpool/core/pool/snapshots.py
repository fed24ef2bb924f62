"""Leases from snapshots: a claim restored from a snapshot, fork, suspend and resume.

The backend's sandboxes take and restore snapshots (:mod:`sandpool.core.snapshot`); this
module does the pool's part:

* :func:`restore`: a claimed, pristine sandbox gets the snapshot's state, verified as a reset
  is: its :meth:`~sandpool.core.base.Sandbox.state_hash` must be the snapshot's
  ``content_hash``. A sandbox that shows another hash is quarantined and another claimed in
  its place (up to :data:`RESTORE_ATTEMPTS`), so a lease never holds an unverified restore.
  A restored sandbox goes back to the pool like any other: its in-place reset takes it back
  to the image and verifies that.
* :func:`fork`: a snapshot of the lease's sandbox, restored into n new leases. The parent goes
  on; each child is a sandbox of its own (no child sees another's later changes).
* :func:`suspend` / :func:`resume`: a backend that can freeze a sandbox in place (the local
  backend's cgroup freezer) does. One that cannot takes a snapshot, then parks the sandbox
  (:meth:`Backend.park <sandpool.core.base.Backend.park>`: on Kubernetes its agent-sandbox
  Sandbox is set ``Suspended``, so the controller deletes the pod while the Sandbox object and
  its claim remain, and so does the pool's entry), or, where it cannot park either, deletes
  it. :func:`resume` runs the parked sandbox again (a new pod, fresh from the image) or
  claims another, and restores the snapshot into it, verified as any restore.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.base import SandboxState
from sandpool.core.pool import claims
from sandpool.core.reset import record_pristine
from sandpool.core.snapshot import Snapshot
from sandpool.core.telemetry import Telemetry

if TYPE_CHECKING:
    from sandpool.core.pool.lease import Lease
    from sandpool.core.pool.pool import SandboxPool

__all__ = ["RESTORE_ATTEMPTS", "fork", "replace", "restore", "resume", "suspend"]

#: Sandboxes a restore tries before it gives up (each failed one is quarantined or deleted).
RESTORE_ATTEMPTS = 3


async def restore(pool: SandboxPool, lease: Lease, snap: Snapshot) -> None:
    """Make ``lease``'s freshly claimed sandbox ``snap``'s state, verified.

    Raises:
        ConfigError: The snapshot cannot be restored here (another image, build or backend;
            its data gone or altered). The lease is released.
        InfraError: No sandbox could be restored and verified in :data:`RESTORE_ATTEMPTS`
            tries (the last error); the lease is released.
    """
    last: errors.InfraError | None = None
    with Telemetry.span("sandpool.restore", snapshot_id=snap.id, image=snap.image):
        for _ in range(RESTORE_ATTEMPTS):
            sb = lease.sandbox
            try:
                await sb.load_snapshot(snap)
                got = await sb.state_hash()
            except errors.InfraError as exc:
                lease.broken = last = exc
                pool._infra_error(exc.kind)
            except BaseException:
                await lease.release()
                raise
            else:
                if got == snap.content_hash:
                    lease.entry.head = None  # at the snapshot's commit, whatever it is
                    lease.restored_from = snap
                    lease._first()
                    return
                last = errors.ResetError(f"sandbox {sb.id} restored from snapshot {snap.id} shows "
                                         f"state {got[:16]}, not the snapshot's {snap.content_hash[:16]}")
                pool._worker.quarantine(lease.entry, [str(last)])
            await claims.replace_sandbox(pool, lease)
        await lease.release(reusable=False)
        assert last is not None
        raise last


async def fork(lease: Lease, n: int) -> list[Lease]:
    """``n`` new leases of ``lease``'s task, each restored from one snapshot of its sandbox
    now (see the module docstring). The caller releases each.

    Raises:
        ConfigError: ``n`` < 1, or the backend cannot snapshot.
        InfraError: The snapshot or a restore failed; no child is left leased.
    """
    if n < 1:
        raise errors.ConfigError(f"fork(n={n}): n must be at least 1")
    snap = await lease.snapshot()
    pool = lease._pool
    got = await asyncio.gather(*(pool.acquire(lease.task, from_snapshot=snap) for _ in range(n)),
                               return_exceptions=True)
    kids = [k for k in got if not isinstance(k, BaseException)]
    failed = [k for k in got if isinstance(k, BaseException)]
    if failed:
        await asyncio.gather(*(k.release() for k in kids), return_exceptions=True)
        raise failed[0]
    return kids


async def suspend(lease: Lease) -> None:
    """Freeze the lease's sandbox in place, or snapshot it and park it or let it go; see the
    module."""
    pool = lease._pool
    if await lease._guard(pool.backend.suspend(lease.sandbox)):
        lease.suspended = True
        return
    snap = await lease.snapshot()
    if await lease._guard(pool.backend.park(lease.sandbox)):
        lease.parked, lease.kept, lease.suspended = snap, True, True
        return
    lease.parked, lease.suspended = snap, True
    entry = lease.entry  # deleted before this returns: its pod (or process tree) is released
    pool._entries.move(entry, SandboxState.DELETED)
    await pool._worker.delete(entry)


async def resume(lease: Lease) -> None:
    """Thaw the lease's sandbox, or restore its snapshot into the parked sandbox run again
    or into a new one (verified)."""
    pool = lease._pool
    snap, lease.parked = lease.parked, None
    if snap is None:
        lease.suspended = False
        await lease._guard(pool.backend.resume(lease.sandbox))
        return
    try:
        if not (lease.kept and await _unpark(pool, lease)):
            dropped, lease.kept = not lease.kept, False  # a parked one that failed goes now
            await claims.replace_sandbox(pool, lease, dropped=dropped)
        lease.suspended = False
        await restore(pool, lease, snap)
    except BaseException:
        if lease.suspended:  # nothing was restored: the snapshot is still what it resumes from
            lease.parked = snap
        raise


async def _unpark(pool: SandboxPool, lease: Lease) -> bool:
    """Run the lease's parked sandbox again under its entry, recorded pristine; False (the
    parked one left to the caller to drop) when it did not come back."""
    entry = lease.entry
    assert entry.sandbox is not None
    try:
        fresh = await pool.backend.unpark(entry.sandbox)
    except errors.InfraError as exc:
        pool._infra_error(exc.kind)
        return False
    try:
        if not fresh.recorded:  # what the restore's change set is against, as at a create
            await record_pristine(fresh, timeout=pool.limits.create_timeout)
    except errors.InfraError as exc:
        pool._infra_error(exc.kind)
        entry.sandbox = fresh  # the new handle is what the drop deletes
        return False
    entry.sandbox, entry.head = fresh, None
    lease.kept = False
    lease.swap(entry)
    return True


async def replace(lease: Lease, snap: Snapshot | None) -> None:
    """A fresh sandbox under ``lease`` in place of its current one (deleted), restored from
    ``snap`` when given; see :meth:`Lease.replace <sandpool.core.pool.Lease.replace>`."""
    pool = lease._pool
    await claims.replace_sandbox(pool, lease)
    lease.restored_from = None
    if snap is not None:
        await restore(pool, lease, snap)
