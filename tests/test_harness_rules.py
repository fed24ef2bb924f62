"""R2E-Gym's and SWE-smith's scoring rules on a real pytest log (tests/data/pytest_logs)."""

from __future__ import annotations

import json
from pathlib import Path

from sandpool.core.task import Task
from sandpool.envs.grading.harness import plan_for

LOG = (Path(__file__).parent / "data" / "pytest_logs" / "toolz_mutant_pytest8.txt").read_text()
_FAILED = ["test_memoize_kwargs", "test_memoize_key_signature"]  # of test_functoolz.py in that run


def _task(**kw) -> Task:
    return Task(instance_id="t-1", repo="pytoolz/toolz", base_commit="a" * 40, image="img",
                problem_statement="p", **kw)


def test_r2e_gym_rule_resolves_only_when_the_parsed_log_equals_the_expected_map():
    plan = plan_for(_task(harness="r2e-gym", expected_output_json=json.dumps({"x": "PASSED"})))
    parsed = plan.parse(LOG)
    # R2E-Gym keys a test by its node id after the file: "test_apply", "Class.test" ...
    assert parsed["test_apply"] == "PASSED" and all(parsed[t] == "FAILED" for t in _FAILED)
    assert not any("::" in k or k.endswith(".py") for k in parsed)
    same = plan_for(_task(harness="r2e-gym", expected_output_json=json.dumps(parsed)))
    assert same.score(same.parse(LOG))[0] is True
    flipped = dict(parsed, test_apply="FAILED")
    other = plan_for(_task(harness="r2e-gym", expected_output_json=json.dumps(flipped)))
    resolved, wrong, _ = other.score(other.parse(LOG))
    assert (resolved, wrong) == (False, ("test_apply",))
    fewer = {k: v for k, v in parsed.items() if k != "test_apply"}
    assert plan_for(_task(harness="r2e-gym", expected_output_json=json.dumps(fewer))).score(parsed)[0] is False


def test_swe_smith_rule_counts_a_test_missing_from_the_log_as_passed_and_only_failures_as_failed():
    f = "toolz/tests/test_functoolz.py"
    plan = plan_for(_task(harness="swe-smith", FAIL_TO_PASS=[f"{f}::test_apply", f"{f}::test_not_in_this_log"],
                          PASS_TO_PASS=[f"{f}::test_thread_first", "toolz/tests/test_other.py::test_elsewhere"]))
    assert plan.command.startswith("pytest --disable-warnings --color=no --tb=no --verbose ")
    assert plan.command.endswith(f)  # only the FAIL_TO_PASS files run
    status = {"toolz/tests/test_functoolz.py::test_apply": "PASSED",
              "toolz/tests/test_functoolz.py::test_thread_first": "PASSED"}
    assert plan.score(status)[0] is True  # test_not_in_this_log is missing: counted as passed
    status[f"{f}::test_thread_first"] = "FAILED"
    assert plan.score(status) == (False, (), (f"{f}::test_thread_first",))
