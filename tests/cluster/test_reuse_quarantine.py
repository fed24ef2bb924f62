"""A quarantined sandbox on the local cluster: its replacement neither evicts another image's
sandbox nor waits for the next claim to be started."""

from __future__ import annotations

import pytest

from sandpool.core import PoolLimits, SandboxPool

from test_kubernetes_backend import backend, make_task, repo  # noqa: F401 - fixture

pytestmark = pytest.mark.cluster

# Root in a kwok pod is root on the node: a mount in the pod's /tmp is something the in-place
# reset cannot undo (its scratch cleanup cannot remove a mount point), so the sandbox is
# quarantined, as one a policy broke would be.
BREAK = "mkdir -p /tmp/held && mount -t tmpfs none /tmp/held"


async def _quarantine(pool: SandboxPool, task) -> str:
    async with pool.claim(task) as lease:
        res = await lease.exec(BREAK)
        assert res.ok, res.err_text
        broken = lease.id
    assert pool.counters.quarantines == 1, pool.counters.quarantine_reasons
    assert "scratch space not empty" in pool.counters.quarantine_reasons[0]
    return broken


async def test_a_quarantined_pod_sandboxs_replacement_evicts_no_other_images_sandbox(
        cluster, namespace, repo):
    path, _, head = repo
    be = backend(cluster, namespace, path, sandbox_objects=True)
    a, b = make_task("sandpool.test/calc-a:1", head), make_task("sandpool.test/calc-b:1", head)
    try:
        # One sandbox per image and no room beyond: the quarantined one's delete is in flight
        # when the image's next claim asks.
        async with SandboxPool(be, "reuse", PoolLimits(max_live=2)) as pool:
            await pool.prepare([a, b], concurrency=2, rollouts_per_task=2)
            async with pool.claim(b) as lease:
                kept = lease.id
            broken = await _quarantine(pool, a)
            async with pool.claim(a) as lease:
                assert lease.id not in (broken, kept)
                assert (await lease.exec("ls -A /tmp")).text == ""
            async with pool.claim(b) as lease:
                assert lease.id == kept
            assert pool.counters.evicted == 0 and pool.counters.created == 3
    finally:
        await be.aclose()


async def test_reuse_starts_a_quarantined_pod_sandboxs_replacement_before_the_next_claim(
        cluster, namespace, repo):
    path, _, head = repo
    be = backend(cluster, namespace, path, sandbox_objects=True)
    a, b = make_task("sandpool.test/calc-a:1", head), make_task("sandpool.test/calc-b:1", head)
    try:
        async with SandboxPool(be, "reuse") as pool:  # the default cap: headroom for it
            await pool.prepare([a, b], concurrency=2, rollouts_per_task=2)
            await _quarantine(pool, a)
            # Decided with the quarantine, before any claim asks: a warm fill is under way.
            assert pool.sizes()["sandpool.test/calc-a:1"]["creating"] == 1
            hits = pool.counters.warm_hits
            await pool.wait_warm()
            async with pool.claim(a) as lease:
                assert (await lease.exec("ls -A /tmp")).text == ""
            assert pool.counters.warm_hits == hits + 1 and pool.counters.evicted == 0
    finally:
        await be.aclose()
