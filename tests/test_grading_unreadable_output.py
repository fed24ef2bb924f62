"""What the code under test writes, read on the host: a 0 however it is written, never an error.

The host reads two things the code under test can write: the test log (it prints anything)
and the verdict report's file (it holds the report's descriptor, and the file's directory).
An exception while reading them is an error sandpool does not know, which the accountant
counts as infra: the rollout is retried and never scored, a failing policy's way out of its
0. Each test shows one: a ``FAIL:`` line alone, which swebench's Django parser indexes past,
and a report whose closing line is JSON but no object (``1``), which the report reader
called ``.get`` on.
"""

from __future__ import annotations

import pytest

from sandpool.envs.grading.diff import grade_patch
from sandpool.envs.grading.verdict import read_signed_report

from .test_harness_real import django_task  # noqa: F401 - the Django task, built once

_PRINT_FAIL = 'print("FAIL:")\n'
#: Writes ``1`` to the verdict report through pytest's own descriptor, then exits before
#: pytest seals it: the report's last line is JSON, and no object.
_REPORT_NOT_AN_OBJECT = """import os
for fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink("/proc/self/fd/" + fd).endswith("/report.jsonl"):
            os.write(int(fd), b"1\\n")
    except OSError:
        pass
os._exit(3)
"""


def _prepend(path: str, old_first: str, code: str) -> str:
    """A patch that puts ``code`` before the first line ``old_first`` of ``path``."""
    n = code.count("\n")
    body = "".join(f"+{ln}\n" for ln in code.splitlines())
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -1 +1,{n + 1} @@\n{body} {old_first}\n")


async def test_a_line_the_django_parser_cannot_read_scores_0_not_an_error(local_backend, django_task):  # noqa: F811
    sb = await local_backend.create(django_task.image)
    first = (await sb.exec(f"git show {django_task.base_commit}:django/utils/text.py | head -1")).text.rstrip("\n")
    try:
        res = await grade_patch(sb, django_task, _prepend("django/utils/text.py", first, _PRINT_FAIL),
                                timeout=300)
    finally:
        await local_backend.delete(sb)
    assert "FAIL:" in res.log.splitlines()
    assert (res.reward, res.resolved) == (0.0, False)
    assert res.error and "parser" in res.error, res.error


async def test_a_verdict_report_ending_in_json_that_is_no_object_scores_0(local_backend, calc_task):
    sb = await local_backend.create(calc_task.image)
    first = (await sb.exec(f"git show {calc_task.base_commit}:calc.py | head -1")).text.rstrip("\n")
    patch = _prepend("calc.py", first, _REPORT_NOT_AN_OBJECT)
    try:
        res = await grade_patch(sb, calc_task, patch, timeout=120)
    finally:
        await local_backend.delete(sb)
    assert (res.reward, res.resolved, res.exit_code) == (0.0, False, 3), res


@pytest.mark.parametrize("body", [
    b"1\n", b"[]\n", b'"x"\n', b"null\n", b'{"ev": "test"}\n', b'{"ev": "finish", "exitstatus": "x"}\n',
    b'{"ev": "collected", "ids": 5}\n', b'{"ev": "collect_error", "nodeid": {}}\n',
    b'{"ev": "test", "nodeid": [], "when": "call", "outcome": "passed", "xfail": false}\n',
    b'[1]\n{"ev": "end", "mac": "0"}\n'])
def test_a_report_of_lines_the_plugin_never_writes_is_unsealed_not_an_error(body):
    rep = read_signed_report(b'{"ev": "start", "pid": 1}\n' + body, b"k" * 32)
    assert rep.present and not rep.sealed and rep.forged
