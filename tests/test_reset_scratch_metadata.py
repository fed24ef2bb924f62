"""The scratch directories themselves, not just their contents, across the in-place reset.

``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` belong to the sandbox: a policy can set their mode
bits, extended attributes, POSIX ACLs (whose entries carry uids of its choosing) and
nanosecond timestamps, and emptying them leaves all of that in place. A rollout that stored
the gold diff there handed it to the next rollout on the same sandbox. Shown first against the
reset without its scratch step, then on real sandboxes of the default pack and of an OCI
image: the next rollout on the reset sandbox, and a concurrent sibling, find the directories
as fresh.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

from sandpool.core import Outcome, PoolLimits, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.core.base import Sandbox
from sandpool.core.images import hydrate
from sandpool.core.reset import reset_in_place

SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")
# The secret, a 60-bit number, as the nanosecond timestamps of each directory, beside a mode,
# an xattr and an ACL naming uid 4242: every one of them a channel.
PLANT = f"""
import os, struct, sys
os.unlink(sys.argv[0])  # /tmp is left empty: nothing for the reset to delete moves its times
secret = int(sys.argv[1])
acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in (
    (1, 7, 0xFFFFFFFF), (2, 7, 4242), (4, 5, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF), (0x20, 0, 0xFFFFFFFF)))
for d in {SCRATCH!r}:
    for what, act in (("xattr", lambda: os.setxattr(d, "user.gold", b"GOLD")),
                      ("acl", lambda: os.setxattr(d, "system.posix_acl_access", acl)),
                      ("mode", lambda: os.chmod(d, 0o1705)),
                      ("times", lambda: os.utime(d, ns=(secret, secret)))):
        try:
            act()
            print("planted", what, d)
        except OSError as exc:
            print("refused", what, d, exc.errno)
"""
READ = f"""
import json, os
out = {{}}
for d in {SCRATCH!r}:
    st = os.stat(d)
    try:
        names = sorted(os.listxattr(d))
    except OSError:
        names = []
    out[d] = [st.st_mode & 0o7777, st.st_atime_ns, st.st_mtime_ns, names]
print(json.dumps(out))
"""


async def _plant(sb, secret: int) -> str:
    await sb.write_file("/tmp/.plant.py", PLANT.encode())
    res = await sb.exec(f"{await _python(sb)} /tmp/.plant.py {secret}")
    assert res.ok, res
    return res.text


async def _read(sb) -> dict[str, list]:
    res = await sb.exec([await _python(sb), "-c", READ])
    assert res.ok, res
    return json.loads(res.text)


async def _python(sb) -> str:
    return "python3" if (await sb.exec("command -v python3")).ok else "python"


def _leaks(seen: dict[str, list], secret: int) -> list[str]:
    return [f"{d}: {v}" for d, v in seen.items() if secret in v[1:3] or v[3] or v[0] == 0o1705]


async def test_without_the_scratch_step_the_reset_hands_the_metadata_to_the_next_rollout(
        test_images_root, calc_commits):
    backend = LocalBackend(test_images_root)
    try:
        sb = await backend.create("sandpool.test/calc:2")
        secret = 0x0DD5EC2E7_1234567
        planted = await _plant(sb, secret)
        assert planted.count("planted") == 10, planted  # mqueue's directory takes no xattr
        # The reset as it was: contents emptied, the directories themselves untouched.
        sb.restore_scratch = lambda **kw: Sandbox.restore_scratch(sb, **kw)
        outcome = await reset_in_place(sb, calc_commits["buggy"])
        assert outcome.ok, outcome.problems
        seen = await _read(sb)
        assert len(_leaks(seen, secret)) == 3, seen
        assert seen["/tmp"][2] == secret and seen["/tmp"][3] == ["system.posix_acl_access", "user.gold"]
    finally:
        await backend.aclose()


async def _next_and_sibling_see_fresh(backend: LocalBackend, task) -> None:
    secrets = {"a": 0x0AAAAAAA_1234567, "b": 0x0BBBBBBB_7654321}
    seen: dict[str, dict] = {}
    fresh: dict[str, dict] = {}
    planted_in: dict[str, str] = {}

    async def plant(name: str, lease) -> float:
        fresh[lease.sandbox.id] = {d: m["mode"] for d, m in lease.sandbox._scratch_record.items()}
        planted_in[name] = lease.sandbox.id
        seen[f"{name}-before"] = await _read(lease)  # a sibling is planting meanwhile
        assert "planted" in await _plant(lease, secrets[name])
        return 0.0

    async def read(name: str, lease) -> float:
        seen[name] = await _read(lease)
        seen[name]["sandbox"] = lease.sandbox.id
        return 0.0

    async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
        first = await asyncio.gather(*(run_rollout(pool, task, lambda lease, n=n: plant(n, lease))
                                       for n in secrets))
        later = await asyncio.gather(*(run_rollout(pool, task, lambda lease, n=n: read(n, lease))
                                       for n in ("next-1", "next-2")))
        assert pool.counters.resets >= 2 and pool.counters.quarantines == 0, pool.counters
    assert [r.outcome for r in (*first, *later)] == [Outcome.COMPLETED] * 4
    # Both later rollouts ran on the planted sandboxes, after their resets.
    ran_on = {name: seen[name].pop("sandbox") for name in ("next-1", "next-2")}
    assert set(ran_on.values()) == set(planted_in.values()), (ran_on, planted_in)
    for name in ("a-before", "b-before", "next-1", "next-2"):
        for secret in secrets.values():
            assert not _leaks(seen[name], secret), (name, seen[name])
    for name, sid in ran_on.items():  # the modes the sandbox had when it started
        assert {d: v[0] for d, v in seen[name].items()} == fresh[sid], (name, seen[name], fresh)


async def test_the_next_rollout_and_a_sibling_find_the_pack_scratch_directories_as_fresh(default_pack_tasks):
    await _next_and_sibling_see_fresh(LocalBackend(), default_pack_tasks[0])


async def test_the_next_rollout_and_a_sibling_find_the_oci_scratch_directories_as_fresh(
        test_images_root, oci_store, swe_task):
    await _next_and_sibling_see_fresh(LocalBackend(test_images_root, store=oci_store), swe_task)


async def test_scratch_directories_of_another_owner_get_their_times_refreshed(
        test_images_root, oci_store, oci_images):
    # A non-root image: /tmp and /dev/shm are root's. The policy cannot change their mode or
    # xattrs or set their times, only move mtime to a moment it picks by adding an entry;
    # the restore moves it to its own moment.
    name = "sandpool.test/user:1"
    if oci_store.resolve(name) is None:  # as test_oci's user test makes it
        lay = oci_images / "layout"

        def make() -> None:
            subprocess.run(["umoci", "tag", "--image", f"{lay}:base", "usertest"], check=True)
            subprocess.run(["umoci", "config", "--image", f"{lay}:usertest", "--config.user=nobody"],
                           check=True)
            hydrate(f"oci:{lay}:usertest", name=name, store=oci_store)

        await asyncio.to_thread(make)
    backend = LocalBackend(test_images_root, store=oci_store)
    try:
        sb = await backend.create(name)
        res = await sb.exec("touch /tmp/x && rm /tmp/x; stat -c %Y /tmp; chmod 700 /tmp; id -u", cwd="/")
        picked, uid = res.text.split()
        assert uid == "65534" and "Operation not permitted" in res.err_text, res
        assert await sb.restore_scratch() == []
        after = (await sb.exec("stat -c '%a %Y' /tmp", cwd="/")).text.split()
        assert after[0] == "1777" and int(after[1]) >= int(picked), after
    finally:
        await backend.aclose()
