"""The OpenAI-compatible gateway against OpenAI's own Python client: a real gateway process,
real worker processes (the tiny generated models, one thread), a real cache daemon.

Model ``tiny`` has two workers of 4 slots; model ``long`` (whose requests only end at
max_tokens or the context's end) one worker of 2 slots, for requests that must still be
running when the test acts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.client import RuntimeClient
from tests.support.gateway_proc import (
    SYSTEM,
    GatewayProcess,
    Gateways,
    chat,
    model_entry,
)


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_model: Path, tiny_model_no_eog: Path) -> GatewayProcess:
    return gateways.start("gateway", models=[
        model_entry("tiny", tiny_model, "--n-ctx", "1024", "--n-seq-max", "4", workers=2),
        model_entry("long", tiny_model_no_eog, "--n-ctx", "8192", "--n-seq-max", "2",
              "--continued-interval", "0")])


def extra(response: Any) -> dict[str, Any]:
    """kvcache's own field beside OpenAI's."""
    return response.model_extra["kvcache"]


def cached(response: Any) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


# --------------------------------------------------------------------------- completions


def test_chat_streamed_and_not_agree(gw: GatewayProcess) -> None:
    client = gw.client()
    messages = chat(SYSTEM, "Where are the hammers?")
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           temperature=0)
    assert whole.object == "chat.completion" and whole.model == "tiny"
    assert whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert 1 <= whole.usage.completion_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert {"hit_kind", "tier", "tokens_restored", "ttft_ms", "worker"} <= set(extra(whole))

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == []  # the usage chunk comes last, as OpenAI sends it
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_kvcache_details_ride_on_the_last_chunk(gw: GatewayProcess) -> None:
    """Beside usage when the client asks for it (the usage chunk is where clients look),
    else on the finish_reason chunk: always the last one, and on no other."""
    client = gw.client()
    messages = chat("Echo details. " + SYSTEM, "Where is the glue?")
    for include_usage in (True, False):
        options = {"include_usage": True} if include_usage else None
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options=options))  # type: ignore[arg-type]
        details = extra(chunks[-1])
        assert {"hit_kind", "tier", "tokens_restored", "ttft_ms", "worker"} <= set(details)
        assert all("kvcache" not in (c.model_extra or {}) for c in chunks[:-1])
        if include_usage:
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        else:
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_each_request_says_where_its_time_went_and_a_stream_each_tokens_way(
        gw: GatewayProcess) -> None:
    """The runtime's steps to the first token (timeline) and the gateway's time before
    the worker had the request in every answer; streamed, each token's way from
    llama.cpp's scores to the socket, in the last chunk and in a Prometheus histogram."""
    client = gw.client()
    messages = chat("Time it. " + SYSTEM, "Where are the clamps?")
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           temperature=0)
    details = extra(whole)
    timeline = details["timeline"]
    assert list(timeline) == ["tokenize_ms", "queue_ms", "lookup_ms", "answer_wait_ms",
                              "restore_ms", "prefill_ms", "sample_ms"]
    assert all(v >= 0 for v in timeline.values()) and timeline["prefill_ms"] > 0
    assert sum(timeline.values()) <= details["ttft_ms"] + 0.01
    assert details["gateway"]["before_worker_ms"] > 0
    assert "token_path_ms" not in details["gateway"]  # not streamed: no token's way

    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True))
    path = extra(chunks[-1])["gateway"]["token_path_ms"]
    texts = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert 1 <= path["messages"] <= texts  # several tokens ready at once share a message
    assert 0 <= path["p50"] <= path["p99"] <= path["max"] < 60_000

    status, _, body = gw.http("GET", "/metrics")
    assert status == 200
    counts = {s.labels["model"]: s.value
              for family in text_string_to_metric_families(body.decode())
              for s in family.samples if s.name == "kvcache_gateway_token_path_seconds_count"}
    assert counts.get("tiny", 0) >= path["messages"]


def channels(gw: GatewayProcess, model: str) -> tuple[int, int]:
    """Requests and messages the event channels of ``model``'s workers carried so far."""
    seen = [w["event_channel"] for w in gw.status()["workers"] if w["model"] == model]
    assert all(channel["open"] for channel in seen)
    return sum(c["requests"] for c in seen), sum(c["messages"] for c in seen)


