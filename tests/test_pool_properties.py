"""Pool invariants over random claim / release / fail / cancel sequences (hypothesis), on the
in-memory backend. The same behaviours on bubblewrap are in test_local_backend.py and
test_runner.py.

After every step of a sequence:

* every entry is in the collection of its state, once, and counts match the backend: every
  sandbox the backend holds is one entry's, and every entry that is not being created or
  deleted holds a live sandbox of the backend;
* sandboxes, those being deleted too (and the backend's at its peak), never exceed ``max_live``;
* a sandbox is leased to at most one lease, and one that was quarantined, died or broke is
  never handed out again;
* warm hits never exceed claims.

At the end, once every lease is released and every claim has ended: nothing waits, nothing
is leased, created, reset or deleted, and after close the backend holds no sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sandpool.core import PoolLimits, SandboxPool, Task, errors
from sandpool.core.base import SandboxState
from sandpool.core.pool import Lease

from .memory_backend import MemoryBackend
from .waiting import until

IMAGES = ("img-a", "img-b", "img-c")
S = SandboxState


def _task(commit: int, image: int) -> Task:
    return Task(instance_id=f"t-{image}-{commit}", repo="r", base_commit=f"{commit:040x}",
                image=IMAGES[image], problem_statement="p")


#: Operations: (kind, i, j, flag). Claims come often, so pools fill and claims wait.
KINDS = ["claim"] * 6 + ["release"] * 5 + ["tick"] * 3 + ["dirty"] * 2 + [
    # dirty: lease i's reset will fail the check: quarantined
    "die",  # lease i's sandbox dies under it
    "break",  # an exec on lease i fails on infra: the lease is broken
    "kill",  # the backend's sandbox i dies, whatever its state (idle: found lost on claim)
    "reset",  # Lease.reset() on lease i: in place, or swapped
    "cancel",  # claim i in flight is cancelled (a few loop turns later)
    "fail_create",  # the backend's next creation fails
]
OPS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 2), st.booleans()),
               min_size=8, max_size=60)


def _quiet(task: asyncio.Task) -> asyncio.Task:
    """Mark ``task``'s exception retrieved when it ends (a failing example leaves claims that
    the pool's close then fails; their errors are not the finding)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


