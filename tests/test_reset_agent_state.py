"""What a rollout sets on the agent's own process never reaches the next rollout.

A command runs as the agent's uid: it may set the agent's (pid 1's) scheduling policy, nice,
CPU affinity and I/O priority, each thread's, which the agent cannot set back without
CAP_SYS_NICE and no file the reset compares holds (and the kernel may let it write the agent's
OOM score adjustment and core dump filter). Unset, the next rollout on the same sandbox reads
them back. The local backend sets them back from the host at each in-place reset and compares
them with the fresh sandbox's; shown first without that step, then for each mark alone on
real sandboxes: the sandbox is reused (no quarantine) and the next rollout reads it as fresh.
"""

from __future__ import annotations

import json

import pytest

from sandpool.core import Outcome, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.core.reset import reset_in_place

#: Each mark alone, a statement run against the agent (pid 1 inside the sandbox).
MARKS = {
    "policy": "os.sched_setscheduler(1, os.SCHED_IDLE, os.sched_param(0))",
    "nice": "os.setpriority(os.PRIO_PROCESS, 1, 17)",
    "affinity": "os.sched_setaffinity(1, {0})",
    "ioprio": "libc.syscall(IOPRIO[1], 1, 1, 3 << 13)",  # the idle class
    "reaper thread's nice": "os.setpriority(os.PRIO_PROCESS, reaper, 13)",
    "oom_score_adj": "open('/proc/1/oom_score_adj', 'w').write('999')",
    "coredump_filter": "open('/proc/1/coredump_filter', 'w').write('0x1a5')",
}
_PRELUDE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
IOPRIO = {"aarch64": (31, 30)}.get(os.uname().machine, (252, 251))
tids = [int(t) for t in os.listdir("/proc/1/task")]
reaper = min(t for t in tids if t != 1)  # the agent's first thread, started before any request
"""
#: Every distinct thread state of the agent (policy, nice, CPUs, I/O priority) and its files.
READ = _PRELUDE + """
threads = set()
for t in tids:
    try:
        threads.add(json.dumps([os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t),
                                sorted(os.sched_getaffinity(t)), libc.syscall(IOPRIO[0], 1, t)]))
    except ProcessLookupError:
        pass  # a request's thread that ended
print(json.dumps([sorted(threads), *(open(f"/proc/1/{n}").read().strip()
                                     for n in ("oom_score_adj", "coredump_filter"))]))
"""


def _mark(what: str) -> str:
    return _PRELUDE + f"""
try:
    if {what} == -1:
        raise OSError(ctypes.get_errno(), "")
    print("marked")
except OSError as exc:
    print("refused", exc.errno)
"""


async def _run(sb, script: str) -> str:
    await sb.write_file("/tmp/.agent-state.py", script.encode())
    res = await sb.exec("python3 /tmp/.agent-state.py; rc=$?; rm -f /tmp/.agent-state.py; exit $rc")
    assert res.ok, res
    return res.text


async def test_without_the_hosts_step_the_agent_carries_the_marks_to_the_next_rollout(
        test_images_root, calc_commits):
    backend = LocalBackend(test_images_root)
    try:
        sb = await backend.create("sandpool.test/calc:2")
        fresh = await _run(sb, READ)
        sb._agent_fresh = None  # the reset as it was: nothing sets the agent's state back
        for name in ("policy", "nice", "affinity", "ioprio"):
            assert await _run(sb, _mark(MARKS[name])) == "marked\n", name
        outcome = await reset_in_place(sb, calc_commits["buggy"])
        assert outcome.ok, outcome.problems
        threads = json.loads(await _run(sb, READ))[0]
        assert threads != json.loads(fresh)[0]
        assert any(json.loads(t)[:2] == [5, 17] for t in threads), threads  # SCHED_IDLE, nice
    finally:
        await backend.aclose()


@pytest.mark.parametrize("mark", list(MARKS))
async def test_what_a_rollout_set_on_the_agent_is_set_back_for_the_next_rollout(
        test_images_root, calc_task, mark):
    read: list[str] = []
    ran_on: list[str] = []

    async def marks(lease) -> float:
        ran_on.append(lease.sandbox.id)
        read.append(await _run(lease, READ))
        said = await _run(lease, _mark(MARKS[mark]))
        assert said == "marked\n" or said.startswith("refused"), said
        if said == "marked\n":  # the mark took: the agent reads otherwise now
            assert await _run(lease, READ) != read[0]
        return 0.0

    async def reads(lease) -> float:
        ran_on.append(lease.sandbox.id)
        read.append(await _run(lease, READ))
        return 0.0

    backend = LocalBackend(test_images_root)
    try:
        async with SandboxPool(backend, "reuse") as pool:
            for episode in (marks, reads):
                result = await run_rollout(pool, calc_task, episode)
                assert result.outcome is Outcome.COMPLETED, result
            assert pool.counters.quarantines == 0 and pool.counters.created == 1, pool.counters
    finally:
        await backend.aclose()
    assert ran_on[0] == ran_on[1], ran_on
    assert read[1] == read[0], read
