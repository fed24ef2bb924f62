"""In-place reset and git-metadata restore against a cheating policy, on real bubblewrap sandboxes.

Each test plays the policy: it leaves git state (stash, commits, branches, tags, reflog,
packed refs, dangling objects, replace refs, a changed index), planted code (hooks, a filter
driver with ``.git/info/attributes``, ``core.fsmonitor``, ``core.hooksPath``, a global
``~/.gitconfig``) and state outside the repo (``/tmp``, ``/dev/shm``, System V IPC), then
checks from the next rollout of the same sandbox (``reuse``, ``max_live=1``) that none of it is
reachable and that no planted code ever ran: every hook and filter would write a marker file.
The repo is compared with the image's on the host, independently of the reset's own check.
"""

from __future__ import annotations

import hashlib
import shlex
import os
import stat
import subprocess
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, SandboxPool, errors
from sandpool.core.agent.client import AgentClient
from sandpool.core.backends.local import _idmap, _overlay
from sandpool.core.backends.local import LocalBackend, image_dir
from sandpool.core.reset import SAFE_GIT, restore_git_metadata

from .conftest import CALC_IMAGE

# Every planted hook, filter and fsmonitor appends its name here; the directory is the
# sandbox's /tmp for hooks run by git in the rollout and survives into nothing (see the
# tests: they look for it after git ran, in the same rollout or the next one).
MARK = "/tmp/planted-code-ran"
PLANT = f"""
set -e
hook='#!/bin/sh
echo "$0" >> {MARK}'
for h in post-checkout pre-commit post-commit post-index-change reference-transaction \\
         pre-auto-gc post-rewrite applypatch-msg pre-applypatch post-applypatch; do
  printf '%s\\n' "$hook" > .git/hooks/$h; chmod +x .git/hooks/$h
done
mkdir -p /tmp/hooks && cp .git/hooks/post-checkout /tmp/hooks/
git config filter.evil.smudge "sh -c 'echo smudge >> {MARK}; cat'"
git config filter.evil.clean "sh -c 'echo clean >> {MARK}; cat'"
git config filter.evil.required true
printf '*.py filter=evil\\n' > .git/info/attributes
git config user.name policy
git config include.path /tmp/evil.gitconfig
printf '[core]\\n\\tfsmonitor = "sh -c \\\\"echo fsmonitor >> {MARK}\\\\""\\n' > /tmp/evil.gitconfig
printf '[core]\\n\\thooksPath = /tmp/hooks\\n[filter \\"evil\\"]\\n\\tsmudge = sh -c \\"echo global >> {MARK}; cat\\"\\n' > /tmp/.gitconfig
mkdir -p /tmp/.config/git && printf '*.py filter=evil\\n' > /tmp/.config/git/attributes
"""
CHEAT = f"""
set -e
echo stashed-answer >> calc.py && git stash -q
echo committed-answer >> calc.py && git commit -qam policy-commit
git checkout -qb other && git tag policy-tag && git tag -a -m annotated policy-annotated
git pack-refs --all
echo dangling-answer | git hash-object -w --stdin > /tmp/dangling
git replace -f $(git rev-parse HEAD:test_calc.py) $(cat /tmp/dangling)
git checkout -q --detach main 2>/dev/null || git checkout -q --detach HEAD~1
echo worktree-answer >> calc.py && echo new > added.py && git add added.py
git update-index --skip-worktree test_calc.py
chmod +x calc.py && touch -d 2001-01-01 test_calc.py && mkfifo fifo
mkdir -p deep/er && echo x > deep/er/f && chmod 000 deep
rm -rf .git/logs && mkdir -p .git/objects/info && echo /tmp/alt > .git/objects/info/alternates
echo /tmp/elsewhere > .git/info/grafts
python -c "import os; os.setxattr('.gitignore', 'user.answer', b'42')"
echo shm > /dev/shm/answer && ipcmk -M 64 >/dev/null && echo t > /tmp/answer
{PLANT}
"""


def _manifest(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (not following symlinks): type, mode, mtime, content hash or
    link target. ``.git/index`` and directory mtimes are left out: sandpool refreshes git's
    stat cache after a reset, as for a fresh sandbox; the index's entries are compared with
    ``git ls-files`` instead."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel == ".git/index":
                continue
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode))
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p), st.st_mtime_ns)
            else:
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns,
                            hashlib.sha256(p.read_bytes()).hexdigest(), os.listxattr(p))
    return out


