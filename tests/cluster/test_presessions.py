"""Agent sessions opened on warm-pool pods before they are claimed, on the local cluster."""

from __future__ import annotations

import pytest

from sandpool.core import SandboxPool
from sandpool.core.reset import pristine_record

from tests.waiting import until
from test_kubernetes_backend import backend, custom, make_task, pods_of, repo  # noqa: F401 - fixture

pytestmark = pytest.mark.cluster


async def test_a_claim_adopts_the_session_and_record_made_on_its_warm_pod(cluster, namespace,
                                                                           repo):
    path, first, _ = repo
    be = backend(cluster, namespace, path, presessions=3)
    task = make_task("sandpool.test/calc:1", first)
    try:
        async with SandboxPool(be, "warm") as pool:
            await pool.prepare([task], concurrency=3, rollouts_per_task=3)
            # Three warm pods, three sessions: opened while nobody has claimed, and before
            # prepare returns (warm means exec-ready).
            pre = be._presessions
            assert len(pre) == 3 and all(t.done() for t in pre.pending.values())
            opened = {name: t.result() for name, t in pre.pending.items()}
            assert all(s is not None and s.session.alive for s in opened.values())
            # ...and each pod's pristine state recorded through it, before any claim.
            assert all(s.recorded is not None for s in opened.values())
            seen = set()
            for i in range(3):
                async with pool.claim(task) as lease:
                    sb = lease.sandbox
                    assert sb.channel == "agent" and sb.pod not in seen
                    seen.add(sb.pod)
                    if i == 0:  # bound to one of the three: it adopted that pod's session
                        assert sb._session is opened[sb.pod].session
                        assert be.presessions_adopted == 1
                    if sb.pod in opened:  # a warm pod's: its record came with it
                        assert sb.recorded and pristine_record(sb) is not None
                    res = await lease.exec("git rev-parse HEAD; pwd")
                    assert res.text.split() == [first, "/testbed"]
                    await lease.write_file("x.txt", b"y")
                    assert await lease.read_file("x.txt") == b"y"
            assert len(pre) <= 3  # the warm pool's refills get sessions too, within the cap
        # Closing the pool closes the sessions nobody adopted.
        assert len(pre) == 0 and not pre.closing
    finally:
        await be.aclose()


async def test_a_batch_announced_up_front_is_claimed_warm_and_exec_ready(cluster, namespace,
                                                                         repo):
    path, first, _ = repo
    be = backend(cluster, namespace, path, presessions=1)
    task = make_task("sandpool.test/calc:1", first)
    try:
        async with SandboxPool(be, "warm") as pool:
            # One lane, three claims announced: the SandboxWarmPool holds all three, each
            # pod's session open and its state recorded before prepare returns.
            await pool.prepare([task], concurrency=1, rollouts_per_task=3, exact=True)
            (wp,) = custom(cluster, namespace, "sandboxwarmpools", be.run_id)
            assert wp["spec"]["replicas"] == 3 and wp["status"]["readyReplicas"] == 3
            pre = be._presessions
            assert len(pre) == 3 and all(t.done() for t in pre.pending.values())
            warm = {p.metadata.name for p in pods_of(cluster, namespace, be.run_id)}
            for i in range(3):
                async with pool.claim(task) as lease:
                    assert lease.sandbox.pod in warm and lease.sandbox.recorded
                    assert (await lease.exec("git rev-parse HEAD")).text.strip() == first
            assert be.presessions_adopted == 3

            def replicas() -> int:
                return custom(cluster, namespace, "sandboxwarmpools", be.run_id)[0]["spec"]["replicas"]

            # Lowered after each claim: nothing refilled that no claim of the batch takes.
            await until(lambda: replicas() == 0, "the warm pool lowered to the claims to come")
    finally:
        await be.aclose()
