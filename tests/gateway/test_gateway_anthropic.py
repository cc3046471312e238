"""The Anthropic Messages API with Anthropic's own client against a real gateway, a real
worker (the tiny model with a Hermes-style tool template, one thread) and a real cache
daemon: create, stream (events in order), forced tool use, a tool_result round trip,
cache_control's usage fields and expiring pins, count_tokens, errors and x-api-key."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anthropic
import pytest
from harness.make_tiny_gguf import HERMES_TEMPLATE, THINK_TEMPLATE
from harness.payloads import payload_for
from harness.system_prompt import build_system_prompt

from kvcache.client import CacheClient, CacheError
from model_runtime.chat.formats import detect_format
from model_runtime.chat.parsing import OutputParser
from model_runtime.chat.prompt import plan_chat
from model_runtime.chat.templates import ChatTemplate
from model_runtime.gateway.apis.anthropic.adapter import error_body, parse_messages_request
from model_runtime.gateway.apis.anthropic.formatter import BlockStream
from model_runtime.gateway.errors import ApiError
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import IDENT, toks
from tests.support.gateway_proc import GatewayProcess, Gateways, kill_leftovers, model_entry

KEY = "k" * 40  # the key file's one key (an operator's: the fixture reads /status)
SYSTEM = ("You are the dispatcher of a delivery company. Answer briefly; look things up with "
          "the tools rather than guessing. ") * 4
WEATHER = {"name": "get_weather", "description": "The weather in a city today.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0}
SHORT_TTL = 5  # seconds a "1h" cache_control pins its entry in this gateway (--cache-ttl)


class Gateway:
    def __init__(self, process: GatewayProcess, daemon: DaemonProcess) -> None:
        self.process = process
        self.daemon = daemon
        self.url = process.url

    def client(self, **kwargs: Any) -> anthropic.Anthropic:
        """Anthropic's client (x-api-key), without retries: every answer is seen."""
        kwargs.setdefault("api_key", KEY)
        return anthropic.Anthropic(base_url=self.url, max_retries=0, timeout=60.0, **kwargs)

    def cache(self) -> CacheClient:
        return CacheClient(self.daemon.address)


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_hermes_model: Path) -> Gateway:
    gateway = gateways.start("anthropic", models=[
        model_entry("hermes", tiny_hermes_model, "--n-ctx", "2048", "--n-seq-max", "2")],
        keys=f"{KEY} acme role=admin\n", args=("--cache-ttl", f"1h={SHORT_TTL}"),
        admin_key=KEY)
    return Gateway(gateway, gateways.daemon(gateway))


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_create_with_every_sampling_field(gw: Gateway) -> None:
    client = gw.client()
    reply = client.messages.create(
        model="hermes", max_tokens=6, system=SYSTEM, messages=user("Where is parcel 12?"),
        stop_sequences=["\n\n\n"], metadata={"user_id": "dispatcher-7"},
        # (the SDK no longer names the sampling fields; the API takes them)
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "hermes"
    assert reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert 1 <= reply.usage.output_tokens <= 6
    # No cache_control: the three input fields add up to the prompt; none was "created".
    assert reply.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model="hermes", system=SYSTEM,
                                           messages=user("Where is parcel 12?"))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_stop_sequence_is_named(gw: Gateway) -> None:
    """A stop sequence that ends the text is reported with stop_reason stop_sequence."""
    client = gw.client()
    free = client.messages.create(model="hermes", max_tokens=12, extra_body=GREEDY,
                                  messages=user("Say anything."))
    text = free.content[0].text
    assert len(text) >= 2, "the greedy reply is needed to pick a stop sequence from"
    stop = text[len(text) // 2:len(text) // 2 + 1]
    stopped = client.messages.create(model="hermes", max_tokens=12, extra_body=GREEDY,
                                      messages=user("Say anything."), stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stop not in stopped.content[0].text


def sse_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a server-sent event stream, in order."""
    out = []
    for block in body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_stream_sends_anthropic_events_in_order(gw: Gateway) -> None:
    status, headers, body = gw.process.http("POST", "/v1/messages", json.dumps({
        "model": "hermes", "max_tokens": 8, "system": SYSTEM, "stream": True,
        "messages": user("Stream it.")}).encode(),
        {"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    kinds = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)  # as Anthropic sends them
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[2:-2]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) <= {"content_block_delta"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 1 <= delta["usage"]["output_tokens"] <= 8
    # The SDK's stream helper puts the same events together into the message.
    client = gw.client()
    with client.messages.stream(model="hermes", max_tokens=8, system=SYSTEM,
                                messages=user("Stream it."), extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == streamed
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens >= 1
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0


def check_weather_input(value: dict[str, Any]) -> None:
    """The input follows WEATHER's schema: exactly a city, a string of at most 8."""
    assert set(value) == {"city"} and isinstance(value["city"], str)
    assert len(value["city"]) <= 8


def test_forced_tool_use_and_tool_result_round_trip(gw: Gateway) -> None:
    client = gw.client()
    question = user("What is the weather in Oslo?")
    reply = client.messages.create(model="hermes", max_tokens=200, system=SYSTEM,
                                   messages=question, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    check_weather_input(calls[0].input)
    # Streamed: the call's input arrives as input_json_delta pieces of its JSON.
    events = list(client.messages.create(
        model="hermes", max_tokens=200, system=SYSTEM, messages=question, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, stream=True, extra_body=GREEDY))
    start = next(e for e in events if e.type == "content_block_start"
                 and e.content_block.type == "tool_use")
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                     and e.index == start.index)
    check_weather_input(json.loads(pieces))
    assert events[-2].delta.stop_reason == "tool_use"
    # The result goes back, as text blocks and as a failed call; the turn continues.
    for result in ({"content": [{"type": "text", "text": "Rain, 4 C."}]},
                   {"content": "the weather service is down", "is_error": True}):
        follow = client.messages.create(
            model="hermes", max_tokens=6, system=SYSTEM, tools=[WEATHER], messages=[
                *question, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": calls[0].id, "name": calls[0].name,
                     "input": calls[0].input}]},
                {"role": "user", "content": [{"type": "tool_result",
                                              "tool_use_id": calls[0].id, **result}]}])
        assert follow.content and follow.usage.output_tokens >= 1
        assert follow.usage.cache_read_input_tokens > 0  # the earlier turns' KV was reused
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="hermes", max_tokens=6, tools=[WEATHER], messages=[
            *question, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "x"}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith(
        "messages.1.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
        "toolu_unknown.")


