"""The asyncio sandbox pool: warm pools per image, millisecond claims, in-place reuse.

State changes happen in one synchronous function, :meth:`SandboxPool._assign`, which matches
waiting claims to idle sandboxes and decides what to create or evict; the I/O it decides on
(create, delete, reset) runs in tasks outside it (the shape of httpcore's connection pool).
A claim that is cancelled or times out removes its waiter, and hands back a sandbox that was
assigned to it in the meantime, so no slot leaks.

Why one module of ~750 lines: every state change goes through ``_assign`` under one lock,
and the claim, release, fill and reset paths that feed it must read the same private state;
splitting them across modules would expose that state. :class:`Lease` is the candidate to move
out next.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from aiolimiter import AsyncLimiter
from prometheus_client import CollectorRegistry

from sandpool.core import errors
from sandpool.core.base import Backend, ExecResult, Sandbox, SandboxState
from sandpool.core.classify import Verdict, classify
from sandpool.core.metrics import (
    Outcome,
    PoolCounters,
    RejectedTask,
    Report,
    RewardSummary,
    RolloutResult,
    TTFCStats,
    Workload,
)
from sandpool.core.reset import checkout, record_pristine, reset_in_place
from sandpool.core.strategies import Strategy, get_strategy
from sandpool.core.task import Task
from sandpool.core.telemetry import PoolMetrics, Telemetry, resolve_metrics

__all__ = ["Lease", "PoolLimits", "PoolState", "SandboxPool"]


@dataclass(frozen=True)
class PoolLimits:
    """Limits on what a pool asks of its backend.

    Usage: ``PoolLimits(max_live=16, create_rate=5.0, create_burst=10)``.

    Attributes:
        max_live: Cap on sandboxes alive at once (creating, idle, leased, resetting, and
            being deleted: a sandbox holds its resources until its delete returns).
            ``None`` takes the strategy's default for the prepared concurrency.
        create_rate: Sandbox creations per second, sustained (token bucket refill).
        create_burst: Creations allowed back to back (token bucket size).
        claim_timeout: Seconds a claim may wait for a sandbox before ``InfraTimeout``.
        reset_timeout: Seconds an in-place reset (and its verification) may take.
        create_timeout: Seconds one creation may take before ``SandboxStartError``.
    """

    max_live: int | None = None
    create_rate: float = 20.0
    create_burst: int = 20
    claim_timeout: float = 300.0
    reset_timeout: float = 60.0
    create_timeout: float = 120.0


class PoolState(enum.Enum):
    """Lifecycle of a pool."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(eq=False)
class _Entry:
    sandbox: Sandbox
    image: str
    state: SandboxState = SandboxState.IDLE
    head: str | None = None  # commit the workdir is known to be at, pristine


@dataclass(eq=False)
class _Waiter:
    image: str
    commit: str
    future: asyncio.Future[_Entry]


@dataclass
class _Image:
    target: int = 0
    idle: deque[_Entry] = field(default_factory=deque)
    waiters: deque[_Waiter] = field(default_factory=deque)
    creating: int = 0
    leased: int = 0
    resetting: int = 0
    deleting: int = 0  # still holding the backend's resources until the delete returns
    fill_failures: int = 0  # consecutive failed warm fills: they back off, the target stays
    fill_after: float = 0.0  # monotonic time before which no warm fill starts
    quarantined: int = 0  # failed their reset; their delete is in flight (part of `deleting`)

    @property
    def live(self) -> int:
        return len(self.idle) + self.creating + self.leased + self.resetting + self.deleting


