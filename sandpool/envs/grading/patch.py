"""A git patch read as git reads it: one :class:`FileChange` per file, with modes and paths.

:func:`parse_patch` accepts exactly the subset of ``git diff`` output that the capture step
writes (``git diff --binary --full-index``, with or without renames): every non-blank line
must belong to a file's ``diff --git`` block, and every hunk's line counts must match its
header. A line it does not understand is an error, never skipped, so the files it reports
are all the files ``git apply`` would touch (``git apply`` would also act on a traditional
``---``/``+++`` diff hidden between blocks; such a patch is refused here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["FileChange", "PatchError", "join_patch", "parse_patch"]


class PatchError(ValueError):
    """The patch is not a git diff this module can read in full; the message says where."""


@dataclass(frozen=True)
class FileChange:
    """One file's part of a patch.

    Attributes:
        old_path: Repo-relative path before (None for a file the patch adds).
        new_path: Repo-relative path after (None for a file the patch deletes).
        old_mode: Git mode before (``100644``, ``100755``, ``120000`` symlink, ``160000``
            gitlink), when the patch says it.
        new_mode: Git mode after, when the patch says it.
        binary: The change is a binary patch (or ``Binary files ... differ``).
        text: The block's text, exactly as in the patch.
    """

    old_path: str | None
    new_path: str | None
    old_mode: str | None
    new_mode: str | None
    binary: bool
    text: str

    @property
    def paths(self) -> tuple[str, ...]:
        """Every path the change touches (one, or two for a rename or copy)."""
        return tuple(dict.fromkeys(p for p in (self.old_path, self.new_path) if p is not None))


_ESCAPES = {"a": "\a", "b": "\b", "t": "\t", "n": "\n", "v": "\v", "f": "\f", "r": "\r",
            '"': '"', "\\": "\\"}
# At most 18 digits a number: int() refuses a string of over 4300, and no patch is that long.
_HUNK = re.compile(r"^@@ -(\d{1,18})(?:,(\d{1,18}))? \+(\d{1,18})(?:,(\d{1,18}))? @@")
_MODE = re.compile(r"^[0-7]{6}$")


def _unquote(s: str) -> tuple[str, str]:
    """Read one path token (C-quoted as git quotes it, or bare to the end); return (path, rest)."""
    if not s.startswith('"'):
        return s, ""
    out = bytearray()
    i = 1
    while i < len(s):
        c = s[i]
        if c == '"':
            return out.decode("utf-8", "surrogateescape"), s[i + 1:]
        if c == "\\":
            nxt = s[i + 1:i + 2]
            if nxt in _ESCAPES:
                out += _ESCAPES[nxt].encode()
                i += 2
                continue
            if re.match(r"[0-3][0-7]{2}", s[i + 1:i + 4]):  # one byte: git writes \000 .. \377
                out.append(int(s[i + 1:i + 4], 8))
                i += 4
                continue
            raise PatchError(f"bad escape in quoted path {s!r}")
        out += c.encode("utf-8", "surrogateescape")
        i += 1
    raise PatchError(f"unterminated quoted path {s!r}")


def _strip(path: str, prefix: str) -> str:
    if not path.startswith(prefix):
        raise PatchError(f"path {path!r} lacks git's {prefix!r} prefix")
    return path[len(prefix):]


def _header_paths(rest: str) -> tuple[str | None, str | None]:
    """The a/ and b/ paths of a ``diff --git`` line, when they can be told apart."""
    if rest.startswith('"'):
        a, tail = _unquote(rest)
        b, _ = _unquote(tail.lstrip(" "))
        return _strip(a, "a/"), _strip(b, "b/")
    if rest.endswith('"'):
        i = rest.rfind(' "')
        b, _ = _unquote(rest[i + 1:])
        return _strip(rest[:i], "a/"), _strip(b, "b/")
    # Unquoted: "a/X b/X"; when X holds spaces only equal halves are unambiguous.
    if len(rest) % 2 == 1:
        half = len(rest) // 2
        a, b = rest[:half], rest[half + 1:]
        if rest[half] == " " and a.startswith("a/") and b.startswith("b/") and a[2:] == b[2:]:
            return a[2:], b[2:]
    return None, None


def _side(line: str, marker: str, prefix: str) -> str | None:
    raw = line[len(marker):]
    if raw.rstrip("\t") == "/dev/null":
        return None
    path, _ = _unquote(raw)
    return _strip(path.rstrip("\t") if not raw.startswith('"') else path, prefix)


def _binary_sections(lines: list[str], i: int) -> int:
    """Skip a ``GIT binary patch``'s one or two sections; return the index after them."""
    for n in (1, 2):
        if i >= len(lines) or not re.match(r"^(literal|delta) \d+$", lines[i]):
            if n == 2:
                return i
            raise PatchError(f"line {i + 1}: a binary patch without a literal or delta section")
        i += 1
        while i < len(lines) and lines[i]:
            if not re.match(r"^[A-Za-z][0-9A-Za-z!#$%&()*+;<=>?@^_`{|}~-]+$", lines[i]):
                raise PatchError(f"line {i + 1}: not a base85 line of a binary patch")
            i += 1
        i += 1  # the blank line that ends the section
    return i


