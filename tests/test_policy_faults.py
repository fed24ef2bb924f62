"""The policy's own mistakes inside a real bubblewrap sandbox are its results, scored, never infra."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from sandpool.core import Outcome, SandboxPool, errors, run_rollout

from .conftest import CALC_IMAGE
from .escapees import ASK, HIDE
from .waiting import exec_past_marker


@pytest.mark.parametrize(("op", "path", "code"), [
    ("write", "/etc/foo", errno.EROFS),
    ("write", "/usr/x", errno.EROFS),
    ("write", "/testbed", errno.EISDIR),
    ("write", "calc.py/x", errno.ENOTDIR),
    ("read", "/testbed/secret", errno.EACCES),
    ("read", "/testbed", errno.EISDIR),
    ("read", "/nope/none", errno.ENOENT),
])
async def test_file_errnos_are_results_and_the_sandbox_stays_usable(local_backend, op, path, code):
    sb = await local_backend.create(CALC_IMAGE)
    assert (await sb.exec("echo s > secret && chmod 000 secret")).ok
    with pytest.raises(errors.SandboxFileError) as info:
        if op == "write":
            await sb.write_file(path, b"x")
        else:
            await sb.read_file(path)
    assert info.value.errno == code and info.value.filename == path
    assert sb.alive() and (await sb.exec("echo ok")).text == "ok\n"


async def test_an_episode_writing_where_it_may_not_is_task_failed_once(test_images_root, calc_task):
    from sandpool.core.backends.local import LocalBackend

    async def episode(lease):
        await lease.write_file("/etc/foo", b"x")
        return 1.0

    async with SandboxPool(LocalBackend(test_images_root), "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
        assert (result.outcome, result.reward, result.attempts) == (Outcome.TASK_FAILED, 0.0, 1)
        assert result.error_kind == "file_error" and "EROFS" in (result.error or "")
        # The sandbox was not marked broken: it was reset and kept, not deleted as infra.
        assert pool.counters.infra_errors == {} and pool.counters.resets == 1


async def test_an_env_cleared_double_forked_escapee_dies_with_the_timeout(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    assert (await sb.exec("sleep 600 & echo older")).ok  # started before: must survive
    # A timeout from 1 s up, until the command had forked its escapees before it fired.
    res = await exec_past_marker(sb, "(env -i setsid sh -c 'sleep 301' &); "
                                 "(env -i setsid sleep 302 &); echo forked; sleep 300", "forked")
    assert res.timed_out and res.text == "forked\n"
    procs = await sb.processes()
    assert not any("sleep 30" in p for p in procs), procs
    assert any("sleep 600" in p for p in procs), procs


def _fork_failures(backend, sb) -> int:
    """How often a fork in the sandbox hit its pid limit (the kernel's pids.events)."""
    group = Path(f"/sys/fs/cgroup/pids/sandpool/{backend.run_id}/{sb.id}")
    total = 0
    for events in (group / "pids.events", group / "work" / "pids.events"):
        if events.exists():
            total += int(events.read_text().split()[1])
    return total


async def test_a_fork_bomb_leaves_the_agent_in_control(test_images_root, calc_commits):
    from sandpool.core import ResourceLimits
    from sandpool.core.backends.local import LocalBackend

    backend = LocalBackend(test_images_root, limits=ResourceLimits(pids=64))
    try:
        sb = await backend.create(CALC_IMAGE)
        # Every pid it gets is held (sleeps), and four loops keep forking for more.
        bomb = asyncio.create_task(sb.exec(
            "for i in 1 2 3 4; do (while :; do sleep 1000 & done 2>/dev/null) & done; sleep 1000",
            timeout=120))
        async with asyncio.timeout(60):
            while _fork_failures(backend, sb) == 0:  # the kernel says the pid limit was hit
                await asyncio.sleep(0.05)
        # While the bomb holds every pid it may have, the agent still starts and runs commands.
        for _ in range(3):
            assert (await sb.exec("echo alive", timeout=30)).text == "alive\n"
        assert await sb.kill_strays() > 0
        assert (await bomb).exit_code != 0
        assert await sb.processes() == [] and sb.alive()
    finally:
        await backend.aclose()


async def test_a_memory_bomb_is_oom_killed_and_the_agent_survives(test_images_root, calc_commits):
    from sandpool.core import ResourceLimits
    from sandpool.core.backends.local import LocalBackend

    backend = LocalBackend(test_images_root, limits=ResourceLimits(memory_bytes=96 * 2**20))
    try:
        sb = await backend.create(CALC_IMAGE)
        for _ in range(3):
            res = await sb.exec("python -c 'x = [bytearray(2**20) for _ in range(4096)]'", timeout=60)
            assert res.exit_code == 137, res
        assert sb.alive() and (await sb.exec("echo ok")).text == "ok\n"
    finally:
        await backend.aclose()


async def test_a_policy_that_signals_every_process_cannot_reach_the_agent(test_images_root, calc_task):
    from sandpool.core.backends.local import LocalBackend

    async def episode(lease):
        for sig in ("-KILL", "-STOP", "-INT"):  # every process it can signal, and pid 1
            await lease.exec(f"kill {sig} -1; kill {sig} 1; sleep 1", timeout=10)
        return 1.0 if (await lease.exec("echo in-control")).text == "in-control\n" else 0.0

    async with SandboxPool(LocalBackend(test_images_root), "reuse") as pool:
        result = await run_rollout(pool, calc_task, episode)
    # The agent is the sandbox's pid 1: no signal from inside reaches it, so the sandbox
    # stays in control and killing it from inside can buy no unscored infra_failed.
    assert (result.outcome, result.reward, result.attempts) == (Outcome.COMPLETED, 1.0, 1), result


async def test_a_process_hiding_behind_its_zombie_leader_is_listed_and_killed(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    assert (await sb.exec(HIDE)).text == "hidden\n"
    assert (await sb.exec(ASK)).text == "the fix\n"  # its server thread runs on
    assert "[pid" in str(await sb.processes())
    await sb.kill_strays()
    assert (await sb.exec(ASK)).text == "nobody: Connection refused\n"
    assert await sb.processes() == []