def test_a_streamed_answer_comes_on_the_workers_event_channel(gw: GatewayProcess) -> None:
    """Its prompt, text and final record are written by the worker's model thread on the
    channel the gateway gave it (model_runtime/event_channel.py), not sent by a gRPC
    stream's thread; an answer read whole comes on its call, in one message."""
    client = gw.client()
    messages = chat("Channel. " + SYSTEM, "Where are the saws?")
    requests, sent = channels(gw, "tiny")
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           temperature=0)
    assert channels(gw, "tiny") == (requests, sent)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    texts = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    after = channels(gw, "tiny")
    assert after[0] == requests + 1
    assert after[1] - sent >= texts + 2  # the prompt's account, the text, the final record


def test_completions_streamed_and_not_agree_and_take_token_prompts(gw: GatewayProcess) -> None:
    client = gw.client()
    whole = client.completions.create(model="tiny", prompt="The quick brown fox",
                                      max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    streamed = client.completions.create(model="tiny", prompt="The quick brown fox",
                                         max_tokens=6, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    by_tokens = client.completions.create(model="tiny", prompt=[1, 40, 41, 42, 43],
                                          max_tokens=3, temperature=0)
    assert by_tokens.usage.prompt_tokens == 5
    assert 1 <= by_tokens.usage.completion_tokens <= 3


def test_second_request_over_a_shared_system_prompt_reports_cached_tokens(
        gw: GatewayProcess) -> None:
    client = gw.client()
    system = "Bravo shop rules. " + SYSTEM
    first = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                           messages=chat(system, "Do you sell nails?"))
    # (An idle sequence may share the chat template's first token or so with it.)
    assert cached(first) < 10
    second = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                            messages=chat(system, "And screws, maybe?"))
    assert 200 < cached(second) < second.usage.prompt_tokens
    assert extra(second)["hit_kind"] == "partial"
    assert extra(second)["tokens_restored"] >= cached(second)


def test_greedy_output_equals_the_runtime_s_own(gw: GatewayProcess) -> None:
    messages = chat("Charlie says: " + SYSTEM, "Name one tool.")
    via_gateway = gw.client().chat.completions.create(model="tiny", messages=messages,
                                                      max_tokens=12, temperature=0)
    socket = gw.worker("w1")["socket"]
    with RuntimeClient(f"unix:{socket}", timeout=60) as direct:
        own = direct.complete(messages=messages, max_tokens=12, temperature=0)
    assert via_gateway.choices[0].message.content == own["text"]
    assert via_gateway.usage.completion_tokens == len(own["tokens"])
    assert via_gateway.usage.prompt_tokens == own["prompt_tokens"]


def test_session_id_maps_to_the_runtime_s_sticky_session(gw: GatewayProcess) -> None:
    client = gw.client()
    messages = chat("Delta. " + SYSTEM, "Hello")
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                           temperature=0,
                                           extra_headers={"X-Session-Id": "sess-1"})
    assert extra(first)["session_id"] == "sess-1"
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "More"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                            temperature=0, extra_body={"session_id": "sess-1"})
    assert extra(second)["worker"] == extra(first)["worker"]
    assert extra(second)["hit_kind"] == "sticky"
    assert cached(second) > cached(first)


# --------------------------------------------------------------------------- errors


def error_of(status: int, body: bytes) -> dict[str, Any]:
    document = json.loads(body)
    assert set(document) == {"error"}
    assert set(document["error"]) == {"message", "type", "param", "code"}
    assert document["error"]["message"]
    return document["error"]


def test_bad_json_and_unknown_route_are_openai_errors(gw: GatewayProcess) -> None:
    status, _, body = gw.http("POST", "/v1/chat/completions", b'{"model": "tiny",')
    assert status == 400
    assert error_of(status, body)["type"] == "invalid_request_error"
    status, _, body = gw.http("POST", "/v1/chat/completions", b'["not an object"]')
    assert status == 400 and error_of(status, body)["code"] == "invalid_json"
    status, _, body = gw.http("GET", "/v1/nothing-here")
    assert status == 404 and error_of(status, body)["code"] == "not_found"


