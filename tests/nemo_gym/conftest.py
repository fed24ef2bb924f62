"""Fixtures for the NeMo Gym integration, run with the real nemo-gym in its own venv.

These tests need Python >= 3.12 and nemo-gym installed; ``nox -s nemo_gym`` builds that venv
and runs them. In a venv without nemo-gym this directory is not collected (the main suite
runs there), rather than reporting every test as skipped.

The ``nemo_gym_run`` fixture starts the servers the way a NeMo Gym user does: ``ng_run`` with
``+config_paths=[...]`` from a working directory holding ``resources_servers/sandpool_swe``;
NeMo Gym's own ``RunHelper`` then starts its head server and Ray, and runs our ``app.py`` with
the merged config in its environment. ``+skip_venv_if_present=true`` with ``uv_venv_dir``
pointing at this venv stands in for the per-server venv NeMo Gym would otherwise build.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("nemo_gym") is None:  # the main venv: nox -s nemo_gym runs these
    collect_ignore_glob = ["test_*.py"]
else:
    from aiohttp import ClientResponse
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import (
        GlobalAIOHTTPAsyncClientConfig,
        ServerClient,
        is_global_aiohttp_client_setup,
        raise_for_status,
        set_global_aiohttp_client,
    )

from sandpool.core.task import Task
from tests.ports import free_port

#: The server instances the test config defines.
MAIN = "sandpool_swe_resources_server"
SHORT_IDLE = "sandpool_swe_short_idle"
SHORT_IDLE_S = 3.0
_STARTUP_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def pack_tasks() -> list[Task]:
    """Two tasks of sandpool's real local task pack, on different images (built once, cached)."""
    from sandpool.envs.taskpack import build_default_pack
    from sandpool.envs.tasks import load_tasks

    picked: dict[str, Task] = {}
    for t in load_tasks(build_default_pack()):
        picked.setdefault(t.image, t)
    return list(picked.values())[:2]


@pytest.fixture(scope="session")
def task_file(tmp_path_factory: pytest.TempPathFactory, calc_task: Task, pack_tasks: list[Task]) -> Path:
    """A SWE-bench-format tasks.jsonl: the tiny calc task plus two real task-pack tasks."""
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(t.model_dump_json() + "\n" for t in [calc_task, *pack_tasks]))
    return path


@pytest.fixture(scope="session")
def images_root(test_images_root: Path, calc_task: Task, pack_tasks: list[Task]) -> Path:
    """One images root for the calc image and the pack's images: links to their directories."""
    from sandpool.core.backends.local import image_dir
    from sandpool.core.paths import sandpool_home

    root = test_images_root / "nemo-gym-root"
    root.mkdir(exist_ok=True)
    for task, home in [(calc_task, test_images_root), *((t, sandpool_home() / "images") for t in pack_tasks)]:
        link = image_dir(root, task.image)
        if not link.exists():
            link.symlink_to(image_dir(home, task.image))
    return root


@pytest.fixture(scope="session")
def pool_block(task_file: Path, images_root: Path) -> dict[str, Any]:
    """The ``sandpool:`` block the test servers and providers use."""
    return {"backend": "local", "strategy": "reuse", "tasks": str(task_file),
            "images_root": str(images_root), "concurrency": 2, "exec_timeout_s": 30,
            "grade_timeout_s": 120}


