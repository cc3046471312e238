"""The Responses API (``/v1/responses``) with OpenAI's own client against a real gateway,
real workers (the tiny models with a Hermes-style and a <think> template, one thread) and
a real cache daemon: create, stream, chains by ``previous_response_id`` continued from
the stored state, function tools, structured output, GET/DELETE, tenants, a restart of
the gateway in the middle of a chain, ``store`` false, the store's bounds, and every
documented field applied or refused."""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from harness.make_tiny_gguf import HERMES_TEMPLATE, THINK_TEMPLATE
from pydantic import BaseModel

from model_runtime.chat.formats import detect_format
from model_runtime.chat.parsing import OutputParser
from model_runtime.chat.templates import ChatTemplate
from model_runtime.gateway.apis.responses.adapter import RESPONSES_FIELDS, parse_responses
from model_runtime.gateway.apis.responses.formatter import ResponseBuilder, reply_messages
from model_runtime.llama_backend import LlamaModel
from model_runtime.request import common_prefix
from model_runtime.v1 import runtime_pb2 as pb
from tests.support.daemon_proc import DaemonProcess
from tests.support.gateway_proc import (
    ALICE,
    BOB,
    GatewayProcess,
    Gateways,
    kill_leftovers,
    model_entry,
    wait_gone,
)

INSTRUCTIONS = ("You are the dispatcher of a delivery company. Answer briefly; look things "
                "up with the tools rather than guessing. ") * 3
WEATHER = {"type": "function", "name": "get_weather",
           "description": "The weather in a city today.", "strict": True,
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}


class Slot(BaseModel):
    """A delivery slot (enum, bool, integer: values the tiny model ends quickly)."""

    period: Literal["am", "pm"]
    express: bool
    day: Literal[1, 2, 3]


def start_gateway(tmp: Path, daemon: DaemonProcess, models: list[dict[str, Any]],
                  *extra: str, admin_key: str | None = None) -> GatewayProcess:
    config = tmp / "gateway.json"
    config.write_text(json.dumps({"models": models}))
    gateway = GatewayProcess(tmp / "gateway.log", "--config", str(config), "--responses-dir",
                             str(tmp / "responses"), *extra, cache=daemon.address,
                             admin_key=admin_key)
    gateway.start()
    return gateway


def worker_pids(gateway: GatewayProcess, key: str | None = None) -> list[int]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return [w["pid"] for w in gateway.status(headers)["workers"] if w["pid"]]


@pytest.fixture(scope="module")
def env(gateways: Gateways, tiny_hermes_model: Path,
        tiny_think_model: Path) -> tuple[GatewayProcess, Path]:
    """The gateway, and its folder (its stored responses are in ``responses``)."""
    args = ("--n-ctx", "2048", "--n-seq-max", "2")
    gateway = gateways.start("responses", models=[model_entry("hermes", tiny_hermes_model, *args),
                                                  model_entry("think", tiny_think_model, *args)],
                             keys=f"{ALICE} alice role=admin\n{BOB} bob\n", admin_key=ALICE)
    return gateway, gateways.folder(gateway)


@pytest.fixture(scope="module")
def gw(env: tuple[GatewayProcess, Path]) -> GatewayProcess:
    return env[0]


def alice(gw: GatewayProcess) -> openai.OpenAI:
    return gw.client(api_key=ALICE)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", "hermes")
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 6)
    return client.responses.create(**kwargs)


def post(gw: GatewayProcess, body: dict[str, Any], key: str = ALICE
         ) -> tuple[int, dict[str, Any]]:
    status, _, raw = gw.http("POST", "/v1/responses", json.dumps(body).encode(),
                             {"Authorization": f"Bearer {key}"})
    return status, json.loads(raw)


def refused(gw: GatewayProcess, body: dict[str, Any], param: str, status: int = 400) -> str:
    code, answer = post(gw, {"model": "hermes", "input": "Hi", **body})
    assert code == status, answer
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return str(error["message"])