def test_unknown_model_is_404(gw: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        gw.client().chat.completions.create(model="gpt-9", messages=chat("s", "u"))
    assert err.value.status_code == 404
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_oversize_prompt_is_400_context_length_exceeded(gw: GatewayProcess) -> None:
    client = gw.client()
    for stream in (False, True):  # a stream refused before its first token keeps its 400
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="word " * 3000, max_tokens=4,
                                      stream=stream)
        assert err.value.status_code == 400
        assert err.value.code == "context_length_exceeded"
        assert "1024" in err.value.message


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(gw: GatewayProcess) -> None:
    """OpenAI's rule: a prompt of 1,020 tokens and max_tokens 5 need 1,025 of the 1,024
    the context holds, and are refused before anything runs (streamed or not). They used
    to be answered with the 4 tokens left and finish_reason "length"."""
    client = gw.client()
    prompt = [40 + i % 200 for i in range(1020)]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                      stream=stream)
        assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
        assert err.value.param == "prompt"  # as OpenAI names it, whichever is too long
        message = err.value.message
        assert "1024" in message and "1025" in message and "1020" in message, message
    chat_prompt = chat("Golf. " + SYSTEM, "Which aisle? " * 300)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=chat_prompt,
                                       max_completion_tokens=1000)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    # Exactly the context: served. Without max_tokens: until the context is full.
    fits = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert 1 <= fits.usage.completion_tokens <= 4
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= 1024
    unbounded = client.completions.create(model="tiny", prompt=prompt, temperature=0)
    assert unbounded.choices[0].text == fits.choices[0].text


