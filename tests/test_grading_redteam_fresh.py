"""A cheating policy against the whole grading flow, each trick played through the accountant.

Every episode here is a scripted policy that acts in its sandbox through ``lease.exec`` and
``lease.write_file`` only, graded as in training: :func:`sandpool.core.rollout.run_rollout`
with :class:`sandpool.envs.grading.DiffGrader` on a pool of real bubblewrap sandboxes. Each
test first shows the trick wins against a grader without the defence (a reward of 1 without
the fix, an unscored outcome instead of a 0, or a fix that reaches another rollout), then that
the flow scores it 0, scores it at all, or lets nothing through.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sandpool.core import Outcome, PoolLimits, ResourceLimits, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.core.task import Task
from sandpool.envs.grading import DiffGrader
from sandpool.envs.grading.harness import plan_for


async def _rollouts(backend, task: Task, *episodes, timeout: float = 120.0,
                    one_sandbox: bool = False):
    """Run ``episodes`` one after another on a reuse pool of ``backend`` (``one_sandbox``: all in
    the same sandbox, reset in place between them); their records."""
    limits = PoolLimits(max_live=1) if one_sandbox else PoolLimits()
    async with SandboxPool(backend, "reuse", limits) as pool:
        return [await run_rollout(pool, task, ep, grader=DiffGrader(timeout=timeout), rollout=i,
                                  policy=ep.__name__, retries=0)
                for i, ep in enumerate(episodes)]


async def _apply(lease, patch: str) -> None:
    await lease.write_file("/tmp/fix.patch", patch.encode())
    res = await lease.exec("git apply /tmp/fix.patch && rm /tmp/fix.patch", timeout=30)
    assert res.ok, res.err_text


# -- expected failures declared by the code under test ------------------------------------------

_XFAIL_INSTEAD_OF_A_FIX = b"""

def _sub(a, b):  # every test of add() now ends "expected to fail", which the harness passes
    import pytest
    pytest.xfail("known issue on this platform")
"""


async def _xfail_from_the_code(lease) -> None:
    buggy = await lease.read_file("calc.py")
    await lease.write_file("calc.py", buggy.replace(b"return a - b", b"return _sub(a, b)")
                           + _XFAIL_INSTEAD_OF_A_FIX)


async def test_an_xfail_raised_by_the_code_under_test_passes_the_harness_rule_and_scores_zero(
        test_images_root, calc_task):
    plan = plan_for(calc_task)
    backend = LocalBackend(test_images_root)
    async with SandboxPool(backend, "reuse") as pool:
        async with pool.claim(calc_task) as lease:  # the harness's rule on a plain run
            await _xfail_from_the_code(lease)
            plain = await lease.exec(plan.command, timeout=120)
        assert plan.score(plan.parse(plain.text))[0], "the trick should pass the harness's own rule"
        result = await run_rollout(pool, calc_task, _xfail_from_the_code,
                                   grader=DiffGrader(timeout=120))
    assert (result.outcome, result.reward, result.error_kind) == (
        Outcome.TASK_FAILED, 0.0, "tampering_suspected"), result
    assert "pytest.xfail() raised from /testbed/calc.py" in (result.error or ""), result.error


_DECLARED_XFAILS = (
    "diff --git a/test_more.py b/test_more.py\nnew file mode 100644\nindex 0000000..1111111\n"
    "--- /dev/null\n+++ b/test_more.py\n@@ -0,0 +1,11 @@\n"
    "+import pytest\n+from calc import add\n+\n+\n"
    "+def test_declared():\n+    pytest.xfail(\"the test itself says so\")\n+\n+\n"
    "+@pytest.mark.xfail(reason=\"marked\")\n+def test_marked():\n+    assert add(1, 1) == 3\n")


async def test_expected_failures_the_tests_declare_still_count_as_passed(test_images_root,
                                                                         calc_task):
    task = calc_task.model_copy(update={
        "instance_id": "calc__xfail", "test_patch": _DECLARED_XFAILS,
        "PASS_TO_PASS": ("test_calc.py::test_zero", "test_more.py::test_declared",
                         "test_more.py::test_marked")})

    async def gold(lease) -> None:
        await _apply(lease, task.patch)

    [result] = await _rollouts(LocalBackend(test_images_root), task, gold)
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result


# -- the verdict's own checks switched off by name, from the code under test ------------------

# Each one makes every test pass without running it, and keeps the verdict from saying so.
_OFF_BY_NAME = {
    # The plugin's module by its name prefix, its checks emptied, then pytest's runner patched.
    "the plugin's module state": """