# --------------------------------------------------------------------------- create


def test_create_answers_a_stored_response(env: tuple[GatewayProcess, Path]) -> None:
    gw, tmp = env
    client = alice(gw)
    answer = create(client, instructions=INSTRUCTIONS, input="Where is parcel 12?",
                    metadata={"ticket": "T-1"}, user="u-1")
    assert answer.object == "response" and answer.id.startswith("resp_")
    assert answer.status in ("completed", "incomplete")
    (message,) = [item for item in answer.output if item.type == "message"]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert answer.output_text == message.content[0].text
    assert answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    assert answer.metadata == {"ticket": "T-1"} and answer.user == "u-1"
    assert answer.instructions == INSTRUCTIONS and answer.store is True
    again = client.responses.retrieve(answer.id)
    assert again.model_dump() == answer.model_dump()
    # Kept on disk, owner-only.
    folder = tmp / "responses"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o600}


def test_input_items_of_every_kind(gw: GatewayProcess) -> None:
    """Messages of each role with text parts, and a function call with its output, in
    one input list (a client that keeps the conversation itself)."""
    answer = create(alice(gw), tools=[WEATHER], input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Snow, -3 C."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Snowing."}]},
        {"role": "user", "content": "And tomorrow?"}], tool_choice="none")
    assert answer.status in ("completed", "incomplete")
    assert [item.type for item in answer.output] == ["message"]


def test_stream_sends_the_events_in_order(gw: GatewayProcess) -> None:
    client = alice(gw)
    events = list(create(client, input="Stream it.", stream=True, max_output_tokens=5))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert deltas == list(range(4, 4 + len(deltas)))  # consecutive
    assert kinds[4 + len(deltas):] == ["response.output_text.done",
                                       "response.content_part.done",
                                       "response.output_item.done",
                                       "response.incomplete" if kinds[-1].endswith(
                                           "incomplete") else "response.completed"]
    text = "".join(events[i].delta for i in deltas)
    final = events[-1].response
    assert events[-4].text == text == final.output_text
    assert client.responses.retrieve(final.id).output_text == text


def test_reasoning_is_a_reasoning_item() -> None:
    """The think family's output read by the chat parser, answered as Responses items:
    a reasoning item, then the message, each opened, written and closed by its events.
    (Built from the parser directly: the tiny model's random weights do not open a
    <think> block by themselves.)"""
    parser = OutputParser(detect_format(THINK_TEMPLATE))
    request = parse_responses({"model": "think", "input": "Think first."})
    builder = ResponseBuilder(request)
    events = builder.start()
    for piece in ["<th", "ink>\nWeigh", " it.\n</think>\n\nSn", "ow."]:
        deltas = parser.feed(piece)
        builder.count_token(deltas)
        events += builder.feed(deltas)
    events += builder.feed(parser.close())
    done = pb.Completion(prompt_tokens=9, tokens=[5, 6, 7, 8], finish_reason="stop")
    body, closing = builder.finish(done, 4, {})
    kinds = [e["type"] for e in events + closing]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.reasoning_text.delta"]
    assert kinds.index("response.reasoning_text.done") < \
        kinds.index("response.output_text.delta")
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events + closing] == list(range(len(kinds)))
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and \
        reasoning["content"][0]["text"].strip() == "Weigh it."
    assert message["content"][0]["text"] == "Snow."
    # Tokens whose text was reasoning alone: "ink>\nWeigh" (the token that closes the
    # block also opens the answer, and "<th" had no text of its own yet).
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
    assert reply_messages(body["output"]) == [
        {"role": "assistant", "content": "Snow.",
         "reasoning_content": reasoning["content"][0]["text"]}]


# --------------------------------------------------------------------------- chains