def cached_system(text: str, ttl: str | None = None) -> list[dict[str, Any]]:
    control: dict[str, Any] = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": text, "cache_control": control}]


def test_cache_control_reports_creation_then_reads(gw: Gateway) -> None:
    client = gw.client()
    system = cached_system("You catalogue rare stamps for a museum in Bergen. " * 8)
    first = client.messages.create(model="hermes", max_tokens=4, system=system,
                                   messages=user("How old is the blue one?"))
    u1 = first.usage
    # (A few leading tokens may be read from an earlier test's live sequence.)
    assert u1.cache_creation_input_tokens >= 64 > u1.cache_read_input_tokens
    second = client.messages.create(model="hermes", max_tokens=4, system=system,
                                    messages=user("Which one is the rarest of all?"))
    u2 = second.usage
    restored = second.model_extra["kvcache"]["tokens_restored"]
    assert u2.cache_read_input_tokens == restored >= u1.cache_creation_input_tokens
    assert u2.cache_creation_input_tokens == 0  # the breakpoint's state was read
    counted = client.messages.count_tokens(model="hermes", system=system,
                                           messages=user("Which one is the rarest of all?"))
    assert u2.input_tokens + u2.cache_read_input_tokens == counted.input_tokens


INPUT_SIDE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def test_message_start_carries_the_input_side_of_usage(gw: Gateway) -> None:
    """Streamed, message_start reports the prompt's tokens as Anthropic's does (input,
    cache creation, cache read), before any content: the SDK's message snapshot has
    them at the first event, and message_delta's final figures are the same; the first
    turn creates the breakpoint's cache, the second reads it."""
    client = gw.client()
    system = cached_system("You value antique clocks for an auction house in Ghent. " * 8)
    counted = client.messages.count_tokens(model="hermes", system=system,
                                           messages=user("How old is the brass one?"))
    for turn in ("create", "read"):
        with client.messages.stream(model="hermes", max_tokens=4, system=system,
                                    messages=user("How old is the brass one?"),
                                    extra_body=GREEDY) as stream:
            events = iter(stream)
            start = next(events)
            assert start.type == "message_start"
            at_start = stream.current_message_snapshot.usage.model_dump()
            rest = list(events)
        final = [e for e in rest if e.type == "message_delta"][-1].usage.model_dump()
        assert {k: at_start[k] for k in INPUT_SIDE} == {k: final[k] for k in INPUT_SIDE}
        assert sum(at_start[k] for k in INPUT_SIDE) == counted.input_tokens
        if turn == "create":
            assert at_start["cache_creation_input_tokens"] >= 64
        else:
            assert at_start["cache_creation_input_tokens"] == 0
            assert at_start["cache_read_input_tokens"] >= 64
    # Raw events: the same fields in message_start's data, as Anthropic writes them.
    status, _, body = gw.process.http("POST", "/v1/messages", json.dumps({
        "model": "hermes", "max_tokens": 4, "system": system, "stream": True,
        "messages": user("How old is the brass one?")}).encode(), {"x-api-key": KEY})
    assert status == 200
    events_seen = sse_events(body)
    start_usage = events_seen[0][1]["message"]["usage"]
    delta_usage = events_seen[-2][1]["usage"]
    assert {k: start_usage[k] for k in INPUT_SIDE} == {k: delta_usage[k] for k in INPUT_SIDE}
    assert start_usage["cache_read_input_tokens"] >= 64 and start_usage["output_tokens"] == 0


