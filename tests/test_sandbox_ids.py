"""Root inside a sandbox is no one outside, and no one of another sandbox: the default pack's
sandboxes, attacked from inside.

A policy creates files, directories, hard links, fifos and setuid/setgid copies of a shell in
every place it can write (the repo, /tmp = $HOME, /dev/shm, /dev/mqueue), chmods a tracked
file setuid, and tries chown, setuid(0) and a nested user namespace. The host then looks at
everything the sandbox could have made: each path is owned by an id of the sandbox's own
unprivileged range, and no setuid or setgid file of host root (or of any id outside the range)
exists.
The sandbox still works end to end: in-place reset verified, gold patch graded 1, no patch 0.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, SandboxPool
from sandpool.core.backends.local import LocalBackend, LocalSandbox, _idmap, _overlay
from sandpool.core.backends.local._idrange import FIRST, RANGES
from sandpool.core.images import ID_COUNT
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task
from sandpool.envs.grading import grade

from .waiting import until

# Every place a pack sandbox can write, $HOME included (it is /tmp).
_PLACES = ("/testbed", "/tmp", "/dev/shm", "$HOME/.home")
_ATTACK = r"""
set -u
mkdir -p "$HOME/.home"
for d in PLACES; do
  cp /bin/sh "$d/evil-suid" && chmod 4755 "$d/evil-suid"
  cp /bin/sh "$d/evil-sgid" && chmod 2755 "$d/evil-sgid"
  cp /bin/sh "$d/evil-both" && chmod 6755 "$d/evil-both"
  mkdir "$d/evil-dir" && chmod 3777 "$d/evil-dir" && echo x > "$d/evil-dir/inner"
  ln "$d/evil-suid" "$d/evil-hard"
  ln -s /etc/shadow "$d/evil-link"
  mkfifo "$d/evil-fifo"
  chown 0:0 "$d/evil-suid" 2>/dev/null && echo "CHOWNED $d"
  chgrp 0 "$d/evil-sgid" 2>/dev/null && echo "CHGRPED $d"
done
touch /dev/mqueue/evil-q && chmod 6777 /dev/mqueue/evil-q
tracked=$(git ls-files | head -1)
chmod 6755 "$tracked"
echo "TRACKED $tracked"
python -c 'import os; os.setuid(0)' 2>/dev/null && echo SETUID0
unshare -U true 2>/dev/null && echo NESTED
unshare -Ur true 2>/dev/null && echo NESTED_ROOT
echo DONE
""".replace("PLACES", " ".join(f'"{p}"' for p in _PLACES))


def _in_range(i: int, sb: LocalSandbox) -> bool:
    """True when host id ``i`` is one of the sandbox's own range (``_idrange``)."""
    return sb.ids is not None and sb.ids.base <= i < sb.ids.base + ID_COUNT


def _agent_pid(sb: LocalSandbox) -> int:
    """Host pid of the sandbox's pid 1 (its agent): bubblewrap's only child."""
    children = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _walk(root: Path) -> list[tuple[str, os.stat_result]]:
    out = [(str(root), os.lstat(root))]
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            out.append((p, os.lstat(p)))
    return out


def _sandbox_made(sb: LocalSandbox) -> list[tuple[str, os.stat_result]]:
    """Every path the sandbox could have created, read on the host: the repo's upper layer,
    its /tmp (on the quota filesystem), and its /dev/shm and /dev/mqueue (sandbox-private
    mounts, reached through its pid 1's root)."""
    assert sb.upper is not None
    root = Path(f"/proc/{_agent_pid(sb)}/root")
    tmp = sb.upper.parent / "tmp"
    places = [sb.upper, tmp, root / "dev" / "shm", root / "dev" / "mqueue"]
    assert tmp.is_dir(), "a pack sandbox's /tmp lives on its quota filesystem"
    return [entry for p in places for entry in _walk(p)]


@pytest.fixture
def pack_task(default_pack_tasks: list[Task]) -> Task:
    return default_pack_tasks[0]


