"""One event, one outcome: the sandpool_swe server, an adapter of the rollout accountant, driven
over HTTP through the events of ``tests/accountant_cases.py`` gives the one outcome table.

The server runs in this process (the ``live`` fixture), so a case can kill its sandbox from
the host; each episode goes over HTTP as NeMo Gym's agents drive it. The outcome is read from
what NeMo Gym sees: the ``/verify`` answer (a reward, or a scored failure), or the failed
rollout's answer (``503`` infra, ``422`` rejected on 0.4; the masked ``200`` on 0.7).
"""

from __future__ import annotations

import json

from aiohttp import ClientResponseError

from sandpool.core.task import Task
from sandpool.integrations.nemo_gym.server import MASKS_FAILED_VERIFY, SandpoolSweResourcesServer
from tests.accountant_cases import KILL_MARK, Case, cases, expected, inline_row, show
from tests.nemo_gym.conftest import MAIN, SimpleAgentEpisode
from tests.waiting import until


def _seen(body: dict) -> tuple[str, float | None, str | None]:
    """The outcome a NeMo Gym answer carries: a graded reward, or the named failure."""
    outcome = body.get("outcome", "completed")
    reward = body.get("reward") if outcome in ("completed", "task_failed") else None
    return outcome if outcome != "bad_input" else "rejected", reward, body.get("kind")


async def _episode(server: SandpoolSweResourcesServer, client, case: Case) -> tuple[str, float | None, str | None]:
    ep = SimpleAgentEpisode(client, MAIN, inline_row(case.task))
    try:
        seeded = await ep.seed()
    except ClientResponseError as exc:  # the seed failed: a failed rollout, never a reward
        return _seen(json.loads(exc.response_content))
    for command in case.commands:
        status, body = await ep.tool("shell", command=command)
        if status != 200:  # the rollout ended; /verify says how
            break
        if KILL_MARK in body["stdout"]:
            [session] = [s for s in server.sessions.active() if s.lease.id == seeded["sandbox_id"]]
            sandbox = session.lease.sandbox
            server.pool.backend.kill(sandbox)
            await until(lambda: not sandbox.alive(), "the killed sandbox's channel to close")
    try:
        body = await ep.verify()
    except ClientResponseError as exc:  # NeMo Gym 0.4: a failed rollout raises
        assert not MASKS_FAILED_VERIFY
        body = json.loads(exc.response_content)
    if MASKS_FAILED_VERIFY and body.get("mask_sample"):
        assert body.get("reward") == 0.0 and body["outcome"] in ("infra_failed", "rejected")
    return _seen(body)


async def test_the_nemo_gym_server_gives_the_one_outcome_table(live, calc_task: Task) -> None:
    server, client = live
    all_cases = cases(calc_task)
    got = {case.name: await _episode(server, client, case) for case in all_cases}
    show("NeMo Gym (sandpool_swe server)", got)
    assert got == expected(all_cases)
