"""A policy trying to fake a pass, in real sandboxes: every attempt must score 0.

Each test first shows that the attempt fools a grader that trusts the log (so the test can
fail), then that :func:`grade` scores it 0 and says why.
"""

from __future__ import annotations

import pytest

from sandpool.core.task import Task
from sandpool.envs.grading import TestStatus, grade, parse_test_log

_IDS = ("test_calc.py::test_add", "test_calc.py::test_zero")


async def _at_base(backend, task: Task):
    sb = await backend.create(task.image)
    assert (await sb.exec(f"git checkout -q {task.base_commit}", timeout=30)).ok
    return sb


async def _prepend(sb, path: str, code: str) -> None:
    old = await sb.read_file(path)
    await sb.write_file(path, code.encode() + b"\n" + old)


async def _plain_run(sb) -> tuple[dict, int]:
    res = await sb.exec("python -m pytest -rA -p no:cacheprovider test_calc.py", timeout=60)
    return parse_test_log(res.text), res.exit_code


def _fooled(statuses: dict) -> bool:
    return all(statuses.get(t) is TestStatus.PASSED for t in _IDS)


FAKE_PASSED_THEN_EXIT = f"""
import os, sys
if "pytest" in sys.modules:
    for fd in range(1, 64):
        try:
            os.write(fd, b"".join(b"PASSED " + t.encode() + b"\\n" for t in {_IDS!r}))
        except OSError:
            pass
    os._exit(0)
"""