async def test_everything_a_sandbox_writes_is_owned_by_an_unprivileged_host_id(pack_backend: LocalBackend,
                                                                              pack_task: Task):
    sb = await pack_backend.create(pack_task.image)
    try:
        res = await sb.exec(_ATTACK, timeout=60)
        assert "DONE" in res.text, (res.text, res.err_text)
        for refused in ("CHOWNED", "CHGRPED", "SETUID0", "NESTED"):
            assert refused not in res.text, res.text
        tracked = res.text.split("TRACKED ")[1].split()[0]
        res = await sb.exec("unshare -U true")  # refused: the namespace allows no nested one
        assert "unshare failed: No space left on device" in res.err_text, res.err_text
        made = _sandbox_made(sb)
        names = {os.path.basename(p) for p, _ in made}
        assert {"evil-suid", "evil-sgid", "evil-both", "evil-dir", "evil-hard", "evil-fifo",
                "evil-q", ".home", tracked.rsplit("/", 1)[-1]} <= names, names
        outside = [(p, st.st_uid, st.st_gid) for p, st in made
                   if not (_in_range(st.st_uid, sb) and _in_range(st.st_gid, sb))]
        assert not outside, outside
        privileged = [(p, st.st_uid, st.st_gid, oct(st.st_mode)) for p, st in made
                      if st.st_mode & (stat.S_ISUID | stat.S_ISGID)]
        # The setuid/setgid bits did land (the attack is real), on files of the sandbox's id.
        assert any(os.path.basename(p) == "evil-both" for p, *_ in privileged), privileged
        assert all(uid == gid == sb.ids.host(_idmap.SANDBOX_UID) for _, uid, gid, _ in privileged), privileged
        # Every process of the sandbox, bubblewrap included, runs as ids of the range.
        ids = set()
        for pid in {sb.pid, *pack_backend._cgroups.pids(sb.id)}:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            for key in ("Uid:", "Gid:"):
                ids |= {int(x) for x in next(ln for ln in status if ln.startswith(key)).split()[1:]}
        assert ids and all(_in_range(i, sb) for i in ids), ids
    finally:
        await pack_backend.delete(sb)


async def test_id_maps_inside_cover_only_the_unprivileged_range(pack_backend: LocalBackend, pack_task: Task):
    sb = await pack_backend.create(pack_task.image)
    try:
        res = await sb.exec("id -u; id -g; cat /proc/self/uid_map; echo --; cat /proc/self/gid_map")
        assert res.ok, res.err_text
        uid, gid, maps = res.text.split("\n", 2)
        assert (uid, gid) == (str(_idmap.SANDBOX_UID),) * 2
        uid_map, gid_map = maps.split("--\n")
        for table in (uid_map, gid_map):
            rows = [tuple(map(int, ln.split())) for ln in table.strip().splitlines()]
            assert rows, table
            for inside, outside, count in rows:
                assert outside - inside == sb.ids.base and count <= ID_COUNT, rows
                assert FIRST <= outside and outside + count <= FIRST + RANGES * ID_COUNT, rows
    finally:
        await pack_backend.delete(sb)


