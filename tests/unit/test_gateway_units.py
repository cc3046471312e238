"""The gateway's pure parts: OpenAI request parsing and response shapes, routing, API keys,
settings, the log ring and the stall rule. No processes here."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from model_runtime.gateway.apis.openai.adapter import parse_chat, parse_completion
from model_runtime.gateway.apis.openai.formatter import (
    OpenAIFormatter,
    chunk,
    sse,
    text_chunk_template,
    usage,
)
from model_runtime.gateway.errors import ApiError
from model_runtime.gateway.keys import (
    ApiKeys,
    Caller,
    KeyConfigError,
    check_listener,
    is_loopback,
)
from model_runtime.gateway.limits import Limits, parse_json
from model_runtime.gateway.pipeline.refusals import refusal_error
from model_runtime.gateway.pipeline.request import served_text
from model_runtime.gateway.settings import (
    GatewaySettings,
    ModelSpec,
    SettingsError,
    Supervision,
    load_config,
    split_listen,
)
from model_runtime.gateway.workers.errors import RuntimeRefused
from model_runtime.gateway.workers.process import (
    ProcessHooks,
    RuntimeInfo,
    RuntimeProcess,
    process_cpu_seconds,
)
from model_runtime.gateway.workers.ring import LogRing
from model_runtime.gateway.workers.router import (
    MIN_ROUTE_CHARS,
    NoFreeSlot,
    NoReadyWorker,
    PrefixTracker,
    SessionMap,
    choose,
    common_prefix_len,
    tenant_text,
)
from model_runtime.gateway.workers.slots import Flight
from model_runtime.gateway.workers.supervisor import READY
from model_runtime.v1 import runtime_pb2 as pb

# --------------------------------------------------------------------------- openai_api


def test_chat_defaults_follow_openai() -> None:
    call = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    req = call.request
    assert (req.temperature, req.top_p, req.max_tokens, req.seed) == (1.0, 1.0, None, None)
    assert not req.stream and not call.include_usage and req.stop == []
    proto = req.to_proto()
    assert proto.max_tokens == 0 and proto.until_context_full  # no limit given
    assert not proto.HasField("seed")
    assert proto.whole  # not streamed: the runtime sends the text with the end


def test_chat_fields_are_mapped() -> None:
    call = parse_chat({
        "model": "m", "max_tokens": 5, "max_completion_tokens": 7, "seed": 3, "stop": "END",
        "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None}]},
        session_header="from-header")
    req = call.request
    assert req.max_tokens == 7 and req.seed == 3 and req.stop == ["END"]
    proto = req.to_proto()  # a limit given: it must fit with the prompt, or be refused
    assert proto.max_tokens == 7 and not proto.until_context_full
    assert not proto.whole  # streamed: each piece as it comes
    assert call.include_usage and req.session_id == "from-header"
    assert req.chat is not None
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("developer", "be brief"), ("user", "ab"), ("assistant", "")]
    body_wins = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "session_id": "from-body"}, session_header="from-header")
    assert body_wins.request.session_id == "from-body"


def test_image_parts_are_refused() -> None:
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    assert err.value.status == 400 and err.value.param == "messages[0].content[0]"
    assert "cannot read images" in err.value.message


def test_completion_prompts() -> None:
    assert parse_completion({"model": "m", "prompt": ["one"]}).request.prompt == "one"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).request.tokens == [1, 2, 3]
    assert parse_completion({"model": "m", "prompt": [[4, 5]]}).request.tokens == [4, 5]
    for bad in (["a", "b"], [], "", None, [1.5], [True]):
        with pytest.raises(ApiError) as err:
            parse_completion({"model": "m", "prompt": bad})
        assert err.value.param == "prompt"
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "m", "prompt": "x", "echo": True})
    assert err.value.code == "unsupported_parameter"


def test_parse_json_refuses_what_is_not_an_object() -> None:
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for body in (b"{", b"[]", b"\xff", b"null"):
        with pytest.raises(ApiError) as err:
            parse_json(body)
        assert err.value.status == 400 and err.value.body()["error"]["code"] == "invalid_json"


def test_usage_caps_cached_tokens_at_the_prompt() -> None:
    done = pb.Completion(prompt_tokens=10, tokens=[1, 2, 3],
                         cache_delta=pb.CacheDelta(tokens_read=12))
    assert usage(done) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                           "prompt_tokens_details": {"cached_tokens": 10}}


def test_chunks_have_openai_s_shape() -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "stream": True, "stream_options": {"include_usage": True}})
    first = chunk(req, "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk(req, usage_body={"prompt_tokens": 1})
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 1}
    text = parse_completion({"model": "m", "prompt": "p", "stream": True})
    body = chunk(text, "abc")
    assert body["object"] == "text_completion" and "usage" not in body
    assert body["choices"][0]["text"] == "abc"


TRICKY_TEXTS = ["", "abc", ' "quoted" ', "back\\slash", "line\nbreak\ttab", "\x00\x1f",
                "ünïcödé", "日本語", "\U0001f600", "</script>", "\u2028\u2029"]


def test_a_text_chunk_made_from_its_template_is_the_chunk_made_whole() -> None:
    # The stream's token chunks come from a template made once per choice: byte for
    # byte the chunk made and encoded whole, for chat and completions, with and without
    # the usage field, any choice, any model name, any text.
    for model in ("m", 'a "quoted" \\ model', "модель"):
        for include_usage in (False, True):
            options = {"stream_options": {"include_usage": True}} if include_usage else {}
            chat = parse_chat({"model": model, "messages": [{"role": "user", "content": "x"}],
                               "stream": True, "n": 2, **options})
            text = parse_completion({"model": model, "prompt": "p", "stream": True, "n": 2,
                                     **options})
            for call in (chat, text):
                for index in (0, 1):
                    template = text_chunk_template(call, index)
                    assert template is not None
                    for piece in TRICKY_TEXTS:
                        whole = sse(chunk(call, delta={"content": piece}, index=index)
                                    if call.chat else chunk(call, piece, index=index))
                        made = (template[0] + json.dumps(piece, ensure_ascii=False)
                                + template[1]).encode()
                        assert made == whole, (model, include_usage, index, piece)


def test_a_completion_s_streamed_token_is_its_chunk() -> None:
    call = parse_completion({"model": "m", "prompt": "p", "stream": True, "logprobs": 1})
    formatter = OpenAIFormatter(call, None, "w0", "")
    for piece in TRICKY_TEXTS[1:]:
        assert formatter.text(pb.CompleteEvent(text=piece)) == sse(chunk(call, piece))
    # A token with its log probability is made whole (its chunk carries them).
    event = pb.CompleteEvent(text="x", logprob=pb.TokenLogprob(token=5, logprob=-0.5,
                                                               piece=b"x"))
    with_logprobs = json.loads(formatter.text(event).decode()[len("data: "):])
    assert with_logprobs["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]


def test_a_conversation_s_next_turn_extends_its_routing_text() -> None:
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]
    turn1 = parse_chat({"model": "m", "messages": first}).request
    turn2 = parse_chat({"model": "m", "messages": [*first,
                                                   {"role": "assistant", "content": "A1"},
                                                   {"role": "user", "content": "Q2"}]}).request
    assert turn2.routing_text().startswith(turn1.routing_text(served_text("A1", [])))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = [{"type": "function", "function": {"name": "f"}}]
    calling = parse_chat({"model": "m", "messages": first, "tools": tools}).request
    round_trip = parse_chat({"model": "m", "tools": tools, "messages": [
        *first, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "r", "tool_call_id": "c1"}]}).request
    assert round_trip.routing_text().startswith(calling.routing_text(served_text("",
                                                                                [("f", "{}")])))
    raw = parse_completion({"model": "m", "prompt": "abc"}).request
    assert parse_completion({"model": "m", "prompt": "abcdef!"}).request.routing_text().startswith(
        raw.routing_text("def"))
    assert not turn1.routing_text().startswith(raw.routing_text()[:8])  # kinds never mix


# --------------------------------------------------------------------------- refusals


def refused(message: str, param: str = "", code: str = "invalid_argument",
            status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> RuntimeRefused:
    return RuntimeRefused(status, code, message, param)


def test_a_refusal_names_the_field_the_runtime_names_in_the_request_s_terms() -> None:
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).request
    text = parse_completion({"model": "m", "prompt": "hi"}).request
    err = refusal_error(refused("penalty_last_n must be an integer >= -1, got -2",
                                "penalty_last_n"), text)
    assert (err.status, err.param, err.code) == (400, "repeat_last_n", "invalid_value")
    assert err.message == "penalty_last_n must be an integer >= -1, got -2"
    assert refusal_error(refused("seed must be ...", "seed"), chat).param == "seed"
    # A message that begins with a field's name names nothing the runtime did not name.
    assert refusal_error(refused("top_k words first, no field named"), chat).param is None
    long = refusal_error(refused("a prompt of 9 tokens ...", code="prompt_too_long"), chat)
    assert (long.param, long.code) == ("messages", "context_length_exceeded")
    assert refusal_error(refused("...", code="prompt_too_long"), text).param == "prompt"
    busy = refusal_error(refused("session s is busy", code="sticky_busy",
                                 status=grpc.StatusCode.FAILED_PRECONDITION), chat)
    assert (busy.status, busy.param, busy.code) == (409, "session_id", "session_busy")


def test_a_grammar_the_gateway_made_is_named_by_the_field_that_asked_for_it() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    grammar = refused("grammar is not valid GBNF: ...", "grammar")
    called = parse_chat({"model": "m", "messages": messages, "tools": tools,
                         "tool_choice": "required"}).request
    assert refusal_error(grammar, called).param == "tool_choice"
    shaped = parse_chat({"model": "m", "messages": messages,
                         "response_format": {"type": "json_object"}}).request
    assert refusal_error(grammar, shaped).param == "response_format"
    given = parse_completion({"model": "m", "prompt": "hi", "grammar": "root ::= \"a\""})
    assert refusal_error(grammar, given.request).param == "grammar"


# --------------------------------------------------------------------------- router


@dataclass
class FakeWorker:
    name: str
    free_slots: int = 1
    in_flight: int = 0
    served: int = 0
    ready: bool = True
    tracker: PrefixTracker = field(default_factory=PrefixTracker)


def test_common_prefix_len() -> None:
    assert common_prefix_len("", "abc") == 0
    assert common_prefix_len("abc", "abd") == 2
    assert common_prefix_len("abc", "abc") == 3
    assert common_prefix_len("x" * 10_000 + "a", "x" * 10_000 + "b") == 10_000


def test_routing_prefers_the_longest_prefix_then_the_least_loaded() -> None:
    a, b, c = FakeWorker("a", in_flight=0), FakeWorker("b", in_flight=1), FakeWorker("c")
    history = "conversation " * 10
    b.tracker.add(history + "reply")
    assert choose([a, b, c], history + "reply and more") is b
    assert choose([a, b, c], "something unrelated") is a  # least loaded, then first
    c.served, a.served = 0, 5
    assert choose([a, b, c], "something unrelated") is c  # fewest served among the idle
    short = "x" * (MIN_ROUTE_CHARS - 1)
    b.tracker.add(short)
    assert choose([a, b, c], short + "yz") is c  # too short a match counts as none
    b.free_slots = 0
    assert choose([a, b, c], history + "reply and more") in (a, c)  # full: elsewhere


def test_routing_session_owner_first_and_refusals() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    assert choose([a, b], "t", session_owner="b") is b
    a.free_slots = b.free_slots = 0
    with pytest.raises(NoFreeSlot):
        choose([a, b], "t")
    a.ready = b.ready = False
    with pytest.raises(NoReadyWorker):
        choose([a, b], "t")


def test_routing_compares_a_tenant_s_texts_with_its_own_only() -> None:
    """Alice's conversation draws her next turn to its worker; bob's identical text is
    routed as new (the runtime would not reuse alice's KV for him anyway)."""
    a, b = FakeWorker("a", served=5), FakeWorker("b")
    history = "conversation " * 10
    a.tracker.add(tenant_text("alice", history))
    assert choose([a, b], tenant_text("alice", history + "more")) is a
    assert choose([a, b], tenant_text("bob", history + "more")) is b  # fewest served
    assert choose([a, b], tenant_text("", history + "more")) is b


def test_trackers_and_session_maps_are_bounded() -> None:
    tracker = PrefixTracker(max_entries=2, max_chars=5)
    for text in ("aaaaaaaa", "bbbbbbbb", "cccccccc"):
        tracker.add(text)
    assert tracker.longest("aaaaaaaa") == 0 and tracker.longest("cccccccc") == 5
    sessions = SessionMap(size=2)
    sessions.set("s1", "w0")
    sessions.set("s2", "w1")
    assert sessions.get("s1") == "w0"  # used: s2 is now the oldest
    sessions.set("s3", "w0")
    assert sessions.get("s2") is None and sessions.get("s1") == "w0"


# --------------------------------------------------------------------------- keys


def write_keys(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_api_keys_map_to_tenants(tmp_path: Path) -> None:
    keys = ApiKeys.load(write_keys(tmp_path, "# comment\n" + "k" * 16 + " acme\n\n" +
                                   "z" * 20 + "\n"))
    assert keys.tenants == ["", "acme"]
    assert keys.tenant_of("Bearer " + "k" * 16) == "acme"
    assert keys.tenant_of("bearer " + "z" * 20) == ""
    for header in (None, "", "Bearer", "Basic " + "k" * 16, "Bearer " + "k" * 15,
                   "Bearer " + "k" * 17):
        assert keys.tenant_of(header) is None


def test_a_key_marked_admin_is_an_operator(tmp_path: Path) -> None:
    keys = ApiKeys.load(write_keys(tmp_path, "k" * 16 + " acme\n" + "o" * 16 +
                                   " acme role=admin\n" + "p" * 16 + " role=admin\n"))
    assert keys.tenants == ["", "acme"]
    assert keys.caller_of("Bearer " + "k" * 16) == Caller("acme", admin=False)
    assert keys.caller_of("Bearer " + "o" * 16) == Caller("acme", admin=True)
    assert keys.caller_of("Bearer " + "p" * 16) == Caller("", admin=True)
    # A header's bytes that are not UTF-8 come as surrogate escapes: no key, no error.
    raw = b"Bearer \xff\xfe" + b"k" * 14
    assert keys.caller_of(raw.decode("utf-8", "surrogateescape")) is None
    assert keys.caller_of("Bearer \ud800" + "k" * 15) is None


@pytest.mark.parametrize("text, mode, message", [
    ("k" * 16 + "\n", 0o640, "chmod 600"),
    ("short\n", 0o600, "at least 16"),
    ("k" * 16 + " a b\n", 0o600, "KEY [TENANT]"),
    ("k" * 16 + " a role=root\n", 0o600, "KEY [TENANT] [role=admin]"),
    ("k" * 16 + " bad/tenant\n", 0o600, "a tenant is"),
    ("k" * 16 + "\n" + "k" * 16 + " x\n", 0o600, "already listed"),
    ("# nothing\n", 0o600, "holds no key"),
])
def test_bad_key_files_are_refused(tmp_path: Path, text: str, mode: int, message: str) -> None:
    with pytest.raises(KeyConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ApiKeys.load(write_keys(tmp_path, text, mode))


def test_listener_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    check_listener("127.0.0.1", None, None, False)
    check_listener("0.0.0.0", None, None, True)
    with pytest.raises(KeyConfigError, match="API keys"):
        check_listener("0.0.0.0", None, None, False)


# --------------------------------------------------------------------------- settings


def test_settings_are_checked(tmp_path: Path) -> None:
    assert split_listen("[::1]:8000") == ("::1", 8000)
    for bad in ("8000", "host:", "host:99999", ":80"):
        with pytest.raises(SettingsError):
            split_listen(bad)
    with pytest.raises(SettingsError, match="set by the gateway"):
        ModelSpec("m", tmp_path, args=("--socket", "x"))
    with pytest.raises(SettingsError):
        ModelSpec("bad name", tmp_path)
    with pytest.raises(SettingsError):
        Supervision(stall_window_s=0)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"models": [{"path": str(model), "workers": 2}],
                                  "supervision": {"stall_window_s": 5}}))
    loaded = load_config(config)
    assert loaded["models"][0].name == "m" and loaded["models"][0].workers == 2
    assert loaded["supervision"] == {"stall_window_s": 5}
    config.write_text(json.dumps({"modles": []}))
    with pytest.raises(SettingsError, match="unknown keys"):
        load_config(config)
    for bad_bound in (0, -1, True, 1.5):
        with pytest.raises(SettingsError, match="max_slots_per_tenant"):
            GatewaySettings(models=(ModelSpec("m", model),), max_slots_per_tenant=bad_bound)


