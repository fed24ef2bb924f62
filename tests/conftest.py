"""Shared fixtures: a tiny real image for fast sandbox tests, and the local backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandpool.core.backends.local import LocalBackend, image_dir
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task

CALC_IMAGE = "sandpool.test/calc:2"
_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **_GIT_ENV}).stdout.strip()


def _build_calc_image(root: Path) -> dict[str, str]:
    """A two-commit repo (clean, then a bug) with a venv holding pytest; built once, cached."""
    d = image_dir(root, CALC_IMAGE)
    meta = d / "commits.json"
    if meta.exists():
        return json.loads(meta.read_text())
    subprocess.run(["rm", "-rf", str(d)], check=True)
    repo, venv = d / "repo", d / "venv"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\n"
                                       "def test_zero():\n    assert add(0, 0) == 0\n")
    (repo / ".gitignore").write_text("__pycache__/\n*.log\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "clean")
    clean = _git(repo, "rev-parse", "HEAD")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    _git(repo, "commit", "-qam", "bug")
    buggy = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "main")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "pytest"], check=True)
    (d / "image.json").write_text(json.dumps({
        "name": CALC_IMAGE, "python_prefix": sys.base_prefix, "venv": str(venv), "repo": str(repo),
        "workdir": "/testbed"}))
    commits = {"clean": clean, "buggy": buggy}
    meta.write_text(json.dumps(commits))
    return commits


def child_processes(pid: int | None = None) -> list[str]:
    """Children of process ``pid`` (default: this one), running or exited and not yet waited
    for (zombies), as ``"<pid> <state> <command>"``."""
    me = str(os.getpid() if pid is None else pid)
    found = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, NotADirectoryError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me:
            found.append(f"{d.name} {fields[0]} {cmd or stat[stat.index('(') + 1:stat.rindex(')')]}")
    return found


@pytest.fixture(scope="session", autouse=True)
def no_child_process_left() -> Iterator[None]:
    """The session ends with no child process left: none still running, and none exited but
    never waited for (a zombie, whose Popen warns "subprocess N is still running" at exit).
    Checked once every other session fixture (cluster, backends) has been torn down."""
    yield
    # multiprocessing's resource tracker, started by the first "spawn" process (AsyncVectorEnv's
    # workers), lives as long as the interpreter by design: stop it and wait for it here, as
    # CPython's own tests do, so that what is left is what a test or sandpool left.
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()
    left = child_processes()
    assert not left, f"the test session left child processes (started, never waited for): {left}"


@pytest.fixture(scope="session")
def test_images_root() -> Path:
    """Root of small images built for tests (never under /tmp, which sandboxes make private)."""
    root = sandpool_home() / "test-images"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def calc_commits(test_images_root: Path) -> dict[str, str]:
    """Commits of the calc test image: ``clean`` and ``buggy`` (add() subtracts)."""
    return _build_calc_image(test_images_root)


@pytest.fixture(scope="session")
def calc_task(calc_commits: dict[str, str]) -> Task:
    """A real task on the calc image: the buggy commit, with the gold patch that fixes it."""
    patch = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n"
             " def add(a, b):\n-    return a - b\n+    return a + b\n")
    return Task(instance_id="calc__calc-1", repo="sandpool/calc", base_commit=calc_commits["buggy"],
                image=CALC_IMAGE, problem_statement="add() returns the wrong value.", patch=patch,
                FAIL_TO_PASS=["test_calc.py::test_add"], PASS_TO_PASS=["test_calc.py::test_zero"])


@pytest.fixture
async def local_backend(test_images_root: Path, calc_commits: dict[str, str]):
    """A real bubblewrap backend over the test images; closed (every sandbox deleted) after."""
    backend = LocalBackend(test_images_root)
    await backend.preflight()
    yield backend
    await backend.aclose()


# ---------------------------------------------------------------------------------------------
# Task pack (sandpool.envs.taskpack): the default pack, built once per machine and cached.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
async def default_pack_path() -> Path:
    """Path of the default pack's ``tasks.jsonl``: built on first use (minutes), then cached."""
    from sandpool.envs.taskpack import abuild_default_pack

    return await abuild_default_pack()


@pytest.fixture(scope="session")
def default_pack_tasks(default_pack_path: Path) -> list[Task]:
    """Every task of the default pack, parsed."""
    lines = default_pack_path.read_text().splitlines()
    return [Task.model_validate_json(line) for line in lines if line.strip()]


@pytest.fixture(scope="session")
async def pack_backend():
    """A real bubblewrap backend over the default images (``sandpool_home()/images``)."""
    backend = LocalBackend()
    await backend.preflight()
    yield backend
    await backend.aclose()


# ---------------------------------------------------------------------------------------------
# OCI test images (sandpool.envs.taskpack.oci): built once per machine and cached, hydrated
# into a test store.
# ---------------------------------------------------------------------------------------------

WH_IMAGE = "sandpool.test/wh:1"
BASE_IMAGE = "sandpool.test/base:1"


@pytest.fixture(scope="session")
def oci_images() -> Path:
    """The cache directory of the built test images (``layout/``, ``swe-task.json``)."""
    from sandpool.envs.taskpack.oci import build_test_images

    return build_test_images()


@pytest.fixture(scope="session")
def oci_store(oci_images: Path):
    """A store holding the three test images, hydrated from the OCI layout."""
    from sandpool.core.images import ImageStore, hydrate
    from sandpool.envs.taskpack.oci import SWE_IMAGE
    from sandpool.envs.taskpack.oci import VERSION as IMAGES_VERSION  # keys the test store

    # Keyed by the images' version: a store hydrated from older test images would not match them.
    store = ImageStore(sandpool_home() / f"test-oci-store-v{IMAGES_VERSION}")
    for tag, name in (("base", BASE_IMAGE), ("swe", SWE_IMAGE), ("wh", WH_IMAGE)):
        if store.resolve(name) is None:
            hydrate(f"oci:{oci_images / 'layout'}:{tag}", name=name, store=store)
    return store


@pytest.fixture(scope="session")
def swe_task(oci_images: Path) -> Task:
    """The SWE-shaped task of the OCI test image."""
    return Task.model_validate_json((oci_images / "swe-task.json").read_text())


@pytest.fixture
def spare_ids():
    """A range of host ids that no sandbox on this machine holds while the test runs: the
    plain namespaces a test starts as those ids starve, or read from, no one else's."""
    from sandpool.core.backends.local._idrange import allocate

    ids = allocate()
    yield ids
    ids.release()
