"""A tree deeper than the host's PATH_MAX, made by a policy, snapshotted, forked, checkpointed.

Inside its sandbox a policy makes directories one ``cd`` at a time, as deep as it likes: 25
levels of 200-byte names is a path of 5 KiB below its repo (or ``/tmp``, or ``/root``), past the
4096 bytes a host path may have. A snapshot that names each entry by its full host path
fails there with ``ENAMETOOLONG``, an InfraError: the fork fails, the lease is broken, and a
checkpointed episode ends ``infra_failed``, so the policy's 0 is never scored. A snapshot
must hold the tree as it is, however deep.
"""

from __future__ import annotations

import gymnasium as gym

from sandpool.core import PoolLimits, ResourceLimits, SandboxPool
from sandpool.core.backends.local import LocalBackend
from sandpool.integrations.gymnasium import ENV_ID

#: 25 directories of 200-byte names, a file at the bottom; then the file's content, read back.
_DEEP = ("cd {top} && n=$(printf 'a%.0s' $(seq 200)) && for i in $(seq 25); do mkdir $n && cd $n"
         " || exit 1; done && echo deep > bottom.txt && echo made")
_READ = ("cd {top} && find . -name bottom.txt -execdir cat {{}} ';'"
         " && find . -name bottom.txt -printf '%d\\n'")


async def _fork_deep(backend: LocalBackend, task, tops: list[str]) -> None:
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=4)) as pool:
        async with pool.claim(task) as parent:
            for top in tops:
                assert (await parent.exec(_DEEP.format(top=top), timeout=60)).text == "made\n"
            a, b = await parent.fork(2)
            try:
                for kid in (a, b):
                    for top in tops:
                        assert (await kid.exec(_READ.format(top=top), timeout=60)).text == "deep\n26\n"
                    assert await kid.sandbox.state_hash() == kid.restored_from.content_hash
                # A child's own deep change is its own, and a snapshot of it holds it.
                assert (await a.exec(_DEEP.format(top=tops[0]).replace("mkdir $n", "mkdir -p $n"),
                                     timeout=60)).ok
                (c,) = await a.fork(1)
                await c.release()
            finally:
                await a.release()
                await b.release()
        assert pool.counters.quarantines == 0


async def test_a_fork_holds_a_tree_deeper_than_the_hosts_path_max(test_images_root, calc_task):
    await _fork_deep(LocalBackend(test_images_root, limits=ResourceLimits(disk_bytes=64 << 20)),
                     calc_task, [".", "/tmp"])


async def test_an_oci_fork_holds_a_deep_tree_in_its_repo_and_outside_it(test_images_root, oci_store,
                                                                       swe_task):
    await _fork_deep(LocalBackend(test_images_root, store=oci_store), swe_task, [".", "/root"])


def test_a_deep_tree_leaves_a_checkpointed_episode_scored_not_infra_failed(test_images_root, calc_task):
    env = gym.make(ENV_ID, tasks=[calc_task], backend_options={"images_root": str(test_images_root)},
                   step_timeout=60.0, grade_timeout=120.0, limits=PoolLimits(max_live=4),
                   checkpoint_every=1)
    try:
        env.reset(options={"task_id": calc_task.instance_id})
        obs, reward, term, trunc, info = env.step(_DEEP.format(top="/tmp"))
        assert obs["stdout"] == "made\n" and not info["infra_failed"], info
        obs, reward, term, trunc, info = env.step("submit")
        assert (reward, info["infra_failed"]) == (0.0, False), info
        assert env.unwrapped.report().failures["infra_failed"] == 0
    finally:
        env.close()
