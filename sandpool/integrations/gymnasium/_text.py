"""Program output as Gymnasium ``Text``: the charset, a reversible escaping of what falls
outside it, and truncation.

The charset (:data:`CHARSET`, 97 characters) is printable ASCII (``0x20``-``0x7e``) plus tab
and newline. :func:`to_text` turns the bytes a command printed into a string of those
characters; every escape starts with a backslash, so a literal backslash is escaped too:

=====================  =================================  =================================
escape                 stands for                         example
=====================  =================================  =================================
``\\\\``                 a backslash                        ``\\xe9`` typed -> ``\\\\xe9``
``\\r``                 a carriage return                  ``\\r\\n`` -> ``\\r`` + newline
``\\xNN``               byte ``0xNN`` that is not valid    ``b"\\xe9"`` -> ``\\xe9``
                       UTF-8 (``NN`` is ``80``-``ff``)
``\\uNNNN``             code point ``U+NNNN`` (BMP)        ``é`` -> ``\\u00e9``, ESC ->
                                                          ``\\u001b``
``\\UNNNNNNNN``         code point above ``U+FFFF``        ``😀`` -> ``\\U0001f600``
=====================  =================================  =================================

Hex digits are lower-case and of fixed width. ``\\x`` only ever means a raw byte and
``\\u``/``\\U`` only a decoded character, so UTF-8 ``é``, the lone byte ``0xE9`` and the
typed text ``\\xe9`` give three different observations (``\\u00e9``, ``\\xe9``, ``\\\\xe9``).
The escaping is reversible: ``from_text(to_text(b)) == b`` for all bytes ``b``. A ``str``
input is escaped as its UTF-8 encoding (a lone surrogate as its three bytes, Python's
``surrogatepass``). Decoding follows Python's ``surrogateescape`` error handler: a byte that
does not start a valid UTF-8 sequence is escaped alone and decoding resumes at the next byte.

:func:`truncate` cuts a long result to ``max_chars`` keeping the head and the tail, joined by
a marker line saying how many characters were cut; it never cuts through an escape.
"""

from __future__ import annotations

import re
import string

__all__ = ["CHARSET", "from_text", "to_text", "truncate"]

#: Printable ASCII plus ``\t`` and ``\n``: every character an observation or a sampled action
#: may contain.
CHARSET: str = string.digits + string.ascii_letters + string.punctuation + " \t\n"

# Backslash, and everything outside the charset (after surrogateescape decoding, a lone
# surrogate U+DC80-U+DCFF is an undecodable byte).
_OUTSIDE = re.compile(r"[^\t\n\x20-\x5b\x5d-\x7e]")
_ESCAPE = re.compile(r"\\(?:(\\)|(r)|x([89a-f][0-9a-f])|u([0-9a-f]{4})|U([0-9a-f]{8}))")
# Longest escape (\UNNNNNNNN): how far back truncate() looks for one it would split.
_MAX_ESCAPE = 10


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    if ch == "\\":
        return "\\\\"
    if ch == "\r":
        return "\\r"
    cp = ord(ch)
    if 0xDC80 <= cp <= 0xDCFF:
        return f"\\x{cp - 0xDC00:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def to_text(data: bytes | str) -> str:
    """Turn raw program output into a string made only of :data:`CHARSET` characters.

    Args:
        data: Output bytes, or a string (escaped as its UTF-8 encoding).

    Returns:
        The escaped string (see the module docstring); each escaped character or byte becomes
        2, 4, 6 or 10 characters.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return _OUTSIDE.sub(_escape, raw.decode("utf-8", "surrogateescape"))


def _unescape(m: re.Match[str]) -> str:
    backslash, cr, byte, bmp, astral = m.groups()
    if backslash:
        return "\\"
    if cr:
        return "\r"
    if byte:
        return chr(0xDC00 + int(byte, 16))
    return chr(int(bmp or astral, 16))


def from_text(text: str) -> bytes:
    """Invert :func:`to_text`: the exact bytes an observation's text was made from.

    Args:
        text: Output of :func:`to_text` (not truncated).

    Returns:
        The original bytes.

    Raises:
        ValueError: ``text`` has a backslash that starts no escape of the table above, or a
            character outside :data:`CHARSET` (it is not something :func:`to_text` returns).
    """
    bad = _OUTSIDE.search(_ESCAPE.sub("", text))
    if bad is not None:
        raise ValueError(f"not escaped text: {bad.group()!r} is outside every escape of to_text()")
    return _ESCAPE.sub(_unescape, text).encode("utf-8", "surrogateescape")


def _escape_start(text: str, i: int) -> int:
    """The index of the escape that covers position ``i`` (``i`` itself if none does)."""
    lo = max(0, i - _MAX_ESCAPE + 1)
    j = lo
    while j > 0 and text[j - 1] == "\\":  # a backslash run crossing lo: find where it begins
        j -= 1
    while j <= i:
        if text[j] != "\\":
            j += 1
            continue
        m = _ESCAPE.match(text, j)
        end = m.end() if m else j + 1
        if j < i < end:
            return j
        j = end
    return i


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut ``text`` to at most ``max_chars`` characters, keeping its head and its tail.

    The two halves are joined by a line ``[... N characters cut ...]``; neither half ends or
    starts inside an escape of :func:`to_text`. Text that already fits is returned unchanged.

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
        return text[:_escape_start(text, max_chars)], True
    keep = max_chars - len(marker)
    head = _escape_start(text, keep // 2)
    tail = len(text) - (keep - keep // 2)
    start = _escape_start(text, tail)
    if start != tail:  # the tail would begin inside an escape: begin after it instead
        m = _ESCAPE.match(text, start)
        tail = m.end() if m else tail
    cut = len(text) - head - (len(text) - tail)
    marker = f"\n[... {cut} characters cut ...]\n"
    return text[:head] + marker + text[tail:], True