async def _sandbox_manifest(lease) -> dict[str, tuple]:
    # The same manifest computed inside the sandbox, over its /testbed.
    res = await lease.exec(
        "python - <<'EOF'\n"
        "import hashlib, json, os, stat\n"
        "out = {}\n"
        "for d, dn, fn in os.walk('/testbed'):\n"
        "    for n in dn + fn:\n"
        "        p = os.path.join(d, n); rel = os.path.relpath(p, '/testbed'); st = os.lstat(p)\n"
        "        if rel == '.git/index': continue\n"
        "        if stat.S_ISDIR(st.st_mode): out[rel] = ['d', stat.S_IMODE(st.st_mode)]\n"
        "        elif stat.S_ISLNK(st.st_mode): out[rel] = ['l', os.readlink(p), st.st_mtime_ns]\n"
        "        else: out[rel] = ['f', stat.S_IMODE(st.st_mode), st.st_mtime_ns,"
        " hashlib.sha256(open(p, 'rb').read()).hexdigest(), os.listxattr(p)]\n"
        "print(json.dumps(out))\nEOF", timeout=60)
    assert res.ok, res.err_text
    import json
    return {k: tuple(v) for k, v in json.loads(res.text).items()}


def _host_git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture
def calc_repo(test_images_root, calc_commits) -> Path:
    return image_dir(test_images_root, CALC_IMAGE) / "repo"


async def test_cheating_rollout_leaves_nothing_reachable_and_its_planted_code_never_runs(
    test_images_root, calc_task, calc_repo
):
    image_view = {
        "log": _host_git(calc_repo, "log", "--all", "--format=%H"),
        "refs": _host_git(calc_repo, "for-each-ref"),
        "config": _host_git(calc_repo, "config", "--local", "--list"),
        "ls-files": _host_git(calc_repo, "ls-files", "-s", "-v"),
        "fsck": _host_git(calc_repo, "fsck", "--unreachable", "--dangling", "--no-progress"),
    }
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        async with pool.claim(calc_task) as lease:
            res = await lease.exec(CHEAT, timeout=60)
            assert res.ok, res.err_text
            first = lease.id
        assert pool.counters.resets == 1 and pool.counters.quarantines == 0
        async with pool.claim(calc_task) as lease:
            assert lease.id == first  # the same sandbox, reset in place
            assert await _sandbox_manifest(lease) == _manifest(calc_repo)

            async def git(*args: str) -> str:
                r = await lease.exec(["git", *args], timeout=30)
                assert r.ok, r.err_text
                return r.text

            assert await git("log", "--all", "--format=%H") == image_view["log"]
            assert await git("for-each-ref") == image_view["refs"]
            assert await git("config", "--local", "--list") == image_view["config"]
            assert await git("ls-files", "-s", "-v") == image_view["ls-files"]
            assert await git("stash", "list") == ""
            assert await git("reflog", "--all") == _host_git(calc_repo, "reflog", "--all")
            assert await git("fsck", "--unreachable", "--dangling", "--no-progress") == image_view["fsck"]
            assert "stashed-answer" not in await git("log", "--all", "-p", "--reflog")
            assert (await git("cat-file", "-p", f"HEAD:test_calc.py")).startswith("from calc")
            # What a grader and the next policy run: no planted hook, filter or fsmonitor fires.
            await git("checkout", calc_task.base_commit, "--", "test_calc.py")
            await git("status")
            await git("commit", "-q", "--allow-empty", "-m", "next rollout")
            outside = await lease.exec(f"ls -A /tmp /dev/shm; cat /proc/sysvipc/shm | tail -n +2;"
                                       f" test ! -e {MARK}")
            assert outside.ok and sorted(outside.text.split()) == ["/dev/shm:", "/tmp:"], outside.text
            assert await lease.sandbox.processes() == []


