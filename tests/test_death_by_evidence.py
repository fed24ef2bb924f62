"""Whose a sandbox's death is, decided by evidence, on real bubblewrap sandboxes.

The policy cannot signal its sandbox's agent (it is the sandbox's pid 1), so an agent killed
by SIGKILL from the host (its OOM killer, an operator, the node) is infra, during a command,
between steps and during grading alike: unscored and retried (NaN in Gymnasium mid-episode;
during grading, the same patch is scored again on another pristine sandbox). A death is the
policy's only when the kernel counted its sandbox's own budget exhausted (a memory-cgroup OOM
or a refused fork in the agent's group): then it is scored 0, never retried.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import warnings
from pathlib import Path

import gymnasium as gym
import pytest

from sandpool.core import Outcome, PoolLimits, ResourceLimits, SandboxPool, errors, run_rollout
from sandpool.core.agent.client import READ_MAX
from sandpool.core.backends.local import LocalBackend, LocalSandbox
from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.integrations.gymnasium import ENV_ID

from .waiting import until, wait_until


def _agent_pid(sb: LocalSandbox) -> int:
    """Host pid of the sandbox's pid 1, its agent: bubblewrap's only child."""
    children = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _running(backend: LocalBackend, needle: str) -> LocalSandbox | None:
    """The sandbox of ``backend`` in which a process runs a command line containing ``needle``
    (``\x00`` separates arguments), or None."""
    assert backend._cgroups is not None
    for sb in list(backend._live.values()):
        for pid in backend._cgroups.pids(sb.id):
            try:
                if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return sb
            except OSError:
                continue
    return None


def _kill_agent(sb: LocalSandbox) -> None:
    os.kill(_agent_pid(sb), signal.SIGKILL)  # from the host, as an OOM killer or operator would


async def _starve_agent(backend: LocalBackend, lease) -> float:
    """A fork bomb holds every pid its commands may have; commands started beside it push the
    sandbox's total to its limit, and the agent is refused threads (the policy's 0)."""
    bomb = asyncio.create_task(lease.exec(
        "for i in 1 2 3 4; do (while :; do sleep 1000 & done 2>/dev/null) & done; sleep 1000",
        timeout=300))
    group = Path(f"/sys/fs/cgroup/pids/sandpool/{backend.run_id}/{lease.sandbox.id}/work")
    await until(lambda: int((group / "pids.events").read_text().split()[1]) > 0,
                "the bomb to reach its pid limit")
    results = await asyncio.gather(*(lease.exec("sleep 2") for _ in range(60)),
                                   return_exceptions=True)
    bomb.cancel()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return 1.0


def honest_after_a_host_kill(task: Task, used: list[str], pause_s: float = 0.0):
    """An episode that applies the gold patch and grades it; on its first attempt the host
    kills the sandbox's agent between two steps (infra, retried), ``pause_s`` after step 1.
    Each attempt appends its sandbox's id to ``used``."""
    attempts = 0

    async def honest(lease) -> float:
        nonlocal attempts
        attempts += 1
        used.append(lease.sandbox.id)
        if attempts == 1:
            assert (await lease.exec("echo step 1")).ok
            await asyncio.sleep(pause_s)
            _kill_agent(lease.sandbox)
            await until(lambda: not lease.sandbox.alive(), "the killed agent's channel to close")
            await lease.exec("echo step 2")
        await lease.write_file("/tmp/gold.patch", task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        return (await grade(lease, task)).reward

    return honest


async def _rollout(backend: LocalBackend, task: Task, attack) -> tuple[object, SandboxPool]:
    """Run one rollout whose first attempt meets ``attack(lease)``; later attempts grade gold."""
    attempts = 0

    async def episode(lease) -> float:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            await attack(lease)
        await lease.write_file("/tmp/gold.patch", task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        return (await grade(lease, task)).reward

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, task, episode)
        return result, pool


async def test_agent_killed_from_the_host_during_a_command_is_infra_and_retried(test_images_root, calc_task):
    backend = LocalBackend(test_images_root)

    async def attack(lease) -> None:
        command = asyncio.create_task(lease.exec("sleep 301", timeout=120))
        _kill_agent(await until(lambda: _running(backend, "sleep\x00301"), "the command to run"))
        await command  # raises: the sandbox died under it

    result, pool = await _rollout(backend, calc_task, attack)
    assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 2), result
    assert pool.counters.infra_errors == {"sandbox_died": 1}, pool.counters.infra_errors


async def test_agent_killed_from_the_host_between_steps_is_infra_and_retried(test_images_root, calc_task):
    seen: list[str] = []

    async def attack(lease) -> None:
        assert (await lease.exec("echo step 1")).ok
        _kill_agent(lease.sandbox)
        await until(lambda: not lease.sandbox.alive(), "the killed agent's channel to close")
        try:
            await lease.exec("echo step 2")
        except errors.SandboxDied as exc:
            seen.append(str(exc))
            raise

    result, pool = await _rollout(LocalBackend(test_images_root), calc_task, attack)
    assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 2), result
    assert pool.counters.infra_errors == {"sandbox_died": 1}, pool.counters.infra_errors
    assert "killed by signal 9 (no OOM or pid-limit event in its cgroup" in seen[0], seen


async def test_agent_killed_from_the_host_during_grading_is_infra_and_retried(test_images_root, calc_task):
    backend = LocalBackend(test_images_root)

    async def attack(lease) -> None:
        async def killer() -> None:
            _kill_agent(await until(lambda: _running(backend, "pytest"), "grading's test run"))

        kill = asyncio.create_task(killer())
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        try:
            await grade(lease, calc_task)  # raises: the sandbox died while its tests ran
        finally:
            await kill

    result, pool = await _rollout(backend, calc_task, attack)
    assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 2), result
    assert set(pool.counters.infra_errors) == {"sandbox_died"}, pool.counters.infra_errors