@pytest.fixture(scope="session")
def nemo_gym_run(tmp_path_factory: pytest.TempPathFactory, pool_block: dict[str, Any]) -> Iterator[BaseServerConfig]:
    """Start ``ng_run`` with the shipped config (plus test overrides); yield the head server config."""
    from sandpool.integrations.nemo_gym import CONFIG_PATH, SERVER_DIR

    work = tmp_path_factory.mktemp("ng-work")
    (work / "resources_servers").mkdir()
    (work / "resources_servers" / "sandpool_swe").symlink_to(SERVER_DIR)
    venvs = work / "venvs" / "resources_servers" / "sandpool_swe"
    venvs.mkdir(parents=True)
    (venvs / ".venv").symlink_to(sys.prefix)
    overrides = work / "test_overrides.yaml"
    short = dict(pool_block, idle_timeout_s=SHORT_IDLE_S, concurrency=1)
    overrides.write_text(json.dumps({
        MAIN: {"resources_servers": {"sandpool_swe": {"sandpool": pool_block}}},
        SHORT_IDLE: {"resources_servers": {"sandpool_swe": {
            "entrypoint": "app.py", "domain": "coding", "num_workers": 1, "sandpool": short}}},
    }))
    head = BaseServerConfig(host="127.0.0.1", port=free_port())
    argv = [str(Path(sys.prefix) / "bin" / "ng_run"), f"+config_paths=[{CONFIG_PATH},{overrides}]",
            "+skip_venv_if_present=true", f"+uv_venv_dir={work / 'venvs'}",
            f"++head_server.host={head.host}", f"++head_server.port={head.port}"]
    log = (work / "ng_run.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_")}
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    proc = subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        wait_for_servers(proc, head, [MAIN, SHORT_IDLE], work / "ng_run.log")
        yield head
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def wait_for_servers(proc: subprocess.Popen, head: BaseServerConfig, names: list[str], log: Path,
                     timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
    """Wait until every named resources server answers ``/pool_status`` through the head server.

    Raises:
        RuntimeError: ``proc`` exited, or ``timeout_s`` passed; the message ends with the log.
    """
    import requests
    from omegaconf import OmegaConf

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ng_run exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            cfg = requests.get(f"http://{head.host}:{head.port}/global_config_dict_yaml", timeout=2)
            cfg.raise_for_status()
            config = OmegaConf.create(json.loads(cfg.content.decode()))  # as ServerClient reads it
            ready = 0
            for name in names:
                inner = config[name]["resources_servers"]["sandpool_swe"]
                status = requests.get(f"http://{inner['host']}:{inner['port']}/pool_status", timeout=2)
                ready += status.status_code == 200
            if ready == len(names):
                return
        except (requests.RequestException, KeyError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"NeMo Gym servers not up in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
async def server_client(nemo_gym_run: BaseServerConfig) -> AsyncIterator[ServerClient]:
    """NeMo Gym's own ``ServerClient``, loaded from the running head server, as agents use it."""
    client = None
    if not is_global_aiohttp_client_setup():
        client = set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    sc = await asyncio.to_thread(ServerClient.load_from_global_config, nemo_gym_run)
    yield sc
    if client is not None:
        await client.close()


class SimpleAgentEpisode:
    """Drives one episode the way NeMo Gym's ``simple_agent`` does.

    ``/seed_session`` and ``/verify`` go through ``raise_for_status`` (a non-2xx fails the
    rollout); tool calls do not (their answer, whatever the status, goes back to the model).
    The resources server's cookies are passed on every call and replaced by each response's.

    Args:
        client: NeMo Gym's ``ServerClient``.
        server: Name of the resources server instance.
        row: The dataset row (``responses_create_params`` plus ``instance_id``).
    """

    def __init__(self, client: ServerClient, server: str, row: dict[str, Any]) -> None:
        self.client = client
        self.server = server
        self.row = row
        self.cookies: Any = None

    async def seed(self) -> dict[str, Any]:
        """POST ``/seed_session``; raises ``ClientResponseError`` on a failed rollout."""
        res = await self.client.post(server_name=self.server, url_path="/seed_session",
                                     json=self.row, cookies=self.cookies)
        await raise_for_status(res)
        self.cookies = res.cookies
        return await res.json()

    async def tool(self, name: str, **arguments: Any) -> tuple[int, dict[str, Any]]:
        """POST a tool call; returns ``(status, body)`` as the model would see it."""
        res: ClientResponse = await self.client.post(server_name=self.server, url_path=f"/{name}",
                                                     json=arguments, cookies=self.cookies)
        self.cookies = res.cookies
        return res.status, json.loads(await res.read())

    async def verify(self) -> dict[str, Any]:
        """POST ``/verify``; raises ``ClientResponseError`` on a failed rollout."""
        response = {"id": "resp_test", "created_at": 0, "model": "policy", "object": "response",
                    "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        res = await self.client.post(server_name=self.server, url_path="/verify",
                                     json=self.row | {"response": response}, cookies=self.cookies)
        await raise_for_status(res)
        return await res.json()


async def verify_failed_rollout(ep: SimpleAgentEpisode) -> dict:
    """POST /verify on a session whose sandbox failed; assert it is not scored, return the body.

    0.4: ``503``, which NeMo Gym's agent raises on (no reward recorded). 0.7: ``200`` with
    ``mask_sample`` and a registered ``failure_kind``, and 0.7's own profiler masks the row.
    """
    from aiohttp import ClientResponseError

    from sandpool.integrations.nemo_gym.server import MASKS_FAILED_VERIFY

    if not MASKS_FAILED_VERIFY:
        with pytest.raises(ClientResponseError) as info:
            await ep.verify()
        assert info.value.status == 503
        body = json.loads(info.value.response_content)
        assert body["outcome"] == "infra_failed" and "reward" not in body
        return body
    from nemo_gym.failure_kinds import FAILURE_KINDS
    from nemo_gym.reward_profile import select_measured

    body = await ep.verify()
    assert body["mask_sample"] is True and body["failure_kind"] in FAILURE_KINDS
    assert body["_ng_failure_class"] == body["failure_kind"] and body["failure_reason"]
    _, measured, masked, _ = select_measured([ep.row], [body])
    assert measured == [] and masked == [body]  # 0.7 leaves it out of every score
    return body


def row_for(task: Task) -> dict[str, Any]:
    """A dataset row for ``task`` as a NeMo Gym dataset holds it."""
    return {"instance_id": task.instance_id,
            "responses_create_params": {"input": task.problem_statement}}


@contextlib.asynccontextmanager
async def serving(pool_block: dict[str, Any], work: Path) -> AsyncIterator[tuple]:
    """A sandpool_swe server in this process with ``pool_block`` as its ``sandpool:`` block,
    built as NeMo Gym's ``run_webserver`` builds it (config from NeMo Gym's config parser,
    ``setup_webserver``, served by uvicorn); yields ``(server, client)``: NeMo Gym's
    ``ServerClient`` reaches it as :data:`MAIN`, and tests reach its pool and sessions."""
    import uvicorn
    from nemo_gym.global_config import GlobalConfigDictParser, get_first_server_config_dict
    from omegaconf import OmegaConf

    from sandpool.integrations.nemo_gym import CONFIG_PATH
    from sandpool.integrations.nemo_gym.server import SandpoolSweConfig, SandpoolSweResourcesServer

    overrides = work / "overrides.yaml"
    overrides.write_text(json.dumps({MAIN: {"resources_servers": {"sandpool_swe": {
        "port": free_port(), "sandpool": pool_block}}}}))
    gcd = GlobalConfigDictParser().parse_no_environment(
        OmegaConf.create({"config_paths": [str(CONFIG_PATH), str(overrides)]}))
    inner = get_first_server_config_dict(gcd, MAIN)
    config = SandpoolSweConfig.model_validate(OmegaConf.to_container(inner, resolve=True) | {"name": MAIN})
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=free_port()),
                          global_config_dict=gcd)
    server = SandpoolSweResourcesServer(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    userver = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))
    serving_ = asyncio.get_running_loop().create_task(userver.serve())
    while not userver.started:
        assert not serving_.done(), serving_.exception()
        await asyncio.sleep(0.05)
    try:
        yield server, client
    finally:
        userver.should_exit = True
        await serving_


@pytest.fixture(scope="module")
async def live(server_client, pool_block: dict[str, Any], tmp_path_factory) -> AsyncIterator[tuple]:
    """A sandpool_swe server in this process (see :func:`serving`) for one session at once."""
    async with serving(pool_block | {"concurrency": 1}, tmp_path_factory.mktemp("faults")) as both:
        yield both
