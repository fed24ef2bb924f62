"""Snapshots and forks of local sandboxes of OCI images (the SWE-bench-shaped test image): the
repo's layers stacked under other sandboxes of it, what changed outside the repo replayed into
their roots, and verified; and the hostile cases of tests/test_snapshot_hostile.py on this
image (a planted hook and a setuid file outside the repo, a snapshot under a writer, the disk
quota across forks)."""

from __future__ import annotations

import os

import pytest

from sandpool.core import PoolLimits, ResourceLimits, SandboxPool, Task, errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.images import ID_BASE
from sandpool.envs.grading import DiffGrader

from .conftest import BASE_IMAGE
from .waiting import until

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
        (layer,) = [snap.location / x["part"] for x in snap.detail["layers"]]  # the repo's, stacked
        assert (layer / ".git/hooks/post-checkout").read_text() == hook
        st = os.lstat(snap.location / snap.detail["outside"]["part"] / "usr/local/bin/suid")  # replayed
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


async def test_an_oci_snapshot_taken_while_a_process_writes_is_consistent(test_images_root, swe):
    store, task = swe
    async with _pool(test_images_root, store) as pool:
        async with pool.claim(task) as parent:
            # One write(2) per line: a line is either whole in the snapshot or absent.
            res = await parent.exec(
                "nohup python -c \"import os\nfd=os.open('log.txt',os.O_WRONLY|os.O_CREAT|os.O_APPEND)\n"
                "import time\ni=0\nwhile True:\n os.write(fd,b'%08d ' % i + b'x'*4000 + b'\\\\n')\n"
                " i+=1\n time.sleep(0.001)\" >/dev/null 2>&1 & echo started", timeout=60)
            assert res.ok
            host = parent.sandbox.merged / "log.txt"
            await until(lambda: host.exists() and host.stat().st_size > 400_000, "the writer running")
            snap = await parent.snapshot()
            async with pool.claim(task, from_snapshot=snap) as child:
                lines = (await child.read_file("log.txt")).split(b"\n")
                assert lines[-1] == b"" and len(lines) > 100
                assert [int(line[:8]) for line in lines[:-1]] == list(range(len(lines) - 1))
                assert all(len(line) == 4009 for line in lines[:-1])
            # The parent's writer went on; the snapshot did not move with it.
            await until(lambda: host.stat().st_size > 4009 * (len(lines) + 50), "the writer going on")
            async with pool.claim(task, from_snapshot=snap) as again:
                assert await again.sandbox.state_hash() == snap.content_hash
                assert len((await again.read_file("log.txt")).split(b"\n")) == len(lines)


async def test_the_disk_quota_holds_across_forks_of_an_oci_sandbox(test_images_root, swe):
    store, task = swe
    mib = 1 << 20
    write = "dd if=/dev/urandom of={name} bs=1M count={n} status=none && echo done"
    limits = ResourceLimits(disk_bytes=96 * mib)
    async with _pool(test_images_root, store, limits=limits) as pool:
        async with pool.claim(task) as parent:
            assert (await parent.exec(write.format(name="base.bin", n=48), timeout=120)).text == "done\n"
            a, b = await parent.fork(2)
            try:
                # The snapshot's 48 MiB are a shared lower layer: not on a child's quota.
                assert (await a.exec(write.format(name="a1.bin", n=48), timeout=120)).text == "done\n"
                full = await a.exec(write.format(name="a2.bin", n=48), timeout=120)
                assert full.exit_code != 0 and "No space left on device" in full.err_text
                with pytest.raises(errors.DiskQuotaExceeded):
                    await a.write_file("a3.bin", b"x" * (32 * mib))
                # A sibling's quota is its own; the parent's holds its own 48 MiB.
                assert (await b.exec(write.format(name="b1.bin", n=48), timeout=120)).text == "done\n"
                assert (await parent.exec(write.format(name="p1.bin", n=48), timeout=120)).exit_code != 0
                res = await b.exec("ls a1.bin a2.bin a3.bin p1.bin; wc -c < base.bin", timeout=60)
                assert res.text == f"{48 * mib}\n"  # none of the others' files
                # Copying a layer's file up is charged to the child that changes it.
                grow = await b.exec("echo x >> base.bin", timeout=120)
                assert grow.exit_code != 0 and "No space left" in grow.err_text
            finally:
                await a.release()
                await b.release()
        assert pool.counters.quarantines == 0


async def test_an_oci_sandbox_whose_repo_is_no_checkout_snapshots_its_whole_root(test_images_root,
                                                                                 oci_store):
    # The base image's workdir is /, no git checkout: no repo overlay of its own, so its whole
    # root is the change set, replayed into the child.
    backend = LocalBackend(test_images_root, store=oci_store)
    try:
        parent = await backend.create(BASE_IMAGE)
        assert parent.repo_lower is None and await parent.restore_repo("") is None
        assert (await parent.exec("echo kept > /root/kept && rm /etc/motd", cwd="/")).ok
        snap = await parent.snapshot()
        assert snap.detail["layers"] == [] and snap.size_bytes == len("kept\n")
        child = await backend.create(BASE_IMAGE)
        await child.load_snapshot(snap)
        assert await child.state_hash() == snap.content_hash
        res = await child.exec("cat /root/kept; test ! -e /etc/motd && echo gone", cwd="/")
        assert res.text == "kept\ngone\n"
        assert (await child.exec("echo more >> /root/kept", cwd="/")).ok
        assert await child.state_hash() != snap.content_hash
    finally:
        await backend.aclose()
