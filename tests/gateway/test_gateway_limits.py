"""What one request may cost and what one tenant may see, against a real gateway process
and real workers: bad input is a 4xx in OpenAI's format with one log line at most; bodies
and the work they ask for are bounded before anything is parsed or rendered; operator
views need an operator; a tenant's key reads its own numbers only.

One gateway with three keys: alice's, bob's, and an operator's (tenant alice, role=admin),
and one worker of two slots that both tenants share, each tenant one slot at most at once.
Its model never ends a reply at an end-of-generation token, so a request holds its slot
until max_tokens: the tests that need a tenant's slots busy hold bob's one slot.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import (
    ALICE,
    BOB,
    OPERATOR,
    GatewayProcess,
    Gateways,
    chat,
    kill_leftovers,
    metrics,
)

MAX_BODY = 20 << 20  # above a worker's 16 MiB message limit: the rendered prompt is checked
MAX_CHARS = 18_000_000
MAX_MESSAGES = 64


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_model_no_eog: Path) -> GatewayProcess:
    return gateways.start(
        "gateway_limits", keys=f"{ALICE} alice\n{BOB} bob\n{OPERATOR} alice role=admin\n",
        args=("--model", f"tiny={tiny_model_no_eog}", "--n-ctx", "16384", "--n-seq-max", "2",
              "--max-body-bytes", str(MAX_BODY), "--max-chars", str(MAX_CHARS),
              "--max-messages", str(MAX_MESSAGES)),
        cache="none", admin_key=OPERATOR, clean_stop=False)


def raw(gw: GatewayProcess, path: str, body: bytes, headers: dict[str, Any] | None = None,
        method: str = "POST", chunked: bool = False) -> tuple[int, dict[str, Any]]:
    """A request whose headers may hold any bytes (http.client sends bytes as given);
    the answer's status and JSON body."""
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.putrequest(method, path)
        sent = {"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}",
                **(headers or {})}
        for name, value in sent.items():
            conn.putheader(name, value)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            step = 1 << 20
            try:
                for at in range(0, len(body), step):
                    piece = body[at:at + step]
                    conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                conn.send(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused mid-body: the answer is already there
        else:
            conn.putheader("Content-Length", str(len(body)))
            # Refused unread, the connection closed mid-body: the answer is there.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def post(gw: GatewayProcess, payload: Any, path: str = "/v1/chat/completions",
         **kwargs: Any) -> tuple[int, dict[str, Any]]:
    return raw(gw, path, json.dumps(payload).encode(), **kwargs)


def log_since(gw: GatewayProcess, mark: int) -> str:
    return gw.log()[mark:]


def assert_refused(answer: tuple[int, dict[str, Any]], status: int, code: str,
                   param: str | None = None) -> None:
    got, body = answer
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's error body
    assert error["code"] == code and error["param"] == param, error


def assert_quiet(gw: GatewayProcess, mark: int) -> None:
    """At most one log line for the refusals since ``mark``, and no traceback."""
    text = log_since(gw, mark)
    assert "Traceback" not in text and "error serving" not in text, text[-3000:]
    own = [line for line in text.splitlines() if line.strip() and " worker " not in line]
    assert len(own) <= 1, own


# --------------------------------------------------------------------------- bad input


def test_deeply_nested_json_is_a_400(gw: GatewayProcess) -> None:
    mark = len(gw.log())
    for depth in (10_000, 100):  # beyond the parser's stack; beyond the gateway's bound
        nested = b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        assert_refused(raw(gw, "/v1/chat/completions", nested), 400, "invalid_json")
    assert_quiet(gw, mark)


