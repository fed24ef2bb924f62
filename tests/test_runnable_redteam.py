"""Red team of the runnable check and SWE-smith's rule: a policy cannot turn its failure into a
reward or a rejection.

Real bubblewrap sandboxes on the OCI test images of ``test_tests_cannot_start`` (Debian's
``python3`` and pytest, the calc repo at /testbed); the policies act with shell access only.
"""

from __future__ import annotations

import pytest

from sandpool.core.task import Task
from sandpool.envs.policies import OraclePolicy, Policy
from sandpool.envs.runner import run_batch
from tests.test_tests_cannot_start import _on, backend, images  # noqa: F401  (fixtures)


class _Shell(Policy):
    """Runs ``command`` in the repo (after the gold fix when ``fix``)."""

    def __init__(self, name: str, command: str, *, fix: bool = False) -> None:
        self.name, self.command, self.fix = name, command, fix

    async def act(self, lease, task: Task) -> None:
        if self.fix:
            await OraclePolicy().act(lease, task)
        res = await lease.exec(self.command, timeout=60)
        assert res.exit_code == 0, (self.name, res.err_text)


#: Code appended to the package under test: when a test module imports it, every test of that
#: module is marked skipped (pytestmark in the importer's globals), so none fails.
_SKIP_ALL = ("printf 'import sys, pytest\\nsys._getframe(1).f_globals.setdefault(\"pytestmark\", "
             "[pytest.mark.skip(reason=\"x\")])\\n' >> calcpkg/__init__.py")
#: The same with one test skipped imperatively from the package's code.
_SKIP_CALL = ("printf 'import pytest\\ndef add(a, b):\\n    pytest.skip(\"x\")\\n' >> calcpkg/__init__.py")


@pytest.mark.parametrize("harness", ["swe-smith", "pytest"])
@pytest.mark.parametrize("command", [_SKIP_ALL, _SKIP_CALL], ids=["pytestmark", "skip-call"])
async def test_decisive_tests_skipped_by_the_code_under_test_score_0(backend, images, command, harness):
    """SWE-smith counts only FAILED/ERROR as failures: a skip raised from the package's code
    (no fix) must not pass for the fix, nor make the task rejected."""
    kind = "no-pytest-command" if harness == "swe-smith" else "python3"
    task = _on(images, kind, instance_id=f"calc-{harness}-skip", harness=harness)
    report = await run_batch([task], [_Shell("skipper", command), OraclePolicy()], backend,
                             rollouts_per_task=2, concurrency=2, strategy="reuse", retries=0)
    by = {r.policy: r for r in report.rollouts}
    assert by["oracle"].reward == 1.0, report.render_text()
    assert by["skipper"].reward == 0.0 and not report.rejected, (by["skipper"], report.render_text())
