"""Red-team of grading's reads of what the code under test wrote, and of the capture's inputs.

A policy with shell access whose patch runs inside the grading sandbox (the code under test
is the policy's) attacks the host side of grading: what the host parses from the test log and
the signed report, and the clean-up after the run. The honest outcome of each: scored (reward
0, ``task_failed`` or ``completed``), in bounded time, never ``infra_failed``. And the
capture, which runs git in the sandbox the policy left: FIFOs and a full disk there are the
policy's failure, scored 0.
"""

from __future__ import annotations

import time

import pytest

from sandpool.core import Outcome, PoolLimits, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.grading import DiffGrader


def _buggy_calc_with(code: str) -> bytes:
    """calc.py as the base has it (the bug unfixed), plus ``code`` run at import."""
    return ("def add(a, b):\n    return a - b\n\n\n" + code).encode()


async def _graded(test_images_root, task, episode, **grader):
    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=2)) as pool:
        t0 = time.monotonic()
        result = await run_rollout(pool, task, episode, grader=DiffGrader(timeout=60, **grader), retries=0,
                                   grade_retries=1)
        took = time.monotonic() - t0
        print("RESULT", result.outcome, result.error_kind, result.reward, round(took, 1),
              (result.error or "")[:300], pool.counters.infra_errors)
        return result, took, pool.counters.infra_errors


_NEST_THE_REPORT = """\
import atexit, glob
def _nest():
    for report in glob.glob('/tmp/.sandpool-grade-*/report.jsonl'):
        with open(report, 'ab') as f:
            f.write(b'[' * 100000 + b']' * 100000 + b'\\n')
atexit.register(_nest)
"""


async def test_a_report_line_nested_past_the_recursion_limit_is_scored_not_infra(test_images_root, calc_task):
    # The code under test appends, after pytest's own closing record, one JSON line nested
    # deeper than the host's decoder recurses: a RecursionError is no ValueError.
    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(_NEST_THE_REPORT))

    result, _, infra = await _graded(test_images_root, calc_task, episode)
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result
    assert infra == {}, infra


_SLOW_LINES = """\
import atexit, os
def _lines():
    os.write(1, b'\\nPASSED x[' + b']' * 400000 + b'\\n')
    os.write(1, b'= ' + b'1' * 40000 + b' x in 1s =\\n')
    os.write(1, b'= ' + b'1 a' * 40000 + b'\\n')
atexit.register(_lines)
"""


async def test_log_lines_made_to_backtrack_are_parsed_in_bounded_time(test_images_root, calc_task):
    # Lines after pytest's own closing line that the host's log parsers read in time
    # quadratic in their length: the host's event loop, every rollout on it, would stall.
    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(_SLOW_LINES))

    result, took, infra = await _graded(test_images_root, calc_task, episode)
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result
    assert infra == {}, infra
    assert took < 30, f"grading took {took:.0f} s"


_N = 1 << 20
#: Lines the host's log parsers once read in time quadratic in their length (1 MiB each).
_BACKTRACKING = {
    "summary of counts": "= " + "1 a" * _N,
    "a number without end": "= " + "1" * _N + " x in 1s =",
    "open parentheses": "= " + " in 1s (" * _N,
    "ids of brackets": "PASSED x[" + "]" * _N,
    "sympy's closing words": "tests finished: " * _N,
    "sympy's long count": "tests finished: " + "1" * _N + " in 1 seconds",
}


@pytest.mark.parametrize("line", list(_BACKTRACKING.values()), ids=list(_BACKTRACKING))
def test_each_log_parser_reads_a_mib_line_in_linear_time(line):
    from sandpool.envs.grading.pytest_log import parse_test_log_details
    from sandpool.envs.grading.runner_log import runner_check
    from sandpool.envs.grading.verdict import _closing_counts
    t0 = time.monotonic()
    parse_test_log_details(line)
    _closing_counts(line)
    runner_check(line, 0, resolved_by_log=True, runner="sympy")
    assert time.monotonic() - t0 < 3.0


def _links_in_the_grading_dir(seconds: float, most: int) -> str:
    # Hard links cost no inode: past the inode count, within the disk quota, for as long as
    # the test run may take (ext4 allows 65000 links to one file).
    return f"""\
import glob, os, time
_end, _n = time.monotonic() + {seconds}, 0
for _d in glob.glob('/tmp/.sandpool-grade-*/'):
    os.mkdir(_d + 'many')
    while time.monotonic() < _end and _n < {most}:
        if _n % 60000 == 0:
            _f = _d + 'many/f%d' % _n
            open(_f, 'w').close()
        os.link(_f, _d + 'many/l%d' % _n)
        _n += 1
"""


async def test_entries_left_in_the_grading_dir_cannot_make_its_cleanup_infra(test_images_root, calc_task,
                                                                             monkeypatch):
    # The code under test fills grading's private directory with directory entries, so that
    # removing it after the run takes longer than grading's wait for it (a minute takes some
    # 13 million links, made in the test run's own time): the clean-up is no infra failure.
    from sandpool.envs.grading import diff
    removed: list[bool] = []
    remove = diff._remove

    async def recorded(sandbox, d: str) -> bool:
        removed.append(await remove(sandbox, d))
        return removed[-1]

    monkeypatch.setattr(diff, "_CLEANUP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(diff, "_remove", recorded)

    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(_links_in_the_grading_dir(8, 400000)))

    result, _, infra = await _graded(test_images_root, calc_task, episode)
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result
    assert infra == {}, infra
    assert removed == [False], "the entries must have outlasted grading's wait for their removal"