def test_a_chain_of_four_reuses_every_earlier_turn(gw: GatewayProcess) -> None:
    """Each continuation resumes from the previous response's saved state, live on the
    worker: every token of that state (the earlier prompt and the reply as generated,
    but for its last sampled token, which was never decoded) is cached, exactly, and
    nothing after it: the state's tokens are taken as they are, never tokenized again,
    and only the rest (the template's end of the reply turn and the new user message)
    is prefilled."""
    client = alice(gw)
    turns = ["Where is parcel 12?", "And parcel 13?", "Is it late?", "Thanks, bye."]
    previous = None
    for i, text in enumerate(turns):
        answer = create(client, instructions=INSTRUCTIONS, input=text,
                        previous_response_id=previous.id if previous else None)
        kv = answer.model_extra["kvcache"]
        # The finish state: the prompt and the reply, all but its last sampled token.
        assert kv["state_tokens"] == answer.usage.input_tokens + \
            answer.usage.output_tokens - 1
        if previous is not None:
            state = previous.model_extra["kvcache"]["state_tokens"]
            assert answer.usage.input_tokens_details.cached_tokens == state, (i, kv)
            assert kv["tier"] == "live"
            # The new input: the turn's end as the template writes it ("<|im_end|>\n"
            # after the last reply token's text) and the user message.
            assert 0 < answer.usage.input_tokens - state < 60
        previous = answer
    metrics = gw.http("GET", "/metrics", headers={"Authorization": f"Bearer {ALICE}"})[2]
    assert b'responses_continued_total{how="state",model="hermes",tenant="alice"}' in metrics


def test_other_instructions_are_served_by_the_common_prefix_and_said_so(
        gw: GatewayProcess, tiny_hermes_model: Path) -> None:
    """Instructions are not carried over (OpenAI's rule): a continuation with other
    instructions renders a prompt that the stored state is not a prefix of. The worker
    says that, not "hash collision or wrong key", and the request reuses exactly the
    tokens the two prompts share (the instructions' common start)."""
    client = alice(gw)
    changed = INSTRUCTIONS + "Reply in French."
    first = create(client, instructions=INSTRUCTIONS, input="Where is parcel 40?",
                   prompt_cache_key="other-instructions")
    logged = len(gw.log())
    second = create(client, instructions=changed, input="And parcel 41?",
                    previous_response_id=first.id, prompt_cache_key="other-instructions")
    log = gw.log()[logged:]
    assert "hash collision" not in log
    assert "is not a prefix of the prompt" in log and "instructions" in log, log[-2000:]
    template = ChatTemplate(HERMES_TEMPLATE, bos_token="", eos_token="")
    with LlamaModel(tiny_hermes_model) as model:
        old, new = (model.tokenize(template.render([
            {"role": "system", "content": text}, {"role": "user", "content": "x"}]))
            for text in (INSTRUCTIONS, changed))
    shared = common_prefix(old, new)
    assert shared >= 64  # (a state is restored for no fewer)
    assert second.usage.input_tokens_details.cached_tokens == shared
    metrics = gw.http("GET", "/metrics", headers={"Authorization": f"Bearer {ALICE}"})[2]
    assert b'responses_continued_total{how="rendered",model="hermes",tenant="alice"}' in \
        metrics


