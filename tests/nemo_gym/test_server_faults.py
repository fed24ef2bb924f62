"""Infra faults in the sandpool_swe server: a killed sandbox is a failed rollout, never reward 0.

The server runs in this process (the ``live`` fixture), so the test can kill the sandbox under
a session with ``LocalBackend.kill``; episodes still go over HTTP. NeMo Gym 0.4 gets a ``503``
from ``/verify`` (its agent raises: a failed rollout); 0.7 gets its own masked-sample answer,
and 0.7's own reward profiler is asked whether the row is masked.
"""

from __future__ import annotations

from sandpool.core.task import Task
from sandpool.integrations.nemo_gym.server import SandpoolSweResourcesServer
from tests.nemo_gym.conftest import MAIN, SimpleAgentEpisode, row_for, verify_failed_rollout


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
    assert body["failure_kind"] == "session_lost"
    body = await verify_failed_rollout(ep)  # the fixed calc.py is never graded
    assert body["kind"] == "sandbox_died"
    assert server.pool.counters.infra_errors.get("sandbox_died", 0) >= 1


async def test_sandbox_killed_before_verify_is_not_scored(live, calc_task: Task) -> None:
    server, client = live
    ep = SimpleAgentEpisode(client, MAIN, row_for(calc_task))
    seeded = await ep.seed()
    await ep.tool("write_file", path="calc.py", content="def add(a, b):\n    return a + b\n")
    _kill_session_sandbox(server, seeded["sandbox_id"])
    body = await verify_failed_rollout(ep)
    assert body["outcome"] == "infra_failed" and body["kind"] == "sandbox_died"


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


async def test_a_task_that_cannot_be_graded_is_rejected_never_scored(live, calc_task: Task) -> None:
    import json

    import pytest
    from aiohttp import ClientResponseError

    from sandpool.integrations.nemo_gym.server import MASKS_FAILED_VERIFY

    _, client = live
    bad = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
    broken = calc_task.model_copy(update={"instance_id": "calc__broken-1", "test_patch": bad})
    ep = SimpleAgentEpisode(client, MAIN, row_for(broken) | {"task": json.loads(broken.model_dump_json())})
    await ep.seed()
    if not MASKS_FAILED_VERIFY:  # 0.4: the agent raises on the 422, no reward recorded
        with pytest.raises(ClientResponseError) as info:
            await ep.verify()
        assert info.value.status == 422 and b"calc__broken-1" in info.value.response_content
        return
    body = await ep.verify()  # 0.7: masked, and terminal so that resume does not retry it
    assert body["mask_sample"] is True and body["_ng_failure_terminal"] is True
    assert (body["outcome"], body["failure_kind"], body["kind"]) == ("rejected", "verifier_error", "broken_task")
