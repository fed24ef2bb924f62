"""How each dataset's own harness tests and scores a task: one :class:`TestPlan` per task.

Four harnesses, chosen by :func:`harness_of` (a row's ``harness`` column wins):

* ``swebench``: SWE-bench (full, Lite, Verified) rows. Everything comes from the pinned
  ``swebench`` package (4.1.0): the test command ``MAP_REPO_VERSION_TO_SPECS[repo][version]
  ["test_cmd"]`` plus ``get_test_directives(instance)`` and the spec's ``eval_commands``
  (``swebench.harness.test_spec.python.make_eval_script_list_py``); the files reset from
  ``base_commit`` before the test patch, ``get_modified_files(test_patch)`` (files the patch
  adds are not reset, as in the harness); the log parser ``MAP_REPO_TO_PARSER[repo]``; the
  verdict ``get_eval_tests_report`` + ``get_resolution_status == RESOLVED_FULL``, fail-only
  for ``FAIL_ONLY_REPOS`` (``swebench.harness.grading``).
  One deliberate difference: the harness's eval script re-runs the spec's ``install``
  command; sandpool does not, because that runs the policy's ``setup.py`` after grading has
  checked the environment (the image already holds the install).
* ``swe-smith``: SWE-smith rows. ``pytest --disable-warnings --color=no --tb=no --verbose``
  on the FAIL_TO_PASS files; a test absent from the log counts as passed and only an
  explicit FAILED/ERROR fails, over the FAIL_TO_PASS/PASS_TO_PASS ids in those files
  (SWE-smith ``swesmith/harness/grading.py`` ``get_eval_report``/``get_eval_tests_report``,
  ``swesmith/harness/utils.py`` ``get_test_command``, read from its repository). Grading
  adds one rule to every harness but R2E-Gym (``verdict.score_run``): a listed test that did
  not run, or was skipped, is no pass (the code under test can hide or skip one).
* ``r2e-gym``: R2E-Gym rows. ``bash /root/run_tests.sh`` with ``/root/r2e_tests`` linked at
  ``<workdir>/r2e_tests``; the pytest short summary parsed into ``Class.test`` keys (the
  node id after its file), keys cut at `` - ``; resolved only when the parsed map equals
  ``expected_output_json`` exactly (R2E-Gym ``DockerRuntime._calculate_reward_r2e``).
* ``pytest``: sandpool's own task pack. ``python -m pytest -rA`` on the FAIL_TO_PASS /
  PASS_TO_PASS files, parsed by :func:`sandpool.envs.grading.pytest_log.parse_test_log`; resolved when
  every listed test is PASSED or XFAIL.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace

from sandpool.core.errors import BrokenTaskError
from sandpool.core.task import Task

__all__ = ["HARNESSES", "TestPlan", "added_files", "harness_of", "plan_for", "reset_files",
           "reverse_patch"]

HARNESSES = ("swebench", "swe-smith", "r2e-gym", "pytest")
SWEBENCH_VERSION = "4.1.0"
_SWESMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
_PASS = ("PASSED", "XFAIL")


@dataclass(frozen=True)
class TestPlan:
    """What grading runs for one task, and how it scores the log.

    Attributes:
        harness: One of :data:`HARNESSES`.
        command: Shell command run in the workdir (after ``prelude``).
        prelude: Shell lines the harness runs first (e.g. the spec's ``eval_commands``).
        restore: Paths reset from ``base_commit`` before the test patch is applied.
        required: Test files that must be at ``base_commit`` (else the task is broken).
        test_patch: The diff applied after the reset (may be empty).
        parse: The harness's log parser: log text -> ``{test id: status}``.
        score: The harness's verdict: status map -> ``(resolved, failed_f2p, failed_p2p)``.
        id_of: Maps a pytest node id to the harness's test id (for cross-checks).
        pytest: True when ``command`` runs pytest, so the signed verdict report applies.
        tests: The harness's ids of the tests whose results decide the task (the
            FAIL_TO_PASS / PASS_TO_PASS ids it scores; R2E-Gym's ``expected_output_json``
            keys): a run that reports none of them ran none of the task's tests.
        source: Where the rules come from, for reports.
    """

    __test__ = False

    harness: str
    command: str
    parse: Callable[[str], dict[str, str]]
    score: Callable[[dict[str, str]], tuple[bool, tuple[str, ...], tuple[str, ...]]]
    prelude: tuple[str, ...] = ()
    restore: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    test_patch: str = ""
    id_of: Callable[[str], str] = field(default=lambda nodeid: nodeid)
    pytest: bool = True
    tests: tuple[str, ...] = ()
    source: str = ""


def harness_of(task: Task) -> str:
    """Return which harness grades ``task`` (see the module docstring).

    An explicit ``harness`` column wins; else a repo/version known to ``swebench`` means
    SWE-bench, an ``expected_output_json`` column R2E-Gym, a ``swesmith`` image SWE-smith,
    and anything else sandpool's own pytest harness.
    """
    extra = task.model_extra or {}
    explicit = extra.get("harness")
    if explicit:
        if explicit not in HARNESSES:
            raise BrokenTaskError(f"task {task.instance_id}: harness {explicit!r} is not one of "
                                  f"{', '.join(HARNESSES)}", task_id=task.instance_id)
        return str(explicit)
    if "expected_output_json" in extra:
        return "r2e-gym"
    if "swesmith" in task.image or "swesmith" in task.repo:
        return "swe-smith"
    specs = _swebench()["specs"]
    if task.repo in specs and str(extra.get("version")) in specs[task.repo]:
        return "swebench"
    return "pytest"


def plan_for(task: Task) -> TestPlan:
    """Build the :class:`TestPlan` of ``task`` from its harness's rules.

    Raises:
        BrokenTaskError: The harness has no test command for the task (an unknown
            repo/version for SWE-bench, no ``expected_output_json`` for R2E-Gym), its test
            patch is not a valid diff, or the task lists no test at all.
    """
    harness = harness_of(task)
    if harness != "r2e-gym" and not task.FAIL_TO_PASS and not task.PASS_TO_PASS:
        raise BrokenTaskError(f"task {task.instance_id}: FAIL_TO_PASS and PASS_TO_PASS are both "
                              "empty; list the test ids that decide the task", task_id=task.instance_id)
    try:
        return {"swebench": _swebench_plan, "swe-smith": _swesmith_plan, "r2e-gym": _r2e_plan,
                "pytest": _pytest_plan}[harness](task)
    except BrokenTaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - unidiff's parse errors: the row's patch is malformed
        if type(exc).__module__.startswith("unidiff"):
            raise BrokenTaskError(f"task {task.instance_id}: test_patch is not a valid unified diff "
                                  f"({exc}); fix the row", task_id=task.instance_id) from None
        raise


# -- SWE-bench ---------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _swebench() -> dict:
    # Imported on first use: swebench pulls in `datasets`, seconds of import time.
    from swebench.harness.constants import FAIL_ONLY_REPOS, MAP_REPO_VERSION_TO_SPECS, EvalType
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER
    from swebench.harness.test_spec.python import get_test_directives
    from swebench.harness.utils import get_modified_files

    return {"specs": MAP_REPO_VERSION_TO_SPECS, "parsers": MAP_REPO_TO_PARSER,
            "directives": get_test_directives, "modified": get_modified_files,
            "report": get_eval_tests_report, "status": get_resolution_status,
            "fail_only": FAIL_ONLY_REPOS, "eval_type": EvalType}


def _swebench_plan(task: Task) -> TestPlan:
    sw = _swebench()
    version = str((task.model_extra or {}).get("version"))
    specs = sw["specs"].get(task.repo, {}).get(version)
    if specs is None or task.repo not in sw["parsers"]:
        raise BrokenTaskError(
            f"task {task.instance_id}: swebench {SWEBENCH_VERSION} has no test command or log parser "
            f"for repo {task.repo!r} version {version!r}; fix the row's repo/version",
            task_id=task.instance_id)
    instance = {"repo": task.repo, "version": version, "test_patch": task.test_patch,
                "instance_id": task.instance_id}
    test_cmd = specs["test_cmd"]
    test_cmd = test_cmd[-1] if isinstance(test_cmd, list) else test_cmd
    command = " ".join([test_cmd, *sw["directives"](instance)])
    spec_ns = SimpleNamespace(instance_id=task.instance_id, repo=task.repo, version=version,
                              FAIL_TO_PASS=list(task.FAIL_TO_PASS), PASS_TO_PASS=list(task.PASS_TO_PASS))
    parser = sw["parsers"][task.repo]
    eval_type = (sw["eval_type"].FAIL_ONLY if task.repo in sw["fail_only"]
                 else sw["eval_type"].PASS_AND_FAIL)
    ref = {"FAIL_TO_PASS": list(task.FAIL_TO_PASS), "PASS_TO_PASS": list(task.PASS_TO_PASS)}

    def score(status: dict[str, str]):
        report = sw["report"](status, ref, eval_type=eval_type)
        resolved = sw["status"](report) == "RESOLVED_FULL"
        return (resolved, tuple(report["FAIL_TO_PASS"]["failure"]),
                tuple(report["PASS_TO_PASS"]["failure"]))

    return TestPlan(
        harness="swebench", command=command, prelude=tuple(specs.get("eval_commands", ())),
        restore=tuple(reset_files(task.test_patch)),
        test_patch=task.test_patch, parse=lambda log: parser(log, spec_ns), score=score,
        pytest=bool(re.search(r"(^|\s)pytest(\s|$)", test_cmd)),
        tests=tuple(task.FAIL_TO_PASS) + tuple(task.PASS_TO_PASS),
        source=f"swebench {SWEBENCH_VERSION} (harness.constants, test_spec.python, log_parsers, grading)")


# -- SWE-smith ---------------------------------------------------------------------------------

_VERBOSE = re.compile(r"^(\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL)\b")


def _parse_pytest_verbose(log: str) -> dict[str, str]:
    """``path::test STATUS`` lines of ``pytest --verbose`` (SWE-smith's pytest log parser)."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _VERBOSE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _swesmith_plan(task: Task) -> TestPlan:
    files = sorted({t.split("::", 1)[0] for t in task.FAIL_TO_PASS})
    def relevant(ids):
        return tuple(t for t in ids if not files or any(t.startswith(f) for f in files))
    f2p, p2p = relevant(task.FAIL_TO_PASS), relevant(task.PASS_TO_PASS)

    def score(status: dict[str, str]):
        # SWE-smith: a test missing from the log counts as passed; only explicit failures fail.
        bad = ("FAILED", "ERROR")
        failed_f2p = tuple(t for t in f2p if status.get(t) in bad)
        failed_p2p = tuple(t for t in p2p if status.get(t) in bad)
        return (not failed_f2p and not failed_p2p, failed_f2p, failed_p2p)

    return TestPlan(harness="swe-smith", command=" ".join([_SWESMITH_TEST_CMD, *map(shlex.quote, files)]),
                    parse=_parse_pytest_verbose, score=score, test_patch=task.test_patch,
                    restore=tuple(dict.fromkeys([*reset_files(task.test_patch), *files])),
                    tests=f2p + p2p,
                    source="SWE-smith swesmith/harness/grading.py + utils.py (read from its repository)")


# -- R2E-Gym -----------------------------------------------------------------------------------


def _r2e_key(nodeid: str) -> str:
    return ".".join(nodeid.split("::")[1:])


def _parse_r2e(log: str) -> dict[str, str]:
    """R2E-Gym's pytest parser: short-summary lines keyed by the node id after its file."""
    log = re.sub(r"\x1b\[[0-9;]*m|\r", "", log)
    if "short test summary info" not in log:
        return {}
    out: dict[str, str] = {}
    for line in log.split("short test summary info", 1)[1].strip().splitlines():
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                out[_r2e_key(line).split(" - ")[0].strip()] = status
                break
    return out


def _r2e_plan(task: Task) -> TestPlan:
    raw = (task.model_extra or {}).get("expected_output_json")
    try:
        expected = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    except (ValueError, TypeError) as exc:
        raise BrokenTaskError(f"task {task.instance_id}: expected_output_json is not a JSON object "
                              f"({exc}); fix the row", task_id=task.instance_id) from None
    if not expected:
        raise BrokenTaskError(f"task {task.instance_id}: R2E-Gym row without expected_output_json; "
                              "the harness compares the test run with it", task_id=task.instance_id)
    expected = {re.sub(r"\x1b\[[0-9;]*m", "", k).split(" - ")[0]: v for k, v in expected.items()}

    def score(status: dict[str, str]):
        wrong = tuple(sorted(k for k in expected if status.get(k) != expected[k]))
        extra = tuple(sorted(k for k in status if k and k not in expected))
        resolved = not wrong and len(status) == len(expected)
        return resolved, wrong, extra

    wd = shlex.quote(task.workdir)
    return TestPlan(
        harness="r2e-gym",
        prelude=(f"rm -rf {wd}/r2e_tests",
                 f"if [ -d /root/r2e_tests ]; then ln -s /root/r2e_tests {wd}/r2e_tests; "
                 f"elif [ -d /r2e_tests ]; then ln -s /r2e_tests {wd}/r2e_tests; fi"),
        command="bash /root/run_tests.sh", parse=_parse_r2e, score=score, id_of=_r2e_key,
        tests=tuple(expected),
        source="R2E-Gym agenthub/runtime/docker.py _calculate_reward_r2e (read from its repository)")


# -- sandpool's own pack -----------------------------------------------------------------------


def _pytest_plan(task: Task) -> TestPlan:
    from sandpool.envs.grading.pytest_log import files_of_tests, parse_test_log, pytest_command

    f2p, p2p = tuple(task.FAIL_TO_PASS), tuple(task.PASS_TO_PASS)
    files = files_of_tests(f2p + p2p)

    def score(status: dict[str, str]):
        failed_f2p = tuple(t for t in f2p if status.get(t) not in _PASS)
        failed_p2p = tuple(t for t in p2p if status.get(t) not in _PASS)
        return (not failed_f2p and not failed_p2p, failed_f2p, failed_p2p)

    added = set(added_files(task.test_patch))
    restore = tuple(dict.fromkeys([*reset_files(task.test_patch), *files]))
    return TestPlan(harness="pytest", command=pytest_command(files), restore=restore,
                    required=tuple(f for f in files if f not in added),
                    test_patch=task.test_patch,
                    parse=lambda log: {k: v.value for k, v in parse_test_log(log).items()},
                    score=score, tests=f2p + p2p, source="sandpool task pack (pytest -rA, every listed test PASSED/XFAIL)")


# -- patches -----------------------------------------------------------------------------------


def added_files(patch: str) -> list[str]:
    """Paths a unified diff creates (new files and rename/copy targets), in patch order."""
    if not patch.strip():
        return []
    from unidiff import PatchSet

    out = []
    for f in PatchSet(patch):
        target = f.target_file[2:] if f.target_file.startswith("b/") else f.path
        if f.is_added_file or f.source_file[2:] != target:
            out.append(target)
    return out


def reset_files(patch: str) -> list[str]:
    """The files SWE-bench resets from base before applying ``patch``: those it modifies
    (``swebench.harness.utils.get_modified_files``: every source that is not /dev/null)."""
    return list(_swebench()["modified"](patch)) if patch.strip() else []


_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")


def reverse_patch(patch: str) -> str:
    """Return the unified git diff that undoes ``patch`` (``git apply -R`` as text).

    SWE-smith's ``patch`` column is the bug-introducing diff and its harness applies it with
    ``--reverse`` for the gold run; sandpool's oracle applies a forward patch, so the loader
    stores the reversal.

    Raises:
        ValueError: ``patch`` holds a binary diff, which cannot be reversed as text.
    """
    out: list[str] = []
    lines = patch.splitlines(keepends=True)
    i = 0
    swaps = {"new file mode ": "deleted file mode ", "deleted file mode ": "new file mode ",
             "rename from ": "rename to ", "rename to ": "rename from ",
             "copy from ": "copy to ", "copy to ": "copy from ",
             "old mode ": "new mode ", "new mode ": "old mode "}
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            m = re.match(r"^diff --git a/(.*) b/(.*?)(\r?\n)?$", line)
            if not m:
                raise ValueError(f"cannot reverse diff header {line!r}")
            out.append(f"diff --git a/{m.group(2)} b/{m.group(1)}{m.group(3) or ''}")
        elif line.startswith("GIT binary patch") or line.startswith("Binary files "):
            raise ValueError("binary diffs cannot be reversed as text")
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = line[4:], lines[i + 1][4:]
            swap = lambda p, side: p if p.startswith("/dev/null") else side + p[2:]  # noqa: E731
            out.append("--- " + swap(new, "a/"))
            out.append("+++ " + swap(old, "b/"))
            i += 1
        elif (m := _HUNK.match(line.rstrip("\r\n"))):
            out.append(f"@@ -{m.group(2)} +{m.group(1)} @@{m.group(3)}\n")
        elif line.startswith("index "):
            m = re.match(r"^index (\w+)\.\.(\w+)(.*)$", line.rstrip("\n"))
            out.append(f"index {m.group(2)}..{m.group(1)}{m.group(3)}\n" if m else line)
        elif line.startswith("+") and not line.startswith("+++ "):
            out.append("-" + line[1:])
        elif line.startswith("-") and not line.startswith("--- "):
            out.append("+" + line[1:])
        else:
            for a, b in swaps.items():
                if line.startswith(a):
                    line = b + line[len(a):]
                    break
            out.append(line)
        i += 1
    return "".join(out)