async def test_policy_cannot_write_outside_repo_tmp_and_shm(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    for path in ("/dev/x", "/x", "/root/x", "/opt/sandpool/image/x", "/testbed/../x", "/usr/x",
                 "/etc/x", "/opt/sandpool/x"):
        res = await sb.exec(f"echo x > {path}")
        assert not res.ok, path
    assert (await sb.exec("echo x > /dev/shm/x && echo x > /dev/mqueue/x 2>/dev/null; ls /dev/shm")).text == "x\n"


async def test_restore_git_metadata_disarms_planted_code_and_keeps_the_policy_s_tree(
    local_backend, calc_task, calc_repo
):
    sb = await local_backend.create(CALC_IMAGE)
    res = await sb.exec("echo fixed >> calc.py && echo new > added.py &&"
                        " git update-index --skip-worktree test_calc.py && echo 'assert True' > test_calc.py"
                        + PLANT, timeout=60)
    assert res.ok, res.err_text
    # A process that keeps re-planting the hook until it is killed; wait for its first lap.
    res = await sb.exec("(while :; do cp /tmp/hooks/post-checkout .git/hooks/; echo lap > /tmp/loop;"
                        " sleep 0.01; done) >/dev/null 2>&1 & while [ ! -e /tmp/loop ]; do sleep 0.01; done",
                        timeout=60)
    assert res.ok, res.err_text
    await restore_git_metadata(sb)
    assert await sb.processes() == []
    # The sandbox's lower layer is the image repo's copy owned by its id range.
    assert _overlay.diff(_idmap.shifted_repo(calc_repo), sb.upper, ".git") == []
    assert (sb.upper / ".git").exists()  # the check above looked at a changed .git, restored, not an untouched one
    # Grading's git commands, through SAFE_GIT: the planted code stays inert, the policy's
    # tree is what it left, and the test file comes back from base.
    res = await sb.exec(f"{SAFE_GIT} checkout -q {calc_task.base_commit} -- test_calc.py &&"
                        f" {SAFE_GIT} status --porcelain && {SAFE_GIT} diff {calc_task.base_commit} --stat"
                        f" && test ! -e {MARK} && cat calc.py test_calc.py added.py")
    assert res.ok, res.err_text + res.text
    assert "fixed" in res.text and "new" in res.text and "def test_add" in res.text
    assert "assert True" not in res.text


async def test_restore_git_metadata_raises_when_git_cannot_be_restored(local_backend, monkeypatch):
    sb = await local_backend.create(CALC_IMAGE)
    await sb.exec("printf '#!/bin/sh\\ntrue\\n' > .git/hooks/post-checkout; chmod +x .git/hooks/post-checkout")
    real_call = AgentClient.call

    async def lying_call(self, op, wait_s, **fields):
        return {"failed": []} if op == "restore" else await real_call(self, op, wait_s, **fields)

    monkeypatch.setattr(AgentClient, "call", lying_call)
    with pytest.raises(errors.ResetError, match="post-checkout"):
        await restore_git_metadata(sb)


async def test_repo_removed_by_the_policy_is_restored_in_place(test_images_root, calc_task, calc_repo):
    # The first rollout only edits a file (its reset pins the refreshed index), the second
    # removes .git and the whole tree, the third finds the image's repo again.
    rollouts = ["echo x >> calc.py",
                "rm -rf .git && git init -q && ln -s /etc/passwd calc.py.new"
                " && rm -rf * .gitignore && mkdir calc.py"]
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        for cmd in rollouts:
            async with pool.claim(calc_task) as lease:
                assert (await lease.exec(cmd)).ok
                first = lease.id
        async with pool.claim(calc_task) as lease:
            assert lease.id == first and pool.counters.quarantines == 0 and pool.counters.resets == 2
            assert await _sandbox_manifest(lease) == _manifest(calc_repo)
            assert (await lease.exec("git rev-parse HEAD")).text.strip() == calc_task.base_commit
            res = await lease.exec(["git", "ls-files", "-s", "-v"])
            assert res.text == _host_git(calc_repo, "ls-files", "-s", "-v")
            assert (await lease.exec("git status --porcelain --ignored")).text == ""


async def test_same_size_edit_with_restored_mtime_of_a_once_restored_file_is_caught(
    test_images_root, calc_task, calc_repo
):
    # The first rollout's edit leaves a restored copy of calc.py in the upper layer; the
    # second rewrites that copy with bytes of the same size and puts its mtime back.
    original = (calc_repo / "calc.py").read_bytes()
    forged = original.replace(b"a - b", b"a + b")
    assert len(forged) == len(original) and forged != original
    rollouts = ["echo x >> calc.py",
                f"printf %s {shlex.quote(forged.decode())} > calc.py"
                " && touch -r /opt/sandpool/image/calc.py calc.py"]
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        for cmd in rollouts:
            async with pool.claim(calc_task) as lease:
                assert (await lease.exec(cmd)).ok
        async with pool.claim(calc_task) as lease:
            assert pool.counters.resets == 2 and pool.counters.quarantines == 0
            assert await lease.read_file("calc.py") == original
