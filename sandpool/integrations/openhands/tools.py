"""OpenHands' terminal and file-editor tools, executed in a leased sandbox.

The LLM sees OpenHands' own ``terminal`` and ``file_editor`` tools: the action and observation
types and the descriptions come from ``TerminalTool.create`` and ``FileEditorTool.create``
(openhands-tools 1.58). Only the executor is replaced. ``LocalConversation`` runs a tool's
executor on the host, so these executors are what carry each call into the sandbox, through
:meth:`Sandbox.exec <sandpool.core.base.Sandbox.exec>`, ``read_file`` and ``write_file``.

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
import shlex
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from openhands.sdk.tool import Tool, ToolDefinition, ToolExecutor, register_tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.file_editor.definition import FileEditorAction, FileEditorObservation
from openhands.tools.file_editor.editor import FileEditor
from openhands.tools.terminal import TerminalTool
from openhands.tools.terminal.definition import TerminalAction, TerminalObservation
from openhands.tools.terminal.metadata import CmdOutputMetadata

from sandpool.core import errors
from sandpool.core.base import ExecResult
from sandpool.core.outcome import ends_rollout

if TYPE_CHECKING:
    from openhands.sdk.conversation.state import ConversationState

    from sandpool.core.pool import Lease

__all__ = [
    "SandboxFileEditorExecutor",
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
_SNIPPET_LINES = 4  # context lines around an edit, as OpenHands' editor shows
_MAX_FILE_BYTES = FileEditor.MAX_FILE_SIZE_MB << 20  # the largest file the editor reads


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


class SandboxFileEditorExecutor(ToolExecutor[FileEditorAction, FileEditorObservation]):
    """Runs OpenHands ``file_editor`` actions on the sandbox's files.

    Implements the commands of OpenHands' ``FileEditor`` (``view``, ``create``,
    ``str_replace``, ``insert``, ``undo_edit``) with its rules and messages: absolute paths
    only, no file read over its ``MAX_FILE_SIZE_MB``, ``create`` never overwrites,
    ``str_replace`` needs exactly one occurrence (retrying once with ``old_str`` stripped),
    ``undo_edit`` restores the content before the last edit.

    Args:
        link: The sandbox.
    """

    def __init__(self, link: SandboxLink) -> None:
        self.link = link
        self._history: dict[str, list[str]] = {}

    def __call__(self, action: FileEditorAction, conversation: Any = None) -> FileEditorObservation:
        """Run ``action``; the policy's mistakes come back as error observations."""
        path = action.path
        if not path.startswith("/"):
            return self._error(action, f"Invalid `path` parameter: {path}. The path should be an "
                               f"absolute path, e.g. {self.link.workdir}/{path}")
        try:
            return getattr(self, f"_{action.command}")(action)
        except _EditorError as exc:
            return self._error(action, str(exc))
        except errors.SandboxFileError as exc:  # e.g. a write the sandbox refused: the policy's
            return self._error(action, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _error(action: FileEditorAction, text: str) -> FileEditorObservation:
        return FileEditorObservation.from_text(text, is_error=True, command=action.command, path=action.path)

    def _kind(self, path: str) -> str:
        res = self.link.exec(f"if [ -d {shlex.quote(path)} ]; then echo dir; "
                             f"elif [ -e {shlex.quote(path)} ]; then echo file; else echo none; fi",
                             timeout=30.0)
        return res.text.strip()

    def _read(self, path: str) -> str:
        # OpenHands' editor refuses files over its MAX_FILE_SIZE_MB; without it a sparse file
        # (no quota used) would cross the channel and reach the LLM as one huge observation.
        size = self.link.exec(["stat", "-L", "-c", "%s", path], timeout=30.0).text.strip()
        if size.isdigit() and int(size) > _MAX_FILE_BYTES:
            raise _EditorError(f"File is too large ({int(size) / 1024 / 1024:.1f}MB). Maximum allowed size "
                               f"is {_MAX_FILE_BYTES >> 20}MB.")
        return self.link.call(lambda: self.link.lease.read_file(path)).decode("utf-8", "replace")

    def _write(self, path: str, text: str) -> None:
        try:
            data = text.encode()
        except UnicodeEncodeError as exc:  # the LLM's text (a lone surrogate): its mistake
            raise _EditorError(f"The text cannot be written as UTF-8: {exc}") from None
        self.link.call(lambda: self.link.lease.write_file(path, data))

    def _existing_file(self, path: str) -> str:
        kind = self._kind(path)
        if kind == "none":
            raise _EditorError(f"The path {path} does not exist. Please provide a valid path.")
        if kind == "dir":
            raise _EditorError(f"The path {path} is a directory and only the `view` command can be "
                               "used on directories.")
        return self._read(path)

    def _view(self, a: FileEditorAction) -> FileEditorObservation:
        kind = self._kind(a.path)
        if kind == "none":
            raise _EditorError(f"The path {a.path} does not exist. Please provide a valid path.")
        if kind == "dir":
            if a.view_range:
                raise _EditorError("The `view_range` parameter is not allowed when `path` points to a directory.")
            q = shlex.quote(a.path)
            res = self.link.exec(f"find {q} -maxdepth 2 -not -path '*/.*' | sort", timeout=60.0)
            text = (f"Here's the files and directories up to 2 levels deep in {a.path}, excluding "
                    f"hidden items:\n{res.text.rstrip()}")
            return FileEditorObservation.from_text(text, command="view", path=a.path)
        content = self._read(a.path)
        lines = content.split("\n")
        start, end = 1, len(lines)
        if a.view_range:
            if len(a.view_range) != 2:
                raise _EditorError("`view_range` should be a list of two integers.")
            start, end = a.view_range
            end = len(lines) if end == -1 else end
            if not 1 <= start <= len(lines) or end < start or end > len(lines):
                raise _EditorError(f"Invalid `view_range` parameter: {a.view_range}. The file has "
                                   f"{len(lines)} lines.")
        text = _numbered("\n".join(lines[start - 1:end]), a.path, start)
        return FileEditorObservation.from_text(text, command="view", path=a.path)

    def _create(self, a: FileEditorAction) -> FileEditorObservation:
        if a.file_text is None:
            raise _EditorError("Parameter `file_text` is required for command: create.")
        if self._kind(a.path) != "none":
            raise _EditorError(f"File already exists at: {a.path}. Cannot overwrite files using "
                               "command `create`.")
        self._write(a.path, a.file_text)
        return FileEditorObservation.from_text(f"File created successfully at: {a.path}", command="create",
                                               path=a.path, prev_exist=False, new_content=a.file_text)

    def _str_replace(self, a: FileEditorAction) -> FileEditorObservation:
        if a.old_str is None:
            raise _EditorError("Parameter `old_str` is required for command: str_replace.")
        content = self._existing_file(a.path)
        old, new = a.old_str, a.new_str or ""
        if content.count(old) == 0 and content.count(old.strip()) > 0 and old.strip():
            old = old.strip()
        n = content.count(old) if old else 0
        if n == 0:
            raise _EditorError(f"No replacement was performed, old_str `{a.old_str}` did not appear "
                               f"verbatim in {a.path}.")
        if n > 1:
            starts, i = [], content.find(old)
            while i != -1:
                starts.append(content.count("\n", 0, i) + 1)
                i = content.find(old, i + 1)
            raise _EditorError(f"No replacement was performed. Multiple occurrences of old_str `{old}` "
                               f"in lines {sorted(set(starts))}. Please ensure it is unique.")
        idx = content.index(old)
        updated = content[:idx] + new + content[idx + len(old):]
        self._write(a.path, updated)
        self._history.setdefault(a.path, []).append(content)
        line = content.count("\n", 0, idx) + 1
        return self._edited(a, content, updated, line, new.count("\n"))

    def _insert(self, a: FileEditorAction) -> FileEditorObservation:
        if a.insert_line is None or a.new_str is None:
            raise _EditorError("Parameters `insert_line` and `new_str` are required for command: insert.")
        content = self._existing_file(a.path)
        lines = content.split("\n")
        n_lines = len(lines) - (1 if content.endswith("\n") else 0)
        if not 0 <= a.insert_line <= n_lines:
            raise _EditorError(f"Invalid `insert_line` parameter: {a.insert_line}. It should be within "
                               f"the range of lines of the file: [0, {n_lines}]")
        head = "".join(line + "\n" for line in lines[:a.insert_line])
        updated = head + a.new_str + "\n" + content[len(head):]
        self._write(a.path, updated)
        self._history.setdefault(a.path, []).append(content)
        return self._edited(a, content, updated, a.insert_line + 1, a.new_str.count("\n"))

    def _undo_edit(self, a: FileEditorAction) -> FileEditorObservation:
        history = self._history.get(a.path)
        if not history:
            raise _EditorError(f"No edit history found for {a.path}.")
        current = self._existing_file(a.path)
        old = history.pop()
        self._write(a.path, old)
        return FileEditorObservation.from_text(
            f"Last edit to {a.path} undone successfully. {_numbered(old, a.path)}", command="undo_edit",
            path=a.path, old_content=current, new_content=old)

    def _edited(self, a: FileEditorAction, before: str, after: str, line: int, extra: int) -> FileEditorObservation:
        lines = after.split("\n")
        start = max(1, line - _SNIPPET_LINES)
        end = min(len(lines), line + _SNIPPET_LINES + extra)
        snippet = _numbered("\n".join(lines[start - 1:end]), f"a snippet of {a.path}", start)
        text = (f"The file {a.path} has been edited. {snippet}Review the changes and make sure they are "
                "as expected. Edit the file again if necessary.")
        return FileEditorObservation.from_text(text, command=a.command, path=a.path,
                                               old_content=before, new_content=after)


class _EditorError(Exception):
    """A file-editor request the policy got wrong; shown to the LLM, never raised out."""


def _numbered(content: str, what: str, start: int = 1) -> str:
    body = "\n".join(f"{i:6}\t{line}" for i, line in enumerate(content.split("\n"), start))
    return f"Here's the result of running `cat -n` on {what}:\n{body}\n"


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
