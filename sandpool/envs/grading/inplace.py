"""Grade in place: run a task's tests in the sandbox the policy itself left, and score them.

This grader trusts nothing the policy wrote that it knows of: it restores ``.git``, runs
``sandbox_side/prepare.py`` (restores the harness's files and every test configuration file
from ``base_commit`` through a private git directory, deletes planted configuration, startup
files and shadowing modules), then runs the harness's command with the signed verdict plugin
(:mod:`sandpool.envs.grading.verdict`). Its defences are a list of known tricks in a sandbox
the policy prepared; :class:`sandpool.envs.grading.DiffGrader` grades by construction instead
(the policy's patch, checked, in a pristine sandbox) and is the grader to use.

Usage::

    result = await grade(sandbox, task, timeout=300)
    result.reward, result.resolved, result.failed_f2p, result.tampering

A transport failure while grading (the sandbox died, the command channel broke) raises the
:class:`~sandpool.core.errors.InfraError` unchanged, and a task that cannot be graded as given
raises :class:`~sandpool.core.errors.BrokenTaskError`: neither is ever scored as 0. The test
command runs with the image's interpreter (:mod:`~sandpool.envs.grading.interpreter`:
``python3`` where there is no ``python``). A run in which none of the task's tests ran has
``ran == 0`` and scores 0 here: the sandbox is the policy's, so whether the task's tests run
at all can only be checked on a pristine one (:mod:`~sandpool.envs.grading.runnable`, which
the diff grader does).
"""

from __future__ import annotations

import json
import secrets
import shlex
from pathlib import Path
from typing import Protocol

from sandpool.core import errors
from sandpool.core.base import ExecResult, Sandbox
from sandpool.core.reset import restore_git_metadata
from sandpool.core.task import Task
from sandpool.core.telemetry import traced
from sandpool.envs.grading.harness import TestPlan, plan_for
from sandpool.envs.grading.interpreter import ACTIVATE, FIND_PYTHON, commands_on_path
from sandpool.envs.grading.pytest_log import pytest_env
from sandpool.envs.grading.verdict import (
    MAX_LOG_BYTES,
    GradeResult,
    score_run,
    unresolved,
)

__all__ = ["grade"]


class _Execs(Protocol):
    async def exec(self, cmd: str | list[str], *, timeout: float = ..., cwd: str | None = ...,
                   env: dict[str, str] | None = ..., max_output: int = ...) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = ...) -> None: ...


_SIDE = Path(__file__).with_name("sandbox_side")


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
    the harness's test command (:func:`sandpool.envs.grading.harness.plan_for`) with the signed
    verdict plugin loaded for pytest; score the log with the harness's parser and rule, and
    cross-check it (:mod:`sandpool.envs.grading.verdict`). Where the policy broke grading itself
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
        res = await sandbox.exec(f"{FIND_PYTHON}; cd {shlex.quote(wd)} && \"$PY\" -I -S {d}/prepare.py {d}/job.json",
                                 timeout=300.0, cwd=wd)
        try:
            prep = json.loads(res.text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return unresolved(task, harness=plan.harness, error=(
                f"restoring test files failed (exit {res.exit_code}): "
                f"{(res.err_text or res.text).strip()[-500:]}"))
        neutral = tuple([f"restored {p}" for p in prep["restored"]] + [f"removed {p}" for p in prep["removed"]]
                        + [f"neutralised {p}" for p in prep["neutralised"]])
        if prep["broken"]:
            raise errors.BrokenTaskError(f"task {task.instance_id}: {prep['broken']}", task_id=task.instance_id)
        if prep["policy_error"]:
            altered = "altered" in prep["policy_error"]  # objects that do not hash to their ids
            return unresolved(task, harness=plan.harness, error=prep["policy_error"], neutralised=neutral,
                               tampering=(prep["policy_error"],) if altered else ())
        if prep["apply_failed"]:
            return unresolved(task, harness=plan.harness, neutralised=neutral,
                               error=f"test_patch did not apply to the policy's tree: {prep['apply_failed']}")
        if plan.pytest:
            await sandbox.write_file(f"{d}/{module}.py", (_SIDE / "verdict_plugin.py").read_bytes(), mode=0o444)
            await sandbox.write_file(f"{d}/key", key, mode=0o600)
        script = _test_script(plan, wd, d, module)
        res = await sandbox.exec(script, timeout=timeout, cwd=wd, env=pytest_env(), max_output=MAX_LOG_BYTES)
        log = res.text + ("\n" + res.err_text if res.stderr else "")
        if res.stdout_truncated or res.stderr_truncated:
            # The code under test wrote it (a task whose gold run does this fails validation):
            # the policy's result, as a timeout is, never an infra failure it could hide behind.
            return unresolved(task, harness=plan.harness, neutralised=neutral, exit_code=res.exit_code,
                               duration_s=res.duration_s, log=log[-(64 << 10):], error=(
                                   f"the test log exceeded {MAX_LOG_BYTES} bytes and was cut, "
                                   "so it cannot be graded (scored 0)"))
        report = None
        if plan.pytest:
            try:
                report = await sandbox.read_file(f"{d}/report.jsonl")
            except (FileNotFoundError, errors.SandboxFileError):  # gone, or not a file (a FIFO)
                report = None
    finally:
        await sandbox.exec(f"rm -rf {d}", timeout=60.0)
    return score_run(task, plan, res, log, report, key, neutral=neutral,
                     suspicious=list(prep["suspicious"]))


def _test_script(plan: TestPlan, wd: str, d: str, module: str) -> str:
    lines = [f"cd {shlex.quote(wd)}", ACTIVATE, FIND_PYTHON, commands_on_path(f"{d}/bin"), *plan.prelude,
             "unset PYTEST_PLUGINS PYTEST_ADDOPTS", "export PYTHONNOUSERSITE=1"]
    if plan.pytest:
        lines += [f"export PYTHONPATH={d}${{PYTHONPATH:+:$PYTHONPATH}}",
                  f"export PYTEST_ADDOPTS='-p {module}'",
                  f"export SANDPOOL_VERDICT={d}/key:{d}/report.jsonl"]
    return "\n".join([*lines, plan.command]) + "\n"