def test_a_function_call_round_trip_by_previous_response(gw: GatewayProcess) -> None:
    client = alice(gw)
    first = create(client, instructions=INSTRUCTIONS, input="Weather in Oslo?",
                   tools=[WEATHER], tool_choice="required", max_output_tokens=200,
                   parallel_tool_calls=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"}
    assert first.tools[0].name == "get_weather"
    second = create(client, instructions=INSTRUCTIONS, previous_response_id=first.id,
                    tools=[WEATHER], tool_choice="none", input=[
                        {"type": "function_call_output", "call_id": call.call_id,
                         "output": "Snow, -3 C."}])
    assert [item.type for item in second.output] == ["message"]
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Streamed: the call's arguments arrive as deltas, then done.
    events = list(create(client, instructions=INSTRUCTIONS, input="Weather in Rome?",
                         tools=[WEATHER], tool_choice={"type": "function",
                                                       "name": "get_weather"},
                         max_output_tokens=200, parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = events[kinds.index("response.function_call_arguments.done")]
    assert json.loads(done.arguments)["city"] is not None
    assert events[-1].response.output[-1].arguments == done.arguments


def test_calls_left_without_their_outputs_are_refused_as_openai_does(
        gw: GatewayProcess) -> None:
    """A continuation of a response that ended in a function call must send the call's
    output: without it, OpenAI answers 400 naming the call, and so does the gateway,
    streamed or not, before anything is computed. Calls sent as input items are held to
    the same rule (each answered by call_id, wherever its output comes)."""
    client = alice(gw)
    first = create(client, instructions=INSTRUCTIONS, input="Weather in Bergen?",
                   tools=[WEATHER], tool_choice="required", max_output_tokens=200,
                   parallel_tool_calls=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            create(client, instructions=INSTRUCTIONS, previous_response_id=first.id,
                   tools=[WEATHER], input="And tomorrow?", stream=stream)
        assert err.value.body == {
            "message": f"No tool output found for function call {call.call_id}.",
            "type": "invalid_request_error", "param": "input", "code": None}
    calls = [{"type": "function_call", "call_id": f"call_{c}", "name": "get_weather",
              "arguments": json.dumps({"city": c})} for c in ("Oslo", "Rome")]
    answer = {"type": "function_call_output", "call_id": "call_Rome", "output": "Sun."}
    code, body = post(gw, {"model": "hermes", "input": [
        {"role": "user", "content": "Oslo and Rome?"}, *calls, answer], "tools": [WEATHER]})
    assert (code, body["error"]["message"]) == (
        400, "No tool output found for function call call_Oslo."), body
    answered = create(client, tools=[WEATHER], input=[
        {"role": "user", "content": "Oslo and Rome?"}, *calls, answer,
        {**answer, "call_id": "call_Oslo", "output": "Rain."}])
    assert answered.status in ("completed", "incomplete")


def test_structured_output_follows_the_schema(gw: GatewayProcess) -> None:
    client = alice(gw)
    parsed = client.responses.parse(model="hermes", input="Book a slot.", text_format=Slot,
                                    temperature=0, max_output_tokens=300)
    assert isinstance(parsed.output_parsed, Slot)
    code, refusal = post(gw, {"model": "hermes", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "bad", "schema": {"type": "object", "properties": {
            "a": {"$ref": "#/nowhere"}}}}}})
    assert code == 400 and refusal["error"]["param"].startswith("text.format"), refusal


# --------------------------------------------------------------------------- the store


def test_get_and_delete(gw: GatewayProcess) -> None:
    client = alice(gw)
    answer = create(client, input="Keep me.")
    assert client.responses.retrieve(answer.id).id == answer.id
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(answer.id)
    assert gone.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="Go on.", previous_response_id=answer.id)


def test_another_tenants_response_does_not_exist(gw: GatewayProcess) -> None:
    mine = create(alice(gw), input="Alice's secret.")
    bob = gw.client(api_key=BOB)
    for call in (lambda: bob.responses.retrieve(mine.id),
                 lambda: bob.responses.delete(mine.id),
                 lambda: create(bob, input="More?", previous_response_id=mine.id),
                 lambda: bob.responses.retrieve("resp_unknown")):
        with pytest.raises(openai.NotFoundError) as refused_:
            call()
        assert refused_.value.body["type"] == "invalid_request_error"
    assert alice(gw).responses.retrieve(mine.id).id == mine.id  # still there


def test_store_false_is_not_kept(gw: GatewayProcess) -> None:
    client = alice(gw)
    answer = create(client, input="Forget me.", store=False)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="Go on.", previous_response_id=answer.id)