class Run:
    """One sequence against one pool: the leases held, the claims and resets in flight."""

    def __init__(self, pool: SandboxPool, backend: MemoryBackend, max_live: int) -> None:
        self.pool, self.backend, self.max_live = pool, backend, max_live
        self.held: list[Lease] = []
        self.claims: list[asyncio.Task[Lease]] = []
        self.resets: dict[Lease, asyncio.Task[None]] = {}
        self.releases: list[asyncio.Task[None]] = []
        self.tainted: set[str] = set()  # sandbox ids that must never be leased again
        self.leased_ok = 0  # claims that returned a lease, and swaps by Lease.reset

    def _lease(self, i: int) -> Lease | None:
        free = [lease for lease in self.held if lease not in self.resets]
        return free[i % len(free)] if free else None

    async def step(self, op: tuple) -> None:
        kind, i, j, flag = op
        if kind == "claim":  # one of two commits of image j
            self.claims.append(_quiet(asyncio.create_task(self.pool.acquire(_task(i % 2, j)))))
        elif kind == "cancel" and self.claims:
            claim = self.claims[i % len(self.claims)]
            for _ in range(j + 2 * flag):  # 0-4 loop turns: it may be assigned, not yet resumed
                await asyncio.sleep(0)
            claim.cancel()
        elif kind == "fail_create" and i == 0:  # rarer than the rest
            self.backend.fail_creates += 1
        elif kind == "kill" and self.backend.live:
            sb = self.backend.live[sorted(self.backend.live)[i % len(self.backend.live)]]
            sb.dead = True
            self.tainted.add(sb.id)
        elif kind == "tick":
            for _ in range(i + 1):
                await asyncio.sleep(0)
        elif (lease := self._lease(i)) is not None:
            if kind == "release":
                reusable = flag or j > 0  # mostly
                self.held.remove(lease)
                if not (reusable and self.pool.strategy.reuse and lease.broken is None
                        and lease.sandbox.alive() and not lease.sandbox.restore_fails):
                    self.tainted.add(lease.id)
                self.releases.append(asyncio.create_task(lease.release(reusable=reusable)))
            elif kind == "dirty":
                with contextlib.suppress(errors.InfraError):  # on a dead sandbox: infra, broken
                    await lease.write_file("calc.py", b"x")
                lease.sandbox.restore_fails = True
                self.tainted.add(lease.id)
            elif kind == "die":
                lease.sandbox.dead = True
                self.tainted.add(lease.id)
            elif kind == "break":
                lease.sandbox.fail_next_exec = errors.ExecTransportError("channel broke")
                with contextlib.suppress(errors.InfraError):
                    await lease.exec("true")
                assert lease.broken is not None
                self.tainted.add(lease.id)
            elif kind == "reset":
                if lease.sandbox.restore_fails or lease.broken or not lease.sandbox.alive():
                    self.tainted.add(lease.id)
                self.resets[lease] = _quiet(asyncio.create_task(self._reset(lease)))
        self.harvest()
        self.check()

    async def _reset(self, lease: Lease) -> None:
        before = lease.id
        await lease.reset()
        if lease.id != before:
            self.tainted.add(before)
            self.leased_ok += 1
            assert lease.id not in self.tainted

    def harvest(self) -> None:
        """Take the leases of claims that returned; forget claims and resets that ended."""
        for t in [t for t in self.claims if t.done()]:
            self.claims.remove(t)
            if not t.cancelled() and t.exception() is None:
                lease = t.result()
                assert lease.id not in self.tainted, f"{lease.id} was handed out again"
                self.held.append(lease)
                self.leased_ok += 1
            elif not t.cancelled():  # a creation failed for it (scripted), or a swap's
                assert isinstance(t.exception(), errors.SandboxStartError), t.exception()
        for lease, t in list(self.resets.items()):
            if t.done():
                del self.resets[lease]
                if t.exception() is not None:
                    assert isinstance(t.exception(), errors.SandboxStartError), t.exception()
                    assert lease.released
                    self.held.remove(lease)

    def check(self) -> None:
        entries = self.pool._entries
        seen: set[int] = set()
        for img in entries.images.values():
            for state in SandboxState:
                for e in img.entries(state):
                    assert e.state is state and e.image == img.image
                    assert id(e) not in seen, f"{e!r} is in two collections"
                    seen.add(id(e))
        assert entries.live <= self.max_live and self.backend.peak_held <= self.max_live
        holding = {e.sandbox.id for img in entries.images.values()
                   for s in (S.IDLE, S.LEASED, S.RESETTING) for e in img.entries(s)}
        deleting = {e.sandbox.id for img in entries.images.values() for e in img.entries(S.DELETED)}
        assert holding <= set(self.backend.live), "an entry holds a sandbox the backend deleted"
        assert set(self.backend.live) <= holding | deleting, "the backend holds a sandbox no entry has"
        ids = [lease.id for lease in self.held]
        assert len(ids) == len(set(ids)), "one sandbox leased twice"
        for lease in self.held:  # (one being reset may be between its old and new sandbox)
            assert lease in self.resets or lease.entry.state is S.LEASED and not lease.released
        c = self.pool.counters
        assert c.warm_hits <= c.claims
        r = repr(self.pool)
        assert f"leased={entries.count(S.LEASED)} " in r and f"waiting={entries.waiting} " in r

    async def finish(self) -> None:
        """Release everything, let every claim and reset end, and wait for the pool to settle."""
        async def end_claim(t: asyncio.Task[Lease]) -> None:
            with contextlib.suppress(asyncio.CancelledError, errors.SandboxStartError):
                lease = await t
                self.leased_ok += 1
                await lease.release()

        async def end_reset(lease: Lease, t: asyncio.Task[None]) -> None:
            with contextlib.suppress(errors.SandboxStartError):
                await t
            await lease.release()

        busy = set(self.resets)
        for lease in [lease for lease in self.held if lease not in busy]:
            await lease.release()
        self.held.clear()
        await asyncio.gather(*(end_reset(lease, t) for lease, t in self.resets.items()),
                             *(end_claim(t) for t in self.claims), *self.releases)
        entries = self.pool._entries
        await until(lambda: not entries.count(S.CREATING, S.RESETTING, S.DELETED, S.LEASED)
                    and not entries.waiting, "the pool to settle", timeout=10)  # in memory: µs
        self.check()
        c = self.pool.counters
        assert c.claims == self.leased_ok
        assert set(self.backend.live) == {e.sandbox.id for img in entries.images.values()
                                          for e in img.entries(S.IDLE)}


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=OPS, strategy=st.sampled_from(["cold", "warm", "reuse"]), max_live=st.integers(1, 4),
       warm=st.booleans())
async def test_pool_invariants_hold_over_any_claim_release_fail_cancel_sequence(
    ops, strategy, max_live, warm
):
    backend = MemoryBackend()
    limits = PoolLimits(max_live=max_live, create_rate=1e6, create_burst=1000, claim_timeout=600)
    async with asyncio.timeout(120):
        pool = SandboxPool(backend, strategy, limits)
        async with pool:
            if warm:
                await pool.prepare([_task(0, i) for i in range(len(IMAGES))], concurrency=max_live)
            run = Run(pool, backend, max_live)
            for op in ops:
                await run.step(op)
            await run.finish()
            c = pool.counters
            for name in ("claims", "warm_hits", "quarantines", "evicted", "lost", "create_failures"):
                event(f"{name} > 0: {getattr(c, name) > 0}")
        assert backend.live == {}
        assert pool._entries.live == 0 and "idle=0 leased=0 creating=0" in repr(pool)
