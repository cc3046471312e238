"""Agents at the front door: tools, tool results, structured output, logprobs and every
documented field, with OpenAI's own client against a real gateway, real workers (the tiny
models with a generic ChatML, a Hermes-style and a <think> template, one thread) and a
real cache daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from model_runtime.gateway.apis.openai.adapter import CHAT_FIELDS, COMPLETION_FIELDS
from model_runtime.llama_backend import LlamaModel
from tests.support.gateway_proc import GatewayProcess, Gateways, model_entry

SYSTEM = ("You are the dispatcher of a delivery company. Answer briefly; look things up with "
          "the tools rather than guessing. ") * 3
# Strings are bounded: the tiny models' weights are random, and a constrained string ends
# only when the model picks its closing quote (1 token in ~400).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
PARCEL = {"type": "function", "function": {
    "name": "track_parcel", "description": "Where a parcel is.",
    "parameters": {"type": "object", "properties": {
        "id": {"type": "string", "maxLength": 6}, "priority": {"enum": ["low", "high"]}},
        "required": ["id", "priority"], "additionalProperties": False}}}
TOOLS = [WEATHER, PARCEL]


class Dims(BaseModel):
    width: int
    height: int


class Parcel(BaseModel):
    """A parcel's record (nested object, enum, array, bounded string)."""

    parcel_id: str = Field(max_length=6)
    priority: Literal["low", "high"]
    fragile: bool
    dims: Dims
    tags: list[Literal["cold", "heavy"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_model: Path, tiny_hermes_model: Path,
       tiny_think_model: Path) -> GatewayProcess:
    args = ("--n-ctx", "2048", "--n-seq-max", "4")
    return gateways.start("agents", models=[model_entry("generic", tiny_model, *args),
                                            model_entry("hermes", tiny_hermes_model, *args),
                                            model_entry("think", tiny_think_model, *args)])


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


def no_thinking(model: str) -> dict[str, Any]:
    """For the think model, a prompt that closes the reasoning block (enable_thinking
    false): the tiny model's random weights would not write </think> within a test's
    tokens, and the grammar then starts at the answer."""
    if model != "think":
        return {}
    return {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}


def still_serves(gw: GatewayProcess, model: str) -> None:
    reply = gw.client().chat.completions.create(model=model, messages=ask("Still there?"),
                                                max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


# Open, seen with the tiny models' random weights, and failing every time (greedy, and the
# kernels compute alike in any batch): reasons, not excuses, each names what fails and
# why; strict, so a fix fails the run until its mark is taken off.
PARALLEL_RUNS_ON = pytest.mark.xfail(reason=(
    "open: with parallel calls on the Hermes template the random weights open call after "
    "call until max_tokens, so the last call is cut (finish_reason length)"), strict=True)
TOKEN_SPLITS = pytest.mark.xfail(reason=(
    "open: constrained output is often not the tokenizer's own split of its text (random "
    "weights pick odd splits the grammar allows), so the re-rendered turn tokenizes "
    "differently right after the prompt and only the prompt is reused (generic: 960 of "
    "960 + 92 tokens cached, hermes: 933 of 932 + 95)"), strict=True)


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


def test_a_call_left_unanswered_is_one_clear_400(gw: GatewayProcess) -> None:
    """As OpenAI's API: the tool messages right after an assistant's calls answer each of
    them (a model shown a call it never saw answered would go on from it)."""
    call = {"id": "call_9", "type": "function",
            "function": {"name": "track_parcel", "arguments": "{}"}}
    body = {"model": "hermes", "tools": TOOLS, "messages": [
        *ask("Where is parcel 9?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "And parcel 10?"}]}
    message = refused(gw, body, "messages[2].role")
    assert message.endswith("did not have response messages: call_9")
    still_serves(gw, "hermes")


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
    """What the gateway says it applies (the rest is noted "refused")."""
    return {name for name, how in endpoint.items() if not how.startswith("refused")}


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
        assert status == 400, (name, raw)
        error = json.loads(raw)["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error", (name, raw)


# --------------------------------------------------------------------------- constrained


def token_id(model_path: Path, text: str) -> int:
    with LlamaModel(model_path) as model:
        (token,) = model.tokenize(text, add_special=False, parse_special=True)
        return token


def assemble(chunks: list[Any]) -> tuple[str, str, list[dict[str, str]], str | None]:
    """Content, reasoning, tool calls and finish_reason from streamed chunks, as OpenAI's
    streaming clients put them together (a call's first delta has its id and name)."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name,
                                     "arguments": ""}
            else:
                assert call.id is None and not call.function.name
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def check_parcel_call(name: str, arguments: str) -> None:
    assert name == "track_parcel"
    args = json.loads(arguments)
    assert set(args) == {"id", "priority"} and args["priority"] in ("low", "high")
    assert isinstance(args["id"], str) and len(args["id"]) <= 6


@pytest.mark.parametrize("model", ["generic", "hermes", "think"])
def test_a_named_tool_is_called_with_arguments_that_parse_streamed_and_not(
        gw: GatewayProcess, model: str) -> None:
    client = gw.client()
    named = {"type": "function", "function": {"name": "track_parcel"}}
    whole = client.chat.completions.create(model=model, messages=ask("Where is parcel 7?"),
                                           tools=TOOLS, tool_choice=named, max_tokens=200,
                                           temperature=0, **no_thinking(model))
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    check_parcel_call(call.function.name, call.function.arguments)
    assert call.id.startswith("call_") and choice.message.content is None
    chunks = list(client.chat.completions.create(
        model=model, messages=ask("Where is parcel 7?"), tools=TOOLS, tool_choice=named,
        max_tokens=200, temperature=0, stream=True, **no_thinking(model)))
    content, _, calls, finish = assemble(chunks)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)]


@pytest.mark.parametrize("model", ["generic", pytest.param("hermes", marks=PARALLEL_RUNS_ON)])
def test_required_calls_one_of_the_tools_or_several_in_parallel(gw: GatewayProcess,
                                                                 model: str) -> None:
    client = gw.client()
    for parallel in (False, True):
        reply = client.chat.completions.create(
            model=model, messages=ask("Track parcel 3 and check Lyon's weather."),
            tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            max_tokens=300, temperature=0)
        calls = reply.choices[0].message.tool_calls
        assert calls and reply.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 or parallel
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            if call.function.name == "get_weather":
                assert set(json.loads(call.function.arguments)) == {"city"}
            else:
                check_parcel_call(call.function.name, call.function.arguments)


def test_auto_on_a_hermes_template_grammar_starts_at_the_tag(gw: GatewayProcess,
                                                             tiny_hermes_model: Path) -> None:
    """The model is pushed to open a call (logit_bias on <tool_call>): from the tag on the
    lazy grammar holds the call to a tool's schema, and after it the reply ends."""
    tag = token_id(tiny_hermes_model, "<tool_call>")
    chunks = list(gw.client().chat.completions.create(
        model="hermes", messages=ask("Where is parcel 5?"), tools=TOOLS, tool_choice="auto",
        parallel_tool_calls=False, logit_bias={str(tag): 100}, max_tokens=200, temperature=0,
        stream=True))
    content, _, calls, finish = assemble(chunks)
    assert finish == "tool_calls" and len(calls) == 1 and content == ""
    arguments = json.loads(calls[0]["arguments"])
    assert calls[0]["name"] in ("get_weather", "track_parcel") and isinstance(arguments, dict)


def test_auto_on_the_generic_path_is_a_reply_or_a_call(gw: GatewayProcess) -> None:
    reply = gw.client().chat.completions.create(model="generic", messages=ask("Hello?"),
                                                tools=TOOLS, max_tokens=300, temperature=0)
    (choice,) = reply.choices
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
        assert '"response"' not in choice.message.content  # the envelope is not content


@TOKEN_SPLITS
@pytest.mark.parametrize("model", ["generic", "hermes"])
def test_a_tool_round_trip_is_served_mostly_from_cache(gw: GatewayProcess, model: str) -> None:
    client = gw.client()
    messages = ask("Where is parcel 12?", f"(cached round trip {model}) {SYSTEM}")
    named = {"type": "function", "function": {"name": "track_parcel"}}
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice=named, max_tokens=200, temperature=0)
    message = first.choices[0].message
    follow = client.chat.completions.create(
        model=model, tools=TOOLS, max_tokens=4, temperature=0,
        messages=[*messages, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                   "content": "In Lyon, on time."}])
    cached = follow.usage.prompt_tokens_details.cached_tokens
    # the previous turn's prompt and the call the model wrote, from its KV
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert follow.usage.prompt_tokens - cached < 40  # the result's turn


@pytest.mark.parametrize("model", ["generic", "think"])
def test_json_schema_strict_with_nested_types(gw: GatewayProcess, model: str) -> None:
    schema = Parcel.model_json_schema()
    for stream in (False, True):
        got = gw.client().chat.completions.create(
            model=model, messages=ask("Describe parcel 4 as JSON."), max_tokens=300,
            temperature=0, stream=stream, response_format={"type": "json_schema", "json_schema": {
                "name": "parcel", "schema": schema, "strict": True}})
        content = assemble(list(got))[0] if stream else got.choices[0].message.content
        Parcel.model_validate_json(content)


def test_json_object(gw: GatewayProcess, tiny_model: Path) -> None:
    # Pushed to close strings and objects early (random weights): any JSON object holds.
    bias = {str(token_id(tiny_model, '"')): 8, str(token_id(tiny_model, "}")): 8}
    reply = gw.client().chat.completions.create(
        model="generic", messages=ask("Answer in JSON."), max_tokens=200, temperature=0,
        logit_bias=bias, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_n_choices_each_are_their_seed_and_the_prompt_counts_once(gw: GatewayProcess) -> None:
    """n=2 through the official client: two choices whose prompt was computed once and
    counts once; with a seed and a temperature they differ, and choice i is what a single
    request with seed + i gives, streamed or not. More choices than a worker has slots is
    one 400 naming n, and the worker keeps serving."""
    client = gw.client()
    body: dict[str, Any] = {"model": "generic", "messages": ask("Two ideas, please."),
                            "max_tokens": 8, "temperature": 1.0, "seed": 5}
    two = client.chat.completions.create(**body, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    singles = [client.chat.completions.create(**{**body, "seed": 5 + i}) for i in (0, 1)]
    texts = [c.message.content for c in two.choices]
    assert texts == [s.choices[0].message.content for s in singles]
    assert texts[0] != texts[1]
    assert two.usage is not None and singles[0].usage is not None
    assert two.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert two.usage.completion_tokens == sum(s.usage.completion_tokens  # type: ignore[union-attr]
                                              for s in singles)
    streamed = {0: "", 1: ""}
    usage = None
    for piece in client.chat.completions.create(**body, n=2, stream=True,
                                                stream_options={"include_usage": True}):
        for choice in piece.choices:
            streamed[choice.index] += choice.delta.content or ""
        usage = piece.usage or usage
    assert [streamed[0], streamed[1]] == texts
    assert usage is not None and usage.prompt_tokens == two.usage.prompt_tokens
    done = client.completions.create(model="generic", prompt="Ready?", max_tokens=6, n=3,
                                     temperature=1.0, seed=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert "n=5" in refused(gw, {**body, "n": 5}, "n")  # (4 slots a worker)
    still_serves(gw, "generic")


def test_penalties_change_the_output(gw: GatewayProcess) -> None:
    client = gw.client()
    # Presence and frequency penalties count generated tokens only: 24 greedy tokens of
    # the tiny model repeat too few for them to change its reply, 48 do.
    base = {"model": "generic", "messages": ask("Repeat after me: la la la la la."),
            "max_tokens": 48, "temperature": 0}
    plain = client.chat.completions.create(**base).choices[0].message.content
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repeat_penalty": 1.5, "repeat_last_n": 64}}):
        other = client.chat.completions.create(**base, **extra).choices[0].message.content
        assert other != plain, extra


def test_a_seed_repeats_a_sampled_reply(gw: GatewayProcess) -> None:
    client = gw.client()
    base = {"model": "generic", "messages": ask("Surprise me."), "max_tokens": 12,
            "temperature": 1.0, "extra_body": {"top_k": 40, "min_p": 0.01}}
    first = client.chat.completions.create(**base, seed=11).choices[0].message.content
    again = client.chat.completions.create(**base, seed=11).choices[0].message.content
    other = client.chat.completions.create(**base, seed=12).choices[0].message.content
    assert first == again and first != other


def test_a_gbnf_grammar_and_a_bad_one(gw: GatewayProcess) -> None:
    reply = gw.client().completions.create(model="generic", prompt="Ready?", max_tokens=8,
                                           temperature=0,
                                           extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert reply.choices[0].text in ("yes", "no")
    message = refused(gw, {"model": "generic", "prompt": "x", "grammar": "root ::= (("},
                      "grammar", "/v1/completions")
    assert message
    still_serves(gw, "generic")


def test_reasoning_is_reasoning_content_never_content(gw: GatewayProcess) -> None:
    """The think model's reply held by a grammar to a reasoning block and an answer."""
    grammar = 'root ::= "<think>" [a-z ]{3,12} "</think>" [a-z]{2,8}'
    client = gw.client()
    whole = client.chat.completions.create(model="think", messages=ask("Think first."),
                                           max_tokens=60, temperature=0,
                                           extra_body={"grammar": grammar})
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and "<think>" not in message.content
    chunks = list(client.chat.completions.create(model="think", messages=ask("Think first."),
                                                 max_tokens=60, temperature=0, stream=True,
                                                 extra_body={"grammar": grammar}))
    content, streamed_reasoning, _, _ = assemble(chunks)
    assert (content, streamed_reasoning) == (message.content, reasoning)

    # include_reasoning false (vLLM's and SGLang's field, which routers pass on): the
    # reasoning is left out of the answer, whole and streamed; the content stays.
    extra = {"grammar": grammar, "include_reasoning": False}
    without = client.chat.completions.create(model="think", messages=ask("Think first."),
                                             max_tokens=60, temperature=0, extra_body=extra)
    assert without.choices[0].message.content == message.content
    assert "reasoning_content" not in (without.choices[0].message.model_extra or {})
    chunks = list(client.chat.completions.create(model="think", messages=ask("Think first."),
                                                 max_tokens=60, temperature=0, stream=True,
                                                 extra_body=extra))
    content, streamed_reasoning, _, _ = assemble(chunks)
    assert (content, streamed_reasoning) == (message.content, "")


# --------------------------------------------------------------------------- frameworks


def test_langchain_bind_tools_and_structured_output(gw: GatewayProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{gw.url}/v1", api_key="none", model="hermes", temperature=0,
                     max_tokens=300, max_retries=0)
    called = llm.bind_tools([PARCEL], tool_choice="track_parcel").invoke("Where is parcel 2?")
    (call,) = called.tool_calls
    check_parcel_call(call["name"], json.dumps(call["args"]))
    for method in ("json_schema", "function_calling"):
        parcel = llm.with_structured_output(Parcel, method=method).invoke("Parcel 9 as JSON.")
        assert isinstance(parcel, Parcel), method


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(gw: GatewayProcess, mode: str) -> None:
    import instructor

    client = instructor.from_openai(gw.client(), mode=getattr(instructor.Mode, mode))
    parcel = client.chat.completions.create(model="generic", response_model=Parcel,
                                            max_retries=0, max_tokens=300, temperature=0,
                                            messages=ask("Parcel 11 as JSON."))
    assert isinstance(parcel, Parcel)