def test_top_level_cache_control_caches_the_conversation_so_far(gw: Gateway) -> None:
    """Automatic caching: the breakpoint is the end of the last message, so the next turn
    reads everything before its new messages."""
    client = gw.client()
    system = "You keep the logbook of a fishing boat off Lofoten. " * 6
    turn = user("Log the morning catch.")
    first = client.messages.create(model="hermes", max_tokens=3, system=system,
                                   messages=turn, cache_control={"type": "ephemeral"},
                                   extra_body=GREEDY)
    held = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.cache_creation_input_tokens > 0
    assert held > first.usage.input_tokens  # all but the assistant turn's opening
    second = client.messages.create(
        model="hermes", max_tokens=3, system=system, cache_control={"type": "ephemeral"},
        messages=[*turn, {"role": "assistant", "content": first.content[0].text or "ok"},
                  *user("And the evening's?")], extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= held


def test_output_config_holds_the_reply_to_a_schema(gw: Gateway) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    reply = gw.client().messages.create(
        model="hermes", max_tokens=60, messages=user("Is it raining?"), extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert reply.stop_reason == "end_turn"
    assert json.loads(reply.content[0].text)["answer"] in ("yes", "no")


def pinned_entries(cache: CacheClient) -> list[Any]:
    return [e for e in cache.list_entries() if e.pinned]


def test_ttl_pins_the_breakpoint_until_it_expires(gw: Gateway) -> None:
    client = gw.client()
    system = cached_system("You answer questions about lighthouses of Norway. " * 8, "1h")
    before = time.time()
    reply = client.messages.create(model="hermes", max_tokens=4, system=system,
                                   messages=user("Which is the oldest?"))
    # The breakpoint's entry holds the tokens this request created and any it read.
    created = reply.usage.cache_creation_input_tokens + reply.usage.cache_read_input_tokens
    assert reply.usage.cache_creation_input_tokens >= 64
    with gw.cache() as cache:
        def short_pins() -> list[Any]:  # (the other tests' breakpoints pin for 5 minutes)
            return [e for e in pinned_entries(cache) if e.n_tokens == created and
                    0 < e.pin_expires <= time.time() + SHORT_TTL]

        wait_for(lambda: bool(short_pins()), "the breakpoint's pin")
        (entry,) = short_pins()
        assert before + SHORT_TTL - 1 <= entry.pin_expires <= time.time() + SHORT_TTL
        assert cache.inspect(entry.key).entry.pin_expires == entry.pin_expires
        # The same breakpoint asked for again: its pin is extended.
        time.sleep(1.0)
        again = client.messages.create(model="hermes", max_tokens=4, system=system,
                                       messages=user("Which is the tallest?"))
        assert again.usage.cache_read_input_tokens >= created
        wait_for(lambda: cache.inspect(entry.key).entry.pin_expires > entry.pin_expires,
                 "the pin extended")
        # Released by time.
        wait_for(lambda: not cache.inspect(entry.key).entry.pinned, "the pin released",
                 timeout=SHORT_TTL + 10)
        assert cache.inspect(entry.key).entry.pin_expires == 0


def test_expiring_pin_survives_a_daemon_restart(daemon_factory: Any) -> None:
    d = daemon_factory()
    with d.client() as c:
        tokens = toks(9100, 40)
        key = c.save(IDENT, tokens, payload_for(tokens, 2000), "cold").key
        c.pin(key, ttl_seconds=3600)
        ends = c.inspect(key).entry.pin_expires
        assert time.time() + 3590 < ends <= time.time() + 3600
        c.pin(key, ttl_seconds=5)  # a shorter pin never shortens it
        with pytest.raises(CacheError, match="ttl_seconds"):
            c.pin(key, ttl_seconds=-1)
        assert c.inspect(key).entry.pin_expires == ends
    listed = subprocess.run([sys.executable, "-m", "kvcache.cli", "ls", "-a", d.address],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and " left" in listed.stdout, listed.stdout + listed.stderr
    d.restart()
    with d.client() as c:
        entry = c.inspect(key).entry
        assert entry.pinned and entry.pin_expires == ends  # kept in the index
        c.unpin(key)
        c.pin(key, ttl_seconds=8)
    d.restart()
    with d.client() as c:
        assert c.inspect(key).entry.pinned
        wait_for(lambda: not c.inspect(key).entry.pinned, "released after the restart")
        c.pin(key)  # a pin without a ttl has no end
        assert c.inspect(key).entry.pinned and c.inspect(key).entry.pin_expires == 0
        c.pin(key, ttl_seconds=1)  # ... and an expiring pin does not give it one
        assert c.inspect(key).entry.pin_expires == 0


def test_errors_in_anthropic_shape(gw: Gateway) -> None:
    client = gw.client()

    def refused(status: int, kind: str, **body: Any) -> str:
        with pytest.raises(anthropic.APIStatusError) as err:
            client.messages.create(**body)
        assert err.value.status_code == status, err.value.body
        assert err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == kind
        return err.value.body["error"]["message"]

    ask = user("Hello?")
    # The SDK itself requires max_tokens: the body is sent without it by hand.
    status, _, body = gw.process.http("POST", "/v1/messages", json.dumps(
        {"model": "hermes", "messages": ask}).encode(), {"x-api-key": KEY})
    error = json.loads(body)
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    bad_schema = {**WEATHER, "input_schema": {"type": "string"}}
    assert "input_schema" in refused(400, "invalid_request_error", model="hermes",
                                     max_tokens=4, messages=ask, tools=[bad_schema])
    # One the grammar cannot hold the input to, and two tools of one name: named as
    # Anthropic names the place.
    unusable = {**WEATHER, "input_schema": {"type": "object", "properties": {
        "city": {"$ref": "#/$defs/nowhere"}}}}
    assert refused(400, "invalid_request_error", model="hermes", max_tokens=4,
                   messages=ask, tools=[unusable]).startswith("tools.0.input_schema")
    assert refused(400, "invalid_request_error", model="hermes", max_tokens=4,
                   messages=ask, tools=[WEATHER, WEATHER]).startswith("tools.1.name")
    assert "role" in refused(400, "invalid_request_error", model="hermes", max_tokens=4,
                             messages=[{"role": "system", "content": "x"}])
    assert "nope" in refused(404, "not_found_error", model="nope", max_tokens=4,
                             messages=ask)
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=ask,
            thinking={"type": "enabled", "budget_tokens": 2048})
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=ask,
            extra_body={"frequency_penalty": 1})
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=ask,
            system=[{"type": "text", "text": "x", "cache_control": {"type": "forever"}}])
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=[
        *ask, {"role": "assistant", "content": "Well,"}])
    refused(400, "invalid_request_error", model="hermes", max_tokens=4000, messages=ask)
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=ask,
            output_config={"effort": "high"})
    refused(400, "invalid_request_error", model="hermes", max_tokens=4, messages=ask,
            output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}})
    marks = [{"type": "text", "text": f"{i}", "cache_control": {"type": "ephemeral"}}
             for i in range(5)]
    assert "4 blocks" in refused(400, "invalid_request_error", model="hermes", max_tokens=4,
                                 messages=ask, system=marks)
    status, _, body = gw.process.http("GET", "/v1/messages/nothing", None,
                                      {"x-api-key": KEY})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ask)
    # Over --max-body-bytes: refused by its length before a byte is read (the connection
    # is then closed, so the client sends a little and reads the answer).
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/messages")
        for name, value in (("x-api-key", KEY), ("Content-Type", "application/json"),
                            ("Content-Length", str(5 << 20))):
            conn.putheader(name, value)
        conn.endheaders(b" " * 1024)
        answer = conn.getresponse()
        assert answer.status == 413
        assert json.loads(answer.read())["error"]["type"] == "request_too_large"
    finally:
        conn.close()
    # Still serving.
    assert client.messages.create(model="hermes", max_tokens=2, messages=ask).content


