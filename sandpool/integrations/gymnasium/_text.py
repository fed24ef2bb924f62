"""Program output as Gymnasium ``Text``: the charset, the escaping of what falls outside it,
and truncation.

The charset (:data:`CHARSET`, 97 characters) is printable ASCII (``0x20``-``0x7e``) plus tab
and newline. Bytes a command prints are turned into text by :func:`to_text`:

1. decode as UTF-8; a byte that is not valid UTF-8 becomes the four characters ``\\xNN``;
2. ``\\r\\n`` becomes ``\\n``, and any other ``\\r`` becomes ``\\n`` (progress bars turn into
   lines instead of overwriting each other);
3. every other character outside the charset is escaped the way Python's
   ``backslashreplace`` does: ``\\xNN`` (other control characters, e.g. ANSI's ``\\x1b`` and
   Latin-1), ``\\uNNNN`` (the rest of the BMP, e.g. ``\\u2713``) or ``\\UNNNNNNNN`` (e.g. emoji),
   so nothing is silently lost and an agent can still read the code point;
4. :func:`truncate` cuts the result to ``max_chars`` keeping the head and the tail, joined by a
   marker line saying how many characters were cut.
"""

from __future__ import annotations

import re
import string

__all__ = ["CHARSET", "to_text", "truncate"]

#: Printable ASCII plus ``\t`` and ``\n``: every character an observation or a sampled action
#: may contain.
CHARSET: str = string.digits + string.ascii_letters + string.punctuation + " \t\n"

_OUTSIDE = re.compile(r"[^\t\n\x20-\x7e]")


def _escape(m: re.Match[str]) -> str:
    cp = ord(m.group())
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def to_text(data: bytes | str) -> str:
    """Turn raw program output into a string made only of :data:`CHARSET` characters.

    Args:
        data: Output bytes (decoded as UTF-8) or an already-decoded string.

    Returns:
        The escaped string (see the module docstring); its length can exceed ``len(data)``
        because each escaped character becomes 4, 6 or 10 characters.
    """
    text = data.decode("utf-8", "backslashreplace") if isinstance(data, bytes) else data
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _OUTSIDE.sub(_escape, text)


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut ``text`` to at most ``max_chars`` characters, keeping its head and its tail.

    The two halves are joined by a line ``[... N characters cut ...]``. Text that already fits
    is returned unchanged.

    Args:
        text: Text to cut.
        max_chars: The length limit in characters (at least 0).

    Returns:
        ``(text, cut)``; ``cut`` is True when characters were removed.
    """
    if len(text) <= max_chars:
        return text, False
    marker = ""
    for _ in range(3):  # the marker's own length decides how much is cut; settle it
        marker = f"\n[... {len(text) - (max_chars - len(marker))} characters cut ...]\n"
    if max_chars < len(marker) + 16:
        return text[:max_chars], True
    keep = max_chars - len(marker)
    head = keep // 2
    tail = keep - head
    return text[:head] + marker + text[len(text) - tail:], True