import sys
if "pytest" in sys.modules:
    for _name, _m in list(sys.modules.items()):
        if _name.startswith("_sandpool_verdict_"):
            _m._WATCHED, _m._RUN_HOOKS, _m._ITEMS = [], (), {}
            _m.tampered = lambda what: None
    import _pytest.python
    _pytest.python.Function.runtest = lambda self: None
""",
    # The report's encoder, rebound to drop the list of what changed.
    "json.dumps": """
import sys
if "pytest" in sys.modules:
    import json
    _dumps = json.dumps
    def dumps(obj, *a, **k):
        if isinstance(obj, dict) and obj.get("ev") == "finish":
            obj = dict(obj, changed=[])
        return _dumps(obj, *a, **k)
    json.dumps = dumps
    import _pytest.python
    _pytest.python.Function.runtest = lambda self: None
""",
    # pluggy's hook caller, which no watched module of pytest's defines: the tests never run.
    "pluggy's HookCaller": """
import sys
if "pytest" in sys.modules:
    import pluggy
    _call = pluggy.HookCaller.__call__
    def __call__(self, *args, **kwargs):
        return [] if self.name == "pytest_runtest_call" else _call(self, *args, **kwargs)
    pluggy.HookCaller.__call__ = __call__
""",
}


@pytest.mark.parametrize("name", sorted(_OFF_BY_NAME))
async def test_checks_switched_off_by_name_fool_the_harness_rule_and_score_zero(
        test_images_root, calc_task, name):
    plan = plan_for(calc_task)

    async def switch_off(lease) -> None:
        code = _OFF_BY_NAME[name].encode()
        await lease.write_file("calc.py", code + await lease.read_file("calc.py"))

    async with SandboxPool(LocalBackend(test_images_root), "reuse") as pool:
        async with pool.claim(calc_task) as lease:
            await switch_off(lease)
            plain = await lease.exec(plan.command, timeout=120)
        assert plain.exit_code == 0 and plan.score(plan.parse(plain.text))[0], \
            "the trick should pass the harness's own rule"
        result = await run_rollout(pool, calc_task, switch_off, grader=DiffGrader(timeout=120))
    assert (result.outcome, result.reward, result.error_kind) == (
        Outcome.TASK_FAILED, 0.0, "tampering_suspected"), result
    assert "replaced during the run" in (result.error or ""), result.error


# -- the agent moved into the policy's own budget ---------------------------------------------

# Fills the memory budget of the group the commands run in with shared memory, which no
# process owns: the kernel's OOM killer then picks the biggest process in that group.
_FILL_THE_BUDGET = "dd if=/dev/zero of=/dev/shm/fill bs=1M count=400 2>/dev/null; echo filled"


def _agent_pid(sb) -> int:
    children = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


async def test_an_agent_in_the_policys_cgroup_dies_unscored_and_the_policy_cannot_put_it_there(
        test_images_root, calc_task):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(memory_bytes=128 * 2**20))
    work = [Path(f"/sys/fs/cgroup/{c}/sandpool/{backend.run_id}") for c in ("pids", "memory")]

    async def moved_then_filled(lease) -> None:
        # What a command could do while the work group's cgroup.procs files were bound into
        # the sandbox, writable by the agent's uid (which the policy's commands share).
        for group in work:
            procs = group / lease.sandbox.id / "work" / "cgroup.procs"
            procs.write_text(str(_agent_pid(lease.sandbox)))
        await lease.exec(_FILL_THE_BUDGET, timeout=120)

    async def move_then_fill(lease) -> None:
        found = await lease.exec(
            "find / -xdev -name cgroup.procs 2>/dev/null; ls /opt/sandpool; for f in "
            "/sys/fs/cgroup/*/cgroup.procs /opt/sandpool/work-cgroup/*; do echo 1 > $f; done; "
            "grep -e memory -e pids /proc/1/cgroup", timeout=60)
        assert "cgroup.procs" not in found.text and ":/work" not in found.text, found.text
        await lease.exec(_FILL_THE_BUDGET, timeout=120)

    without, with_ = await _rollouts(backend, calc_task, moved_then_filled, move_then_fill)
    assert (without.outcome, without.reward, without.error_kind) == (
        Outcome.INFRA_FAILED, None, "sandbox_died"), without
    assert with_.outcome is Outcome.TASK_FAILED and with_.reward == 0.0, with_


# -- a fix carried across the in-place reset in access times -------------------------------------

# Seven bytes of the message per path of .git (which grading leaves alone, but for the index):
# four in the seconds of a far-future access time (which no read moves), three in its ns.
_HIDE_IN_ATIMES = """
import os, sys, zlib
paths = sorted(os.path.join(r, n) for r, ds, fs in os.walk(".git") for n in ds + fs if n != "index")
data = zlib.compress(sys.stdin.buffer.read(), 9)
data = len(data).to_bytes(2, "big") + data
assert len(paths) * 7 >= len(data), (len(paths), len(data))
for i, path in enumerate(paths):
    chunk = data[7 * i:7 * i + 7].ljust(7, b"\\0")
    sec = 4_000_000_000 + int.from_bytes(chunk[:4], "big")
    mtime = os.lstat(path).st_mtime_ns
    atime = sec * 10**9 + int.from_bytes(chunk[4:], "big")
    os.utime(path, ns=(atime, mtime), follow_symlinks=False)