@pytest.mark.parametrize("field, payload", [
    ("messages", {"messages": [{"role": "user", "content": "hi \ud800 there"}]}),
    ("stop", {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}),
    ("session_id", {"messages": [{"role": "user", "content": "hi"}],
                    "session_id": "s\udfff"}),
    ("prompt", {"prompt": "a lone \ud800 surrogate"}),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(gw: GatewayProcess, field: str,
                                                    payload: dict[str, Any]) -> None:
    mark = len(gw.log())
    path = "/v1/completions" if field == "prompt" else "/v1/chat/completions"
    body = json.dumps({"model": "tiny", "max_tokens": 2, **payload})  # \ud800 escapes
    assert "\\ud" in body
    assert_refused(raw(gw, path, body.encode()), 400, "invalid_value", field)
    assert_quiet(gw, mark)


def test_header_bytes_that_are_not_utf8(gw: GatewayProcess) -> None:
    mark = len(gw.log())
    payload = {"model": "tiny", "messages": chat("s", "u"), "max_tokens": 2}
    for value in (b"Bearer \xff\xfe\xfd", b"\xc3\x28 " + ALICE.encode()):
        assert_refused(post(gw, payload, headers={"Authorization": value}), 401,
                       "invalid_api_key")
    assert_refused(post(gw, payload, headers={"X-Session-Id": b"s\xff"}), 400,
                   "invalid_value", "session_id")
    assert_quiet(gw, mark)


# --------------------------------------------------------------------------- bodies


def test_a_body_over_the_limit_is_a_413_before_it_is_read(gw: GatewayProcess) -> None:
    body = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY + b'"}'
    # By its Content-Length, and (chunked, no length) as soon as the limit is passed.
    assert_refused(raw(gw, "/v1/completions", body), 413, "request_too_large")
    assert_refused(raw(gw, "/v1/completions", body, chunked=True), 413, "request_too_large")
    # The gateway still serves.
    assert post(gw, {"model": "tiny", "prompt": "Alpha", "max_tokens": 1},
                "/v1/completions")[0] == 200


def test_a_large_refused_body_is_not_read_the_connection_is_closed(gw: GatewayProcess
                                                                     ) -> None:
    """A body declared over the limit, of which a client sends 1 KiB only: the 413 comes
    at once with ``Connection: close`` and the gateway closes the connection rather than
    wait for (and read) the rest."""
    url = urlsplit(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{ALICE}\r\nContent-Type: application/json\r\nContent-Length: "
                     f"{MAX_BODY * 4}\r\n\r\n".encode() + b"a" * 1024)
        started = time.monotonic()
        answer = b""
        while chunk := conn.recv(65536):  # until the gateway closes
            answer += chunk
        assert time.monotonic() - started < 3  # (it used to read for up to 10 s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head, head
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_small_refused_body_keeps_the_connection(gw: GatewayProcess) -> None:
    """A refusal whose small body was not read (a wrong key) drops the body and keeps
    the connection for the next request."""
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        body = json.dumps({"model": "tiny", "prompt": "x" * 1000}).encode()
        conn.request("POST", "/v1/completions", body, {"Authorization": "Bearer wrong"})
        refused = conn.getresponse()
        assert refused.status == 401 and refused.getheader("Connection") != "close"
        refused.read()
        sock = conn.sock
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {ALICE}"})
        assert conn.getresponse().status == 200
        assert sock is not None and conn.sock is sock  # the same connection
    finally:
        conn.close()


def test_a_prompt_larger_than_a_worker_accepts_is_a_413_not_a_worker_error(
        gw: GatewayProcess) -> None:
    """Within the body limit, but the worker's gRPC limit is 16 MiB: the gateway refuses
    it itself (it used to come back as 503 worker_error, "larger than max")."""
    prompt = "Bravo " * ((17 << 20) // 6)
    assert len(prompt) < MAX_CHARS
    assert_refused(post(gw, {"model": "tiny", "prompt": prompt, "max_tokens": 1},
                        "/v1/completions"), 413, "request_too_large")
    assert all(w["restarts"] == 0 for w in gw.status()["workers"])


def test_a_large_body_is_parsed_and_rendered_as_a_small_one(gw: GatewayProcess) -> None:
    """A body over 256 KiB goes to the helper process (parsed and rendered there): the
    same chat, padded with JSON whitespace, gets the small body's answer."""
    payload = {"model": "tiny", "messages": chat("Echo test. " * 8, "Hello"),
               "max_tokens": 3, "temperature": 0}
    small = post(gw, payload)
    body = json.dumps(payload).encode()
    large = raw(gw, "/v1/chat/completions", body[:-1] + b" " * (300 << 10) + b"}")
    assert small[0] == large[0] == 200, (small, large)
    assert large[1]["choices"][0]["message"] == small[1]["choices"][0]["message"]
    assert large[1]["usage"]["prompt_tokens"] == small[1]["usage"]["prompt_tokens"]
    refused = raw(gw, "/v1/chat/completions",
                  b'{"model": "tiny", "messages": 3' + b" " * (300 << 10) + b"}")
    assert_refused(refused, 400, "invalid_value", "messages")


def test_the_work_a_request_asks_for_is_bounded(gw: GatewayProcess) -> None:
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
            for i in range(MAX_MESSAGES + 1)]
    assert_refused(post(gw, {"model": "tiny", "messages": many}), 400,
                   "array_above_max_length", "messages")
    long = [{"role": "user", "content": "c" * (MAX_CHARS + 1)}]
    assert_refused(post(gw, {"model": "tiny", "messages": long}), 413,
                   "request_too_large", "messages")
    within = many[:MAX_MESSAGES - 1]
    assert post(gw, {"model": "tiny", "messages": within, "max_tokens": 1})[0] == 200


def test_expect_continue_over_the_limit_is_a_413_not_an_invitation(gw: GatewayProcess
                                                                      ) -> None:
    """A client that asks first (``Expect: 100-continue``) with a body over the limit gets
    its 413 at once, never "100 Continue" (which asked it to send the whole body); one
    within the limit is invited and served."""
    url = urlsplit(gw.url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
            "Content-Type: application/json\r\nExpect: 100-continue\r\n")
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        conn.sendall(f"{head}Content-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        answer = b""
        while chunk := conn.recv(65536):  # until the gateway closes: no body is awaited
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"100 Continue" not in answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
        "request_too_large"
    body = json.dumps({"model": "tiny", "prompt": "Alpha", "max_tokens": 1}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        assert conn.recv(100).startswith(b"HTTP/1.1 100 Continue")
        conn.sendall(body)
        assert conn.recv(100).startswith(b"HTTP/1.1 200")


# --------------------------------------------------------------------------- grammars

MESSAGES = [{"role": "user", "content": "u"}]
# The request that cost the gateway 2.7 GB: 211 bytes.
HUGE_MIN_LENGTH = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "response_format": {
    "type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "minLength": 100_000_000}}}}


def tool(parameters: dict[str, Any], name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_schema_bound_over_budget_is_refused_before_anything_is_built(
        gw: GatewayProcess) -> None:
    """It used to build half a gigabyte of grammar, then answer 413 (the grammar was
    larger than a worker takes)."""
    mark = len(gw.log())
    assert len(json.dumps(HUGE_MIN_LENGTH)) < 250
    answer = post(gw, HUGE_MIN_LENGTH)
    assert_refused(answer, 400, "invalid_value", "response_format.json_schema.schema.minLength")
    assert answer[1]["error"]["message"].startswith("minLength must be an integer from 0 "
                                                    "to 2000")
    assert_quiet(gw, mark)


@pytest.mark.parametrize("payload, param", [
    ({"tools": [tool({"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "string"}, "maxItems": 1_000_000}}})],
      "tool_choice": "required"}, "tools[0].function.parameters.properties.a.maxItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "pattern": "^a{0,5000}$"}}}},
     "response_format.json_schema.schema.pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"e": {"enum": list(range(1001))}}}}}},
     "response_format.json_schema.schema.properties.e.enum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "minLength": 10, "maxLength": 5}}}},
     "response_format.json_schema.schema.maxLength"),
    # Thirteen strings of 2,000 characters: each bound within, the grammar over budget,
    # refused where it passes the budget (the thirteenth).
    ({"tools": [tool({"type": "object", "properties": {
        f"s{i}": {"type": "string", "maxLength": 2000} for i in range(13)}})]},
     "tools[0].function.parameters.properties.s12.maxLength"),
    # llama.cpp would read a maximum above 2,000 as none.
    ({"grammar": 'root ::= "x"{0,100000000}'}, "grammar"),
])
def test_every_bound_of_a_grammar_is_held_to_a_budget_naming_it(
        gw: GatewayProcess, payload: dict[str, Any], param: str) -> None:
    mark = len(gw.log())
    answer = post(gw, {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **payload})
    assert_refused(answer, 400, "invalid_value", param)
    assert_quiet(gw, mark)


def test_completions_grammar_is_held_to_the_budget(gw: GatewayProcess) -> None:
    answer = post(gw, {"model": "tiny", "prompt": "p", "max_tokens": 1,
                       "grammar": 'root ::= [a-z]{0,3000}'}, "/v1/completions")
    assert_refused(answer, 400, "invalid_value", "grammar")


def test_anthropic_and_responses_schemas_are_held_to_the_budget(gw: GatewayProcess) -> None:
    big = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3000}}}
    status, body = post(gw, {"model": "tiny", "max_tokens": 1, "messages": MESSAGES,
                             "tools": [{"name": "f", "input_schema": big}],
                             "tool_choice": {"type": "any"}}, "/v1/messages")
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith("tools.0.input_schema.properties.x.maxLength")
    for payload, param in (
            ({"tools": [{"type": "function", "name": "f", "parameters": big}],
              "tool_choice": "required"}, "tools[0].parameters.properties.x.maxLength"),
            ({"text": {"format": {"type": "json_schema", "name": "n", "schema": big}}},
             "text.format.schema.properties.x.maxLength")):
        answer = post(gw, {"model": "tiny", "input": "u", "max_output_tokens": 16,
                           "store": False, **payload}, "/v1/responses")
        assert_refused(answer, 400, "invalid_value", param)


def test_a_schema_at_the_budget_s_edge_is_served(gw: GatewayProcess) -> None:
    """Eleven strings of up to 2,000 characters (about 90,000 symbols): built in the
    helper process, compiled by the worker's llama.cpp, the reply held to it."""
    schema = {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 2000}
                                               for i in range(11)},
              "required": [f"s{i}" for i in range(11)], "additionalProperties": False}
    status, body = post(gw, {"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "n", "schema": schema}}})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith('{')


# --------------------------------------------------------------------------- logit_bias


@pytest.mark.parametrize("key", ["4294967296", "2147483648", "99999999999999999999999",
                                 "-1", "1.5", "1e3", "abc", " 5", "+5", "٣", "5_0", ""])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_logit_bias_key_that_is_not_a_token_id_is_a_400(gw: GatewayProcess, key: str,
                                                          path: str) -> None:
    """Keys ≥ 2^32 used to be a 500 with a traceback; every key but a token id (ASCII
    digits, below llama.cpp's int32 token type) is a 400 naming logit_bias."""
    mark = len(gw.log())
    body = {"model": "tiny", "max_tokens": 1, "logit_bias": {key: 5}}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "p"})
    assert_refused(post(gw, body, path), 400, "invalid_value", "logit_bias")
    assert_quiet(gw, mark)


def test_a_logit_bias_on_a_token_is_served(gw: GatewayProcess) -> None:
    for path, extra in (("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/v1/completions", {"prompt": "p"})):
        status, body = post(gw, {"model": "tiny", "max_tokens": 1,
                                 "logit_bias": {"7": -100, "12": 5.5}, **extra}, path)
        assert status == 200, body


def hold_slot(gw: GatewayProcess, key: str, started: threading.Event,
              stop: threading.Event) -> threading.Thread:
    """A streamed request that holds ``key``'s tenant's slot until ``stop``."""
    def run() -> None:
        client = gw.client(api_key=key)
        with client.chat.completions.create(model="tiny", messages=chat("s", "hold"),
                                            max_tokens=1500, stream=True) as events:
            for _ in events:
                started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_full_server_refuses_before_reading_the_body(gw: GatewayProcess) -> None:
    """Bob's one slot is busy: his next request is a 429 whatever its body (a malformed
    one was parsed first and answered 400); alice's are served meanwhile, on the same
    worker's other slot."""
    started, stop = threading.Event(), threading.Event()
    holder = hold_slot(gw, BOB, started, stop)
    try:
        assert started.wait(60)
        answer = raw(gw, "/v1/chat/completions", b'{"model": "tiny", "messa',
                     headers={"Authorization": f"Bearer {BOB}"})
        assert_refused(answer, 429, "tenant_slots_busy")
        assert post(gw, {"model": "tiny", "messages": chat("s", "u"), "max_tokens": 1}
                    )[0] == 200
    finally:
        stop.set()
        holder.join(60)


# --------------------------------------------------------------------------- cancellation


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_client_gone_during_prefill_stops_costing_cpu(gw: GatewayProcess) -> None:
    """A prompt of 15,000 tokens (seconds of prefill, no event before its first token)
    whose client leaves after half a second: its worker goes idle within a prefill chunk
    or two, rather than computing the rest for nobody; the next request is served."""
    (worker,) = gw.status()["workers"]  # alice's and bob's
    payload = {"model": "tiny", "prompt": [5 + i % 290 for i in range(15_000)],
               "max_tokens": 1}
    with pytest.raises(openai.APITimeoutError):
        gw.client(api_key=ALICE, timeout=0.5).completions.create(**payload)
    time.sleep(0.5)  # the cancellation's way to the runtime, and the chunk in progress
    before = cpu_seconds(worker["pid"])
    time.sleep(1.5)
    spent = cpu_seconds(worker["pid"]) - before
    assert spent < 0.3, f"the worker used {spent:.2f} s of CPU for a client gone"
    done = gw.client(api_key=ALICE).completions.create(model="tiny", prompt="Charlie",
                                                       max_tokens=1)
    assert done.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- operator views


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_status_needs_an_operator(gw: GatewayProcess) -> None:
    for key in (ALICE, BOB):
        code, _, body = gw.http("GET", "/status", headers={"Authorization": f"Bearer {key}"})
        assert code == 403 and json.loads(body)["error"]["code"] == "operator_only"
    status = gw.status()  # the operator's key
    assert status["gateway"]["tenants"] == 2 and len(status["workers"]) == 1


def test_a_tenant_sees_only_its_own_numbers(gw: GatewayProcess) -> None:
    """Bob cannot watch alice's requests, tokens or cache hits move."""
    bob_before = metrics(gw, BOB)
    alice = gw.client(api_key=ALICE)
    for _ in range(2):
        alice.chat.completions.create(model="tiny", messages=chat("A secret system prompt "
                                                                  * 8, "u"), max_tokens=2)
    bob_after = metrics(gw, BOB)
    assert 'tenant="alice"' not in bob_after and 'tenant="bob"' in bob_after
    for name in ("kvcache_gateway_tokens_total", "kvcache_gateway_requests_total",
                 "kvcache_gateway_ttft_seconds_count"):
        before, after = samples(bob_before, name), samples(bob_after, name)
        # Bob's own scrape of /metrics counts as his request; nothing of alice's shows.
        after = {k: v for k, v in after.items() if ("endpoint", "metrics") not in k}
        before = {k: v for k, v in before.items() if ("endpoint", "metrics") not in k}
        assert after == before, name
    alice_view = metrics(gw, ALICE)
    assert 'tenant="bob"' not in alice_view
    tokens = samples(alice_view, "kvcache_gateway_tokens_total")
    assert tokens[(("kind", "prompt"), ("model", "tiny"), ("tenant", "alice"))] > 0
    every = metrics(gw, OPERATOR)
    assert 'tenant="alice"' in every and 'tenant="bob"' in every


def outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), if any."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_without_a_key_file_operator_views_are_loopback_s(tmp_path: Path,
                                                          tiny_model: Path) -> None:
    address = outward_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    gateway = GatewayProcess(tmp_path / "gateway.log", "--model", f"tiny={tiny_model}",
                             "--n-ctx", "512", "--n-seq-max", "1", "--listen", "0.0.0.0:0",
                             "--insecure-tcp")
    pids: list[int] = []
    try:
        gateway.start()  # ready: polled from loopback
        gateway.url = gateway.url.replace("0.0.0.0", "127.0.0.1")
        pids = [w["pid"] for w in gateway.status()["workers"]]
        for path in ("/status", "/metrics"):
            assert gateway.http("GET", path)[0] == 200  # from loopback
        outside = GatewayProcess.__new__(GatewayProcess)
        outside.url = gateway.url.replace("127.0.0.1", address)
        for path in ("/status", "/metrics"):
            code, _, body = GatewayProcess.http(outside, "GET", path)
            assert code == 403 and json.loads(body)["error"]["code"] == "operator_only"
        assert GatewayProcess.http(outside, "GET", "/v1/models")[0] == 200
    finally:
        gateway.close()
        kill_leftovers(pids)
