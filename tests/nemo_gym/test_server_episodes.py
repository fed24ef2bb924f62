"""Full episodes against the sandpool_swe server started by ``ng_run``, driven over HTTP."""

from __future__ import annotations

import asyncio
import errno

import pytest
from aiohttp import ClientResponseError

from sandpool.core.task import Task
from tests.nemo_gym.conftest import (
    MAIN,
    SHORT_IDLE,
    SHORT_IDLE_S,
    SimpleAgentEpisode,
    row_for,
    verify_failed_rollout,
)


async def _status(client, server: str) -> dict:
    res = await client.get(server_name=server, url_path="/pool_status")
    return await res.json()


async def test_oracle_episode_gets_reward_1(server_client, calc_task: Task) -> None:
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(calc_task))
    seeded = await ep.seed()
    assert seeded["instance_id"] == calc_task.instance_id and seeded["workdir"] == "/testbed"
    status, body = await ep.tool("write_file", path="/tmp/gold.patch", content=calc_task.patch)
    assert status == 200 and body["bytes_written"] == len(calc_task.patch.encode())
    status, body = await ep.tool("shell", command="git apply /tmp/gold.patch && git diff --stat")
    assert status == 200 and body["exit_code"] == 0, body
    status, body = await ep.tool("read_file", path="calc.py")
    assert status == 200 and "a + b" in body["content"]
    result = await ep.verify()
    assert result["reward"] == 1.0 and result["resolved"] is True
    assert result["f2p_passed"] == 1 and result["p2p_passed"] == 1
    assert result["sandbox_id"] == seeded["sandbox_id"]


async def test_noop_episode_gets_reward_0(server_client, calc_task: Task) -> None:
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(calc_task))
    await ep.seed()
    status, body = await ep.tool("shell", command="git status --porcelain")
    assert status == 200 and body["exit_code"] == 0 and body["stdout"] == ""
    result = await ep.verify()
    assert result["reward"] == 0.0 and result["resolved"] is False
    assert result["f2p_failed"] == 1 and result["p2p_passed"] == 1


async def test_reused_sandbox_starts_pristine_after_an_oracle_episode(server_client, calc_task: Task) -> None:
    # concurrency=2 and strategy reuse: these episodes run on sandboxes earlier ones used.
    for _ in range(3):
        ep = SimpleAgentEpisode(server_client, MAIN, row_for(calc_task))
        await ep.seed()
        status, body = await ep.tool("shell", command="git status --porcelain; cat calc.py; ls /tmp")
        assert status == 200 and "a - b" in body["stdout"] and "gold.patch" not in body["stdout"]
        await ep.tool("write_file", path="calc.py", content="def add(a, b):\n    return a + b\n")
        assert (await ep.verify())["reward"] == 1.0
    stats = await _status(server_client, MAIN)
    assert stats["resets"] >= 1 and stats["quarantines"] == 0


async def test_concurrent_sessions_get_separate_sandboxes(server_client, calc_task: Task) -> None:
    eps = [SimpleAgentEpisode(server_client, MAIN, row_for(calc_task)) for _ in range(2)]
    seeded = await asyncio.gather(*(ep.seed() for ep in eps))
    assert seeded[0]["sandbox_id"] != seeded[1]["sandbox_id"]
    # A write in one session is invisible in the other.
    await eps[0].tool("write_file", path="marker.txt", content="session 0")
    status, body = await eps[1].tool("read_file", path="marker.txt")
    assert status == 404, body
    await eps[0].tool("write_file", path="calc.py", content="def add(a, b):\n    return a + b\n")
    rewards = [r["reward"] for r in await asyncio.gather(*(ep.verify() for ep in eps))]
    assert rewards == [1.0, 0.0]


async def test_policy_errors_are_tool_results_not_failures(server_client, calc_task: Task) -> None:
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(calc_task))
    await ep.seed()
    status, body = await ep.tool("shell", command="echo out; echo err >&2; exit 3")
    assert status == 200 and (body["exit_code"], body["stdout"], body["stderr"]) == (3, "out\n", "err\n")
    status, body = await ep.tool("shell", command="sleep 30", timeout_s=1)
    assert status == 200 and body["timed_out"] and body["exit_code"] == 124
    status, body = await ep.tool("read_file", path="no/such/file")
    assert status == 404
    assert (await ep.verify())["reward"] == 0.0


