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
    assert (result.outcome, result.reward) != (Outcome.INFRA_FAILED, None), (result.error_kind, result.error)
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
    from sandpool.envs.grading.verdict import _closing_counts, runner_check
    t0 = time.monotonic()
    parse_test_log_details(line)
    _closing_counts(line)
    runner_check(line, 0, resolved_by_log=True, runner="sympy")
    assert time.monotonic() - t0 < 3.0
