"""Oracle and noop episodes on real task-pack tasks, through the server ``ng_run`` started."""

from __future__ import annotations

import pytest

from sandpool.core.task import Task
from tests.nemo_gym.conftest import MAIN, SimpleAgentEpisode, row_for


@pytest.mark.parametrize("which", [0, 1])
async def test_oracle_episode_on_a_pack_task_gets_reward_1(server_client, pack_tasks: list[Task],
                                                           which: int) -> None:
    task = pack_tasks[which]
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(task))
    await ep.seed()
    status, _ = await ep.tool("write_file", path="/tmp/gold.patch", content=task.patch)
    assert status == 200
    status, body = await ep.tool("shell", command="git apply /tmp/gold.patch")
    assert status == 200 and body["exit_code"] == 0, body
    result = await ep.verify()
    assert result["reward"] == 1.0, result


@pytest.mark.parametrize("which", [0, 1])
async def test_noop_episode_on_a_pack_task_gets_reward_0(server_client, pack_tasks: list[Task],
                                                         which: int) -> None:
    task = pack_tasks[which]
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(task))
    await ep.seed()
    status, body = await ep.tool("shell", command="git status --porcelain")
    assert status == 200 and body["stdout"] == ""
    result = await ep.verify()
    assert result["reward"] == 0.0 and result["f2p_failed"] >= 1, result