def test_error_types_follow_anthropic_statuses() -> None:
    """The gateway's refusals as Anthropic answers them: a busy server's 429, a worker not
    ready (or failed) as 529 overloaded, a busy session's 409 as a 400."""
    cases = {429: (429, "rate_limit_error"), 503: (529, "overloaded_error"),
             409: (400, "invalid_request_error"), 500: (500, "api_error"),
             403: (403, "permission_error")}
    for given, (status, kind) in cases.items():
        answer, body = error_body(ApiError(given, "why", param="model"))
        assert answer == status and body == {"type": "error", "error": {
            "type": kind, "message": "model: why"}}


def test_x_api_key_and_bearer_auth(gw: Gateway) -> None:
    for client in (gw.client(api_key="wrong-" + "x" * 40), gw.client(api_key=None,
                                                                   auth_token="nope")):
        with pytest.raises(anthropic.AuthenticationError) as err:
            client.messages.create(model="hermes", max_tokens=2, messages=user("Hi"))
        assert err.value.body["error"]["type"] == "authentication_error"
    status, _, body = gw.process.http("POST", "/v1/messages", b"{}",
                                      {"anthropic-version": "2023-06-01"})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    bearer = gw.client(api_key=None, auth_token=KEY)
    assert bearer.messages.create(model="hermes", max_tokens=2, messages=user("Hi")).content
    assert gw.client().messages.count_tokens(model="hermes",
                                             messages=user("Hi")).input_tokens > 0


