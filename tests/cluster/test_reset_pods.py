"""The in-pod reset (the generic path: a pristine record kept on the host) against a cheating
policy, on the local cluster: the same property as the local backend's (tests/test_reset.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, SandboxPool
from sandpool.core.reset import SAFE_GIT, restore_git_metadata

from test_kubernetes_backend import backend, make_task, repo  # noqa: F401 - fixture

pytestmark = pytest.mark.cluster

MARK = "/tmp/planted-code-ran"
PLANT = f"""
set -e
printf '#!/bin/sh\\necho "$0" >> {MARK}\\n' > .git/hooks/post-checkout
chmod +x .git/hooks/post-checkout && cp .git/hooks/post-checkout .git/hooks/pre-commit
git config filter.evil.smudge "sh -c 'echo smudge >> {MARK}; cat'"
git config filter.evil.required true
printf '*.py filter=evil\\n' > .git/info/attributes
git config core.fsmonitor "sh -c 'echo fsmonitor >> {MARK}'"
"""
CHEAT = f"""
set -e
echo stashed-answer >> calc.py && git stash -q
echo committed-answer >> calc.py && git commit -qam policy-commit
git checkout -qb other && git tag policy-tag && git pack-refs --all
echo dangling-answer | git hash-object -w --stdin >/dev/null
git checkout -q --detach HEAD~1 && echo new > added.py && git add added.py
echo worktree >> calc.py && chmod +x calc.py
{PLANT}
"""


def _host_git(repo_path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo_path), *args], capture_output=True, text=True,
                          check=True).stdout


async def test_in_pod_reset_leaves_nothing_of_a_cheating_rollout(cluster, namespace, repo):
    path, first, second = repo
    be = backend(cluster, namespace, path)
    task = make_task("sandpool.test/calc:1", second)  # the repo's HEAD, as in a task image
    try:
        async with SandboxPool(be, "reuse", PoolLimits(max_live=1)) as pool:
            async with pool.claim(task) as lease:
                res = await lease.exec(CHEAT, timeout=60)
                assert res.ok, res.err_text
                sid = lease.sandbox.id
            assert pool.counters.resets == 1 and pool.counters.quarantines == 0, \
                pool.counters.quarantine_reasons
            async with pool.claim(task) as lease:
                assert lease.sandbox.id == sid

                async def git(*args: str) -> str:
                    r = await lease.exec(["git", *args], timeout=30)
                    assert r.ok, r.err_text
                    return r.text

                assert await git("log", "--all", "--format=%H") == _host_git(path, "log", "--all", "--format=%H")
                assert await git("for-each-ref") == _host_git(path, "for-each-ref")
                assert await git("config", "--local", "--list") == _host_git(path, "config", "--local", "--list")
                assert await git("stash", "list") == ""
                assert await git("fsck", "--unreachable", "--dangling", "--no-progress") == ""
                assert await git("status", "--porcelain", "--ignored") == ""
                await git("checkout", second, "--", "calc.py")
                await git("commit", "-q", "--allow-empty", "-m", "next rollout")
                assert (await lease.exec(f"test ! -e {MARK} && ls -A /tmp")).text == ""
    finally:
        await be.aclose()


async def test_restore_git_metadata_in_a_pod_disarms_planted_code(cluster, namespace, repo):
    path, first, second = repo
    be = backend(cluster, namespace, path)
    task = make_task("sandpool.test/calc:1", second)
    try:
        async with SandboxPool(be, "warm", PoolLimits(max_live=1)) as pool:
            async with pool.claim(task) as lease:
                res = await lease.exec("echo fixed >> calc.py" + PLANT, timeout=60)
                assert res.ok, res.err_text
                await restore_git_metadata(lease.sandbox)
                res = await lease.exec(f"{SAFE_GIT} checkout -q {first} -- .gitignore &&"
                                       f" {SAFE_GIT} status --porcelain; test ! -e {MARK} && cat calc.py")
                assert res.ok, res.err_text
                assert "fixed" in res.text
                cfg = await lease.exec(["git", "config", "--local", "--list"])
                assert cfg.text == _host_git(path, "config", "--local", "--list")
    finally:
        await be.aclose()
