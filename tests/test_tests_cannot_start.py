"""A task whose tests cannot run is rejected, never scored 0; an image with only ``python3``
is graded with it; a policy cannot buy a rejection.

Real bubblewrap sandboxes on real OCI images without a ``python`` command: the OCI test
image shaped like a SWE-bench one (Debian bookworm's ``python3`` and pytest, the repo at
/testbed) with its venv taken off ``PATH``, and layers made here on top of it (pytest
deleted, an R2E-Gym ``run_tests.sh`` that says ``python``). They are derived from the cached
test images with umoci (no new mmdebstrap) and hydrated once into a store of their own
(keyed by what they hold), so the shared test store keeps only the shared images.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandpool.core.backends.local import LocalBackend
from sandpool.core.images import ImageStore, hydrate
from sandpool.core.metrics import Outcome
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.envs.grading.validate import ValidationCache, validate_tasks, validated
from sandpool.envs.policies import NoopPolicy, OraclePolicy, Policy
from sandpool.envs.runner import run_batch
from sandpool.envs.taskpack.oci import VERSION as IMAGES_VERSION
from sandpool.envs.taskpack.oci import build_test_images

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_DIST = "usr/lib/python3/dist-packages"
#: Deletes pytest from the image (whiteouts): its Python cannot import it, no pytest command.
_NO_PYTEST = [(f"{_DIST}/.wh.pytest", b""), (f"{_DIST}/.wh._pytest", b""),
              ("usr/bin/.wh.pytest", b""), ("usr/bin/.wh.py.test", b"")]
#: Deletes the ``pytest`` command only, and installs the repo for the image's Python (as
#: ``pip install -e`` would): a ``pytest`` run imports it from there.
_NO_PYTEST_COMMAND = [("usr/bin/.wh.pytest", b""), ("usr/bin/.wh.py.test", b""),
                      (f"{_DIST}/calcpkg-editable.pth", b"/testbed\n")]
#: R2E-Gym's test script, run as ``bash /root/run_tests.sh``; it says ``python``.
_RUN_TESTS = [("root/run_tests.sh",
               b"#!/bin/bash\ncd /testbed\npython -m pytest -rA -p no:cacheprovider tests/test_calc.py\n")]
#: The R2E-Gym verdict of the gold patch on the calc task.
_R2E_EXPECTED = json.dumps({"test_add": "PASSED", "test_zero": "PASSED"})


def _layer(path: Path, entries: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.mode, ti.mtime, ti.size = (0o755 if name.endswith(".sh") else 0o644), 946684800, len(data)
            tf.addfile(ti, io.BytesIO(data))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[ImageStore, dict[str, str], Task]:
    """The store, the derived images by kind, and the calc task of the OCI test image."""
    built = build_test_images()
    names = {"python3": "sandpool.test/swe-calc-python3-only:1", "no-pytest": "sandpool.test/swe-calc-no-pytest:1",
             "r2e": "sandpool.test/swe-calc-r2e-python3-only:1",
             "no-pytest-command": "sandpool.test/swe-calc-no-pytest-command:1"}
    layers = {"python3": [], "no-pytest": _NO_PYTEST, "r2e": _RUN_TESTS, "no-pytest-command": _NO_PYTEST_COMMAND}
    key = hashlib.sha256(repr(sorted(layers.items())).encode()).hexdigest()[:12]
    store = ImageStore(sandpool_home() / f"test-oci-store-v{IMAGES_VERSION}-cannot-start-{key}")
    for kind, name in names.items():
        if store.resolve(name) is not None:
            continue
        tmp = tmp_path_factory.mktemp(kind)
        layout = tmp / "layout"
        subprocess.run(["cp", "-al", str(built / "layout"), str(layout)], check=True)
        (layout / "index.json").unlink()  # umoci rewrites it: a copy, not the shared file
        shutil.copy(built / "layout" / "index.json", layout / "index.json")
        subprocess.run(["umoci", "config", "--image", f"{layout}:swe", "--tag", kind, f"--config.env=PATH={_PATH}"],
                       check=True, capture_output=True)
        if layers[kind]:
            _layer(tmp / "layer.tar", layers[kind])
            subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:{kind}", str(tmp / "layer.tar")],
                           check=True, capture_output=True)
        hydrate(f"oci:{layout}:{kind}", name=name, store=store)
    task = Task.model_validate_json((built / "swe-task.json").read_text())
    return store, names, task


@pytest.fixture
async def backend(test_images_root, images):
    b = LocalBackend(test_images_root, store=images[0])
    await b.preflight()
    yield b
    await b.aclose()


def _on(images, kind: str, **row) -> Task:
    _, names, task = images
    return task.model_copy(update={"image": names[kind], "instance_id": f"calc-{kind}", **row})


def _r2e(images, kind: str) -> Task:
    return _on(images, kind, instance_id=f"calc-{kind}-r2e", harness="r2e-gym",
               expected_output_json=_R2E_EXPECTED)


#: A test patch whose conftest.py cannot be imported: pytest collects none of the task's tests,
#: with any patch, on a sound image.
_UNCOLLECTABLE = ("diff --git a/tests/conftest.py b/tests/conftest.py\nnew file mode 100644\n--- /dev/null\n"
                  "+++ b/tests/conftest.py\n@@ -0,0 +1 @@\n+import calcpkg_fixtures_not_installed\n")


def _by_outcome(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in report.rollouts:
        out.setdefault(r.outcome.value, []).append(r)
    return out


# -- (1) a task whose tests cannot run is rejected, every rollout, with the reason -------------

@pytest.mark.parametrize(("kind", "why"), [
    ("no-pytest", "cannot run pytest"),
    ("r2e-no-script", "run_tests.sh"),
    ("uncollectable", "calcpkg_fixtures_not_installed"),
], ids=["no-pytest-in-the-image", "r2e-runner-missing", "collection-error-on-pristine"])
async def test_a_task_whose_tests_cannot_run_has_every_rollout_rejected_not_scored(backend, images, kind, why):
    task = {"no-pytest": lambda: _on(images, "no-pytest"),
            "r2e-no-script": lambda: _r2e(images, "python3"),
            "uncollectable": lambda: _on(images, "python3", instance_id="calc-uncollectable",
                                         test_patch=_UNCOLLECTABLE)}[kind]()
    report = await run_batch([task], [OraclePolicy(), NoopPolicy()], backend, rollouts_per_task=4,
                             concurrency=2, strategy="reuse")
    assert report.failures["rejected"] == 4 and report.failures["completed"] == 0, report.render_text()
    assert report.reward.scored == 0 and report.unaccounted == 0
    (rejected,) = report.rejected
    assert "none of its tests ran" in rejected.reason and why in rejected.reason, rejected.reason
    assert all(r.reward is None and r.error_kind == "broken_task" for r in report.rollouts)
    assert why in report.render_text()


# -- (2) an image with only python3: every harness runs its tests with it ----------------------

def _swesmith(images) -> Task:
    return _on(images, "no-pytest-command", instance_id="calc-swe-smith", harness="swe-smith")


async def test_only_python3_grades_oracle_1_noop_0_for_the_pytest_r2e_and_swe_smith_harnesses(backend, images):
    tasks = [_on(images, "python3"), _r2e(images, "r2e"), _swesmith(images)]
    for t in tasks:
        sb = await backend.create(t.image)
        try:
            res = await sb.exec("command -v python python3 pytest", timeout=10)
            assert res.text.split()[0] == "/usr/bin/python3", res.text
        finally:
            await backend.delete(sb)
    report = await run_batch(tasks, [OraclePolicy(), NoopPolicy()], backend, rollouts_per_task=2,
                             concurrency=2, strategy="reuse")
    assert report.failures["completed"] == 6, report.render_text()
    rewards = {(r.task_id, r.policy): r.reward for r in report.rollouts}
    assert rewards == {(t.instance_id, p): float(p == "oracle") for t in tasks for p in ("oracle", "noop")}


@pytest.mark.parametrize("harness", ["pytest", "r2e-gym", "swe-smith"])
async def test_in_place_grading_runs_the_harness_with_python3(backend, images, harness):
    task = {"pytest": lambda: _on(images, "python3"), "r2e-gym": lambda: _r2e(images, "r2e"),
            "swe-smith": lambda: _swesmith(images)}[harness]()
    scores = []
    for patch in (task.patch, ""):
        sb = await backend.create(task.image)
        try:
            if patch:
                await sb.write_file("/tmp/gold.patch", patch.encode())
                assert (await sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=30)).ok
            result = await grade(sb, task, timeout=120)
        finally:
            await backend.delete(sb)
        assert result.ran and "command not found" not in result.log, result.log[-2000:]
        scores.append(result.reward)
    assert scores == [1.0, 0.0]


# -- (3) a policy cannot make its own run look like a broken task -----------------------------

class _Breaker(Policy):
    """Breaks the test run its own way, after fixing the bug when ``fix``."""

    def __init__(self, name: str, command: str, *, fix: bool = False) -> None:
        self.name, self.command, self.fix = name, command, fix

    async def act(self, lease, task: Task) -> None:
        if self.fix:
            await OraclePolicy().act(lease, task)
        res = await lease.exec(self.command, timeout=60)
        assert res.exit_code == 0, (self.name, res.err_text)


_BREAKERS = [
    # In its own sandbox: grading runs elsewhere, so only its (empty) patch is scored.
    _Breaker("deletes-the-interpreter", "rm -f /usr/bin/python3* && ! command -v python3"),
    _Breaker("deletes-pytest", f"rm -rf /{_DIST}/pytest /{_DIST}/_pytest /usr/bin/pytest"),
    # In its patch, with the fix: none of the task's tests is collected, or the run looks
    # as if the test command never started.
    _Breaker("breaks-collection", "printf 'raise ImportError(\"broken\")\\n' >> calcpkg/__init__.py", fix=True),
    _Breaker("fakes-command-not-found", "printf 'import os, sys\\nsys.stderr.write(\"/bin/bash: line 8: "
             "python: command not found\\\\n\")\\nos._exit(127)\\n' >> calcpkg/__init__.py", fix=True),
    _Breaker("exits-quietly", "printf 'import os\\nos._exit(0)\\n' >> calcpkg/__init__.py", fix=True),
]


async def test_a_policy_that_breaks_the_interpreter_pytest_or_collection_is_scored_0_never_rejected(
        backend, images):
    task = _on(images, "python3")
    fixer = _Breaker("fixes-then-deletes-the-interpreter", "rm -f /usr/bin/python3*", fix=True)
    policies = [*_BREAKERS, fixer, OraclePolicy()]
    report = await run_batch([task], policies, backend, rollouts_per_task=len(policies),
                             concurrency=2, strategy="reuse", retries=0)
    by = {r.policy: r for r in report.rollouts}
    assert report.failures["rejected"] == 0 and not report.rejected, report.render_text()
    for p in _BREAKERS:
        r = by[p.name]
        assert r.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and r.reward == 0.0, (p.name, r)
    assert by["exits-quietly"].outcome is Outcome.TASK_FAILED  # exit 0, pytest never sealed: tampering
    for name in ("fixes-then-deletes-the-interpreter", "oracle"):  # its own sandbox is not graded
        assert (by[name].outcome, by[name].reward) == (Outcome.COMPLETED, 1.0), by[name]


# -- (4) validation finds it ------------------------------------------------------------------

async def test_validation_reports_a_task_whose_tests_cannot_run_and_passes_python3_only(
        test_images_root, images, tmp_path):
    store = images[0]
    broken = [_on(images, "no-pytest"), _r2e(images, "python3")]
    sound = [_on(images, "python3"), _r2e(images, "r2e")]
    result = await validate_tasks(broken + sound, lambda: LocalBackend(test_images_root, store=store),
                                  concurrency=2, grade_timeout=120)
    verdicts = {v.task_id: v for v in result.verdicts}
    for t in broken:
        v = verdicts[t.instance_id]
        assert v.status == "broken" and "none of its tests ran" in v.reason, v
    assert [t.instance_id for t in result.passing] == [t.instance_id for t in sound], result.render_text()
    # sandpool run's validation of rows it has not seen: the broken ones are rejected with the reason.
    runnable, rejected, _ = await validated(broken + sound, lambda: LocalBackend(test_images_root, store=store),
                                            cache=ValidationCache(tmp_path), grade_timeout=120)
    assert [t.instance_id for t in runnable] == [t.instance_id for t in sound]
    assert {r.task_id for r in rejected} == {t.instance_id for t in broken}
    assert all("none of its tests ran" in r.reason for r in rejected)
