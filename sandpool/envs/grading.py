"""SWE-bench style grading: run a task's tests in its sandbox and score the result.

The reward is SWE-bench's "resolved": 1.0 only if every ``FAIL_TO_PASS`` and every
``PASS_TO_PASS`` test passed, else 0.0. Before the tests run, the test files they live in (and
every ``conftest.py``) are restored from the task's ``base_commit``, so a policy cannot pass by
editing tests; then the task's ``test_patch`` is applied.

Usage::

    result = await grade(sandbox, task, timeout=300)
    result.reward, result.resolved, result.failed_f2p

A transport failure while grading (the sandbox died, the command channel broke) raises the
:class:`~sandpool.core.errors.InfraError` unchanged: an infra failure is never scored as 0.
"""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from sandpool.core import errors
from sandpool.core.base import ExecResult
from sandpool.core.task import Task

__all__ = [
    "GradeResult",
    "TestStatus",
    "files_of_tests",
    "grade",
    "parse_test_log",
    "parse_test_log_details",
    "pytest_command",
    "pytest_env",
]

#: Environment of every test run: no bytecode written into the work tree, and a terminal
#: wide enough that pytest keeps most of each failure message in its summary line.
_TEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "240", "PYTHONHASHSEED": "0"}
#: Cap on the captured test log; a longer log is an infra problem, not a failing test.
_MAX_LOG_BYTES = 64 << 20
_PATCH_PATH = "/tmp/.sandpool_test.patch"
#: Untracked files that could change how pytest runs or reports; grading deletes them.
_HOOK_FILES = r"\(^\|/\)\(conftest\.py\|pytest\.ini\|sitecustomize\.py\|usercustomize\.py\)$"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class TestStatus(enum.Enum):
    """Outcome of one test id as pytest's ``-rA`` short summary reports it."""

    __test__ = False  # not a pytest test class

    PASSED = "PASSED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    ERROR = "ERROR"
    XFAIL = "XFAIL"
    XPASS = "XPASS"

    @property
    def passed(self) -> bool:
        """True for outcomes SWE-bench counts as a pass (``PASSED`` and ``XFAIL``)."""
        return self in (TestStatus.PASSED, TestStatus.XFAIL)


# Worse outcomes win when a test id appears twice (e.g. PASSED, then ERROR at teardown).
_RANK = {
    TestStatus.PASSED: 0,
    TestStatus.XFAIL: 0,
    TestStatus.SKIPPED: 1,
    TestStatus.XPASS: 2,
    TestStatus.FAILED: 3,
    TestStatus.ERROR: 3,
}
# ``SUBFAILED(i=1) id - msg`` is pytest 9's line for a failed unittest subTest of ``id``.
_LINE = re.compile(r"^(SUB)?(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(\(.*?\))? (.+)$")


def _split_id(rest: str) -> tuple[str, str]:
    """Split ``"<node id> - <message>"``; a parametrized id may itself contain `` - ``."""
    bracket, dash = rest.find("["), rest.find(" - ")
    if bracket != -1 and (dash == -1 or bracket < dash):
        # The id ends at the first "]" followed by the end of the line or by " - ".
        i = rest.find("]", bracket)
        while i != -1:
            after = rest[i + 1 :]
            if not after or after.startswith(" - "):
                return rest[: i + 1].strip(), after[3:].strip()
            i = rest.find("]", i + 1)
    test_id, _, message = rest.partition(" - ")
    return test_id.strip(), message.strip()


def parse_test_log_details(text: str) -> dict[str, tuple[TestStatus, str]]:
    """Parse pytest ``-rA`` short-summary lines into ``{test id: (status, message)}``.

    Reads lines such as ``PASSED tests/test_a.py::test_b``, ``FAILED tests/test_a.py::test_c -
    AssertionError: ...``, ``ERROR tests/test_a.py::test_d``, ``XFAIL ... - reason`` (the format
    SWE-bench's pytest log parser reads). ANSI colour codes are stripped first. Grouped skip
    lines (``SKIPPED [2] tests/test_a.py:12: reason``) name no test id and are ignored. When an
    id appears more than once, the worse outcome is kept (a test that passed and then errored
    in teardown is ``ERROR``). pytest 9's ``SUBFAILED(params) id`` line (a failed unittest
    ``subTest``) marks ``id`` as ``FAILED`` even though pytest also prints it as ``PASSED``.

    Args:
        text: The test command's output (stdout, optionally with stderr appended).

    Returns:
        A dict from pytest node id to ``(status, message)``; ``message`` is the text after
        `` - `` on the summary line (the exception line or the xfail reason), else ``""``.
    """
    out: dict[str, tuple[TestStatus, str]] = {}
    for raw in text.splitlines():
        m = _LINE.match(_ANSI.sub("", raw).rstrip())
        if m is None:
            continue
        status, rest = TestStatus(m.group(2)), m.group(4)
        if m.group(1) and status not in (TestStatus.FAILED, TestStatus.ERROR):
            continue  # a passed or skipped subtest says nothing new about its test
        if m.group(3) and not m.group(1):
            continue
        if status is TestStatus.SKIPPED and rest.startswith("["):
            continue
        test_id, message = _split_id(rest)
        if not test_id or " " in test_id.split("[", 1)[0]:
            continue  # not a node id (a stray line that happens to start with a keyword)
        old = out.get(test_id)
        if old is None or _RANK[status] >= _RANK[old[0]]:
            out[test_id] = (status, message)
    return out


