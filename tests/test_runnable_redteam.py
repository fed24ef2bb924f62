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


def _append(code: str) -> str:
    """A shell command that appends ``code`` to the package under test."""
    return f"cat >> calcpkg/__init__.py <<'PYEOF'\n{code}PYEOF"


#: Finds the test module importing the package (the nearest frame of a ``test_`` module).
_IMPORTER = """import sys
f = sys._getframe(1)
while f is not None and "test_" not in f.f_globals.get("__name__", ""):
    f = f.f_back
"""
#: Every test of the importing module marked skipped (``pytestmark`` in its globals).
_SKIP_ALL = _append(_IMPORTER + """import pytest
f.f_globals["pytestmark"] = [pytest.mark.skip(reason="x")]
""")
#: The FAIL_TO_PASS test made absent: a trace function on the importing module's frame deletes
#: ``test_add`` from its globals once defined, so pytest collects only the PASS_TO_PASS test
#: (no hook, nothing of pytest touched).
_HIDE_F2P = _append(_IMPORTER + """def tr(frame, ev, arg):
    frame.f_globals.pop("test_add", None)
    return tr
f.f_trace = tr
sys.settrace(lambda *a: None)
""")
#: The function the tests call skips them imperatively.
_SKIP_CALL = _append("""import pytest
def add(a, b):
    pytest.skip("x")
""")


@pytest.mark.parametrize("harness", ["swe-smith", "pytest"])
@pytest.mark.parametrize("command", [_SKIP_ALL, _SKIP_CALL, _HIDE_F2P], ids=["pytestmark", "skip-call", "hide-f2p"])
async def test_decisive_tests_skipped_by_the_code_under_test_score_0(backend, images, command, harness):
    """SWE-smith counts only FAILED/ERROR as failures: a test the package's code (no fix)
    skipped or hid from collection must not pass for the fix, nor make the task rejected."""
    kind = "no-pytest-command" if harness == "swe-smith" else "python3"
    task = _on(images, kind, instance_id=f"calc-{harness}-skip", harness=harness)
    report = await run_batch([task], [_Shell("skipper", command), OraclePolicy()], backend,
                             rollouts_per_task=2, concurrency=2, strategy="reuse", retries=0)
    by = {r.policy: r for r in report.rollouts}
    assert by["oracle"].reward == 1.0, report.render_text()
    assert by["skipper"].reward == 0.0 and not report.rejected, (by["skipper"], report.render_text())


#: Python lines that, run as root in the sandbox, leave what a later Python run in it would
#: trip on, outside the repo: a .pth and a sitecustomize that end every interpreter at start,
#: a pytest.ini in the root's home and in /, PYTEST_ADDOPTS for login shells, an edit of
#: pytest itself, files in /tmp and /dev/shm; then they stop collection (none of the tests
#: runs).
_POISON = r"""
import glob, os, sysconfig
def put(p, s, mode="w"):
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, mode) as f: f.write(s)
    except OSError: pass
for d in {sysconfig.get_paths()["purelib"], "/usr/lib/python3/dist-packages", *glob.glob("/usr/lib/python3*/")}:
    put(d + "/zz_poison.pth", "import os; os._exit(0)\n")
    put(d + "/sitecustomize.py", "import os; os._exit(0)\n")
for d in ("/root", "/", "/tmp", "/testbed/..", os.path.expanduser("~")):
    put(d + "/pytest.ini", "[pytest]\naddopts = -p no:python --co\n")
put("/etc/profile.d/zz.sh", "export PYTEST_ADDOPTS='--co -p no:python'\n")
put("/etc/environment", "PYTEST_ADDOPTS=--co\n", "a")
for f in glob.glob("/usr/lib/python3/dist-packages/_pytest/main.py"):
    put(f, "\nimport os; os._exit(0)\n", "a")
put("/dev/shm/poison", "x"); put("/tmp/poison", "x")
"""


def _poison_cmd(into_patch: bool) -> str:
    code = _POISON.replace("'", "'\\''")
    if into_patch:  # runs at grading, when the tests import the package
        return (f"printf '%s\\nraise ImportError(\"poisoned\")\\n' '{code}' >> calcpkg/__init__.py")
    return f"python3 -c '{code}'"


@pytest.mark.parametrize("into_patch", [False, True], ids=["in-its-sandbox", "from-its-patch-at-grading"])
async def test_a_policy_cannot_poison_the_runnable_check_for_later_rollouts(backend, images, into_patch):
    """The poisoner's run: 0 (its tests did not run), never rejected; the runnable check it
    triggers sees a pristine sandbox, and later rollouts of the task on the same sandboxes
    (reuse) are scored as usual."""
    task = _on(images, "python3", instance_id=f"calc-poison-{into_patch}")
    poisoner = _Shell("poisoner", _poison_cmd(into_patch))
    policies = [poisoner, OraclePolicy(), OraclePolicy(), poisoner, OraclePolicy()]
    report = await run_batch([task], policies, backend, rollouts_per_task=len(policies),
                             concurrency=1, strategy="reuse", retries=0)
    assert not report.rejected and report.failures["rejected"] == 0, report.render_text()
    rewards = sorted((r.policy, r.reward) for r in report.rollouts)
    assert rewards == [("oracle", 1.0)] * 3 + [("poisoner", 0.0)] * 2, report.render_text()


#: The package's code (no fix), run at grading, exhausts what the sandbox has: memory, its
#: process limit, or the agent's pipe with output, to end the run as the sandbox's failure.
_EXHAUST = {
    "memory": _append("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 26))\n"),
    "fork-bomb": _append("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
    "kill-all": _append("import os, signal\nos.kill(-1, signal.SIGKILL)\n"),
}


@pytest.mark.parametrize("how", list(_EXHAUST))
async def test_a_patch_that_exhausts_the_sandbox_at_grading_scores_0_not_infra_or_rejected(backend, images, how):
    task = _on(images, "python3", instance_id=f"calc-exhaust-{how}")
    report = await run_batch([task], [_Shell(how, _EXHAUST[how]), OraclePolicy()], backend,
                             rollouts_per_task=2, concurrency=1, strategy="reuse", retries=0,
                             grade_timeout=30)  # the fork bomb runs until the timeout
    by = {r.policy: r for r in report.rollouts}
    assert not report.rejected and by[how].reward == 0.0, (by[how], report.render_text())
    assert by[how].outcome.value in ("completed", "task_failed"), by[how]
    assert by["oracle"].reward == 1.0, report.render_text()
