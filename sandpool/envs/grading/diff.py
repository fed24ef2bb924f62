"""Grade the diff, not the sandbox: the policy's patch, checked, applied in a pristine sandbox.

This is how the SWE-bench harness grades a prediction (swebench 4.1.0 ``run_evaluation``: the
model patch applied to a fresh container, then ``make_eval_script_list_py``'s reset of the
test patch's files, the test patch, and the test command), with three things added:

1. the patch is checked against the patch policy on the host before it is applied
   (:mod:`sandpool.envs.grading.policy`): a refused patch scores 0 with its reasons;
2. for pytest harnesses the tests run in an isolated process (``sandbox_side/runner.py``):
   a clean environment, no ``site`` at start-up, pytest and the signed verdict plugin
   imported before anything from the repo, the site directories ahead of the repo on
   ``sys.path``, no bytecode written, and a per-run key in no environment,
   argument or file the code under test can read;
3. every read from the sandbox is bounded (the log by ``max_output``, the report by a cap):
   an oversized report or log is the policy's failure, scored 0, never an infra failure.

The sandbox given to :func:`grade_patch` must be pristine at ``task.base_commit`` (a verified
in-place reset, :meth:`~sandpool.core.pool.Lease.reset`, or a fresh claim): nothing the
policy did reaches it but the patch.

Every harness runs with the image's interpreter (:mod:`~sandpool.envs.grading.interpreter`:
``python3`` where the image has no ``python``).

What is evidence of a broken task (:class:`~sandpool.core.errors.BrokenTaskError`, the task
rejected, never a reward), found before the patch is applied: the image has no Python; the
test patch does not apply to ``base_commit``. A run in which none of the task's tests ran
(``GradeResult.ran == 0``: the test command could not start, with ``not_run`` saying why when
the image's Python could not import pytest, or it collected none of them) is not, by
itself: the patch can break collection (or its code exit early) on purpose, and the base's
own bug can stop collection. Whether the tests run at all is decided on pristine sandboxes
(:mod:`~sandpool.envs.grading.runnable`; validation's gold and empty runs), never on the
policy's run.
"""

from __future__ import annotations

import json
import posixpath
import re
import secrets
import shlex
from pathlib import Path

from sandpool.core import errors
from sandpool.core.reset import SAFE_GIT
from sandpool.core.task import Task
from sandpool.core.telemetry import traced
from sandpool.envs.grading.harness import TestPlan, plan_for
from sandpool.envs.grading.interpreter import ACTIVATE, FIND_PYTHON, commands_on_path
from sandpool.envs.grading.policy import MAX_PATCH_BYTES, check_patch, counted_as_tests
from sandpool.envs.grading.pytest_log import pytest_env
from sandpool.envs.grading.verdict import MAX_LOG_BYTES, GradeResult, score_run, unresolved

__all__ = ["MAX_REPORT_BYTES", "grade_patch"]

#: Cap on the signed report read back from the sandbox; a larger one scores 0.
MAX_REPORT_BYTES = 16 << 20
_SIDE = Path(__file__).with_name("sandbox_side")
_ENV_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PATCH_FAILED, _TEST_PATCH_FAILED, _NO_PYTHON = 10, 11, 12
_STARTED = "@@sandpool-runner-started"  # sandbox_side/runner.py's STARTED
#: Seconds grading waits for its own directory to be removed after the run.
_CLEANUP_TIMEOUT_S = 10.0


def _pytest_argv(command: str) -> tuple[list[str], bool, dict[str, str]] | None:
    """pytest's arguments in a harness command, whether it runs ``python -m pytest`` (the
    workdir then goes on ``sys.path``), and its leading ``VAR=value`` assignments; None when
    the command is not a plain pytest command (R2E-Gym's ``bash /root/run_tests.sh``)."""
    try:
        toks = shlex.split(command)
    except ValueError:
        return None
    env: dict[str, str] = {}
    while toks and _ENV_VAR.match(toks[0]):
        name, value = toks.pop(0).split("=", 1)
        env[name] = value
    if toks[:1] in (["pytest"], ["py.test"]):
        return toks[1:], False, env
    if len(toks) >= 3 and re.match(r"^python[0-9.]*$", posixpath.basename(toks[0])) and toks[1:3] == ["-m", "pytest"]:
        return toks[3:], True, env
    return None


