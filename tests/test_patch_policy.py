"""The patch policy on the host: what a policy's patch may change, on real git diffs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sandpool.core.task import Task
from sandpool.envs.grading.patch import PatchError, parse_patch
from sandpool.envs.grading.policy import check_patch, counted_as_tests

_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": "/dev/null"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          env=_ENV).stdout.decode("utf-8", "surrogateescape")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repo shaped like a SWE task: a package, its tests package, config and a runner script."""
    r = tmp_path / "repo"
    for rel, text in {"pkg/__init__.py": "from pkg.core import add\n", "pkg/core.py": "def add(a, b):\n    return a - b\n",
                      "pkg/tests/__init__.py": "", "pkg/tests/test_core.py": "def test_add():\n    pass\n",
                      "pkg/tests/test_other.py": "def test_other():\n    pass\n",
                      "setup.cfg": "[metadata]\nname = pkg\n", "bin/test": "#!/bin/sh\n",
                      "data.bin": "x"}.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    _git(r, "init", "-q", "-b", "main")
    _git(r, "add", "-A")
    _git(r, "commit", "-qm", "base")
    return r


def _diff(repo: Path) -> str:
    """The patch of the work tree, as capture takes it."""
    _git(repo, "add", "-A")
    return _git(repo, "-c", "core.quotePath=true", "diff", "--cached", "--binary", "--full-index",
                "--no-renames", "HEAD")


def _task(**kw) -> Task:
    test_patch = ("diff --git a/pkg/tests/test_core.py b/pkg/tests/test_core.py\n--- a/pkg/tests/test_core.py\n"
                  "+++ b/pkg/tests/test_core.py\n@@ -1,2 +1,2 @@\n def test_add():\n-    pass\n"
                  "+    assert True\n")
    row = {"instance_id": "pkg-1", "repo": "o/pkg", "base_commit": "0" * 40, "image": "img",
           "problem_statement": "x", "patch": "", "test_patch": test_patch,
           "FAIL_TO_PASS": ["pkg/tests/test_core.py::test_add"], "PASS_TO_PASS": [], **kw}
    return Task.model_validate(row)


