"""The asyncio sandbox pool: warm pools per image, millisecond claims, in-place reuse.

:class:`SandboxPool` is the surface: open and close, prepare, claim and release, a lease's
reset, the run report. What it holds and decides is
:class:`~sandpool.core.pool.entries.Entries`, changed only there; the creations, resets and
deletes decided there run in :class:`~sandpool.core.pool.worker.PoolWorker`. A claim's wait,
checkout and a held lease's reset or swap are :mod:`~sandpool.core.pool.claims`; the run
report is built in :mod:`~sandpool.core.pool.report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry

from sandpool.core import errors
from sandpool.core.base import Backend, SandboxState
from sandpool.core.classify import Verdict, classify
from sandpool.core.metrics import PoolCounters, RejectedTask, Report, RolloutResult, Workload
from sandpool.core.pool import claims, snapshots
from sandpool.core.pool.batch import Batch
from sandpool.core.pool.entries import Entries
from sandpool.core.pool.lease import Lease
from sandpool.core.pool.report import build_report
from sandpool.core.pool.limits import PoolLimits, PoolState
from sandpool.core.pool.worker import PoolWorker
from sandpool.core.snapshot import Snapshot
from sandpool.core.strategies import Strategy, get_strategy
from sandpool.core.task import Task
from sandpool.core.telemetry import PoolMetrics, Telemetry, resolve_metrics

__all__ = ["SandboxPool"]

S = SandboxState


class SandboxPool:
    """Warm pools of sandboxes per image over one backend.

    Usage::

        async with SandboxPool(LocalBackend(), strategy="reuse") as pool:
            await pool.prepare(tasks, concurrency=8)       # hydrate images, fill warm pools
            async with pool.claim(task) as sandbox:
                result = await sandbox.exec("git status", timeout=30)

    Use it on one event loop (the one it was opened on; callers on other threads submit to
    :attr:`loop`). A claim that is cancelled or times out leaves the queue and hands back a
    sandbox assigned to it in the meantime, so no slot leaks.

    Args:
        backend: Where sandboxes run.
        strategy: ``"cold"``, ``"warm"``, ``"reuse"`` or a :class:`Strategy`.
        limits: Creation rate, live cap and timeouts.
        metrics: Prometheus series to record into: ``True`` (the default registry), a
            ``prometheus_client.CollectorRegistry``, a
            :class:`~sandpool.core.telemetry.PoolMetrics`, or ``None`` (off). OpenTelemetry
            spans are emitted either way (a no-op without a configured ``TracerProvider``).
    """

    def __init__(
        self,
        backend: Backend,
        strategy: str | Strategy = "reuse",
        limits: PoolLimits = PoolLimits(),  # noqa: B008 - frozen: one shared default is safe
        *,
        metrics: PoolMetrics | CollectorRegistry | bool | None = None,
    ) -> None:
        self.backend = backend
        self.strategy = get_strategy(strategy)
        self.limits = limits
        self.state = PoolState.UNOPENED
        self.counters = PoolCounters()
        self._entries = Entries(self.strategy, limits.max_live or 8)
        self._hydrated: set[str] = set()
        self._prefetched: dict[str, int] = {}  # image -> its target before the last prefetch
        self._concurrency = 0  # rollouts at once, as prepare was told
        self._leases: set[Lease] = set()
        self._ttfc: list[float] = []
        self.telemetry = Telemetry(resolve_metrics(metrics), backend=backend.name,
                                   strategy=self.strategy.name)
        self._worker = PoolWorker(backend, self._entries, limits, self.counters, self.telemetry,
                                  is_open=lambda: self.state is PoolState.OPEN)
        self._batch = Batch(backend, self._worker.spawn)
        if self.telemetry.metrics is not None:
            self.telemetry.metrics.attach(self)
        backend.telemetry = self.telemetry
        #: The event loop the pool was opened on (callers on other threads submit to it).
        self.loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        e = self._entries
        return (f"<SandboxPool [{self.state.value}] {self.strategy.name} on {self.backend.name}: "
                f"idle={e.count(S.IDLE)} leased={e.count(S.LEASED)} creating={e.count(S.CREATING)} "
                f"resetting={e.count(S.RESETTING)} deleting={e.count(S.DELETED)} "
                f"waiting={e.waiting} max_live={e.max_live}>")

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> SandboxPool:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Run the backend's preflight and open the pool.

        Raises:
            BackendUnavailable: The backend cannot run sandboxes here.
            PoolClosed: The pool was already closed.
        """
        if self.state is PoolState.CLOSED:
            raise errors.PoolClosed("this pool was closed; make a new SandboxPool")
        if self.state is PoolState.OPEN:
            return
        await self.backend.preflight()
        self.loop = asyncio.get_running_loop()
        self.state = PoolState.OPEN

    async def aclose(self) -> None:
        """Delete every sandbox (idle, leased or in flight) and close the backend. Idempotent."""
        if self.state is PoolState.CLOSED:
            return
        self.state = PoolState.CLOSED
        self._entries.close(errors.PoolClosed("pool closed while waiting for a sandbox"))
        await self._worker.drain()
        for lease in self._leases:
            lease.released = True
        self._leases.clear()
        # Idle and leased sandboxes, and those whose reset was cancelled above.
        doomed = [e for img in self._entries.images.values()
                  for state in (S.IDLE, S.LEASED, S.RESETTING) for e in img.entries(state)]
        for entry in doomed:
            self._entries.move(entry, S.DELETED)
        await asyncio.gather(*(self._worker.delete(e) for e in doomed), return_exceptions=True)
        await self.backend.aclose()

    def _check_open(self) -> None:
        if self.state is not PoolState.OPEN:
            raise errors.PoolClosed(f"pool is {self.state.value}; use `async with "
                                    "SandboxPool(...)` or await pool.open()")

    # -- planning --------------------------------------------------------------------------

    async def hydrate(self, image: str) -> None:
        """Make ``image`` present for the backend once (pull or verify a local build).

        Raises:
            ImageNotFound: The image does not exist.
        """
        if image not in self._hydrated:
            await self.backend.hydrate(image)
            self._hydrated.add(image)

    async def prepare(
        self,
        tasks: Iterable[Task],
        concurrency: int,
        *,
        rollouts_per_task: int = 1,
        exact: bool = False,
        wait: bool = True,
    ) -> dict[str, int]:
        """Hydrate the tasks' images and fill warm pools for ``concurrency`` rollouts at once.

        Args:
            tasks: The tasks about to run.
            concurrency: How many rollouts will run at once.
            rollouts_per_task: Rollouts each task will get (weights the per-image split).
            exact: The tasks get exactly ``rollouts_per_task`` claims each: a warm pool the
                backend holds is sized to them (:mod:`~sandpool.core.pool.batch`).
            wait: Return only once every warm pool reached its target (or creation failed).

        Returns:
            Slots per image from the strategy's plan.

        Raises:
            ImageNotFound: An image is missing (nothing was started).
            PoolClosed: The pool is not open.
        """
        self._check_open()
        demand = await self._hydrated_demand(tasks, rollouts_per_task)
        slots = self.strategy.plan(demand, concurrency)
        self._concurrency = concurrency
        if self.limits.max_live is None:
            self._entries.max_live = self.strategy.max_live(max(concurrency, len(slots)))
        for image, n in slots.items():
            # The strategy's warm count for an empty image; the backend may hold it server-side.
            warm = self.strategy.deficit(target=n, idle=0, creating=0, leased=0, resetting=0)
            kept = await self._batch.size(image, demand[image] if exact else None, warm,
                                          reuse=self.strategy.reuse)
            self._entries.image(image).target = kept if warm else n
        self._worker.assign()
        if wait:
            await self.wait_warm()
        return slots

    async def _hydrated_demand(self, tasks: Iterable[Task], rollouts_per_task: int) -> dict[str, int]:
        """Rollouts per image of ``tasks`` (``rollouts_per_task`` each), every image hydrated.

        Raises:
            ImageNotFound: An image is missing (the images before it are hydrated).
        """
        demand: dict[str, int] = {}
        for t in tasks:
            demand[t.image] = demand.get(t.image, 0) + rollouts_per_task
        for image in demand:
            await self.hydrate(image)
        return demand

    async def prefetch(self, tasks: Iterable[Task], *, rollouts_per_task: int = 1,
                       concurrency: int | None = None) -> dict[str, int]:
        """Hydrate and warm the next batch's images while the current batch runs.

        Each image of ``tasks`` gets a warm target of the sandboxes the next batch runs on it
        at once (``rollouts_per_task`` per task: a GRPO group's size); the targets the last
        prefetch raised for images not in this batch go back to what they were, so their idle
        sandboxes become the first evicted to make room. Creations stay within ``max_live``
        (when :class:`PoolLimits` leaves it unset, the cap grows to the strategy's for
        ``concurrency`` rollouts plus the next batch). Returns without waiting for them.

        Args:
            tasks: The next batch's tasks.
            rollouts_per_task: Rollouts each of them will get at once.
            concurrency: Rollouts running now (default: what :meth:`prepare` was told).

        Returns:
            The warm target per image of the next batch.

        Raises:
            ImageNotFound: An image is missing (nothing was started).
            PoolClosed: The pool is not open.
        """
        self._check_open()
        demand = await self._hydrated_demand(tasks, rollouts_per_task)
        for image in [i for i in self._prefetched if i not in demand]:
            self._entries.image(image).target = self._prefetched.pop(image)
        for image, n in demand.items():
            img = self._entries.image(image)
            self._prefetched.setdefault(image, img.target)
            img.target = max(self._prefetched[image], n)
        if self.limits.max_live is None:
            now = concurrency if concurrency is not None else self._concurrency
            self._entries.max_live = max(self._entries.max_live,
                                         self.strategy.max_live(now + sum(demand.values())))
        self._worker.assign()
        return demand

    async def wait_warm(self, timeout: float | None = None) -> None:
        """Wait until no creation is in flight and warm targets are met (or cannot be)."""
        async with asyncio.timeout(timeout):
            while self._entries.count(S.CREATING):
                self._worker.changed.clear()
                await self._worker.changed.wait()
            await self.backend.wait_warm()

    # -- claim / release -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def claim(self, task: Task, *, timeout: float | None = None,
                    from_snapshot: Snapshot | None = None) -> AsyncIterator[Lease]:
        """Claim a sandbox for one rollout of ``task``; release it on exit.

        An error inside the block that :func:`~sandpool.core.classify.classify` calls infra
        marks the sandbox broken, so it is deleted rather than reused. Yields a
        :class:`Lease`. Raises as :meth:`acquire`.
        """
        lease = await self.acquire(task, timeout=timeout, from_snapshot=from_snapshot)
        try:
            yield lease
        except Exception as exc:
            # An infra error, or one nobody can explain, leaves the sandbox suspect: delete it.
            await self.release(lease, reusable=classify(exc) is not Verdict.INFRA)
            raise
        except BaseException:
            await self.release(lease)
            raise
        else:
            await self.release(lease)

    async def acquire(self, task: Task, *, timeout: float | None = None,
                      from_snapshot: Snapshot | None = None) -> Lease:
        """Claim a sandbox of ``task.image`` at ``task.base_commit``, or in ``from_snapshot``'s
        state.

        A warm hit is served at once; a miss waits for a creation (rate-limited) or a reset.
        A claim counts (``counters.claims``, and ``warm_hits`` when an idle sandbox served
        it) only once it returns a lease.

        Args:
            task: The task to run.
            timeout: Seconds to wait (default ``limits.claim_timeout``).
            from_snapshot: A snapshot of a sandbox of ``task.image``: the claimed sandbox is
                restored from it and verified (its state hash must be the snapshot's; one that
                is not is quarantined and another tried; see :mod:`.snapshots`).

        Returns:
            A :class:`Lease`; release it with :meth:`release`.

        Raises:
            InfraTimeout: No sandbox within ``timeout``.
            SandboxStartError: Creating a sandbox for this claim failed.
            ImageNotFound: Unknown image.
            InputError: ``base_commit`` is not in the image.
            ConfigError: ``from_snapshot`` is of another image, build or backend.
            PoolClosed: The pool is not open.
        """
        self._check_open()
        if from_snapshot is not None:
            from_snapshot.check_target(task.image, None, self.backend.name)
        t0 = time.monotonic()
        with Telemetry.span("sandpool.claim", task_id=task.instance_id, image=task.image) as span:
            await self.hydrate(task.image)
            deadline = t0 + (timeout if timeout is not None else self.limits.claim_timeout)
            entry, warm = await claims.entry_at(self, task, deadline)
            self._check_open()  # closed during the checkout: the close took the sandbox
            lease = Lease(self, entry, task, t0)
            self._leases.add(lease)
            self._claimed(warm, task.image)
            span.set_attribute("sandpool.warm", warm)
            span.set_attribute("sandpool.sandbox_id", lease.id)
        if from_snapshot is not None:
            await snapshots.restore(self, lease, from_snapshot)
        return lease

    def _claimed(self, warm: bool, image: str) -> None:
        self._batch.claimed(image)
        self.counters.claims += 1
        self.counters.warm_hits += warm
        self.telemetry.claimed(warm=warm)

    async def release(self, lease: Lease, *, reusable: bool = True) -> None:
        """Return a leased sandbox: reset it in place for reuse, or delete it.

        With a reusing strategy and a healthy sandbox this returns once the in-place reset is
        verified (or the sandbox quarantined: deleted and counted), so the reset is part of
        ending the rollout, not of the next claim; its duration is reported as reset time.
        Otherwise the delete runs in the background. Releasing twice is a no-op; cancelling
        the caller does not interrupt a reset.
        """
        if lease.released:
            return
        if lease.suspended:
            if lease.parked is not None:  # its sandbox was parked or went at the suspend
                lease.released = True
                self._leases.discard(lease)
                if lease.kept:  # parked: its identity goes now (never reset: nothing runs it)
                    lease.kept = False
                    self._worker.drop(lease.entry)
                return
            await self.backend.resume(lease.sandbox)  # a frozen sandbox cannot be reset
            lease.suspended = False
        lease.released = True
        self._leases.discard(lease)
        entry = lease.entry
        assert entry.sandbox is not None
        if self.state is not PoolState.OPEN:
            self._entries.move(entry, S.DELETED)
            await self._worker.delete(entry)
            return
        keep = reusable and lease.broken is None and self.strategy.reuse
        if not (keep and entry.sandbox.alive()):
            self._worker.drop(entry)
            return
        self._entries.move(entry, S.RESETTING)
        await asyncio.shield(self._worker.spawn(self._worker.reset(entry, lease.task.base_commit)))

    def _infra_error(self, kind: str) -> None:
        self._worker.infra_error(kind)

    def _first_command(self, ttfc_s: float) -> None:
        self._ttfc.append(ttfc_s)
        self.telemetry.first_command(ttfc_s)

    # -- reporting ---------------------------------------------------------------------------

    def sizes(self) -> dict[str, dict[str, int]]:
        """Sandboxes by image and state (idle, leased, creating, resetting, quarantined).

        Read from the pool's entries; safe to call from another thread (a metrics scrape)."""
        return {name: img.sizes() for name, img in list(self._entries.images.items())}

    @property
    def max_live(self) -> int:
        """The cap on live sandboxes in force: ``PoolLimits.max_live``, or the default
        :meth:`prepare` and :meth:`prefetch` sized when that is unset."""
        return self._entries.max_live

    @property
    def ttfc_samples(self) -> list[float]:
        """TTFC of every lease that ran a command, in seconds, in order."""
        return list(self._ttfc)

    def report(
        self,
        workload: Workload,
        results: list[RolloutResult],
        wall_time_s: float,
        rejected: list[RejectedTask] | None = None,
    ) -> Report:
        """Build the run :class:`Report` from this pool's counters and ``results``."""
        return build_report(self, workload, results, wall_time_s, rejected)