def test_continuing_with_another_model_is_refused(gw: GatewayProcess) -> None:
    answer = create(alice(gw), input="Hermes here.")
    message = refused(gw, {"model": "think", "previous_response_id": answer.id},
                      "previous_response_id")
    assert "hermes" in message


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("body", "param"), [
    ({"foo": 1}, "foo"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "oops": 1}]}, "tools[0].oops"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input[0].tool_call_id"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"input": None}, "input"),
    ({"input": [{"role": "user", "content": "x"}] * 4097}, "input"),
])
def test_bad_input_is_one_clear_400(gw: GatewayProcess, body: dict[str, Any],
                                    param: str) -> None:
    refused(gw, body, param)


def test_every_documented_field_is_applied_or_refused(gw: GatewayProcess) -> None:
    """Each field of RESPONSES_FIELDS is read: a request with its neutral value works."""
    neutral = {"truncation": "disabled", "include": [], "reasoning": {},
               "service_tier": "auto", "background": False, "top_logprobs": 0,
               "stream_options": None, "parallel_tool_calls": False,
               "prompt_cache_key": "k", "user": "u", "metadata": {"a": "b"},
               "store": False, "stream": False, "max_output_tokens": 2, "top_p": 0.9,
               "temperature": 0, "instructions": "Short.", "tools": [WEATHER],
               "tool_choice": "none", "text": {"format": {"type": "text"}},
               "speculative": False}
    assert set(neutral) | {"model", "input", "previous_response_id", "max_tool_calls",
                           "conversation", "prompt", "safety_identifier"} == \
        set(RESPONSES_FIELDS)
    code, answer = post(gw, {"model": "hermes", "input": "Hi", **neutral})
    assert code == 200, answer
    assert answer["parallel_tool_calls"] is False and answer["top_p"] == 0.9


def test_unknown_response_is_a_404_in_openais_shape(gw: GatewayProcess) -> None:
    status, _, raw = gw.http("GET", "/v1/responses/resp_nope",
                             headers={"Authorization": f"Bearer {ALICE}"})
    error = json.loads(raw)["error"]
    assert status == 404 and error["code"] == "response_not_found" and error["param"] == "id"


# --------------------------------------------------------------------------- restarts


@pytest.fixture()
def small(tmp_path: Path, tiny_hermes_model: Path) -> Iterator[tuple[Path, DaemonProcess]]:
    daemon = DaemonProcess(tmp_path / "data").start()
    try:
        yield tmp_path, daemon
    finally:
        daemon.close()


def test_a_chain_goes_on_after_a_gateway_restart_and_bounds_drop_the_oldest(
        small: tuple[Path, DaemonProcess], tiny_hermes_model: Path) -> None:
    tmp, daemon = small
    models = [{"name": "hermes", "path": str(tiny_hermes_model),
               "args": ["--n-ctx", "2048", "--n-seq-max", "2"]}]
    bounds = ("--responses-max-count", "3")
    gateway = start_gateway(tmp, daemon, models, *bounds)
    pids = worker_pids(gateway)
    try:
        client = gateway.client()
        first = create(client, instructions=INSTRUCTIONS, input="Where is parcel 12?")
        second = create(client, instructions=INSTRUCTIONS, input="And parcel 13?",
                        previous_response_id=first.id)
        # The third turn on the live state (not stored), to compare with after the restart.
        live = create(client, instructions=INSTRUCTIONS, input="Is it late?",
                      previous_response_id=second.id, store=False)
        assert gateway.stop() == 0
        assert wait_gone(pids)
        gateway.close()
        gateway = start_gateway(tmp, daemon, models, *bounds)  # same store, same daemon
        pids = worker_pids(gateway)
        client = gateway.client()
        assert client.responses.retrieve(second.id).output_text == second.output_text
        third = create(client, instructions=INSTRUCTIONS, input="Is it late?",
                       previous_response_id=second.id)
        # Restored from the daemon (the new worker holds nothing live): the whole state.
        assert third.usage.input_tokens_details.cached_tokens == \
            second.model_extra["kvcache"]["state_tokens"]
        assert third.model_extra["kvcache"]["tier"] in ("ram", "disk")
        # The same tokens restored as reused live: the same reply.
        assert third.output_text == live.output_text
        assert third.usage.input_tokens == live.usage.input_tokens
        # Bound of 3: the fourth stored response drops the oldest (the first).
        create(client, input="Fourth.")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        for kept in (second, third):
            assert client.responses.retrieve(kept.id).id == kept.id
        metrics = gateway.http("GET", "/metrics")[2].decode()
        assert 'kvcache_gateway_responses_continued_total{how="state",model="hermes"' \
            in metrics
        assert 'kvcache_gateway_responses_stored_total{event="evicted"} 1.0' in metrics
        assert gateway.stop() == 0
        assert wait_gone(pids)
    finally:
        gateway.close()
        kill_leftovers(pids)


