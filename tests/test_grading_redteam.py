"""A cheating policy against the grader, in real sandboxes of the default pack: each kind of trick.

Every test first plays the trick against grading in place (:func:`sandpool.envs.grading.grade`,
which grades the sandbox the policy left and defends a list of known tricks) and shows it
wins there: a reward of 1 without the fix, or an unscored infra failure instead of a 0. Then it
plays the same trick under diff grading (capture the policy's patch, check it, apply it in a
pristine sandbox, run the tests isolated) and shows the trick scores 0, with the reason.
"""

from __future__ import annotations

import pytest

from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.envs.grading.capture import capture_patch
from sandpool.envs.grading.diff import grade_patch

# Stops pytest calling the tests: every test "passes" without running.
_SKIP_TESTS = "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
# A pytest plugin that reports every test's call as passed.
_FORGE_PLUGIN = (b"import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                 b"def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                 b"    report = outcome.get_result()\n    if report.when == 'call':\n"
                 b"        report.outcome, report.longrepr = 'passed', None\n")


def _task(tasks: list[Task], instance_id: str) -> Task:
    return next(t for t in tasks if t.instance_id == instance_id)


@pytest.fixture(scope="module")
def toolz(default_pack_tasks) -> Task:
    return _task(default_pack_tasks, "pytoolz__toolz-1")


@pytest.fixture(scope="module")
def slugify(default_pack_tasks) -> Task:
    return _task(default_pack_tasks, "un33k__python-slugify-1")


async def _at_base(backend, task: Task):
    sb = await backend.create(task.image)
    assert (await sb.exec(f"git checkout -q {task.base_commit}", timeout=60)).ok
    return sb


async def _in_place(backend, task: Task, attack) -> float:
    """The reward grading in place gives the attack."""
    sb = await _at_base(backend, task)
    try:
        await attack(sb)
        return (await grade(sb, task, timeout=300)).reward
    finally:
        await backend.delete(sb)


async def _by_diff(backend, task: Task, attack):
    """The attack's patch (captured from the policy's sandbox) graded in a pristine sandbox."""
    sb = await _at_base(backend, task)
    try:
        await attack(sb)
        patch = await capture_patch(sb, task)
    finally:
        await backend.delete(sb)
    pristine = await _at_base(backend, task)
    try:
        return await grade_patch(pristine, task, patch, timeout=300)
    finally:
        await backend.delete(pristine)


# -- 1. code on the interpreter's start-up path, imported before the verdict plugin ------------

async def _sitecustomize(sb) -> None:
    # The image's .pth puts /testbed on sys.path at start-up, so site imports this.
    await sb.write_file("sitecustomize.py", _SKIP_TESTS.encode())


_SHADOW_DEPENDENCY = """
import os, sys
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
saved = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules[__name__]
real = __import__(__name__)
sys.modules[__name__] = real
sys.path[:] = saved


class _Patch:  # pytest is half-loaded here: patch its test runner as soon as that module loads
    def find_spec(self, name, path=None, target=None):
        if name != "_pytest.python":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.Function.runtest = lambda self: None
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
"""


async def _shadow_a_pytest_dependency(sb) -> None:
    # python -m pytest puts the workdir first on sys.path; pytest imports iniconfig as it loads.
    await sb.write_file("iniconfig/__init__.py", _SHADOW_DEPENDENCY.encode())


async def test_a_sitecustomize_in_the_repo_fools_grading_in_place_and_is_refused(pack_backend, toolz):
    assert await _in_place(pack_backend, toolz, _sitecustomize) == 1.0, "the trick should win in place"
    result = await _by_diff(pack_backend, toolz, _sitecustomize)
    assert result.reward == 0.0
    assert result.refused == ("sitecustomize.py is a start-up or plugin hook",)


async def test_a_module_shadowing_a_pytest_dependency_fools_grading_in_place_but_never_loads(
        pack_backend, toolz):
    assert await _in_place(pack_backend, toolz, _shadow_a_pytest_dependency) == 1.0
    # The patch may add the package (it is source), but the isolated run imports the real one:
    # the site directories come before the repo, and pytest is loaded before the repo is added.
    result = await _by_diff(pack_backend, toolz, _shadow_a_pytest_dependency)
    assert result.refused == () and result.tampering == ()
    assert result.reward == 0.0 and set(result.failed_f2p) == set(toolz.FAIL_TO_PASS)