"""
_READ_ATIMES = """
import os, sys, zlib
paths = sorted(os.path.join(r, n) for r, ds, fs in os.walk(".git") for n in ds + fs if n != "index")
data = b""
for path in paths:
    ns = os.lstat(path).st_atime_ns
    sec, rest = divmod(ns, 10**9)
    if sec < 4_000_000_000:
        break
    data += (sec - 4_000_000_000).to_bytes(4, "big") + rest.to_bytes(3, "big")
if len(data) > 2:
    sys.stdout.buffer.write(zlib.decompress(data[2:2 + int.from_bytes(data[:2], "big")]))
"""


async def _solve_and_hide(lease) -> None:
    await _apply(lease, _GOLD[0])  # the policy's own fix, in training
    await lease.write_file("/tmp/hide.py", _HIDE_IN_ATIMES.encode())
    res = await lease.exec("git diff | python /tmp/hide.py", timeout=60)
    assert res.ok, res.err_text


async def _take_the_hidden_fix(lease) -> None:
    await lease.write_file("/tmp/read.py", _READ_ATIMES.encode())
    res = await lease.exec("python /tmp/read.py > /tmp/found.patch && test -s /tmp/found.patch && "
                           "git apply /tmp/found.patch", timeout=60)
    _FOUND.append(res.ok)


_GOLD: list[str] = []
_FOUND: list[bool] = []


async def test_a_fix_hidden_in_access_times_crosses_a_reset_that_ignores_them_and_not_ours(
        test_images_root, calc_task, monkeypatch):
    from sandpool.core.backends.local import _overlay

    _GOLD[:] = [calc_task.patch]
    _FOUND.clear()
    compare = _overlay._same_attrs

    def without_atime(u, ust, lo, lst, atime=True):  # the compare as it was: access times ignored
        return compare(u, ust, lo, lst, atime=False)

    create = LocalBackend.create

    async def restoring_in_place(self, *args, **kwargs):  # not a fresh layer: the compare decides
        sandbox = await create(self, *args, **kwargs)
        sandbox.fresh_layers = False
        return sandbox

    with monkeypatch.context() as m:
        m.setattr(_overlay, "_same_attrs", without_atime)
        m.setattr(LocalBackend, "create", restoring_in_place)
        solved, copied = await _rollouts(LocalBackend(test_images_root), calc_task, _solve_and_hide,
                                         _take_the_hidden_fix, one_sandbox=True)
    assert solved.sandbox_id == copied.sandbox_id and _FOUND == [True], (solved, copied, _FOUND)
    assert (copied.outcome, copied.reward) == (Outcome.COMPLETED, 1.0), "the trick should leak"

    _FOUND.clear()
    solved, copied = await _rollouts(LocalBackend(test_images_root), calc_task, _solve_and_hide,
                                     _take_the_hidden_fix, one_sandbox=True)
    assert solved.sandbox_id == copied.sandbox_id and (solved.reward, _FOUND) == (1.0, [False])
    assert (copied.outcome, copied.reward) == (Outcome.COMPLETED, 0.0), copied


# -- a fix passed between concurrent siblings through file locks ---------------------------------

_FILES = "sorted(p for p in (os.path.join(r, n) for r, _, fs in os.walk('/usr/share') for n in fs)" \
         " if os.path.isfile(p) and not os.path.islink(p))[:4096]"
# Holds a shared flock on file i of the list for each bit i set (the fix, compressed, behind its
# length), and an open-file-description lock whose byte range is a marker, until stdin closes.
_HOLD = f"""
import fcntl, os, struct, sys, zlib
files = {_FILES}
data = zlib.compress(sys.stdin.buffer.read(), 9)
data = len(data).to_bytes(2, "big") + data
held = []
for i in range(8 * len(data)):
    if data[i // 8] >> (7 - i % 8) & 1:
        fd = os.open(files[i], os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        held.append(fd)
mark = os.open("/tmp/mark", os.O_RDWR | os.O_CREAT)
fcntl.fcntl(mark, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0x5A4D90D, 1, 0))
open("/tmp/holding", "w").close()
import time
time.sleep(600)
"""
# A bit is set where an exclusive flock of the file is refused: another sandbox holds it.
_PROBE = f"""
import fcntl, os, zlib
files = {_FILES}

def bit(i):
    fd = os.open(files[i], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return 0
    except BlockingIOError:
        return 1
    finally:
        os.close(fd)

def read(n, at):
    return bytes(sum(bit(8 * (at + k) + j) << (7 - j) for j in range(8)) for k in range(n))

size = int.from_bytes(read(2, 0), "big")
seen = str(0x5A4D90D) in open("/proc/locks").read()
print("marker" if seen else "no-marker")
if 0 < size < 500:
    open("/tmp/found.patch", "wb").write(zlib.decompress(read(size, 2)))
"""


async def _siblings(backend, task: Task) -> tuple:
    """Two concurrent rollouts: one solves and holds its fix in locks until the other (which
    does no work of its own) has looked; (solver's record, copier's record, what it saw)."""
    holding, looked = asyncio.Event(), asyncio.Event()
    seen: list[str] = []

    async def solve_and_hold(lease) -> None:
        await _apply(lease, task.patch)
        await lease.write_file("/tmp/hold.py", _HOLD.encode())
        hold = asyncio.create_task(lease.exec("git diff | python /tmp/hold.py", timeout=600))
        while not (await lease.exec("test -e /tmp/holding", timeout=30)).ok:
            assert not hold.done(), hold.result()
        holding.set()
        await looked.wait()
        hold.cancel()

    async def copy_the_sibling(lease) -> None:
        await holding.wait()
        await lease.write_file("/tmp/probe.py", _PROBE.encode())
        res = await lease.exec("python /tmp/probe.py && git apply /tmp/found.patch", timeout=300)
        seen.append(res.text.strip() + (" applied" if res.ok else ""))
        looked.set()

    async with SandboxPool(backend, "reuse") as pool:
        solver, copier = await asyncio.gather(*(
            run_rollout(pool, task, ep, grader=DiffGrader(timeout=120), rollout=i, retries=0)
            for i, ep in enumerate((solve_and_hold, copy_the_sibling))))
    return solver, copier, seen


async def test_a_fix_passed_between_siblings_in_file_locks_crosses_shared_inodes_and_not_ours(
        test_images_root, calc_task, monkeypatch):
    from sandpool.core.backends.local import _views

    with monkeypatch.context() as m:  # every sandbox bound the host's own inodes, /proc/locks shown
        m.setattr(_views, "mount", lambda where, sources: {})
        m.setattr(_views, "devices", lambda where: [])
        solver, copier, seen = await _siblings(LocalBackend(test_images_root), calc_task)
    assert solver.sandbox_id != copier.sandbox_id and seen == ["marker applied"], (seen, solver)
    assert (copier.outcome, copier.reward) == (Outcome.COMPLETED, 1.0), "the trick should leak"

    solver, copier, seen = await _siblings(LocalBackend(test_images_root), calc_task)
    assert (solver.reward, seen) == (1.0, ["no-marker"]), (solver, seen)
    assert (copier.outcome, copier.reward) == (Outcome.COMPLETED, 0.0), copier