@pytest.mark.parametrize("key_file, setting, slots, bound", [
    (None, None, 4, None),  # no key file: one tenant, nobody to leave room for
    ("k" * 16 + " alice\n", None, 4, None),  # one tenant
    ("k" * 16 + " alice\n" + "b" * 16 + " bob\n", None, 4, 2),  # half of the pool's
    ("k" * 16 + " alice\n" + "b" * 16 + " bob\n", None, 3, 2),  # rounded up
    ("k" * 16 + " alice\n" + "b" * 16 + " bob\n", None, 1, 1),
    ("k" * 16 + " alice\n" + "b" * 16 + " bob\n", 3, 4, 3),  # the setting's
    (None, 1, 4, 1),
])
def test_a_tenant_s_share_of_a_pool(tmp_path: Path, key_file: str | None,
                                    setting: int | None, slots: int, bound: int | None
                                    ) -> None:
    from model_runtime.gateway.fleet import Fleet

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    keys = ApiKeys.load(write_keys(tmp_path, key_file)) if key_file else None
    fleet = Fleet(GatewaySettings(models=(ModelSpec("m", model, workers=2),),
                                  run_dir=tmp_path / "run", max_slots_per_tenant=setting),
                  keys)
    pool = fleet.pools["m"]
    assert len(pool) == 2 and fleet.workers == pool  # one pool, whatever the tenants
    # Workers that serve: slots split between the two (one with none left over).
    pool[0].process.state = pool[1].process.state = READY
    pool[0].process.info = RuntimeInfo(slots=slots - slots // 2)
    pool[1].process.info = RuntimeInfo(slots=slots // 2)
    assert fleet.tenant_bound(pool) == bound
    fleet.ledger.acquire(pool[0].name, "alice")
    assert fleet.tenant_busy(pool, "alice") == 1 and fleet.tenant_busy(pool, "bob") == 0


def test_each_worker_publishes_its_kv_events_on_a_port_of_its_own(tmp_path: Path) -> None:
    from model_runtime.gateway.fleet import Fleet

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    fleet = Fleet(GatewaySettings(models=(ModelSpec("m", model, workers=2),),
                                  run_dir=tmp_path / "run", kv_events="tcp://127.0.0.1:5560"),
                  None)
    for i, worker in enumerate(fleet.pools["m"]):
        command = worker.process.command()
        at = command.index("--kv-events")
        assert command[at + 1] == f"tcp://127.0.0.1:{5560 + i}"
    quiet = Fleet(GatewaySettings(models=(ModelSpec("m", model),), run_dir=tmp_path / "r2"),
                  None)
    assert "--kv-events" not in quiet.workers[0].process.command()
    for bad in ("127.0.0.1:5560", "tcp://127.0.0.1", "tcp://127.0.0.1:port"):
        with pytest.raises(SettingsError, match="tcp://HOST:PORT expected"):
            GatewaySettings(models=(ModelSpec("m", model),), kv_events=bad)


# --------------------------------------------------------------------------- ring, stall


def test_log_ring_keeps_the_last_lines() -> None:
    ring = LogRing(3)
    for i in range(5):
        ring.add(f"line {i}" + "x" * (LogRing.MAX_LINE if i == 4 else 0))
    assert [line.text[:6] for line in ring.lines()] == ["line 2", "line 3", "line 4"]
    assert len(ring.lines()[-1].text) == LogRing.MAX_LINE


def test_stall_rule_counts_events_and_cpu_as_progress(tmp_path: Path) -> None:
    now = time.monotonic()
    waiting = Flight("w0", "", wait_since=now - 2)
    writing = Flight("w0", "", wait_since=None)  # the gateway is writing to its client
    flights = [writing]
    worker = RuntimeProcess("w0", ModelSpec("m", tmp_path), tmp_path / "s.sock", None,
                            Supervision(stall_window_s=1.0), ProcessHooks(
                                spawned=lambda: None, failing=lambda reason, detail: None,
                                waits=lambda: [f.wait_since for f in flights]))
    assert worker._stalled_for(now) is None
    flights.append(waiting)
    assert worker._stalled_for(now) == pytest.approx(2)
    worker.cpu_progress_at = now - 0.5  # the process computes (a prefill): not stalled
    assert worker._stalled_for(now) is None
    assert process_cpu_seconds(os.getpid()) > 0
    assert process_cpu_seconds(2**22 + 12345) is None


def test_stale_run_dirs_of_killed_gateways_are_swept(tmp_path: Path) -> None:
    import subprocess

    from model_runtime.gateway.fleet import PID_FILE, sweep_stale_run_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live, foreign = (tmp_path / "kvgw-a", tmp_path / "kvgw-b", tmp_path / "kvgw-c")
    for folder in (stale, live, foreign):
        folder.mkdir()
    (stale / PID_FILE).write_text(f"{dead.pid}\n")
    (live / PID_FILE).write_text(f"{os.getpid()}\n")
    (foreign / "something").write_text("not ours")
    assert sweep_stale_run_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and foreign.exists()


def test_bodies_are_held_to_the_limits() -> None:
    limits = Limits(messages=3, chars=40, depth=4)
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_json(json.dumps(ok).encode(), limits) == ok
    cases = [
        (b"[" * 5000 + b"]" * 5000, 400, None),  # the parser's own recursion
        (json.dumps({"a": [[[[1]]]]}).encode(), 400, None),  # the gateway's bound
        (json.dumps({"messages": [{"content": "x"}] * 4}).encode(), 400, "messages"),
        (json.dumps({"prompt": "x" * 41}).encode(), 413, "prompt"),
        (json.dumps({"stop": ["\ud800"]}).encode(), 400, "stop"),
        (json.dumps({"x\udc80": 1}).encode(), 400, "x\udc80"),
    ]
    for body, status, param in cases:
        with pytest.raises(ApiError) as err:
            parse_json(body, limits)
        assert (err.value.status, err.value.param) == (status, param), body[:40]
