"""Fixtures for the OpenHands app server (openhands-ai 1.11.0) on sandpool, in its own venv.

``nox -s openhands_app`` runs these with openhands-ai 1.11.0 installed (it pins the SDK at
1.34.0, so it cannot share the SDK 1.58 venv); elsewhere this directory is not collected. The
``app_server`` fixture starts the real app server (``openhands.app_server.app:app`` under
uvicorn) with sandpool selected as its sandbox service by environment, exactly as a user would.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandpool.core.paths import sandpool_home
from tests.ports import free_port as _free_port

os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULES = ROOT / "tests" / "openhands" / "server_modules"
_STARTUP_S = 600.0

if importlib.util.find_spec("openhands") is None or importlib.util.find_spec("openhands.app_server") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import httpx


class AppServer:
    """A running app server: its base URL and the files it was configured with."""

    def __init__(self, url: str, results: Path, log: Path) -> None:
        self.url, self.results, self.log = url, results, log

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=600.0)


@pytest.fixture(scope="session")
def app_server(tmp_path_factory: pytest.TempPathFactory, calc_task, test_images_root) -> Iterator[AppServer]:
    d = tmp_path_factory.mktemp("app")
    tasks = d / "tasks.jsonl"
    # The calc task and the outcome table's tasks that cannot run (one spec each).
    from tests.accountant_cases import cases

    specs = {c.task.instance_id: c.task for c in cases(calc_task)}
    tasks.write_text("".join(t.model_dump_json() + "\n" for t in specs.values()))
    port = _free_port()
    kind = "sandpool.integrations.openhands."
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HOME": str(d / "home"),  # the app server's own settings and database
        "SANDPOOL_HOME": str(sandpool_home()),  # sandpool's caches: images, the agent-server env
        "OH_SANDBOX_KIND": kind + "SandpoolSandboxServiceInjector",
        "OH_SANDBOX_TASKS_PATH": str(tasks),
        "OH_SANDBOX_IMAGES_ROOT": str(test_images_root),
        "OH_SANDBOX_WARM": "1",
        "OH_SANDBOX_PRELOAD": "sandpool_scripted_llm",
        "OH_SANDBOX_PYTHON_PATH": str(SERVER_MODULES),
        "OH_SANDBOX_RESULTS_PATH": str(d / "results.jsonl"),
        "OH_SANDBOX_SPEC_KIND": kind + "SandpoolSandboxSpecServiceInjector",
        "OH_SANDBOX_SPEC_TASKS_PATH": str(tasks),
        "OH_LIFESPAN_KIND": kind + "SandpoolAppLifespanService",
    }
    log = d / "app.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "openhands.app_server.app:app",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=d)
    server = AppServer(f"http://127.0.0.1:{port}", d / "results.jsonl", log)
    try:
        deadline = time.monotonic() + _STARTUP_S
        while True:  # the app server answers once its startup is complete
            if proc.poll() is not None:
                raise RuntimeError(f"the app server exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{server.url}/api/v1/sandboxes/search", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the app server did not start: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
