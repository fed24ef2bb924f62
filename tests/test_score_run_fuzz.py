"""Whatever the code under test writes, scoring it is a score, never an error.

Every input :func:`~sandpool.envs.grading.verdict.score_run` reads (the test log, the signed
report's lines, the exit status) comes from the sandbox that ran the policy's code, so an
exception there would end the rollout as an error sandpool does not know (infra: unscored).
Hypothesis writes logs with pytest's summary and closing lines and reports whose lines are
any JSON, sealed with the run's key as the plugin would seal them.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandpool.core.base import ExecResult
from sandpool.core.task import Task
from sandpool.envs.grading.harness import plan_for
from sandpool.envs.grading.verdict import GradeResult, score_run

KEY = b"k" * 32
TASK = Task(instance_id="calc__calc-1", repo="sandpool/calc", base_commit="0" * 40, image="calc",
            problem_statement="add() returns the wrong value.", patch="",
            FAIL_TO_PASS=["test_calc.py::test_add"], PASS_TO_PASS=["test_calc.py::test_zero"])
IDS = st.sampled_from(["test_calc.py::test_add", "test_calc.py::test_zero", "x.py::t", ""])
#: Numbers at the edges of what the host's parses take: past int()'s 4300 digits, infinite,
#: NaN, past 64 bits; then any.
EDGES = ["9" * 5000, float("inf"), float("-inf"), float("nan"), 10**30, -(2**63), 1e308, "1e400"]
NUMBER = st.one_of(st.sampled_from(EDGES), st.integers(), st.floats(),
                   st.text(alphabet="0123456789", min_size=1, max_size=20))
DIGITS = st.one_of(st.sampled_from(["9" * 5000, "0" * 4400 + "1", "1"]),
                   st.text(alphabet="0123456789", min_size=1, max_size=30))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, st.text(max_size=20), IDS),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                    max_leaves=20)
RECORD = st.one_of(
    JSON,
    st.fixed_dictionaries({"ev": st.sampled_from(["test", "finish", "collected", "collect_error"]),
                           "nodeid": st.one_of(IDS, JSON), "when": st.one_of(st.sampled_from(
                               ["setup", "call", "teardown"]), JSON),
                           "outcome": st.one_of(st.sampled_from(["passed", "failed", "skipped"]), JSON),
                           "xfail": JSON, "exitstatus": NUMBER, "ids": JSON, "changed": JSON}),
)
LINE = st.one_of(
    st.text(max_size=80),
    st.builds(lambda s, i: f"{s} {i}", st.sampled_from(["PASSED", "FAILED", "ERROR", "SKIPPED"]), IDS),
    st.builds(lambda n, w: f"===== {n} {w} in 0.1s =====", DIGITS,
              st.sampled_from(["passed", "failed", "errors", "warnings", "skipped"])),
)


def _sealed(records: list, cut: bool) -> bytes:
    body = b"".join(json.dumps(r, allow_nan=True).encode() + b"\n" for r in records)
    if cut:
        return body
    mac = hmac.new(KEY, body, hashlib.sha256).hexdigest()
    return body + json.dumps({"ev": "end", "mac": mac}).encode() + b"\n"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(LINE, max_size=12), records=st.lists(RECORD, max_size=8), cut=st.booleans(),
       exit_code=st.integers(min_value=-300, max_value=300), raw=st.binary(max_size=64))
def test_any_log_and_report_the_code_under_test_writes_is_scored(lines, records, cut, exit_code, raw):
    log = "\n".join(lines)
    res = ExecResult(exit_code=exit_code, stdout=log.encode(), stderr=b"", duration_s=1.0)
    for report in (_sealed(records, cut), raw, None):
        got = score_run(TASK, plan_for(TASK), res, log, report, KEY)
        assert isinstance(got, GradeResult)
        assert got.reward in (0.0, 1.0)
