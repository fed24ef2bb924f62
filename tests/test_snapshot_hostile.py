"""Snapshots and forks as a hostile policy would use them, on real bubblewrap sandboxes.

* a fork sibling reads another sibling's files (or the parent's later ones);
* a snapshot is taken while a process is writing;
* a restored sandbox holds a planted ``.git`` hook and a setuid file;
* a snapshot of one image is restored onto another image, or onto a rebuild of its own;
* the disk quota holds across forks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, ResourceLimits, SandboxPool, errors
from sandpool.core.backends.local import LocalBackend, image_dir
from sandpool.core.images import ID_BASE
from sandpool.envs.grading import DiffGrader

from .conftest import CALC_IMAGE, _git
from .waiting import until

OTHER_IMAGE = "sandpool.test/calc-other:1"


@pytest.fixture(scope="module")
def other_image(test_images_root: Path, calc_commits) -> Path:
    """A second image directory (another repo, the calc image's venv); rebuilt by one test."""
    calc = json.loads((image_dir(test_images_root, CALC_IMAGE) / "image.json").read_text())
    d = image_dir(test_images_root, OTHER_IMAGE)
    repo = d / "repo"
    if not (d / "image.json").exists():
        repo.mkdir(parents=True, exist_ok=True)
        _git(repo, "init", "-q", "-b", "main")
        (repo / "other.py").write_text("VALUE = 1\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "other")
        (d / "image.json").write_text(json.dumps({**calc, "name": OTHER_IMAGE, "repo": str(repo)}))
    return repo


def _pool(root: Path, **kw) -> SandboxPool:
    return SandboxPool(LocalBackend(root, **kw), "reuse", PoolLimits(max_live=8))


async def test_a_fork_sibling_sees_none_of_another_siblings_files(test_images_root, calc_task):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as parent:
            assert (await parent.exec("echo shared > shared.txt")).ok
            a, b = await parent.fork(2)
            try:
                assert (await a.exec("echo TOKEN-A > secret.txt; echo TOKEN-A > /tmp/secret;"
                                     " echo TOKEN-A > /dev/shm/secret; echo TOKEN-A >> shared.txt;"
                                     " nohup sleep 600 >/dev/null 2>&1 & echo ok")).ok
                assert (await parent.exec("echo TOKEN-P > later.txt")).ok
                # B looks everywhere it can write or read that a sibling could have reached.
                res = await b.exec("grep -rsl -e TOKEN-A -e TOKEN-P /testbed /tmp /dev/shm /opt"
                                   " /dev/mqueue; cat shared.txt; ps -eo comm | grep -cx sleep")
                assert res.text == "shared\n0\n", res  # nor A's process
                # B's write to a file of the shared layer lands in B's own upper layer only.
                assert (await b.exec("echo TOKEN-B > shared.txt")).ok
                assert (await a.exec("cat shared.txt")).text == "shared\nTOKEN-A\n"
                assert (await parent.exec("cat shared.txt")).text == "shared\n"
                snap = a.restored_from
                assert snap is not None
                (layer,) = [snap.location / p for p in snap.parts if p.startswith("layers/")]
                assert (layer / "shared.txt").read_text() == "shared\n"  # the layer: unchanged
                for lease, sid in ((a, b.id), (b, a.id)):  # no path of a sibling's state is visible
                    res = await lease.exec(f"grep -rs {sid} /proc/self/mountinfo; ls /opt/sandpool")
                    assert sid not in res.text
            finally:
                await a.release()
                await b.release()


async def test_a_snapshot_taken_while_a_process_writes_is_consistent(test_images_root, calc_task):
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as parent:
            # One write(2) per line: a line is either whole in the snapshot or absent.
            res = await parent.exec(
                "nohup python -c \"import os\nfd=os.open('log.txt',os.O_WRONLY|os.O_CREAT|os.O_APPEND)\n"
                "import time\ni=0\nwhile True:\n os.write(fd,b'%08d ' % i + b'x'*4000 + b'\\\\n')\n"
                " i+=1\n time.sleep(0.001)\" "
                ">/dev/null 2>&1 & echo started")
            assert res.ok
            host = parent.sandbox.merged / "log.txt"
            await until(lambda: host.exists() and host.stat().st_size > 400_000, "the writer running")
            snap = await parent.snapshot()
            async with pool.claim(calc_task, from_snapshot=snap) as child:
                lines = (await child.read_file("log.txt")).split(b"\n")
                assert lines[-1] == b"" and len(lines) > 100
                assert [int(line[:8]) for line in lines[:-1]] == list(range(len(lines) - 1))
                assert all(len(line) == 4009 for line in lines[:-1])
            # The parent's writer went on; the snapshot did not move with it.
            await until(lambda: host.stat().st_size > 4009 * (len(lines) + 50), "the writer going on")
            async with pool.claim(calc_task, from_snapshot=snap) as again:
                assert await again.sandbox.state_hash() == snap.content_hash
                assert len((await again.read_file("log.txt")).split(b"\n")) == len(lines)


async def test_a_restored_planted_hook_never_runs_and_a_setuid_file_stays_powerless(
        test_images_root, calc_task):
    hook = "#!/bin/sh\ntouch /tmp/HOOK-RAN /testbed/HOOK-RAN\n"
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as parent:
            await parent.write_file(".git/hooks/post-checkout", hook.encode(), mode=0o755)
            await parent.write_file(".git/hooks/pre-commit", hook.encode(), mode=0o755)
            assert (await parent.exec("cp /usr/bin/id ./suid-id && chmod 4755 suid-id && echo fix >> calc.py")).ok
            snap = await parent.snapshot()
        # The snapshot's copy: owned by the image store's shift of uid 1000, never by host root.
        (layer,) = [snap.location / p for p in snap.parts if p.startswith("layers/")]
        st = os.lstat(layer / "suid-id")
        assert (st.st_uid, st.st_mode & 0o7777) == (ID_BASE + 1000, 0o4755)
        async with pool.claim(calc_task, from_snapshot=snap) as child:
            # The state is restored as it was: the hook and the setuid bit are there...
            res = await child.exec("stat -c '%a %u' suid-id .git/hooks/post-checkout; ./suid-id -u;"
                                   " grep ' /testbed ' /proc/self/mountinfo | tail -1")
            first, second, uid, mount = res.text.splitlines()
            assert (first, second, uid) == ("4755 1000", "755 1000", "1000")
            assert "nosuid" in mount.split(" - ")[0] and "nodev" in mount.split(" - ")[0]
            host = os.lstat(child.sandbox.merged / "suid-id")  # ...owned by the child's own range
            assert host.st_uid == child.sandbox.ids.base + 1000 != 0
            # ...and sandpool's own git never runs the hook: grading captures the diff and
            # resets with hooks off, and the reset takes the child back to the image.
            patch = await DiffGrader().capture(child, calc_task)
            assert b"suid-id" in patch and b"+fix" in patch
            assert (await child.exec("ls /tmp/HOOK-RAN HOOK-RAN")).exit_code != 0
            await child.reset()
            hooks = (await child.exec("ls .git/hooks")).text.split()
            assert hooks and not [h for h in hooks if not h.endswith(".sample")], hooks
            res = await child.exec("ls suid-id HOOK-RAN; git status --porcelain")
            assert res.text == "" and "suid-id" in res.err_text
            assert (await child.exec("ls /tmp")).text == ""


async def test_a_snapshot_restored_onto_another_image_is_refused(test_images_root, calc_task,
                                                                 other_image):
    other = calc_task.model_copy(update={"instance_id": "other-1", "image": OTHER_IMAGE,
                                         "base_commit": _git(other_image, "rev-parse", "HEAD")})
    async with _pool(test_images_root) as pool:
        async with pool.claim(calc_task) as lease:
            snap = await lease.snapshot()
        with pytest.raises(errors.ConfigError, match=f"is of image '{CALC_IMAGE}' and cannot be "
                                                     f"restored onto image '{OTHER_IMAGE}'"):
            await pool.acquire(other, from_snapshot=snap)
        # A snapshot of the other image, then that image is rebuilt: the old build's snapshot
        # is refused by the new build's sandboxes.
        async with pool.claim(other) as lease:
            assert (await lease.exec("echo 2 > other.py")).ok
            old = await lease.snapshot()
    os.utime(other_image)  # a rebuild: the image's repo is another directory state
    subprocess.run(["chmod", "g+w", str(other_image)], check=True)
    async with _pool(test_images_root) as pool:
        with pytest.raises(errors.ConfigError, match="restores only onto the build it was taken from"):
            await pool.acquire(other, from_snapshot=old)
        assert pool.counters.quarantines == 0


async def test_the_disk_quota_holds_across_forks(test_images_root, calc_task):
    mib = 1 << 20
    limits = ResourceLimits(disk_bytes=64 * mib)
    write = "dd if=/dev/urandom of={name} bs=1M count={n} status=none && echo done"
    async with _pool(test_images_root, limits=limits) as pool:
        async with pool.claim(calc_task) as parent:
            assert (await parent.exec(write.format(name="base.bin", n=40))).text == "done\n"
            a, b = await parent.fork(2)
            try:
                # The snapshot's 40 MiB are a shared lower layer: not on a child's quota.
                assert (await a.exec(write.format(name="a1.bin", n=40))).text == "done\n"
                full = await a.exec(write.format(name="a2.bin", n=40))
                assert full.exit_code != 0 and "No space left on device" in full.err_text
                with pytest.raises(errors.DiskQuotaExceeded):
                    await a.write_file("a3.bin", b"x" * (8 * mib))
                # A sibling's quota is its own; the parent's holds its own 40 MiB.
                assert (await b.exec(write.format(name="b1.bin", n=40))).text == "done\n"
                assert (await parent.exec(write.format(name="p1.bin", n=40))).exit_code != 0
                # Copying a layer's file up is charged to the child that changes it.
                grow = await b.exec("echo x >> base.bin")
                assert grow.exit_code != 0 and "No space left" in grow.err_text
            finally:
                await a.release()
                await b.release()
        assert pool.counters.quarantines == 0
