"""OpenHands' ``file_editor`` tool's executor, acting on a leased sandbox's files.

:class:`SandboxFileEditorExecutor` implements the commands of OpenHands' own ``FileEditor``
(openhands-tools 1.58) with its rules and messages, over :class:`~.tools.SandboxLink`: every
read, write and probe of a path is a call into the sandbox (``read_file``, ``write_file``,
``exec``), never a host file. A request the policy got wrong (a relative path, a missing
file, an ambiguous ``old_str``, a write the sandbox refused) comes back as an error
observation for the LLM; an error that ends the rollout is raised, as the link raises it.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from openhands.sdk.tool import ToolExecutor
from openhands.tools.file_editor.definition import FileEditorAction, FileEditorObservation
from openhands.tools.file_editor.editor import FileEditor

from sandpool.core import errors

if TYPE_CHECKING:
    from sandpool.integrations.openhands.tools import SandboxLink

__all__ = ["SandboxFileEditorExecutor"]

_SNIPPET_LINES = 4  # context lines around an edit, as OpenHands' editor shows
_MAX_FILE_BYTES = FileEditor.MAX_FILE_SIZE_MB << 20  # the largest file the editor reads


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
