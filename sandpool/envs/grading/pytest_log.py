"""pytest's ``-rA`` log as the pack's harness reads it, and the command that prints it.

The parser reads the short-summary lines SWE-bench's pytest log parser reads
(``swebench.harness.log_parsers``), with pytest 9's ``SUBFAILED`` lines for unittest subtests.
"""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Iterable

__all__ = ["TestStatus", "files_of_tests", "parse_test_log", "parse_test_log_details",
           "pytest_command", "pytest_env"]

#: Environment of every test run: no bytecode written into the work tree, and a terminal
#: wide enough that pytest keeps most of each failure message in its summary line.
_TEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "240", "PYTHONHASHSEED": "0"}
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
        # Two searches, not a loop over every "]": a line of them stays linear.
        ends = (rest.find("] - ", bracket), len(rest) - 1 if rest.endswith("]") else -1)
        i = min((e for e in ends if e != -1), default=-1)
        if i != -1:
            return rest[: i + 1].strip(), rest[i + 4 :].strip()
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
    cache or colour is written. Run it with :func:`pytest_env` as the environment. The
    graders run it with the image's interpreter, whatever its name
    (:mod:`~sandpool.envs.grading.interpreter`: ``python3`` where there is no ``python``).

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
