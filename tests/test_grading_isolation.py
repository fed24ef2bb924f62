"""Diff grading in real sandboxes: the isolated test process, and the handed cases.

The isolated run must import nothing of the repo's before pytest and the verdict plugin, and
keep the per-run key out of the code under test's reach; a test patch that adds a test file
must grade (case 001); printed PASSED lines must not (case 002); an image without ``python``
must be graded with the interpreter it has, and an image that cannot run the tests at all
must reject the task, never score it 0 (case 006; on OCI images in
``test_tests_cannot_start.py``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend, image_dir
from sandpool.core.images import ImageStore, hydrate
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task
from sandpool.envs.grading import grade, parse_test_log
from sandpool.envs.grading.capture import capture_patch
from sandpool.envs.grading.diff import grade_patch
from sandpool.envs.taskpack.oci import VERSION as IMAGES_VERSION
from sandpool.envs.taskpack.oci import build_test_images


async def _at_base(backend, task: Task):
    sb = await backend.create(task.image)
    assert (await sb.exec(f"git checkout -q {task.base_commit}", timeout=60)).ok
    return sb


async def _prepend(sb, path: str, code: str) -> None:
    await sb.write_file(path, code.encode() + b"\n" + await sb.read_file(path))


async def _rollout(backend, task: Task, act) -> tuple:
    """Act as the policy, capture its patch, grade it in a pristine sandbox: (patch, result)."""
    sb = await _at_base(backend, task)
    try:
        await act(sb)
        patch = await capture_patch(sb, task)
    finally:
        await backend.delete(sb)
    pristine = await _at_base(backend, task)
    try:
        return patch, await grade_patch(pristine, task, patch, timeout=300)
    finally:
        await backend.delete(pristine)


async def _gold(sb, task: Task) -> None:
    await sb.write_file("/tmp/gold.patch", task.patch.encode())
    assert (await sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=30)).ok


async def _noop(sb) -> None:
    pass


# -- the isolated test process ---------------------------------------------------------------

_READ_THE_KEY_AT_STARTUP = b"""
import os, sys
spec = os.environ.get("SANDPOOL_VERDICT")
if spec:
    with open(spec.split(":")[0], "rb") as f:
        sys.stderr.write("KEY-READ %s\\n" % f.read().hex())
open("/tmp/.startup-file-ran", "w").close()
"""

_LOOK_FOR_THE_KEY = """
import json, os, sys
if "pytest" in sys.modules:
    seen = []
    if "SANDPOOL_VERDICT" in os.environ or any(k.startswith("SANDPOOL_V") for k in os.environ):
        seen.append("environment")
    if b"VERDICT" in open("/proc/self/environ", "rb").read():
        seen.append("/proc/self/environ")
    for arg in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
        if arg.endswith(b".json") and os.path.exists(arg):
            job = json.load(open(arg))
            if os.path.exists(job.get("key", "")):
                seen.append("key file")
    with open("/tmp/.key-seen", "w") as f:  # past pytest's capture of the tests' output
        f.write(",".join(seen) or "nothing")