def test_agent_killed_from_the_host_is_nan_mid_episode_and_graded_again_in_gymnasium(
        test_images_root, calc_task):
    """Mid-episode the episode ends unscored (NaN); during grading the same patch is scored
    again on another pristine sandbox: the death is counted, never a reward of its own."""
    env = gym.make(ENV_ID, tasks=[calc_task], backend_options={"images_root": str(test_images_root)},
                   step_timeout=30.0, grade_timeout=120.0)
    try:
        env.reset(seed=0)
        sb = env.unwrapped.sandbox
        _kill_agent(sb)
        wait_until(lambda: not sb.alive(), "the killed agent's channel to close")
        with warnings.catch_warnings(record=True):  # Gymnasium's checker flags a NaN (once)
            warnings.simplefilter("always")
            _, reward, term, trunc, info = env.step("echo hi")
        assert math.isnan(reward) and trunc and not term, (reward, info)
        assert info["infra_failed"] and info["error_kind"] == "sandbox_died", info

        env.reset(seed=0)
        pool = env.unwrapped.pool.pool
        env.unwrapped.write_file("/tmp/gold.patch", calc_task.patch)
        env.step("git apply /tmp/gold.patch")
        killed: list[LocalSandbox] = []

        def kill_grading() -> None:
            # The grading's isolated test run (sandbox_side/runner.py) is the sign it has begun.
            sb = wait_until(lambda: _running(pool.backend, "/runner.py"), "grading's test run")
            _kill_agent(sb)
            killed.append(sb)

        killer = threading.Thread(target=kill_grading, daemon=True)
        killer.start()
        _, reward, term, trunc, info = env.step("submit")
        killer.join()
        assert killed, "grading's test run was never seen"
        assert (reward, term, trunc, info["infra_failed"], info["resolved"]) == (1.0, True, False, False, True)
        assert pool.counters.infra_errors == {"sandbox_died": 2}, pool.counters.infra_errors
        report = env.unwrapped.report()
        assert report.failures["infra_failed"] == 1 and report.failures["completed"] == 1
    finally:
        env.close()


# -- deaths the policy's own processes caused: scored -----------------------------------------

async def test_memory_exhausted_by_the_policy_kills_the_agent_and_is_scored(test_images_root, calc_task):
    # The agent's group allows the policy's 64 MB plus the agent's own margin; the policy's
    # sparse file, read whole by the episode many times at once (each read within the agent's
    # read cap), exhausts it: the kernel kills the agent.
    backend = LocalBackend(test_images_root, limits=ResourceLimits(memory_bytes=64 * 2**20))

    async def episode(lease) -> float:
        assert (await lease.exec(f"truncate -s {READ_MAX} /tmp/answer.txt")).ok
        await asyncio.gather(*(lease.read_file("/tmp/answer.txt") for _ in range(16)))
        return 1.0

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
    assert (result.outcome, result.reward, result.attempts) == (Outcome.TASK_FAILED, 0.0, 1), result
    assert result.error_kind == "sandbox_exhausted" and "OOM killer" in (result.error or ""), result


async def test_a_fork_bomb_that_starves_the_agent_is_scored(test_images_root, calc_task):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(pids=64))

    async def episode(lease) -> float:
        return await _starve_agent(backend, lease)

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
    assert (result.outcome, result.reward, result.attempts) == (Outcome.TASK_FAILED, 0.0, 1), result
    assert result.error_kind == "sandbox_exhausted" and "pid limit" in (result.error or ""), result


@pytest.mark.parametrize("bomb", [
    "python -c 'x = [bytearray(2**20) for _ in range(4096)]'",
    "for i in 1 2 3 4; do (while :; do sleep 1000 & done 2>/dev/null) & done; sleep 5",
])
async def test_a_bomb_within_the_policys_own_budget_leaves_the_rollout_scored(test_images_root, calc_task,
                                                                             bomb):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(memory_bytes=96 * 2**20, pids=64))

    async def episode(lease) -> float:
        await lease.exec(bomb, timeout=60)
        # The kernel stopped it at the policy's own limits (an OOM kill, refused forks), in
        # the group of its commands, below the agent's.
        work = [Path(f"/sys/fs/cgroup/{c}/sandpool/{backend.run_id}/{lease.sandbox.id}/work")
                for c in ("memory", "pids")]
        oom = int((work[0] / "memory.oom_control").read_text().split("oom_kill ")[1].split()[0])
        refused = int((work[1] / "pids.events").read_text().split()[1])
        assert oom + refused > 0, (oom, refused)
        return 0.0

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
    assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 0.0, 1), result


# A reused sandbox keeps its cgroup, whose OOM and refused-fork counts only grow: they are
# evidence for the rollout that made them, never for a later rollout of the same sandbox.
async def test_a_starved_agent_of_one_rollout_is_no_evidence_against_the_next(test_images_root, calc_task):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(pids=64))
    used: list[str] = []

    async def starve(lease) -> float:
        used.append(lease.sandbox.id)
        return await _starve_agent(backend, lease)

    honest = honest_after_a_host_kill(calc_task, used)

    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        first = await run_rollout(pool, calc_task, starve)
        assert (first.outcome, first.error_kind) == (Outcome.TASK_FAILED, "sandbox_exhausted"), first
        second = await run_rollout(pool, calc_task, honest, rollout=1)
    assert used[1] == used[0], "the second rollout must reuse the starved sandbox"
    assert (second.outcome, second.reward, second.attempts) == (Outcome.COMPLETED, 1.0, 2), second
    assert pool.counters.infra_errors == {"sandbox_died": 1}, pool.counters.infra_errors
