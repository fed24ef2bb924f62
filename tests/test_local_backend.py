"""The local backend and the pool on real bubblewrap sandboxes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from sandpool.core import Outcome, PoolLimits, ResourceLimits, SandboxPool, errors, run_rollout
from sandpool.core.agent.client import AgentClient
from sandpool.core.backends.local import LocalBackend, reap_stale
from sandpool.core.backends.local._cleanup import make_run_dir

from .conftest import CALC_IMAGE
from .waiting import exec_past_marker, until


async def test_no_network(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    res = await sb.exec("python -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=2)'")
    assert res.exit_code != 0 and "Network is unreachable" in res.err_text
    res = await sb.exec("python -c 'import socket; print([n for _, n in socket.if_nameindex()])'")
    assert res.text.strip() == "['lo']"


async def test_no_writes_outside_the_workspace(local_backend, test_images_root, monkeypatch):
    sb = await local_backend.create(CALC_IMAGE)
    for path in ("/usr/sandpool-probe", "/etc/sandpool-probe", f"{local_backend.image(CALC_IMAGE).venv}/x"):
        res = await sb.exec(f"touch {path}")
        assert res.exit_code != 0 and "Read-only file system" in res.err_text, path
    res = await sb.exec("echo changed > calc.py && echo new > new.txt && cat calc.py")
    assert res.ok and res.text == "changed\n"
    lower = Path(local_backend.image(CALC_IMAGE).repo)
    assert "changed" not in (lower / "calc.py").read_text() and not (lower / "new.txt").exists()
    # The host's home, work trees and environment are not visible.
    monkeypatch.setenv("SANDPOOL_TEST_SECRET", "hunter2")
    sb = await local_backend.create(CALC_IMAGE)
    home = test_images_root.parent  # sandpool_home(): only the image directories are visible
    res = await sb.exec(f"env; ls -A {home} /root/.pyenv /work /home 2>&1")
    assert "hunter2" not in res.text and "PATH=" in res.text
    # Only the image's own directories are mounted: not the host's work tree, other images
    # or the backend's state (where other sandboxes' layers live).
    assert "No such file or directory" in res.text and "local" not in res.text.split()
    assert sorted(res.text.split(f"{home}:")[1].split("\n\n")[0].split()) == ["test-images"]


async def test_timeout_kills_the_whole_process_group(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    # A timeout from 1 s up, until the command had started its children before it fired.
    res = await exec_past_marker(sb, "sleep 300 & (setsid sleep 301 &); echo started; sleep 302",
                                 "started")
    # 124 and the flag (a finished command would be 0; one the agent waited out, no answer
    # before the transport timeout), and nothing left: killed at the timeout, escapee too.
    assert res.timed_out and res.exit_code == 124 and res.text == "started\n"
    assert await sb.processes() == []


async def test_background_child_does_not_hold_the_exec(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    res = await sb.exec("sleep 60 & echo bg", timeout=30)
    assert res.ok and res.text == "bg\n" and not res.timed_out
    assert any("sleep 60" in p for p in await sb.processes())


async def test_output_is_capped_and_flagged(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    res = await sb.exec("head -c 300000 /dev/zero; head -c 10 /dev/zero >&2", max_output=1000)
    assert len(res.stdout) == 1000 and res.stdout_truncated
    assert len(res.stderr) == 10 and not res.stderr_truncated


async def test_exit_codes_and_binary_files(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    assert (await sb.exec("exit 3")).exit_code == 3
    assert (await sb.exec("kill -9 $$")).exit_code == 137
    assert (await sb.exec(["/bin/no-such-binary"])).exit_code == 127
    blob = bytes(range(256)) * 64
    await sb.write_file("/tmp/blob.bin", blob)
    assert await sb.read_file("/tmp/blob.bin") == blob
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing.txt")


async def test_cpu_memory_and_pid_limits_are_enforced(test_images_root, calc_commits):
    limits = ResourceLimits(cpus=0.5, memory_bytes=128 * 2**20, pids=40)
    backend = LocalBackend(test_images_root, limits=limits)
    try:
        sb = await backend.create(CALC_IMAGE)
        res = await sb.exec("python -c 'x = bytearray(512 * 2**20); print(len(x))'", timeout=60)
        assert res.exit_code == 137, res  # OOM-killed by the memory cgroup
        res = await sb.exec("for i in $(seq 1 80); do sleep 5 & done 2>&1; wait", timeout=60)
        assert "Resource temporarily unavailable" in res.text + res.err_text
        quota = Path(f"/sys/fs/cgroup/cpu/sandpool/{backend.run_id}/{sb.id}/cpu.cfs_quota_us")
        if quota.exists():  # cgroup v1 (this machine); v2 keeps cpu.max instead
            assert quota.read_text().strip() == "50000"
    finally:
        await backend.aclose()


async def test_sandbox_dies_with_its_runner(test_images_root, calc_commits):
    """kill -9 of the runner leaves no sandbox process; the next preflight reaps its state."""
    # A state directory of its own: in the shared one, any other run's preflight may reap
    # the dead run first.
    state = test_images_root.parent / f"test-state-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent(f"""
        import asyncio, sys
        from sandpool.core.backends.local import LocalBackend
        async def main():
            b = LocalBackend({str(test_images_root)!r}, state_root={str(state)!r})
            sb = await b.create({CALC_IMAGE!r})
            await sb.exec("sleep 600 &")
            print(sb.pid, b.run_id, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid, run_id = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    await until(lambda: not Path(f"/proc/{pid}").exists(), "the sandbox to die with its runner")
    try:
        assert reap_stale(state) == [run_id]
        assert not (state / run_id).exists()
        assert run_id not in Path("/proc/self/mountinfo").read_text()
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_a_run_directory_is_never_reaped_while_it_is_being_made(tmp_path):
    """A run's state directory appears with its owner in it (one rename), and a directory still
    being made is left alone: another run's preflight, reaping, never removes a live run's."""
    being_made = tmp_path / ".0123abcd-x1"  # make_run_dir's name before its rename
    being_made.mkdir()
    ownerless = tmp_path / "89abcdef"  # a run killed before it wrote its owner
    ownerless.mkdir()
    make_run_dir(tmp_path / "fedcba98")
    assert (tmp_path / "fedcba98" / "owner.pid").read_text() == str(os.getpid())
    assert reap_stale(tmp_path) == ["89abcdef"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".0123abcd-x1", "fedcba98"]


async def test_dead_agent_is_sandbox_died(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    local_backend.kill(sb)
    await until(lambda: not sb.alive(), "the killed sandbox's channel to close")
    with pytest.raises(errors.SandboxDied):
        await sb.exec("true")


async def test_unknown_image_names_the_fix(local_backend):
    with pytest.raises(errors.ImageNotFound, match="build-pack"):
        await local_backend.create("sandpool.local/nope:0")


async def test_reset_removes_modified_untracked_ignored_files_and_processes(
    test_images_root, calc_task
):
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=1)) as pool:
        async with pool.claim(calc_task) as lease:
            await lease.exec("echo x >> calc.py; echo y > untracked.py; echo z > debug.log;"
                             " mkdir -p __pycache__ && touch __pycache__/a.pyc; echo t > /tmp/t;"
                             " git commit -qam wip; sleep 500 &")
            first = lease.id
        await pool.wait_warm()
        await until(lambda: pool.counters.resets, "the in-place reset")
        async with pool.claim(calc_task) as lease:
            assert lease.id == first  # reused in place, not recreated
            res = await lease.exec("git status --porcelain --ignored; git rev-parse HEAD; ls -A /tmp")
            assert res.text.split() == [calc_task.base_commit]
            assert await lease.sandbox.processes() == []
        assert pool.counters.created == 1 and pool.counters.quarantines == 0


