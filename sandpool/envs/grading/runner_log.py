"""The closing lines of test runners that are not pytest, cross-checked with their exit status.

For django's ``tests/runtests.py`` and sympy's ``bin/test`` no plugin can be loaded into the
test process, so no signed report exists; :func:`runner_check` holds the runner's own closing
lines against its exit status instead. Its limit, stated plainly: code that prints a full,
consistent fake transcript including the closing lines and then exits with the matching
status is not caught here. Every pattern is linear in the line (the code under test wrote
the log; see :mod:`sandpool.envs.grading.verdict`).
"""

from __future__ import annotations

import re

__all__ = ["ANSI", "RUNNERS", "runner_check"]

_SYMPY_END = re.compile(r"(.*) in [\d.]+ seconds")
_SYMPY_FAILED = re.compile(r"(?<!\d)\d+ (failed|exceptions?)")
#: Terminal colour codes, taken out of a log before its lines are read.
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: Runners :func:`runner_check` knows the closing lines of, by SWE-bench repo.
RUNNERS = {"django/django": "unittest", "sympy/sympy": "sympy"}


def _sympy_closing_lines(text: str) -> list[str]:
    """What follows ``tests finished:`` up to the last `` in N seconds`` of each line that has
    both (sympy's closing line), in order: the first mention on a line opens the match."""
    found = []
    for line in text.split("\n"):  # as `.` stops: at a newline only
        at = line.find("tests finished: ")
        m = _SYMPY_END.match(line, at + len("tests finished: ")) if at != -1 else None
        if m:
            found.append(m.group(1))
    return found


def runner_check(log: str, exit_code: int, *, resolved_by_log: bool, runner: str) -> list[str]:
    """Cross-check a non-pytest runner's closing lines with its exit status.

    Reads unittest's (django ``runtests.py``, ``runner="unittest"``) ``Ran N tests`` then
    ``OK`` / ``FAILED (...)`` and sympy ``bin/test``'s (``runner="sympy"``) ``tests finished:
    ...`` line. A log the harness scores as resolved must end with the runner's own closing
    lines, and they must agree with the exit status. Other runners (the JavaScript, Go, ...
    harnesses of SWE-bench) are not checked. See the module docstring for what this cannot
    catch.

    Returns:
        One sentence per disagreement (empty: none found, or an unknown runner).
    """
    text = ANSI.sub("", log)
    evidence: list[str] = []
    unittest_ok = re.findall(r"^(OK|FAILED)\b.*$", text, re.M) if runner == "unittest" else []
    sympy = _sympy_closing_lines(text) if runner == "sympy" else []
    if runner not in ("unittest", "sympy"):
        return evidence
    if sympy:
        failed = _SYMPY_FAILED.search(sympy[-1]) is not None
        if failed == (exit_code == 0):
            evidence.append(f"bin/test reports '{sympy[-1]}' but exited {exit_code}")
    elif unittest_ok and re.search(r"^Ran \d+ tests? in ", text, re.M):
        if (unittest_ok[-1] == "OK") != (exit_code == 0):
            evidence.append(f"the test runner's closing verdict is {unittest_ok[-1]} but it exited {exit_code}")
    elif resolved_by_log and exit_code == 0:
        evidence.append("the log shows passing tests but none of the runner's closing lines "
                        "(the runner was ended early)")
    return evidence
