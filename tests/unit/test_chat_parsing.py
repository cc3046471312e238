"""The output read back while it streams (model_runtime/chat/parsing.py): every way of
cutting a text into pieces gives the same content, reasoning and tool calls, and the
deltas add up to them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runtime.chat.formats import ChatFormat, Family
from model_runtime.chat.parsing import (
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ReasoningDelta,
    ToolCallDelta,
)

GENERIC = ChatFormat(Family.GENERIC)
HERMES = ChatFormat(Family.HERMES)
THINK = ChatFormat(Family.HERMES, ("<think>", "</think>"))
LLAMA3 = ChatFormat(Family.LLAMA3)
MISTRAL = ChatFormat(Family.MISTRAL)


def ids() -> object:
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


def parse(fmt: ChatFormat, pieces: list[str], **kw: object) -> tuple[ParsedOutput, list]:
    parser = OutputParser(fmt, new_id=ids(), **kw)  # type: ignore[arg-type]
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.close()
    return parser.output, deltas


def cuts(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def summary(out: ParsedOutput) -> tuple[str, str, list[tuple[str, str, str]]]:
    return out.content, out.reasoning, [(c.id, c.name, c.arguments) for c in out.tool_calls]


def replay(deltas: list) -> tuple[str, str, list[tuple[str, str, str]]]:
    """What a streaming client assembles from the deltas (OpenAI's rules)."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index not in calls:
                assert d.id and d.name is not None, "a call's first delta names it"
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert not d.id and not d.name
            calls[d.index][2] += d.arguments
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


CASES = [
    # (format, options, text, content, reasoning, [(name, arguments)])
    (GENERIC, {"envelope": True}, '{"response": "Hi \\"you\\" caf\\u00e9 \\ud83d\\ude00\\n"}',
     'Hi "you" café 😀\n', "", []),
    (GENERIC, {"envelope": True},
     '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}, '
     '{"name": "noop", "arguments": {}}]}', "", "",
     [("get_weather", '{"city": "Paris", "n": [1, 2]}'), ("noop", "{}")]),
    (GENERIC, {"envelope": True}, '{"response": {"answer": [1, "}"]}}', '{"answer": [1, "}"]}',
     "", []),
    (GENERIC, {"envelope": True}, "no envelope here", "no envelope here", "", []),
    (HERMES, {"tools": True}, 'Let me look.\n<tool_call>\n{"name": "f", "arguments": '
     '{"q": "a</tool_call>b"}}\n</tool_call>\n<tool_call>\n{"arguments": {"n": 1}, '
     '"name": "g"}\n</tool_call>', "Let me look.", "",
     [("f", '{"q": "a</tool_call>b"}'), ("g", '{"n": 1}')]),
    (HERMES, {"tools": True}, "a < b and <tool no call", "a < b and <tool no call", "", []),
    (HERMES, {}, '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>',
     "", []),
    (THINK, {"tools": True}, '<think>\nI need the weather.\n\n</think>\n\nSure.<tool_call>\n'
     '{"name": "w", "arguments": {}}\n</tool_call>', "Sure.", "I need the weather.",
     [("w", "{}")]),
    (THINK, {"inside_reasoning": True}, "mulling it over\n</think>\n\nAnswer.",
     "Answer.", "mulling it over", []),
    (THINK, {}, "No reasoning at all.", "No reasoning at all.", "", []),
    (THINK, {}, "<think>cut short", "", "cut short", []),
    (LLAMA3, {"tools": True}, '{"name": "f", "parameters": {"x": 1}}; {"type": "function", '
     '"name": "g", "parameters": {}}', "", "", [("f", '{"x": 1}'), ("g", "{}")]),
    (LLAMA3, {"tools": True}, 'Paris is sunny {"name"', 'Paris is sunny {"name"', "", []),
    (LLAMA3, {"tools": True}, '{"city": "Paris"}', '{"city": "Paris"}', "", []),
    (MISTRAL, {"tools": True}, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, '
     '"id": "abcdefghi"}, {"name": "g", "arguments": {}}]', "", "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    (MISTRAL, {"tools": True}, '[{"name": "f", "arguments": {}}]', "", "", [("f", "{}")]),
    (MISTRAL, {"tools": True}, "See [1] and [TOOL_CALLS]", "See [1] and", "", []),
]


@pytest.mark.parametrize("fmt, options, text, content, reasoning, calls", CASES)
def test_every_cut_of_the_text_gives_the_same_parse(
        fmt: ChatFormat, options: dict, text: str, content: str, reasoning: str,
        calls: list[tuple[str, str]]) -> None:
    expected = (content, reasoning, [(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)])
    for size in (1, 2, 3, 5, 8, 13, len(text)):
        out, deltas = parse(fmt, cuts(text, size), **options)
        assert summary(out) == expected, size
        assert replay(deltas) == expected, size


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=40), st.sampled_from(CASES))
def test_random_cuts_agree(sizes: list[int], case: tuple) -> None:
    fmt, options, text, *_ = case
    pieces, at = [], 0
    for size in sizes * (len(text) // max(1, sum(sizes)) + 1):
        if at >= len(text):
            break
        pieces.append(text[at:at + size])
        at += size
    whole, _ = parse(fmt, [text], **options)
    cut, deltas = parse(fmt, pieces, **options)
    assert summary(cut) == summary(whole) == replay(deltas)


def test_arguments_stream_before_the_call_ends_and_the_name_comes_first() -> None:
    parser = OutputParser(HERMES, tools=True, new_id=lambda: "call_x")
    first = parser.feed('<tool_call>\n{"name": "search", "arguments": {"query": "kv ca')
    assert first[0] == ToolCallDelta(0, "call_x", "search", "")
    assert "".join(d.arguments for d in first) == '{"query": "kv ca'
    assert parser.feed('che"}}\n</tool_call>') == [ToolCallDelta(0, arguments='che"}')]


def test_arguments_written_before_the_name_wait_for_it() -> None:
    parser = OutputParser(HERMES, tools=True, new_id=lambda: "call_y")
    assert parser.feed('<tool_call>{"arguments": {"a": 1}, ') == []
    assert parser.feed('"name": "f"}') == [ToolCallDelta(0, "call_y", "f", '{"a": 1}')]


def test_a_call_cut_short_is_still_reported() -> None:
    out, deltas = parse(GENERIC, ['{"tool_calls": [{"name": "f", "arguments": {"a": "x'],
                        envelope=True)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": "x')]
    assert json.loads('{"a": "x"}') and out.content == ""


# Two calls in each family's syntax, as a model forced to call (parallel calls allowed)
# writes them; max_tokens may cut the text anywhere.
TWO_CALLS = [
    (GENERIC, {"envelope": True}, '{"tool_calls": [{"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}, {"name": "track_parcel", "arguments": {"id": "A1"}}]}'),
    (HERMES, {"tools": True}, '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "track_parcel", "arguments": {"id": '
     '"A1"}}\n</tool_call>'),
    (HERMES, {"tools": True}, '<tool_call>{"arguments": {"city": "Oslo"}, "name": '
     '"get_weather"}</tool_call><tool_call>{"arguments": {"id": "A1"}, "name": '
     '"track_parcel"}</tool_call>'),
    (LLAMA3, {"tools": True}, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "track_parcel", "parameters": {"id": "A1"}}'),
    (MISTRAL, {"tools": True}, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
     '"Oslo"}}, {"name": "track_parcel", "arguments": {"id": "A1"}}]'),
]
NAMES = ("get_weather", "track_parcel")


@pytest.mark.parametrize("fmt, options, text", TWO_CALLS)
def test_a_call_cut_before_its_name_is_complete_is_never_given_out(
        fmt: ChatFormat, options: dict, text: str) -> None:
    """Cut at every character (max_tokens ends the output anywhere): a call is given out,
    whole and as deltas, only once its name's closing quote was written; then with its
    name and whatever of its arguments came, and the calls are numbered without gaps."""
    for end in range(len(text) + 1):
        head = text[:end]
        named = [n for n in NAMES if f'"{n}"' in head]
        for size in (1, 4, max(1, end)):
            out, deltas = parse(fmt, cuts(head, size), **options)
            assert [c.name for c in out.tool_calls] == named, (end, size)
            assert [c.id for c in out.tool_calls] == [f"call_{i}" for i in range(len(named))]
            assert replay(deltas) == summary(out), (end, size)
            firsts = [d for d in deltas if isinstance(d, ToolCallDelta) and d.id]
            assert [d.name for d in firsts] == named and all(d.name for d in firsts)
            for call in out.tool_calls:  # arguments as written so far, a prefix of the whole
                whole = json.dumps({"get_weather": {"city": "Oslo"},
                                    "track_parcel": {"id": "A1"}}[call.name])
                assert whole.startswith(call.arguments), (end, call)