class Lease:
    """A claimed sandbox, held by one rollout until released.

    It forwards :meth:`exec`, :meth:`read_file` and :meth:`write_file` to the sandbox and
    measures TTFC: from the claim request to the result of the first command.

    Attributes:
        task: The task the sandbox was claimed for.
        sandbox: The underlying sandbox.
        ttfc_s: Time to first command in seconds, once the first exec has returned.
        broken: Set when an infra error was seen; the sandbox is then deleted, not reused.
    """

    def __init__(self, pool: SandboxPool, entry: _Entry, task: Task, t_claim: float) -> None:
        self._pool = pool
        self._entry = entry
        self.task = task
        self.sandbox = entry.sandbox
        self._t_claim = t_claim
        self.ttfc_s: float | None = None
        self.broken: errors.InfraError | None = None
        self.released = False

    def __repr__(self) -> str:
        return f"<Lease {self.sandbox.id} task={self.task.instance_id} ttfc={self.ttfc_s}>"

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.sandbox.id

    @property
    def workdir(self) -> str:
        """The task repo's path inside the sandbox."""
        return self.sandbox.workdir

    def _check(self) -> None:
        if self.released:
            raise errors.PoolClosed(f"lease on {self.sandbox.id} was released; claim again")

    async def _guard(self, coro):  # type: ignore[no-untyped-def]
        if self.released:
            coro.close()  # never started; closing it avoids a "never awaited" warning
            self._check()
        try:
            return await coro
        except errors.InfraError as exc:
            self.broken = exc
            self._pool._infra_error(exc.kind)
            raise

    async def exec(self, cmd: str | list[str], **kwargs: object) -> ExecResult:
        """Run a command; see :meth:`sandpool.core.base.Sandbox.exec`. The first call sets TTFC."""
        with Telemetry.span("sandpool.exec", sandbox_id=self.sandbox.id):
            res = await self._guard(self.sandbox.exec(cmd, **kwargs))  # type: ignore[arg-type]
        if self.ttfc_s is None:
            self.ttfc_s = time.monotonic() - self._t_claim
            self._pool._ttfc.append(self.ttfc_s)
            self._pool.telemetry.first_command(self.ttfc_s)
        return res

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
        await self._pool._reset_lease(self)

    async def release(self, *, reusable: bool = True) -> None:
        """Give the sandbox back (see :meth:`SandboxPool.release`)."""
        await self._pool.release(self, reusable=reusable)


