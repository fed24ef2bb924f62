"""A fork of a sandbox holding sparse files, as a hostile policy would make them.

A file of holes costs its sandbox's disk quota nothing (``truncate -s 512M``: no block
allocated). A snapshot that copies its bytes, holes read as zeros, writes its apparent size:
to the host's snapshot store (a policy's few commands fill the disk every other rollout and
every other sandbox's quota file lives on), then into each fork child's quota, where the
restore fails with ``ENOSPC``: an infra failure the policy made, never scored. A snapshot
must cost the store, and a child's quota, no more than the blocks the parent had.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandpool.core import PoolLimits, ResourceLimits, SandboxPool
from sandpool.core.backends.local import LocalBackend, _layers

MIB = 1 << 20
QUOTA = 64 * MIB
#: 512 MiB of holes with one byte of data in the middle, in the repo, in /tmp and (an OCI
#: sandbox) under /root; then what a child shows of them.
_PLANT = ("for f in holes.bin /tmp/holes.bin {extra}; do truncate -s 512M $f &&"
          " printf x | dd of=$f bs=1 seek=$((300 << 20)) conv=notrunc status=none || exit 1; done;"
          " df -k --output=used . | tail -1")
_SHOW = ("for f in holes.bin /tmp/holes.bin {extra}; do stat -c %s $f;"
         " dd if=$f bs=1 skip=$((300 << 20)) count=1 status=none; echo; done")


def _blocks(root: Path, parts: tuple[str, ...]) -> int:
    """Bytes of disk the snapshot's parts take on the host."""
    total = 0
    for part in parts:
        for dirpath, dirs, files in os.walk(root / part):
            for name in dirs + files:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


async def _fork_holes(backend: LocalBackend, task, extra: str) -> None:
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=4)) as pool:
        async with pool.claim(task) as parent:
            res = await parent.exec(_PLANT.format(extra=extra), timeout=60)
            assert res.ok, res.err_text
            assert int(res.text.split()[-1]) * 1024 < QUOTA  # the holes cost the quota nothing
            (child,) = await parent.fork(1)
            try:
                snap = child.restored_from
                used = _blocks(snap.location, snap.parts)
                assert used < QUOTA, f"the snapshot takes {used >> 20} MiB of the host's disk"
                shown = (await child.exec(_SHOW.format(extra=extra), timeout=60)).text.split()
                n = len(shown) // 2
                assert n >= 2 and shown == [str(512 * MIB), "x"] * n, shown
                assert await child.sandbox.state_hash() == child.restored_from.content_hash
            finally:
                await child.release()
        assert pool.counters.quarantines == 0


async def test_a_fork_of_sparse_files_costs_the_store_and_the_child_only_their_blocks(
        test_images_root, calc_task):
    await _fork_holes(LocalBackend(test_images_root, limits=ResourceLimits(disk_bytes=QUOTA)),
                      calc_task, "")


async def test_a_fork_of_an_oci_sandbox_with_sparse_files_outside_its_repo_restores(
        test_images_root, oci_store, swe_task):
    await _fork_holes(LocalBackend(test_images_root, store=oci_store,
                                   limits=ResourceLimits(disk_bytes=QUOTA)),
                      swe_task, "/root/holes.bin")


def test_a_files_hash_is_its_content_not_its_holes_and_a_copy_takes_no_more_blocks(tmp_path):
    # One byte every MiB: a 4 KiB block each on disk; a copy that wrote whole chunks would
    # take 256 times the source's blocks.
    sparse, dense = tmp_path / "a" / "f", tmp_path / "b" / "f"
    for d in (sparse.parent, dense.parent):
        d.mkdir()
    with open(sparse, "wb") as f:
        for i in range(64):
            f.seek(i * MIB + 7)
            f.write(b"y")
        f.truncate(64 * MIB + 5)
    dense.write_bytes(sparse.read_bytes())  # the same bytes, every block allocated
    assert os.stat(dense).st_blocks > 8 * os.stat(sparse).st_blocks
    for f in (sparse, dense):
        os.utime(f, ns=(0, 0))
    a = _layers.hash_tree(sparse.parent, base=0)
    assert a.digest == _layers.hash_tree(dense.parent, base=0).digest
    copy = _layers.copy_tree(sparse.parent, tmp_path / "c", src_base=0, dst_base=0)
    assert copy.digest == a.digest == _layers.hash_tree(tmp_path / "c", base=0).digest
    assert (tmp_path / "c" / "f").read_bytes() == dense.read_bytes()
    assert os.stat(tmp_path / "c" / "f").st_blocks <= os.stat(sparse).st_blocks
