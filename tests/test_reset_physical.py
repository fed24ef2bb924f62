"""The repo's physical state across the in-place reset of a local sandbox.

A reset that copies the files a rollout changed back from the image leaves each of them a new
inode of the overlay's upper layer: another device and inode number than the image's. So a rollout can encode one bit per repo path (change the file or not)
and the next rollout on the same sandbox reads it back, though every byte, mode and time is
the image's. Shown first against the reset restoring in place, then on the reset as it is: it
swaps in a fresh upper layer, and the next rollout finds every path's device, inode number and
place in its directory's listing as after an idle rollout. The same for ``/dev/shm``: a tmpfs
emptied in place still numbers the next file after every file the rollout made there; a fresh
one starts where a fresh sandbox's does. Both for a sandbox of an image directory and of an OCI
image (the SWE-bench-shaped test image, whose repo is an overlay of its own over its root's).
"""

from __future__ import annotations

import json

import pytest

from sandpool.core.backends.local import LocalBackend
from sandpool.core.reset import record_pristine, reset_in_place

CALC_IMAGE = "sandpool.test/calc:2"
# Every repo path's (device, inode) and every directory's listing order (as ``ls -f`` shows it).
READ = r"""
import json, os, sys
repo, out = sys.argv[1], {"stat": {}, "order": {}}
for top, dirs, files in os.walk(repo):
    rel = os.path.relpath(top, repo)
    out["order"][rel] = os.listdir(top)
    for name in dirs + files:
        st = os.lstat(os.path.join(top, name))
        out["stat"][os.path.normpath(os.path.join(rel, name))] = [st.st_dev, st.st_ino]
print(json.dumps(out))
"""
# The rollout's encoder: a file it changes (the reset puts the image's bytes back) is a 1.
WRITE = r"""
import os, sys
for path in sys.argv[2:]:
    with open(os.path.join(sys.argv[1], path), "ab") as f:
        f.write(b"#")
"""
# Its index is sandpool's refreshed copy, written anew for every reset (see restore_repo).
NOT_THE_IMAGES = {".git/index"}


async def _view(sb) -> dict:
    """What the next rollout reads: devices numbered by first appearance (an overlay's device
    number is the machine's to give), inode numbers, listing orders."""
    await sb.write_file("/tmp/read.py", READ.encode())
    res = await sb.exec(["python", "/tmp/read.py", sb.workdir])
    assert res.ok, res
    await sb.exec("rm -f /tmp/read.py")
    raw = json.loads(res.text)
    devs: dict[int, int] = {}
    stat = {p: (devs.setdefault(d, len(devs)), i) for p, (d, i) in sorted(raw["stat"].items())}
    return {"stat": stat, "order": raw["order"]}


async def _rollout_then_reset(sb, files: list[str]) -> dict:
    await sb.write_file("/tmp/write.py", WRITE.encode())
    res = await sb.exec(["python", "/tmp/write.py", sb.workdir, *files])
    assert res.ok, res
    outcome = await reset_in_place(sb, sb.head)
    assert outcome.ok, outcome.problems  # verified pristine: bytes, modes, times, xattrs
    return await _view(sb)


def _decode(baseline: dict, seen: dict, candidates: list[str]) -> list[str]:
    return [p for p in candidates if seen["stat"][p] != baseline["stat"][p]]


@pytest.fixture(params=["image-dir", "oci"])
async def sb(request, test_images_root):
    """A fresh sandbox of the calc image directory, or of the OCI test image, as the pool
    hands it out."""
    if request.param == "oci":
        from sandpool.envs.taskpack.oci import SWE_IMAGE

        store = request.getfixturevalue("oci_store")
        backend, image = LocalBackend(test_images_root, store=store), SWE_IMAGE
    else:
        request.getfixturevalue("calc_commits")
        backend, image = LocalBackend(test_images_root), CALC_IMAGE
    try:
        sandbox = await backend.create(image)
        await record_pristine(sandbox, refresh_index=True)  # as the pool does for every sandbox
        yield sandbox
    finally:
        await backend.aclose()


async def test_inodes_a_reset_restores_in_place_carry_bits_and_a_fresh_layer_none(sb):
    assert (await sb.exec("command -v python")).ok
    files = sorted((await sb.exec("find . -type f ! -path ./.git/index -printf '%P\\n'")).text.split())
    candidates = [p for p in files if p.startswith(".git/hooks/") or "/" not in p]
    assert len(candidates) >= 8, files
    secret = candidates[::3]  # bits 1 0 0 1 0 0 ...

    # The reset restoring in place: the next rollout decodes the secret exactly.
    sb.fresh_layers = False
    baseline = await _rollout_then_reset(sb, [])
    seen = await _rollout_then_reset(sb, secret)
    assert _decode(baseline, seen, candidates) == secret

    # The reset as it is: nothing to decode, and every path as after an idle rollout.
    sb.fresh_layers = True
    await _rollout_then_reset(sb, [])  # git's index is refreshed for the image's inodes again
    baseline = await _rollout_then_reset(sb, [])
    for bits in (secret, candidates, []):
        seen = await _rollout_then_reset(sb, bits)
        assert _decode(baseline, seen, candidates) == []
        assert seen["order"] == baseline["order"]
        moved = {p for p in baseline["stat"] if seen["stat"].get(p) != baseline["stat"][p]}
        assert moved <= NOT_THE_IMAGES and seen["stat"].keys() == baseline["stat"].keys(), moved


# The next file's inode number in /dev/shm: a tmpfs numbers its files in turn, from its mount on.
NEXT_INODE = "import os; open('/dev/shm/n', 'w').close(); print(os.stat('/dev/shm/n').st_ino)"
FILL_SHM = "import os\nfor i in range(500):\n    open(f'/dev/shm/f{i}', 'w').close()\n"


async def _next_shm_inode_after(sb, files: bool) -> int:
    if files:
        assert (await sb.exec(["python", "-c", FILL_SHM])).ok
    outcome = await reset_in_place(sb, sb.head)
    assert outcome.ok, outcome.problems
    res = await sb.exec(["python", "-c", NEXT_INODE])
    assert res.ok, res
    assert (await reset_in_place(sb, sb.head)).ok  # the reader's own file goes too
    return int(res.text)


async def test_the_shm_inode_counter_carries_a_count_over_an_emptied_tmpfs_and_not_a_fresh_one(sb):
    shm, sb.shm = sb.shm, None  # the tmpfs emptied in place, as bubblewrap's was
    idle = await _next_shm_inode_after(sb, files=False)
    assert await _next_shm_inode_after(sb, files=True) >= idle + 500
    sb.shm = shm  # a fresh tmpfs for each reset
    idle = await _next_shm_inode_after(sb, files=False)
    assert [await _next_shm_inode_after(sb, files=f) for f in (True, False, True)] == [idle] * 3