async def test_fake_passed_lines_and_an_early_exit_score_zero(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", FAKE_PASSED_THEN_EXIT)
    statuses, code = await _plain_run(sb)
    assert _fooled(statuses) and code == 0, "the attack should fool a log-trusting grader"
    result = await grade(sb, calc_task, timeout=120)
    assert (result.reward, result.resolved) == (0.0, False)
    assert result.tampering, result
    assert any("verdict report" in e for e in result.tampering)


async def test_an_exit_zero_before_pytest_seals_its_report_is_tampering(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", "import os, sys\nif 'pytest' in sys.modules:\n    os._exit(0)\n")
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0 and result.exit_code == 0
    assert any("never sealed" in e for e in result.tampering), result.tampering


FORGE_REPORT = """
import json, os, sys
if "pytest" in sys.modules:
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.endswith("report.jsonl"):
            fd = int(name)
            for t in ("test_calc.py::test_add", "test_calc.py::test_zero"):
                os.write(fd, (json.dumps({"ev": "test", "nodeid": t, "when": "call",
                                          "outcome": "passed", "xfail": False,
                                          "longrepr": False}) + "\\n").encode())
            os.write(fd, (json.dumps({"ev": "finish", "exitstatus": 0, "changed": []}) + "\\n").encode())
            os.write(fd, (json.dumps({"ev": "end", "mac": "0" * 64}) + "\\n").encode())
            os.write(1, b"PASSED test_calc.py::test_add\\nPASSED test_calc.py::test_zero\\n")
            os._exit(0)
"""


async def test_a_report_forged_by_the_code_under_test_does_not_verify(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", FORGE_REPORT)
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0
    assert any("forged or altered" in e for e in result.tampering), result.tampering


REWRITE_OUTCOMES = """
import sys
if "pytest" in sys.modules:
    from _pytest import reports
    _orig = reports.TestReport.from_item_and_call.__func__

    def _passed(cls, item, call):
        rep = _orig(cls, item, call)
        rep.outcome = "passed"
        return rep

    reports.TestReport.from_item_and_call = classmethod(_passed)
"""


async def test_rewriting_pytest_reports_in_process_is_caught(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", REWRITE_OUTCOMES)
    statuses, code = await _plain_run(sb)
    assert _fooled(statuses) and code == 0, "the attack should fool a log-trusting grader"
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0
    assert any("replaced during the run" in e for e in result.tampering), result.tampering


SKIP_THE_TEST_CALL = {
    "Function.runtest replaced": """
import sys
if "pytest" in sys.modules:
    import _pytest.python
    _pytest.python.Function.runtest = lambda self: None
""",
    "pytest_pyfunc_call plugin registered": """
import gc, sys
if "pytest" in sys.modules:
    import pytest

    class _Skip:
        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(self, pyfuncitem):
            return True  # "called": the test function never runs

    for o in gc.get_objects():
        if type(o).__name__ == "Config" and hasattr(o, "pluginmanager"):
            o.pluginmanager.register(_Skip(), "skip")
            break
""",
    "test functions emptied as pytest collects them": """
import sys
if "pytest" in sys.modules:
    import _pytest.python
    _collect = _pytest.python.PyCollector.collect

    def collect(self):
        for name, obj in list(vars(self.obj).items()):
            if name.startswith("test_") and callable(obj):
                obj.__code__ = (lambda: None).__code__
        return _collect(self)

    _pytest.python.PyCollector.collect = collect
""",
}


@pytest.mark.parametrize("attack", list(SKIP_THE_TEST_CALL))
async def test_code_under_test_that_stops_pytest_calling_the_tests_is_caught(local_backend, calc_task, attack):
    # Every test "passes" for real in pytest's eyes (log, counts, exit status and the signed
    # report agree), because no test function runs: only a check of pytest's own machinery
    # at the end of the session tells it apart.
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", SKIP_THE_TEST_CALL[attack])
    statuses, code = await _plain_run(sb)
    assert _fooled(statuses) and code == 0, "the attack should fool a log-trusting grader"
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0
    assert any("replaced during the run" in e for e in result.tampering), result.tampering


# Imported from the workdir (first on sys.path under ``python -m pytest``) instead of the real
# module, before the verdict plugin looks at pytest: each stops pytest calling the tests.
_SHADOW = """
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
saved = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
sys.modules.pop({name!r}, None)
real = __import__({name!r})
sys.modules[{name!r}] = real
import _pytest.python
_pytest.python.Function.runtest = lambda self: None
sys.path[:] = saved
if __name__ == "__main__":
    sys.exit(real.console_main())
"""


@pytest.mark.parametrize("module", ["pytest", "hmac"])
async def test_an_untracked_module_shadowing_pytest_or_the_stdlib_in_the_workdir_is_removed(
        local_backend, calc_task, module):
    sb = await _at_base(local_backend, calc_task)
    await sb.write_file(f"{module}.py", _SHADOW.format(name=module).encode())
    # The verdict plugin imports hmac; loading hmac as a plugin does the same in a plain run.
    plugin = "" if module == "pytest" else f" -p {module}"
    res = await sb.exec(f"python -m pytest -rA -p no:cacheprovider{plugin} test_calc.py", timeout=60)
    assert _fooled(parse_test_log(res.text)), "the attack should fool a log-trusting grader"
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0 and result.failed_f2p == ("test_calc.py::test_add",)
    assert f"removed {module}.py" in result.neutralised


async def test_a_pytest_plugin_entry_point_planted_in_the_workdir_never_loads(local_backend, calc_task):
    # The workdir is on sys.path, so pytest reads package metadata there for pytest11 plugins.
    sb = await _at_base(local_backend, calc_task)
    await sb.write_file("skipper-1.0.dist-info/METADATA", b"Metadata-Version: 2.1\nName: skipper\nVersion: 1.0\n")
    await sb.write_file("skipper-1.0.dist-info/entry_points.txt", b"[pytest11]\nskipper = skipper_plugin\n")
    await sb.write_file("skipper_plugin.py", b"import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\n"
                                             b"def pytest_pyfunc_call(pyfuncitem):\n    return True\n")
    statuses, code = await _plain_run(sb)
    assert _fooled(statuses) and code == 0, "the attack should fool a log-trusting grader"
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0 and result.failed_f2p == ("test_calc.py::test_add",)
    assert "neutralised skipper-1.0.dist-info/entry_points.txt" in result.neutralised


FORGING_HOOK = (b"import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                b"def pytest_runtest_makereport(item, call):\n"
                b"    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")


@pytest.mark.parametrize(("path", "text"), [
    ("pytest.ini", "[pytest]\naddopts = -p forge\n"),
    (".pytest.ini", "[pytest]\naddopts = -p forge\n"),
    ("tox.ini", "[pytest]\naddopts = -p forge\n"),
    ("setup.cfg", "[tool:pytest]\naddopts = -p forge\n"),
    ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-p forge'\n"),
])
async def test_an_untracked_pytest_config_that_loads_a_forging_plugin_is_removed(
        local_backend, calc_task, path, text):
    sb = await _at_base(local_backend, calc_task)
    await sb.write_file("forge.py", FORGING_HOOK)
    await sb.write_file(path, text.encode())
    res = await sb.exec("PYTHONPATH=. python -m pytest -rA -p no:cacheprovider test_calc.py", timeout=60)
    assert _fooled(parse_test_log(res.text)), f"{path} should load the forging plugin in a plain run"
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0 and result.failed_f2p == ("test_calc.py::test_add",)
    assert f"removed {path}" in result.neutralised
    assert (await sb.exec(f"test -e {path}", timeout=10)).exit_code == 1


@pytest.mark.parametrize("surface", ["sandbox", "bare-exec"])
async def test_planted_git_hooks_filters_and_fsmonitor_never_run_during_grading(local_backend, calc_task, surface):
    # "sandbox": .git is restored first; "bare-exec": no restore, prepare.py's private git dir alone.
    sb = await _at_base(local_backend, calc_task)
    marker = "/tmp/planted-ran"
    script = f"#!/bin/sh\necho \"$0\" >> {marker}\ncat\n"
    for hook in ("post-checkout", "pre-commit", "post-index-change", "reference-transaction",
                 "pre-auto-gc", "post-merge", "fsmonitor-watchman"):
        await sb.write_file(f".git/hooks/{hook}", script.encode(), mode=0o755)
    await sb.write_file("/tmp/filter.sh", script.encode(), mode=0o755)
    assert (await sb.exec(
        "git config filter.evil.smudge /tmp/filter.sh && git config filter.evil.clean /tmp/filter.sh"
        " && git config filter.evil.process /tmp/filter.sh && git config core.fsmonitor /tmp/filter.sh"
        " && git config diff.external /tmp/filter.sh && git config core.pager /tmp/filter.sh"
        " && echo '* filter=evil' > .git/info/attributes && echo '* filter=evil' > .gitattributes",
        timeout=10)).ok
    # Prove the plants are live: a plain checkout runs the hook and the smudge filter.
    assert (await sb.exec("git checkout -q HEAD -- calc.py && test -s /tmp/planted-ran", timeout=10)).ok
    await sb.write_file("test_calc.py", b"def test_add():\n    pass\n\n\ndef test_zero():\n    pass\n")
    await sb.write_file("calc.py", b"def add(a, b):\n    return a + b\n")
    await sb.exec(f"rm -f {marker}", timeout=10)
    result = await grade(sb if surface == "sandbox" else _BareExec(sb), calc_task, timeout=120)
    ran = await sb.exec(f"cat {marker}", timeout=10)
    assert ran.exit_code == 1, f"a planted hook or filter ran: {ran.text}"
    assert result.reward == 1.0, result
    assert "restored test_calc.py" in result.neutralised
    body = (await sb.read_file("test_calc.py")).decode()
    assert "assert add(1, 2) == 3" in body


class _BareExec:
    """Only the exec surface of a sandbox: grading cannot restore .git through it."""

    def __init__(self, sb):
        self._sb = sb
        self.exec, self.read_file, self.write_file = sb.exec, sb.read_file, sb.write_file


_ALTER = ("blob=$(git rev-parse {base}:test_calc.py) && other=$(git rev-parse {base}:calc.py) && "
          "p=.git/objects/${{blob:0:2}}/${{blob:2}} && o=.git/objects/${{other:0:2}}/${{other:2}} && "
          "test -f $p && chmod u+w $p && cp $o $p")


async def test_an_altered_object_is_repaired_before_grading(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await sb.write_file("test_calc.py", b"def test_add():\n    pass\n\n\ndef test_zero():\n    pass\n")
    assert (await sb.exec(_ALTER.format(base=calc_task.base_commit), timeout=10)).ok
    result = await grade(sb, calc_task, timeout=120)
    assert (result.reward, result.failed_f2p) == (0.0, ("test_calc.py::test_add",))
    assert "assert add(1, 2) == 3" in (await sb.read_file("test_calc.py")).decode()


async def test_without_a_git_restore_an_altered_object_is_found_by_its_hash(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    assert (await sb.exec(_ALTER.format(base=calc_task.base_commit), timeout=10)).ok
    result = await grade(_BareExec(sb), calc_task, timeout=120)
    assert result.reward == 0.0 and result.error and "altered" in result.error
    assert result.tampering


async def _sb_apply(sb, patch: str) -> None:
    await sb.write_file("/tmp/gold.patch", patch.encode())
    res = await sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=30)
    assert res.ok, res.err_text


async def test_startup_files_planted_in_a_writable_site_directory_are_neutralised(local_backend, calc_task):
    # The user site under $HOME (/tmp here) is writable; an interpreter that honours it (a conda
    # env's python, unlike this venv) would run a .pth import line or usercustomize at startup.
    sb = await _at_base(local_backend, calc_task)
    site = "/tmp/.local/lib/python3.12/site-packages"
    await sb.write_file(f"{site}/evil.pth", b"import os; os.write(1, b'PASSED test_calc.py::test_add\\n')\n")
    await sb.write_file(f"{site}/usercustomize.py", b"print('PASSED test_calc.py::test_add')\n")
    await sb.write_file(f"{site}/evil-1.0.dist-info/entry_points.txt", b"[pytest11]\nevil = evil\n")
    result = await grade(sb, calc_task, timeout=120)
    assert result.reward == 0.0
    for name in ("evil.pth", "usercustomize.py", "evil-1.0.dist-info/entry_points.txt"):
        assert f"neutralised {site}/{name}" in result.neutralised, result.neutralised
        assert (await sb.exec(f"test -e {site}/{name}", timeout=10)).exit_code == 1


# -- an older pytest, as SWE-bench-era environments carry -----------------------------------------

OLD_PYTEST_IMAGE = "sandpool.test/calc-pytest7:1"


@pytest.fixture(scope="session")
def old_pytest_image(test_images_root, calc_task) -> str:
    """The calc repo with a venv holding pytest 7.4.4 (built once per machine)."""
    import json as _json
    import subprocess as _sp
    import sys as _sys

    from sandpool.core.backends.local import image_dir

    d = image_dir(test_images_root, OLD_PYTEST_IMAGE)
    if not (d / "image.json").exists():
        _sp.run(["rm", "-rf", str(d)], check=True)
        venv = d / "venv"
        _sp.run([_sys.executable, "-m", "venv", str(venv)], check=True)
        _sp.run([str(venv / "bin" / "pip"), "install", "-q", "pytest==7.4.4"], check=True)
        calc = _json.loads((image_dir(test_images_root, calc_task.image) / "image.json").read_text())
        (d / "image.json").write_text(_json.dumps({**calc, "name": OLD_PYTEST_IMAGE, "venv": str(venv)}))
    return OLD_PYTEST_IMAGE


async def test_the_signed_report_works_and_catches_forgery_under_pytest_7(local_backend, calc_task, old_pytest_image):
    task = calc_task.model_copy(update={"image": old_pytest_image})
    sb = await _at_base(local_backend, task)
    assert "pytest 7.4.4" in (await sb.exec("python -m pytest --version", timeout=60)).text + \
        (await sb.exec("python -m pytest --version", timeout=60)).err_text
    empty = await grade(sb, task, timeout=120)
    assert (empty.reward, empty.tampering) == (0.0, ())
    await _sb_apply(sb, task.patch)
    gold = await grade(sb, task, timeout=120)
    assert (gold.reward, gold.tampering) == (1.0, ()), gold.log[-1500:]
    sb = await _at_base(local_backend, task)
    await _prepend(sb, "calc.py", FAKE_PASSED_THEN_EXIT)
    faked = await grade(sb, task, timeout=120)
    assert faked.reward == 0.0 and faked.tampering
    sb = await _at_base(local_backend, task)
    await _prepend(sb, "calc.py", REWRITE_OUTCOMES)
    rewritten = await grade(sb, task, timeout=120)
    assert rewritten.reward == 0.0 and any("replaced during the run" in e for e in rewritten.tampering)


FLOOD_THE_LOG = """
import os, sys
if "pytest" in sys.modules:
    # Past pytest's capture: write to the test process's own output pipe.
    for fd in range(3, 64):
        try:
            target = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            continue
        if target.startswith("pipe:"):
            for _ in range(3):
                os.write(fd, b"x" * (1 << 20))
            break
"""


async def test_code_under_test_that_floods_the_test_log_scores_zero_instead_of_an_infra_failure(
        local_backend, calc_task, monkeypatch):
    # An infra failure is never scored, so a policy that could turn its failing rollout into
    # one would escape its 0. A small cap keeps the flood cheap.
    import sandpool.envs.grading.inplace as inplace
    monkeypatch.setattr(inplace, "MAX_LOG_BYTES", 1 << 20)
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", FLOOD_THE_LOG)
    result = await grade(sb, calc_task, timeout=120)
    assert (result.reward, result.resolved) == (0.0, False)
    assert "test log exceeded" in (result.error or ""), result
    assert (await sb.exec("true", timeout=10)).ok, "the sandbox keeps working"


SWAP_THE_REPORT_FOR_A_FIFO = """
import atexit, glob, os, sys
if "pytest" in sys.modules:
    def swap():
        for report in glob.glob("/tmp/.sandpool-grade-*/report.jsonl"):
            os.unlink(report)
            os.mkfifo(report)
            print("swapped", report, file=sys.stderr)
    atexit.register(swap)
"""


async def test_a_verdict_report_swapped_for_a_fifo_scores_zero_instead_of_an_infra_failure(
        local_backend, calc_task):
    # Read, the FIFO held the grader until the host's wait gave up (an infra failure, never
    # scored): a failing policy's way out of its 0.
    sb = await _at_base(local_backend, calc_task)
    await _prepend(sb, "calc.py", SWAP_THE_REPORT_FOR_A_FIFO)
    result = await grade(sb, calc_task, timeout=120)
    assert "swapped" in result.log, result.log[-2000:]
    assert (result.reward, result.resolved) == (0.0, False)
    assert (await sb.exec("true", timeout=10)).ok, "the sandbox keeps working"
