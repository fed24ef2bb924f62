"""The OpenHands agent loop on the host, its terminal and file-editor tools in real sandboxes."""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import tempfile

import pytest
from openhands.sdk.event import AgentErrorEvent, ObservationEvent
from openhands.sdk.testing import TestLLM
from openhands.sdk.tool import Tool, ToolExecutor
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool

from sandpool.core import errors
from sandpool.core.metrics import Outcome
from sandpool.core.rollout import run_rollout
from sandpool.core.task import Task
from sandpool.envs.scoring import default_grader
from sandpool.integrations.openhands import SandboxLink, openhands_episode, run_conversation
from tests.openhands.conftest import say, tool_call


class NeverRuns(ToolExecutor):
    """The executor of a reference tool built only to read its definition: unlike OpenHands'
    own ``TerminalExecutor`` it starts no shell on the host, and it is never called."""

    def __call__(self, action, conversation=None):  # type: ignore[no-untyped-def]
        raise AssertionError("a reference tool ran")


class RecordingLLM(TestLLM):
    """OpenHands' TestLLM that also keeps the tool schemas each completion was offered."""

    __test__ = False

    def completion(self, messages, tools=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.__dict__.setdefault("_offered", []).append([t.to_openai_tool() for t in tools or []])
        return super().completion(messages, tools, *args, **kwargs)


def gold_patch_script(task: Task) -> list:
    return [
        tool_call("file_editor", command="create", path="/tmp/gold.patch", file_text=task.patch),
        tool_call("terminal", command="git apply /tmp/gold.patch && git diff --stat"),
        say("Applied the fix."),
    ]


async def test_conversation_that_applies_the_gold_patch_scores_one(pool, calc_task):
    llm = TestLLM.from_messages(gold_patch_script(calc_task))
    result = await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm), retries=0, grader=default_grader())
    assert result.outcome is Outcome.COMPLETED, result.error
    assert result.reward == 1.0
    assert llm.remaining_responses == 0
    assert result.ttfc_s is not None


async def test_conversation_that_does_nothing_scores_zero(pool, calc_task):
    llm = TestLLM.from_messages([say("I cannot fix this.")])
    result = await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm), retries=0, grader=default_grader())
    assert result.outcome is Outcome.COMPLETED
    assert result.reward == 0.0


async def test_llm_sees_openhands_own_tool_names_and_schemas(pool, calc_task):
    llm = RecordingLLM.from_messages([say("done")])
    async with pool.claim(calc_task) as lease:
        await run_conversation(lease, llm)
    offered = {t["function"]["name"]: t["function"] for t in llm.__dict__["_offered"][0]}
    assert {"terminal", "file_editor"} <= set(offered)
    # The same tools as OpenHands builds them for a local workspace, parameters included.
    from openhands.sdk import Agent, Conversation

    with tempfile.TemporaryDirectory() as d:
        conv = Conversation(agent=Agent(llm=TestLLM.from_messages([])), workspace=d, visualizer=None)
        try:
            own = {t.name: t.to_openai_tool()["function"]
                   for t in [*TerminalTool.create(conv.state, executor=NeverRuns()),
                             *FileEditorTool.create(conv.state)]}
        finally:
            conv.close()
    for name in ("terminal", "file_editor"):
        assert offered[name]["parameters"] == own[name]["parameters"]
    assert offered["terminal"]["description"] == own["terminal"]["description"]
    # The editor's description names the sandbox's repo, not the host-side scratch directory.
    assert f"working directory is: {calc_task.workdir}" in offered["file_editor"]["description"]


async def test_tools_act_in_the_sandbox_and_host_cwd_is_scratch(pool, calc_task):
    seen: list[ObservationEvent] = []
    script = [
        tool_call("terminal", command="cd /testbed && export FOO=bar && pwd && hostname"),
        tool_call("terminal", command="echo $FOO; pwd; cat /proc/1/cmdline | tr '\\0' ' '"),
        tool_call("file_editor", command="str_replace", path="/testbed/calc.py",
                  old_str="return a - b", new_str="return a + b"),
        tool_call("file_editor", command="view", path="/testbed/calc.py"),
        tool_call("file_editor", command="undo_edit", path="/testbed/calc.py"),
        tool_call("file_editor", command="create", path="/testbed/calc.py", file_text="x"),
        tool_call("terminal", command="sleep 5", timeout=1),
        say("done"),
    ]
    def on_event(event):  # type: ignore[no-untyped-def]
        if isinstance(event, ObservationEvent):
            seen.append(event)

    async with pool.claim(calc_task) as lease:
        before = await lease.read_file("calc.py")
        res = await run_conversation(lease, TestLLM.from_messages(script), callbacks=[on_event])
        after = await lease.read_file("calc.py")
    assert res.status == "finished" and res.tool_calls == 7
    texts = [e.observation.text for e in seen]
    assert "/testbed" in texts[0] and "sandbox" in texts[0]  # the sandbox's hostname
    assert texts[1].startswith("bar\n/testbed\n")  # cwd and exports carry over
    assert seen[1].observation.metadata.working_dir == "/testbed"
    assert "has been edited" in texts[2] and "return a + b" in texts[3]
    assert "undone successfully" in texts[4]
    assert seen[5].observation.is_error and "already exists" in texts[5]
    assert seen[6].observation.timeout and seen[6].observation.exit_code == 124
    assert before == after  # undo restored the buggy line
    assert res.host_workdir.startswith(tempfile.gettempdir()) and res.host_workdir != lease.workdir
    assert not os.path.exists(res.host_workdir)  # the scratch directory is removed after