def _prepare_script(task: Task, plan: TestPlan, d: str, *, patch: bool, files: list[str],
                    test_dirs: list[str]) -> str:
    """Find the image's Python (before the patch: nothing of it can hide one), apply the patch,
    reset the test files, apply the test patch, keep the harness's environment.

    Runs only the harness's own commands and git on the pristine repo (its ``.git`` is the
    image's): nothing of the repo's code runs yet.
    """
    base = shlex.quote(task.base_commit)
    lines = ["set -u", f"cd {shlex.quote(task.workdir)} || exit 120", ACTIVATE, FIND_PYTHON,
             f'[ -n "$PY" ] || {{ echo "no python3 or python on PATH=$PATH"; exit {_NO_PYTHON}; }}',
             commands_on_path(f"{d}/bin"), *plan.prelude]
    if patch:
        lines.append(f"{SAFE_GIT} apply -v --whitespace=nowarn {d}/patch.diff > {d}/apply.log 2>&1 || "
                     f"{{ tail -c 2000 {d}/apply.log; exit {_PATCH_FAILED}; }}")
    for f in files:  # the harness's reset: files at base_commit only (a test file it adds is not)
        q = shlex.quote(f)
        lines.append(f"if {SAFE_GIT} cat-file -e {base}:{q} 2>/dev/null; then "
                     f"{SAFE_GIT} checkout -q {base} -- {q}; fi")
    if plan.test_patch:
        lines.append(
            f"{SAFE_GIT} apply -v --whitespace=nowarn {d}/test.patch > {d}/apply.log 2>&1 || {{ "
            f"tail -c 2000 {d}/apply.log; GIT_INDEX_FILE={d}/base.index {SAFE_GIT} read-tree {base} && "
            f"GIT_INDEX_FILE={d}/base.index {SAFE_GIT} apply --check --cached {d}/test.patch "
            f">/dev/null 2>&1 && echo 'applies to base' ; exit {_TEST_PATCH_FAILED}; }}")
    # What each test module, conftest.py and Python file under the tests' directories holds
    # before any of the repo's code runs.
    dirs = " ".join(f"-o -path {shlex.quote('./' + t + '*')} -name '*.py'" for t in test_dirs)
    lines.append(f"find . -path ./.git -prune -o -type f \\( -name 'test_*.py' -o -name '*_test.py' "
                 f"-o -name conftest.py {dirs} \\) -print0 | xargs -0 -r sha256sum -- > {d}/tests.sha256")
    lines += [
        f"env -0 > {d}/env.all",
        f"grep -zv -e '^PYTHON' -e '^PYTEST_ADDOPTS=' -e '^PYTEST_PLUGINS=' -e '^SANDPOOL_' "
        f"{d}/env.all > {d}/env.clean",
    ]
    lines.append('echo "@@python $PY"')
    return "\n".join(lines) + "\n"


def _clean_env(d: str) -> str:
    # The harness's environment without PYTHON* (so no PYTHONPATH entry in the repo is on
    # sys.path at start-up), plus grading's own; SANDPOOL_EXEC lets the agent find the run.
    ours = " ".join(f"{k}={shlex.quote(v)}" for k, v in {
        **pytest_env(), "PYTHONNOUSERSITE": "1"}.items())
    return (f"E=(); while IFS= read -r -d '' kv; do E+=(\"$kv\"); done < {d}/env.clean; "
            f"exec env -i \"${{E[@]}}\" SANDPOOL_EXEC=\"${{SANDPOOL_EXEC:-}}\" {ours}")


def _test_script(task: Task, plan: TestPlan, d: str, python: str, *, isolated: bool, module: str) -> str:
    head = f"cd {shlex.quote(task.workdir)} || exit 120\n"
    if isolated:
        return head + f"{_clean_env(d)} {shlex.quote(python)} -s -S {d}/runner.py {d}/job.json\n"
    # Any other command (django's or sympy's runner, R2E-Gym's run_tests.sh) starts the
    # repo's code itself: it runs as the harness runs it, in the harness's environment, with
    # the verdict plugin loaded through PYTEST_ADDOPTS when it runs pytest.
    lines = [f"while IFS= read -r -d '' kv; do export \"$kv\" 2>/dev/null; done < {d}/env.all",
             "unset PYTEST_ADDOPTS PYTEST_PLUGINS",
             *(f"export {k}={shlex.quote(v)}" for k, v in pytest_env().items())]
    if plan.pytest:
        lines += [f"export PYTHONPATH={d}${{PYTHONPATH:+:$PYTHONPATH}}",
                  f"export PYTEST_ADDOPTS='-p {module}'",
                  f"export SANDPOOL_VERDICT={d}/key:{d}/report.jsonl"]
    return head + "\n".join([*lines, plan.command]) + "\n"


