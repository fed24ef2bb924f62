"""The patch policy: what a policy's patch may change, checked on the host before it is applied.

A patch is the policy's whole answer (see :mod:`sandpool.envs.grading.capture`). Before it
touches the grading sandbox, :func:`check_patch` sorts its file changes into three kinds:

**Reset, as the harness does** (the change is dropped, the rest of the patch is graded).
The tests, which are:

* every file the task's ``test_patch`` touches, modified or added;
* every file holding one of the task's FAIL_TO_PASS / PASS_TO_PASS tests (the pytest node
  id's path, for harnesses that name tests by path);
* the repo script the harness's test command runs (sympy's ``bin/test``, django's
  ``tests/runtests.py``);
* the ``__init__.py`` of each directory holding one of those files (below the repo root),
  and of each parent directory named ``test``, ``tests`` or ``testing`` above it: importing
  a test module imports them first;
* everything under the nearest directory named ``test``, ``tests`` or ``testing`` that holds
  one of those files: the tests' data, golden files and helpers (a golden file rewritten to
  the buggy output passes its test).

**Refused** (the rollout scores 0, with the reasons recorded):

* start-up and plugin hooks: ``conftest.py``, ``sitecustomize.py``, ``usercustomize.py``,
  ``*.pth``, anywhere in the tree;
* test-runner configuration, anywhere in the tree: every file name pytest reads its
  configuration from (``pytest.toml``, ``.pytest.toml``, ``pytest.ini``, ``.pytest.ini``,
  ``pyproject.toml``, ``tox.ini``, ``setup.cfg``: pytest 9's ``CONFIG_LOADERS_BY_NAME``),
  and ``.coveragerc`` (coverage's plugins load under pytest-cov);
* packaging metadata: anything under a ``*.egg-info`` or ``*.dist-info`` directory, an
  ``entry_points.txt`` or ``*.egg-link`` anywhere (pytest loads ``pytest11`` entry points);
* bytecode: ``*.pyc``, ``*.pyo``, anything under ``__pycache__``;
* git's own files in the tree: ``.gitattributes``, ``.gitmodules``;
* a package or extension module of a test module's name beside it (anything under
  ``pkg/test_a/``, or ``pkg/test_a*.so``, next to ``pkg/test_a.py``) that is not itself
  reset as a test: Python's path finder takes a package, or an extension module, before
  the source file of the same name, so pytest would run its tests instead;
* symlinks and submodules (modes ``120000``, ``160000``), a new file that is not mode
  ``100644``, any mode change, and binary changes;
* paths outside the repo: absolute, with a ``..``, ``.`` or empty component, or through a
  ``.git`` directory;
* a patch over ``max_bytes``, or one :func:`~sandpool.envs.grading.patch.parse_patch` cannot
  read in full.

**Everything else is applied**: source files added, changed or deleted.

Where this mirrors SWE-bench (swebench 4.1.0's ``run_evaluation``): the model patch is
applied to the pristine base, then the files the test patch modifies are reset to
``base_commit`` and the test patch applied (``make_eval_script_list_py``), so a model's edit
to those files never counts. Dropping those changes before applying gives the same tree.

Where it is stricter, and why: SWE-bench applies any patch and resets only the test patch's
modified files. Here the files holding the task's tests, the test runner script and the test
packages' ``__init__.py`` are reset too, because each runs inside the test process before or
around the tests (a test package's ``__init__.py`` can swap the test functions' code). The
refused kinds change what the test process loads or how, not what the code does: a hook or a
config file runs code before any verdict machinery or reconfigures pytest, packaging metadata
registers plugins, bytecode is loaded instead of the source, a symlink points outside the
repo, a binary cannot be reviewed as text. A fix never needs them; ``sandpool validate``
checks each task's gold patch against this policy, so a task whose honest fix does is
reported, never silently scored 0.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass, field

from sandpool.core.task import Task
from sandpool.envs.grading.harness import TestPlan, added_files, plan_for
from sandpool.envs.grading.patch import FileChange, PatchError, join_patch, parse_patch

__all__ = ["CONFIG_NAMES", "HOOK_NAMES", "MAX_PATCH_BYTES", "PatchVerdict", "check_patch",
           "counted_as_tests"]

#: Cap on a patch, in bytes; a larger one is refused.
MAX_PATCH_BYTES = 1 << 20
#: Start-up and plugin hooks, by file name.
HOOK_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py")
#: Test-runner configuration, by file name (pytest 9's ``CONFIG_LOADERS_BY_NAME``, and coverage's).
CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml",
                "tox.ini", "setup.cfg", ".coveragerc")
_GIT_NAMES = (".gitattributes", ".gitmodules")
_TEST_DIRS = ("test", "tests", "testing")


@dataclass(frozen=True)
class PatchVerdict:
    """What the policy makes of one patch.

    Attributes:
        patch: The patch to apply: the input without the reset changes.
        refused: Why the patch is refused, one sentence per file (empty: it may be applied).
        reset: Test files whose changes were dropped, as the harness resets them.
        changes: Every file change of the input, parsed.
    """

    patch: str
    refused: tuple[str, ...] = ()
    reset: tuple[str, ...] = ()
    changes: tuple[FileChange, ...] = field(default=(), repr=False)


def _runner_script(command: str) -> str | None:
    try:
        first = shlex.split(command)[0] if command.strip() else ""
    except ValueError:
        return None
    if "/" in first and not first.startswith("/"):
        return posixpath.normpath(first)
    return None


def counted_as_tests(task: Task, plan: TestPlan | None = None) -> frozenset[str]:
    """The files that count as the task's tests (see the module docstring), repo-relative;
    a path ending in ``/`` stands for everything under that directory.

    Raises:
        BrokenTaskError: The task has no harness plan (see :func:`plan_for`).
    """
    plan = plan or plan_for(task)
    files = set(plan.restore) | set(plan.required) | set(added_files(plan.test_patch))
    for tid in (*task.FAIL_TO_PASS, *task.PASS_TO_PASS):
        path = tid.split("::", 1)[0]
        if "::" in tid and path.endswith(".py"):
            files.add(path)
    script = _runner_script(plan.command)
    if script:
        files.add(script)
    inits = set()
    for f in files:
        d = posixpath.dirname(f)
        if d:
            inits.add(posixpath.join(d, "__init__.py"))
        nearest = True
        while d:
            if posixpath.basename(d) in _TEST_DIRS:
                inits.add(posixpath.join(d, "__init__.py"))
                if nearest:
                    inits.add(d + "/")
                    nearest = False
            d = posixpath.dirname(d)
    return frozenset(files | inits)


def _is_test(path: str, tests: frozenset[str]) -> bool:
    return path in tests or any(path.startswith(t) for t in tests if t.endswith("/"))


def _outside(path: str) -> bool:
    parts = path.split("/")
    return (path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") or p.lower() == ".git" for p in parts))


def _shadowed(path: str, modules: frozenset[str]) -> str | None:
    """The test module (a ``.py`` path in ``modules``) that ``path`` shadows, if any: a path
    under a directory of the module's name (a package), or an extension module of its name."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        if "/".join(parts[:i]) + ".py" in modules:
            return "/".join(parts[:i]) + ".py"
    test = posixpath.join(posixpath.dirname(path), parts[-1].split(".", 1)[0]) + ".py"
    return test if test in modules and path.endswith(".so") else None  # an extension module


