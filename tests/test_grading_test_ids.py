"""Test ids as the datasets list them: a gold patch scores 1 whatever shape its tests' ids take.

The datasets' FAIL_TO_PASS / PASS_TO_PASS ids are what pytest prints: node ids relative to
the directory pytest ran in (``pytest --verbose`` lines, ``-rA`` summaries). pytest's own node
ids are relative to its *rootdir*, which is the directory of the nearest configuration file
above the tests: a repo with ``tests/pytest.ini`` has ``unit/test_mod.py::test_x`` for the
``tests/unit/test_mod.py::test_x`` its log shows. The signed report must name tests as the
log does, or every pass the log shows is "never run" by the report: a gold patch scored 0
as tampering, the task rejected by validation.

Also here, on the same repo: parametrized ids (with a space, which SWE-smith's log parser
cannot read), a class's test, an expected failure the test declares, for the SWE-smith and
the pack's pytest harness. The empty patch still scores 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandpool.core.backends.local import LocalBackend, image_dir
from sandpool.core.task import Task
from sandpool.envs.grading.diff import grade_patch

from .conftest import CALC_IMAGE, _git

IMAGE = "sandpool.test/nested-ids:1"
_TESTS = '''import pytest

from pkg.mod import double


@pytest.mark.parametrize("x", [1, "a b"])
def test_param(x):
    assert double(x) == x + x


class TestDouble:
    def test_int(self):
        assert double(2) == 4


@pytest.mark.xfail(reason="declared by the test")
def test_declared_xfail():
    assert double(1) == 5


def test_stays():
    assert double(0) == 0
'''
_GOLD = ("diff --git a/pkg/mod.py b/pkg/mod.py\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n"
         "@@ -1,2 +1,2 @@\n def double(x):\n-    return x * 3 if x else x\n+    return x + x\n")
T = "tests/unit/test_mod.py"


@pytest.fixture(scope="module")
def nested(test_images_root: Path, calc_commits) -> str:
    """An image directory (the calc image's venv) whose tests have a pytest.ini of their own."""
    calc = json.loads((image_dir(test_images_root, CALC_IMAGE) / "image.json").read_text())
    d = image_dir(test_images_root, IMAGE)
    repo = d / "repo"
    if not (d / "image.json").exists():
        (repo / "pkg").mkdir(parents=True, exist_ok=True)
        (repo / "tests" / "unit").mkdir(parents=True, exist_ok=True)
        _git(repo, "init", "-q", "-b", "main")
        (repo / "pkg" / "__init__.py").write_text("")
        (repo / "pkg" / "mod.py").write_text("def double(x):\n    return x * 3 if x else x\n")
        (repo / "tests" / "pytest.ini").write_text("[pytest]\npythonpath = ..\n")
        (repo / "tests" / "unit" / "test_mod.py").write_text(_TESTS)
        (repo / ".gitignore").write_text("__pycache__/\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "buggy")
        (d / "image.json").write_text(json.dumps({**calc, "name": IMAGE, "repo": str(repo)}))
    return _git(repo, "rev-parse", "HEAD")


@pytest.mark.parametrize("harness", ["swe-smith", "pytest"])
async def test_a_gold_patch_scores_1_when_pytests_rootdir_is_not_the_workdir(
        test_images_root, nested, harness):
    task = Task(instance_id=f"nested-ids-{harness}", repo="sandpool/nested", base_commit=nested,
                image=IMAGE, problem_statement="double() triples.", patch=_GOLD, harness=harness,
                FAIL_TO_PASS=[f"{T}::test_param[1]", f"{T}::test_param[a b]", f"{T}::TestDouble::test_int"],
                PASS_TO_PASS=[f"{T}::test_stays", f"{T}::test_declared_xfail"])
    backend = LocalBackend(test_images_root)
    try:
        for patch, reward in ((_GOLD, 1.0), ("", 0.0)):
            sb = await backend.create(IMAGE)
            try:
                res = await grade_patch(sb, task, patch, timeout=120)
            finally:
                await backend.delete(sb)
            assert "rootdir: /testbed/tests" in res.log
            assert (res.reward, res.tampering, res.error) == (reward, (), None), res.log[-3000:]
            if reward == 0.0:
                assert res.failed_f2p and not res.failed_p2p, res
    finally:
        await backend.aclose()
