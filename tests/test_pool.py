"""Pool logic on the scriptable in-memory backend (each behaviour also runs on bubblewrap in
test_local_backend.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

import sandpool.core as core
from sandpool.core import (
    Outcome,
    PoolClosed,
    PoolLimits,
    SandboxPool,
    Task,
    errors,
    get_strategy,
    run_rollout,
)

from .memory_backend import MemoryBackend
from .waiting import until


def task(i: int = 0, image: str = "img-a") -> Task:
    return Task(instance_id=f"t-{image}-{i}", repo="r", base_commit=f"{i:040x}", image=image,
                problem_statement="p")


def test_public_names_match_all():
    # Submodules become attributes once anything imports them: they are not exports.
    exported = {n for n in dir(core) if not n.startswith("_")
                and not isinstance(getattr(core, n), types.ModuleType)}
    assert exported == set(core.__all__)


def test_plan_splits_concurrency_by_demand():
    plan = get_strategy("reuse").plan({"a": 12, "b": 12, "c": 8}, 8)
    assert sum(plan.values()) == 8 and plan["a"] >= plan["c"] >= 1
    assert get_strategy("warm").plan({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 1}


def test_unknown_strategy_names_the_choices():
    with pytest.raises(errors.ConfigError, match="cold"):
        get_strategy("lukewarm")


async def test_warm_claim_is_a_hit_and_reuse_keeps_the_sandbox():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse") as pool:
        await pool.prepare([task(0)], concurrency=1)
        assert len(backend.live) == 1
        for i in range(3):
            async with pool.claim(task(i)) as lease:  # its release returns once reset
                await lease.exec("echo hi")
        assert pool.counters.created == 1
        assert pool.counters.resets == 3
        assert pool.counters.warm_hits == 3


async def test_cold_creates_per_rollout_and_deletes_after():
    backend = MemoryBackend()
    async with SandboxPool(backend, "cold") as pool:
        await pool.prepare([task(0)], concurrency=1)
        assert backend.live == {}
        for i in range(3):
            async with pool.claim(task(i)) as lease:
                await lease.exec("true")
        await until(lambda: not backend.live, "the background deletes")
        assert pool.counters.created == 3


async def test_live_cap_is_never_exceeded():
    backend = MemoryBackend(create_delay=0.01)
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        async with pool.claim(task(i, image=f"img-{i % 4}")) as lease:
            peak = max(peak, len(backend.live))
            await lease.exec("true")
            await asyncio.sleep(0.005)

    async with SandboxPool(backend, "warm", PoolLimits(max_live=3)) as pool:
        await asyncio.gather(*(one(i) for i in range(20)))
    assert peak <= 3


async def test_creation_rate_is_limited():
    backend = MemoryBackend()
    limits = PoolLimits(create_rate=20.0, create_burst=2, max_live=10)
    async with SandboxPool(backend, "cold", limits) as pool:
        leases = await asyncio.gather(*(pool.acquire(task(i)) for i in range(6)))
        for lease in leases:
            await pool.release(lease)
    t = backend.created_at
    # 2 at once (the burst), then 4 more at 20/s: at least ~0.15 s after the first.
    assert t[-1] - t[0] >= 0.15


async def test_cancelled_claim_leaks_no_slot():
    backend = MemoryBackend(create_delay=0.05)
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        waiter = asyncio.create_task(pool.acquire(task(0)))
        await until(lambda: backend.created_at, "the claim to start a creation")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await until(lambda: backend.live, "the creation to finish")
        # The one slot must not have leaked: this claim gets the sandbox the cancelled one made.
        lease = await asyncio.wait_for(pool.acquire(task(0)), 60.0)
        assert lease.sandbox.id == "mem-1"
        await pool.release(lease)


async def test_claim_timeout_is_an_infra_timeout():
    backend = MemoryBackend(create_delay=5)
    async with SandboxPool(backend, "cold") as pool:
        with pytest.raises(errors.InfraTimeout):
            await pool.acquire(task(0), timeout=0.05)
        assert pool.counters.infra_errors["infra_timeout"] == 1


async def test_start_failure_is_retried_then_completes():
    backend = MemoryBackend()
    backend.fail_creates = 1

    async def episode(lease):
        await lease.exec("true")
        return 1.0

    async with SandboxPool(backend, "cold") as pool:
        result = await run_rollout(pool, task(0), episode, retries=2)
    assert result.outcome is Outcome.COMPLETED and result.attempts == 2
    assert pool.counters.infra_errors == {"sandbox_start": 1}


async def test_infra_failure_is_never_reward_zero():
    backend = MemoryBackend()

    async def episode(lease):
        lease.sandbox.dead = True  # dies mid-rollout, every attempt
        await lease.exec("pytest")
        return 0.0

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, task(0), episode, retries=2)
        report = pool.report(core.Workload(tasks=1, images=1, rollouts=1, concurrency=1,
                                           backend="memory", strategy="reuse"), [result], 0.1)
    assert result.outcome is Outcome.INFRA_FAILED and result.reward is None and result.attempts == 3
    assert report.failures["infra_failed"] == 1 and report.infra_errors_by_kind["sandbox_died"] == 3
    assert report.reward.scored == 0 and report.reward.mean is None


async def test_task_error_is_task_failed():
    async def episode(lease):
        raise errors.TaskError("policy produced no action")

    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        result = await run_rollout(pool, task(0), episode)
    assert result.outcome is Outcome.TASK_FAILED and result.reward == 0.0 and result.attempts == 1


async def test_dirty_reset_is_quarantined_not_reused():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse") as pool:
        lease = await pool.acquire(task(0))
        sb = lease.sandbox
        await lease.write_file("calc.py", b"x")
        sb.restore_fails = True  # a reset that does not take
        await pool.release(lease)
        await until(lambda: sb.id not in backend.live, "the quarantined sandbox's delete")
        assert pool.counters.quarantines == 1
        assert "differs from the image" in pool.counters.quarantine_reasons[0]
        lease2 = await pool.acquire(task(0))
        assert lease2.sandbox.id != sb.id
        await pool.release(lease2)


async def test_a_claim_rejected_at_its_checkout_counts_neither_a_claim_nor_a_warm_hit():
    good, bad = task(1), task(2)
    backend = MemoryBackend(commits={good.base_commit})  # bad's base_commit is not in the image
    async with SandboxPool(backend, "reuse") as pool:
        await pool.prepare([good, bad], concurrency=1)
        with pytest.raises(errors.InputError, match="is not a commit of image"):
            await pool.acquire(bad)  # served by the warm sandbox, then rejected
        assert (pool.counters.claims, pool.counters.warm_hits) == (0, 0)
        await pool.wait_warm()  # the rejected claim's sandbox was deleted; its refill
        async with pool.claim(good) as lease:
            await lease.exec("true")
        assert (pool.counters.claims, pool.counters.warm_hits) == (1, 1)


async def test_unknown_image_fails_the_claim_with_input_error():
    async with SandboxPool(MemoryBackend(images={"img-a"}), "warm") as pool:
        with pytest.raises(errors.ImageNotFound):
            await pool.acquire(task(0, image="nope"))


async def test_use_after_close_is_precise():
    pool = SandboxPool(MemoryBackend(), "warm")
    async with pool:
        lease = await pool.acquire(task(0))
    with pytest.raises(PoolClosed):
        await lease.exec("true")
    with pytest.raises(PoolClosed):
        await pool.acquire(task(0))
    with pytest.raises(PoolClosed):
        await pool.open()


async def test_close_deletes_leased_and_idle_sandboxes():
    backend = MemoryBackend()
    async with SandboxPool(backend, "warm") as pool:
        await pool.prepare([task(0), task(1, "img-b")], concurrency=4)
        await pool.acquire(task(0))
        assert backend.live
    assert backend.live == {}


async def test_fresh_sandbox_at_the_task_commit_needs_no_checkout():
    backend = MemoryBackend(head=task(2).base_commit)  # as for a per-task image
    async with SandboxPool(backend, "warm") as pool:
        await pool.prepare([task(2), task(3)], concurrency=2)
        lease = await pool.acquire(task(2))
        await lease.exec("echo first")
        assert not any("checkout" in c for c in lease.sandbox.commands)
        assert lease.sandbox.commands[-1] == "echo first"
        other = await pool.acquire(task(3))  # at another commit: checked out first
        assert any("checkout" in c for c in other.sandbox.commands)
        await pool.release(lease)
        await pool.release(other)


async def test_a_creation_failing_with_an_unexpected_error_leaks_no_creating_slot():
    backend = MemoryBackend()
    backend.create_error = RuntimeError("backend bug")
    async with SandboxPool(backend, "warm") as pool:
        # prepare() waits for warm fills in flight: a leaked `creating` count hangs it forever.
        await asyncio.wait_for(pool.prepare([task(0)], concurrency=2), 60.0)
        assert pool.counters.create_failures == 1
        assert pool.counters.infra_errors == {"sandbox_start": 1}
        async with pool.claim(task(0)) as lease:
            assert (await lease.exec("true")).ok


async def test_one_failed_warm_fill_does_not_lower_the_warm_target():
    backend = MemoryBackend()
    backend.fail_creates = 1
    async with SandboxPool(backend, "warm") as pool:
        await pool.prepare([task(0)], concurrency=3, rollouts_per_task=3)
        # The failed fill is retried after a back-off: the warm pool gets back to 3.
        await until(lambda: len(backend.live) == 3, "the warm pool to refill to its target")
        async with pool.claim(task(0)) as lease:
            await lease.exec("true")
        await until(lambda: len(backend.live) == 3, "the warm pool to refill after a claim")


async def test_sandboxes_being_deleted_count_against_max_live():
    backend = MemoryBackend()
    backend.delete_gate = asyncio.Event()
    async with SandboxPool(backend, "cold", PoolLimits(max_live=2)) as pool:
        for i in range(2):
            async with pool.claim(task(i)) as lease:
                await lease.exec("true")
        # Two deletes hang in the backend: a third claim must wait for one of them.
        third = asyncio.create_task(pool.acquire(task(2)))
        await until(lambda: backend.deleting == 2, "both deletes to be in flight")
        assert not third.done() and len(backend.created_at) == 2
        backend.delete_gate.set()
        lease = await asyncio.wait_for(third, 60.0)
        await pool.release(lease)
    assert backend.peak_held <= 2


async def test_a_quarantined_sandboxs_replacement_evicts_no_other_images_sandbox():
    # max_live equals the number of images: the quarantined sandbox holds its room until its
    # delete returns. Its image's next claim waits for that room; it does not evict the other
    # image's idle sandbox (whose next rollout would then start cold and evict in turn).
    backend = MemoryBackend()
    backend.delete_gate = asyncio.Event()
    a, b = task(0, image="img-a"), task(0, image="img-b")
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
        try:
            await pool.prepare([a, b], concurrency=2, rollouts_per_task=4)
            kept = next(sid for sid, sb in backend.live.items() if sb.image == "img-b")
            lease = await pool.acquire(a)
            lease.sandbox.restore_fails = True
            await pool.release(lease)
            assert pool.counters.quarantines == 1 and backend.deleting == 1
            claim = asyncio.create_task(pool.acquire(a))
            await until(lambda: "waiting=1" in repr(pool) or claim.done(), "the claim")
            assert pool.counters.evicted == 0 and kept in backend.live
            backend.delete_gate.set()  # the quarantined sandbox's delete returns: its room
            lease = await asyncio.wait_for(claim, 60)
            assert lease.sandbox.id != kept and pool.counters.created == 3
            await pool.release(lease)
            lease = await pool.acquire(b)
            assert lease.sandbox.id == kept and pool.counters.evicted == 0
            await pool.release(lease)
        finally:
            backend.delete_gate.set()


async def test_a_warm_fill_at_the_cap_evicts_no_other_images_warm_sandbox():
    # With warm, a leased sandbox is deleted at its release: it does not count toward its
    # image's warm target. An image with one leased and one idle sandbox is at its target of
    # one, so another image's fill at the cap waits for room instead of evicting that idle
    # sandbox (which its image would refill at once, evicting in turn: a cascade).
    backend = MemoryBackend()
    a, b = task(0, image="img-a"), task(0, image="img-b")
    async with SandboxPool(backend, "warm", PoolLimits(max_live=4)) as pool:
        await pool.prepare([a, b], concurrency=2)
        held = [await pool.acquire(a), await pool.acquire(b)]
        await pool.wait_warm(60)
        assert pool.sizes()["img-a"]["idle"] == pool.sizes()["img-b"]["idle"] == 1
        kept = next(sid for sid, sb in backend.live.items()
                    if sb.image == "img-a" and sid != held[0].sandbox.id)
        held.append(await pool.acquire(b))  # b's idle sandbox: b's fill finds the cap
        await pool.wait_warm(60)
        assert pool.counters.evicted == 0 and kept in backend.live
        for lease in held:
            await pool.release(lease)
        hits = pool.counters.warm_hits
        async with pool.claim(a) as lease:
            assert lease.sandbox.id == kept and pool.counters.warm_hits == hits + 1


async def test_reuse_starts_a_quarantined_sandboxs_replacement_before_the_next_claim():
    # The default cap leaves headroom: the replacement is a warm fill started as the
    # quarantine is decided, while the old sandbox's delete is still in flight, so the
    # image's next claim is a warm hit.
    backend = MemoryBackend()
    backend.delete_gate = asyncio.Event()
    a, b = task(0, image="img-a"), task(0, image="img-b")
    async with SandboxPool(backend, "reuse") as pool:
        try:
            await pool.prepare([a, b], concurrency=2, rollouts_per_task=4)
            lease = await pool.acquire(a)
            lease.sandbox.restore_fails = True
            await pool.release(lease)
            assert pool.counters.quarantines == 1 and backend.deleting == 1
            assert len(backend.created_at) == 3 and pool.counters.evicted == 0
            hits = pool.counters.warm_hits
            lease = await pool.acquire(a)
            assert pool.counters.warm_hits == hits + 1
            await pool.release(lease)
        finally:
            backend.delete_gate.set()


async def test_prefetch_warms_the_next_batch_within_max_live_and_lets_the_last_one_go():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=4)) as pool:
        a = [task(0, "img-a"), task(1, "img-a")]
        await pool.prefetch(a, rollouts_per_task=1, concurrency=2)
        await until(lambda: pool.sizes().get("img-a", {}).get("idle") == 2, "a warm")
        leases = [await pool.acquire(t) for t in a]
        assert pool.counters.warm_hits == 2  # the prefetched batch is claimed warm
        b = [task(2, "img-b")]
        await pool.prefetch(b, rollouts_per_task=2)  # while batch a runs
        await until(lambda: pool.sizes().get("img-b", {}).get("idle") == 2, "b warm")
        for lease in leases:
            await pool.release(lease)
        c = [task(3, "img-c")]
        await pool.prefetch(c, rollouts_per_task=2)  # room comes from a's idle sandboxes
        await until(lambda: pool.sizes().get("img-c", {}).get("idle") == 2, "c warm")
        assert pool.sizes()["img-b"]["idle"] == 2  # the batch not yet run keeps its warm pool
        assert backend.peak_held <= 4 and pool.counters.evicted == 2
        async with pool.claim(b[0]) as lease:
            await lease.exec("true")
        assert pool.counters.warm_hits == 3


async def test_a_prefetch_at_the_cap_creates_only_once_the_evicted_sandboxes_are_deleted():
    # A sandbox being deleted holds its room: the next batch's sandboxes start as the last
    # batch's deletes return, never beside them.
    backend = MemoryBackend()
    backend.delete_gate = asyncio.Event()
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
        try:
            await pool.prefetch([task(0, "img-a")], rollouts_per_task=2)
            await until(lambda: pool.sizes().get("img-a", {}).get("idle") == 2, "a warm")
            await pool.prefetch([task(1, "img-b")], rollouts_per_task=2)
            await until(lambda: backend.deleting == 2, "a's sandboxes evicted")
            assert len(backend.created_at) == 2 and pool._entries.live == 2
            backend.delete_gate.set()
            await until(lambda: pool.sizes().get("img-b", {}).get("idle") == 2, "b warm")
            assert backend.peak_held <= 2 and pool.counters.evicted == 2
        finally:
            backend.delete_gate.set()