def _broken(task: Task, why: str) -> errors.BrokenTaskError:
    return errors.BrokenTaskError(f"task {task.instance_id}: {why}", task_id=task.instance_id)


@traced("sandpool.grade", lambda sandbox, task, patch, **_: {"task_id": task.instance_id, "image": task.image})
async def grade_patch(sandbox, task: Task, patch: bytes | str, *, timeout: float = 300.0,
                      max_patch_bytes: int = MAX_PATCH_BYTES) -> GradeResult:
    """Grade ``patch`` on a pristine sandbox as the task's harness does (see the module docstring).

    Args:
        sandbox: A sandbox pristine at ``task.base_commit`` (a
            :class:`~sandpool.core.base.Sandbox` or a pool lease).
        task: The task.
        patch: The policy's patch (see :func:`~sandpool.envs.grading.capture.capture_patch`).
        timeout: Seconds the test command may run; on expiry the rollout scores 0 with
            ``timed_out`` set.
        max_patch_bytes: Cap on the patch (over it: refused).

    Returns:
        The :class:`~sandpool.envs.grading.verdict.GradeResult`. A refused patch has
        ``refused`` set; a patch that does not apply, an oversized log or report has
        ``error`` set; evidence of a forged pass is in ``tampering``; a run in which none of
        the task's tests ran has ``ran == 0`` (and ``not_run`` when pytest could not start).
        All score 0.

    Raises:
        BrokenTaskError: The task cannot be graded as given (see the module docstring).
        InfraError: The sandbox died, the command channel failed, or preparing the run
            (no code of the policy's runs then) timed out.
    """
    plan = plan_for(task)
    verdict = check_patch(patch, task, max_bytes=max_patch_bytes, plan=plan)
    reset = tuple(f"reset {p}" for p in verdict.reset)
    if verdict.refused:
        return unresolved(task, harness=plan.harness, refused=verdict.refused, neutralised=reset,
                          error="the patch policy refuses the patch: " + "; ".join(verdict.refused))
    d = f"/tmp/.sandpool-grade-{secrets.token_hex(8)}"
    module = f"_sandpool_verdict_{secrets.token_hex(8)}"
    key = secrets.token_bytes(32)
    files = list(dict.fromkeys([*plan.restore, *verdict.reset]))
    argv = _pytest_argv(plan.command) if plan.pytest else None
    isolated = argv is not None
    tests = counted_as_tests(task, plan)
    if argv is not None:
        args, cwd_on_path, assigned = argv
        job = {"workdir": task.workdir, "args": args, "cwd_on_path": cwd_on_path, "key": f"{d}/key",
               "report": f"{d}/report.jsonl", "plugin": module, "env_file": f"{d}/env.all",
               "hashes": f"{d}/tests.sha256", "trusted": sorted(tests),
               "assigned": assigned}
        await sandbox.write_file(f"{d}/runner.py", (_SIDE / "runner.py").read_bytes(), mode=0o444)
        await sandbox.write_file(f"{d}/job.json", json.dumps(job).encode(), mode=0o444)
    if plan.pytest:
        await sandbox.write_file(f"{d}/{module}.py", (_SIDE / "verdict_plugin.py").read_bytes(), mode=0o444)
        await sandbox.write_file(f"{d}/key", key, mode=0o600)
    if verdict.patch:
        await sandbox.write_file(f"{d}/patch.diff", verdict.patch.encode("utf-8", "surrogateescape"))
    if plan.test_patch:
        await sandbox.write_file(f"{d}/test.patch", plan.test_patch.encode())
    test_dirs = sorted(t for t in tests if t.endswith("/"))
    prep = await sandbox.exec(_prepare_script(task, plan, d, patch=bool(verdict.patch), files=files,
                                              test_dirs=test_dirs),
                              timeout=300.0, cwd="/", max_output=1 << 20)
    out = (prep.text + prep.err_text).strip()
    if prep.timed_out:
        raise errors.InfraTimeout(f"preparing the test run of {task.instance_id} took over 300 s")
    if prep.exit_code == _PATCH_FAILED:
        return unresolved(task, harness=plan.harness, neutralised=reset,
                          error=f"the patch does not apply to base_commit: {out[-600:]}")
    if prep.exit_code == _TEST_PATCH_FAILED:
        if "applies to base" not in out:
            raise _broken(task, f"test_patch does not apply to base_commit {task.base_commit[:12]}: {out[-400:]}")
        return unresolved(task, harness=plan.harness, neutralised=reset,
                          error=f"test_patch did not apply to the patched tree: {out[-600:]}")
    if prep.exit_code == _NO_PYTHON:
        raise _broken(task, f"the image has no Python to run the tests with: {out[-300:]}")
    python = next((ln[len("@@python "):] for ln in prep.text.splitlines() if ln.startswith("@@python ")), None)
    if prep.exit_code != 0 or python is None:
        raise _broken(task, f"the harness's preparation failed (exit {prep.exit_code}): {out[-400:]}")
    res = await sandbox.exec(_test_script(task, plan, d, python, isolated=isolated, module=module),
                             timeout=timeout, cwd="/",
                             max_output=MAX_LOG_BYTES)
    log = res.text + ("\n" + res.err_text if res.stderr else "")
    if isolated and not res.timed_out and _STARTED not in res.text[:4096]:
        # Nothing of the repo's ran, but the patch was applied: a pristine run says whose.
        return unresolved(task, harness=plan.harness, neutralised=reset, exit_code=res.exit_code,
                          duration_s=res.duration_s, log=log[-(64 << 10):], ran=0, not_run=(
                              f"the image's Python ({python}) cannot run pytest (exit {res.exit_code}): "
                              f"{res.err_text.strip()[-400:]}"))
    log = "\n".join(ln for ln in log.split("\n") if not ln.startswith(_STARTED))
    target = getattr(sandbox, "sandbox", sandbox)
    if hasattr(target, "kill_strays"):
        await target.kill_strays()  # nothing of the code under test runs while its output is read
    report, oversized = await _read_report(sandbox, d) if plan.pytest else (None, False)
    await _remove(sandbox, d)
    common = {"harness": plan.harness, "neutralised": reset, "exit_code": res.exit_code,
              "duration_s": res.duration_s}
    if res.stdout_truncated or res.stderr_truncated or oversized:
        what = "verdict report" if oversized else "test log"
        cap = MAX_REPORT_BYTES if oversized else MAX_LOG_BYTES
        return unresolved(task, log=log[-(64 << 10):], **common, error=(
            f"the {what} exceeded {cap} bytes, so it cannot be graded (the code under test wrote it)"))
    return score_run(task, plan, res, log, report, key, neutral=reset)


