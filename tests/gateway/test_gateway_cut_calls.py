"""Tool calls cut short by max_tokens, on every API the gateway speaks, whole and
streamed, with the official clients against a real gateway, real workers (the tiny models
with a generic ChatML and a Hermes-style template, one thread) and a real cache daemon.

A model forced to call (``required``/``any``, parallel calls allowed) opens call after
call until max_tokens ends it. The greedy output is read once (its tokens' bytes, from
logprobs), then the same request is cut at chosen tokens: inside the first call's name,
inside the second's, right after the second's name, inside its arguments. A call whose
name is not complete is never answered, whole or as a delta; one cut in its arguments
comes as OpenAI's does, with what was written and finish_reason ``length``
(``max_tokens`` on /v1/messages, ``incomplete`` on /v1/responses).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.support.gateway_proc import GatewayProcess, Gateways, model_entry

WEATHER = {"name": "get_weather",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
PARCEL = {"name": "track_parcel",
          "parameters": {"type": "object",
                         "properties": {"id": {"type": "string", "maxLength": 6}},
                         "required": ["id"], "additionalProperties": False}}
# With their random weights both tiny models answer this by opening call after call (the
# wording matters: others make one call and close the list).
QUESTION = "Weather in Oslo and parcel A1?"
LONG = 200  # tokens: within them both open a third call
CALL = re.compile(rb'"name"\s*:\s*"([a-z_]*)"')
ARGUMENTS = re.compile(rb'"arguments"\s*:\s*')


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_model: Path, tiny_hermes_model: Path) -> GatewayProcess:
    args = ("--n-ctx", "2048", "--n-seq-max", "2")
    return gateways.start("cut_calls", models=[model_entry("generic", tiny_model, *args),
                                               model_entry("hermes", tiny_hermes_model, *args)])


@dataclass
class Cut:
    """What a client must see when the output ends after ``tokens`` tokens."""

    tokens: int
    names: list[str]  # the calls whose name is complete, in order
    last: str | None = None  # the last call's arguments as written (None: whole)


def chat_body(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "tools": [{"type": "function", "function": t} for t in (WEATHER, PARCEL)],
            "tool_choice": "required", "max_tokens": max_tokens, "temperature": 0, **extra}


def cuts_of(pieces: list[bytes]) -> dict[str, Cut]:
    """The cut points of an output (its tokens' bytes), by place."""
    raw = b"".join(pieces)
    ends = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces) + 1)]
    calls = list(CALL.finditer(raw))
    assert len(calls) >= 3, raw  # two whole calls and a third begun
    first, second = calls[0], calls[1]
    names = [first.group(1).decode(), second.group(1).decode()]
    args = ARGUMENTS.search(raw, second.end())
    assert args is not None, raw

    def ending_inside(lo: int, hi: int) -> int:
        """The fewest tokens whose text ends strictly between bytes lo and hi."""
        k = next((k for k, end in enumerate(ends) if lo < end < hi), None)
        assert k is not None, (raw, lo, hi)
        return k

    # Inside the arguments: past their opening brace, before any byte that is not ASCII.
    inside = ending_inside(args.end() + 1, args.end() + 4)
    assert raw[args.end():ends[inside]].isascii()
    return {
        "first_mid_name": Cut(ending_inside(first.start(1), first.end() - 1), []),
        "second_mid_name": Cut(ending_inside(second.start(1), second.end() - 1), names[:1]),
        # (its closing quote ends a token)
        "after_second_name": Cut(ends.index(second.end()), names, ""),
        "second_mid_arguments": Cut(inside, names, raw[args.end():ends[inside]].decode())}


@pytest.fixture(scope="module")
def cuts(gw: GatewayProcess) -> dict[str, dict[str, Cut]]:
    """Each model's cut points, from its greedy output's tokens."""
    out = {}
    for model in ("generic", "hermes"):
        reply = gw.client().chat.completions.create(**chat_body(model, LONG, logprobs=True))
        pieces = [bytes(t.bytes or b"") for t in reply.choices[0].logprobs.content]
        assert len(pieces) == LONG, b"".join(pieces)
        out[model] = cuts_of(pieces)
    return out


