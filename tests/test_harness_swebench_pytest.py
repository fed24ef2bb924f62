"""The SWE-bench harness on a real pytest suite: marshmallow 3.19 (a SWE-bench repo), from its sdist.

swebench 4.1.0's ``marshmallow-code/marshmallow`` 3.19 spec gives ``pytest -rA`` plus the test
patch's files; ``parse_log_pytest`` keeps the *last* status a test id gets in the log, so a line
printed after pytest's summary fools it. The signed verdict report must not be fooled. The repo
tracks a ``setup.cfg`` with ``[tool:pytest]`` and a ``tests/conftest.py``: edits to both are
restored before the tests run.
"""

from __future__ import annotations


import pytest

from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.envs.taskpack.image import build_image
from sandpool.envs.taskpack.spec import PackageSpec
from tests.sdist_tasks import bug_task

MARSHMALLOW = PackageSpec(dist="marshmallow", version="3.19.0", repo="marshmallow-code/marshmallow",
                          import_root="src", sources=("src/marshmallow/utils.py",), tests=("tests",),
                          requirements=("packaging==25.0", "pytz==2025.2", "simplejson==3.20.1"))
_NEW_TEST = ("\n\ndef test_is_collection_of_a_set():\n"
             "    assert utils.is_collection({1, 2}) is True\n")


@pytest.fixture(scope="session")
async def mm_task(test_images_root) -> Task:
    image = await build_image(MARSHMALLOW, test_images_root)
    info = bug_task(
        image, "swebench-task.json", source="src/marshmallow/utils.py",
        bug=("and not isinstance(obj, Mapping)", "and isinstance(obj, Mapping)"),
        test_file="tests/test_utils.py", edit_test=lambda body: body + _NEW_TEST)
    return Task(instance_id="marshmallow-code__marshmallow-90001", repo="marshmallow-code/marshmallow",
                version="3.19", harness="swebench", base_commit=info["base"], image=MARSHMALLOW.image,
                problem_statement="is_collection is wrong", patch=info["patch"], test_patch=info["test_patch"],
                FAIL_TO_PASS=["tests/test_utils.py::test_is_collection",
                              "tests/test_utils.py::test_is_collection_of_a_set"],
                PASS_TO_PASS=["tests/test_utils.py::test_get_value_from_dict",
                              "tests/test_utils.py::test_set_value"])


async def _at_base(backend, task, *, gold: bool = False):
    sb = await backend.create(task.image)
    assert (await sb.exec(f"git checkout -q {task.base_commit}", timeout=60)).ok
    if gold:
        await sb.write_file("/tmp/gold.patch", task.patch.encode())
        assert (await sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=60)).ok
    return sb


async def test_swebench_pytest_harness_gold_one_empty_zero_with_the_signed_report(local_backend, mm_task):
    empty = await grade(await _at_base(local_backend, mm_task), mm_task, timeout=300)
    assert (empty.harness, empty.reward, empty.tampering, empty.error) == ("swebench", 0.0, (), None), empty.log[-2000:]
    assert set(empty.failed_f2p) == set(mm_task.FAIL_TO_PASS)
    gold = await grade(await _at_base(local_backend, mm_task, gold=True), mm_task, timeout=300)
    assert (gold.reward, gold.tampering, gold.exit_code) == (1.0, (), 0), gold.log[-2000:]
    assert "pytest -rA tests/test_utils.py" not in gold.log  # the command is not echoed; the log is pytest's


LATE_PASSED = """
import atexit, os, sys
if "pytest" in sys.modules:
    atexit.register(os.write, 1, b"PASSED tests/test_utils.py::test_is_collection\\n"
                                 b"PASSED tests/test_utils.py::test_is_collection_of_a_set\\n")
"""


async def test_passed_lines_printed_after_pytests_summary_fool_the_parser_but_not_the_grade(local_backend, mm_task):
    from types import SimpleNamespace

    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    sb = await _at_base(local_backend, mm_task)
    old = await sb.read_file("src/marshmallow/utils.py")
    await sb.write_file("src/marshmallow/utils.py", old + LATE_PASSED.encode())  # after its __future__ import
    result = await grade(sb, mm_task, timeout=300)
    fooled = MAP_REPO_TO_PARSER[mm_task.repo](result.log, SimpleNamespace())
    assert all(fooled.get(t) == "PASSED" for t in mm_task.FAIL_TO_PASS), result.log[-1500:]
    assert result.reward == 0.0
    # Here the bug even breaks conftest's import, so pytest stops with exit 4 and reports nothing.
    assert any("passed; pytest's signed report says" in e for e in result.tampering), result.tampering


