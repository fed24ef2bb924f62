"""OpenHands' terminal and file-editor tools, executed in a leased sandbox.

The LLM sees OpenHands' own ``terminal`` and ``file_editor`` tools: the action and observation
types and the descriptions come from ``TerminalTool.create`` and ``FileEditorTool.create``
(openhands-tools 1.58). Only the executor is replaced: :class:`SandboxTerminalExecutor`
here, :class:`~.editor.SandboxFileEditorExecutor` in :mod:`.editor`. ``LocalConversation``
runs a tool's executor on the host, so these executors are what carry each call into the
sandbox, through :meth:`Sandbox.exec <sandpool.core.base.Sandbox.exec>`, ``read_file`` and
``write_file``.

OpenHands runs the agent loop, and so the executors, on its own threads; the sandbox lives on
the asyncio loop that claimed it. :class:`SandboxLink` carries each call onto that loop and
waits for its result (the bridge a synchronous SDK needs; no sandbox work happens on the
threads). The first error that ends the rollout (:func:`sandpool.core.outcome.ends_rollout`:
an infra failure, an error sandpool does not know, the policy's processes killing its
sandbox) is kept on the link: every later call fails at once, and :func:`run_conversation
<sandpool.integrations.openhands.conversation>` stops the conversation and re-raises it for
the rollout accountant, so neither is ever shown to the LLM as a tool result. A file errno on
the policy's path is shown to it, as OpenHands' own tools show one.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from openhands.sdk.tool import Tool, ToolDefinition, ToolExecutor, register_tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.file_editor.definition import FileEditorAction, FileEditorObservation
from openhands.tools.terminal import TerminalTool
from openhands.tools.terminal.definition import TerminalAction, TerminalObservation
from openhands.tools.terminal.metadata import CmdOutputMetadata

from sandpool.core.base import ExecResult
from sandpool.core.outcome import ends_rollout
from sandpool.integrations.openhands.editor import SandboxFileEditorExecutor

if TYPE_CHECKING:
    from openhands.sdk.conversation.state import ConversationState

    from sandpool.core.pool import Lease

__all__ = [
    "SandboxLink",
    "SandboxTerminalExecutor",
    "sandbox_tool_specs",
]

T = TypeVar("T")

#: Where the terminal keeps its shell state (cwd, exported variables) between commands; /tmp
#: is private to the sandbox and cleared by in-place reset.
_TERM_STATE = "/tmp/.sandpool-openhands-terminal"
# One command in the shell the previous command left: restore cwd and exports, run it with
# stderr merged into stdout (as a terminal shows them), save the state, report $PWD on stderr.
_TERM_SCRIPT = (
    f"S={_TERM_STATE}; [ -f $S ] && . $S >/dev/null 2>&1; "
    "trap '__rc=$?; { export -p | grep -v \"^declare -x SANDPOOL_\"; printf \"cd %q\\n\" \"$PWD\"; }"
    " > $S 2>/dev/null; printf %s \"$PWD\" >&2; exit $__rc' EXIT; "
    'eval "$SANDPOOL_OH_COMMAND" 2>&1'
)


class SandboxLink:
    """A leased sandbox as seen from OpenHands' threads.

    Args:
        lease: The claimed sandbox (a :class:`~sandpool.core.pool.Lease`).
        loop: The event loop the lease belongs to (default: the running loop).

    Attributes:
        key: The registry key the tool specs name.
        failure: The first error that ended the rollout; once set, every call raises it.
    """

    _links: dict[str, SandboxLink] = {}
    _lock = threading.Lock()

    def __init__(self, lease: Lease, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.lease = lease
        self.loop = loop or asyncio.get_running_loop()
        self.key = uuid.uuid4().hex
        self.failure: Exception | None = None
        with self._lock:
            self._links[self.key] = self

    @property
    def workdir(self) -> str:
        """The task repo's path inside the sandbox."""
        return self.lease.workdir

    @classmethod
    def get(cls, key: str) -> SandboxLink:
        """Return the open link registered under ``key``.

        Raises:
            KeyError: No open link has that key (it was closed, or never made here).
        """
        with cls._lock:
            return cls._links[key]

    def close(self) -> None:
        """Unregister the link; the lease itself is released by its owner."""
        with self._lock:
            self._links.pop(self.key, None)

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run the coroutine ``make()`` on the lease's loop and return its result (blocking).

        Raises:
            SandboxFileError: A file errno on the policy's path (a result it sees).
            Exception: What ended the rollout, now or earlier in this conversation (the
                sandbox failed, the policy's processes killed it, a host error).
        """
        if self.failure is not None:
            raise self.failure
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError("SandboxLink.call blocks; call it from OpenHands' threads, not the loop")
        try:
            return asyncio.run_coroutine_threadsafe(make(), self.loop).result()  # type: ignore[arg-type]
        except Exception as exc:
            if ends_rollout(exc) and self.failure is None:
                self.failure = exc
            raise

    def exec(self, cmd: str | list[str], **kwargs: Any) -> ExecResult:
        """Blocking :meth:`Lease.exec <sandpool.core.pool.Lease.exec>`."""
        return self.call(lambda: self.lease.exec(cmd, **kwargs))


class SandboxTerminalExecutor(ToolExecutor[TerminalAction, TerminalObservation]):
    """Runs OpenHands ``terminal`` actions as commands in the sandbox.

    Each command runs to completion under the sandbox's server-side timeout (``action.timeout``,
    else ``default_timeout`` seconds, never over ``max_timeout``: the LLM sets the action's, and
    a ``sleep infinity`` with a huge one would hold the rollout, and a synchronous batch, forever), in the shell state the previous command left: the
    working directory and exported variables carry over, as in OpenHands' persistent session.
    There is no interactive process to send input to (``is_input`` answers with an error), and
    a command that outlives its timeout is killed with its process group rather than left
    running (OpenHands' soft timeout would leave it running).

    Args:
        link: The sandbox.
        default_timeout: Seconds a command may run when the action sets no timeout.
        max_timeout: Seconds a command may run whatever the action sets.
        max_output: Cap in bytes on a command's output.
    """

    def __init__(self, link: SandboxLink, *, default_timeout: float = 300.0, max_timeout: float = 3600.0,
                 max_output: int = 1 << 20) -> None:
        self.link = link
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.max_output = max_output

    def __call__(self, action: TerminalAction, conversation: Any = None) -> TerminalObservation:
        """Run ``action`` and return its observation (errors the policy caused included)."""
        if action.is_input:
            return TerminalObservation.from_text(
                "No process is waiting for input: each command runs to completion in the sandbox.",
                is_error=True, command=action.command, exit_code=None)
        if action.reset:
            self.link.exec(["rm", "-f", _TERM_STATE], timeout=30.0)
            if not action.command.strip():
                return TerminalObservation.from_text("Terminal session reset.", command="", exit_code=0)
        timeout = min(float(action.timeout or self.default_timeout), self.max_timeout)
        res = self.link.exec(["/bin/bash", "-c", _TERM_SCRIPT], timeout=timeout,
                             env={"SANDPOOL_OH_COMMAND": action.command}, max_output=self.max_output)
        text = res.text
        if res.stdout_truncated:
            text += f"\n[output cut at {self.max_output} bytes]"
        if res.timed_out:
            text += f"\n[The command timed out after {timeout:g} s and was killed.]"
        cwd = res.err_text.strip() or None
        return TerminalObservation.from_text(
            text, command=action.command, exit_code=res.exit_code, timeout=res.timed_out,
            metadata=CmdOutputMetadata(exit_code=res.exit_code, working_dir=cwd))


class SandboxTerminalTool(ToolDefinition[TerminalAction, TerminalObservation]):
    """Registry factory: OpenHands' ``terminal`` tool with a :class:`SandboxTerminalExecutor`."""

    @classmethod
    def create(cls, conv_state: ConversationState, link: str, default_timeout: float = 300.0,
               max_timeout: float = 3600.0, **_: Any) -> Sequence[ToolDefinition]:
        """Return ``TerminalTool.create(...)``'s tool with its executor replaced.

        Args:
            conv_state: The conversation state (its host-side working directory is a scratch
                directory, never the sandbox's path).
            link: Key of an open :class:`SandboxLink`.
            default_timeout: Seconds a command may run when the action sets no timeout.
            max_timeout: Seconds a command may run whatever the action sets.
        """
        ex = SandboxTerminalExecutor(SandboxLink.get(link), default_timeout=default_timeout,
                                     max_timeout=max_timeout)
        return TerminalTool.create(conv_state, executor=ex)


class SandboxFileEditorTool(ToolDefinition[FileEditorAction, FileEditorObservation]):
    """Registry factory: OpenHands' ``file_editor`` tool with a :class:`SandboxFileEditorExecutor`."""

    @classmethod
    def create(cls, conv_state: ConversationState, link: str, **_: Any) -> Sequence[ToolDefinition]:
        """Return ``FileEditorTool.create(...)``'s tool, executing in the sandbox.

        Its description names the sandbox's working directory instead of the host-side one.
        """
        sandbox = SandboxLink.get(link)
        host_dir = str(conv_state.workspace.working_dir)
        tools = []
        for tool in FileEditorTool.create(conv_state):
            desc = tool.description.replace(host_dir, sandbox.workdir)
            tools.append(tool.model_copy(update={"executor": SandboxFileEditorExecutor(sandbox),
                                                 "description": desc}))
        return tools


_REGISTERED = False


def sandbox_tool_specs(link: SandboxLink, *, default_timeout: float = 300.0,
                       max_timeout: float = 3600.0) -> list[Tool]:
    """Tool specs for an ``Agent``: OpenHands' terminal and file editor, run in ``link``'s sandbox.

    Usage: ``Agent(llm=llm, tools=sandbox_tool_specs(link))``.

    Args:
        link: The sandbox the tools act in.
        default_timeout: Seconds a terminal command may run when the action sets no timeout.
        max_timeout: Seconds a terminal command may run whatever the action sets.

    Returns:
        Two :class:`openhands.sdk.tool.Tool` specs; they resolve to tools named ``terminal``
        and ``file_editor`` with OpenHands' own schemas.
    """
    global _REGISTERED
    if not _REGISTERED:  # OpenHands' registry is process-wide; register on first use
        register_tool(SandboxTerminalTool.__name__, SandboxTerminalTool)
        register_tool(SandboxFileEditorTool.__name__, SandboxFileEditorTool)
        _REGISTERED = True
    return [Tool(name=SandboxTerminalTool.__name__, params={"link": link.key, "default_timeout": default_timeout,
                                                             "max_timeout": max_timeout}),
            Tool(name=SandboxFileEditorTool.__name__, params={"link": link.key})]