async def test_writable_mounts_are_nosuid_and_nodev(pack_backend: LocalBackend, pack_task: Task):
    sb = await pack_backend.create(pack_task.image)
    try:
        info = (await sb.exec("cat /proc/self/mountinfo")).text
        opts = {f[4]: set(f[5].split(",")) for f in (ln.split() for ln in info.splitlines())}
        # /dev/mqueue is bubblewrap's own mqueue mount, which it makes without flags; a queue
        # reads as its status line, so it can never be a program (setuid or not) anyway.
        for place in ("/testbed", "/tmp", "/dev/shm"):
            assert {"nosuid", "nodev"} <= opts[place], (place, opts[place])
        res = await sb.exec("cp /bin/sh /tmp/s && chmod 4755 /tmp/s && /tmp/s -c 'id -u'")
        assert res.ok and res.text.strip() == str(_idmap.SANDBOX_UID)  # the bit does not act
        # On the host too: the repo's overlay, the quota filesystem (upper layer and /tmp) and
        # every bind the host made for bubblewrap.
        host = [ln.split() for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
        mine = {f[4]: set(f[5].split(",")) for f in host
                if f[4].startswith((str(sb.state_dir), f"/run/sandpool/{pack_backend.run_id}/{sb.id}/"))}
        assert {str(sb.state_dir / "merged"), str(sb.state_dir / "disk")} <= set(mine), mine
        assert any("/run/sandpool/" in m for m in mine), mine
        for point, flags in mine.items():
            assert {"nosuid", "nodev"} <= flags, (point, flags)
    finally:
        await pack_backend.delete(sb)


async def test_the_shifted_repo_is_the_image_repo_but_for_owner(pack_backend: LocalBackend, pack_task: Task):
    repo = Path(pack_backend.image(pack_task.image).repo)
    shifted = _idmap.shifted_repo(repo)
    assert shifted != repo and shifted.parent == repo.parent
    assert _idmap.shifted_repo(repo) == shifted  # made once
    # Access times aside: reading the image's repo (cp -a did, to copy it) moves its own.
    assert (_overlay.tree_equal(str(shifted), str(repo), atime=False)
            and _overlay.tree_equal(str(repo), str(shifted), atime=False))
    assert {st.st_uid for _, st in _walk(shifted)} == {_idmap.HOST_UID}
    # The image directory itself is as it was: old code on the same cache keeps working.
    assert {st.st_uid for _, st in _walk(repo)} == {0}


async def test_attacked_sandbox_resets_in_place_and_grades_gold_1_and_empty_0(pack_task: Task):
    async with SandboxPool(LocalBackend(), "reuse", PoolLimits(max_live=1)) as pool:
        async with pool.claim(pack_task) as lease:
            res = await lease.exec(_ATTACK, timeout=60)
            assert "DONE" in res.text, res.err_text
            tracked = res.text.split("TRACKED ")[1].split()[0]
            first = lease.id
        await until(lambda: pool.counters.resets, "the in-place reset")
        async with pool.claim(pack_task) as lease:
            assert lease.id == first and pool.counters.quarantines == 0
            res = await lease.exec(f"git status --porcelain --ignored; ls -A /tmp /dev/shm /dev/mqueue; "
                                   f"stat -c %a {tracked}")
            mode = stat.S_IMODE(os.stat(Path(LocalBackend().image(pack_task.image).repo) / tracked).st_mode)
            assert sorted(res.text.split()) == sorted(["/tmp:", "/dev/shm:", "/dev/mqueue:", f"{mode:o}"]), res.text
            empty = await grade(lease.sandbox, pack_task, timeout=600)
        await until(lambda: pool.counters.resets >= 2, "the second in-place reset")
        async with pool.claim(pack_task) as lease:
            assert lease.id == first
            await lease.write_file("/tmp/gold.patch", pack_task.patch.encode())
            res = await lease.exec("git apply /tmp/gold.patch", timeout=60)
            assert res.ok, res.err_text
            gold = await grade(lease.sandbox, pack_task, timeout=600)
        assert (empty.reward, gold.reward) == (0.0, 1.0), (empty, gold)
        assert pool.counters.quarantines == 0 and pool.counters.created == 1


def test_host_binds_only_what_the_sandbox_uid_cannot_reach_and_parses_arguments_as_arguments():
    src = sandpool_home() / "test-images"  # below /root (0700): out of reach of the sandbox uid
    user = FIRST + _idmap.SANDBOX_UID  # a sandbox's uid on the host
    assert not _idmap.reachable(src, user) and _idmap.reachable("/usr/bin", user)
    where = Path(f"/run/sandpool/test-{secrets.token_hex(4)}") / "sb"
    argv = ["--setenv", "X", "--ro-bind", "--ro-bind", str(src), "/x", "--ro-bind", "/usr", "/usr",
            "/bin/true", "--ro-bind", str(src), "/y"]
    try:
        out = _idmap.publish_binds(argv, where, user)
        assert out == ["--setenv", "X", "--ro-bind", "--ro-bind", str(where / "b0"), "/x",
                       "--ro-bind", "/usr", "/usr", "/bin/true", "--ro-bind", str(src), "/y"]
        points = {ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()}
        assert str(where / "b0") in points and sorted(os.listdir(where / "b0")) == sorted(os.listdir(src))
        with pytest.raises(OSError):  # read-only: nothing of the image can be changed through it
            (where / "b0" / "probe").write_text("x")
        with pytest.raises(ValueError, match="--new-option"):
            _idmap.publish_binds(["--new-option", "/bin/true"], where, user)
    finally:
        assert _idmap.unpublish(where)
        where.rmdir()
        where.parent.rmdir()
    assert not where.exists() and sorted(os.listdir(src))  # the source itself is untouched
