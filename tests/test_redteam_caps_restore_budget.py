"""Red-team of three local-backend fixes, as a policy with shell access would attack them.

1. A restore of an unchanged snapshot onto a reset sandbox (an empty layer over the image):
   no state of the policy that held the sandbox before (a fix, an ignored file, ``.git``
   plants, ``/tmp``, ``/dev/shm``) shows in the restored claim, and the hash check holds.
2. The agent's read cap and output cap: many concurrent reads at the cap, and both streams
   at the output cap, under a small memory budget, are the policy's result, never infra;
   so are such answers while the policy keeps the sandbox's CPU busy (the agent outweighs
   the commands' work group).
3. Budget counts baselined at each ``kill_strays``: a policy's fork racer left at the end
   of its rollout cannot make the next, honest, rollout's infra death its 0.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sandpool.core import Outcome, PoolLimits, ResourceLimits, SandboxPool, run_rollout
from sandpool.core.agent.client import READ_MAX
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.grading import grade

from .test_death_by_evidence import honest_after_a_host_kill

_PLANT = ("git apply /tmp/gold.patch && echo leaked > ignored.txt && echo ignored.txt >> .git/info/exclude"
          " && printf '#!/bin/sh\\nexit 0\\n' > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit"
          " && git update-index --assume-unchanged calc.py && echo tmp > /tmp/leak && echo shm > /dev/shm/leak")
_LOOK = ("cat calc.py; ls -a; cat .git/info/exclude 2>/dev/null; ls .git/hooks; git ls-files -v;"
         " ls -a /tmp /dev/shm; git status --porcelain --ignored")


async def test_a_restored_unchanged_snapshot_holds_nothing_of_the_last_holder(test_images_root, calc_task):
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        async with pool.claim(calc_task) as lease:
            pristine = (await lease.exec(_LOOK)).text
            snap = await lease.snapshot()
            first = lease.id
        # The next holder takes the same sandbox from the snapshot, plants, and releases it.
        async with pool.claim(calc_task, from_snapshot=snap) as lease:
            assert lease.id == first
            await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
            res = await lease.exec(_PLANT)
            assert res.ok, res.text
        async with pool.claim(calc_task, from_snapshot=snap) as lease:
            assert lease.id == first and pool.counters.quarantines == 0, pool.counters.quarantine_reasons
            assert await lease.sandbox.state_hash() == snap.content_hash
            assert (await lease.exec(_LOOK)).text == pristine
            assert (await grade(lease, calc_task)).reward == 0.0  # the gold fix did not carry over
            await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
            assert (await lease.exec(_PLANT)).ok
        async with pool.claim(calc_task) as lease:  # a plain claim after a restored holder's plants
            assert lease.id == first and (await lease.exec(_LOOK)).text == pristine


async def test_a_snapshot_of_only_tmp_restores_it_onto_a_reset_sandbox(test_images_root, calc_task):
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        async with pool.claim(calc_task) as lease:
            assert (await lease.exec("echo mine > /tmp/only")).ok
            snap = await lease.snapshot()
            want = (await lease.exec(_LOOK)).text
            first = lease.id
            await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
            assert (await lease.exec(_PLANT)).ok  # after the snapshot: none of it is the snapshot's
        async with pool.claim(calc_task, from_snapshot=snap) as lease:
            assert lease.id == first and pool.counters.quarantines == 0, pool.counters.quarantine_reasons
            assert await lease.sandbox.state_hash() == snap.content_hash
            assert (await lease.exec(_LOOK)).text == want


async def _reads_at_the_cap(lease) -> float:
    assert (await lease.exec(f"head -c {READ_MAX} /dev/urandom > /tmp/at")).ok
    await asyncio.gather(*(lease.read_file("/tmp/at") for _ in range(16)))
    return 1.0


async def _both_streams_at_the_cap(lease) -> float:
    res = await lease.exec("head -c 200M /dev/urandom; head -c 200M /dev/urandom >&2",
                           max_output=1 << 30, timeout=300)
    return 1.0 if res.ok else 0.0


@pytest.mark.parametrize("episode", [_reads_at_the_cap, _both_streams_at_the_cap])
async def test_answers_at_the_caps_under_a_small_budget_are_never_infra(test_images_root, calc_task,
                                                                        episode):
    # Sixteen concurrent reads of READ_MAX bytes, or both streams of one command at the
    # output cap, under a 128 MiB budget: the policy's result, never an infra failure.
    backend = LocalBackend(test_images_root, limits=ResourceLimits(memory_bytes=128 << 20))
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        result = await run_rollout(pool, calc_task, episode, checkpoint="step")
    print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:300])
    assert result.outcome != Outcome.INFRA_FAILED, (result.error_kind, result.error)
    assert pool.counters.infra_errors == {}, pool.counters.infra_errors


async def test_a_fork_racer_left_by_a_starving_policy_is_no_evidence_against_the_next(test_images_root,
                                                                                      calc_task):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(pids=64))
    used: list[str] = []
    refused: list[int] = []

    async def starve(lease) -> float:
        # Fill the pid budget, then leave racers that re-fork as fast as they can, detached,
        # so that the reset's kill and the mark after it race forks refused at the limit.
        used.append(lease.sandbox.id)
        await lease.exec("for i in 1 2 3 4 5 6; do setsid sh -c 'while :; do (sh -c \"sleep 1000\" &) ;"
                         " done' >/dev/null 2>&1 & done; sleep 3", timeout=30)
        group = Path(f"/sys/fs/cgroup/pids/sandpool/{backend.run_id}/{lease.sandbox.id}")
        refused.append(int((group / "pids.events").read_text().split()[1])
                       + int((group / "work" / "pids.events").read_text().split()[1]))
        return 0.0

    # The pause: a racer that survived the reset would spend pids then.
    honest = honest_after_a_host_kill(calc_task, used, pause_s=2.0)

    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        await run_rollout(pool, calc_task, starve)
        second = await run_rollout(pool, calc_task, honest, rollout=1)
    assert used[1] == used[0], "the second rollout must reuse the starved sandbox"
    assert refused and refused[0] > 0, "the racers must have reached the pid limit"
    assert (second.outcome, second.reward) == (Outcome.COMPLETED, 1.0), second
    assert pool.counters.infra_errors.get("sandbox_died") == 1, pool.counters.infra_errors


async def test_a_read_of_a_file_growing_past_the_cap_is_its_data_or_efbig(local_backend):
    from sandpool.core import errors

    from .conftest import CALC_IMAGE
    sb = await local_backend.create(CALC_IMAGE)
    assert (await sb.exec(f"head -c {READ_MAX - 4096} /dev/zero > /tmp/grow")).ok
    writer = asyncio.create_task(sb.exec("while :; do head -c 65536 /dev/zero >> /tmp/grow; done", timeout=60))
    outcomes = set()
    for _ in range(20):
        try:
            outcomes.add(len(await sb.read_file("/tmp/grow")) <= READ_MAX)
        except errors.SandboxFileError as exc:
            outcomes.add(exc.errno)
    writer.cancel()
    await sb.kill_strays()
    assert outcomes <= {True, 27}, outcomes  # 27: EFBIG
    assert sb.alive() and (await sb.exec("echo ok")).text == "ok\n"


async def test_a_fix_that_prints_both_streams_at_the_cap_in_grading_is_scored(test_images_root, calc_task):
    async def episode(lease) -> float:
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch && printf '%s\\n' 'import atexit, os' "
                                 "'atexit.register(lambda: (os.write(1, os.urandom(200 << 20)), "
                                 "os.write(2, os.urandom(200 << 20))))'"
                                 " >> calc.py")).ok
        return (await grade(lease, calc_task)).reward

    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        result = await run_rollout(pool, calc_task, episode)
    print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:300])
    assert result.outcome != Outcome.INFRA_FAILED, (result.error_kind, result.error)
    assert pool.counters.infra_errors == {}, pool.counters.infra_errors


@pytest.mark.parametrize("size", [4096, READ_MAX])
async def test_a_policy_starving_the_agents_cpu_during_reads_is_not_infra(test_images_root, calc_task, size):
    # The agent shares the sandbox's CPU quota with the policy's processes. When they shared
    # one group, 100 spinners left it 1/101 of a core, and four answers of READ_MAX bytes
    # (read, base64, JSON) then took longer than the host's 60 s wait for a read (4 KiB
    # answers did not). The commands' work group now weighs a ninth against the agent.
    async def episode(lease) -> float:
        assert (await lease.exec(f"head -c {size} /dev/urandom > /tmp/at; for i in $(seq 100);"
                                 " do sh -c 'while :; do :; done' >/dev/null 2>&1 & done", timeout=120)).ok
        await asyncio.gather(*(lease.read_file("/tmp/at") for _ in range(4)))
        return 1.0

    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        result = await run_rollout(pool, calc_task, episode, retries=0)
    print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:300])
    assert result.outcome != Outcome.INFRA_FAILED, (result.error_kind, result.error)


async def test_shm_filling_the_commands_memory_before_grading_is_scored_not_infra(test_images_root, calc_task):
    # /dev/shm's pages stay charged to the commands' memory group after kill_strays (its tmpfs
    # is new only at the reset): grading's own commands then start in a full group.
    async def episode(lease) -> float:
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        await lease.exec("head -c 300M /dev/zero > /dev/shm/fill", timeout=60)
        return (await grade(lease, calc_task)).reward

    backend = LocalBackend(test_images_root, limits=ResourceLimits(memory_bytes=256 << 20))
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        result = await run_rollout(pool, calc_task, episode, retries=0)
    print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:400])
    assert result.outcome != Outcome.INFRA_FAILED, (result.error_kind, result.error)


async def test_a_policy_starving_the_agents_cpu_during_a_large_output_is_not_infra(test_images_root, calc_task):
    # As for reads: the answer to a command printing 32 MiB, under 100 spinners, took longer
    # than the command's timeout plus the host's 10 s grace.
    async def episode(lease) -> float:
        assert (await lease.exec(f"head -c {READ_MAX} /dev/urandom > /tmp/at; for i in $(seq 100);"
                                 " do sh -c 'while :; do :; done' >/dev/null 2>&1 & done", timeout=120)).ok
        await lease.exec("cat /tmp/at", timeout=20, max_output=READ_MAX)
        return 1.0

    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        result = await run_rollout(pool, calc_task, episode, retries=0)
    print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:300])
    assert result.outcome != Outcome.INFRA_FAILED, (result.error_kind, result.error)
