"""The SWE-bench harness on real suites that are not pytest: Django's ``tests/runtests.py``, sympy's runner.

The image is Django's own PyPI sdist (which ships ``tests/runtests.py`` and the suite), built by
the task pack's image builder into the test images root once per machine; the task is a
one-line bug in ``django/utils/text.py`` with a test patch that adds a test, graded with
swebench 4.1.0's ``django/django`` 5.2 test command and ``parse_log_django``.
"""

from __future__ import annotations


import pytest

from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.envs.taskpack.image import build_image
from sandpool.envs.taskpack.spec import PackageSpec
from tests.sdist_tasks import bug_task, git

DJANGO = PackageSpec(dist="django", version="5.2.8", repo="django/django", sources=("django/utils/text.py",),
                     tests=("tests",), requirements=("asgiref==3.9.2", "sqlparse==0.5.3"))
_CASE = "utils_tests.test_text.TestUtilsText"
_NEW_TEST = (
    "    def test_normalize_newlines_turns_cr_into_lf(self):\n"
    '        self.assertEqual(text.normalize_newlines("a\\rb"), "a\\nb")\n\n'
)


@pytest.fixture(scope="session")
async def django_task(test_images_root) -> Task:
    image = await build_image(DJANGO, test_images_root)
    info = bug_task(
        image, "django-task.json", source="django/utils/text.py",
        bug=('return re_newlines.sub("\\n", str(text))', 'return re_newlines.sub(" ", str(text))'),
        test_file="tests/utils_tests/test_text.py",
        edit_test=lambda body: body.replace("    def test_wrap(self):", _NEW_TEST + "    def test_wrap(self):", 1))
    return Task(instance_id="django__django-90001", repo="django/django", version="5.2", harness="swebench",
                base_commit=info["base"], image=DJANGO.image, problem_statement="normalize_newlines drops LF",
                patch=info["patch"], test_patch=info["test_patch"],
                FAIL_TO_PASS=[f"test_normalize_newlines ({_CASE}.test_normalize_newlines)",
                              f"test_normalize_newlines_turns_cr_into_lf ({_CASE}.test_normalize_newlines_turns_cr_into_lf)"],
                PASS_TO_PASS=[f"test_wrap ({_CASE}.test_wrap)", f"test_slugify ({_CASE}.test_slugify)"])


async def _at_base(backend, task):
    sb = await backend.create(task.image)
    assert (await sb.exec(f"git checkout -q {task.base_commit}", timeout=60)).ok
    return sb


async def test_django_runtests_grades_gold_one_and_empty_zero_with_the_swebench_harness(
        local_backend, django_task):
    empty = await grade(await _at_base(local_backend, django_task), django_task, timeout=300)
    assert (empty.harness, empty.reward, empty.tampering, empty.error) == ("swebench", 0.0, (), None), empty.log[-3000:]
    assert set(empty.failed_f2p) == set(django_task.FAIL_TO_PASS) and empty.p2p_passed == 2
    assert "Ran 21 tests" in empty.log and "FAILED (failures=2)" in empty.log
    sb = await _at_base(local_backend, django_task)
    await sb.write_file("/tmp/gold.patch", django_task.patch.encode())
    assert (await sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=60)).ok
    gold = await grade(sb, django_task, timeout=300)
    assert (gold.reward, gold.tampering, gold.exit_code) == (1.0, (), 0), gold.log[-3000:]


FAKE_OK = """
import os, sys
if any("runtests" in a for a in sys.argv):
    for t in {ids!r}:
        os.write(2, (t + " ... ok\\n").encode())
    os._exit(0)
"""


async def test_fake_ok_lines_from_the_code_under_test_do_not_pass_a_django_task(local_backend, django_task):
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    sb = await _at_base(local_backend, django_task)
    ids = list(django_task.FAIL_TO_PASS + django_task.PASS_TO_PASS)
    old = await sb.read_file("django/utils/text.py")
    await sb.write_file("django/utils/text.py", FAKE_OK.format(ids=ids).encode() + old)
    plain = await sb.exec("./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
                          "utils_tests.test_text", timeout=300)
    fooled = MAP_REPO_TO_PARSER["django/django"](plain.err_text, None)
    assert plain.exit_code == 0 and all(fooled.get(t) == "PASSED" for t in ids), "the attack should fool the log parser"
    result = await grade(sb, django_task, timeout=300)
    assert result.reward == 0.0
    assert any("closing lines" in e for e in result.tampering), result.tampering


# -- swebench's parsers and sandpool's runner cross-check on captured real logs ------------------

from pathlib import Path  # noqa: E402

LOGS = Path(__file__).parent / "data" / "runner_logs"


