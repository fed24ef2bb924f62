"""Session ids under concurrency, and NeMo Gym 0.7's typed seed and ``/close_session``.

The per-id lock tests drive the session table of a live server on real sandboxes. The
``/close_session`` tests follow the contract NeMo Gym 0.7 documents on
``SimpleResourcesServer.close_resources_session`` (and checks with its
``check_resources_session_contract``), over HTTP the way its Environment Server calls a
resources server: the typed seed sets the cookie that the tool calls, ``/verify`` and the
close carry. On 0.4, which has no such protocol, the route is absent.
"""

from __future__ import annotations

import asyncio
import uuid

from sandpool.core.task import Task
from sandpool.integrations.nemo_gym.server import ResourcesSeedSessionRequest
from sandpool.integrations.nemo_gym.sessions import SessionState
from tests.nemo_gym.conftest import MAIN, row_for

_RESPONSE = {"id": "resp_test", "created_at": 0, "model": "policy", "object": "response",
             "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


async def test_racing_seeds_on_one_session_id_claim_one_sandbox(live, calc_task: Task) -> None:
    server, _ = live
    claims = server.pool.counters.claims
    sid = f"race-{uuid.uuid4().hex}"
    a, b = await asyncio.gather(server.sessions.open(sid, calc_task), server.sessions.open(sid, calc_task))
    assert a is b and server.pool.counters.claims == claims + 1  # no second, leaked lease
    await server.sessions.close(sid)
    assert server.sessions.get(sid) is None


async def test_close_waits_for_the_request_in_flight_on_its_session(live, calc_task: Task) -> None:
    server, _ = live
    sid = f"inflight-{uuid.uuid4().hex}"
    await server.sessions.open(sid, calc_task)
    async with server.sessions.use(sid) as session:
        closing = asyncio.get_running_loop().create_task(server.sessions.close(sid))
        await asyncio.sleep(0)  # let the close run up to the session's lock
        res = await session.lease.exec("echo still mine", timeout=30)
        assert res.text == "still mine\n" and not closing.done()
        assert session.state is SessionState.ACTIVE
    await closing
    assert server.sessions.get(sid) is None


async def test_sessions_with_different_ids_do_not_wait_on_each_other(live, calc_task: Task) -> None:
    server, _ = live
    first = f"a-{uuid.uuid4().hex}"
    await server.sessions.open(first, calc_task)
    async with server.sessions.use(first):
        # With one table-wide lock, this close would wait for the block forever.
        await asyncio.wait_for(server.sessions.close(f"never-{uuid.uuid4().hex}"), timeout=30)
    await server.sessions.close(first)


async def _post(client, path: str, body: dict, cookies=None):
    res = await client.post(server_name=MAIN, url_path=path, json=body, cookies=cookies)
    return res.status, await res.json(), res.cookies


def _typed_seed(task: Task, sid: str) -> dict:
    return {"resources_session_id": sid, "episode_id": {"rollout_id": sid, "attempt": 0},
            "task_id": {"taskset": "sandpool:tests", "task_id": task.instance_id},
            "task_data": row_for(task)}


async def test_close_session_follows_nemo_gym_contract(live, calc_task: Task) -> None:
    server, client = live
    sid = f"resources-session-{uuid.uuid4().hex}"
    if ResourcesSeedSessionRequest is None:  # NeMo Gym 0.4: no typed sessions, no close route
        status, _, _ = await _post(client, "/close_session", {"resources_session_id": sid})
        assert status == 404
        return
    episode = {"rollout_id": sid, "attempt": 0}
    claims = server.pool.counters.claims
    for _attempt in ("seed", "repeated seed"):
        status, body, cookies = await _post(client, "/seed_session", _typed_seed(calc_task, sid))
        assert status == 200 and body == {"resources_session_id": sid, "resources_tools": None,
                                          "sandbox_access": None}
    assert server.pool.counters.claims == claims + 1 and server.sessions.get(sid) is not None
    for _attempt in ("close", "repeated close"):
        status, body, _ = await _post(client, "/close_session",
                                      {"resources_session_id": sid, "episode_id": episode}, cookies)
        assert (status, body) == (200, {"resources_session_id": sid})
    assert server.sessions.get(sid) is None  # the sandbox went back to the pool
    never = f"{sid}-never-seeded"
    status, _, _ = await _post(client, "/close_session", {"resources_session_id": never, "episode_id": episode})
    assert status == 200
    for late in (sid, never):  # a seed after its close must not create the session again
        status, body, _ = await _post(client, "/seed_session", _typed_seed(calc_task, late))
        assert status == 409 and body["kind"] == "session_closed"
    assert server.sessions.get(sid) is None and server.sessions.get(never) is None


async def test_typed_seed_episode_is_graded_through_its_cookie(live, calc_task: Task) -> None:
    _, client = live
    if ResourcesSeedSessionRequest is None:  # NeMo Gym 0.4 validates only dataset-row seeds
        status, body, _ = await _post(client, "/seed_session", _typed_seed(calc_task, "x"))
        assert status == 422
        return
    sid = f"resources-session-{uuid.uuid4().hex}"
    status, _, cookies = await _post(client, "/seed_session", _typed_seed(calc_task, sid))
    assert status == 200 and cookies
    status, body, cookies = await _post(client, "/write_file", {"path": "calc.py",
                                        "content": "def add(a, b):\n    return a + b\n"}, cookies)
    assert status == 200
    # As 0.7's single_agent_turn posts it: the row, responses_create_params and the response.
    status, body, _ = await _post(client, "/verify", row_for(calc_task) | {"response": _RESPONSE}, cookies)
    assert status == 200 and body["reward"] == 1.0 and body.get("mask_sample") is False
    status, _, _ = await _post(client, "/close_session", {"resources_session_id": sid,
                                                          "episode_id": {"rollout_id": sid}}, cookies)
    assert status == 200