def parse_patch(patch: str) -> list[FileChange]:
    """Split a git diff into its file changes.

    Args:
        patch: The patch text (UTF-8; undecodable bytes kept as surrogate escapes).

    Returns:
        The file changes, in patch order (empty for an empty patch).

    Raises:
        PatchError: A line outside any ``diff --git`` block, a header or hunk line that
            does not parse, a hunk whose line counts do not match its header, a block whose
            paths cannot be told apart, or anything else this parse fails on: the policy's
            git wrote the patch, so no text of it is an error of sandpool's.
    """
    try:
        return _parse_patch(patch)
    except PatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - text the policy's git (or the policy) wrote
        raise PatchError(f"cannot parse it ({type(exc).__name__}: {str(exc)[:200]})") from None


def _parse_patch(patch: str) -> list[FileChange]:
    lines = patch.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    out: list[FileChange] = []
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        if not lines[i].startswith("diff --git "):
            raise PatchError(f"line {i + 1} is outside any 'diff --git' block: {lines[i][:80]!r}")
        start = i
        old, new = _header_paths(lines[i][len("diff --git "):])
        modes: dict[str, str | None] = {"old": None, "new": None}
        added = deleted = binary = False
        i += 1
        while i < len(lines) and not lines[i].startswith(("diff --git ", "--- ", "@@", "GIT binary patch",
                                                           "Binary files ")):
            line = lines[i]
            key, _, value = line.partition(" mode ")
            if line.startswith(("old mode ", "new mode ", "deleted file mode ", "new file mode ")):
                if not _MODE.match(value):
                    raise PatchError(f"line {i + 1}: bad mode {value!r}")
                side = "old" if key in ("old", "deleted file") else "new"
                modes[side] = value
                added |= key == "new file"
                deleted |= key == "deleted file"
            elif line.startswith(("rename from ", "copy from ")):
                old = _unquote(line.split(" from ", 1)[1])[0]
            elif line.startswith(("rename to ", "copy to ")):
                new = _unquote(line.split(" to ", 1)[1])[0]
            elif re.match(r"^index [0-9a-f]+\.\.[0-9a-f]+( [0-7]{6})?$", line):
                mode = line.split(" ")[2] if line.count(" ") == 2 else None
                modes["old"] = modes["old"] or mode
                modes["new"] = modes["new"] or mode
            elif not re.match(r"^(similarity|dissimilarity) index \d+%$", line):
                raise PatchError(f"line {i + 1}: unknown header line {line[:80]!r}")
            i += 1
        if i < len(lines) and lines[i].startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(f"line {i + 1}: '---' without '+++'")
            a, b = _side(lines[i], "--- ", "a/"), _side(lines[i + 1], "+++ ", "b/")
            if (a is None) != added or (b is None) != deleted:
                raise PatchError(f"line {i + 1}: /dev/null does not match the file's mode lines")
            old, new = (a if a is not None else old), (b if b is not None else new)
            i += 2
            if i >= len(lines) or not lines[i].startswith("@@"):
                raise PatchError(f"line {i + 1}: a file header without a hunk")
            while i < len(lines) and lines[i].startswith("@@"):
                m = _HUNK.match(lines[i])
                if m is None:
                    raise PatchError(f"line {i + 1}: bad hunk header {lines[i][:80]!r}")
                left = int(m.group(2) if m.group(2) is not None else 1)
                right = int(m.group(4) if m.group(4) is not None else 1)
                i += 1
                while left > 0 or right > 0:
                    if i >= len(lines):
                        raise PatchError("the patch ends inside a hunk")
                    c = lines[i][:1]
                    if c in (" ", ""):
                        left, right = left - 1, right - 1
                    elif c == "-":
                        left -= 1
                    elif c == "+":
                        right -= 1
                    elif c != "\\":
                        raise PatchError(f"line {i + 1}: not a hunk line: {lines[i][:80]!r}")
                    if left < 0 or right < 0:
                        raise PatchError(f"line {i + 1}: the hunk is longer than its header says")
                    i += 1
                while i < len(lines) and lines[i].startswith("\\"):
                    i += 1
        elif i < len(lines) and lines[i].startswith(("GIT binary patch", "Binary files ")):
            binary = True
            i += 1
            if lines[i - 1].startswith("GIT binary patch"):
                i = _binary_sections(lines, i)
        if added:
            old = None
        if deleted:
            new = None
        if (old is None and not added) or (new is None and not deleted):
            raise PatchError(f"line {start + 1}: cannot tell the paths of {lines[start][:80]!r}")
        out.append(FileChange(old, new, modes["old"] if not added else None,
                              modes["new"] if not deleted else None, binary,
                              "\n".join(lines[start:i]) + "\n"))
    return out


def join_patch(changes: list[FileChange]) -> str:
    """The patch made of ``changes`` alone (their blocks, in order)."""
    return "".join(c.text for c in changes)
