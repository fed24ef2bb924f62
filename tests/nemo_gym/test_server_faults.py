"""Infra faults in the sandpool_swe server: a killed sandbox is a failed rollout, never reward 0.

The server runs in this process, built as NeMo Gym's ``run_webserver`` builds it (config from
NeMo Gym's config parser, ``setup_webserver``, served by uvicorn), so the test can kill the
sandbox under a session with ``LocalBackend.kill``; episodes still go over HTTP.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from aiohttp import ClientResponseError
from omegaconf import OmegaConf

from nemo_gym.global_config import GlobalConfigDictParser, get_first_server_config_dict
from nemo_gym.server_utils import ServerClient
from nemo_gym.config_types import BaseServerConfig
from sandpool.core.task import Task
from sandpool.integrations.nemo_gym import CONFIG_PATH
from sandpool.integrations.nemo_gym.server import SandpoolSweConfig, SandpoolSweResourcesServer
from tests.nemo_gym.conftest import MAIN, SimpleAgentEpisode, free_port, row_for


@pytest.fixture(scope="module")
async def live(server_client, pool_block: dict[str, Any], tmp_path_factory) -> AsyncIterator[tuple]:
    overrides = tmp_path_factory.mktemp("faults") / "overrides.yaml"
    overrides.write_text(json.dumps({MAIN: {"resources_servers": {"sandpool_swe": {
        "port": free_port(), "sandpool": pool_block | {"concurrency": 1}}}}}))
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
    serving = asyncio.get_running_loop().create_task(userver.serve())
    while not userver.started:
        assert not serving.done(), serving.exception()
        await asyncio.sleep(0.05)
    yield server, client
    userver.should_exit = True
    await serving


def _kill_session_sandbox(server: SandpoolSweResourcesServer, sandbox_id: str) -> None:
    [session] = [s for s in server.sessions.active() if s.lease.id == sandbox_id]
    server.pool.backend.kill(session.lease.sandbox)


async def test_killed_sandbox_mid_episode_is_a_failed_rollout(live, calc_task: Task) -> None:
    server, client = live
    ep = SimpleAgentEpisode(client, MAIN, row_for(calc_task))
    seeded = await ep.seed()
    await ep.tool("write_file", path="calc.py", content="def add(a, b):\n    return a + b\n")
    _kill_session_sandbox(server, seeded["sandbox_id"])
    status, body = await ep.tool("shell", command="true")
    assert status == 503 and body["outcome"] == "infra_failed" and body["kind"] == "sandbox_died"
    with pytest.raises(ClientResponseError) as info:  # NeMo Gym's agent raises: no reward recorded
        await ep.verify()
    assert info.value.status == 503 and b"sandbox_died" in info.value.response_content
    assert server.pool.counters.infra_errors.get("sandbox_died", 0) >= 1


async def test_sandbox_killed_before_verify_is_not_scored(live, calc_task: Task) -> None:
    server, client = live
    ep = SimpleAgentEpisode(client, MAIN, row_for(calc_task))
    seeded = await ep.seed()
    _kill_session_sandbox(server, seeded["sandbox_id"])
    with pytest.raises(ClientResponseError) as info:
        await ep.verify()
    assert info.value.status == 503
    body = json.loads(info.value.response_content)
    assert body["outcome"] == "infra_failed" and "reward" not in body


async def test_pool_recovers_after_a_killed_sandbox(live, calc_task: Task) -> None:
    server, client = live
    ep = SimpleAgentEpisode(client, MAIN, row_for(calc_task))
    seeded = await ep.seed()
    _kill_session_sandbox(server, seeded["sandbox_id"])
    await ep.tool("shell", command="true")
    again = SimpleAgentEpisode(client, MAIN, row_for(calc_task))
    fresh = await again.seed()
    assert fresh["sandbox_id"] != seeded["sandbox_id"]
    await again.tool("write_file", path="/tmp/p", content=calc_task.patch)
    await again.tool("shell", command="git apply /tmp/p")
    assert (await again.verify())["reward"] == 1.0
