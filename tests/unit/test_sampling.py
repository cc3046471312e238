"""Stop strings and streamed text, with no model: ``StopScanner`` finds what a scan of the
whole text finds, while reading each character a bounded number of times, and
``TextStream`` hands out pieces that add up to the final text.

Tokens are given as their bytes (what ``LlamaModel.token_to_piece`` returns).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runtime.sampling import StopScanner, TextStream


def whole_text_find(text: str, stops: Sequence[str]) -> int:
    """The reference: the earliest start of any non-empty stop string in the whole text."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def scan(pieces: Sequence[str], stops: Sequence[str]) -> tuple[int, int]:
    """Feed the text piece by piece as the engine does: (pieces fed, where a stop starts)."""
    scanner = StopScanner(stops)
    text = ""
    for n, piece in enumerate(pieces, 1):
        text += piece
        at = scanner.find(text)
        if at >= 0:
            return n, at
    return len(pieces), -1


def first_stop_by_whole_text(pieces: Sequence[str], stops: Sequence[str]) -> tuple[int, int]:
    text = ""
    for n, piece in enumerate(pieces, 1):
        text += piece
        at = whole_text_find(text, stops)
        if at >= 0:
            return n, at
    return len(pieces), -1


def stream(pieces: Sequence[bytes], stops: Sequence[str],
           keep_stop: bool = False) -> tuple[list[str], str, bool]:
    """Run a TextStream as the engine does: (pieces streamed, final text, stopped)."""
    out = TextStream(stops, keep_stop)
    streamed = []
    for piece in pieces:
        text, stopped = out.add(piece)
        streamed.append(text)
        if stopped:
            break
    final, rest = out.close()
    if rest:
        streamed.append(rest)
    return streamed, final, out.stopped


# --------------------------------------------------------------------------- StopScanner


@pytest.mark.parametrize("pieces, stops, expected", [
    (["Hello wor", "ld. The", " end"], ["The"], (2, 13)),  # within one piece
    (["abc ST", "O", "P def"], ["STOP"], (3, 4)),  # split over three pieces
    (["xx", "yy", "zz"], ["y", "x"], (1, 0)),  # several stops: the earliest in the text
    (["ab", "cd"], ["bcd", "cd"], (2, 1)),  # overlapping: the one that starts first
    (["aaa", "ab"], ["aab"], (2, 2)),  # a stop overlapping itself
    (["some", " text"], ["", "zz"], (2, -1)),  # an empty stop string never matches
    (["some", " text"], [], (2, -1)),
    (["prix: 1", "0 €", " net"], ["€ n"], (3, 9)),  # multi-byte characters
    (["日本", "語の", "テキスト"], ["語のテ"], (3, 2)),
])
def test_stop_strings_are_found_where_the_whole_text_finds_them(
        pieces: list[str], stops: list[str], expected: tuple[int, int]) -> None:
    assert scan(pieces, stops) == expected
    assert first_stop_by_whole_text(pieces, stops) == expected


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet="abc€日", max_size=4), max_size=20),
       stops=st.lists(st.text(alphabet="abc€日", max_size=4), max_size=4))
def test_any_text_any_stops_same_answer_as_scanning_the_whole_text(
        pieces: list[str], stops: list[str]) -> None:
    assert scan(pieces, stops) == first_stop_by_whole_text(pieces, stops)


class SpyText(str):
    """A str that records where each ``find`` starts."""

    starts: list[int] = []

    def find(self, sub: str, start: int | None = None, end: int | None = None) -> int:
        SpyText.starts.append(start or 0)
        return super().find(sub, start, end)


def test_each_call_scans_the_new_text_and_only_the_held_back_end_before_it() -> None:
    stops = ["STOP", "ab"]
    scanner = StopScanner(stops)
    assert scanner.hold == 3
    text = ""
    scanned = 0
    for i in range(2000):  # one character per token: a rescan would read 2 million
        text += "xyz"[i % 3]
        SpyText.starts = []
        assert scanner.find(SpyText(text)) == -1
        assert SpyText.starts == [max(0, len(text) - 1 - 3)] * len(stops)
        scanned += len(text) - SpyText.starts[0]
    assert scanned <= 2000 * (1 + 3)


def test_a_call_after_a_hit_finds_the_same_stop() -> None:
    scanner = StopScanner(["cd"])
    assert scanner.find("abcd") == 2
    assert scanner.find("abcdef cd") == 2


# --------------------------------------------------------------------------- TextStream


def test_text_that_may_begin_a_stop_string_is_held_back_then_released() -> None:
    streamed, final, stopped = stream([b"one S", b"T", b"ory", b" two"], ["STOP"])
    # The last 3 characters (the stop's length - 1) may begin "STOP": held back until
    # more text shows they do not, or the request ends.
    assert streamed == ["on", "e", " ST", "ory ", "two"]
    assert final == "one STory two" and not stopped


def test_a_stop_string_ends_the_text_before_it() -> None:
    streamed, final, stopped = stream([b"one S", b"TO", b"P two"], ["STOP", "never"])
    assert stopped and final == "one "
    assert "".join(streamed) == final


def test_keep_stop_ends_the_text_after_the_stop_string() -> None:
    # (SGLang's no_stop_trim) the text ends after the stop string, whatever came after it
    # in the same token; the pieces still add up to it.
    streamed, final, stopped = stream([b"one S", b"TO", b"P two"], ["STOP", "never"], True)
    assert stopped and final == "one STOP"
    assert "".join(streamed) == final


def test_a_character_split_across_tokens_is_streamed_whole() -> None:
    euro = "€".encode()
    streamed, final, _ = stream([b"1 ", euro[:1], euro[1:2], euro[2:] + b" net"], [])
    assert streamed == ["1 ", "", "", "€ net"]
    assert final == "1 € net"


def test_an_incomplete_character_at_the_end_becomes_a_replacement_character() -> None:
    streamed, final, _ = stream([b"ok ", "€".encode()[:2]], [])
    assert final == "ok \ufffd"
    assert "".join(streamed) == final


def test_invalid_bytes_become_replacement_characters_in_the_stream_and_the_text() -> None:
    streamed, final, _ = stream([b"a\xff", b"b"], ["zz"])
    assert final == "a\ufffdb" and "".join(streamed) == final


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(max_size=4) | st.text(alphabet="ab€ ", max_size=3)
                       .map(str.encode), max_size=15),
       stops=st.lists(st.text(alphabet="ab€ ", max_size=3), max_size=3))
def test_the_streamed_pieces_always_add_up_to_the_final_text(
        pieces: list[bytes], stops: list[str]) -> None:
    streamed, final, stopped = stream(pieces, stops)
    assert "".join(streamed) == final
    whole = b"".join(pieces).decode("utf-8", errors="replace")
    if stopped:
        assert whole_text_find(final, stops) == -1
        assert any(whole.startswith(final + s) for s in stops if s)
    else:
        assert final == whole and whole_text_find(final, stops) == -1
