"""What a policy leaves behind never turns its failure into an unscored infra failure.

Grading first makes ``.git`` the image's again (``restore_git_metadata``), and every reset
restores the repo and empties the scratch directories, from what the rollout left. A policy
that fails can try to make that restore fail, so that its 0 becomes a dropped, retried sample:

* a directory nested deeper than the recursion limit, with a path longer than PATH_MAX: the
  agent's recursive restore overflowed (``agent_exception``, infra);
* a disk it filled, within its own quota, when ``.git``'s files are written back: ENOSPC
  made the restore a ``ResetError`` (infra).

Now the restore is iterative and takes names relative to an open directory, and an ENOSPC on a
quota the rollout filled (read on the host) is :class:`DiskQuotaExceeded`: scored 0. Real
bubblewrap sandboxes; the rollouts grade in place with the task's harness.
"""

from __future__ import annotations

import os
import sys

import pytest

from sandpool.core import Outcome, ResourceLimits, SandboxPool, errors, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.core.reset import restore_git_metadata
from sandpool.envs.grading import grade

DEPTH = 3000  # > sys.getrecursionlimit(); 3 bytes a level: > PATH_MAX
DEEP = f"""
import os, sys
for top in sys.argv[1:]:
    os.makedirs(top, exist_ok=True)
    fd = os.open(top, os.O_RDONLY)
    for _ in range({DEPTH}):
        os.mkdir("dd", dir_fd=fd)
        fd = os.open("dd", os.O_RDONLY, dir_fd=fd)
    os.close(os.open("gold", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.chmod(fd, 0o500)  # and the deepest directory read-only
print("deep", len(sys.argv) - 1)
"""


def test_the_attack_tree_is_beyond_a_recursive_or_path_based_walk():
    assert DEPTH > sys.getrecursionlimit() and DEPTH * len("dd/") > os.pathconf("/", "PC_PATH_MAX")


async def test_a_tree_deeper_than_any_path_is_restored_and_the_rollout_is_scored(test_images_root, calc_task):
    async def episode(lease) -> float:
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        await lease.write_file("/tmp/deep.py", DEEP.encode())
        res = await lease.exec("python /tmp/deep.py .git/refs/deep .git/deep /tmp/deep /dev/shm/deep")
        assert res.text == "deep 4\n", res
        return (await grade(lease, calc_task)).reward

    async with SandboxPool(LocalBackend(test_images_root), "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
        # The next rollout gets the same sandbox, reset in place, and sees none of it.
        seen = []

        async def look(lease) -> float:
            seen.append((await lease.exec("ls -A .git/refs /tmp /dev/shm; git status --short")).text)
            return 0.0

        await run_rollout(pool, calc_task, look)
        counters = pool.counters
    assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 1), result
    assert counters.resets == 2 and counters.quarantines == 0, counters
    assert "deep" not in seen[0], seen


async def test_a_disk_filled_when_git_is_restored_is_the_policys_failure_scored_0(test_images_root, calc_task):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(disk_bytes=64 << 20))

    async def episode(lease) -> float:
        # .git's objects must be written back for grading, and no block is left for them.
        res = await lease.exec("rm -rf .git/objects; cat /dev/zero > /tmp/fill; "
                               "dd if=/dev/zero of=/tmp/fill2 bs=1k; df --output=avail -B1 /tmp | tail -1",
                               timeout=120)
        assert res.text.split()[-1] == "0", res
        return (await grade(lease, calc_task)).reward

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
        counters = pool.counters
    assert (result.outcome, result.reward, result.attempts) == (Outcome.TASK_FAILED, 0.0, 1), result
    assert result.error_kind == "disk_quota" and "disk quota has 0 bytes left" in (result.error or ""), result
    # The reset empties /tmp before it restores the repo: the sandbox is reused, not lost.
    assert counters.resets == 1 and counters.quarantines == 0, counters


async def test_a_restore_out_of_time_for_the_policys_paths_is_its_failure(test_images_root, calc_commits):
    # More paths in .git than the restore gets through in its time: the host counts them in
    # the upper layer (bounded) and finds the rollout's, not the sandbox's, doing.
    backend = LocalBackend(test_images_root)
    try:
        sb = await backend.create("sandpool.test/calc:2")
        res = await sb.exec("python -c \"import os\nos.makedirs('.git/junk')\n"
                            "for i in range(120000): os.close(os.open(f'.git/junk/{i}', os.O_CREAT))\"",
                            timeout=600)
        assert res.ok, res
        with pytest.raises(errors.SandboxExhausted, match="left over 100000 paths"):
            await restore_git_metadata(sb, timeout=1.0)
        # A few paths that take as long are not evidence: infra, as before.
        sb2 = await backend.create("sandpool.test/calc:2")
        assert (await sb2.exec("mkdir .git/slow && touch .git/slow/a")).ok
        await backend.freeze(sb2)  # the agent cannot answer: out of time, not for the policy
        try:
            with pytest.raises(errors.ExecTransportError, match="no answer to 'restore'"):
                await sb2.restore_repo(".git", timeout=1.0)
        finally:
            await backend.freeze(sb2, False)
    finally:
        await backend.aclose()