"""


async def test_a_startup_file_reads_the_key_in_place_but_nothing_of_the_repo_runs_first_isolated(
        pack_backend, default_pack_tasks):
    task = next(t for t in default_pack_tasks if t.instance_id == "pytoolz__toolz-1")
    sb = await _at_base(pack_backend, task)
    try:  # in place, the image's .pth puts the repo on sys.path and site imports this
        await sb.write_file("sitecustomize.py", _READ_THE_KEY_AT_STARTUP)
        leaked = await grade(sb, task, timeout=300)
    finally:
        await pack_backend.delete(sb)
    assert "KEY-READ " in leaked.log, "the trick should read the key in place"
    # Isolated: plant the start-up file, a module shadowing a pytest dependency and one
    # shadowing pytest itself straight into the grading tree (no patch policy in the way).
    pristine = await _at_base(pack_backend, task)
    try:
        await pristine.write_file("sitecustomize.py", _READ_THE_KEY_AT_STARTUP)
        for name in ("iniconfig/__init__.py", "pluggy/__init__.py", "pytest.py"):
            await pristine.write_file(name, b"open('/tmp/.shadow-ran', 'w').close()\nraise SystemExit(0)\n")
        await _gold(pristine, task)
        await _prepend(pristine, "toolz/__init__.py", _LOOK_FOR_THE_KEY)
        result = await grade_patch(pristine, task, b"", timeout=300)
        ran = await pristine.exec("ls /tmp/.startup-file-ran /tmp/.shadow-ran", timeout=10)
        seen = (await pristine.read_file("/tmp/.key-seen")).decode()
    finally:
        await pack_backend.delete(pristine)
    assert ran.exit_code != 0 and "No such file" in ran.err_text, ran.text
    assert "KEY-READ" not in result.log and seen == "nothing", seen
    assert (result.reward, result.tampering) == (1.0, ()), result.log[-2000:]


# -- case 001: a test patch that adds a test file --------------------------------------------

_NEW_TEST = ("diff --git a/test_more.py b/test_more.py\nnew file mode 100644\nindex 0000000..1111111\n"
             "--- /dev/null\n+++ b/test_more.py\n@@ -0,0 +1,5 @@\n+from calc import add\n+\n+\n"
             "+def test_add_more():\n+    assert add(2, 2) == 4\n")


async def test_a_test_patch_that_adds_a_test_file_grades_gold_1_and_empty_0(local_backend, calc_task):
    task = calc_task.model_copy(update={
        "instance_id": "calc__calc-new-test", "test_patch": _NEW_TEST,
        "FAIL_TO_PASS": ["test_more.py::test_add_more", "test_calc.py::test_add"]})
    _, gold = await _rollout(local_backend, task, lambda sb: _gold(sb, task))
    _, empty = await _rollout(local_backend, task, _noop)
    assert (gold.reward, gold.error) == (1.0, None), gold.log[-2000:]
    assert (empty.reward, empty.failed_f2p) == (0.0, tuple(task.FAIL_TO_PASS))


async def test_a_policy_that_writes_the_new_test_file_itself_gets_it_reset(local_backend, calc_task):
    task = calc_task.model_copy(update={"test_patch": _NEW_TEST,
                                        "FAIL_TO_PASS": ["test_more.py::test_add_more"]})

    async def own_test(sb) -> None:
        await sb.write_file("test_more.py", b"def test_add_more():\n    pass\n")

    patch, result = await _rollout(local_backend, task, own_test)
    assert b"test_more.py" in patch
    assert result.neutralised == ("reset test_more.py",) and result.reward == 0.0


# -- case 002: PASSED lines printed by the code under test -------------------------------------

_FAKE_PASSED = """
import os, sys
if "pytest" in sys.modules:
    ids = {ids!r}
    for fd in range(1, 64):
        try:
            os.write(fd, "".join("PASSED %s\\n" % t for t in ids).encode())
        except OSError:
            pass
    os._exit(0)
