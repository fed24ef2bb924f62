"""Grading: run a task's tests in its sandbox as the task's own harness does, and score them.

The reward is the harness's "resolved" (1.0 or 0.0). Which commands run, which files are
reset, how the log is parsed and what counts as resolved come from the task's harness
(:mod:`sandpool.envs.harness`: swebench 4.1.0 for SWE-bench rows, SWE-smith's and R2E-Gym's
rules for theirs, ``pytest -rA`` for sandpool's pack). The verdict does not rest on text the
code under test can print: for pytest a signed report is cross-checked with the log, the exit
status and pytest's counts (:mod:`sandpool.envs.verdict`), and a disagreement scores 0 with
its evidence. No hook, filter or config file the policy planted runs during grading.

This module also holds the pytest ``-rA`` log parser of the pack's harness.

Usage::

    result = await grade(sandbox, task, timeout=300)
    result.reward, result.resolved, result.failed_f2p, result.tampering

A transport failure while grading (the sandbox died, the command channel broke) raises the
:class:`~sandpool.core.errors.InfraError` unchanged, and a task that cannot be graded as given
raises :class:`~sandpool.core.errors.BrokenTaskError`: neither is ever scored as 0.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sandpool.core import errors
from sandpool.core.base import ExecResult, Sandbox
from sandpool.core.reset import restore_git_metadata
from sandpool.core.task import Task
from sandpool.core.telemetry import traced
from sandpool.envs.harness import TestPlan, plan_for
from sandpool.envs.verdict import RUNNERS, cross_check, read_signed_report, runner_check

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
#: Cap on the captured test log; a longer log scores 0 (the code under test wrote it).
_MAX_LOG_BYTES = 64 << 20
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

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = ...) -> None: ...


@dataclass(frozen=True)
class GradeResult:
    """The outcome of grading one rollout.

    Attributes:
        reward: 1.0 if resolved, else 0.0.
        resolved: True when the harness's rule says resolved and every cross-check agreed.
        f2p_passed: Number of FAIL_TO_PASS tests that passed.
        f2p_failed: Number of FAIL_TO_PASS tests that did not pass.
        p2p_passed: Number of PASS_TO_PASS tests that passed.
        p2p_failed: Number of PASS_TO_PASS tests that did not pass.
        failed_f2p: The FAIL_TO_PASS ids that did not pass, in task order.
        failed_p2p: The PASS_TO_PASS ids that did not pass, in task order.
        timed_out: True when the test command hit its timeout (scored 0: the policy's code
            hung, e.g. an infinite loop).
        error: Why the tests could not run as the harness runs them, when the policy's state
            is the cause (it destroyed ``.git``, the test patch does not apply to its tree,
            its code wrote a test log over the capture cap);
            scored 0. A cause in the task itself raises instead (see :func:`grade`).
        tampering: Evidence that the policy's code forged a pass (scored 0), one sentence each.
        neutralised: Test configuration restored or removed, and startup files deleted, before
            the tests ran.
        harness: Which harness graded (see :mod:`sandpool.envs.harness`).
        exit_code: The test command's exit status (``None`` when it did not run).
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
    tampering: tuple[str, ...] = ()
    neutralised: tuple[str, ...] = ()
    harness: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    log: str = ""


def _unresolved(task: Task, **kw: object) -> GradeResult:
    return GradeResult(
        reward=0.0, resolved=False,
        f2p_passed=0, f2p_failed=len(task.FAIL_TO_PASS),
        p2p_passed=0, p2p_failed=len(task.PASS_TO_PASS),
        failed_f2p=tuple(task.FAIL_TO_PASS), failed_p2p=tuple(task.PASS_TO_PASS), **kw,  # type: ignore[arg-type]
    )


_SIDE = Path(__file__).with_name("sandbox_side")
#: The interpreter grading's helper runs with: the SWE-bench env's, else the image's python.
_FIND_PYTHON = ('for p in /opt/miniconda3/envs/testbed/bin/python "$(command -v python3)" '
                '"$(command -v python)"; do [ -x "$p" ] && PY="$p" && break; done; ')
_ACTIVATE = ("if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate "
             "&& conda activate testbed; fi")


