"""The Gymnasium ``Text`` escaping of program output: unambiguous, reversible, fuzzed."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sandpool.integrations.gymnasium._text import CHARSET, from_text, to_text, truncate

# Output that stresses the escaping: the characters escapes are made of, next to bytes and
# characters that must be escaped, and plain random bytes.
_FRAGMENTS = st.sampled_from([
    b"\\", b"\\\\", b"x", b"u", b"U", b"r", b"e9", b"00e9", b"0001f600", b"\r", b"\r\n", b"\n",
    b"\t", b"\x1b", b"\x00", b"\x7f", b"\xe9", b"\xc3", b"\xa9", "é".encode(), "✓".encode(),
    "😀".encode(), b"\xed\xb3\xa9", b"\xf0\x9f\x98", b"\\xe9", b"\\u00e9", b"a", b" ",
])
OUTPUT = st.one_of(st.binary(max_size=300), st.lists(_FRAGMENTS, max_size=60).map(b"".join),
                   st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")))


def test_utf8_char_raw_byte_and_typed_escape_render_differently() -> None:
    rendered = {to_text("é".encode()), to_text(b"\xe9"), to_text(b"\\xe9")}
    assert rendered == {"\\u00e9", "\\xe9", "\\\\xe9"}


def test_carriage_returns_are_kept_as_an_escape() -> None:
    assert to_text(b"10%\r20%\r\nend\n") == "10%\\r20%\\r\nend\n"
    assert from_text("10%\\r20%\\r\nend\n") == b"10%\r20%\r\nend\n"


@given(OUTPUT)
@settings(max_examples=500, deadline=None)
@example(b"\\xe9\xe9\xc3\xa9")
def test_escaping_stays_in_the_charset_and_reverses_exactly(data: bytes) -> None:
    text = to_text(data)
    assert set(text) <= set(CHARSET)
    assert from_text(text) == data


@given(st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_a_str_is_escaped_as_its_utf8(s: str) -> None:
    text = to_text(s)
    assert text == to_text(s.encode("utf-8", "surrogatepass"))
    assert from_text(text).decode("utf-8", "surrogatepass") == s


@given(OUTPUT, OUTPUT)
@settings(max_examples=300, deadline=None)
def test_different_output_never_renders_the_same(a: bytes, b: bytes) -> None:
    assert (to_text(a) == to_text(b)) == (a == b)


@given(OUTPUT, st.integers(min_value=0, max_value=400))
@settings(max_examples=500, deadline=None)
def test_truncation_keeps_head_and_tail_and_never_splits_an_escape(data: bytes, limit: int) -> None:
    text = to_text(data)
    cut, was_cut = truncate(text, limit)
    assert len(cut) <= limit and was_cut == (len(text) > limit)
    if not was_cut:
        assert cut == text
        return
    if "\n[... " not in cut:  # too short for a marker: the head only
        assert text.startswith(cut)
        from_text(cut)
        return
    head, _, rest = cut.partition("\n[... ")
    count, _, tail = rest.partition(" characters cut ...]\n")
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) + int(count) + len(tail) == len(text)
    from_text(head)  # each side is whole escapes: it decodes
    from_text(tail)


@pytest.mark.parametrize("bad", ["\\", "\\q", "\\x41", "\\u12", "\\U0001f60", "tab\r", "é"])
def test_from_text_rejects_what_to_text_never_returns(bad: str) -> None:
    with pytest.raises(ValueError, match="not escaped text"):
        from_text(bad)