def test_thinking_output_becomes_thinking_blocks() -> None:
    """The chat front end's parse of a reasoning model's output (the tiny <think> model's
    template: its random weights never write the tags themselves), as Anthropic's events:
    the <think> part a thinking block (thinking_delta), the rest a text block."""
    parser = OutputParser(detect_format(THINK_TEMPLATE))
    blocks = BlockStream()
    events = [e for piece in ("<think>\nweigh", " it</think>\n\nIt ", "rains.")
              for d in parser.feed(piece) for e in blocks.feed(d)]
    events += [e for d in parser.close() for e in blocks.feed(d)] + blocks.finish()
    kinds = [(name, data.get("content_block", data.get("delta", {})).get("type"))
             for name, data in events]
    assert kinds[0] == ("content_block_start", "thinking")
    assert ("content_block_delta", "thinking_delta") in kinds
    assert ("content_block_start", "text") in kinds and kinds[-1][0] == "content_block_stop"
    thinking = "".join(d["delta"]["thinking"] for n, d in events
                       if n == "content_block_delta" and d["delta"]["type"] == "thinking_delta")
    text = "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert "weigh it" in thinking and text == "It rains."


def test_breakpoints_are_the_ends_of_their_messages() -> None:
    """Each cache_control mark is the end of the message holding it as the template
    renders it (a tool's: the system message's), sent to the runtime as boundary_chars
    with its ttl's seconds, in place of the system message's end."""
    mark = {"type": "ephemeral"}
    mreq = parse_messages_request({
        "model": "m", "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{**WEATHER, "cache_control": mark}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Oslo?",
                                          "cache_control": {**mark, "ttl": "1h"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "Rain.", "is_error": True}]}]},
        {"5m": 300, "1h": 3600})
    chat = mreq.request.chat
    assert chat is not None
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[3].content == "Error: Rain."
    assert mreq.request.breakpoint_ttls == {0: 300, 1: 3600}
    template = ChatTemplate(HERMES_TEMPLATE, eos_token="<|im_end|>")
    plan = plan_chat(template, detect_format(HERMES_TEMPLATE), chat)
    (system, system_end), (user_index, user_end) = plan.boundaries
    assert (system, user_index) == (0, 1)
    assert plan.text[:system_end].rstrip().endswith("<|im_end|>")
    assert "get_weather" in plan.text[:system_end]  # the tools are in the system message
    assert plan.text[:user_end].rstrip().endswith("Oslo?<|im_end|>")
    proto = mreq.request.to_proto(plan)
    assert proto.prefix_chars == 0
    assert list(proto.boundary_chars) == [system_end, user_end]
    assert list(proto.boundary_ttl_seconds) == [300, 3600]