FORGING_HOOK = ("\nimport pytest as _p\n\n\n@_p.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n"
                "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")


async def test_edits_to_the_tracked_setup_cfg_and_conftest_are_restored(local_backend, mm_task):
    sb = await _at_base(local_backend, mm_task)
    conftest = (await sb.read_file("tests/conftest.py")).decode()
    await sb.write_file("tests/conftest.py", (conftest + FORGING_HOOK).encode())
    cfg = (await sb.read_file("setup.cfg")).decode()
    await sb.write_file("setup.cfg", cfg.replace("addopts = -v --tb=short", "addopts = -v --tb=short -p no:terminal").encode())
    result = await grade(sb, mm_task, timeout=300)
    assert result.reward == 0.0 and result.tampering == ()
    assert {"restored tests/conftest.py", "restored setup.cfg"} <= set(result.neutralised)
    assert (await sb.read_file("tests/conftest.py")).decode() == conftest


async def test_a_late_passed_line_for_a_test_that_ran_and_failed_is_caught_by_the_signed_report(
        local_backend, mm_task):
    from types import SimpleNamespace

    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER

    sb = await _at_base(local_backend, mm_task, gold=True)
    old = await sb.read_file("src/marshmallow/utils.py")
    # A fix that misses sets, plus the late PASSED lines.
    partial = (b"\n_is_collection = is_collection\n\n\ndef is_collection(obj):\n"
               b"    return False if isinstance(obj, set) else _is_collection(obj)\n")
    await sb.write_file("src/marshmallow/utils.py", old + partial + LATE_PASSED.encode())
    result = await grade(sb, mm_task, timeout=300)
    fooled = MAP_REPO_TO_PARSER[mm_task.repo](result.log, SimpleNamespace())
    assert all(fooled.get(t) == "PASSED" for t in mm_task.FAIL_TO_PASS), result.log[-1500:]
    assert "FAILED tests/test_utils.py::test_is_collection_of_a_set" in result.log
    assert result.reward == 0.0
    assert any("test_is_collection_of_a_set passed; pytest's signed report says FAILED" in e
               for e in result.tampering), result.tampering


async def test_swebench_pytest_harness_by_diff_gold_one_empty_zero(local_backend, mm_task):
    from sandpool.envs.grading.diff import grade_patch

    # The console-script form (``pytest -rA <test patch files>``) run isolated: the repo
    # reaches sys.path only through the image's .pth, after the site directories.
    results = []
    for patch in (mm_task.patch, ""):
        sb = await _at_base(local_backend, mm_task)
        try:
            results.append(await grade_patch(sb, mm_task, patch, timeout=300))
        finally:
            await local_backend.delete(sb)
    gold, empty = results
    assert (gold.harness, gold.reward, gold.tampering) == ("swebench", 1.0, ()), gold.log[-2000:]
    assert (empty.reward, set(empty.failed_f2p)) == (0.0, set(mm_task.FAIL_TO_PASS))


async def test_validate_names_listed_tests_the_harness_never_runs_and_why(test_images_root, mm_task):
    from sandpool.core.backends.local import LocalBackend
    from sandpool.envs.grading.validate import validate_tasks

    task = mm_task.model_copy(update={
        "instance_id": "marshmallow-code__marshmallow-90002",
        "PASS_TO_PASS": [*mm_task.PASS_TO_PASS, "tests/test_fields.py::TestField::test_repr"]})
    result = await validate_tasks([task], lambda: LocalBackend(test_images_root))
    (v,) = result.verdicts
    assert v.status == "broken" and (v.gold, v.empty) == (0.0, 0.0)
    assert ("absent from the log, never run: tests/test_fields.py::TestField::test_repr (their files "
            "are not among the harness's test directives, the files the test patch touches)") in v.reason