async def _restore_git(sandbox: _Execs) -> None:
    # First kill the processes the policy left (one could race grading: read the key file,
    # rewrite restored files), then make .git the image's (config, hooks, info/attributes,
    # refs, objects): core.reset.restore_git_metadata does both. A bare exec surface (no
    # Sandbox behind it) gets only the kill; prepare.py's private git dir and hash-verified
    # reads then stand alone.
    target = getattr(sandbox, "sandbox", sandbox)
    if isinstance(target, Sandbox):
        await restore_git_metadata(target)
        return
    kill = getattr(target, "kill_strays", None)
    if kill is not None:
        await kill()


@traced("sandpool.grade", lambda sandbox, task, **_: {"task_id": task.instance_id, "image": task.image})
async def grade(sandbox: _Execs, task: Task, *, timeout: float = 300.0) -> GradeResult:
    """Grade the current state of ``sandbox`` against ``task`` as the task's harness does.

    Steps: kill the policy's leftover processes and restore ``.git`` to the image's
    (:func:`sandpool.core.reset.restore_git_metadata`); run ``sandbox_side/prepare.py`` (restore
    the harness's reset files and all test configuration from ``base_commit`` through a
    private git directory, so no planted hook, filter or config runs; delete test
    configuration the base does not have; check the test patch applies to the pristine base,
    then apply it; neutralise startup files changed in a writable Python environment); run
    the harness's test command (:func:`sandpool.envs.harness.plan_for`) with the signed
    verdict plugin loaded for pytest; score the log with the harness's parser and rule, and
    cross-check it (:mod:`sandpool.envs.verdict`). Where the policy broke grading itself
    (its tree rejects the test patch, it deleted ``.git``) the rollout scores 0 with
    ``error`` set, as the SWE-bench harness scores a run whose eval script failed.

    Args:
        sandbox: Anything with the sandbox ``exec``/``read_file``/``write_file`` methods (a
            :class:`~sandpool.core.base.Sandbox` or a pool lease).
        task: The task.
        timeout: Seconds the test command may run; on expiry the rollout scores 0 with
            ``timed_out`` set.

    Returns:
        The :class:`GradeResult`.

    Raises:
        BrokenTaskError: The task cannot be graded as given, shown on its pristine tree: no
            test command, no tests listed, or the test patch does not apply to base_commit.
        InfraError: The sandbox died or the command channel failed (never scored), or ``.git``
            could not be restored to the image's (``ResetError``). A test log too long to
            capture whole scores 0 with ``error`` set: the code under test wrote it.
    """
    plan = plan_for(task)
    await _restore_git(sandbox)
    f2p, p2p = tuple(task.FAIL_TO_PASS), tuple(task.PASS_TO_PASS)
    wd = task.workdir
    d = f"/tmp/.sandpool-grade-{secrets.token_hex(8)}"
    module = f"_sandpool_verdict_{secrets.token_hex(8)}"
    key = secrets.token_bytes(32)
    job = {"workdir": wd, "base": task.base_commit, "git_dir": f"{d}/git",
           "restore": list(plan.restore), "required": list(plan.required), "test_patch": f"{d}/test.patch" if plan.test_patch else None}
    await sandbox.write_file(f"{d}/prepare.py", (_SIDE / "prepare.py").read_bytes(), mode=0o444)
    await sandbox.write_file(f"{d}/job.json", json.dumps(job).encode())
    if plan.test_patch:
        await sandbox.write_file(f"{d}/test.patch", plan.test_patch.encode())
    try:
        res = await sandbox.exec(f"{_FIND_PYTHON}cd {shlex.quote(wd)} && \"$PY\" -I -S {d}/prepare.py {d}/job.json",
                                 timeout=300.0, cwd=wd)
        try:
            prep = json.loads(res.text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return _unresolved(task, harness=plan.harness, error=(
                f"restoring test files failed (exit {res.exit_code}): "
                f"{(res.err_text or res.text).strip()[-500:]}"))
        neutral = tuple([f"restored {p}" for p in prep["restored"]] + [f"removed {p}" for p in prep["removed"]]
                        + [f"neutralised {p}" for p in prep["neutralised"]])
        if prep["broken"]:
            raise errors.BrokenTaskError(f"task {task.instance_id}: {prep['broken']}", task_id=task.instance_id)
        if prep["policy_error"]:
            altered = "altered" in prep["policy_error"]  # objects that do not hash to their ids
            return _unresolved(task, harness=plan.harness, error=prep["policy_error"], neutralised=neutral,
                               tampering=(prep["policy_error"],) if altered else ())
        if prep["apply_failed"]:
            return _unresolved(task, harness=plan.harness, neutralised=neutral,
                               error=f"test_patch did not apply to the policy's tree: {prep['apply_failed']}")
        if plan.pytest:
            await sandbox.write_file(f"{d}/{module}.py", (_SIDE / "verdict_plugin.py").read_bytes(), mode=0o444)
            await sandbox.write_file(f"{d}/key", key, mode=0o600)
        script = _test_script(plan, wd, d, module)
        res = await sandbox.exec(script, timeout=timeout, cwd=wd, env=pytest_env(), max_output=_MAX_LOG_BYTES)
        log = res.text + ("\n" + res.err_text if res.stderr else "")
        if res.stdout_truncated or res.stderr_truncated:
            # The code under test wrote it (a task whose gold run does this fails validation):
            # the policy's result, as a timeout is, never an infra failure it could hide behind.
            return _unresolved(task, harness=plan.harness, neutralised=neutral, exit_code=res.exit_code,
                               duration_s=res.duration_s, log=log[-(64 << 10):], error=(
                                   f"the test log exceeded {_MAX_LOG_BYTES} bytes and was cut, "
                                   "so it cannot be graded (scored 0)"))
        report = None
        if plan.pytest:
            try:
                report = await sandbox.read_file(f"{d}/report.jsonl")
            except (FileNotFoundError, errors.SandboxFileError):  # gone, or not a file (a FIFO)
                report = None
    finally:
        await sandbox.exec(f"rm -rf {d}", timeout=60.0)
    return _score(task, plan, res, log, report, key, neutral, list(prep["suspicious"]))


def _test_script(plan: TestPlan, wd: str, d: str, module: str) -> str:
    lines = [f"cd {shlex.quote(wd)}", _ACTIVATE, *plan.prelude, "unset PYTEST_PLUGINS PYTEST_ADDOPTS",
             "export PYTHONNOUSERSITE=1"]
    if plan.pytest:
        lines += [f"export PYTHONPATH={d}${{PYTHONPATH:+:$PYTHONPATH}}",
                  f"export PYTEST_ADDOPTS='-p {module}'",
                  f"export SANDPOOL_VERDICT={d}/key:{d}/report.jsonl"]
    return "\n".join([*lines, plan.command]) + "\n"


def _score(task: Task, plan: TestPlan, res: ExecResult, log: str, report: bytes | None, key: bytes,
           neutral: tuple[str, ...], suspicious: list[str]) -> GradeResult:
    f2p, p2p = tuple(task.FAIL_TO_PASS), tuple(task.PASS_TO_PASS)
    common = {"harness": plan.harness, "neutralised": neutral, "exit_code": res.exit_code,
              "duration_s": res.duration_s, "log": log}
    if res.timed_out:
        return _unresolved(task, timed_out=True, **common)
    status = plan.parse(log)
    resolved, failed_f2p, failed_p2p = plan.score(status)
    evidence = list(suspicious)
    if plan.pytest:
        rep = read_signed_report(report, key)
        evidence += cross_check(rep, log=log, log_status=status, exit_code=res.exit_code,
                                tests=f2p + p2p, id_of=plan.id_of)
        if rep.sealed:
            # The harness's rule must also hold on the signed report's outcomes.
            by_id: dict[str, str] = {}
            for nodeid, st in rep.statuses.items():
                by_id[plan.id_of(nodeid)] = st
            ok, rep_f2p, rep_p2p = plan.score(by_id)
            if resolved and not ok:
                resolved, failed_f2p, failed_p2p = False, rep_f2p, rep_p2p
        elif resolved:  # pytest did not finish: nothing it reported can resolve the task
            resolved, failed_f2p, failed_p2p = False, f2p, p2p
    else:
        evidence += runner_check(log, res.exit_code, resolved_by_log=resolved,
                                 runner=RUNNERS.get(task.repo, ""))
    if evidence:
        return _unresolved(task, tampering=tuple(evidence), **common)
    return GradeResult(
        reward=1.0 if resolved else 0.0, resolved=resolved,
        # R2E-Gym compares whole maps: its "failed" lists hold mismatched keys, not listed ids.
        f2p_passed=max(0, len(f2p) - len(failed_f2p)), f2p_failed=len(failed_f2p),
        p2p_passed=max(0, len(p2p) - len(failed_p2p)), p2p_failed=len(failed_p2p),
        failed_f2p=failed_f2p, failed_p2p=failed_p2p, **common,
    )