def test_tool_use_and_tool_result_pair_up_as_anthropic_requires() -> None:
    """Each tool_use is answered in the next (user) turn and each tool_result answers a
    tool_use of the turn before it; otherwise one 400 in Anthropic's own words, naming
    its message (Anthropic's index, not the chat's)."""
    def refusal(messages: list[dict[str, Any]]) -> str:
        with pytest.raises(ApiError) as err:
            parse_messages_request({"model": "m", "max_tokens": 8, "tools": [WEATHER],
                                    "messages": messages}, {})
        status, body = error_body(err.value)
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        return str(body["error"]["message"])

    ask = user("Oslo and Rome?")
    calls = {"role": "assistant", "content": [
        {"type": "text", "text": "Looking."},
        *({"type": "tool_use", "id": f"toolu_{city}", "name": "get_weather",
           "input": {"city": city}} for city in ("oslo", "rome"))]}

    def results(*ids: str) -> dict[str, Any]:
        return {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": "Rain."} for i in ids]}

    assert refusal([*ask, calls, *user("And Paris?")]) == (
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately "
        "after: toolu_oslo, toolu_rome. Each `tool_use` block must have a corresponding "
        "`tool_result` block in the next message.")
    assert refusal([*ask, calls, results("toolu_rome")]).startswith(
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately "
        "after: toolu_oslo.")
    assert refusal([*ask, calls, results("toolu_oslo", "toolu_rome", "toolu_paris")]) == (
        "messages.2.content.2: unexpected `tool_use_id` found in `tool_result` blocks: "
        "toolu_paris. Each `tool_result` block must have a corresponding `tool_use` block "
        "in the previous message.")
    # An answer to a call two turns back is no answer: the previous turn's calls only.
    answered = [*ask, calls, results("toolu_oslo", "toolu_rome"),
                {"role": "assistant", "content": "Rain in both."}]
    assert refusal([*answered, results("toolu_oslo")]).startswith(
        "messages.4.content.0: unexpected `tool_use_id`")
    assert refusal([results("toolu_oslo")]).startswith("messages.0.content.0: unexpected")
    chat = parse_messages_request({"model": "m", "max_tokens": 8, "tools": [WEATHER],
                                   "messages": [*answered, *user("Thanks.")]}, {}).request.chat
    assert chat is not None
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool",
                                               "assistant", "user"]


@pytest.mark.slow
def test_smollm2_through_the_messages_api(tmp_path: Path) -> None:
    """The real default model: a cached system prompt read back on the next question, the
    streamed reply equal to the whole one, the key in x-api-key."""
    daemon = DaemonProcess(tmp_path / "data").start()
    gateway = GatewayProcess(tmp_path / "gateway.log", "--n-ctx", "2048", "--n-seq-max", "2",
                             cache=daemon.address)
    pids: list[int] = []
    try:
        gateway.start(timeout=300)
        pids = [w["pid"] for w in gateway.status()["workers"]]
        client = anthropic.Anthropic(base_url=gateway.url, api_key="unused-on-loopback",
                                     max_retries=0, timeout=300.0)
        model = gateway.client().models.list().data[0].id
        system = cached_system(build_system_prompt(300))
        first = client.messages.create(model=model, max_tokens=24, system=system,
                                       messages=user("What is the warranty of the Atlas "
                                                     "Notebook?"), extra_body=GREEDY)
        assert first.content[0].text.strip()
        assert first.usage.cache_creation_input_tokens > 300
        question = user("How do I get a refund?")
        second = client.messages.create(model=model, max_tokens=24, system=system,
                                        messages=question, extra_body=GREEDY)
        assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
        with client.messages.stream(model=model, max_tokens=24, system=system,
                                    messages=question, extra_body=GREEDY) as stream:
            streamed = "".join(stream.text_stream)
        assert streamed == second.content[0].text
    finally:
        gateway.close()
        kill_leftovers(pids)
        daemon.close()