PLACES = ["first_mid_name", "second_mid_name", "after_second_name", "second_mid_arguments"]
MODELS = ["generic", "hermes"]


def check_calls(cut: Cut, calls: list[tuple[str, str]]) -> None:
    """(name, arguments) of the calls a client got: the named ones, whole ones valid
    JSON, the cut one as written."""
    assert [name for name, _ in calls] == cut.names, (cut, calls)
    for i, (_, arguments) in enumerate(calls):
        if i == len(calls) - 1 and cut.last is not None:
            assert arguments == cut.last
        else:
            assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("model", MODELS)
def test_chat_completions_never_answer_a_call_without_its_name(
        gw: GatewayProcess, cuts: dict[str, dict[str, Cut]], model: str, place: str) -> None:
    cut = cuts[model][place]
    client = gw.client()
    reply = client.chat.completions.create(**chat_body(model, cut.tokens))
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == cut.tokens
    calls = choice.message.tool_calls or []
    check_calls(cut, [(c.function.name, c.function.arguments) for c in calls])
    assert choice.message.content in (None, "")
    # Streamed: nothing of a call before its name is complete; OpenAI's client puts the
    # deltas together into the same calls.
    stream = client.chat.completions.create(**chat_body(model, cut.tokens), stream=True)
    assembled: dict[int, list[str]] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                if delta.index not in assembled:
                    assert delta.id and delta.function and delta.function.name, delta
                    assembled[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and not (delta.function and delta.function.name)
                assembled[delta.index][1] += (delta.function and delta.function.arguments) or ""
    assert sorted(assembled) == list(range(len(assembled)))
    check_calls(cut, [(name, args) for name, args in (assembled[i] for i in sorted(assembled))])
    assert [r for r in reasons if r] == ["length"]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("model", MODELS)
def test_messages_never_answer_a_tool_use_without_its_name(
        gw: GatewayProcess, cuts: dict[str, dict[str, Cut]], model: str, place: str) -> None:
    cut = cuts[model][place]
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0,
                                 timeout=60.0)
    request: dict[str, Any] = {
        "model": model, "max_tokens": cut.tokens, "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"name": t["name"], "input_schema": t["parameters"]}
                  for t in (WEATHER, PARCEL)],
        "extra_body": {"temperature": 0}}
    reply = client.messages.create(**request)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == cut.tokens
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert [b.name for b in uses] == cut.names
    assert all(isinstance(b.input, dict) for b in uses)
    if not uses:  # nothing at all was written but a cut call: an empty text block
        assert [(b.type, getattr(b, "text", None)) for b in reply.content] == [("text", "")]
    # Streamed: no block is started for a call before its name is complete.
    events = list(client.messages.create(**request, stream=True))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.name for b in starts if b.type == "tool_use"] == cut.names
    pieces: dict[int, str] = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            pieces[e.index] = pieces.get(e.index, "") + e.delta.partial_json
    if cut.last:
        assert pieces[max(pieces)] == cut.last
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == "max_tokens"


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("model", MODELS)
def test_responses_never_answer_a_function_call_without_its_name(
        gw: GatewayProcess, cuts: dict[str, dict[str, Cut]], model: str, place: str) -> None:
    cut = cuts[model][place]
    client = gw.client()
    request: dict[str, Any] = {
        "model": model, "input": QUESTION, "tool_choice": "required", "temperature": 0,
        "max_output_tokens": cut.tokens, "store": False,
        "tools": [{"type": "function", **t} for t in (WEATHER, PARCEL)]}
    reply = client.responses.create(**request)
    assert reply.status == "incomplete"
    assert reply.incomplete_details and reply.incomplete_details.reason == "max_output_tokens"
    calls = [item for item in reply.output if item.type == "function_call"]
    check_calls(cut, [(c.name, c.arguments) for c in calls])
    # Streamed: an item is added for a call only with its name.
    events = list(client.responses.create(**request, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.name for i in added if i.type == "function_call"] == cut.names
    final = events[-1]
    assert final.type == "response.incomplete"
    check_calls(cut, [(i.name, i.arguments) for i in final.response.output
                      if i.type == "function_call"])