# -- 2. tracked files the policy may edit and the grader trusted ---------------------------------

async def _entry_point_plugin(sb) -> None:
    # The repo is on sys.path, so pytest loads the pytest11 entry points of its egg-info.
    await sb.exec("printf '\\n[pytest11]\\nslugforge = slugforge\\n' >> python_slugify.egg-info/entry_points.txt",
                  timeout=10)
    await sb.write_file("slugforge.py", _FORGE_PLUGIN)


_SWAP_TEST_CODE = """
import sys


def _swap(module):
    for cls in list(vars(module).values()):
        if isinstance(cls, type):
            for name, fn in list(vars(cls).items()):
                if name.startswith("test") and hasattr(fn, "__code__"):
                    fn.__code__ = (lambda self: None).__code__


class _Loader:
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _swap(module)


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if not name.startswith("tests.test_"):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    spec.loader = _Loader(spec.loader)
                    return spec
        return None


sys.meta_path.insert(0, _Finder())
"""


async def _swap_tests_from_the_test_package(sb) -> None:
    await sb.write_file("tests/__init__.py", _SWAP_TEST_CODE.encode())


async def test_a_pytest11_entry_point_in_tracked_metadata_fools_grading_in_place_and_is_refused(
        pack_backend, slugify):
    assert await _in_place(pack_backend, slugify, _entry_point_plugin) == 1.0
    result = await _by_diff(pack_backend, slugify, _entry_point_plugin)
    assert result.reward == 0.0
    assert result.refused == ("python_slugify.egg-info/entry_points.txt is packaging metadata",)


async def test_a_test_package_init_that_swaps_the_tests_code_fools_grading_in_place_and_is_reset(
        pack_backend, slugify):
    assert await _in_place(pack_backend, slugify, _swap_tests_from_the_test_package) == 1.0
    result = await _by_diff(pack_backend, slugify, _swap_tests_from_the_test_package)
    assert result.neutralised == ("reset tests/__init__.py",)
    assert result.reward == 0.0 and set(result.failed_f2p) == set(slugify.FAIL_TO_PASS)


# -- 3. a package directory replaced by a symlink to a path outside the repo ---------------------

async def _package_through_a_symlink(sb) -> None:
    assert (await sb.exec("mv toolz /tmp/elsewhere && ln -s /tmp/elsewhere toolz", timeout=10)).ok
    await sb.write_file("/tmp/elsewhere/conftest.py", _FORGE_PLUGIN)


async def test_a_package_symlinked_out_of_the_repo_fools_grading_in_place_and_is_refused(
        pack_backend, toolz):
    assert await _in_place(pack_backend, toolz, _package_through_a_symlink) == 1.0
    result = await _by_diff(pack_backend, toolz, _package_through_a_symlink)
    assert result.reward == 0.0
    assert "toolz is a symlink" in result.refused


# -- 4. bytecode left in the tree, loaded instead of the source -----------------------------------

_FIX_IN_BYTECODE_ONLY = """
import importlib._bootstrap_external as bx, importlib.util, os, subprocess, sys
files = sys.argv[1:]
fixed = {f: open(f).read() for f in files}
subprocess.run(["git", "checkout", "-q", "--"] + files, check=True)  # the source is buggy again
for f in files:
    st = os.stat(f)
    code = compile(fixed[f], os.path.abspath(f), "exec")
    pyc = importlib.util.cache_from_source(os.path.abspath(f))
    os.makedirs(os.path.dirname(pyc), exist_ok=True)
    with open(pyc, "wb") as out:  # stamped with the buggy source's mtime and size: it is "fresh"
        out.write(bx._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size))
"""


async def _fix_only_in_bytecode(sb, task: Task) -> None:
    await sb.write_file("/tmp/gold.patch", task.patch.encode())
    await sb.write_file("/tmp/fix_in_bytecode.py", _FIX_IN_BYTECODE_ONLY.encode())
    files = "toolz/functoolz.py"
    res = await sb.exec(f"git apply /tmp/gold.patch && python /tmp/fix_in_bytecode.py {files} && "
                        f"git status --porcelain --untracked-files=no", timeout=60)
    assert res.ok and res.text.strip() == "", res.err_text + res.text  # no source change left


