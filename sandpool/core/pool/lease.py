"""A claimed sandbox, held by one rollout until released: :class:`Lease`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from sandpool.core import errors
from sandpool.core.base import ExecResult, Sandbox
from sandpool.core.pool import claims
from sandpool.core.task import Task
from sandpool.core.telemetry import Telemetry

if TYPE_CHECKING:
    from sandpool.core.snapshot import Snapshot
    from sandpool.core.pool.entries import Entry
    from sandpool.core.pool.pool import SandboxPool

__all__ = ["Lease"]

T = TypeVar("T")

#: Seconds at most that a lease's first command runs with its sandbox's CPU weight raised.
FAVOUR_S = 1.0


class Lease:
    """A claimed sandbox, held by one rollout until released.

    It forwards :meth:`exec`, :meth:`read_file` and :meth:`write_file` to the sandbox and
    measures TTFC: from the claim request to the result of the first command. Made by
    :meth:`SandboxPool.acquire <sandpool.core.pool.SandboxPool.acquire>`, never directly.

    Attributes:
        task: The task the sandbox was claimed for.
        sandbox: The underlying sandbox (another one after :meth:`reset` swapped it).
        ttfc_s: Time to first command in seconds, once the first exec has returned.
        broken: Set when an infra error was seen; the sandbox is then deleted, not reused.
        released: The lease has ended (released, or its pool closed); using it raises
            ``PoolClosed``.
        restored_from: The snapshot its sandbox was restored from (a claim ``from_snapshot``,
            a fork's child), until a :meth:`reset` takes it back to the image.
        suspended: Between :meth:`suspend` and :meth:`resume`; using it raises ``ConfigError``.
    """

    def __init__(self, pool: SandboxPool, entry: Entry, task: Task, t_claim: float) -> None:
        assert entry.sandbox is not None
        self._pool = pool
        self._entry = entry
        self.task = task
        self.sandbox: Sandbox = entry.sandbox
        self._t_claim = t_claim
        self.ttfc_s: float | None = None
        self.broken: errors.InfraError | None = None
        self.released = False
        self.restored_from: Snapshot | None = None
        self.suspended = False
        #: The snapshot a suspend took where the backend cannot freeze (its sandbox parked
        #: or let go): what :meth:`resume` restores.
        self.parked: Snapshot | None = None
        #: The suspend parked the sandbox (:meth:`Backend.park
        #: <sandpool.core.base.Backend.park>`): its entry is still this lease's.
        self.kept = False

    def __repr__(self) -> str:
        return f"<Lease {self.sandbox.id} task={self.task.instance_id} ttfc={self.ttfc_s}>"

    @property
    def entry(self) -> Entry:
        """The pool's entry for the leased sandbox."""
        return self._entry

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.sandbox.id

    @property
    def workdir(self) -> str:
        """The task repo's path inside the sandbox."""
        return self.sandbox.workdir

    def swap(self, entry: Entry) -> None:
        """Hold ``entry``'s sandbox instead (:meth:`reset` found the old one unusable)."""
        assert entry.sandbox is not None
        self._entry, self.sandbox, self.broken = entry, entry.sandbox, None

    def _check(self) -> None:
        if self.released:
            raise errors.PoolClosed(f"lease on {self.sandbox.id} was released; claim again")
        if self.suspended:
            raise errors.ConfigError(f"lease on {self.sandbox.id} is suspended; await lease.resume() "
                                     "before using it")

    async def _guard(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.released or self.suspended:
            coro.close()  # never started; closing it avoids a "never awaited" warning
            self._check()
        try:
            return await coro
        except errors.InfraError as exc:
            self.broken = exc
            self._pool._infra_error(exc.kind)
            raise

    async def exec(self, cmd: str | list[str], **kwargs: Any) -> ExecResult:
        """Run a command; see :meth:`sandpool.core.base.Sandbox.exec`. The first call sets TTFC;
        while it runs (for at most :data:`FAVOUR_S`), the sandbox's CPU weight is raised
        (:meth:`Sandbox.favour_cpu <sandpool.core.base.Sandbox.favour_cpu>`)."""
        first = self.ttfc_s is None
        if first:  # what a synchronous batch waits on: not behind other sandboxes' grading
            sandbox = self.sandbox
            sandbox.favour_cpu(True)
            # A first command that runs long is work, not a wait: it gets no more than that.
            undo = asyncio.get_running_loop().call_later(FAVOUR_S, sandbox.favour_cpu, False)
        try:
            with Telemetry.span("sandpool.exec", sandbox_id=self.sandbox.id):
                res = await self._guard(self.sandbox.exec(cmd, **kwargs))
        finally:
            if first:
                undo.cancel()
                sandbox.favour_cpu(False)
        self._first()
        return res

    def _first(self) -> None:
        """TTFC ends now, unless it already has: a first command returned, or a claim from a
        snapshot verified its restored state (its first look at the sandbox)."""
        if self.ttfc_s is None:
            self.ttfc_s = time.monotonic() - self._t_claim
            self._pool._first_command(self.ttfc_s)

    async def read_file(self, path: str) -> bytes:
        """Read a file; see :meth:`sandpool.core.base.Sandbox.read_file`."""
        return await self._guard(self.sandbox.read_file(path))

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write a file; see :meth:`sandpool.core.base.Sandbox.write_file`."""
        await self._guard(self.sandbox.write_file(path, data, mode=mode))

    async def reset(self) -> None:
        """Make the leased sandbox pristine again, keeping the lease (grading's clean slate).

        The sandbox is reset in place and verified, as on release, and checked out at
        ``task.base_commit``. If it fails the check, it is quarantined (deleted, counted); if
        it is dead or :attr:`broken` it is deleted without a reset. Either way a fresh sandbox
        of the same image, at the same commit, is swapped in under this lease (a claim of its
        own: warm or created), and :attr:`sandbox` then names it. TTFC stays the first
        command's.

        Raises:
            InfraError: No replacement sandbox could be had (``InfraTimeout``,
                ``SandboxStartError``, ...); the lease is then released.
            PoolClosed: The lease was released or the pool closed.
        """
        self._check()
        await claims.reset_lease(self._pool, self)

    async def snapshot(self) -> Snapshot:
        """Capture the sandbox's filesystem state: the repo and everything changed outside it
        since the image, not its processes (see :mod:`sandpool.core.snapshot`). The sandbox
        goes on.

        Returns:
            A :class:`~sandpool.core.snapshot.Snapshot` (id, image, ``size_bytes``,
            ``content_hash``); ``save()`` it to keep it past the pool.

        Raises:
            ConfigError: The backend (or this kind of image) cannot snapshot.
            InfraError: The sandbox or the host failed (the lease is then broken).
            PoolClosed: The lease was released.
        """
        with Telemetry.span("sandpool.snapshot", sandbox_id=self.sandbox.id):
            return await self._guard(self.sandbox.snapshot())

    async def fork(self, n: int) -> list[Lease]:
        """``n`` new leases of this task whose sandboxes start in this one's state now.

        This sandbox goes on; each child is a sandbox of its own, restored from one snapshot
        of it and verified (:func:`~sandpool.core.pool.snapshots.fork`): no child sees the
        parent's or a sibling's later changes. Release each child as any lease.

        Raises:
            ConfigError: ``n`` < 1, or the backend cannot snapshot.
            InfraError: The snapshot or a restore failed (no child is left leased).
            PoolClosed: The lease was released.
        """
        from sandpool.core.pool import snapshots

        self._check()
        with Telemetry.span("sandpool.fork", sandbox_id=self.sandbox.id, n=n):
            return await snapshots.fork(self, n)

    async def suspend(self) -> None:
        """Freeze the sandbox's processes (locally, its cgroup freezer), or where the backend
        cannot freeze (Kubernetes), snapshot it and release what runs it: on Kubernetes its
        pod, through its agent-sandbox Sandbox's ``spec.operatingMode: Suspended`` (the
        Sandbox object and claim remain); a plain pod is deleted. See
        :func:`~sandpool.core.pool.snapshots.suspend`. Until :meth:`resume`, every other
        call raises ``ConfigError``. Releasing a suspended lease deletes what remains.
        Idempotent.

        Raises:
            ConfigError: The backend can neither freeze nor snapshot.
            InfraError: The sandbox failed.
        """
        from sandpool.core.pool import snapshots

        if self.suspended:
            return
        self._check()
        with Telemetry.span("sandpool.suspend", sandbox_id=self.sandbox.id):
            await snapshots.suspend(self)

    async def resume(self) -> None:
        """Thaw the sandbox, or restore the suspend's snapshot into a new sandbox (verified)
        held under this lease: on Kubernetes the new pod the controller makes for the Sandbox
        set ``Running`` again (another claim if that Sandbox is gone), with fresh processes.
        A restore that shows another hash than the snapshot's quarantines the sandbox and
        tries another. Idempotent.

        Raises:
            InfraError: No sandbox could be restored (``ResetError``: each one tried showed
                another hash, e.g. the snapshot's data was altered); the lease is then released.
        """
        from sandpool.core.pool import snapshots

        if not self.suspended:
            return
        if self.released:
            self._check()
        with Telemetry.span("sandpool.resume", sandbox_id=self.sandbox.id):
            await snapshots.resume(self)

    async def replace(self, from_snapshot: Snapshot | None = None) -> None:
        """Put a fresh sandbox under this lease in place of the current one (deleted): in
        ``from_snapshot``'s state (restored and verified), or at ``task.base_commit`` without
        one. How an episode goes on after its sandbox failed (:mod:`sandpool.core.checkpoint`).

        Raises:
            InfraError: No sandbox could be had or restored (the lease is then released).
            ConfigError: The snapshot cannot be restored here.
            PoolClosed: The lease was released.
        """
        from sandpool.core.pool import snapshots

        self._check()
        with Telemetry.span("sandpool.replace", sandbox_id=self.sandbox.id):
            await snapshots.replace(self, from_snapshot)

    async def discard_snapshot(self, snap: Snapshot, *, keep: Snapshot | None = None) -> None:
        """Let ``snap``'s data go (a checkpoint superseded by ``keep``, whose data stays);
        see :meth:`Backend.discard_snapshot <sandpool.core.base.Backend.discard_snapshot>`."""
        await self._pool.backend.discard_snapshot(snap, keep=keep)

    async def release(self, *, reusable: bool = True) -> None:
        """Give the sandbox back (see :meth:`SandboxPool.release
        <sandpool.core.pool.SandboxPool.release>`)."""
        await self._pool.release(self, reusable=reusable)