def parse_test_log(text: str) -> dict[str, TestStatus]:
    """Parse pytest ``-rA`` output into ``{test id: status}``.

    See :func:`parse_test_log_details` for the formats read.

    Args:
        text: The test command's output.

    Returns:
        A dict from pytest node id (``path::Class::test[param]``) to :class:`TestStatus`.
    """
    return {tid: status for tid, (status, _) in parse_test_log_details(text).items()}


def files_of_tests(test_ids: Iterable[str]) -> list[str]:
    """Return the sorted, distinct file paths of pytest node ids (the part before ``::``)."""
    return sorted({tid.split("::", 1)[0] for tid in test_ids if tid})



def pytest_command(paths: Iterable[str] = ()) -> str:
    """Return the shell command that runs pytest on ``paths`` in the task workdir.

    The command is ``python -m pytest -rA --tb=no -p no:cacheprovider --color=no <paths>``:
    ``-rA`` prints one summary line per test (what :func:`parse_test_log` reads), and no
    cache or colour is written. Run it with :func:`pytest_env` as the environment.

    Args:
        paths: Test files or node ids, relative to the workdir; empty runs the whole suite
            as the repo's own pytest configuration selects it.

    Returns:
        A ``bash -c`` command string with every path shell-quoted.
    """
    args = " ".join(shlex.quote(p) for p in paths)
    return f"python -m pytest -rA --tb=no -p no:cacheprovider --color=no {args}".rstrip()



def pytest_env() -> dict[str, str]:
    """Return the environment variables every test run gets (a fresh dict).

    ``PYTHONDONTWRITEBYTECODE=1`` (no ``__pycache__`` in the work tree), ``COLUMNS=240``
    (longer failure messages in the summary) and ``PYTHONHASHSEED=0`` (stable set order).
    """
    return dict(_TEST_ENV)



class _Execs(Protocol):
    async def exec(self, cmd: str | list[str], *, timeout: float = ..., cwd: str | None = ...,
                   env: dict[str, str] | None = ..., max_output: int = ...) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = ...) -> None: ...


@dataclass(frozen=True)
class GradeResult:
    """The outcome of grading one rollout.

    Attributes:
        reward: 1.0 if resolved, else 0.0.
        resolved: True when every FAIL_TO_PASS and PASS_TO_PASS test passed.
        f2p_passed: Number of FAIL_TO_PASS tests that passed.
        f2p_failed: Number of FAIL_TO_PASS tests that did not pass (failed, errored, skipped,
            or missing from the log).
        p2p_passed: Number of PASS_TO_PASS tests that passed.
        p2p_failed: Number of PASS_TO_PASS tests that did not pass.
        failed_f2p: The FAIL_TO_PASS ids that did not pass, in task order.
        failed_p2p: The PASS_TO_PASS ids that did not pass, in task order.
        timed_out: True when the test command hit its timeout (scored 0: the policy's code
            hung, e.g. an infinite loop).
        error: Why the tests could not be set up (test files could not be restored, or the
            test patch did not apply), else ``None``. Such a rollout scores 0.
        duration_s: Wall time of the test command inside the sandbox, in seconds.
        log: The test command's stdout and stderr, for debugging.
    """

    reward: float
    resolved: bool
    f2p_passed: int
    f2p_failed: int
    p2p_passed: int
    p2p_failed: int
    failed_f2p: tuple[str, ...] = ()
    failed_p2p: tuple[str, ...] = ()
    timed_out: bool = False
    error: str | None = None
    duration_s: float = 0.0
    log: str = ""


def _unresolved(task: Task, *, error: str | None, log: str = "", timed_out: bool = False,
                duration_s: float = 0.0) -> GradeResult:
    return GradeResult(
        reward=0.0, resolved=False,
        f2p_passed=0, f2p_failed=len(task.FAIL_TO_PASS),
        p2p_passed=0, p2p_failed=len(task.PASS_TO_PASS),
        failed_f2p=tuple(task.FAIL_TO_PASS), failed_p2p=tuple(task.PASS_TO_PASS),
        timed_out=timed_out, error=error, duration_s=duration_s, log=log,
    )


