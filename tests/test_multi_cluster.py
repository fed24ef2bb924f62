"""Placement over several clusters and a cluster going away, on in-memory clusters (the same
behaviours run on two real control planes in tests/cluster/test_two_clusters.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from sandpool.core import Outcome, PoolLimits, SandboxPool, Task, Workload, errors, run_rollout
from sandpool.core.backends.multi import MultiClusterBackend

from .memory_backend import MemoryBackend


def task(i: int = 0, image: str = "img-a") -> Task:
    return Task(instance_id=f"t-{image}-{i}", repo="r", base_commit=f"{i:040x}", image=image,
                problem_statement="p")


def where(multi: MultiClusterBackend, members: dict[str, MemoryBackend], sandbox) -> str:
    return next(n for n, b in members.items() if b.live.get(sandbox.id) is sandbox)


async def test_round_robin_takes_the_clusters_in_turn():
    members = {"a": MemoryBackend(), "b": MemoryBackend(), "c": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="round-robin")
    placed = [where(multi, members, await multi.create("img")) for _ in range(6)]
    assert placed == ["a", "b", "c", "a", "b", "c"]


async def test_capacity_weighted_places_in_proportion_and_smoothly():
    members = {"big": MemoryBackend(), "small": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="capacity-weighted",
                                capacity={"big": 3, "small": 1})
    placed = [where(multi, members, await multi.create("img")) for _ in range(8)]
    assert Counter(placed) == {"big": 6, "small": 2}
    assert "big,big,big,big" not in ",".join(placed)  # interleaved, not in blocks


async def test_least_loaded_fills_the_cluster_with_room():
    members = {"a": MemoryBackend(), "b": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="least-loaded", capacity={"a": 2, "b": 1})
    boxes = [await multi.create("img") for _ in range(3)]
    assert Counter(where(multi, members, s) for s in boxes) == {"a": 2, "b": 1}
    for s in [s for s in boxes if where(multi, members, s) == "a"]:
        await multi.delete(s)
    assert where(multi, members, await multi.create("img")) == "a"  # a has room again


async def test_image_affinity_keeps_an_image_on_its_home_which_others_leaving_do_not_move():
    members = {n: MemoryBackend() for n in ("a", "b", "c", "d")}
    multi = MultiClusterBackend(members, placement="image-affinity")
    homes = {}
    for i in range(12):
        image = f"img-{i}"
        homes[image] = {where(multi, members, await multi.create(image)) for _ in range(3)}
        assert len(homes[image]) == 1  # all of an image's sandboxes on one cluster
    assert len(set().union(*homes.values())) > 1  # images spread over the clusters
    # Only the images homed on a cluster that goes away move (rendezvous hashing).
    lost = next(iter(homes["img-0"]))
    members[lost].create_error = errors.ApiError("cannot reach the Kubernetes API")
    for image, (home,) in homes.items():
        now = where(multi, members, await multi.create(image))
        assert now == home or home == lost


async def test_a_warm_target_is_split_by_the_policy():
    members = {"a": MemoryBackend(), "b": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="capacity-weighted", capacity={"a": 3, "b": 1})
    seen = {}
    for name, b in members.items():
        async def take(image, n, *, reuse, name=name):
            seen[name] = n
            return n
        b.set_warm_target = take  # type: ignore[method-assign]
    assert await multi.set_warm_target("img", 8, reuse=True) == 8
    assert seen == {"a": 6, "b": 2}


async def test_a_cluster_that_cannot_be_reached_is_marked_down_and_its_creation_fails_over():
    members = {"a": MemoryBackend(), "b": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="round-robin")
    await multi.create("img")  # on a
    members["b"].create_error = errors.ApiError("POST pods: cannot reach the Kubernetes API")
    sandbox = await multi.create("img")  # b's turn: unreachable, so placed on a
    assert where(multi, members, sandbox) == "a"
    a, b = multi.cluster_stats
    assert b.down is not None and "cannot reach" in b.down and b.failovers == 1
    assert a.created == 2 and a.down is None
    assert [where(multi, members, await multi.create("img")) for _ in range(4)] == ["a"] * 4


async def test_a_cluster_that_answers_an_error_is_not_marked_down():
    members = {"a": MemoryBackend(), "b": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="round-robin")
    members["a"].create_error = errors.ApiError("POST pods: HTTP 503", status=503)
    with pytest.raises(errors.ApiError):
        await multi.create("img")
    assert [c.down for c in multi.cluster_stats] == [None, None]


async def test_no_cluster_left_is_backend_unavailable_naming_each_reason():
    members = {"a": MemoryBackend(), "b": MemoryBackend()}
    multi = MultiClusterBackend(members)
    for b in members.values():
        b.create_error = errors.BackendUnavailable("TLS to the Kubernetes API failed")
    with pytest.raises(errors.BackendUnavailable, match="a: BackendUnavailable.*b: Backend"):
        await multi.create("img")


def test_bad_configuration_names_the_field():
    with pytest.raises(errors.ConfigError, match="placement"):
        MultiClusterBackend({"a": MemoryBackend()}, placement="random")
    with pytest.raises(errors.ConfigError, match="capacity"):
        MultiClusterBackend({"a": MemoryBackend()}, capacity={"z": 1})
    with pytest.raises(errors.ConfigError, match="clusters"):
        MultiClusterBackend({})


async def test_rollouts_on_a_cluster_that_goes_away_are_retried_on_the_other_and_counted():
    members = {"a": MemoryBackend(), "b": MemoryBackend()}
    multi = MultiClusterBackend(members, placement="round-robin")
    started = asyncio.Event()
    gone = asyncio.Event()

    async def episode(lease) -> float:
        await lease.exec("echo hi")
        if where(multi, members, lease.sandbox) == "b" and not gone.is_set():
            started.set()
            await gone.wait()
        await lease.exec("echo again")  # raises SandboxDied on the lost cluster
        return 1.0

    async def lose_b() -> None:
        await started.wait()
        members["b"].create_error = errors.ApiError("cannot reach the Kubernetes API")
        for sb in members["b"].live.values():
            sb.dead = True
        gone.set()

    async with SandboxPool(multi, "cold", PoolLimits(max_live=8)) as pool:
        results, _ = await asyncio.gather(
            asyncio.gather(*(run_rollout(pool, task(i), episode, retries=2) for i in range(8))),
            lose_b())
        report = pool.report(Workload(tasks=8, images=1, rollouts=8, concurrency=8,
                                      backend=multi.name, strategy="cold"), list(results), 0.0)
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 8
    assert report.unaccounted == 0
    retried = [r for r in results if r.attempts > 1]
    assert retried and report.infra_errors_by_kind.get("sandbox_died", 0) == len(retried)
    a, b = report.clusters
    assert b.down is not None and b.lost == len(retried) and a.down is None
    assert "cluster      b: created" in report.render_text() and "DOWN at" in report.render_text()