@pytest.mark.parametrize("change, param", [
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": None}, "model"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"store": True}, "store"),
    ({"some_future_field": {"x": 1}}, "some_future_field"),
])
def test_bad_parameters_are_400_naming_the_parameter(gw: GatewayProcess, change: dict[str, Any],
                                                     param: str) -> None:
    body = {"model": "tiny", "messages": chat("s", "u"), "max_tokens": 2, **change}
    status, _, raw = gw.http("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, raw
    error = error_of(status, raw)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_an_unknown_field_is_refused_as_openai_refuses_it(gw: GatewayProcess) -> None:
    """Never accepted and ignored: a field this server does not know is a 400 naming it
    (OpenAI's own answer); the documented fields at their neutral values are served."""
    body = {"model": "tiny", "messages": chat("s", "u"), "max_tokens": 2, "temperature": 0,
            "user": "someone", "logit_bias": {}, "frequency_penalty": 0, "store": False}
    status, _, raw = gw.http("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, raw
    status, _, raw = gw.http("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "cache_prompt": True}).encode())
    error = error_of(status, raw)
    assert status == 400 and error["param"] == "cache_prompt"
    assert error["code"] == "unknown_parameter" and "Unrecognized" in error["message"]


# --------------------------------------------------------------------------- other endpoints


def test_models_health_metrics_and_status(gw: GatewayProcess) -> None:
    models = {m.id: m for m in gw.client().models.list()}
    assert set(models) == {"tiny", "long"}
    assert models["tiny"].model_extra["context_length"] == 1024
    assert models["long"].model_extra["context_length"] == 8192
    assert gw.client().models.retrieve("long").id == "long"

    status, _, body = gw.http("GET", "/health")
    assert status == 200 and json.loads(body)["workers_ready"] == 3

    status, headers, body = gw.http("GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert 'kvcache_gateway_requests_total{endpoint="chat",model="tiny",outcome="ok",' \
        'status="200",tenant=""}' in text
    assert 'kvcache_gateway_slots{model="tiny",state="free"}' in text
    assert 'kvcache_gateway_workers{model="long",state="ready"} 1.0' in text
    assert 'model="gpt-9"' not in text  # callers' made-up names are not labels

    workers = gw.status()["workers"]
    assert [w["model"] for w in workers] == ["tiny", "tiny", "long"]
    for w in workers:
        assert w["state"] == "ready" and w["restarts"] == 0
        assert any("listening on" in line["text"] for line in w["recent_logs"])
    assert [w["slots_total"] for w in workers] == [4, 4, 2]


def request_counts(gw: GatewayProcess) -> Counter[tuple[str, str, str, str]]:
    """kvcache_gateway_requests_total by (model, endpoint, outcome, status)."""
    status, _, body = gw.http("GET", "/metrics")
    assert status == 200
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "kvcache_gateway_requests_total":
                labels = sample.labels
                counts[(labels["model"], labels["endpoint"], labels["outcome"],
                        labels["status"])] = int(sample.value)
    return counts


def test_metrics_count_every_request_by_outcome_and_status(gw: GatewayProcess) -> None:
    """Refused requests are counted too: they used to be refused before anything was
    counted (bad JSON, bad parameters, a prompt that does not fit)."""
    before = request_counts(gw)
    assert gw.http("POST", "/v1/chat/completions", b'{"model": "tiny",')[0] == 400
    bad = {"model": "tiny", "messages": chat("s", "u"), "temperature": 3}
    assert gw.http("POST", "/v1/chat/completions", json.dumps(bad).encode())[0] == 400
    unknown = {"model": "gpt-9", "prompt": "hi"}
    assert gw.http("POST", "/v1/completions", json.dumps(unknown).encode())[0] == 404
    too_long = {"model": "tiny", "prompt": "word " * 3000, "max_tokens": 4}
    assert gw.http("POST", "/v1/completions", json.dumps(too_long).encode())[0] == 400
    served = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    assert gw.http("POST", "/v1/completions", json.dumps(served).encode())[0] == 200
    assert gw.http("GET", "/v1/nothing-here")[0] == 404
    assert gw.http("GET", "/v1/models")[0] == 200
    after = request_counts(gw)
    counted = {key: n - before[key] for key, n in after.items() if n != before[key]}
    assert counted == {
        ("", "chat", "bad_request", "400"): 1,
        ("tiny", "chat", "bad_request", "400"): 1,
        ("unknown", "text", "not_found", "404"): 1,
        ("tiny", "text", "bad_request", "400"): 1,
        ("tiny", "text", "ok", "200"): 1,
        ("", "unknown", "not_found", "404"): 1,
        ("", "models", "ok", "200"): 1,
        ("", "metrics", "ok", "200"): 1,  # the scrape before
    }, counted


# --------------------------------------------------------------------------- slots


def test_full_slots_answer_429_and_a_disconnect_frees_its_slot(gw: GatewayProcess) -> None:
    client = gw.client()
    w = gw.worker("w2")
    prompt = "Echo papers, " * 40
    with RuntimeClient(f"unix:{w['socket']}", timeout=30) as direct:
        completed = int(direct.stats()["counters"]["requests_completed"])
        streams = [client.completions.create(model="long", prompt=prompt + str(i),
                                             stream=True)  # until the context is full
                   for i in range(2)]
        for s in streams:
            next(iter(s))  # decoding now: both slots are taken
        assert gw.worker("w2")["slots_busy"] == 2
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="long", prompt="one more", max_tokens=2)
        assert err.value.status_code == 429 and err.value.code == "no_slot_available"
        assert err.value.response.headers["retry-after"] == "1"

        for s in streams:
            s.close()  # the client goes away mid-stream
        gw.wait_worker("w2", lambda w: w["slots_busy"] == 0, timeout=10)
        # The runtime's requests ended too (cancelled): their sequences are free.
        deadline = time.monotonic() + 10
        while int(direct.stats()["counters"]["requests_completed"]) < completed + 2:
            assert time.monotonic() < deadline, "the cancelled requests still run"
            time.sleep(0.05)
    # What was computed stays reusable.
    again = client.completions.create(model="long", prompt=prompt + "0", max_tokens=2)
    assert cached(again) > 0
    assert gw.worker("w2")["restarts"] == 0


# --------------------------------------------------------------------------- routing


def test_concurrent_conversations_stay_on_their_workers(gw: GatewayProcess) -> None:
    client = gw.client()
    names = ["Foxtrot", "Golf", "Hotel", "India"]
    seen: dict[str, list[tuple[str, int, str]]] = {n: [] for n in names}
    barrier = threading.Barrier(len(names))
    errors: list[BaseException] = []

    def converse(name: str) -> None:
        try:
            messages = chat(f"{name} is the shop's name. " + SYSTEM, "Hi")
            barrier.wait(10)
            for turn in range(3):
                r = client.chat.completions.create(model="tiny", messages=messages,
                                                   max_tokens=6, temperature=0)
                seen[name].append((extra(r)["worker"], cached(r), extra(r)["tier"]))
                messages = [*messages, {"role": "assistant",
                                        "content": r.choices[0].message.content},
                            {"role": "user", "content": f"Turn {turn} question?"}]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=converse, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for name, turns in seen.items():
        assert len({worker for worker, _, _ in turns}) == 1, (name, turns)
        # Later turns extend what the conversation left: warm (mostly in place, "live").
        assert all(n > 100 for _, n, _ in turns[1:]), (name, turns)
    assert len({turns[0][0] for turns in seen.values()}) == 2  # both workers served
