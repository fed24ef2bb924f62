"""Snapshots, restores, forks, suspend and resume on real bubblewrap sandboxes.

A snapshot is the repo and ``/tmp`` as a value; a claim from it gets that state, verified by
its hash; a fork gives n sandboxes of it; suspend freezes the sandbox's cgroup. The hostile
cases (a sibling reading another's files, a snapshot under a writer, a planted hook and a
setuid file, another image, the disk quota) are in ``test_snapshot_hostile.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, SandboxPool, errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.backends.local._cgroup import _FREEZER
from sandpool.core.snapshot import Snapshot

from .waiting import until

# A policy's state: an edit, an added file, a deletion, a directory, a commit, /tmp.
_STATE = ("echo 'x = 1' >> calc.py && rm test_calc.py && mkdir -p pkg/sub && echo deep > pkg/sub/f"
          " && echo kept > notes.txt && chmod 600 notes.txt && echo scratch > /tmp/work.txt"
          " && git add -A && git -c user.name=p -c user.email=p@p commit -qm policy-step")
_SHOW = ("cat calc.py pkg/sub/f notes.txt /tmp/work.txt; stat -c %a notes.txt; ls test_calc.py;"
         " git log --format=%s -1")


def _pool(root: Path, **kw) -> SandboxPool:
    return SandboxPool(LocalBackend(root, **kw), "reuse", PoolLimits(max_live=8))


async def test_a_claim_from_a_snapshot_has_the_state_and_its_hash(test_images_root, calc_task):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as parent:
            assert (await parent.exec(_STATE)).ok
            want = (await parent.exec(_SHOW)).text
            snap = await parent.snapshot()
            assert (snap.image, snap.backend) == (calc_task.image, "local")
            assert len(snap.content_hash) == 64 and snap.size_bytes > 0
            assert await parent.sandbox.state_hash() == snap.content_hash
            async with pool.claim(calc_task, from_snapshot=snap) as child:
                assert child.sandbox is not parent.sandbox and child.restored_from == snap
                assert (await child.exec(_SHOW)).text == want
                assert await child.sandbox.state_hash() == snap.content_hash
                # The child is a sandbox of its own: its change moves its hash, not the parent's.
                assert (await child.exec("echo more >> notes.txt")).ok
                assert await child.sandbox.state_hash() != snap.content_hash
                assert await parent.sandbox.state_hash() == snap.content_hash
        # Both went back to the pool and were reset in place: a plain claim is the image's.
        assert pool.counters.resets == 2 and pool.counters.quarantines == 0
        async with pool.claim(calc_task) as fresh:
            res = await fresh.exec("git status --porcelain; ls /tmp; git log --format=%s -1")
            assert res.text == "bug\n"  # nothing changed, /tmp empty, the image's last commit


async def test_a_snapshot_of_an_unchanged_sandbox_restores_the_image(test_images_root, calc_task):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as lease:
            snap = await lease.snapshot()
            first = lease.id
        # The sandbox was reset in place (its upper layer holds the reset's refreshed index):
        # it takes the snapshot as a fresh one would, verified, not quarantined.
        async with pool.claim(calc_task, from_snapshot=snap) as lease:
            assert lease.id == first and pool.counters.quarantines == 0, pool.counters.quarantine_reasons
            assert (await lease.exec("git status --porcelain")).text == ""
            assert (await lease.exec("git rev-parse HEAD")).text.strip() == calc_task.base_commit


async def test_a_saved_snapshot_is_restored_by_another_process(test_images_root, calc_task, tmp_path):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as lease:
            assert (await lease.exec(_STATE)).ok
            want = (await lease.exec(_SHOW)).text
            snap = await lease.snapshot()
            path = snap.save(tmp_path / "step.snap")
    assert not (snap.location / snap.parts[0]).exists()  # the store went with its backend
    with pytest.raises(errors.ConfigError, match="save\\(\\) it before the pool closes"):
        snap.save(tmp_path / "again.snap")
    loaded = Snapshot.load(path)
    assert (loaded.id, loaded.content_hash, loaded.image) == (snap.id, snap.content_hash, snap.image)
    # Another interpreter loads the file, restores it in a pool of its own and shows the state.
    script = f"""
import asyncio, json, sys
from sandpool.core import PoolLimits, SandboxPool
from sandpool.core.backends.local import LocalBackend
from sandpool.core.snapshot import Snapshot
from sandpool.core.task import Task

async def main():
    task = Task.model_validate_json(sys.argv[1])
    snap = Snapshot.load(sys.argv[2])
    async with SandboxPool(LocalBackend({str(test_images_root)!r}), "reuse", PoolLimits(max_live=2)) as pool:
        async with pool.claim(task, from_snapshot=snap) as lease:
            out = (await lease.exec({_SHOW!r})).text
            print(json.dumps({{"show": out, "hash": await lease.sandbox.state_hash()}}))

