"""Agents at the front door: tools, tool results, structured output, logprobs and every
documented field, with OpenAI's own client against a real gateway, real workers (the tiny
models with a generic ChatML, a Hermes-style and a <think> template, one thread) and a
real cache daemon."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_proc import DaemonProcess
from test_gateway_support import GatewayProcess, kill_leftovers, wait_gone

from model_runtime.gateway.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, PROTO_FIELDS

SYSTEM = ("You are the dispatcher of a delivery company. Answer briefly; look things up with "
          "the tools rather than guessing. ") * 3
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
PARCEL = {"type": "function", "function": {
    "name": "track_parcel", "description": "Where a parcel is.",
    "parameters": {"type": "object", "properties": {
        "id": {"type": "string"}, "priority": {"enum": ["low", "high"]}},
        "required": ["id", "priority"], "additionalProperties": False}}}
TOOLS = [WEATHER, PARCEL]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tiny_hermes_model: Path,
       tiny_think_model: Path) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("agents")
    daemon = DaemonProcess(tmp / "data").start()
    args = ["--n-ctx", "2048", "--n-seq-max", "4"]
    config = tmp / "gateway.json"
    config.write_text(json.dumps({"models": [
        {"name": "generic", "path": str(tiny_model), "args": args},
        {"name": "hermes", "path": str(tiny_hermes_model), "args": args},
        {"name": "think", "path": str(tiny_think_model), "args": args}]}))
    gateway = GatewayProcess(tmp / "gateway.log", "--config", str(config),
                             cache=daemon.address)
    pids: list[int] = []
    try:
        gateway.start()
        pids = [w["pid"] for w in gateway.status()["workers"]]
        yield gateway
        assert gateway.stop() == 0, gateway.log()[-3000:]
        assert wait_gone(pids), "workers outlived the gateway"
    finally:
        gateway.close()
        kill_leftovers(pids)
        daemon.close()


def ask(question: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def post(gw: GatewayProcess, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = gw.http("POST", path, json.dumps(body).encode())
    return status, json.loads(raw)


def refused(gw: GatewayProcess, body: dict[str, Any], param: str,
            path: str = "/v1/chat/completions") -> str:
    """The request is a 400 naming ``param``; returns the message."""
    status, answer = post(gw, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return str(error["message"])


def still_serves(gw: GatewayProcess, model: str) -> None:
    reply = gw.client().chat.completions.create(model=model, messages=ask("Still there?"),
                                                max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("model", ["generic", "hermes", "think"])
def test_a_second_request_with_the_same_tools_reuses_them(gw: GatewayProcess,
                                                          model: str) -> None:
    client = gw.client()
    system = f"({model} tools) {SYSTEM}"
    first = client.chat.completions.create(model=model, messages=ask("Alpha?", system),
                                           tools=TOOLS, tool_choice="none", max_tokens=4,
                                           temperature=0)
    second = client.chat.completions.create(model=model, messages=ask("Beta?", system),
                                            tools=TOOLS, tool_choice="none", max_tokens=4,
                                            temperature=0)
    # Everything up to the user message: the system message with both tools' schemas.
    tools_text = len(json.dumps(TOOLS))
    assert second.usage.prompt_tokens_details.cached_tokens > tools_text // 2
    assert second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens < 40
    assert first.choices[0].message.tool_calls is None


def test_a_tool_result_continues_the_turn_that_called_the_tool(gw: GatewayProcess) -> None:
    """The client sends back the call and its result: the new prompt extends the previous
    one, so only the result (and the call, as the template writes it) is prefilled."""
    client = gw.client()
    messages = ask("Where is parcel 7?", f"(round trip) {SYSTEM}")
    first = client.chat.completions.create(model="hermes", messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=3, temperature=0)
    call = {"id": "call_7", "type": "function",
            "function": {"name": "track_parcel", "arguments": '{"id": "7", "priority": "low"}'}}
    follow = client.chat.completions.create(
        model="hermes", tools=TOOLS, tool_choice="none", max_tokens=3, temperature=0,
        messages=[*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_7", "content": "In Lyon, on time."}])
    assert follow.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


# --------------------------------------------------------------------------- logprobs


def test_chat_logprobs_streamed_and_not(gw: GatewayProcess) -> None:
    client = gw.client()
    messages = ask("Logprobs please.")
    whole = client.chat.completions.create(model="generic", messages=messages, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    # A token may hold part of a character: its bytes, joined, are the text.
    assert bytes(b for t in content for b in t.bytes).decode(errors="replace") == \
        whole.choices[0].message.content
    for token in content:
        assert token.logprob <= 0
        assert bytes(token.bytes).decode(errors="replace") == token.token
        assert len(token.top_logprobs) == 3
        tops = [t.logprob for t in token.top_logprobs]
        assert tops == sorted(tops, reverse=True) and token.logprob <= tops[0] + 1e-9
    # temperature 0 picks the most likely token
    assert all(t.token == t.top_logprobs[0].token for t in content)
    streamed = client.chat.completions.create(model="generic", messages=messages, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 6)) for t in tokens] == \
        [(t.token, round(t.logprob, 6)) for t in content]


def test_completions_logprobs_as_an_integer(gw: GatewayProcess) -> None:
    reply = gw.client().completions.create(model="generic", prompt="The parcel is in",
                                           max_tokens=5, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        reply.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) >= lp_ - 1e-9
               for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    refused(gw, {"model": "generic", "prompt": "x", "logprobs": 6}, "logprobs",
            "/v1/completions")


# --------------------------------------------------------------------------- refusals


def test_a_tool_result_for_an_unknown_call_is_one_clear_400(gw: GatewayProcess) -> None:
    body = {"model": "hermes", "tools": TOOLS, "messages": [
        *ask("Where is parcel 9?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "track_parcel", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_8", "content": "Lost."}]}
    message = refused(gw, body, "messages[3].tool_call_id")
    assert "call_8" in message
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().chat.completions.create(model="hermes", messages=body["messages"],
                                            tools=TOOLS)
    assert err.value.param == "messages[3].tool_call_id"
    still_serves(gw, "hermes")


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "function": {"name": "no spaces allowed"}}], "tools[0].function.name"),
    ([{"type": "code_interpreter"}], "tools[0].type"),
    ([WEATHER, {"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}],
     "tools[1].function.parameters"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"a": {"type": "complex"}}}}}],
     "tools[0].function.parameters"),
])
def test_a_bad_tool_definition_is_one_clear_400(gw: GatewayProcess, tools: list,
                                                param: str) -> None:
    refused(gw, {"model": "generic", "messages": ask("x"), "tools": tools}, param)
    still_serves(gw, "generic")


def test_a_schema_that_cannot_be_constrained_is_one_clear_400(gw: GatewayProcess) -> None:
    body = {"model": "hermes", "messages": ask("x"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}}
    message = refused(gw, body, "response_format.json_schema.schema")
    assert "nowhere" in message
    still_serves(gw, "hermes")


def test_image_parts_are_refused_clearly(gw: GatewayProcess) -> None:
    body = {"model": "generic", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    message = refused(gw, body, "messages[0].content[1]")
    assert "images" in message


# --------------------------------------------------------------------------- the fields

# OpenAI's API reference: the request body of each endpoint, every field.
DOCUMENTED_CHAT = ["messages", "model", "audio", "frequency_penalty", "function_call",
                   "functions", "logit_bias", "logprobs", "max_completion_tokens",
                   "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
                   "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
                   "response_format", "safety_identifier", "seed", "service_tier", "stop",
                   "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
                   "top_logprobs", "top_p", "user", "verbosity", "web_search_options"]
DOCUMENTED_COMPLETIONS = ["model", "prompt", "best_of", "echo", "frequency_penalty",
                          "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
                          "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                          "top_p", "user"]
# A value of each that asks for something (not the default), with what it needs beside it.
PROBES: dict[str, dict[str, Any]] = {
    "audio": {"audio": {"voice": "alloy", "format": "mp3"}},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto"},
    "functions": {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
    "logit_bias": {"logit_bias": {"42": -100}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "max_tokens": {"max_tokens": 3},
    "metadata": {"metadata": {"k": "v"}},
    "modalities": {"modalities": ["text", "audio"]},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": [WEATHER],
                            "tool_choice": "none"},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt_cache_key": {"prompt_cache_key": "customer-7"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": "user-1"},
    "seed": {"seed": 7},
    "service_tier": {"service_tier": "flex"},
    "stop": {"stop": ["\n\n"]},
    "store": {"store": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5},
    "tool_choice": {"tools": [WEATHER], "tool_choice": "none"},
    "tools": {"tools": [WEATHER], "tool_choice": "none"},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.5},
    "user": {"user": "user-1"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {}},
    "prompt": {}, "messages": {}, "model": {},
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    "suffix": {"suffix": "the end"},
}


def served_fields(endpoint: dict[str, str]) -> set[str]:
    """What the gateway says it applies: refusals are noted so, sampler settings and
    structured output need the runtime to have them."""
    sampler = {"frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
               "logit_bias": "logit_bias", "n": "n", "response_format": "grammar"}
    return {name for name, how in endpoint.items()
            if not how.startswith("refused") and
            (name not in sampler or sampler[name] in PROTO_FIELDS)}


@pytest.mark.parametrize("path, documented, table, base", [
    ("/v1/chat/completions", DOCUMENTED_CHAT, CHAT_FIELDS,
     {"model": "hermes", "messages": ask("Fields?"), "max_tokens": 2}),
    ("/v1/completions", DOCUMENTED_COMPLETIONS, COMPLETION_FIELDS,
     {"model": "hermes", "prompt": "Fields?", "max_tokens": 2})])
def test_every_documented_field_is_applied_or_refused(
        gw: GatewayProcess, path: str, documented: list[str], table: dict[str, str],
        base: dict[str, Any]) -> None:
    """No field accepted and ignored: each documented field, given a value that asks for
    something, is served (the gateway's table says it applies it) or refused with a 400
    naming it (the table says so, or the runtime lacks it)."""
    assert set(documented) <= set(table), set(documented) - set(table)
    applied = served_fields(table)
    probes = {**PROBES, "logprobs": {"logprobs": 2}} if "prompt" in base else PROBES
    for name in documented:
        body = {**base, **probes[name]}
        status, _, raw = gw.http("POST", path, json.dumps(body).encode())
        if name in applied:
            assert status == 200, (name, raw)
            continue
        else:
            assert status == 400, (name, raw)
        error = json.loads(raw)["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error", (name, raw)