def _refusal(change: FileChange) -> str | None:
    """Why the policy refuses ``change`` (None: it does not)."""
    for path in change.paths:
        name, parts = posixpath.basename(path), path.split("/")
        if _outside(path):
            return f"{path!r} is outside the repo"
        if name in HOOK_NAMES or name.endswith(".pth"):
            return f"{path} is a start-up or plugin hook"
        if name in CONFIG_NAMES:
            return f"{path} is test-runner configuration"
        if (any(p.endswith((".egg-info", ".dist-info")) for p in parts[:-1])
                or name == "entry_points.txt" or name.endswith((".egg-link", ".egg-info", ".dist-info"))):
            return f"{path} is packaging metadata"
        if name.endswith((".pyc", ".pyo")) or "__pycache__" in parts:
            return f"{path} is bytecode"
        if name in _GIT_NAMES:
            return f"{path} is git's own configuration"
    path = change.paths[-1]
    modes = {change.old_mode, change.new_mode}
    if "120000" in modes:
        return f"{path} is a symlink"
    if "160000" in modes:
        return f"{path} is a submodule"
    if change.binary:
        return f"{path} is a binary change"
    if change.old_path is None and change.new_mode not in (None, "100644"):
        return f"{path} is added with mode {change.new_mode} (only 100644 is allowed)"
    if change.old_mode and change.new_mode and change.old_mode != change.new_mode:
        return f"{path} changes mode {change.old_mode} -> {change.new_mode}"
    return None


def check_patch(patch: bytes | str, task: Task, *, max_bytes: int = MAX_PATCH_BYTES,
                plan: TestPlan | None = None) -> PatchVerdict:
    """Check a patch against the policy (see the module docstring) before it is applied.

    Args:
        patch: The patch (a git diff); bytes are decoded as UTF-8, undecodable bytes kept.
        task: The task it answers.
        max_bytes: Cap on the patch's size.
        plan: The task's harness plan, when already built.

    Returns:
        The :class:`PatchVerdict`: ``refused`` empty means ``patch`` may be applied.

    Raises:
        BrokenTaskError: The task has no harness plan.
    """
    raw = patch if isinstance(patch, bytes) else patch.encode("utf-8", "surrogateescape")
    if len(raw) > max_bytes:
        return PatchVerdict("", (f"the patch is {len(raw)} bytes, over the cap of {max_bytes}",))
    text = raw.decode("utf-8", "surrogateescape")
    try:
        changes = parse_patch(text)
    except PatchError as exc:
        return PatchVerdict("", (f"the patch cannot be read as a git diff: {exc}",))
    tests = counted_as_tests(task, plan)
    keep: list[FileChange] = []
    reset: list[str] = []
    refused: list[str] = []
    modules = frozenset(t for t in tests if t.endswith(".py"))
    for change in changes:
        why = _refusal(change)
        is_test = any(_is_test(p, tests) for p in change.paths)
        shadowed = None if is_test else next(filter(None, (_shadowed(p, modules) for p in change.paths)), None)
        if why is None and shadowed is not None:
            why = f"{change.paths[-1]} shadows the test module {shadowed}"
        if why is not None:
            refused.append(why)
        elif is_test:
            reset.extend(change.paths)
        else:
            keep.append(change)
    if refused:
        return PatchVerdict("", tuple(refused), tuple(reset), tuple(changes))
    return PatchVerdict(join_patch(keep), (), tuple(reset), tuple(changes))