def test_a_source_fix_passes_untouched(repo):
    (repo / "pkg/core.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "pkg/util.py").write_text("X = 1\n")
    patch = _diff(repo)
    verdict = check_patch(patch, _task())
    assert verdict.refused == () and verdict.reset == ()
    assert verdict.patch == patch


@pytest.mark.parametrize(("rel", "why"), [
    ("conftest.py", "start-up or plugin hook"),
    ("pkg/conftest.py", "start-up or plugin hook"),
    ("sitecustomize.py", "start-up or plugin hook"),
    ("usercustomize.py", "start-up or plugin hook"),
    ("pkg/evil.pth", "start-up or plugin hook"),
    ("pytest.ini", "test-runner configuration"),
    (".pytest.ini", "test-runner configuration"),
    ("pytest.toml", "test-runner configuration"),
    (".pytest.toml", "test-runner configuration"),
    ("pyproject.toml", "test-runner configuration"),
    ("tox.ini", "test-runner configuration"),
    ("pkg/setup.cfg", "test-runner configuration"),
    (".coveragerc", "test-runner configuration"),
    ("pkg.egg-info/entry_points.txt", "packaging metadata"),
    ("pkg-1.0.dist-info/METADATA", "packaging metadata"),
    ("entry_points.txt", "packaging metadata"),
    ("pkg/__pycache__/core.cpython-312.pyc", "bytecode"),
    ("pkg/core.pyc", "bytecode"),
    (".gitattributes", "git's own configuration"),
])
def test_hooks_config_metadata_and_bytecode_are_refused(repo, rel, why):
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    (repo / rel).write_text("import os\n")
    verdict = check_patch(_diff(repo), _task())
    assert verdict.patch == "" and len(verdict.refused) == 1
    assert why in verdict.refused[0] and rel in verdict.refused[0]


def test_a_change_to_a_tracked_config_file_is_refused(repo):
    (repo / "setup.cfg").write_text("[tool:pytest]\naddopts = -p evil\n")
    assert "setup.cfg is test-runner configuration" in check_patch(_diff(repo), _task()).refused


def test_symlinks_executables_mode_changes_and_binaries_are_refused(repo):
    (repo / "pkg" / "tests2").symlink_to("/tmp")
    (repo / "tool.py").write_text("print(1)\n")
    (repo / "tool.py").chmod(0o755)
    (repo / "pkg/core.py").chmod(0o755)
    (repo / "data.bin").write_bytes(b"\0\1\2")
    refused = check_patch(_diff(repo), _task()).refused
    assert sorted(refused) == sorted([
        "data.bin is a binary change", "pkg/core.py changes mode 100644 -> 100755",
        "pkg/tests2 is a symlink", "tool.py is added with mode 100755 (only 100644 is allowed)"])


def test_a_package_replaced_by_a_symlink_is_refused(repo):
    import shutil
    shutil.rmtree(repo / "pkg" / "tests")
    (repo / "pkg" / "tests").symlink_to("/tmp/elsewhere")
    assert "pkg/tests is a symlink" in check_patch(_diff(repo), _task()).refused


def test_changes_to_the_tests_are_dropped_as_the_harness_resets_them(repo):
    (repo / "pkg/core.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "pkg/tests/test_core.py").write_text("def test_add():\n    assert 1\n")  # the test patch's file
    (repo / "pkg/tests/__init__.py").write_text("import sys\n")  # its package
    (repo / "bin/test").write_text("#!/bin/sh\nexit 0\n")  # not the pytest harness's runner
    verdict = check_patch(_diff(repo), _task())
    assert verdict.refused == ()
    assert sorted(verdict.reset) == ["pkg/tests/__init__.py", "pkg/tests/test_core.py"]
    kept = {c.new_path for c in parse_patch(verdict.patch)}
    assert kept == {"pkg/core.py", "bin/test"}


def test_what_counts_as_a_test_file():
    task = _task(FAIL_TO_PASS=["pkg/tests/test_core.py::test_add"],
                 PASS_TO_PASS=["tests/unit/test_b.py::TestB::test_c[1-2]"])
    files = counted_as_tests(task)
    assert {"pkg/tests/test_core.py", "pkg/tests/__init__.py", "tests/unit/test_b.py",
            "tests/unit/__init__.py", "tests/__init__.py", "pkg/tests/", "tests/"} <= files
    assert "pkg/__init__.py" not in files and "pkg/core.py" not in files and "pkg/" not in files


def test_golden_files_and_helpers_beside_the_tests_are_reset(repo):
    (repo / "pkg/core.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "pkg/tests/data").mkdir()
    (repo / "pkg/tests/data/expected.json").write_text('{"add": -1}\n')  # the buggy output, as golden
    (repo / "pkg/tests/helpers.py").write_text("def check(x):\n    return True\n")
    verdict = check_patch(_diff(repo), _task())
    assert verdict.refused == ()
    assert sorted(verdict.reset) == ["pkg/tests/data/expected.json", "pkg/tests/helpers.py"]
    assert {c.new_path for c in parse_patch(verdict.patch)} == {"pkg/core.py"}


@pytest.mark.parametrize("path", ["../evil.py", "/etc/passwd", "a/../../b.py", ".git/hooks/pre-commit",
                                  "sub/.git/config", "a//b.py"])
def test_paths_outside_the_repo_are_refused(path):
    patch = (f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..e69de29\n"
             f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x\n")
    refused = check_patch(patch, _task()).refused
    assert refused and "outside the repo" in refused[0]


def test_a_traditional_diff_smuggled_between_blocks_is_refused(repo):
    (repo / "pkg/core.py").write_text("def add(a, b):\n    return a + b\n")
    patch = _diff(repo) + "--- a/conftest.py\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+import os\n"
    refused = check_patch(patch, _task()).refused
    assert refused and "cannot be read as a git diff" in refused[0]


def test_a_hunk_longer_than_its_header_is_refused():
    patch = ("diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
             "+diff --git a/conftest.py b/conftest.py\n")
    with pytest.raises(PatchError):
        parse_patch(patch)


def test_a_patch_over_the_cap_is_refused(repo):
    (repo / "pkg/core.py").write_text("x = 1\n" * 1000)
    refused = check_patch(_diff(repo), _task(), max_bytes=1000).refused
    assert refused and "over the cap of 1000" in refused[0]


def test_names_with_spaces_quotes_and_non_ascii_parse_to_their_paths(repo):
    for name in ("a b.py", 'q"uote.py', "caf\u00e9.py", "tab\there.py"):
        (repo / "pkg" / name).write_text("x = 1\n")
    (repo / "pkg/core.py").unlink()
    changes = parse_patch(_diff(repo))
    assert {(c.old_path, c.new_path) for c in changes} == {
        (None, "pkg/a b.py"), (None, 'pkg/q"uote.py'), (None, "pkg/caf\u00e9.py"),
        (None, "pkg/tab\there.py"), ("pkg/core.py", None)}


def test_renames_and_copies_name_both_paths():
    patch = ("diff --git a/pkg/core.py b/pkg/tests/test_core.py\nsimilarity index 100%\n"
             "rename from pkg/core.py\nrename to pkg/tests/test_core.py\n")
    (change,) = parse_patch(patch)
    assert change.paths == ("pkg/core.py", "pkg/tests/test_core.py")
    assert check_patch(patch, _task()).reset == change.paths