def test_swebench_django_parser_on_a_real_runtests_log_matches_its_closing_counts():
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    from sandpool.envs.grading.runner_log import runner_check

    log = (LOGS / "django_5.2.8_utils_text_mutant.txt").read_text()
    status = MAP_REPO_TO_PARSER["django/django"](log, None)
    full = {t: s for t, s in status.items() if t.endswith(")")}  # "name (module.Class.name)" ids
    assert len(full) == 20 and "Ran 20 tests" in log  # every test of the closing count is parsed
    assert [t for t, s in full.items() if s == "FAILED"] == [f"test_normalize_newlines ({_CASE}.test_normalize_newlines)"]
    assert "FAILED (failures=1)" in log
    assert runner_check(log, 1, resolved_by_log=False, runner="unittest") == []
    assert runner_check(log, 0, resolved_by_log=False, runner="unittest"), "FAILED with exit 0 must be flagged"


def test_swebench_sympy_parser_on_a_real_bin_test_log_matches_its_closing_counts():
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    from sandpool.envs.grading.runner_log import runner_check

    log = (LOGS / "sympy_1.13.3_iterables_mutant.txt").read_text()
    status = MAP_REPO_TO_PARSER["sympy/sympy"](log, None)
    failed = sorted(t for t, s in status.items() if s == "FAILED" and "::" not in t)
    assert failed == ["test_minlex", "test_rotate", "test_rotations"]  # (also keyed path::name)
    # "44 passed, 3 failed": the file's last line reads "test_signed_permutations ok  [FAIL]", which
    # swebench's parser (lines ending " ok") does not count; sandpool scores what the harness scores.
    assert sum(s == "PASSED" for s in status.values()) == 43 and "test_signed_permutations" not in status
    assert runner_check(log, 1, resolved_by_log=False, runner="sympy") == []
    assert runner_check(log, 0, resolved_by_log=False, runner="sympy"), "3 failed with exit 0 must be flagged"
    assert runner_check(log, 0, resolved_by_log=True, runner="") == []  # runners it does not know


# -- sympy's runner under the SWE-bench harness -------------------------------------------------

SYMPY = PackageSpec(dist="sympy", version="1.13.3", repo="sympy/sympy", sources=("sympy/utilities/iterables.py",),
                    tests=("sympy/utilities/tests",), requirements=("mpmath==1.3.0",))
# The sdist does not ship sympy's bin/test; this stand-in calls the runner bin/test calls
# (sympy.testing.runtests.test) with what `-C --verbose` asks for.
_BIN_TEST = ('#!/usr/bin/env python\n"""Stand-in for sympy\'s bin/test: the same runner."""\nimport sys\n\n'
             "from sympy.testing.runtests import test\n\n"
             "paths = [a for a in sys.argv[1:] if not a.startswith('-')]\n"
             "sys.exit(not test(*paths, verbose='--verbose' in sys.argv, colors='-C' not in sys.argv))\n")
# Not appended last: bin/test's last line of a file ends in "[OK]", which swebench's sympy
# parser does not read (the harness's own F2P lists never hold such a test).
_SYMPY_TEST = ("def test_rotate_left_by_two():\n"
               "    assert rotate_left([0, 1, 2, 3], 2) == [2, 3, 0, 1]\n\n\n")


@pytest.fixture(scope="session")
async def sympy_task(test_images_root) -> Task:
    image = await build_image(SYMPY, test_images_root)

    def bin_test(repo):
        (repo / "bin").mkdir(exist_ok=True)
        (repo / "bin/test").write_text(_BIN_TEST)
        (repo / "bin/test").chmod(0o755)
        git(repo, "add", "bin/test")
        git(repo, "commit", "-qm", "bin/test stand-in")

    info = bug_task(
        image, "swebench-task.json", source="sympy/utilities/iterables.py", setup=bin_test,
        bug=("    return x[y:] + x[:y]", "    return x[:y] + x[y:]"),
        test_file="sympy/utilities/tests/test_iterables.py",
        edit_test=lambda body: body.replace("def test_rotations():", _SYMPY_TEST + "def test_rotations():", 1))
    return Task(instance_id="sympy__sympy-90001", repo="sympy/sympy", version="1.13", harness="swebench",
                base_commit=info["base"], image=SYMPY.image, problem_statement="rotate_left rotates wrong",
                patch=info["patch"], test_patch=info["test_patch"],
                FAIL_TO_PASS=["test_rotate", "test_minlex", "test_rotations", "test_rotate_left_by_two"],
                PASS_TO_PASS=["test_uniq", "test_flatten"])


async def test_sympy_bin_test_grades_gold_one_and_empty_zero_with_the_swebench_harness(local_backend, sympy_task):
    empty = await grade(await _at_base(local_backend, sympy_task), sympy_task, timeout=600)
    assert (empty.harness, empty.reward, empty.tampering, empty.error) == ("swebench", 0.0, (), None), empty.log[-3000:]
    assert set(empty.failed_f2p) == set(sympy_task.FAIL_TO_PASS) and empty.p2p_passed == 2
    assert "tests finished:" in empty.log and empty.exit_code != 0
    sb = await _at_base(local_backend, sympy_task)
    await sb.write_file("/tmp/gold.patch", sympy_task.patch.encode())
    assert (await sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=60)).ok
    gold = await grade(sb, sympy_task, timeout=600)
    assert (gold.reward, gold.tampering, gold.exit_code) == (1.0, (), 0), gold.log[-3000:]