def _gold_then(task, command: str):
    async def episode(lease) -> None:
        await lease.write_file("/tmp/gold.patch", task.patch.encode())
        res = await lease.exec(f"git apply /tmp/gold.patch && rm /tmp/gold.patch && {{ {command}; }}", timeout=60)
        assert res.ok, res.text + res.err_text
    return episode


@pytest.mark.parametrize("command", [
    # git opens an alternate object store's own alternates file: one with no writer blocks it.
    "rm -f .git/objects/info/alternates && mkfifo .git/objects/info/alternates",
    # An untracked FIFO, and a tracked file replaced by one.
    "mkfifo pipe",
    "mv test_calc.py /tmp/ && mkfifo test_calc.py",
], ids=["alternates", "untracked", "tracked"])
async def test_a_fifo_in_the_repo_at_capture_is_the_policys_failure(test_images_root, calc_task, command):
    result, took, infra = await _graded(test_images_root, calc_task, _gold_then(calc_task, command),
                                        capture_timeout=5)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED), result
    assert took < 30, f"the rollout took {took:.0f} s"


async def test_a_disk_filled_before_capture_is_the_policys_failure(test_images_root, calc_task):
    from sandpool.core import ResourceLimits
    episode = _gold_then(calc_task, "head -c 100M /dev/zero > /tmp/fill; df -h /tmp >&2; true")
    backend = LocalBackend(test_images_root, limits=ResourceLimits(disk_bytes=64 << 20))
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
        result = await run_rollout(pool, calc_task, episode, grader=DiffGrader(timeout=60), retries=0)
        print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:300])
        assert pool.counters.infra_errors == {}, pool.counters.infra_errors
    assert (result.outcome, result.reward, result.error_kind) == (Outcome.TASK_FAILED, 0.0, "disk_quota"), result


async def test_many_empty_untracked_files_are_refused_as_a_patch_over_the_cap(test_images_root, calc_task):
    # Empty files weigh nothing against the byte cap on the files; the patch naming them does.
    episode = _gold_then(calc_task, "mkdir many && cd many && seq 1 40000 | xargs touch")
    result, took, infra = await _graded(test_images_root, calc_task, episode)
    assert infra == {}, infra
    assert (result.outcome, result.reward, result.error_kind) == (Outcome.TASK_FAILED, 0.0, "patch_policy"), result
    assert "over the cap" in (result.error or "")


_HUGE_COUNT = """\
import atexit, os
atexit.register(lambda: os.write(1, b'\\n= ' + b'9' * 5000 + b' passed in 1s =\\n'))
"""
_INFINITE_EXIT = """\
import atexit, glob
def _finish():
    for report in glob.glob('/tmp/.sandpool-grade-*/report.jsonl'):
        with open(report, 'ab') as f:
            f.write(b'{"ev": "finish", "exitstatus": 1e400}\\n')
atexit.register(_finish)
"""


@pytest.mark.parametrize("code", [_HUGE_COUNT, _INFINITE_EXIT], ids=["log-count", "report-exit-status"])
async def test_numbers_int_refuses_in_the_log_or_report_are_scored_not_infra(test_images_root, calc_task, code):
    # A closing line's count of 5000 digits (int() refuses over 4300), and an exit status
    # the decoder reads as an infinite float (int() overflows).
    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(code))

    result, _, infra = await _graded(test_images_root, calc_task, episode)
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result
    assert infra == {}, infra


async def test_a_policys_git_printing_a_hunk_count_int_refuses_is_scored_not_infra(
        test_images_root, oci_store, swe_task):
    from sandpool.envs.runner import run_batch

    from .test_capture_hostile_git import _FakeGit
    patch = f"diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,{'9' * 5000} +1 @@\n-a\n+b\n"
    report = await run_batch([swe_task], [_FakeGit(patch, "/usr/local/bin/git")],
                             LocalBackend(test_images_root, store=oci_store),
                             rollouts_per_task=1, concurrency=1, strategy="reuse", retries=0)
    (r,) = report.rollouts
    assert (r.outcome, r.reward, r.error_kind) == (Outcome.TASK_FAILED, 0.0, "patch_policy"), report.render_text()
    assert "bad hunk header" in (r.error or ""), r


_PTH = ("import sys; m = sys.modules.setdefault('calcpkg', type(sys)('calcpkg')); "
        "m.add = lambda a, b: a + b\n")