async def _read_report(sandbox, d: str) -> tuple[bytes | None, bool]:
    """The report's bytes (None: missing or not a regular file) and whether it is over the cap."""
    r = f"{d}/report.jsonl"
    res = await sandbox.exec(f"if [ -f {r} ] && [ ! -L {r} ]; then head -c {MAX_REPORT_BYTES + 1} {r}; "
                             f"else echo missing >&2; fi", timeout=60.0, cwd="/", max_output=MAX_REPORT_BYTES)
    if res.timed_out:  # a regular file of at most the cap, read with nothing else running
        raise errors.InfraTimeout(f"reading the verdict report {r} took over 60 s")
    if res.stdout_truncated:
        return None, True
    return (None if "missing" in res.err_text else res.stdout), False


async def _remove(sandbox, d: str) -> bool:
    """Remove grading's directory ``d``, waiting at most :data:`_CLEANUP_TIMEOUT_S`; return
    whether it went in time. What the code under test put there can take longer to remove
    (it had the whole test run to make it), and is then left to the sandbox's own reset: a
    timeout here is no failure of anyone's."""
    res = await sandbox.exec(f"rm -rf {d} >/dev/null 2>&1", timeout=_CLEANUP_TIMEOUT_S, cwd="/",
                             max_output=4096)
    return not res.timed_out
