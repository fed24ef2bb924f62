"""A batch announced up front (``prepare(..., exact=True)``): warm pools a backend holds are
sized to the batch's claims and lowered as they are served. Pool logic on the in-memory
backend, made to hold its warm pool as agent-sandbox's does (the same on the kwok cluster:
tests/cluster/test_presessions.py)."""

from __future__ import annotations

from sandpool.core import SandboxPool, Task

from .memory_backend import MemoryBackend
from .waiting import until


def task(i: int, image: str) -> Task:
    return Task(instance_id=f"t-{image}-{i}", repo="r", base_commit="0" * 40, image=image,
                problem_statement="p")


class HeldWarm(MemoryBackend):
    """Holds each image's warm sandboxes itself, as a SandboxWarmPool does: the pool keeps
    none (``set_warm_target`` returns 0) and every claim is a ``create``."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: dict[str, list[int]] = {}

    async def set_warm_target(self, image: str, n: int, *, reuse: bool) -> int:
        self.targets.setdefault(image, []).append(n)
        return 0


async def test_a_held_warm_pool_is_sized_to_the_batch_and_lowered_per_claim():
    be = HeldWarm()
    tasks = [task(0, "a"), task(1, "a"), task(0, "b")]
    async with SandboxPool(be, "warm") as pool:
        # One lane per image, but image a gets 2 x 3 claims and b 3: each warm pool holds
        # its batch's claims from the start.
        await pool.prepare(tasks, concurrency=2, rollouts_per_task=3, exact=True)
        assert be.targets == {"a": [6], "b": [3]}
        for _ in range(2):
            async with pool.claim(tasks[0]):
                pass
        await until(lambda: be.targets["a"][-1] == 4, "a lowered to the claims to come")
        for _ in range(3):
            async with pool.claim(tasks[2]):
                pass
        await until(lambda: be.targets["b"] == [3, 2, 1, 0], "b lowered after each claim")
        # A claim past the announced ones still gets a sandbox (cold), and lowers nothing.
        async with pool.claim(tasks[2]) as lease:
            assert lease.sandbox.alive()
        assert be.targets["b"][-1] == 0 and pool.counters.claims == 6


async def test_without_exact_the_held_warm_pool_stands_at_the_split():
    be = HeldWarm()
    t = task(0, "a")
    async with SandboxPool(be, "warm") as pool:
        await pool.prepare([t], concurrency=1, rollouts_per_task=3)
        for _ in range(3):
            async with pool.claim(t):
                pass
    assert be.targets == {"a": [1]}  # set once, refilled by the backend after every claim


async def test_a_warm_pool_the_pool_keeps_itself_is_not_resized_by_a_batch():
    be = MemoryBackend()
    t = task(0, "a")
    async with SandboxPool(be, "warm") as pool:
        await pool.prepare([t], concurrency=1, rollouts_per_task=4, exact=True)
        assert len(be.live) == 1  # the split's one warm sandbox, not the batch's four
        async with pool.claim(t):
            pass