async def test_a_pth_planted_in_the_images_site_packages_reaches_neither_grading_nor_the_next(
        test_images_root, oci_store, swe_task):
    # In an OCI sandbox the policy may write the image's root: a .pth in its site-packages
    # runs in every Python started there, grading's runner included (it adds the site
    # directories as site.main() does), and fakes the fixed module.
    seen: list[str] = []

    async def plant(lease) -> None:
        site = (await lease.exec("python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'")).text.strip()
        await lease.write_file(f"{site}/zz_fake.pth", _PTH.encode())
        res = await lease.exec("python3 -m pytest -q -p no:cacheprovider tests/test_calc.py", timeout=60)
        assert res.ok, res.text  # the plant fakes the fix where the policy runs the tests
        seen.append(site)

    async def look(lease) -> None:
        seen.append((await lease.exec(f"ls {seen[0]}/zz_fake.pth 2>&1; true")).text)

    backend = LocalBackend(test_images_root, store=oci_store)
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        planted = await run_rollout(pool, swe_task, plant, grader=DiffGrader(timeout=60), retries=0)
        after = await run_rollout(pool, swe_task, look, grader=DiffGrader(timeout=60), retries=0, rollout=1)
        assert pool.counters.infra_errors == {}, pool.counters.infra_errors
    assert (planted.outcome, planted.reward) == (Outcome.COMPLETED, 0.0), planted
    assert after.sandbox_id == planted.sandbox_id and (after.outcome, after.reward) == (Outcome.COMPLETED, 0.0)
    assert "No such file" in seen[1], seen


_SPECIAL = ("mkfifo /tmp/fifo && mknod /tmp/whiteout c 0 0 && python3 -c \"import socket; "
            "socket.socket(socket.AF_UNIX).bind('/tmp/sock')\" && mkfifo repo_fifo && ls -l /tmp")


async def test_special_files_in_every_checkpoint_are_no_infra_failure(test_images_root, calc_task):
    # A FIFO, a socket and a 0:0 character device (an overlay whiteout, which a sandbox may
    # make in its /tmp) in the state each step's checkpoint takes, then a fork of it.
    async def episode(lease) -> None:
        res = await lease.exec(_SPECIAL)
        assert res.ok, res.text + res.err_text
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        (child,) = await lease.fork(1)
        try:
            seen = await child.exec("ls -l /tmp; ls repo_fifo; git diff --stat")
            assert seen.ok and "calc.py" in seen.text and "whiteout" in seen.text, seen.text + seen.err_text
        finally:
            await child.release()

    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=3)) as pool:
        result = await run_rollout(pool, calc_task, episode, grader=DiffGrader(timeout=60), retries=0,
                                   checkpoint="step")
        print("RESULT", result.outcome, result.error_kind, result.reward, (result.error or "")[:300])
        assert pool.counters.infra_errors == {}, pool.counters.infra_errors
        assert pool.counters.quarantines == 0, pool.counters.quarantine_reasons
    assert (result.outcome, result.reward, result.recoveries) == (Outcome.COMPLETED, 1.0, 0), result


_SHADOW = """\
# A package beside test_calc.py, of the same name: Python's path finder takes a package
# before a module, and __file__ names the module pytest asked for.
__file__ = __file__[:-len('/test_calc/__init__.py')] + '/test_calc.py'


def test_add():
    pass


def test_zero():
    pass
"""


async def test_a_package_shadowing_the_test_module_scores_0(test_images_root, calc_task):
    async def episode(lease) -> None:
        assert (await lease.exec("mkdir test_calc")).ok
        await lease.write_file("test_calc/__init__.py", _SHADOW.encode())
        res = await lease.exec("python -m pytest -q -p no:cacheprovider test_calc.py", timeout=60)
        print("POLICY'S OWN RUN", res.text[-300:])

    result, _, infra = await _graded(test_images_root, calc_task, episode)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result



@pytest.mark.parametrize(("path", "refused"), [
    ("test_calc/__init__.py", True), ("test_calc/x.txt", True), ("test_calc.abi3.so", True),
    ("test_calcx/__init__.py", False), ("calc/__init__.py", False), ("test_calc.txt", False)])
def test_the_patch_policy_refuses_a_package_or_extension_shadowing_a_test_module(calc_task, path, refused):
    from sandpool.envs.grading.policy import check_patch
    patch = f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x\n"
    verdict = check_patch(patch, calc_task)
    assert bool(verdict.refused) == refused, verdict
    if refused:
        assert "shadows the test module test_calc.py" in verdict.refused[0]


_SWAP_BY_TRACE = """\
import sys
_f = sys._getframe(1)
while _f is not None and "test_" not in _f.f_globals.get("__name__", ""):
    _f = _f.f_back


def _passes():
    pass


def _swap(frame, event, arg):
    # Once the importing test module defines its tests, they are replaced by a passing one.
    for name in ("test_add", "test_zero"):
        if name in frame.f_globals:
            frame.f_globals[name] = _passes
    return _swap


_f.f_trace = _swap
sys.settrace(lambda *a: None)
"""


async def test_tests_swapped_before_collection_by_the_code_under_test_score_0(test_images_root, calc_task):
    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(_SWAP_BY_TRACE))
        res = await lease.exec("python -m pytest -q -p no:cacheprovider test_calc.py", timeout=60)
        print("POLICY'S OWN RUN", res.text[-300:])

    result, _, infra = await _graded(test_images_root, calc_task, episode)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result
