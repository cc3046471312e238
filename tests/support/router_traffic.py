"""What a client sends to the gateways through a router, and what it must get back: the
same checks behind vllm-router and sglang-router (tests/routers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

IM_END = 4  # the tiny models' <|im_end|>: a control token, end of generation
TRACK = {"type": "function", "function": {
    "name": "track_parcel", "description": "Where a parcel is.",
    "parameters": {"type": "object", "properties": {"id": {"type": "string", "maxLength": 6}},
                   "required": ["id"], "additionalProperties": False}}}
Ask = Callable[[str], list[dict[str, str]]]  # a user message -> the chat's messages


def chat_stream_and_tool_call(client: Any, ask: Ask) -> None:
    """A chat, a stream with usage, and a required tool call pass through."""
    reply = client.chat.completions.create(model="hermes", messages=ask("Hello?"),
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model="hermes", messages=ask("Stream it."), max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    called = client.chat.completions.create(model="hermes", messages=ask("Where is A1?"),
                                            tools=[TRACK], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200,
                                            temperature=0)
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.name == "track_parcel" and "id" in json.loads(call.function.arguments)
    assert called.choices[0].finish_reason == "tool_calls"


def fields_applied(client: Any, ask: Ask) -> tuple[dict[str, Any], str]:
    """A client's own ignore_eos, skip_special_tokens and no_stop_trim reach the gateway
    through the router and are applied. Returns a request and its reply's text, for more
    checks."""
    # Every token the model's end of turn; ignore_eos: it goes on to max_tokens, and
    # skip_special_tokens false shows the tokens.
    shown = client.chat.completions.create(
        model="hermes", messages=ask("Hello?"), max_tokens=3, temperature=0,
        logit_bias={str(IM_END): 100},
        extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.choices[0].message.content == "<|im_end|>" * 3
    assert shown.choices[0].finish_reason == "length"
    base: dict[str, Any] = {"model": "hermes", "messages": ask("Say more."),
                            "max_tokens": 16, "temperature": 0}
    text = client.chat.completions.create(**base).choices[0].message.content or ""
    assert len(text) > 6, text
    stop = text[3:6]
    kept = client.chat.completions.create(**base, stop=[stop],
                                          extra_body={"no_stop_trim": True})
    assert kept.choices[0].message.content == text[:text.index(stop)] + stop
    return base, text