async def test_no_policy_command_reaches_a_host_shell(pool, calc_task, tmp_path):
    marker = tmp_path / "reached-the-host"  # a host path: the sandbox's /tmp is its own
    cmd = f"touch {marker} 2>/dev/null || echo not-on-the-host"
    # OpenHands maps legacy and unknown tool names onto the terminal it was given: ours.
    names = ["execute_bash", "bash", "host_shell", "terminal"]
    script = [*(tool_call(name, command=cmd) for name in names), say("done")]
    seen: list = []
    async with pool.claim(calc_task) as lease:
        res = await run_conversation(lease, TestLLM.from_messages(script), callbacks=[seen.append])
    assert res.status == "finished" and not marker.exists()
    ran = [e.observation.text for e in seen if isinstance(e, ObservationEvent)]
    refused = [e.error for e in seen if isinstance(e, AgentErrorEvent)]
    assert len(ran) + len(refused) == len(names) and ran, (ran, refused)
    assert all("not-on-the-host" in text for text in ran), ran
    # OpenHands' host terminal would have started a shell in the conversation's scratch dir.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert res.host_workdir not in ps


@pytest.mark.parametrize("kwargs", [{"tools": [Tool(name="terminal")]},
                                    {"mcp_config": {"mcpServers": {"fetch": {"command": "uvx"}}}}])
async def test_agent_kwargs_that_would_add_host_tools_are_refused(pool, calc_task, kwargs):
    async with pool.claim(calc_task) as lease:
        with pytest.raises(errors.ConfigError, match=next(iter(kwargs))):
            await run_conversation(lease, TestLLM.from_messages([say("done")]), agent_kwargs=kwargs)


def test_an_agent_with_openhands_own_host_tool_is_refused_before_it_runs(tmp_path):
    from openhands.sdk import Agent, Conversation

    from sandpool.integrations.openhands.conversation import _sandbox_tools_only

    # OpenHands' own file editor edits host files (its terminal would be a host shell).
    agent = Agent(llm=TestLLM.from_messages([]), tools=[Tool(name=FileEditorTool.name)])
    conv = Conversation(agent=agent, workspace=str(tmp_path), visualizer=None)
    try:
        conv.send_message("hi")  # makes the agent's tools
        with pytest.raises(errors.ConfigError, match="'file_editor'.*act on the host"):
            _sandbox_tools_only(conv.agent)
    finally:
        conv.close()


async def test_sandbox_killed_mid_conversation_is_infra_not_reward_zero(pool, local_backend, calc_task):
    leases = []

    def make_llm(lease):  # type: ignore[no-untyped-def]
        leases.append(lease)
        return TestLLM.from_messages([tool_call("terminal", command="echo one"),
                                      tool_call("terminal", command="echo two"),
                                      say("done")])

    def kill_after_first_observation(event):  # type: ignore[no-untyped-def]
        if isinstance(event, ObservationEvent) and event.observation.text.startswith("one"):
            local_backend.kill(leases[-1].sandbox)

    episode = openhands_episode(make_llm, callbacks=[kill_after_first_observation])
    result = await run_rollout(pool, calc_task, episode, retries=0, grader=default_grader())
    assert result.outcome is Outcome.INFRA_FAILED
    assert result.reward is None
    assert result.error_kind in {"sandbox_died", "exec_transport"}


async def test_concurrent_conversations_get_separate_sandboxes(pool, calc_task):
    ids: dict[str, str] = {}
    outputs: dict[str, str] = {}

    async def one(name: str) -> None:
        def on_event(event):  # type: ignore[no-untyped-def]
            if isinstance(event, ObservationEvent) and "owner=" in event.observation.text:
                outputs[name] = event.observation.text

        script = [tool_call("terminal", command=f"echo {name} >> /testbed/owner.txt"),
                  tool_call("terminal", command="echo owner=$(cat /testbed/owner.txt | tr '\\n' ,)"),
                  say("done")]
        async with pool.claim(calc_task) as lease:
            ids[name] = lease.id
            await run_conversation(lease, TestLLM.from_messages(script), callbacks=[on_event])

    await asyncio.gather(one("alpha"), one("beta"))
    assert ids["alpha"] != ids["beta"]
    assert outputs["alpha"].startswith("owner=alpha,") and outputs["beta"].startswith("owner=beta,")


async def test_nothing_is_left_running_after_close(local_backend, calc_task):
    from sandpool.core.pool import SandboxPool

    run_id = local_backend.run_id
    async with SandboxPool(local_backend, strategy="reuse") as pool:
        llm = TestLLM.from_messages(gold_patch_script(calc_task))
        await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm), retries=0, grader=default_grader())
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"sb-{run_id}-" not in ps and run_id not in ps
    assert not SandboxLink._links
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "sandpool-openhands-*"))