async def grade(sandbox: _Execs, task: Task, *, timeout: float = 300.0) -> GradeResult:
    """Grade the current state of ``sandbox`` against ``task``, as SWE-bench does.

    Steps, all in ``task.workdir``: restore the files holding the FAIL_TO_PASS/PASS_TO_PASS
    tests, and every ``conftest.py``, from ``task.base_commit`` (``git checkout <base> --
    <files>``); delete untracked ``conftest.py``, ``pytest.ini``, ``sitecustomize.py`` and
    ``usercustomize.py`` files (hooks that could rewrite test outcomes); apply
    ``task.test_patch`` if it is not empty (``git apply``); run
    :func:`pytest_command` on those files; parse the log with :func:`parse_test_log`. A test
    counts as passed only with status ``PASSED`` or ``XFAIL``; a missing, skipped or errored
    test counts as failed.

    Args:
        sandbox: Anything with the sandbox ``exec``/``write_file`` methods (a
            :class:`~sandpool.core.base.Sandbox` or a pool lease).
        task: The task; its FAIL_TO_PASS/PASS_TO_PASS must be non-empty together.
        timeout: Seconds the test command may run; on expiry the rollout scores 0 with
            ``timed_out`` set.

    Returns:
        The :class:`GradeResult`.

    Raises:
        TaskValidationError: The task lists no FAIL_TO_PASS and no PASS_TO_PASS test.
        InfraError: The sandbox died or the command channel failed (never scored), or the
            test log was too long to capture whole.
    """
    f2p, p2p = tuple(task.FAIL_TO_PASS), tuple(task.PASS_TO_PASS)
    if not f2p and not p2p:
        raise errors.TaskValidationError(
            f"task {task.instance_id}: FAIL_TO_PASS and PASS_TO_PASS are both empty; "
            "list the test ids that decide the task", field="FAIL_TO_PASS",
        )
    files = files_of_tests(f2p + p2p)
    wd, base = task.workdir, task.base_commit
    quoted = " ".join(shlex.quote(f) for f in files)
    restore = (
        f"git checkout -q {base} -- {quoted} && "
        f"git ls-tree -r --name-only -z {base} | grep -z '\\(^\\|/\\)conftest\\.py$' "
        f"| xargs -0 -r git checkout -q {base} -- && "
        f"git ls-files -z --others | grep -z '{_HOOK_FILES}' | xargs -0 -r rm -f --"
    )
    res = await sandbox.exec(restore, timeout=120.0, cwd=wd)
    if not res.ok:
        return _unresolved(task, error=f"restoring test files from {base[:12]} failed: "
                           f"{(res.err_text or res.text).strip()[-500:]}")
    if task.test_patch:
        await sandbox.write_file(_PATCH_PATH, task.test_patch.encode())
        res = await sandbox.exec(f"git apply {_PATCH_PATH}", timeout=120.0, cwd=wd)
        if not res.ok:
            why = res.err_text.strip()[-500:]
            return _unresolved(task, error=f"test_patch did not apply: {why}")

    res = await sandbox.exec(pytest_command(files), timeout=timeout, cwd=wd, env=pytest_env(),
                             max_output=_MAX_LOG_BYTES)
    log = res.text + ("\n" + res.err_text if res.stderr else "")
    if res.stdout_truncated:
        raise errors.ExecTransportError(
            f"task {task.instance_id}: the test log exceeded {_MAX_LOG_BYTES} bytes and was cut, "
            "so it cannot be graded"
        )
    if res.timed_out:
        return _unresolved(task, error=None, log=log, timed_out=True, duration_s=res.duration_s)

    status = parse_test_log(res.text)

    def ok(tid: str) -> bool:
        s = status.get(tid)
        return s is not None and s.passed

    failed_f2p = tuple(t for t in f2p if not ok(t))
    failed_p2p = tuple(t for t in p2p if not ok(t))
    resolved = not failed_f2p and not failed_p2p
    return GradeResult(
        reward=1.0 if resolved else 0.0,
        resolved=resolved,
        f2p_passed=len(f2p) - len(failed_f2p),
        f2p_failed=len(failed_f2p),
        p2p_passed=len(p2p) - len(failed_p2p),
        p2p_failed=len(failed_p2p),
        failed_f2p=failed_f2p,
        failed_p2p=failed_p2p,
        duration_s=res.duration_s,
        log=log,
    )