asyncio.run(main())
"""
    res = subprocess.run([sys.executable, "-c", script, calc_task.model_dump_json(), str(path)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"show": want, "hash": snap.content_hash}


async def test_an_altered_archive_is_refused_naming_the_layer(test_images_root, calc_task, tmp_path):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as lease:
            assert (await lease.exec("echo original > data.txt")).ok
            path = (await lease.snapshot()).save(tmp_path / "s.snap")
    # Unpack, change one byte of the layer's file, pack again with the same metadata.
    work = tmp_path / "x"
    work.mkdir()
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "-xf", str(path), "-C", str(work)], check=True)
    (victim,) = work.glob("layers/*/data.txt")
    victim.write_text("altered\n")
    names = ["snapshot.json"] + sorted(p.name for p in work.iterdir() if p.name != "snapshot.json")
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-cf",
                    str(tmp_path / "t.snap"), "-C", str(work), *names], check=True)
    snap = Snapshot.load(tmp_path / "t.snap")
    async with _pool(test_images_root) as pool:
        with pytest.raises(errors.ConfigError, match="the data was altered"):
            await pool.acquire(calc_task, from_snapshot=snap)
        assert pool.counters.quarantines == 0


async def test_a_restore_whose_hash_differs_is_quarantined(test_images_root, calc_task):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as lease:
            assert (await lease.exec("echo original > data.txt")).ok
            snap = await lease.snapshot()
            async with pool.claim(calc_task, from_snapshot=snap):
                pass  # the store has checked the layer once
            # The layer changes on the host after that check: every restore shows another hash.
            layer = snap.location / snap.parts[0] / "data.txt"
            os.chmod(layer, 0o600)
            with pytest.raises(errors.ResetError, match="not the snapshot's"):
                await pool.acquire(calc_task, from_snapshot=snap)
            assert pool.counters.quarantines == 3
            assert "restored from snapshot" in pool.counters.quarantine_reasons[-1]


async def test_fork_gives_children_of_the_state_and_the_parent_goes_on(test_images_root, calc_task):
    async with _pool(test_images_root) as pool:
        await pool.prepare([calc_task], 4, rollouts_per_task=4)
        async with pool.claim(calc_task) as parent:
            assert (await parent.exec(_STATE)).ok
            want = (await parent.exec(_SHOW)).text
            kids = await parent.fork(3)
            try:
                assert len({k.id for k in kids} | {parent.id}) == 4
                for k in kids:
                    assert (await k.exec(_SHOW)).text == want
                    assert k.restored_from is not None
                assert (await parent.exec("echo parent-later > later.txt")).ok
                for i, k in enumerate(kids):
                    assert (await k.exec(f"echo {i} > mine.txt")).ok
                for i, k in enumerate(kids):
                    res = await k.exec("cat mine.txt; ls later.txt")
                    assert res.text == f"{i}\n" and "No such file" in res.err_text
                assert (await parent.exec("ls mine.txt")).exit_code != 0
                grandkids = await kids[0].fork(1)  # a fork of a fork stacks one more layer
                assert (await grandkids[0].exec("cat mine.txt pkg/sub/f")).text == "0\ndeep\n"
                assert len(grandkids[0].restored_from.parts) == 3  # two layers and /tmp
                await grandkids[0].release()
            finally:
                for k in kids:
                    await k.release()
    assert pool.counters.quarantines == 0


async def test_suspend_freezes_the_cgroup_and_resume_goes_on(test_images_root, calc_task):
    if not os.access(_FREEZER, os.W_OK):
        pytest.skip("no writable cgroup v1 freezer on this host")
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as lease:
            # A process that counts in memory and writes each number: a restart would begin at 0.
            res = await lease.exec("nohup python -c \"import time\nn=0\nwhile True:\n n+=1\n"
                                   " open('/tmp/n','w').write(str(n))\n time.sleep(0.01)\" "
                                   ">/dev/null 2>&1 & echo started")
            assert res.ok
            host = lease.sandbox.tmp_host() / "n"
            await until(lambda: host.exists() and host.read_text().isdigit()
                        and int(host.read_text()) > 5, "the counter running")
            await lease.suspend()
            state = _FREEZER / "sandpool" / pool.backend.run_id / lease.id / "freezer.state"
            assert state.read_text().strip() == "FROZEN"
            with pytest.raises(errors.ConfigError, match="is suspended"):
                await lease.exec("true")
            frozen_at = int(host.read_text() or 0)
            await lease.resume()
            assert state.read_text().strip() == "THAWED"
            await until(lambda: host.read_text().isdigit() and int(host.read_text()) > frozen_at + 5,
                        "the counter going on from where it was")
            assert (await lease.exec("echo back")).text == "back\n"
            # A suspended lease released is thawed, then reset in place as any other.
            await lease.suspend()
        assert pool.counters.resets == 1 and pool.counters.quarantines == 0


def test_a_snapshot_refuses_another_image_build_or_backend():
    snap = Snapshot(id="snap-1", image="a:1", image_id="build-1", backend="local",
                    content_hash="0" * 64, size_bytes=0, parts=(), location=Path("/nonexistent"))
    with pytest.raises(errors.ConfigError, match="is of image 'a:1' and cannot be restored onto image 'b:1'"):
        snap.check_target("b:1", None, "local")
    with pytest.raises(errors.ConfigError, match="restores only onto the build it was taken from"):
        snap.check_target("a:1", "build-2", "local")
    with pytest.raises(errors.ConfigError, match="on the kubernetes backend"):
        dataclasses.replace(snap, backend="local").check_target("a:1", None, "kubernetes")
    snap.check_target("a:1", "build-1", "local")


def test_loading_a_file_that_is_not_a_snapshot_says_so(tmp_path):
    (tmp_path / "x").write_text("hello")
    subprocess.run(["tar", "-cf", str(tmp_path / "a.tar"), "-C", str(tmp_path), "x"], check=True)
    with pytest.raises(errors.ConfigError, match="is not a sandpool snapshot"):
        Snapshot.load(tmp_path / "a.tar")
    (tmp_path / "b.snap").write_text("not a tar")
    with pytest.raises(errors.ConfigError, match="is not a sandpool snapshot archive"):
        Snapshot.load(tmp_path / "b.snap")