async def test_reset_that_does_not_take_is_caught_by_verification_and_quarantined(
    test_images_root, calc_task, monkeypatch
):
    # The agent answers "restored" but does nothing (a broken or subverted agent): the host
    # compares the overlay with the image itself, so the sandbox is quarantined, not reused.
    real_call = AgentClient.call

    async def lying_call(self, op, wait_s, **fields):
        return {"failed": []} if op == "restore" else await real_call(self, op, wait_s, **fields)

    monkeypatch.setattr(AgentClient, "call", lying_call)
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=2)) as pool:
        async with pool.claim(calc_task) as lease:
            # The restore in place (an OCI sandbox's; an image directory's swaps in a fresh
            # layer, which the agent has no part in): the agent writes the image's files back.
            lease.sandbox.fresh_layers = False
            await lease.exec("echo policy >> calc.py")
            broken = lease.id
        await until(lambda: pool.counters.quarantines, "the quarantine")
        assert pool.counters.resets == 0
        assert "calc.py differs from the image" in pool.counters.quarantine_reasons[0]
        async with pool.claim(calc_task) as lease:
            assert lease.id != broken
            assert (await lease.exec("git status --porcelain")).text == ""


async def test_sandbox_killed_mid_rollout_is_infra_failed_and_retried(test_images_root, calc_task):
    backend = LocalBackend(test_images_root)
    attempts = []

    async def episode(lease):
        attempts.append(lease.id)
        await lease.exec("true")
        if len(attempts) == 1:
            backend.kill(lease.sandbox)  # as an OOM kill or eviction would
            await until(lambda: not lease.sandbox.alive(), "the killed sandbox's channel to close")
        res = await lease.exec("python -m pytest -q test_calc.py", timeout=60)
        return 1.0 if res.ok else 0.0

    async with SandboxPool(backend, "reuse") as pool:
        retried = await run_rollout(pool, calc_task, episode, retries=1)
        attempts.clear()
        exhausted = await run_rollout(pool, calc_task, episode, retries=0)
    assert retried.outcome is Outcome.COMPLETED and retried.attempts == 2 and retried.reward == 0.0
    assert exhausted.outcome is Outcome.INFRA_FAILED and exhausted.reward is None
    assert exhausted.error_kind == "sandbox_died"
    assert pool.counters.infra_errors["sandbox_died"] == 2


@pytest.mark.parametrize("mode", [1 << 70, -1, 0o10000, "644", True, 0.5])
async def test_a_write_with_a_mode_that_is_no_permission_is_refused_before_it_is_sent(local_backend, mode):
    # Sent, such a mode broke the agent's os.open (OverflowError) and came back as an infra
    # "agent failed" error; it is the caller's bad input, named as such.
    sb = await local_backend.create(CALC_IMAGE)
    with pytest.raises(ValueError, match=r"write_file: mode must be a permission int"):
        await sb.write_file("/tmp/m", b"x", mode=mode)
    await sb.write_file("/tmp/m", b"x", mode=0o600)
    assert (await sb.exec("stat -c %a /tmp/m")).text == "600\n"


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0, True, "60"])
async def test_an_exec_timeout_that_is_no_number_of_seconds_is_refused_before_it_runs(local_backend,
                                                                                    timeout):
    # Sent, NaN came back as "no answer to 'exec' within nan s" (infra); the caller's input.
    sb = await local_backend.create(CALC_IMAGE)
    with pytest.raises(ValueError, match=r"exec: timeout must be a finite number of seconds > 0"):
        await sb.exec("touch /tmp/ran", timeout=timeout)
    assert (await sb.exec("ls /tmp/ran", timeout=30)).exit_code != 0  # nothing ran
