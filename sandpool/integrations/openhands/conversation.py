"""One OpenHands conversation on a leased sandbox, and the one-shot episode it makes.

The agent loop and its LLM calls stay on the host (how an RL trainer with a local inference
server runs OpenHands); the terminal and file-editor tools act in the sandbox
(:mod:`sandpool.integrations.openhands.tools`). The conversation's host-side working directory
is a fresh scratch directory, never the sandbox's path, so nothing OpenHands writes on the host
(skills lookup, persisted output) lands in or reads from the task repo.

:func:`openhands_episode` makes the conversation a one-shot episode for the rollout
accountant (:func:`sandpool.core.rollout.run_rollout`), which grades it and decides its end;
a sandbox that fails during the conversation raises its
:class:`~sandpool.core.errors.InfraError`, so the rollout ends ``infra_failed``, never with
reward 0.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openhands.sdk import LLM, Agent, Conversation
from openhands.sdk.event import Event, ObservationEvent
from openhands.sdk.llm.exceptions import LLMContextWindowExceedError
from pydantic_core import PydanticSerializationError

from sandpool.core import errors
from sandpool.core.pool import Lease
from sandpool.core.rollout import Episode
from sandpool.integrations.openhands.editor import SandboxFileEditorExecutor
from sandpool.integrations.openhands.tools import (
    SandboxLink,
    SandboxTerminalExecutor,
    sandbox_tool_specs,
)

__all__ = ["ConversationResult", "openhands_episode", "run_conversation",
           "task_instruction"]


@dataclass
class ConversationResult:
    """What one conversation did.

    Attributes:
        status: OpenHands' final ``execution_status`` value (``finished``, ``stuck``, ...).
        events: Every event of the conversation, in order.
        tool_calls: How many tool observations the sandbox produced.
        host_workdir: The conversation's host-side working directory (a scratch directory,
            removed when the conversation ends).
    """

    status: str
    host_workdir: str = ""
    events: list[Event] = field(default_factory=list)
    tool_calls: int = 0


def task_instruction(lease: Lease) -> str:
    """The first user message for a task: where the repo is and the problem statement."""
    return (f"The repository is at {lease.workdir} (the sandbox's working directory). Resolve this "
            f"issue by editing the code there; do not change the tests.\n\n"
            f"{lease.task.problem_statement}")


async def run_conversation(
    lease: Lease,
    llm: LLM,
    instruction: str | None = None,
    *,
    max_iterations: int = 50,
    command_timeout: float = 300.0,
    max_command_timeout: float = 3600.0,
    agent_kwargs: dict[str, Any] | None = None,
    callbacks: list[Callable[[Event], None]] | None = None,
) -> ConversationResult:
    """Run an OpenHands ``Agent`` with ``llm`` until it finishes, its tools in ``lease``.

    The conversation runs on a worker thread (OpenHands' loop is synchronous); every tool call
    comes back to this event loop to reach the sandbox.

    Args:
        lease: The claimed sandbox.
        llm: The OpenHands LLM (a real endpoint, or ``openhands.sdk.testing.TestLLM``).
        instruction: The first user message (default :func:`task_instruction`).
        max_iterations: OpenHands' ``max_iteration_per_run``.
        command_timeout: Seconds a terminal command may run when the LLM sets no timeout.
        max_command_timeout: Seconds a terminal command may run whatever timeout the LLM sets.
        agent_kwargs: Extra ``Agent`` fields (condenser, system prompt, ...); none that adds
            tools (``tools``, ``mcp_config``): every tool the LLM can call acts in the sandbox.
        callbacks: Extra conversation callbacks, called on OpenHands' thread with each event.

    Returns:
        The :class:`ConversationResult`.

    Raises:
        ConfigError: ``agent_kwargs`` would give the LLM a tool that acts on the host (its
            ``tools`` or ``mcp_config``, or any tool but the sandbox's terminal and file editor
            and the SDK's built-ins such as finish and think); nothing ran.
        InfraError: The sandbox failed during the conversation (it died, its channel broke).
        SandboxExhausted: The policy's processes killed or starved its sandbox.
        ContextWindowExceeded: The LLM refused the prompt as longer than its context window
            (OpenHands' ``LLMContextWindowExceedError``, with no condenser to shorten it): the
            policy's failure, scored.
        TaskError: The LLM's output held text UTF-8 cannot encode (a lone surrogate), which
            OpenHands cannot record: the policy's failure, scored.
        InputError: The first message cannot be encoded as UTF-8 (nothing ran).
        Exception: Whatever the agent loop itself raised (e.g. the LLM endpoint failed, as
            OpenHands' ``ConversationRunError``); :func:`sandpool.core.classify.classify` makes
            it an infra failure, never a reward.
    """
    if host_tools := sorted({"tools", "mcp_config"} & set(agent_kwargs or {})):
        raise errors.ConfigError(f"run_conversation(agent_kwargs=...): {', '.join(host_tools)} would "
                                 "give the LLM tools that act on the host; the sandbox's terminal and "
                                 "file editor are its tools, so leave them out")
    first = instruction or task_instruction(lease)
    try:
        first.encode()
    except UnicodeEncodeError as exc:
        raise errors.InputError(f"the conversation's first message cannot be encoded as UTF-8 ({exc}); "
                                "fix the task's problem_statement or the instruction") from None
    link = SandboxLink(lease)
    scratch = tempfile.mkdtemp(prefix="sandpool-openhands-")
    agent = Agent(llm=llm, tools=sandbox_tool_specs(link, default_timeout=command_timeout,
                                                       max_timeout=max_command_timeout),
                  **(agent_kwargs or {}))
    events: list[Event] = []
    holder: dict[str, Any] = {}

    def on_event(event: Event) -> None:
        events.append(event)
        # A failure that ended the rollout ends the conversation at the next step: OpenHands
        # would otherwise show the LLM the error and go on, on a sandbox that failed.
        if link.failure is not None and "conversation" in holder:
            holder["conversation"].pause()

    def run() -> str:
        conv = Conversation(agent=agent, workspace=scratch, callbacks=[on_event, *(callbacks or [])],
                            max_iteration_per_run=max_iterations, visualizer=None,
                            stuck_detection=True)
        holder["conversation"] = conv
        try:
            conv.send_message(first)  # the agent's tools are made
            _sandbox_tools_only(conv.agent)
            conv.run()
            return str(conv.state.execution_status.value)
        finally:
            conv.close()

    try:
        status = await asyncio.to_thread(run)
    except Exception as exc:
        if link.failure is not None:  # the loop broke because the rollout ended
            raise link.failure from exc
        if _chain(exc, lambda e: isinstance(e, LLMContextWindowExceedError)):
            raise errors.ContextWindowExceeded(f"the policy's prompt outgrew its model's context window: {exc}") from exc
        if _unencodable(exc):
            # Only the LLM's output can hold a lone surrogate (JSON's "\ud800"): the first
            # message was checked, observations are decoded with replacement. OpenHands cannot
            # record such an event and stops; as infra, a policy could choose that over a 0.
            raise errors.TaskError(f"the policy's output holds text UTF-8 cannot encode, which "
                                   f"ended its agent loop: {exc}") from exc
        raise  # the host-side loop's own error: sandpool's classifier calls it infra, unscored
    finally:
        link.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if link.failure is not None:
        raise link.failure
    if lease.broken is not None:
        raise lease.broken
    tool_calls = sum(isinstance(e, ObservationEvent) for e in events)
    return ConversationResult(status=status, events=events, tool_calls=tool_calls, host_workdir=scratch)


def _sandbox_tools_only(agent: Agent) -> None:
    """Refuse an agent with a tool that acts on the host: each tool the LLM can call must run in
    the sandbox (the terminal and file editor here) or be one of the SDK's built-ins, which
    "do not interact with the environment" (finish, think; openhands-sdk's
    ``BUILT_IN_TOOL_CLASSES``). OpenHands' own terminal would be a shell on the host, as the
    user running the trainer (often root).

    Raises:
        ConfigError: Such a tool; the conversation has not started.
    """
    from openhands.sdk.tool.builtins import BUILT_IN_TOOL_CLASSES

    for name, tool in agent.tools_map.items():
        if not (isinstance(tool.executor, (SandboxTerminalExecutor, SandboxFileEditorExecutor))
                or type(tool) in BUILT_IN_TOOL_CLASSES.values()):
            raise errors.ConfigError(
                f"OpenHands tool {name!r} ({type(tool).__name__}) would act on the host, not in the "
                "sandbox; run_conversation offers only the sandbox's terminal and file editor")


def _unencodable(exc: BaseException) -> bool:
    """Whether OpenHands' loop stopped because an event held text UTF-8 cannot encode: a
    ``UnicodeEncodeError``, or pydantic's serialization error naming one (it does not chain
    it)."""
    return _chain(exc, lambda e: isinstance(e, UnicodeEncodeError) or (
        isinstance(e, PydanticSerializationError) and "UnicodeEncodeError" in str(e)))


def _chain(exc: BaseException, test: Callable[[BaseException], bool]) -> bool:
    """Whether ``test`` holds for ``exc`` or an error it wraps (OpenHands'
    ``ConversationRunError`` wraps the loop's)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if test(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def openhands_episode(
    make_llm: Callable[[Lease], LLM],
    *,
    instruction: Callable[[Lease], str] = task_instruction,
    on_result: Callable[[Lease, ConversationResult], None] | None = None,
    **conversation_kwargs: Any,
) -> Episode:
    """An :data:`~sandpool.core.rollout.Episode` for :func:`~sandpool.core.rollout.run_rollout`:
    an OpenHands conversation on the lease. Give ``run_rollout`` a grader (e.g.
    :func:`sandpool.envs.scoring.default_grader`) to score it.

    Usage: ``await run_rollout(pool, task, openhands_episode(make_llm), grader=default_grader())``.

    Args:
        make_llm: Returns the LLM for one rollout (called per attempt: a retry starts over).
        instruction: The first user message for a lease.
        on_result: Called with each finished conversation.
        **conversation_kwargs: Passed to :func:`run_conversation`.

    Returns:
        An episode that raises the sandbox's ``InfraError`` (or the policy's failure) instead
        of ending normally.
    """

    async def episode(lease: Lease) -> None:
        conv = await run_conversation(lease, make_llm(lease), instruction(lease), **conversation_kwargs)
        if on_result is not None:
            on_result(lease, conv)

    return episode