async def test_llm_endpoint_failure_is_infra_not_reward_zero(pool, calc_task):
    from openhands.sdk.llm.exceptions import LLMServiceUnavailableError

    llm = TestLLM(model="test-model", scripted_responses=[tool_call("terminal", command="echo hi"),
                                  LLMServiceUnavailableError("the inference server is down")])
    result = await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm), retries=0, grader=default_grader())
    assert result.outcome is Outcome.INFRA_FAILED and result.reward is None


async def test_a_prompt_past_the_context_window_is_the_policys_failure_scored_zero(pool, calc_task):
    # A policy that floods its own context (cat of huge files) must not turn its reward 0
    # into an unscored, retried infra failure.
    from openhands.sdk.llm.exceptions import LLMContextWindowExceedError

    llm = TestLLM(model="test-model", scripted_responses=[tool_call("terminal", command="echo hi"),
                                  LLMContextWindowExceedError("prompt is 2000000 tokens, the window 128000")])
    result = await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm), retries=0, grader=default_grader())
    assert result.outcome is Outcome.TASK_FAILED and result.reward == 0.0, result
    assert result.error_kind == "context_window_exceeded", result.error


async def test_file_editor_on_a_fifo_is_the_policys_error_not_infra(pool, calc_task):
    # A FIFO nobody writes: reading it would block until the host's wait gave up and the
    # rollout ended infra_failed, a failure the policy could choose instead of its reward 0.
    seen: list[ObservationEvent] = []
    llm = TestLLM.from_messages([tool_call("terminal", command="mkfifo /tmp/pipe"),
                                 tool_call("file_editor", command="view", path="/tmp/pipe"),
                                 say("done")])
    result = await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm, callbacks=[seen.append]),
                               retries=0, grader=default_grader())
    assert result.outcome is Outcome.COMPLETED and result.reward == 0.0, result.error
    view = [e for e in seen if isinstance(e, ObservationEvent)][1].observation
    assert view.is_error and "(EINVAL)" in view.text, view.text


async def test_a_timeout_the_llm_sets_is_capped_so_a_command_cannot_hold_the_rollout(pool, calc_task):
    # The action's timeout is the LLM's to set: uncapped, `sleep infinity` with timeout=1e9
    # would hold this rollout, and the synchronous batch waiting for it, forever.
    seen: list[ObservationEvent] = []
    llm = TestLLM.from_messages([tool_call("terminal", command="sleep 30", timeout=1e9), say("done")])
    async with pool.claim(calc_task) as lease:
        await run_conversation(lease, llm, max_command_timeout=2, callbacks=[seen.append])
    obs = [e for e in seen if isinstance(e, ObservationEvent)][0].observation
    assert obs.timeout and "timed out after 2 s" in obs.text, obs.text


async def test_file_editor_refuses_a_file_over_openhands_size_limit(pool, calc_task):
    # A sparse file costs no quota: read whole, it crossed the channel and reached the LLM as
    # one observation of that size (OpenHands' own editor refuses it).
    seen: list[ObservationEvent] = []
    llm = TestLLM.from_messages([tool_call("terminal", command="truncate -s 64M /tmp/big"),
                                 tool_call("file_editor", command="view", path="/tmp/big"), say("done")])
    async with pool.claim(calc_task) as lease:
        await run_conversation(lease, llm, callbacks=[seen.append])
    view = [e for e in seen if isinstance(e, ObservationEvent)][1].observation
    assert view.is_error and "File is too large (64.0MB)" in view.text, view.text[:300]


@pytest.mark.parametrize("tool, arguments", [
    ("file_editor", {"command": "create", "path": "/tmp/new.py", "file_text": "x = '\ud800'\n"}),
    ("file_editor", {"command": "str_replace", "path": "/testbed/calc.py", "old_str": "def add",
                     "new_str": "def \ud800"}),
    ("terminal", {"command": "echo \udcff"}),
], ids=["create", "str_replace", "terminal"])
async def test_llm_output_no_utf8_can_hold_is_the_policys_failure_not_infra(pool, calc_task, tool, arguments):
    # JSON's "\ud800" decodes to a lone surrogate, which OpenHands cannot record as an event:
    # its loop stops. As infra (an error sandpool does not know), the rollout was unscored
    # and retried, a failure the policy could choose instead of its reward 0.
    llm = TestLLM.from_messages([tool_call(tool, **arguments), say("done")])
    result = await run_rollout(pool, calc_task, openhands_episode(lambda lease: llm), retries=0,
                               grader=default_grader())
    assert (result.outcome, result.reward, result.error_kind) == (Outcome.TASK_FAILED, 0.0, "task"), result
    assert "UTF-8 cannot encode" in result.error


async def test_a_first_message_no_utf8_can_hold_is_the_inputs_error(pool, calc_task):
    llm = TestLLM.from_messages([say("done")])
    async with pool.claim(calc_task) as lease:
        with pytest.raises(errors.InputError, match="first message cannot be encoded"):
            await run_conversation(lease, llm, "fix \udcff")