async def test_bytecode_that_holds_the_fix_fools_grading_in_place_and_is_never_read(pack_backend, toolz):
    assert toolz.patch.count("diff --git ") == 1 and "diff --git a/toolz/functoolz.py" in toolz.patch
    assert await _in_place(pack_backend, toolz, lambda sb: _fix_only_in_bytecode(sb, toolz)) == 1.0
    result = await _by_diff(pack_backend, toolz, lambda sb: _fix_only_in_bytecode(sb, toolz))
    assert result.reward == 0.0 and result.refused == ()  # capture leaves bytecode out: no change


# -- 5. config file names newer pytest versions read ----------------------------------------------

@pytest.mark.parametrize("name", ["pytest.toml", ".pytest.toml"])
async def test_a_config_name_only_newer_pytest_reads_fools_grading_in_place_and_is_refused(
        local_backend, calc_task, name):
    async def plant(sb) -> None:
        await sb.write_file("forge.py", _FORGE_PLUGIN)
        await sb.write_file(name, b'[pytest]\naddopts = ["-p", "forge"]\n')

    assert await _in_place(local_backend, calc_task, plant) == 1.0  # the calc image has pytest 9
    result = await _by_diff(local_backend, calc_task, plant)
    assert result.reward == 0.0 and result.refused == (f"{name} is test-runner configuration",)


# -- 6. unscored on purpose: a report made huge by the code under test ---------------------------

_HUGE_REPORT = """
import os, sys
if "pytest" in sys.modules:
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.endswith("report.jsonl"):
            os.ftruncate(int(name), 256 << 20)  # sparse: no disk, 256 MiB to read
"""


async def _huge_report(sb) -> None:
    old = await sb.read_file("calc.py")
    await sb.write_file("calc.py", _HUGE_REPORT.encode() + old)


async def test_a_huge_report_is_scored_zero_in_place_and_by_diff(local_backend, calc_task):
    # In place, the report is read with the agent's read cap: too large is EFBIG, no report.
    assert await _in_place(local_backend, calc_task, _huge_report) == 0.0
    result = await _by_diff(local_backend, calc_task, _huge_report)
    assert result.reward == 0.0
    assert "verdict report exceeded" in (result.error or ""), result


# -- found red-teaming diff grading: the code under test reaches the collected tests ---------

_EMPTY_THE_COLLECTED_TESTS = """
import gc, sys
if "pytest" in sys.modules:
    class _Empty:  # on a hook that makes no report, so no run-hook check sees it
        def pytest_collection_modifyitems(self, session, config, items):
            for item in items:
                item.runtest = lambda: None

    for o in gc.get_objects():
        if type(o).__name__ == "Config" and hasattr(o, "pluginmanager"):
            o.pluginmanager.register(_Empty(), "empty")
            break
"""


async def test_tests_emptied_after_collection_fool_a_log_reader_and_are_caught_by_diff(local_backend, calc_task):
    from sandpool.envs.grading import parse_test_log

    async def plant(sb) -> None:
        await sb.write_file("calc.py", _EMPTY_THE_COLLECTED_TESTS.encode() + await sb.read_file("calc.py"))
        plain = await sb.exec("python -m pytest -rA -p no:cacheprovider test_calc.py", timeout=60)
        assert parse_test_log(plain.text).get("test_calc.py::test_add") is not None and plain.exit_code == 0, \
            "the trick should fool a grader that reads the log"

    result = await _by_diff(local_backend, calc_task, plant)
    assert result.reward == 0.0
    assert any("test_calc.py::test_add replaced after collection" in e for e in result.tampering), result


_REWRITE_LATER_TEST_FILES = """
import os, sys
if "pytest" in sys.modules:  # imported by the first test module, before the others are read
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rel, names in {targets!r}.items():
        with open(os.path.join(root, rel), "a") as f:  # a later def of the same name wins
            f.write("".join("\\n\\ndef %s():\\n    pass\\n" % n for n in names))
"""


