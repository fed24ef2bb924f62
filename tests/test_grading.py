"""Grading: the pytest log parser on real pytest output, and grade() in real sandboxes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandpool.core import errors
from sandpool.core.task import Task
from sandpool.envs.grading import (
    TestStatus,
    files_of_tests,
    grade,
    parse_test_log,
    parse_test_log_details,
    pytest_command,
)

LOGS = Path(__file__).parent / "data" / "pytest_logs"
_SUMMARY = re.compile(r"(\d+) (failed|passed|error|errors|xfailed|xpassed)\b")


def _summary_counts(text: str) -> dict[str, int]:
    """Counts from pytest's closing line, e.g. ``5 failed, 50 passed in 1.04s``."""
    last = re.sub(r"\x1b\[[0-9;]*m", "", text.strip().splitlines()[-1])
    counts = {word.rstrip("s") if word == "errors" else word: int(n) for n, word in _SUMMARY.findall(last)}
    return counts


# -- parser -------------------------------------------------------------------------------------


def test_parser_reads_every_outcome_of_pytest8():
    statuses = parse_test_log((LOGS / "outcomes_pytest8.txt").read_text())
    assert statuses == {
        "test_a.py::test_ok": TestStatus.PASSED,
        "test_a.py::test_p[a b]": TestStatus.PASSED,
        "test_a.py::test_xf": TestStatus.XFAIL,
        "test_a.py::test_xp": TestStatus.XPASS,
        "test_a.py::test_err": TestStatus.ERROR,
        "test_a.py::test_bad": TestStatus.FAILED,
        "test_a.py::test_exc": TestStatus.FAILED,
        "test_a.py::test_p[c - d]": TestStatus.FAILED,
    }


def test_parser_keeps_failure_messages_and_dashes_inside_parameter_ids():
    details = parse_test_log_details((LOGS / "outcomes_pytest8.txt").read_text())
    assert details["test_a.py::test_bad"] == (TestStatus.FAILED, "assert [1, 2, 3] == [1, 2, 4]")
    assert details["test_a.py::test_p[c - d]"] == (
        TestStatus.FAILED, "AssertionError: assert 'c - d' != 'c - d'")
    assert details["test_a.py::test_xf"] == (TestStatus.XFAIL, "known")
    assert details["test_a.py::test_ok"] == (TestStatus.PASSED, "")


def test_parser_marks_a_test_with_a_failed_subtest_as_failed():
    # pytest 9 prints both "PASSED id" and "SUBFAILED(i=1) id - msg" for such a test.
    statuses = parse_test_log((LOGS / "outcomes_pytest9.txt").read_text())
    assert statuses["test_sub.py::T::test_subs"] is TestStatus.FAILED
    assert statuses["test_sub.py::T::test_fine"] is TestStatus.PASSED


def test_parser_strips_colour_codes_and_matches_the_closing_counts():
    text = (LOGS / "slugify_mutant_color_pytest8.txt").read_text()
    assert "\x1b[" in text
    statuses = parse_test_log(text)
    assert all("\x1b" not in tid and tid.startswith("tests/") for tid in statuses)
    counts = _summary_counts(text)
    assert sum(s is TestStatus.FAILED for s in statuses.values()) == counts["failed"] == 8
    assert sum(s is TestStatus.PASSED for s in statuses.values()) == counts["passed"]
    assert statuses["tests/test_release.py::ReleaseRegressionTests::test_readme_examples"] is TestStatus.FAILED


def test_parser_on_a_mutant_run_of_toolz():
    text = (LOGS / "toolz_mutant_pytest8.txt").read_text()
    details = parse_test_log_details(text)
    failed = {tid: msg for tid, (s, msg) in details.items() if s is TestStatus.FAILED}
    assert failed == {
        "toolz/tests/test_functoolz.py::test_memoize_kwargs": "assert 1 == 3",
        "toolz/tests/test_functoolz.py::test_memoize_key_signature": "assert False == 2",
        "toolz/tests/test_inspect_args.py::test_has_keywords": "assert False",
        "toolz/tests/test_inspect_args.py::test_is_arity": "assert True is False",
        "toolz/tests/test_inspect_args.py::test_introspect_curry_py3": "assert True is False",
    }
    assert sum(s is TestStatus.PASSED for s, _ in details.values()) == _summary_counts(text)["passed"]


def test_parser_keeps_the_worse_outcome_of_a_repeated_id():
    text = "PASSED t.py::test_a\nERROR t.py::test_a - RuntimeError: teardown failed\nPASSED t.py::test_b\n"
    assert parse_test_log(text) == {"t.py::test_a": TestStatus.ERROR, "t.py::test_b": TestStatus.PASSED}


def test_parser_ignores_grouped_skips_and_prose():
    text = ("SKIPPED [2] tests/test_a.py:12: no backend\n"
            "PASSED tests are listed below\n"
            "collected 3 items\n")
    assert parse_test_log(text) == {}