class SandboxPool:
    """Warm pools of sandboxes per image over one backend.

    Usage::

        async with SandboxPool(LocalBackend(), strategy="reuse") as pool:
            await pool.prepare(tasks, concurrency=8)       # hydrate images, fill warm pools
            async with pool.claim(task) as sandbox:
                result = await sandbox.exec("git status", timeout=30)

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
        limits: PoolLimits = PoolLimits(),
        *,
        metrics: PoolMetrics | CollectorRegistry | bool | None = None,
    ) -> None:
        self.backend = backend
        self.strategy = get_strategy(strategy)
        self.limits = limits
        self.state = PoolState.UNOPENED
        self.counters = PoolCounters()
        self._images: dict[str, _Image] = {}
        self._hydrated: set[str] = set()
        self._max_live = limits.max_live or 8
        self._limiter = AsyncLimiter(limits.create_burst, limits.create_burst / limits.create_rate)
        self._tasks: set[asyncio.Task[None]] = set()
        self._leases: set[Lease] = set()
        self._ttfc: list[float] = []
        self._changed = asyncio.Event()
        self.telemetry = Telemetry(resolve_metrics(metrics), backend=backend.name,
                                   strategy=self.strategy.name)
        if self.telemetry.metrics is not None:
            self.telemetry.metrics.attach(self)
        backend.telemetry = self.telemetry
        #: The event loop the pool was opened on (callers on other threads submit to it).
        self.loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        idle = sum(len(i.idle) for i in self._images.values())
        leased = sum(i.leased for i in self._images.values())
        creating = sum(i.creating for i in self._images.values())
        resetting = sum(i.resetting for i in self._images.values())
        waiting = sum(len(i.waiters) for i in self._images.values())
        return (f"<SandboxPool [{self.state.value}] {self.strategy.name} on {self.backend.name}: "
                f"idle={idle} leased={leased} creating={creating} resetting={resetting} "
                f"waiting={waiting} max_live={self._max_live}>")

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
        for img in self._images.values():
            for w in img.waiters:
                if not w.future.done():
                    w.future.set_exception(errors.PoolClosed("pool closed while waiting for a sandbox"))
            img.waiters.clear()
        # Let in-flight creations, resets and deletes finish: a cancelled delete would leave
        # mounts behind, and work that lands after close deletes its own sandbox.
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.limits.create_timeout)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        doomed = [e.sandbox for img in self._images.values() for e in img.idle]
        doomed += [lease.sandbox for lease in self._leases]
        for lease in self._leases:
            lease.released = True
        self._leases.clear()
        await asyncio.gather(*(self.backend.delete(sb) for sb in doomed), return_exceptions=True)
        self.counters.deleted += len(doomed)
        self._images.clear()
        await self.backend.aclose()

    def _check_open(self) -> None:
        if self.state is not PoolState.OPEN:
            raise errors.PoolClosed(
                f"pool is {self.state.value}; use `async with SandboxPool(...)` or await pool.open()"
            )

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
        wait: bool = True,
    ) -> dict[str, int]:
        """Hydrate the tasks' images and fill warm pools for ``concurrency`` rollouts at once.

        Args:
            tasks: The tasks about to run.
            concurrency: How many rollouts will run at once.
            rollouts_per_task: Rollouts each task will get (weights the per-image split).
            wait: Return only once every warm pool reached its target (or creation failed).

        Returns:
            Slots per image from the strategy's plan.

        Raises:
            ImageNotFound: An image is missing (nothing was started).
            PoolClosed: The pool is not open.
        """
        self._check_open()
        demand: dict[str, int] = {}
        for t in tasks:
            demand[t.image] = demand.get(t.image, 0) + rollouts_per_task
        for image in demand:
            await self.hydrate(image)
        slots = self.strategy.plan(demand, concurrency)
        if self.limits.max_live is None:
            self._max_live = self.strategy.max_live(max(concurrency, len(slots)))
        for image, n in slots.items():
            # The strategy's warm count for an empty image; the backend may hold it server-side.
            warm = self.strategy.deficit(target=n, idle=0, creating=0, leased=0, resetting=0)
            kept = await self.backend.set_warm_target(image, warm, reuse=self.strategy.reuse)
            self._images.setdefault(image, _Image()).target = kept if warm else n
        self._assign()
        if wait:
            await self.wait_warm()
        return slots

    async def wait_warm(self, timeout: float | None = None) -> None:
        """Wait until no creation is in flight and warm targets are met (or cannot be)."""
        async with asyncio.timeout(timeout):
            while any(i.creating for i in self._images.values()):
                self._changed.clear()
                await self._changed.wait()
            await self.backend.wait_warm()

    # -- claim / release -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def claim(self, task: Task, *, timeout: float | None = None) -> AsyncIterator[Lease]:
        """Claim a sandbox for one rollout of ``task``; release it on exit.

        An error inside the block that :func:`~sandpool.core.classify.classify` calls infra
        marks the sandbox broken, so it is deleted rather than reused. Yields a
        :class:`Lease`. Raises as :meth:`acquire`.
        """
        lease = await self.acquire(task, timeout=timeout)
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

    async def acquire(self, task: Task, *, timeout: float | None = None) -> Lease:
        """Claim a sandbox of ``task.image`` at ``task.base_commit``.

        A warm hit is served at once; a miss waits for a creation (rate-limited) or a reset.

        Args:
            task: The task to run.
            timeout: Seconds to wait (default ``limits.claim_timeout``).

        Returns:
            A :class:`Lease`; release it with :meth:`release`.

        Raises:
            InfraTimeout: No sandbox within ``timeout``.
            SandboxStartError: Creating a sandbox for this claim failed.
            ImageNotFound: Unknown image.
            InputError: ``base_commit`` is not in the image.
            PoolClosed: The pool is not open.
        """
        self._check_open()
        t0 = time.monotonic()
        with Telemetry.span("sandpool.claim", task_id=task.instance_id, image=task.image) as span:
            await self.hydrate(task.image)
            deadline = t0 + (timeout if timeout is not None else self.limits.claim_timeout)
            entry, warm = await self._entry_at(task, deadline)
            lease = Lease(self, entry, task, t0)
            self._leases.add(lease)
            self.counters.claims += 1
            self.telemetry.claimed(warm=warm)
            span.set_attribute("sandpool.warm", warm)
            span.set_attribute("sandpool.sandbox_id", entry.sandbox.id)
            return lease

    async def _entry_at(self, task: Task, deadline: float) -> tuple[_Entry, bool]:
        """A live sandbox of ``task.image`` assigned to the caller, at ``task.base_commit``,
        and whether it was a warm hit. A failed checkout deletes the sandbox and raises."""
        while True:
            entry, warm = await self._wait_for_entry(task, deadline)
            if entry.sandbox.alive():
                break
            self.counters.lost += 1  # died while idle: not this rollout's failure
            self._drop(entry)
        if entry.head != task.base_commit:
            try:
                await checkout(entry.sandbox, task.base_commit, timeout=self.limits.reset_timeout)
            except BaseException as exc:
                if isinstance(exc, errors.InfraError):
                    self._infra_error(exc.kind)
                self._drop(entry)
                raise
            entry.head = task.base_commit
        return entry, warm

    async def _wait_for_entry(self, task: Task, deadline: float) -> tuple[_Entry, bool]:
        """Wait for a sandbox of ``task.image``; return it and whether it was a warm hit."""
        img = self._images.setdefault(task.image, _Image())
        fut: asyncio.Future[_Entry] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(task.image, task.base_commit, fut)
        img.waiters.append(waiter)
        self._assign()
        warm = fut.done() and not fut.cancelled() and fut.exception() is None
        if warm:
            self.counters.warm_hits += 1
        try:
            return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic())), warm
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                img.waiters.remove(waiter)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._to_idle(fut.result())  # assigned just as we gave up: hand it back
            elif not fut.done():
                fut.cancel()
            self._assign()
            if isinstance(exc, TimeoutError):
                self._infra_error(errors.InfraTimeout.kind)
                raise errors.InfraTimeout(
                    f"no sandbox of {task.image!r} within the claim timeout; raise "
                    "PoolLimits.claim_timeout or max_live"
                ) from None
            raise

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
        lease.released = True
        self._leases.discard(lease)
        entry = lease._entry
        img = self._images.get(entry.image)
        if img is None or self.state is not PoolState.OPEN:
            await self._delete(entry.sandbox)
            return
        img.leased -= 1
        keep = (reusable and lease.broken is None and self.strategy.reuse
                and entry.sandbox.alive())
        if not keep:
            self._start_delete(entry.sandbox, entry.image)
            self._assign()
            return
        entry.state = SandboxState.RESETTING
        img.resetting += 1
        await asyncio.shield(self._spawn(self._reset(entry, lease.task.base_commit)))

    async def _reset_lease(self, lease: Lease) -> None:
        """:meth:`Lease.reset`: reset the leased entry in place, or quarantine it and swap."""
        self._check_open()
        entry, task = lease._entry, lease.task
        img = self._images[entry.image]
        quarantine = False
        if lease.broken is None and entry.sandbox.alive():
            problems, head = await self._reset_checked(entry, task.base_commit)
            self._check_open()
            if not problems:
                self.counters.resets += 1
                if head == task.base_commit:
                    entry.head = head
                    return
                problems = [f"could not check out {task.base_commit[:12]} after the reset"]
            self._quarantined(entry, problems)
            quarantine = True
        # The old sandbox leaves the lease (deleted as on a release of a broken one, or
        # quarantined); its delete frees its room under the live cap.
        img.leased -= 1
        entry.state = SandboxState.DELETED
        self._start_delete(entry.sandbox, entry.image, quarantined=quarantine)
        self._assign()
        try:
            fresh, warm = await self._entry_at(task, time.monotonic() + self.limits.claim_timeout)
        except BaseException:
            lease.released = True  # nothing is leased any more
            self._leases.discard(lease)
            raise
        self.counters.claims += 1  # a claim of its own: a warm hit counts as one
        self.telemetry.claimed(warm=warm)
        lease._entry, lease.sandbox, lease.broken = fresh, fresh.sandbox, None

    # -- the one place where state changes -------------------------------------------------

    def _assign(self) -> None:
        if self.state is not PoolState.OPEN:
            return
        # 1. Serve waiters from idle sandboxes, preferring one already at the right commit.
        for img in self._images.values():
            while img.waiters and img.idle:
                w = img.waiters.popleft()
                if w.future.done():
                    continue
                entry = next((e for e in img.idle if e.head == w.commit), img.idle[0])
                img.idle.remove(entry)
                entry.state = SandboxState.LEASED
                img.leased += 1
                w.future.set_result(entry)
            while img.waiters and img.waiters[0].future.done():
                img.waiters.popleft()
        # 2. Start sandboxes: first for waiting claims, then to keep warm pools at target.
        # At the cap, a claim waits for a delete in flight (a quarantined sandbox's, say)
        # to give back its room rather than evict an idle sandbox whose image's next
        # rollout would then start cold and evict another: the cascade.
        live = sum(i.live for i in self._images.values())
        freeing = sum(i.deleting for i in self._images.values())
        for name, img in self._images.items():
            pending = img.creating + (img.resetting if self.strategy.reuse else 0)
            for _ in range(max(0, len(img.waiters) - pending)):
                if live >= self._max_live:
                    if freeing > 0:
                        freeing -= 1
                        continue
                    if not self._evict_one(exclude=name):
                        break
                self._start_create(name, img, warm_up=False)  # a claim waits: no extra work
                live += 1
        now = time.monotonic()
        for name, img in self._images.items():
            if now < img.fill_after:
                continue
            want = self.strategy.deficit(target=img.target, idle=len(img.idle), creating=img.creating,
                                         leased=img.leased, resetting=img.resetting)
            for _ in range(want):
                if live >= self._max_live:
                    break
                self._start_create(name, img, warm_up=True)
                live += 1
        self._changed.set()

    def _evict_one(self, exclude: str) -> bool:
        # An idle sandbox of an image nobody waits for makes room for one that is needed:
        # first one beyond its image's target (not planned for), then any.
        for beyond in (True, False):
            for name, img in self._images.items():
                if name == exclude or not img.idle or img.waiters:
                    continue
                if beyond and len(img.idle) + img.leased + img.resetting <= img.target:
                    continue
                entry = img.idle.pop()
                entry.state = SandboxState.DELETED
                self.counters.evicted += 1
                self._start_delete(entry.sandbox, entry.image)
                return True
        return False

    def _start_create(self, name: str, img: _Image, *, warm_up: bool) -> None:
        img.creating += 1
        self._spawn(self._create(name, warm_up))

    def _to_idle(self, entry: _Entry) -> None:
        img = self._images[entry.image]
        if entry.state is SandboxState.LEASED:
            img.leased -= 1
        entry.state = SandboxState.IDLE
        img.idle.appendleft(entry)

    def _drop(self, entry: _Entry) -> None:
        img = self._images[entry.image]
        if entry.state is SandboxState.LEASED:
            img.leased -= 1
        entry.state = SandboxState.DELETED
        self._start_delete(entry.sandbox, entry.image)
        self._assign()

    # -- I/O, outside _assign ----------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _create(self, name: str, warm_up: bool) -> None:
        with Telemetry.span("sandpool.create", image=name, warm_up=warm_up):
            await self._create_traced(name, warm_up)

    async def _create_traced(self, name: str, warm_up: bool) -> None:
        img = self._images[name]
        try:
            async with self._limiter:
                sandbox = await asyncio.wait_for(self.backend.create(name), self.limits.create_timeout)
            try:
                # What the in-place reset and grading restore to, recorded while it is fresh;
                # warming includes git's index (off the claim path).
                await record_pristine(sandbox, refresh_index=warm_up,
                                      timeout=self.limits.create_timeout)
            except BaseException:
                await self._delete(sandbox)
                raise
        except TimeoutError:
            self._create_failed(name, errors.SandboxStartError(
                f"creating a sandbox of {name!r} took over {self.limits.create_timeout:.0f} s"))
            return
        except errors.SandpoolError as exc:
            self._create_failed(name, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a backend bug must not leak a `creating` slot
            self._create_failed(name, errors.SandboxStartError(
                f"creating a sandbox of {name!r} failed: {type(exc).__name__}: {exc}"))
            return
        img.creating -= 1
        img.fill_failures = 0
        self.counters.created += 1
        self.telemetry.created(ok=True)
        if self.state is not PoolState.OPEN:
            await self._delete(sandbox)
            return
        img.idle.append(_Entry(sandbox, name, head=sandbox.head))
        self._assign()

    def _create_failed(self, name: str, exc: errors.SandpoolError) -> None:
        img = self._images[name]
        img.creating -= 1
        self.counters.create_failures += 1
        self.telemetry.created(ok=False)
        if isinstance(exc, errors.InfraError):
            self._infra_error(exc.kind)
        # The failure belongs to a waiting claim, if any; otherwise it only shows in counters.
        while img.waiters:
            w = img.waiters.popleft()
            if not w.future.done():
                w.future.set_exception(exc)
                break
        if not isinstance(exc, errors.InfraError):  # bad image: every waiter gets the error
            while img.waiters:
                w = img.waiters.popleft()
                if not w.future.done():
                    w.future.set_exception(exc)
        if isinstance(exc, errors.InfraError):
            # Warm fills back off (0.5 s doubling to 30 s) and keep the target: one failure
            # must not shrink the warm pool for the rest of the run.
            img.fill_failures += 1
            delay = min(30.0, 0.5 * 2 ** (img.fill_failures - 1))
            img.fill_after = time.monotonic() + delay
            # The loop may run a timer up to its clock resolution early: wake a little late.
            asyncio.get_running_loop().call_later(delay + 0.01, self._assign)
        else:  # the image itself is unusable: stop filling it
            img.target = min(img.target, img.live)
        self._changed.set()

    async def _reset_checked(self, entry: _Entry, commit: str) -> tuple[list[str], str | None]:
        """Reset ``entry`` in place and verify it; return its problems (empty: pristine) and the
        commit it is at. Counts its time; raises nothing but a cancellation."""
        t0 = time.monotonic()
        quarantine = None
        with Telemetry.span("sandpool.reset", image=entry.image, sandbox_id=entry.sandbox.id) as span:
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

    def _quarantined(self, entry: _Entry, problems: list[str]) -> None:
        self.counters.quarantines += 1
        self.counters.quarantine_reasons = (self.counters.quarantine_reasons
                                            + [f"{entry.sandbox.id}: {'; '.join(problems)}"])[-20:]

    async def _reset(self, entry: _Entry, commit: str) -> None:
        img = self._images[entry.image]
        problems, head = await self._reset_checked(entry, commit)
        img.resetting -= 1
        if self.state is not PoolState.OPEN:
            await self._delete(entry.sandbox)
            return
        if problems:
            self._quarantined(entry, problems)
            entry.state = SandboxState.DELETED
            self._start_delete(entry.sandbox, entry.image, quarantined=True)
        else:
            self.counters.resets += 1
            entry.head = head
            entry.state = SandboxState.IDLE
            img.idle.appendleft(entry)
        self._assign()

    def _start_delete(self, sandbox: Sandbox, image: str, *, quarantined: bool = False) -> None:
        # Counted against max_live until the backend says it is gone.
        img = self._images.get(image)
        if img is not None:
            img.deleting += 1
            img.quarantined += quarantined
        self._spawn(self._delete(sandbox, img, quarantined=quarantined))

    async def _delete(self, sandbox: Sandbox, img: _Image | None = None, *, quarantined: bool = False) -> None:
        try:
            await self.backend.delete(sandbox)
        finally:
            self.counters.deleted += 1
            if img is not None:
                img.deleting -= 1
                img.quarantined -= quarantined
                self._assign()  # its room is free now

    def _infra_error(self, kind: str) -> None:
        self.counters.infra_error(kind)
        self.telemetry.infra_error(kind)

    # -- reporting ---------------------------------------------------------------------------

    def sizes(self) -> dict[str, dict[str, int]]:
        """Sandboxes by image and state (idle, leased, creating, resetting, quarantined)."""
        return {name: {"idle": len(i.idle), "leased": i.leased, "creating": i.creating,
                       "resetting": i.resetting, "quarantined": i.quarantined}
                for name, i in self._images.items()}

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
        failures = {o.value: 0 for o in Outcome}
        for r in results:
            failures[r.outcome.value] += 1
        return Report(
            workload=workload,
            ttfc=TTFCStats.from_samples(self._ttfc),
            sandboxes_created=self.counters.created,
            api_writes=self.backend.api_writes,
            resets=self.counters.resets,
            quarantines=self.counters.quarantines,
            failures=failures,
            infra_errors_by_kind=dict(self.counters.infra_errors),
            reward=RewardSummary.from_results(results),
            wall_time_s=wall_time_s,
            pool=self.counters.model_copy(deep=True),
            rejected=rejected or [],
            rollouts=results,
        )
