"""OpenHands' agent-server inside real sandboxes: ``Conversation(agent, SandpoolWorkspace(pool, task))``.

The server runs from the read-only agent-server env in each sandbox, started while the pool
warms; the LLM is a scripted litellm provider loaded into the server process
(``server_modules/sandpool_scripted_llm.py``), so no test calls a real model.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import pytest
from openhands.sdk import LLM, Agent, Conversation
from openhands.sdk.tool import Tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.pool import PoolLimits, SandboxPool
from sandpool.core.task import Task
from sandpool.integrations.openhands.server import agent_server_env, agent_server_service
from sandpool.integrations.openhands.workspace import SandpoolWorkspace

SERVER_MODULES = Path(__file__).with_name("server_modules")


def scripted_agent(steps: list[dict]) -> Agent:
    llm = LLM(model="sandpool_scripted/test", usage_id="agent", native_tool_calling=True,
              litellm_extra_body={"sandpool_script": steps}, input_cost_per_token=0.0,
              output_cost_per_token=0.0)
    return Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)])


def gold_steps(task: Task) -> list[dict]:
    return [{"tool": "file_editor", "arguments": {"command": "create", "path": "/tmp/gold.patch",
                                                  "file_text": task.patch}},
            {"tool": "terminal", "arguments": {"command": f"cd {task.workdir} && git apply /tmp/gold.patch"}},
            {"text": "Applied the fix."}]


@pytest.fixture(scope="module")
def server_env() -> Path:
    return agent_server_env()


@pytest.fixture(scope="module")
async def server_pool(test_images_root, calc_commits, calc_task, server_env):
    service = agent_server_service(server_env, preload=("sandpool_scripted_llm",),
                                   python_path=(str(SERVER_MODULES),))
    backend = LocalBackend(test_images_root, service=service)
    # A server takes seconds to start, and much longer on a loaded CI machine.
    async with SandboxPool(backend, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        t0 = time.monotonic()
        await pool.prepare([calc_task], concurrency=2, rollouts_per_task=2)
        pool.warm_s = time.monotonic() - t0  # type: ignore[attr-defined]
        yield pool


def run_episode(pool: SandboxPool, task: Task, steps: list[dict], on_workspace=None) -> float:
    """One OpenHands episode with unchanged OpenHands code, then sandpool's grader."""
    with SandpoolWorkspace(pool, task) as ws:
        if on_workspace is not None:
            on_workspace(ws)
        conv = Conversation(agent=scripted_agent(steps), workspace=ws, visualizer=None)
        try:
            conv.send_message(f"Fix the bug in {task.workdir}.")
            conv.run()
        finally:
            conv.close()
        result = ws.finish()
        assert result.reward is not None, result
        return result.reward


async def test_server_is_up_before_the_claim(server_pool, calc_task):
    assert server_pool.counters.created == 2, server_pool.counters  # both warm sandboxes started their server
    t0 = time.monotonic()

    def claim_and_ping() -> float:
        with SandpoolWorkspace(server_pool, calc_task) as ws:
            assert ws.alive  # /health through the relay
            assert ws.host.startswith("http://127.0.0.1:")
            res = ws.execute_command("pwd && hostname")
            assert res.exit_code == 0 and res.stdout.split() == ["/testbed", "sandbox"]
            return time.monotonic() - t0

    assert await asyncio.to_thread(claim_and_ping) < server_pool.warm_s  # no server start on claim


async def test_the_agent_s_terminal_runs_the_task_s_python_not_the_server_s(server_pool, calc_task):
    """What the policy's commands run is what the grader runs: the sandbox's PATH and venv."""
    probe = "command -v python; python -c 'import sys; print(sys.prefix)'"

    def both() -> tuple[str, str]:
        with SandpoolWorkspace(server_pool, calc_task) as ws:
            through_server = ws.execute_command(probe).stdout
            through_sandpool = ws._run(ws.lease.exec(probe, cwd=calc_task.workdir)).text
            return through_server, through_sandpool

    through_server, through_sandpool = await asyncio.to_thread(both)
    assert through_server.split() == through_sandpool.split()
    assert "agent-server" not in through_server


async def test_gold_patch_conversation_scores_one(server_pool, calc_task):
    reward = await asyncio.to_thread(run_episode, server_pool, calc_task, gold_steps(calc_task))
    assert reward == 1.0


async def test_conversation_that_does_nothing_scores_zero(server_pool, calc_task):
    reward = await asyncio.to_thread(run_episode, server_pool, calc_task, [{"text": "I give up."}])
    assert reward == 0.0


async def test_reset_keeps_the_server_and_the_next_rollout_starts_clean(server_pool, calc_task):
    assert await asyncio.to_thread(run_episode, server_pool, calc_task, gold_steps(calc_task)) == 1.0
    # The same warm sandboxes, reset in place: the fix is gone and the server still answers.
    assert await asyncio.to_thread(run_episode, server_pool, calc_task, [{"text": "noop"}]) == 0.0
    assert server_pool.counters.created == 2 and server_pool.counters.quarantines == 0


async def test_sandbox_killed_mid_conversation_is_infra(server_pool, calc_task):
    backend = server_pool.backend
    steps = [{"tool": "terminal", "arguments": {"command": "echo started"}},
             {"tool": "terminal", "arguments": {"command": "echo never"}},
             {"text": "done"}]

    def episode() -> None:
        def kill(ws: SandpoolWorkspace) -> None:
            backend.kill(ws.lease.sandbox)

        run_episode(server_pool, calc_task, steps, on_workspace=kill)

    with pytest.raises(errors.InfraError):
        await asyncio.to_thread(episode)


async def test_concurrent_workspaces_get_separate_sandboxes(server_pool, calc_task):
    both_hold_one = threading.Barrier(2, timeout=300)

    def one(name: str) -> tuple[str, str]:
        with SandpoolWorkspace(server_pool, calc_task) as ws:
            ws.execute_command(f"echo {name} >> owner.txt")
            both_hold_one.wait()  # both workspaces are open at once
            out = ws.execute_command("cat owner.txt").stdout
            return ws.lease.id, out

    (a_id, a_out), (b_id, b_out) = await asyncio.gather(asyncio.to_thread(one, "alpha"),
                                                        asyncio.to_thread(one, "beta"))
    assert a_id != b_id and a_out == "alpha\n" and b_out == "beta\n"


async def test_nothing_left_running_after_close(test_images_root, calc_commits, calc_task, server_env):
    backend = LocalBackend(test_images_root, service=agent_server_service(server_env))
    async with SandboxPool(backend, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        await pool.prepare([calc_task], concurrency=1)
        await asyncio.to_thread(lambda: SandpoolWorkspace(pool, calc_task).cleanup())
        before = {p: _cmdline(p) for sb in backend._live.values() for p in backend._cgroups.pids(sb.id)}
        assert len(before) >= 3  # bubblewrap's init, the agent, the agent-server
    left = {p: c for p, c in before.items() if _cmdline(p) == c}  # same pid, same process
    assert not left
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert backend.run_id not in ps


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return None