def test_pytest_command_quotes_paths_and_files_of_tests_dedupes():
    assert files_of_tests(["b.py::t1", "a.py::C::t2[x]", "b.py::t3"]) == ["a.py", "b.py"]
    cmd = pytest_command(["tests/it's.py", "a.py"])
    assert cmd == ("python -m pytest -rA --tb=no -p no:cacheprovider --color=no "
                   "'tests/it'\"'\"'s.py' a.py")


# -- grade() in real sandboxes ----------------------------------------------------------------------


async def _at_base(backend, task: Task):
    sb = await backend.create(task.image)
    res = await sb.exec(f"git checkout -q {task.base_commit}", timeout=30)
    assert res.ok, res.err_text
    return sb


async def _apply(sb, patch: str) -> None:
    await sb.write_file("/tmp/gold.patch", patch.encode())
    res = await sb.exec("git apply /tmp/gold.patch", timeout=30)
    assert res.ok, res.err_text


async def test_grade_scores_zero_before_and_one_after_the_gold_patch(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    before = await grade(sb, calc_task, timeout=120)
    assert (before.reward, before.resolved) == (0.0, False)
    assert (before.f2p_passed, before.f2p_failed, before.p2p_passed, before.p2p_failed) == (0, 1, 1, 0)
    assert before.failed_f2p == ("test_calc.py::test_add",) and before.error is None
    await _apply(sb, calc_task.patch)
    after = await grade(sb, calc_task, timeout=120)
    assert (after.reward, after.resolved, after.failed_f2p, after.failed_p2p) == (1.0, True, (), ())
    assert after.duration_s > 0 and "PASSED test_calc.py::test_add" in after.log


async def test_grade_restores_edited_test_files(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await sb.write_file("test_calc.py", b"def test_add():\n    pass\n\n\ndef test_zero():\n    pass\n")
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0 and result.failed_f2p == ("test_calc.py::test_add",)


async def test_grade_removes_an_untracked_conftest_that_forges_outcomes(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    forge = (b"import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
             b"def pytest_runtest_makereport(item, call):\n"
             b"    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    await sb.write_file("conftest.py", forge)
    forged = await sb.exec("python -m pytest -q -p no:cacheprovider test_calc.py", timeout=60)
    assert forged.ok, "the forging conftest should fool a plain pytest run"
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0
    assert (await sb.exec("test -e conftest.py", timeout=10)).exit_code == 1


async def test_grade_applies_the_test_patch_before_running(local_backend, calc_task):
    test_patch = ("diff --git a/test_calc.py b/test_calc.py\n--- a/test_calc.py\n+++ b/test_calc.py\n"
                  "@@ -7,3 +7,7 @@ def test_add():\n \n def test_zero():\n     assert add(0, 0) == 0\n"
                  "+\n+\n+def test_negative():\n+    assert add(-1, -2) == -3\n")
    task = calc_task.model_copy(update={
        "test_patch": test_patch,
        "FAIL_TO_PASS": ("test_calc.py::test_add", "test_calc.py::test_negative"),
    })
    sb = await _at_base(local_backend, task)
    before = await grade(sb, task, timeout=120)
    assert before.reward == 0.0 and set(before.failed_f2p) == set(task.FAIL_TO_PASS)
    await _apply(sb, task.patch)
    after = await grade(sb, task, timeout=120)
    assert after.reward == 1.0 and "PASSED test_calc.py::test_negative" in after.log


async def test_grade_reports_a_test_patch_that_does_not_apply_to_base_as_a_broken_task(local_backend, calc_task):
    bad = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
    task = calc_task.model_copy(update={"test_patch": bad})
    sb = await _at_base(local_backend, task)
    await _apply(sb, task.patch)
    with pytest.raises(errors.BrokenTaskError, match="test_patch does not apply to base"):
        await grade(sb, task, timeout=120)


async def test_grade_scores_zero_when_the_policy_tree_rejects_a_test_patch_that_fits_base(local_backend, calc_task):
    # The policy created the file the test patch adds: SWE-bench's `git apply` fails there too.
    add = ("diff --git a/test_more.py b/test_more.py\nnew file mode 100644\n--- /dev/null\n"
           "+++ b/test_more.py\n@@ -0,0 +1,4 @@\n+from calc import add\n+\n+def test_more():\n"
           "+    assert add(2, 2) == 4\n")
    task = calc_task.model_copy(update={"test_patch": add, "FAIL_TO_PASS": ("test_more.py::test_more",)})
    sb = await _at_base(local_backend, task)
    await _apply(sb, task.patch)
    await sb.write_file("test_more.py", b"def test_more():\n    pass\n")
    result = await grade(sb, task, timeout=120)
    assert result.reward == 0.0 and result.error is not None and "did not apply" in result.error


async def test_grade_restores_a_git_directory_the_policy_destroyed_and_grades_its_tree(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    assert (await sb.exec("rm -rf .git", timeout=30)).ok
    before = await grade(sb, calc_task, timeout=120)
    assert (before.reward, before.error) == (0.0, None)
    await _apply(sb, calc_task.patch)
    assert (await sb.exec("rm -rf .git", timeout=30)).ok
    after = await grade(sb, calc_task, timeout=120)
    assert (after.reward, after.error, after.tampering) == (1.0, None, ())


async def test_grade_scores_zero_on_a_test_timeout(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await _apply(sb, calc_task.patch)
    await sb.write_file("calc.py", b"import time\n\n\ndef add(a, b):\n    time.sleep(60)\n    return a + b\n")
    result = await grade(sb, calc_task, timeout=3)
    assert (result.reward, result.timed_out, result.error) == (0.0, True, None)


async def test_grade_raises_infra_error_when_the_sandbox_dies(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    local_backend.kill(sb)
    with pytest.raises(errors.InfraError):
        await grade(sb, calc_task, timeout=120)


async def test_grade_reports_a_task_without_tests_as_broken(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    task = calc_task.model_copy(update={"FAIL_TO_PASS": (), "PASS_TO_PASS": ()})
    with pytest.raises(errors.BrokenTaskError, match="FAIL_TO_PASS"):
        await grade(sb, task, timeout=120)


# -- test patches that add, delete and rename files ----------------------------------------------

_NEW_FILE = ("diff --git a/test_new.py b/test_new.py\nnew file mode 100644\nindex 0000000..1111111\n"
             "--- /dev/null\n+++ b/test_new.py\n@@ -0,0 +1,5 @@\n+from calc import add\n+\n+\n"
             "+def test_negative():\n+    assert add(-1, -2) == -3\n")
_DELETE_OLD = ("diff --git a/test_calc.py b/test_calc.py\ndeleted file mode 100644\n--- a/test_calc.py\n"
               "+++ /dev/null\n@@ -1,9 +0,0 @@\n-from calc import add\n-\n-\n-def test_add():\n"
               "-    assert add(1, 2) == 3\n-\n-\n-def test_zero():\n-    assert add(0, 0) == 0\n")
_RENAME = ("diff --git a/test_calc.py b/tests_moved.py\nsimilarity index 80%\nrename from test_calc.py\n"
           "rename to tests_moved.py\n--- a/test_calc.py\n+++ b/tests_moved.py\n@@ -7,3 +7,7 @@ def test_add():\n"
           " \n def test_zero():\n     assert add(0, 0) == 0\n+\n+\n+def test_two():\n"
           "+    assert add(1, 1) == 2\n")


@pytest.mark.parametrize(("test_patch", "f2p", "p2p"), [
    (_NEW_FILE, ("test_new.py::test_negative",), ("test_calc.py::test_zero",)),
    (_NEW_FILE + _DELETE_OLD, ("test_new.py::test_negative",), ()),
    (_RENAME, ("tests_moved.py::test_add", "tests_moved.py::test_two"), ("tests_moved.py::test_zero",)),
], ids=["adds-a-file", "adds-and-deletes", "renames-and-edits"])
async def test_gold_scores_one_and_empty_zero_when_the_test_patch_adds_deletes_or_renames_files(
        local_backend, calc_task, test_patch, f2p, p2p):
    task = calc_task.model_copy(update={"test_patch": test_patch, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})
    empty = await grade(await _at_base(local_backend, task), task, timeout=120)
    assert (empty.reward, empty.error, empty.tampering) == (0.0, None, ()), empty
    sb = await _at_base(local_backend, task)
    await _apply(sb, task.patch)
    gold = await grade(sb, task, timeout=120)
    assert (gold.reward, gold.error, gold.tampering) == (1.0, None, ()), gold.log[-2000:]
    assert gold.f2p_passed == len(f2p) and gold.p2p_passed == len(p2p)


async def test_a_listed_test_file_missing_at_base_and_not_added_is_a_broken_task(local_backend, calc_task):
    task = calc_task.model_copy(update={"FAIL_TO_PASS": ("test_gone.py::test_x",)})
    sb = await _at_base(local_backend, task)
    await sb.write_file("test_gone.py", b"def test_x():\n    pass\n")  # the policy cannot supply it
    with pytest.raises(errors.BrokenTaskError, match="test_gone.py"):
        await grade(sb, task, timeout=120)


async def test_a_file_the_test_patch_modifies_that_the_policy_deleted_is_reset_from_base_first(
        local_backend, calc_task):
    # SWE-bench resets every file the test patch modifies from base_commit before applying it
    # (get_modified_files), so the policy deleting one does not keep the patch from applying.
    task = calc_task.model_copy(update={"test_patch": _RENAME.replace("tests_moved.py", "test_calc.py")
                                        .replace("similarity index 80%\nrename from test_calc.py\n"
                                                 "rename to test_calc.py\n", ""),
                                        "FAIL_TO_PASS": ("test_calc.py::test_add", "test_calc.py::test_two")})
    sb = await _at_base(local_backend, task)
    await _apply(sb, task.patch)
    assert (await sb.exec("rm test_calc.py", timeout=10)).ok
    result = await grade(sb, task, timeout=120)
    assert (result.reward, result.error) == (1.0, None), result.log[-1500:]
    assert "restored test_calc.py" in result.neutralised