def test_a_state_gone_from_the_cache_is_rendered_again(
        small: tuple[Path, DaemonProcess], tiny_hermes_model: Path) -> None:
    """The daemon lost the state and the worker holds nothing live (killed): the
    continuation renders the stored conversation, prefills it, answers the same, and is
    counted as rendered."""
    tmp, daemon = small
    models = [{"name": "hermes", "path": str(tiny_hermes_model),
               "args": ["--n-ctx", "2048", "--n-seq-max", "2"]}]
    gateway = start_gateway(tmp, daemon, models)
    pids = worker_pids(gateway)
    empty = DaemonProcess(tmp / "empty").start()  # a cache that lost every state
    try:
        client = gateway.client()
        first = create(client, instructions=INSTRUCTIONS, input="Where is parcel 12?")
        assert gateway.stop() == 0
        assert wait_gone(pids)
        gateway.close()
        gateway = start_gateway(tmp, empty, models)
        pids = worker_pids(gateway)
        client = gateway.client()
        second = create(client, instructions=INSTRUCTIONS, input="And parcel 13?",
                        previous_response_id=first.id)
        assert second.usage.input_tokens_details.cached_tokens == 0
        whole = client.chat.completions.create(model="hermes", max_tokens=6, temperature=0,
                                               messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "Where is parcel 12?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And parcel 13?"}])
        assert whole.choices[0].message.content == second.output_text
        metrics = gateway.http("GET", "/metrics")[2].decode()
        assert 'kvcache_gateway_responses_continued_total{how="rendered",model="hermes"' \
            in metrics
        assert gateway.stop() == 0
        assert wait_gone(pids)
    finally:
        gateway.close()
        kill_leftovers(pids)
        empty.close()


def test_prompt_cache_key_and_user_keep_a_conversation_on_one_worker(
        small: tuple[Path, DaemonProcess], tiny_hermes_model: Path) -> None:
    """Two workers: requests sharing a prompt_cache_key (or a user) whose texts share
    nothing go to the worker the key last ran on, on both APIs."""
    tmp, daemon = small
    models = [{"name": "hermes", "path": str(tiny_hermes_model), "workers": 2,
               "args": ["--n-ctx", "1024", "--n-seq-max", "1"]}]
    gateway = start_gateway(tmp, daemon, models)
    pids = worker_pids(gateway)
    try:
        client = gateway.client()
        for key in ("k1", "k2"):
            served = {create(client, input=f"Question {i} {key}", prompt_cache_key=key,
                             max_output_tokens=2).model_extra["kvcache"]["worker"]
                      for i in range(3)}
            served |= {client.chat.completions.create(
                model="hermes", messages=[{"role": "user", "content": f"Other {i}"}],
                max_tokens=2, prompt_cache_key=key).model_extra["kvcache"]["worker"]
                for i in range(2)}
            assert len(served) == 1, served
        by_user = {create(client, input=f"User question {i}", user="u-7",
                          max_output_tokens=2).model_extra["kvcache"]["worker"]
                   for i in range(3)}
        assert len(by_user) == 1
        assert gateway.stop() == 0
        assert wait_gone(pids)
    finally:
        gateway.close()
        kill_leftovers(pids)


