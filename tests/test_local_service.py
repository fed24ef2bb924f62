"""A sandbox's long-lived service process (ServiceSpec) on real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from sandpool.core import errors
from sandpool.core.backends.local import SERVICE_DIR, LocalBackend, ServiceSpec
from sandpool.core.reset import reset_in_place

from .conftest import CALC_IMAGE
from .waiting import DEADLINE_S

# The service marks itself ready by writing a file in its own directory, then waits forever.
_SERVICE = ("/bin/sh", "-c", "echo $SANDPOOL_SVC_GREETING > ready; echo $SVC_KEY > key; exec sleep 100000")
_READY = ("/bin/sh", "-c", "while [ ! -s ready ]; do sleep 0.01; done")


@pytest.fixture
async def service_backend(test_images_root, calc_commits):
    backend = LocalBackend(test_images_root, service=ServiceSpec(
        argv=_SERVICE, env={"SANDPOOL_SVC_GREETING": "hello"}, ready_argv=_READY, ready_timeout=30,
        secret_env=("SVC_KEY",)))
    await backend.preflight()
    yield backend
    await backend.aclose()


async def test_service_is_running_when_the_sandbox_is_handed_out(service_backend):
    sb = await service_backend.create(CALC_IMAGE)
    assert sb.service_dir is not None and (sb.service_dir / "ready").read_text() == "hello\n"
    res = await sb.exec(f"cat {SERVICE_DIR}/ready && pgrep -f 'sleep 100000'")
    assert res.ok and res.text.startswith("hello\n")


async def test_reset_and_kill_strays_spare_the_service(service_backend, calc_commits):
    sb = await service_backend.create(CALC_IMAGE)
    pid = (await sb.exec("pgrep -f 'sleep 100000'")).text.strip()
    await sb.exec("sleep 300 &", timeout=5)  # the policy's stray
    # Its shell forks it and exits: until the child has exec'd, ps shows it as the shell.
    deadline = time.monotonic() + DEADLINE_S
    while (procs := await sb.processes()) != ["sleep 300"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert procs == ["sleep 300"]
    outcome = await reset_in_place(sb, calc_commits["buggy"])
    assert outcome.ok, outcome.problems
    assert outcome.killed >= 1
    assert (await sb.exec(f"kill -0 {pid}")).ok  # the service lives on
    assert (await sb.exec("pgrep -x 'sleep 300'")).exit_code == 1


async def test_service_state_lives_outside_the_repo_and_tmp(service_backend):
    sb = await service_backend.create(CALC_IMAGE)
    res = await sb.exec("git status --porcelain --ignored && ls -A /tmp")
    assert res.ok and res.text == ""


async def test_each_sandbox_service_gets_its_own_secret(service_backend):
    a, b = await service_backend.create(CALC_IMAGE), await service_backend.create(CALC_IMAGE)
    ka, kb = a.service_env["SVC_KEY"], b.service_env["SVC_KEY"]
    assert len(ka) >= 32 and ka != kb
    assert (a.service_dir / "key").read_text().strip() == ka
    assert (b.service_dir / "key").read_text().strip() == kb


async def test_freeze_stops_every_process_until_thawed(service_backend):
    sb = await service_backend.create(CALC_IMAGE)
    pids = service_backend._cgroups.pids(sb.id) if service_backend._cgroups else [sb.pid]
    await service_backend.freeze(sb)
    try:
        states = {Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] for p in pids}
        # The cgroup freezer's tasks sleep uninterruptibly (D); SIGSTOP's are stopped (T).
        freezer = Path("/sys/fs/cgroup/freezer/sandpool") / service_backend.run_id / sb.id
        if (freezer / "freezer.state").exists():
            assert (freezer / "freezer.state").read_text().strip() == "FROZEN"
            assert states == {"D"}
        else:
            assert states == {"T"}
    finally:
        await service_backend.freeze(sb, frozen=False)
    assert (await sb.exec("echo thawed", timeout=10)).text == "thawed\n"


async def test_a_service_that_never_becomes_ready_fails_the_start(test_images_root, calc_commits):
    # The readiness check ends as soon as the service has exited (the event), not at a timeout
    # that a loaded machine might reach before the service printed its error.
    gone = ("/bin/sh", "-c", 'while kill -0 "$SANDPOOL_SERVICE_PID" 2>/dev/null; do sleep 0.01; done; exit 1')
    backend = LocalBackend(test_images_root, service=ServiceSpec(
        argv=("/bin/sh", "-c", "echo broken config >&2; exit 3"), ready_argv=gone))
    try:
        with pytest.raises(errors.SandboxStartError, match="broken config"):
            await backend.create(CALC_IMAGE)
        assert not backend._live
    finally:
        await backend.aclose()


@pytest.mark.parametrize("dest", ["/tmp/code", "/dev/shm/x", "relative/path"])
def test_a_service_bind_into_scratch_space_is_refused_with_the_fix(dest: str) -> None:
    # A mount point under /tmp would make every in-place reset find scratch not empty.
    with pytest.raises(errors.ConfigError, match="ServiceSpec.binds.*outside"):
        ServiceSpec(argv=("/bin/true",), binds=(("/usr", dest),))


# A service with state: a cache directory its reset empties (it needs its secret to do so).
_STATEFUL = ("/bin/sh", "-c", "mkdir -p cache; echo said-$SVC_KEY; echo ok > ready; exec sleep 100000")
_EMPTY_CACHE = ("/bin/sh", "-c", 'test -n "$SVC_KEY" && test -d /proc/$SANDPOOL_SERVICE_PID && rm -rf cache/*')


@pytest.fixture
async def stateful_backend(test_images_root, calc_commits):
    backend = LocalBackend(test_images_root, service=ServiceSpec(
        argv=_STATEFUL, ready_argv=_READY, ready_timeout=30, secret_env=("SVC_KEY",),
        reset_argv=_EMPTY_CACHE))
    await backend.preflight()
    yield backend
    await backend.aclose()


async def test_reset_runs_the_service_reset_and_reuses_the_sandbox(stateful_backend, calc_commits):
    sb = await stateful_backend.create(CALC_IMAGE)
    assert (await sb.exec(f"echo entry > {SERVICE_DIR}/cache/a && mkdir {SERVICE_DIR}/cache/d")).ok
    outcome = await reset_in_place(sb, calc_commits["buggy"])
    assert outcome.ok, outcome.problems
    assert not list((sb.service_dir / "cache").iterdir())


@pytest.mark.parametrize("plant", [
    "echo planted > {d}/config.json",                   # a file the service may read
    "echo changed > {d}/ready",                         # a fresh file, changed
    "rm {d}/ready",                                     # a fresh file, gone
    "chmod 777 {d}/cache",                              # a mode
    "ln -s /tmp {d}/cache.link",                        # a link
    "mkfifo {d}/fifo",                                  # a special file
])
async def test_reset_quarantines_a_sandbox_whose_service_directory_the_rollout_changed(
        stateful_backend, calc_commits, plant):
    sb = await stateful_backend.create(CALC_IMAGE)
    assert (await sb.exec(plant.format(d=SERVICE_DIR))).ok
    outcome = await reset_in_place(sb, calc_commits["buggy"])
    assert not outcome.ok
    assert any("service directory differs" in p for p in outcome.problems), outcome.problems


@pytest.mark.parametrize("signal", ["KILL", "STOP"])
async def test_reset_quarantines_a_sandbox_whose_service_was_killed_or_stopped(
        stateful_backend, calc_commits, signal):
    sb = await stateful_backend.create(CALC_IMAGE)
    assert (await sb.exec(f"pkill -{signal} -x sleep")).ok
    outcome = await reset_in_place(sb, calc_commits["buggy"])
    assert not outcome.ok
    assert any("its service" in p for p in outcome.problems), outcome.problems


async def test_a_failing_service_reset_quarantines(test_images_root, calc_commits):
    backend = LocalBackend(test_images_root, service=ServiceSpec(
        argv=_STATEFUL, ready_argv=_READY, secret_env=("SVC_KEY",),
        reset_argv=("/bin/sh", "-c", "test ! -e cache/poison || { echo poisoned >&2; exit 1; }")))
    try:
        sb = await backend.create(CALC_IMAGE)
        assert (await sb.exec(f"touch {SERVICE_DIR}/cache/poison")).ok
        outcome = await reset_in_place(sb, calc_commits["buggy"])
        assert not outcome.ok and "poisoned" in " ".join(outcome.problems), outcome.problems
    finally:
        await backend.aclose()


async def test_the_service_output_is_kept_on_the_host_out_of_the_sandbox(stateful_backend):
    sb = await stateful_backend.create(CALC_IMAGE)
    key = sb.service_env["SVC_KEY"]
    # What the service says (here its secret) must not reach the policy or the next rollout.
    res = await sb.exec(f'grep -rs "$K" {SERVICE_DIR} /tmp /testbed; true', env={"K": key})
    assert res.ok and key not in res.text
    assert f"said-{key}" in (sb.state_dir / "stderr.log").read_text()


@pytest.mark.parametrize("change", [
    "renice -n 19 -p $(pgrep -x sleep)",
    "taskset -p 1 $(pgrep -x sleep)",
])
async def test_reset_quarantines_a_sandbox_whose_service_priority_or_affinity_was_changed(
        stateful_backend, calc_commits, change):
    sb = await stateful_backend.create(CALC_IMAGE)
    res = await sb.exec(change)
    assert res.ok, res.err_text  # same uid: allowed without ptrace
    outcome = await reset_in_place(sb, calc_commits["buggy"])
    assert not outcome.ok
    assert any("resource limits" in p for p in outcome.problems), outcome.problems


@pytest.mark.parametrize("change", [
    "prlimit --pid $(pgrep -x sleep) --fsize=1024:1024",   # its children could not write files
    "prlimit --pid $(pgrep -x sleep) --nofile=16:16",
])
async def test_the_policy_cannot_change_the_services_limits(stateful_backend, calc_commits, change):
    sb = await stateful_backend.create(CALC_IMAGE)
    res = await sb.exec(change)
    assert not res.ok and "Operation not permitted" in res.err_text, res  # the seccomp filter
    outcome = await reset_in_place(sb, calc_commits["buggy"])
    assert outcome.ok, outcome.problems