async def test_later_test_modules_rewritten_on_disk_fool_in_place_grading_and_are_caught_by_diff(
        pack_backend, default_pack_tasks):
    task = next(t for t in default_pack_tasks if t.instance_id == "pytoolz__toolz-7")
    targets: dict[str, list[str]] = {}
    for tid in task.FAIL_TO_PASS:
        path, name = tid.split("::")
        targets.setdefault(path, []).append(name)

    async def rewrite(sb) -> None:
        code = _REWRITE_LATER_TEST_FILES.format(targets=targets)
        await sb.write_file("toolz/__init__.py", code.encode() + await sb.read_file("toolz/__init__.py"))

    assert await _in_place(pack_backend, task, rewrite) == 1.0, "the trick should win in place"
    result = await _by_diff(pack_backend, task, rewrite)
    assert result.reward == 0.0
    assert any("toolz/tests/test_itertoolz.py changed on disk during the run" in e for e in result.tampering), result


_UNITTEST_RUNS_NOTHING = """
import sys, unittest
if "pytest" in sys.modules:
    def run(self, result=None):  # every TestCase "succeeds" without running
        result.startTest(self)
        result.addSuccess(self)
        result.stopTest(self)
    unittest.case.TestCase.run = run
"""


async def test_unittest_machinery_patched_by_the_code_under_test_fools_a_log_reader_and_is_caught(
        pack_backend, slugify):
    from sandpool.envs.grading import parse_test_log

    async def plant(sb) -> None:
        await sb.write_file("slugify/__init__.py", _UNITTEST_RUNS_NOTHING.encode()
                            + await sb.read_file("slugify/__init__.py"))
        files = " ".join(sorted({t.split("::")[0] for t in slugify.FAIL_TO_PASS}))
        plain = await sb.exec(f"python -m pytest -rA -p no:cacheprovider {files}", timeout=120)
        statuses = parse_test_log(plain.text)
        assert plain.exit_code == 0 and all(statuses[t].passed for t in slugify.FAIL_TO_PASS), \
            "the trick should fool a grader that reads the log"

    result = await _by_diff(pack_backend, slugify, plant)
    assert result.reward == 0.0
    assert any("TestCase.run" in e for e in result.tampering), result.tampering


_HELPER_TEST = (
    "diff --git a/tests/__init__.py b/tests/__init__.py\nnew file mode 100644\nindex 0000000..e69de29\n"
    "diff --git a/tests/helpers.py b/tests/helpers.py\nnew file mode 100644\nindex 0000000..1111111\n"
    "--- /dev/null\n+++ b/tests/helpers.py\n@@ -0,0 +1,2 @@\n+def check(got, want):\n"
    "+    assert got == want, (got, want)\n"
    "diff --git a/tests/test_more.py b/tests/test_more.py\nnew file mode 100644\nindex 0000000..2222222\n"
    "--- /dev/null\n+++ b/tests/test_more.py\n@@ -0,0 +1,6 @@\n+from calc import add\n+\n+\n"
    "+def test_more():\n+    from tests.helpers import check\n+    check(add(2, 2), 4)\n")

_REWRITE_THE_HELPER = """
import os, sys
if "pytest" in sys.modules:  # imported while the tests are collected, before any test runs
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "helpers.py")
    if os.path.exists(helper):
        with open(helper, "w") as f:
            f.write("def check(got, want):\\n    pass\\n")
"""


async def test_a_test_helper_rewritten_on_disk_fools_in_place_grading_and_is_caught_by_diff(
        local_backend, calc_task):
    task = calc_task.model_copy(update={"instance_id": "calc__helper", "test_patch": _HELPER_TEST,
                                        "FAIL_TO_PASS": ("tests/test_more.py::test_more",)})

    async def rewrite(sb) -> None:
        await sb.write_file("calc.py", _REWRITE_THE_HELPER.encode() + await sb.read_file("calc.py"))

    assert await _in_place(local_backend, task, rewrite) == 1.0, "the trick should win in place"
    result = await _by_diff(local_backend, task, rewrite)
    assert result.reward == 0.0
    assert any("tests/helpers.py changed on disk during the run" in e for e in result.tampering), result