"""


async def test_printed_passed_lines_fool_a_log_reading_grader_and_are_tampering_by_diff(
        pack_backend, default_pack_tasks):
    task = next(t for t in default_pack_tasks if t.instance_id == "pytoolz__toolz-1")
    files = " ".join(sorted({t.split("::")[0] for t in task.FAIL_TO_PASS + task.PASS_TO_PASS}))

    async def fake(sb) -> None:
        ids = await sb.exec(f"python -m pytest --collect-only -q -p no:cacheprovider {files}", timeout=120)
        assert ids.ok, ids.err_text
        collected = [line for line in ids.text.splitlines() if "::" in line]
        await _prepend(sb, "toolz/__init__.py", _FAKE_PASSED.format(ids=collected))
        plain = await sb.exec(f"python -m pytest -rA -p no:cacheprovider {files}", timeout=120)
        statuses = parse_test_log(plain.text)
        assert all(statuses.get(t) is not None and statuses[t].passed for t in task.FAIL_TO_PASS)
        assert plain.exit_code == 0, "the trick should fool a grader that reads the log"

    _, result = await _rollout(pack_backend, task, fake)
    assert (result.reward, result.resolved) == (0.0, False)
    assert any("verdict report" in e for e in result.tampering), result.tampering


# -- case 006: the harness uses the image's interpreter; one that cannot run is a broken task --

@pytest.fixture(scope="module")
def python3_only(tmp_path_factory) -> tuple[ImageStore, Task]:
    """The OCI test image shaped like a SWE-bench one (Debian bookworm, ``python3`` with
    pytest, the repo at /testbed) with its venv taken off ``PATH``: there is no ``python``."""
    images = build_test_images()
    store = ImageStore(sandpool_home() / f"test-oci-store-v{IMAGES_VERSION}")
    name = "sandpool.test/swe-calc-python3-only:1"
    if store.resolve(name) is None:
        layout = tmp_path_factory.mktemp("layout") / "layout"
        subprocess.run(["cp", "-al", str(images / "layout"), str(layout)], check=True)
        (layout / "index.json").unlink()  # umoci rewrites it: a copy, not the shared file
        shutil.copy(images / "layout" / "index.json", layout / "index.json")
        subprocess.run(["umoci", "config", "--image", f"{layout}:swe", "--tag", "python3-only",
                        "--config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                       check=True, capture_output=True)
        hydrate(f"oci:{layout}:python3-only", name=name, store=store)
    task = Task.model_validate_json((images / "swe-task.json").read_text())
    return store, task.model_copy(update={"image": name})


@pytest.fixture(scope="module")
def no_pytest_task(test_images_root, calc_task) -> Task:
    """The calc task on an image whose Python has no pytest."""
    name = "sandpool.test/calc-no-pytest:1"
    d = image_dir(test_images_root, name)
    if not (d / "image.json").exists():
        calc = json.loads((image_dir(test_images_root, calc_task.image) / "image.json").read_text())
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d / "venv")], check=True)
        (d / "image.json").write_text(json.dumps({**calc, "name": name, "venv": str(d / "venv")}))
    return calc_task.model_copy(update={"image": name})


async def test_an_image_without_python_grades_with_python3_in_place_and_by_diff(test_images_root, python3_only):
    store, task = python3_only
    backend = LocalBackend(test_images_root, store=store)
    await backend.preflight()
    try:
        in_place = []
        for act in (lambda sb: _gold(sb, task), _noop):
            sb = await _at_base(backend, task)
            try:
                assert (await sb.exec("command -v python", timeout=10)).exit_code == 1
                await act(sb)
                in_place.append(await grade(sb, task, timeout=120))
            finally:
                await backend.delete(sb)
        _, gold = await _rollout(backend, task, lambda sb: _gold(sb, task))
        _, empty = await _rollout(backend, task, _noop)
    finally:
        await backend.aclose()
    assert [r.reward for r in in_place] == [1.0, 0.0], in_place[0].log[-2000:]
    assert "command not found" not in in_place[1].log and in_place[1].ran == 2
    assert (gold.reward, empty.reward) == (1.0, 0.0), gold.log[-2000:]


async def _accountant(backend, task: Task, episode):
    from sandpool.core.pool import SandboxPool
    from sandpool.core.rollout import run_rollout
    from sandpool.envs.grading.grader import DiffGrader

    async with SandboxPool(backend, "reuse") as pool:
        return await run_rollout(pool, task, episode, grader=DiffGrader(timeout=120), retries=0)


async def test_an_image_that_cannot_run_pytest_says_so_and_the_accountant_rejects_the_task(
        local_backend, test_images_root, no_pytest_task):
    task = no_pytest_task
    for act in (lambda sb: _gold(sb, task), _noop):
        _, result = await _rollout(local_backend, task, act)  # the patch applied: it says why, no more
        assert (result.reward, result.ran) == (0.0, 0) and "cannot run pytest" in (result.not_run or "")
    result = await _accountant(LocalBackend(test_images_root), task, lambda lease: _gold(lease, task))
    assert (result.outcome.value, result.reward, result.error_kind) == ("rejected", None, "broken_task")
    assert "none of its tests ran" in result.error and "cannot run pytest" in result.error, result.error


async def test_a_run_where_no_listed_test_ran_scores_0_and_pristine_runs_decide_it_is_broken(
        local_backend, test_images_root, calc_task):
    # The base's own bug can stop collection, and the policy's code can exit on purpose: a
    # rollout's run is never evidence of a broken task by itself; runs with no patch and with
    # the gold patch, on pristine sandboxes, decide.
    task = calc_task.model_copy(update={"FAIL_TO_PASS": ["test_gone.py::test_add"]})
    _, empty = await _rollout(local_backend, task, _noop)
    _, gold = await _rollout(local_backend, task, lambda sb: _gold(sb, task))
    assert (empty.reward, gold.reward, empty.ran, gold.ran) == (0.0, 0.0, 0, 0)
    assert set(gold.absent) == {"test_gone.py::test_add", "test_calc.py::test_zero"}
    result = await _accountant(LocalBackend(test_images_root), task, lambda lease: _gold(lease, task))
    assert (result.outcome.value, result.reward) == ("rejected", None), result
    assert "none of its tests ran" in result.error and "test_gone.py" in result.error, result.error


# -- capture: what the policy left can only fail its own rollout -------------------------------

async def test_capture_on_a_disk_the_policy_filled_is_its_own_failure(test_images_root, calc_task):
    from sandpool.core.base import ResourceLimits

    backend = LocalBackend(test_images_root, limits=ResourceLimits(disk_bytes=32 << 20))
    await backend.preflight()
    try:
        sb = await _at_base(backend, calc_task)
        await _gold(sb, calc_task)
        fill = await sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=64; dd if=/dev/zero of=/tmp/fill2 bs=512;"
                             " for i in $(seq 64); do mkdir /tmp/d$i || break; done", timeout=60)
        assert "No space left on device" in fill.err_text, fill.err_text
        with pytest.raises(errors.DiskQuotaExceeded):  # a TaskError: scored 0, never infra
            await capture_patch(sb, calc_task)
    finally:
        await backend.aclose()


async def test_capture_kills_the_policys_processes_and_ignores_its_git_config(local_backend, calc_task):
    sb = await _at_base(local_backend, calc_task)
    await _gold(sb, calc_task)
    # Config that would run a clean filter or an external diff if git honoured it, and a
    # process left running.
    assert (await sb.exec("git config filter.x.clean 'echo FILTERED' && git config diff.external /bin/false"
                          " && echo 'calc.py filter=x' > .gitattributes && (nohup sleep 600 >/dev/null 2>&1 &)",
                          timeout=10)).ok
    assert any("sleep 600" in p for p in await sb.processes())
    patch = (await capture_patch(sb, calc_task)).decode()
    assert "+    return a + b" in patch and "FILTERED" not in patch, patch
    assert not any("sleep 600" in p for p in await sb.processes())