async def test_file_errors_of_the_policy_are_tool_results_and_the_episode_goes_on(server_client, calc_task: Task) -> None:
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(calc_task))
    seeded = await ep.seed()
    for path in ("/usr/x", "/etc/foo"):  # read-only root: EROFS or EACCES, the policy's doing
        status, body = await ep.tool("write_file", path=path, content="x")
        assert status == 400 and body["outcome"] == "policy_error" and body["kind"] == "file_error", body
        assert body["errno"] in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT), body
    status, body = await ep.tool("read_file", path=".")  # a directory
    assert status == 400 and body["errno"] == errno.EISDIR, body
    await ep.tool("write_file", path="calc.py", content="def add(a, b):\n    return a + b\n")
    result = await ep.verify()  # the same sandbox, still leased: graded, not failed
    assert result["reward"] == 1.0 and result["sandbox_id"] == seeded["sandbox_id"]


async def test_tool_call_without_seed_is_rejected(server_client) -> None:
    ep = SimpleAgentEpisode(server_client, MAIN, {"instance_id": "x", "responses_create_params": {"input": ""}})
    status, body = await ep.tool("shell", command="true")
    assert status == 409 and body["kind"] == "unknown_session"


async def test_unknown_task_fails_the_seed_naming_the_id(server_client) -> None:
    ep = SimpleAgentEpisode(server_client, MAIN, {"instance_id": "nope__nope-1",
                                                 "responses_create_params": {"input": ""}})
    with pytest.raises(ClientResponseError) as info:
        await ep.seed()
    assert info.value.status == 422 and b"nope__nope-1" in info.value.response_content


async def test_abandoned_session_is_reclaimed_after_idle_timeout(server_client, calc_task: Task) -> None:
    before = (await _status(server_client, SHORT_IDLE))["sessions"]["reclaimed"]
    ep = SimpleAgentEpisode(server_client, SHORT_IDLE, row_for(calc_task))
    await ep.seed()
    await ep.tool("write_file", path="calc.py", content="def add(a, b):\n    return a + b\n")
    stats = await _status(server_client, SHORT_IDLE)
    deadline = asyncio.get_running_loop().time() + 30 * SHORT_IDLE_S
    while stats["sessions"]["reclaimed"] == before:  # the reaper's own count is the event
        assert asyncio.get_running_loop().time() < deadline, stats
        await asyncio.sleep(0.2)
        stats = await _status(server_client, SHORT_IDLE)
    assert stats["sessions"]["reclaimed"] == before + 1 and stats["sessions"]["active"] == 0
    status, body = await ep.tool("shell", command="true")
    assert status == 503 and body["kind"] == "session_expired"
    body = await verify_failed_rollout(ep)  # a failed rollout, not a reward
    assert body["kind"] == "session_expired"
    # The reclaimed sandbox went back to the pool, reset: a new session finds it pristine.
    ep2 = SimpleAgentEpisode(server_client, SHORT_IDLE, row_for(calc_task))
    await ep2.seed()
    status, body = await ep2.tool("read_file", path="calc.py")
    assert "a - b" in body["content"]
    assert (await ep2.verify())["reward"] == 0.0


async def test_metrics_endpoint_counts_the_servers_claims_and_rollouts(server_client, calc_task: Task) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async def scrape() -> dict[str, float]:
        res = await server_client.get(server_name=MAIN, url_path="/metrics")
        assert res.status == 200
        out: dict[str, float] = {}
        for family in text_string_to_metric_families((await res.read()).decode()):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    before, status = await scrape(), await _status(server_client, MAIN)
    assert before["sandpool_claims_total"] == status["claims"]
    ep = SimpleAgentEpisode(server_client, MAIN, row_for(calc_task))
    await ep.seed()
    await ep.verify()
    after, status = await scrape(), await _status(server_client, MAIN)
    assert after["sandpool_claims_total"] == before["sandpool_claims_total"] + 1 == status["claims"]
    assert after["sandpool_ttfc_seconds_count"] == before["sandpool_ttfc_seconds_count"] + 1
    assert after["sandpool_sandbox_creations_total"] == status["created"]
    assert after["sandpool_rollouts_total"] == before.get("sandpool_rollouts_total", 0) + 1
