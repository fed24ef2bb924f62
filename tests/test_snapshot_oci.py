"""Snapshots and forks of local sandboxes of OCI images (the SWE-bench-shaped test image): the
change set against the image, replayed into other sandboxes of it and verified."""

from __future__ import annotations

import os

import pytest

from sandpool.core import PoolLimits, ResourceLimits, SandboxPool, Task, errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.images import ID_BASE
from sandpool.envs.grading import DiffGrader

STATE = ("echo '# note' >> calcpkg/__init__.py && rm -f README* && mkdir -p new/deep && echo x > new/deep/f"
         " && echo kept > /tmp/kept && mkdir -p /root/.cache && echo c > /root/.cache/c"
         " && git add -A && git -c user.name=p -c user.email=p@p commit -qm policy-step")
SHOW = ("tail -1 calcpkg/__init__.py; cat new/deep/f /tmp/kept /root/.cache/c; ls README* 2>&1 | wc -l;"
        " git log --format=%s -1")


@pytest.fixture
def swe(oci_store, swe_task: Task):
    return oci_store, swe_task


def _pool(root, store, **kw) -> SandboxPool:
    return SandboxPool(LocalBackend(root, store=store, **kw), "reuse", PoolLimits(max_live=6))


async def test_an_oci_sandbox_snapshot_replays_into_others_of_its_image(test_images_root, swe):
    store, task = swe
    async with _pool(test_images_root, store) as pool:
        async with pool.claim(task) as parent:
            assert (await parent.exec(STATE, timeout=120)).ok
            want = (await parent.exec(SHOW, timeout=60)).text
            snap = await parent.snapshot()
            assert snap.image_id == store.resolve(task.image).digest and snap.size_bytes > 0
            assert await parent.sandbox.state_hash() == snap.content_hash
            a, b = await parent.fork(2)
            try:
                for kid in (a, b):
                    assert (await kid.exec(SHOW, timeout=60)).text == want
                    assert await kid.sandbox.state_hash() == snap.content_hash
                assert (await a.exec("echo TOKEN-A > /root/secret; echo TOKEN-A >> new/deep/f")).ok
                res = await b.exec("grep -rsl TOKEN-A /testbed /tmp /root; cat new/deep/f")
                assert res.text == "x\n"
                assert await b.sandbox.state_hash() == snap.content_hash
            finally:
                await a.release()
                await b.release()
        # A saved snapshot restores the same in a pool of its own.
        path = snap.save(test_images_root.parent / "oci-step.snap")
    from sandpool.core import Snapshot

    async with _pool(test_images_root, store) as pool:
        async with pool.claim(task, from_snapshot=Snapshot.load(path)) as lease:
            assert (await lease.exec(SHOW, timeout=60)).text == want
    os.unlink(path)


async def test_a_restored_oci_sandbox_holds_a_planted_hook_and_setuid_file_inertly(test_images_root, swe):
    store, task = swe
    hook = "#!/bin/sh\ntouch /tmp/HOOK-RAN \"$PWD/HOOK-RAN\"\n"
    async with _pool(test_images_root, store, limits=ResourceLimits(disk_bytes=256 << 20)) as pool:
        async with pool.claim(task) as parent:
            await parent.write_file(".git/hooks/post-checkout", hook.encode(), mode=0o755)
            # Root in the image: a setuid-root binary, as far as the sandbox can tell.
            assert (await parent.exec("cp /bin/true /usr/local/bin/suid && chmod 4755 /usr/local/bin/suid",
                                      timeout=60)).ok
            snap = await parent.snapshot()
        (layer,) = [snap.location / p for p in snap.parts]
        st = os.lstat(layer / "usr/local/bin/suid")
        assert (st.st_uid, st.st_mode & 0o7777) == (ID_BASE, 0o4755)  # the store's uid 0, never host root
        async with pool.claim(task, from_snapshot=snap) as child:
            res = await child.exec("stat -c '%a %u' /usr/local/bin/suid .git/hooks/post-checkout", timeout=60)
            assert res.text == "4755 0\n755 0\n"
            host = os.lstat(child.sandbox.root / "usr/local/bin/suid")
            assert host.st_uid == child.sandbox.ids.base != 0  # its own range's uid 0
            patch = await DiffGrader().capture(child, task)
            assert b"post-checkout" not in patch
            assert (await child.exec("ls /tmp/HOOK-RAN HOOK-RAN", timeout=60)).exit_code != 0
            await child.reset()  # the reset removes what was added outside the repo too
            res = await child.exec("ls /usr/local/bin/suid .git/hooks/post-checkout", timeout=60)
            assert res.exit_code != 0 and res.text == ""


async def test_an_oci_snapshot_is_refused_by_a_sandbox_of_another_image(test_images_root, swe, calc_task):
    store, task = swe
    async with _pool(test_images_root, store) as pool:
        async with pool.claim(task) as lease:
            snap = await lease.snapshot()
        with pytest.raises(errors.ConfigError, match="cannot be restored onto image"):
            await pool.acquire(calc_task, from_snapshot=snap)
