"""The pool's state: every sandbox is an entry in one per-state collection of its image.

Each :class:`Entry` sits in exactly one collection of its image, named by its
:class:`~sandpool.core.base.SandboxState`: ``CREATING`` (its backend create is in flight),
``IDLE`` (ordered: a claim takes the front), ``LEASED``, ``RESETTING`` (an in-place reset
after release) or ``DELETED`` (its delete is in flight: it holds its room under ``max_live``
until the backend's delete returns, then it leaves the pool). Every count the pool acts on
or reports is the size of a collection, read when needed, never a number kept beside the
entries (httpcore's connection pool asks its connections the same way).

:meth:`Entries.move` is the one place an entry changes state, and it refuses a move the
lifecycle does not allow. :meth:`Entries.assign` is the one place decisions are made: it
hands idle sandboxes to waiting claims and returns what to create and what to evict. All of
it is synchronous and runs on the pool's event loop, so nothing else runs between a read of
the state and the change made from it: the loop is the lock. The I/O decided here (create,
reset, delete) runs in the pool's tasks and reports back through ``move``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from sandpool.core import errors
from sandpool.core.base import Sandbox, SandboxState
from sandpool.core.strategies import Strategy

__all__ = ["Entries", "Entry", "ImageEntries", "Waiter", "Work"]

S = SandboxState

#: The lifecycle: from a state (``None``: not in the pool) to the states it may move to.
_MOVES: dict[SandboxState | None, frozenset[SandboxState | None]] = {
    None: frozenset({S.CREATING}),
    S.CREATING: frozenset({S.IDLE, S.DELETED, None}),  # created; created after close; failed
    S.IDLE: frozenset({S.LEASED, S.DELETED}),  # claimed; evicted, found dead or pool closed
    S.LEASED: frozenset({S.IDLE, S.RESETTING, S.DELETED}),  # handed back unused; released
    S.RESETTING: frozenset({S.IDLE, S.DELETED}),  # verified pristine; quarantined or closed
    S.DELETED: frozenset({None}),  # the backend's delete returned
}


@dataclass(eq=False)
class Entry:
    """One sandbox of the pool (or the creation of one).

    Attributes:
        image: Its image.
        sandbox: The sandbox; ``None`` while ``CREATING``.
        state: Which collection of its image it is in (change it only with ``Entries.move``).
        head: The commit its workdir is known to be at, pristine; ``None`` when unknown.
        quarantined: It failed its reset's check; set before its move to ``DELETED``.
    """

    image: str
    sandbox: Sandbox | None = None
    state: SandboxState | None = None
    head: str | None = None
    quarantined: bool = False

    def __repr__(self) -> str:
        sid = self.sandbox.id if self.sandbox is not None else "-"
        state = self.state.value if self.state is not None else "gone"
        return f"<Entry {sid} {self.image} {state}{' quarantined' if self.quarantined else ''}>"


@dataclass(eq=False)
class Waiter:
    """A claim waiting for a sandbox of ``image``, preferably one at ``commit``."""

    image: str
    commit: str
    future: asyncio.Future[Entry]


@dataclass
class Work:
    """What :meth:`Entries.assign` decided; the pool runs it.

    Attributes:
        create: New ``CREATING`` entries, each with whether it is a warm fill.
        evict: Idle entries moved to ``DELETED`` to make room for another image.
    """

    create: list[tuple[Entry, bool]] = field(default_factory=list)
    evict: list[Entry] = field(default_factory=list)


class ImageEntries:
    """The entries and the waiting claims of one image.

    Attributes:
        image: The image.
        target: Its warm pool's size (slots from the strategy's plan).
        waiters: Claims waiting, first come first served.
        fill_failures: Consecutive failed warm fills (they back off; the target stays).
        fill_after: Monotonic time before which no warm fill starts.
    """

    def __init__(self, image: str) -> None:
        self.image = image
        self.target = 0
        self.waiters: deque[Waiter] = deque()
        self.fill_failures = 0
        self.fill_after = 0.0
        self._by_state: dict[SandboxState, deque[Entry]] = {s: deque() for s in SandboxState}

    def __repr__(self) -> str:
        counts = " ".join(f"{s.value}={len(q)}" for s, q in self._by_state.items())
        return (f"<ImageEntries {self.image} {counts} waiting={len(self.waiters)} "
                f"target={self.target}>")

    def count(self, *states: SandboxState) -> int:
        """Entries in any of ``states``."""
        return sum(len(self._by_state[s]) for s in states)

    def entries(self, state: SandboxState) -> tuple[Entry, ...]:
        """The entries in ``state``, in order (for ``IDLE``: the next claim's first)."""
        return tuple(self._by_state[state])

    @property
    def live(self) -> int:
        """Entries holding (or about to hold) a sandbox's resources: all of them."""
        return sum(len(q) for q in self._by_state.values())

    def sizes(self) -> dict[str, int]:
        """Counts by state, for reports and the ``sandpool_sandboxes`` gauge. Safe to call from
        another thread: it only takes lengths and copies (atomic under the GIL)."""
        deleting = list(self._by_state[S.DELETED])
        return {"idle": len(self._by_state[S.IDLE]), "leased": len(self._by_state[S.LEASED]),
                "creating": len(self._by_state[S.CREATING]),
                "resetting": len(self._by_state[S.RESETTING]),
                "quarantined": sum(e.quarantined for e in deleting)}


class Entries:
    """Every entry of a pool, by image, and the one place they change (see the module).

    Args:
        strategy: Decides warm targets and whether waiting claims count resets in flight.
        max_live: Cap on entries alive at once (every state counts).
    """

    def __init__(self, strategy: Strategy, max_live: int) -> None:
        self.strategy = strategy
        self.max_live = max_live
        self.images: dict[str, ImageEntries] = {}

    def __repr__(self) -> str:
        counts = " ".join(f"{s.value}={self.count(s)}" for s in SandboxState)
        return f"<Entries {counts} waiting={self.waiting} max_live={self.max_live}>"

    def image(self, name: str) -> ImageEntries:
        """The entries of image ``name`` (an empty set the first time)."""
        if name not in self.images:
            self.images[name] = ImageEntries(name)
        return self.images[name]

    def count(self, *states: SandboxState) -> int:
        """Entries in any of ``states``, over every image."""
        return sum(img.count(*states) for img in self.images.values())

    @property
    def live(self) -> int:
        """Entries over every image, whatever their state."""
        return sum(img.live for img in self.images.values())

    @property
    def waiting(self) -> int:
        """Claims waiting, over every image."""
        return sum(len(img.waiters) for img in self.images.values())

    # -- the one place an entry changes state ----------------------------------------------

    def move(self, entry: Entry, to: SandboxState | None, *, front: bool = False) -> None:
        """Move ``entry`` to the collection of state ``to`` (``None``: out of the pool).

        ``front`` puts it first in line (an idle sandbox just reset or handed back).

        Raises:
            RuntimeError: The lifecycle does not allow this move (a pool bug, never input).
        """
        if to not in _MOVES[entry.state]:
            raise RuntimeError(f"pool bug: {entry!r} cannot move to {to}")
        img = self.image(entry.image)
        if entry.state is not None:
            img._by_state[entry.state].remove(entry)
        entry.state = to
        if to is not None:
            (img._by_state[to].appendleft if front else img._by_state[to].append)(entry)

    # -- transitions the pool's I/O reports --------------------------------------------------

    def created(self, entry: Entry, sandbox: Sandbox) -> None:
        """A creation returned ``sandbox``: it goes idle, last in line."""
        entry.sandbox, entry.head = sandbox, sandbox.head
        self.image(entry.image).fill_failures = 0
        self.move(entry, S.IDLE)

    def creation_failed(self, entry: Entry, exc: errors.SandpoolError, now: float) -> float | None:
        """A creation failed with ``exc``: the entry leaves, and a waiting claim gets ``exc``.

        An infra failure goes to the first waiting claim and backs warm fills off (0.5 s
        doubling to 30 s) without lowering the target: one failure must not shrink the warm
        pool for the rest of the run. Any other failure (the image is unusable) goes to every
        waiting claim and stops filling the image.

        Returns:
            Seconds until warm fills of the image may start again, or ``None``.
        """
        img = self.image(entry.image)
        self.move(entry, None)
        infra = isinstance(exc, errors.InfraError)
        while img.waiters:
            w = img.waiters.popleft()
            if not w.future.done():
                w.future.set_exception(exc)
                if infra:
                    break
        if not infra:
            img.target = min(img.target, img.live)
            return None
        img.fill_failures += 1
        delay = min(30.0, 0.5 * 2 ** (img.fill_failures - 1))
        img.fill_after = now + delay
        return delay

    def wait(self, image: str, commit: str, future: asyncio.Future[Entry]) -> Waiter:
        """Queue a claim for a sandbox of ``image``; :meth:`assign` sets ``future``."""
        waiter = Waiter(image, commit, future)
        self.image(image).waiters.append(waiter)
        return waiter

    def give_up(self, waiter: Waiter) -> None:
        """Remove a claim that stopped waiting (cancelled, timed out, failed). A sandbox
        assigned to it in the meantime goes back to idle, first in line: no slot leaks."""
        img = self.image(waiter.image)
        if waiter in img.waiters:
            img.waiters.remove(waiter)
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            entry = fut.result()
            if entry.state is S.LEASED:
                self.move(entry, S.IDLE, front=True)
        elif not fut.done():
            fut.cancel()

    def close(self, exc: BaseException) -> None:
        """Fail every waiting claim with ``exc`` (the pool is closing)."""
        for img in self.images.values():
            while img.waiters:
                w = img.waiters.popleft()
                if not w.future.done():
                    w.future.set_exception(exc)

    # -- the one place decisions are made ----------------------------------------------------

    def assign(self, now: float) -> Work:
        """Serve waiting claims from idle sandboxes, then decide creations and evictions.

        1. A waiting claim gets an idle sandbox of its image, one already at its commit if
           there is one, else the first in line.
        2. Claims still waiting get creations (beyond creations, and with reuse resets,
           already in flight for the image). At ``max_live`` a claim waits for a delete in
           flight to give back its room rather than evict an idle sandbox whose image's next
           rollout would then start cold and evict another (the cascade); with no delete in
           flight it evicts an idle sandbox of an image nobody waits for, and creates once
           that delete has returned (a sandbox being deleted holds its room: the pool never
           holds more than ``max_live``).
        3. Warm pools below their target (the strategy's deficit) get creations, up to
           ``max_live`` (at the cap, waiting for deletes in flight, or evicting only idle
           sandboxes beyond their image's target and waiting for those deletes), unless the
           image is backing off after a failed fill.

        Args:
            now: Monotonic time, for the fill back-off.

        Returns:
            The :class:`Work` to start.
        """
        work = Work()
        for img in self.images.values():
            while img.waiters and img.count(S.IDLE):
                w = img.waiters.popleft()
                if w.future.done():
                    continue
                idle = img._by_state[S.IDLE]
                entry = next((e for e in idle if e.head == w.commit), idle[0])
                self.move(entry, S.LEASED)
                w.future.set_result(entry)
            while img.waiters and img.waiters[0].future.done():
                img.waiters.popleft()
        live = self.live
        freeing = self.count(S.DELETED)
        for name, img in list(self.images.items()):
            pending = img.count(S.CREATING) + (img.count(S.RESETTING) if self.strategy.reuse else 0)
            for _ in range(max(0, len(img.waiters) - pending)):
                if live >= self.max_live:
                    if freeing > 0:
                        freeing -= 1
                        continue
                    evicted = self._evict_one(exclude=name)
                    if evicted is None:
                        break
                    work.evict.append(evicted)
                    continue  # its room is free when its delete returns; assign runs then
                work.create.append((self._new(name), False))
                live += 1
        for name, img in list(self.images.items()):
            if now < img.fill_after:
                continue
            want = self.strategy.deficit(target=img.target, idle=img.count(S.IDLE),
                                         creating=img.count(S.CREATING), leased=img.count(S.LEASED),
                                         resetting=img.count(S.RESETTING))
            for _ in range(want):
                if live >= self.max_live:
                    if freeing > 0:  # room a delete in flight gives back (claims took theirs)
                        freeing -= 1
                        continue
                    # Room from an idle sandbox no plan wants (its image is past its target,
                    # e.g. the batch before a prefetch), never from one that is planned for.
                    evicted = self._evict_one(exclude=name, planned_too=False)
                    if evicted is None:
                        break
                    work.evict.append(evicted)
                    continue  # as for a claim: the creation waits for the delete's return
                work.create.append((self._new(name), True))
                live += 1
        return work

    def _new(self, image: str) -> Entry:
        entry = Entry(image)
        self.move(entry, S.CREATING)
        return entry

    def _evict_one(self, exclude: str, planned_too: bool = True) -> Entry | None:
        # An idle sandbox of an image nobody waits for makes room for one that is needed:
        # first one beyond its image's target (not planned for), then any.
        for beyond in (True, False) if planned_too else (True,):
            for name, img in self.images.items():
                if name == exclude or not img.count(S.IDLE) or img.waiters:
                    continue
                if beyond and not self._beyond_target(img):
                    continue
                entry = img._by_state[S.IDLE][-1]
                self.move(entry, S.DELETED)
                return entry
        return None

    def _beyond_target(self, img: ImageEntries) -> bool:
        """Whether ``img`` holds more sandboxes than its target, counted as its strategy counts
        them toward it (a leased sandbox counts for ``reuse``, which gets it back; not for
        ``warm``, which deletes it). Creations in flight are not counted: they are not idle."""
        # The deficit toward one more than the target is 0 exactly when the target is exceeded.
        return self.strategy.deficit(target=img.target + 1, idle=img.count(S.IDLE), creating=0,
                                     leased=img.count(S.LEASED), resetting=img.count(S.RESETTING)) == 0
