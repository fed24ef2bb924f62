"""``Lease.reset()``: a pristine sandbox under the same lease, reset in place or swapped.

Pool logic on the in-memory backend, then the same on real bubblewrap sandboxes (a planted
change gone; a sandbox killed from the host swapped) and on a real OCI image (an edit outside
the repo fails the reset's check: quarantined and swapped).
"""

from __future__ import annotations

import pytest

from sandpool.core import PoolLimits, SandboxPool, Task, errors
from sandpool.core.backends.local import LocalBackend

from .memory_backend import MemoryBackend
from .waiting import until


def _task(i: int = 0) -> Task:
    return Task(instance_id=f"t-{i}", repo="r", base_commit=f"{i:040x}", image="img-a",
                problem_statement="p")


async def test_a_lease_reset_in_place_keeps_its_sandbox_and_counts_a_reset():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse") as pool:
        lease = await pool.acquire(_task(1))
        sb = lease.sandbox
        await lease.write_file("calc.py", b"x")
        assert sb.dirty
        await lease.reset()
        assert lease.sandbox is sb and not sb.dirty and sb.at == _task(1).base_commit
        assert (pool.counters.resets, pool.counters.quarantines, pool.counters.claims) == (1, 0, 1)
        assert pool.sizes()["img-a"]["leased"] == 1
        await lease.release()
    assert pool.counters.created == 1


async def test_a_lease_whose_reset_fails_its_check_is_quarantined_and_swapped():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        lease = await pool.acquire(_task(1))
        old = lease.sandbox
        old.restore_fails = True
        await lease.reset()  # waits for the quarantined sandbox's room under max_live=1
        assert lease.sandbox is not old and lease.id != old.id
        assert old.id not in backend.live and lease.sandbox.at == _task(1).base_commit
        assert (pool.counters.quarantines, pool.counters.resets, pool.counters.claims) == (1, 0, 2)
        assert "differs from the image" in pool.counters.quarantine_reasons[0]
        assert (await lease.exec("true")).ok
        await lease.release()
        await until(lambda: pool.sizes()["img-a"]["idle"] == 1, "the swapped-in sandbox back idle")
        assert pool.sizes()["img-a"] == {"idle": 1, "leased": 0, "creating": 0, "resetting": 0,
                                         "quarantined": 0}


async def test_a_broken_or_dead_lease_is_swapped_without_a_reset():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse") as pool:
        lease = await pool.acquire(_task(0))
        first = lease.sandbox
        first.fail_next_exec = errors.ExecTransportError("channel broke")
        with pytest.raises(errors.ExecTransportError):
            await lease.exec("true")
        await lease.reset()
        assert lease.sandbox is not first and lease.broken is None
        second = lease.sandbox
        second.dead = True
        await lease.reset()
        assert lease.sandbox not in (first, second)
        assert (pool.counters.resets, pool.counters.quarantines) == (0, 0)  # nothing was verified
        await lease.release()


async def test_a_swap_that_cannot_get_a_sandbox_raises_infra_and_ends_the_lease():
    backend = MemoryBackend()
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        lease = await pool.acquire(_task(0))
        lease.sandbox.dead = True
        backend.fail_creates = 1
        with pytest.raises(errors.SandboxStartError):
            await lease.reset()
        assert lease.released
        with pytest.raises(errors.PoolClosed):
            await lease.reset()
        await lease.release()  # a no-op
        assert pool.sizes()["img-a"]["leased"] == 0


# -- real sandboxes ------------------------------------------------------------------------------


async def test_a_real_lease_reset_removes_what_the_rollout_planted(test_images_root, calc_task):
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        lease = await pool.acquire(calc_task)
        first = lease.id
        await lease.exec("echo fix >> calc.py; echo key > /tmp/gold; echo n > new.py;"
                         " git commit -qam wip; git stash list; sleep 500 &")
        await lease.reset()
        assert lease.id == first
        res = await lease.exec("git status --porcelain --ignored; git rev-parse HEAD; ls -A /tmp;"
                               " git log --all --format=%s | grep -c wip")
        assert res.text.split() == [calc_task.base_commit, "0"]
        assert await lease.sandbox.processes() == []
        assert (pool.counters.resets, pool.counters.quarantines) == (1, 0)
        await lease.release()


async def test_a_real_sandbox_killed_from_the_host_is_swapped_under_the_lease(test_images_root, calc_task):
    backend = LocalBackend(test_images_root)
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
        lease = await pool.acquire(calc_task)
        killed = lease.sandbox
        backend.kill(killed)  # as an OOM kill or an eviction would
        await until(lambda: not killed.alive(), "the killed sandbox's channel to close")
        await lease.reset()
        assert lease.sandbox is not killed and lease.sandbox.alive()
        res = await lease.exec("git rev-parse HEAD; git status --porcelain")
        assert res.text.split() == [calc_task.base_commit]
        await lease.release()


async def test_an_oci_sandbox_changed_outside_the_repo_is_quarantined_and_swapped(test_images_root, tmp_path):
    from sandpool.core.base import ResourceLimits
    from sandpool.core.images import ImageStore, hydrate
    from sandpool.core.paths import sandpool_home
    from sandpool.envs.taskpack.oci import SWE_IMAGE, VERSION, build_test_images

    images = build_test_images()
    store = ImageStore(sandpool_home() / f"test-oci-store-v{VERSION}")  # shared with test_oci.py
    if store.resolve(SWE_IMAGE) is None:
        hydrate(f"oci:{images / 'layout'}:swe", name=SWE_IMAGE, store=store)
    task = Task.model_validate_json((images / "swe-task.json").read_text())
    backend = LocalBackend(test_images_root, store=store, limits=ResourceLimits(disk_bytes=64 << 20))
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
        lease = await pool.acquire(task)
        old = lease.id
        assert (await lease.exec("echo evil >> /etc/hostname", cwd="/")).ok
        await lease.reset()
        assert lease.id != old and pool.counters.quarantines == 1
        assert "modified /etc/hostname" in pool.counters.quarantine_reasons[0]
        res = await lease.exec("cat /etc/hostname; git rev-parse HEAD", cwd=task.workdir)
        assert "evil" not in res.text and task.base_commit in res.text
        await lease.release()
