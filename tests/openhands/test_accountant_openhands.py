"""One event, one outcome: OpenHands, an adapter of the rollout accountant, driven through the
events of ``tests/accountant_cases.py`` gives the one outcome table, on both routes:

* the agent loop on the host, its ``terminal`` tool in the sandbox (``openhands_episode``
  under ``run_rollout``), the LLM OpenHands' own scripted ``TestLLM``;
* the agent-server inside the sandbox (``SandpoolWorkspace``), its LLM a scripted litellm
  provider loaded into the server.

A command whose observation shows the kill mark has its sandbox killed from the host.
"""

from __future__ import annotations

import asyncio

from openhands.sdk import Conversation
from openhands.sdk.event import ObservationEvent
from openhands.sdk.testing import TestLLM

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.pool import PoolLimits, SandboxPool
from sandpool.core.rollout import run_rollout
from sandpool.envs.scoring import default_grader
from sandpool.integrations.openhands import openhands_episode
from sandpool.integrations.openhands.server import agent_server_env, agent_server_service
from sandpool.integrations.openhands.workspace import SandpoolWorkspace
from tests.accountant_cases import KILL_MARK, Case, cases, expected, show
from tests.openhands.conftest import say, tool_call
from tests.openhands.test_agent_server import SERVER_MODULES, scripted_agent
from tests.waiting import wait_until


async def test_the_openhands_host_loop_gives_the_one_outcome_table(pool, local_backend, calc_task):
    all_cases = cases(calc_task)
    got = {}
    for case in all_cases:
        leases = []

        def make_llm(lease, case: Case = case):  # type: ignore[no-untyped-def]
            leases.append(lease)
            return TestLLM.from_messages([*(tool_call("terminal", command=c) for c in case.commands),
                                          say("done")])

        def kill_on_mark(event) -> None:  # type: ignore[no-untyped-def]
            if isinstance(event, ObservationEvent) and KILL_MARK in event.observation.text:
                local_backend.kill(leases[-1].sandbox)
                wait_until(lambda: not leases[-1].sandbox.alive(), "the killed sandbox's channel to close")

        episode = openhands_episode(make_llm, callbacks=[kill_on_mark])
        r = await run_rollout(pool, case.task, episode, grader=default_grader(120), retries=0)
        got[case.name] = (r.outcome.value, r.reward, r.error_kind)
    show("OpenHands host loop (openhands_episode, terminal tool)", got)
    assert got == expected(all_cases)


def _workspace_episode(pool: SandboxPool, case: Case) -> tuple[str, float | None, str | None]:
    steps = [{"tool": "terminal", "arguments": {"command": f"cd {case.task.workdir} && {c}"}}
             for c in case.commands] + [{"text": "done"}]
    recorded = []
    try:
        with SandpoolWorkspace(pool, case.task, grader=default_grader(120), on_result=recorded.append) as ws:
            def kill_on_mark(event) -> None:  # type: ignore[no-untyped-def]
                if isinstance(event, ObservationEvent) and KILL_MARK in event.observation.text:
                    sandbox = ws.lease.sandbox
                    pool.backend.kill(sandbox)
                    wait_until(lambda: not sandbox.alive(), "the killed sandbox's channel to close")

            conv = Conversation(agent=scripted_agent(steps), workspace=ws, visualizer=None,
                                callbacks=[kill_on_mark])
            try:
                conv.send_message("Fix the bug.")
                conv.run()
            finally:
                conv.close()
            ws.finish()
    except errors.SandpoolError:
        pass  # the claim failed, or the conversation lost its sandbox: recorded as it ended
    [r] = recorded
    return r.outcome.value, r.reward, r.error_kind


async def test_the_openhands_agent_server_workspace_gives_the_one_outcome_table(test_images_root, calc_task):
    service = agent_server_service(agent_server_env(), preload=("sandpool_scripted_llm",),
                                   python_path=(str(SERVER_MODULES),))
    backend = LocalBackend(test_images_root, service=service)
    all_cases = cases(calc_task)
    async with SandboxPool(backend, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        got = {case.name: await asyncio.to_thread(_workspace_episode, pool, case) for case in all_cases}
    show("OpenHands agent-server (SandpoolWorkspace)", got)
    assert got == expected(all_cases)