@pytest.mark.slow
def test_smollm2_a_chain_by_previous_response(tmp_path: Path) -> None:
    """SmolLM2 end to end: a chain of three continued from each reply's state (the whole
    state cached each time), streamed and not, and the same turns sent whole through
    chat completions answer the same (SmolLM2's greedy output is its tokenizer's own
    split, so rendering it again gives the same tokens)."""
    daemon = DaemonProcess(tmp_path / "data").start()
    gateway = GatewayProcess(tmp_path / "gateway.log", "--n-ctx", "2048", "--n-seq-max", "2",
                             "--responses-dir", str(tmp_path / "responses"),
                             cache=daemon.address)
    pids: list[int] = []
    try:
        gateway.start(timeout=300)
        pids = worker_pids(gateway)
        client = gateway.client(timeout=300)
        (model,) = [m.id for m in client.models.list()]
        history: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
        previous = None
        for i, text in enumerate(["Where is parcel 12?", "And parcel 13?", "Which is first?"]):
            kwargs = {"model": model, "instructions": INSTRUCTIONS, "input": text,
                      "max_output_tokens": 24, "temperature": 0,
                      "previous_response_id": previous.id if previous else None}
            if i == 1:
                events = list(client.responses.create(stream=True, **kwargs))
                answer = events[-1].response
            else:
                answer = client.responses.create(**kwargs)
            history.append({"role": "user", "content": text})
            if previous is not None:
                assert answer.usage.input_tokens_details.cached_tokens == \
                    previous.model_extra["kvcache"]["state_tokens"]
            whole = client.chat.completions.create(model=model, messages=history,
                                                   max_tokens=24, temperature=0)
            assert whole.choices[0].message.content == answer.output_text
            history.append({"role": "assistant", "content": answer.output_text})
            previous = answer
        assert gateway.stop() == 0
        assert wait_gone(pids)
    finally:
        gateway.close()
        kill_leftovers(pids)
        daemon.close()


def test_failures_are_told_in_openais_shape_and_the_gateway_keeps_serving(
        small: tuple[Path, DaemonProcess], tiny_model_no_eog: Path) -> None:
    """A store that cannot be written (a folder where its file goes): a 500 ``store_failed``, or
    an error event when streamed, never a response said to be stored that is not; a
    worker killed in the middle of a stream: an error event. Then the gateway serves on
    (store false, and a new worker after the restart)."""
    tmp, daemon = small
    (tmp / "responses" / "responses.sqlite3").mkdir(parents=True)
    models = [{"name": "tiny", "path": str(tiny_model_no_eog),
               "args": ["--n-ctx", "4096", "--n-seq-max", "1"]}]
    gateway = start_gateway(tmp, daemon, models)
    pids = worker_pids(gateway)
    try:
        client = gateway.client()
        with pytest.raises(openai.InternalServerError) as failed:
            create(client, model="tiny", input="Store me.")
        assert failed.value.body["code"] == "store_failed"
        with pytest.raises(openai.APIError) as failed_stream:
            list(create(client, model="tiny", input="Store me.", stream=True))
        assert failed_stream.value.body["code"] == "store_failed"
        assert create(client, model="tiny", input="Do not.", store=False).output_text
        # The model never ends by itself: a stream that is still going when its worker
        # is killed.
        stream = create(client, model="tiny", input="Go on.", store=False, stream=True,
                        max_output_tokens=3000)
        seen = []
        with pytest.raises(openai.APIError) as broken:
            for event in stream:
                seen.append(event.type)
                if len(seen) == 8:
                    os.kill(pids[0], signal.SIGKILL)
        assert "response.output_text.delta" in seen
        assert broken.value.body["type"] == "server_error"
        assert broken.value.body["code"] == "worker_died"
        after = create(client, model="tiny", input="Still there?", store=False)
        assert after.status == "incomplete" and after.output_text
        pids = worker_pids(gateway)
        assert gateway.stop() == 0
        assert wait_gone(pids)
    finally:
        gateway.close()
        kill_leftovers(pids)
