"""The verdict grading trusts: pytest's signed report, cross-checked with what else was seen.

The code under test runs inside the test process and can print anything, so the log alone
proves nothing. For pytest harnesses the grader loads ``sandbox_side/verdict_plugin.py``,
which writes one JSON line per event and seals the file with an HMAC under a per-run key the
code under test never sees (:func:`read_signed_report`). :func:`cross_check` then compares
four sources: the signed report, the harness's parse of the log, the test process's exit
status, and pytest's own closing counts. Any disagreement in the direction of a pass that
did not happen is evidence of tampering; the rollout then scores 0 with the evidence kept.

For runners that are not pytest (django's ``tests/runtests.py``, sympy's ``bin/test``) no
plugin can be loaded; :func:`~sandpool.envs.grading.runner_log.runner_check` compares the
runner's closing lines with its exit status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field

from sandpool.core import errors
from sandpool.core.base import ExecResult
from sandpool.core.task import Task
from sandpool.envs.grading.harness import TestPlan
from sandpool.envs.grading.runner_log import ANSI, RUNNERS, runner_check

__all__ = ["MAX_LOG_BYTES", "GradeResult", "SignedReport", "cross_check", "read_signed_report",
           "score_run", "unresolved"]

#: Cap on the captured test log; a longer log scores 0 (the code under test wrote it).
MAX_LOG_BYTES = 64 << 20

_PASS = ("PASSED", "XFAIL")
# Every pattern run on text the code under test wrote matches in time linear in the line:
# no two unbounded repeats that can share the same characters, and a number is matched only
# from its first digit (the log is up to MAX_LOG_BYTES, parsed on the host's event loop).
# A count is at most 18 digits: int() refuses a string of over 4300.
_SUMMARY = re.compile(r"^=+ (.*) in [\d.]+s(?: \([^()]*\))? =+$")
_HAS_COUNT = re.compile(r"\d \w")
_COUNT = re.compile(r"(?<!\d)(\d{1,18}) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")


@dataclass
class SignedReport:
    """What the verdict plugin recorded, once its seal was checked.

    Attributes:
        present: The report file existed.
        sealed: The closing line was there and its HMAC verified.
        forged: The file had a closing line whose HMAC does not verify, or garbled lines.
        exitstatus: pytest's own exit status from ``pytest_sessionfinish``.
        collected: Node ids pytest collected, in order.
        statuses: ``{node id: PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS}``.
        passed_calls: Call-phase passes (what pytest's closing line counts as ``passed``).
        changed: pytest internals replaced during the session.
        rewritten: Node ids whose report says passed but carries a failure representation.
        xfail_by_code: ``(node id, where)`` of each expected failure that code other than the
            test's raised (``pytest.xfail()`` called by the code under test); such a test's
            status is FAILED, not XFAIL.
    """

    present: bool = False
    sealed: bool = False
    forged: bool = False
    exitstatus: int | None = None
    collected: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)
    passed_calls: int = 0
    changed: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    xfail_by_code: list[tuple[str, str]] = field(default_factory=list)


def _merge(old: str | None, new: str) -> str:
    rank = {"PASSED": 0, "XFAIL": 0, "SKIPPED": 1, "XPASS": 2, "FAILED": 3, "ERROR": 3}
    return new if old is None or rank[new] >= rank[old] else old


#: What decoding a line the plugin never writes can raise (RecursionError: JSON nested past
#: the decoder's depth; OverflowError: an infinite float where an int belongs).
_NOT_THE_PLUGINS = (ValueError, RecursionError, OverflowError, KeyError, TypeError, AttributeError)


def read_signed_report(data: bytes | None, key: bytes) -> SignedReport:
    """Verify and decode a report written by the verdict plugin.

    Args:
        data: The report file's bytes, or ``None`` when the file was missing.
        key: The per-run key the grader gave the plugin.

    Returns:
        A :class:`SignedReport`; ``sealed`` is False unless the closing HMAC verified.
    """
    rep = SignedReport(present=data is not None)
    if not data:
        return rep
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    body, last = lines[:-1], lines[-1] if lines else b""
    try:
        end = json.loads(last)
    except _NOT_THE_PLUGINS:
        end = {}
    if not isinstance(end, dict):  # JSON, but no line the plugin writes
        end = {}
    if end.get("ev") != "end":
        body = lines  # cut short: no closing line was written
    else:
        mac = hmac.new(key, b"".join(line + b"\n" for line in body), hashlib.sha256).hexdigest()
        rep.sealed = hmac.compare_digest(mac, str(end.get("mac", "")))
        rep.forged = not rep.sealed
    if not rep.sealed and end.get("ev") == "end":
        return rep  # nothing in a forged file is trusted
    for raw in body:
        try:
            _read_record(rep, json.loads(raw))
        except _NOT_THE_PLUGINS:
            rep.forged = True
            rep.sealed = False
            return rep
    return rep


def _read_record(rep: SignedReport, rec: dict) -> None:
    """Add one of the plugin's records to ``rep``; raises on anything the plugin never writes."""
    ev = rec.get("ev")
    if ev == "collected":
        rep.collected = [str(i) for i in rec.get("ids", [])]
    elif ev == "collect_error":
        rep.statuses[_nodeid(rec)] = "ERROR"
    elif ev == "finish":
        rep.exitstatus = int(rec["exitstatus"])
        rep.changed = [str(c) for c in rec.get("changed", [])]
    elif ev == "test":
        nodeid, when, outcome, xfail = _nodeid(rec), rec["when"], rec["outcome"], rec["xfail"]
        if outcome == "failed":
            status = "FAILED" if when == "call" else "ERROR"
        elif outcome == "skipped" and xfail and rec.get("xfail_by"):
            status = "FAILED"  # an xfail the test did not declare: its failure stands
            rep.xfail_by_code.append((nodeid, str(rec["xfail_by"])))
        elif outcome == "skipped":
            status = "XFAIL" if xfail else "SKIPPED"
        elif outcome != "passed":
            return  # e.g. pytest-rerunfailures' "rerun": the final report decides
        elif rec.get("sub"):
            return  # a passed subtest: the test's own report decides (and pytest counts that)
        elif when == "call":
            status = "XPASS" if xfail else "PASSED"
            if not xfail:
                rep.passed_calls += 1
                if rec.get("longrepr"):
                    rep.rewritten.append(nodeid)
        else:
            return  # a passed setup/teardown says nothing on its own
        rep.statuses[nodeid] = _merge(rep.statuses.get(nodeid), status)


def _nodeid(rec: dict) -> str:
    nodeid = rec["nodeid"]
    if not isinstance(nodeid, str):
        raise TypeError(f"node id {nodeid!r} is no string")
    return nodeid


def _closing_counts(log: str) -> dict[str, int] | None:
    for line in reversed(ANSI.sub("", log).splitlines()):
        m = _SUMMARY.match(line.strip())
        if m and _HAS_COUNT.search(m.group(1)):
            return {w.rstrip("s") if w.startswith(("error", "warning")) else w: int(n)
                    for n, w in _COUNT.findall(m.group(1))}
    return None


def cross_check(rep: SignedReport, *, log: str, log_status: dict[str, str], exit_code: int,
                tests: tuple[str, ...], id_of, timed_out: bool = False) -> list[str]:
    """Compare the signed report with the log verdict, the exit status and pytest's counts.

    Args:
        rep: The signed report.
        log: The test command's output.
        log_status: The harness parser's ``{test id: status}`` of ``log``.
        exit_code: The test command's exit status as the sandbox saw it.
        tests: The FAIL_TO_PASS and PASS_TO_PASS ids (harness ids).
        id_of: Maps a pytest node id to the harness's test id.
        timed_out: The test command was killed at its timeout (an unsealed report is then
            expected, not evidence).

    Returns:
        One sentence per disagreement that points at a faked pass (empty: none found).
    """
    evidence: list[str] = []
    if rep.forged:
        evidence.append("the verdict report does not verify against this run's key: it was forged or altered")
        return evidence
    if not rep.sealed and exit_code == 0 and not timed_out:
        evidence.append("the test process exited 0 but pytest never sealed its verdict report "
                        "(the process was ended early, e.g. os._exit, or the plugin was kept from loading)")
    if rep.sealed and rep.exitstatus != exit_code and not timed_out:
        evidence.append(f"pytest finished with exit status {rep.exitstatus} but the test process "
                        f"exited {exit_code}")
    if rep.changed:
        evidence.append(f"pytest's report machinery was replaced during the run: {', '.join(rep.changed)}")
    for nodeid, where in rep.xfail_by_code[:3]:
        evidence.append(f"{nodeid} was turned into an expected failure by code that is not the "
                        f"test's: pytest.xfail() raised from {where}")
    if rep.rewritten:
        evidence.append(f"{len(rep.rewritten)} test report(s) were rewritten to passed while holding a "
                        f"failure, e.g. {rep.rewritten[0]}")
    by_id: dict[str, str] = {}
    for nodeid, status in rep.statuses.items():
        key = id_of(nodeid)
        by_id[key] = _merge(by_id.get(key), status)
    for t in tests:
        if log_status.get(t) in _PASS and by_id.get(t) not in _PASS:
            said = by_id.get(t, "it never ran") if rep.sealed else f"nothing: pytest never finished (exit {exit_code})"
            evidence.append(f"the log says {t} passed; pytest's signed report says {said}")
            if len(evidence) > 8:
                break
    counts = _closing_counts(log)
    if rep.sealed and counts is not None and counts.get("passed", 0) != rep.passed_calls:
        evidence.append(f"the log's closing line counts {counts.get('passed', 0)} passed; pytest's "
                        f"signed report counts {rep.passed_calls}")
    return evidence


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
        absent: The listed ids (of either list) the log does not mention at all: never run
            or never collected.
        ran: How many of the tests that decide the task (:attr:`TestPlan.tests
            <sandpool.envs.grading.harness.TestPlan.tests>`) the log or the signed report
            gives a result for; 0: none of them ran (the test command could not start, or
            collected none of them), and the run is never resolved. ``None`` when the tests
            were not run to the end (a refused patch, a timeout, a cut log).
        not_run: Why the test command could not start when the sandbox had the patch
            applied (the image's Python could not import pytest). Whose fault it is, the
            patch's or the image's, only a pristine run can say
            (:mod:`~sandpool.envs.grading.runnable`).
        timed_out: True when the test command hit its timeout (scored 0: the policy's code
            hung, e.g. an infinite loop).
        error: Why the tests could not run as the harness runs them, when the policy's state
            is the cause (it destroyed ``.git``, the test patch does not apply to its tree,
            its code wrote a test log over the capture cap);
            scored 0. A cause in the task itself raises instead (see :func:`grade`).
        tampering: Evidence that the policy's code forged a pass (scored 0), one sentence each.
        refused: Why the patch policy refused the policy's patch (scored 0), one sentence per
            file (:mod:`sandpool.envs.grading.policy`).
        neutralised: Test configuration restored or removed, and startup files deleted, before
            the tests ran.
        harness: Which harness graded (see :mod:`sandpool.envs.grading.harness`).
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
    absent: tuple[str, ...] = ()
    ran: int | None = None
    not_run: str | None = None
    timed_out: bool = False
    error: str | None = None
    tampering: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    neutralised: tuple[str, ...] = ()
    harness: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    log: str = ""


def unresolved(task: Task, **kw: object) -> GradeResult:
    return GradeResult(
        reward=0.0, resolved=False,
        f2p_passed=0, f2p_failed=len(task.FAIL_TO_PASS),
        p2p_passed=0, p2p_failed=len(task.PASS_TO_PASS),
        failed_f2p=tuple(task.FAIL_TO_PASS), failed_p2p=tuple(task.PASS_TO_PASS), **kw,  # type: ignore[arg-type]
    )


def score_run(task: Task, plan: TestPlan, res: ExecResult, log: str, report: bytes | None, key: bytes, *,
              neutral: tuple[str, ...] = (), suspicious: list[str] = ()) -> GradeResult:
    """Score one test run with the harness's parser and rule, cross-checked (see the module docstring).

    Args:
        task: The task.
        plan: Its harness plan.
        res: The test command's result.
        log: Its stdout and stderr.
        report: The signed report's bytes (None: missing), for pytest harnesses.
        key: The run's report key.
        neutral: What grading restored or removed before the run, for the result.
        suspicious: Evidence found before the run, scored as tampering.

    Returns:
        The :class:`GradeResult`: resolved only when the harness's rule holds on the log and on
        the signed report, at least one of the tests that decide the task ran, and no
        evidence of tampering was found. A log, report or exit status that a parse here
        raises on has ``error`` set (scored 0), whatever it raised: the code under test wrote
        them, and a gold run's that it raises on is a broken task that validation reports.
    """
    common = {"harness": plan.harness, "neutralised": neutral, "exit_code": res.exit_code,
              "duration_s": res.duration_s, "log": log}
    try:
        return _score(task, plan, res, log, report, key, common, suspicious)
    except errors.SandpoolError:  # the task's own fault (BrokenTaskError) is no score
        raise
    except Exception as exc:  # noqa: BLE001 - every other input is what the code under test wrote
        return unresolved(task, **common, error=(
            f"sandpool cannot read what the code under test wrote ({type(exc).__name__}: "
            f"{str(exc)[:300]})"))


def _score(task: Task, plan: TestPlan, res: ExecResult, log: str, report: bytes | None, key: bytes,
           common: dict, suspicious: list[str]) -> GradeResult:
    f2p, p2p = tuple(task.FAIL_TO_PASS), tuple(task.PASS_TO_PASS)
    if res.timed_out:
        return unresolved(task, timed_out=True, **common)
    try:
        status = plan.parse(log)
    except Exception as exc:  # noqa: BLE001 - the dataset's parser, on a log the code under test wrote
        return unresolved(task, **common, error=(
            f"the harness's log parser cannot read the test log ({type(exc).__name__}: {exc}); the code "
            "under test wrote it"))
    resolved, failed_f2p, failed_p2p = plan.score(status)
    common["absent"] = tuple(t for t in f2p + p2p if t not in status)
    seen = set(status)
    evidence = list(suspicious)
    skipped_by_report: dict[str, bool] = {}
    if plan.pytest:
        rep = read_signed_report(report, key)
        seen.update(plan.id_of(nodeid) for nodeid in rep.statuses)
        skipped_by_report = {plan.id_of(n): True for n, st in rep.statuses.items() if st == "SKIPPED"}
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
    common["ran"] = sum(t in seen for t in plan.tests)
    if not common["ran"] and resolved:  # a harness rule that counts an absent test as passed
        resolved, failed_f2p, failed_p2p = False, f2p, p2p
    if resolved and plan.harness != "r2e-gym":
        # Every listed test passed with the gold patch, so one that did not run (absent from
        # the log and the signed report) or was skipped is no pass, whatever a harness rule
        # that fails only FAILED/ERROR says (SWE-smith's): the code under test can skip a test
        # (``pytest.skip`` in a function it calls) or hide one from collection (a trace
        # function that deletes it from its module). R2E-Gym compares whole maps.
        bad = {t for t in plan.tests
               if t not in seen or status.get(t) == "SKIPPED" or skipped_by_report.get(t)}
        if bad:
            resolved = False
            failed_f2p, failed_p2p = (tuple(t for t in f2p if t in bad),
                                      tuple(t for t in p2p if t in bad))
    if evidence:
        return unresolved(task, tampering=tuple(evidence), **common)
    return GradeResult(
        reward=1.0 if resolved else 0.0, resolved=resolved,
        # R2E-Gym compares whole maps: its "failed" lists hold mismatched keys, not listed ids.
        f2p_passed=max(0, len(f2p) - len(failed_f2p)), f2p_failed=len(failed_f2p),
        p2p_passed=max(0, len(p2p) - len(failed_p2p)), p2p_failed=len(failed_p2p),
        failed_f2p=failed_f2p, failed_p2p=failed_p2p, **common,
    )
