"""The runtime's gRPC service and CLI, as real processes: ``model-runtime serve`` on a
unix socket in front of a real kvcache daemon, the ``model-runtime complete`` command,
and the ``shutdown`` save point on SIGTERM.

Everything runs the tiny generated GGUF with one thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvcache.client import CacheError
from model_runtime.client import RuntimeClient
from model_runtime.llama_backend import LlamaModel
from model_runtime.v1 import runtime_pb2 as pb
from model_runtime.v1 import runtime_pb2_grpc as pb_grpc
from tests.support.daemon_proc import DaemonProcess
from tests.support.runtime_proc import SERVICE, RuntimeProcess
from tests.support.tiny_llama import sample_prompt

# --------------------------------------------------------------------------- helpers


def daemon_counters(daemon: DaemonProcess) -> dict[str, int]:
    with daemon.client() as c:
        return dict(c.stats().counters)


def wait_for_entry(daemon: DaemonProcess, key_hex: str, timeout: float = 30.0) -> None:
    """Saves are asynchronous: wait until the daemon has published ``key_hex``."""
    deadline = time.monotonic() + timeout
    with daemon.client(timeout=5.0) as c:
        while True:
            try:
                c.inspect(bytes.fromhex(key_hex))
                return
            except CacheError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)


def request(*, tokens: list[int] | None = None, prompt: str | None = None,
            **options: Any) -> pb.CompleteRequest:
    req = pb.CompleteRequest(**options)
    if tokens is not None:
        req.tokens.ids.extend(tokens)
    elif prompt is not None:
        req.prompt = prompt
    return req


@pytest.fixture(scope="module")
def tokenize(tiny_model: Path) -> Iterator[Callable[[str], list[int]]]:
    with LlamaModel(tiny_model) as m:
        yield m.tokenize


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
          module_daemon: DaemonProcess) -> Iterator[tuple[DaemonProcess, RuntimeProcess]]:
    """One daemon and one ``model-runtime serve`` process shared by this module."""
    tmp = tmp_path_factory.mktemp("service")
    runtime = RuntimeProcess(tiny_model, module_daemon.address, tmp / "runtime.log",
                             "--continued-interval", "0")
    try:
        runtime.start()
        yield module_daemon, runtime
    finally:
        runtime.close()


@pytest.fixture
def stub(stack: tuple[DaemonProcess, RuntimeProcess]) -> Iterator[pb_grpc.ModelRuntimeStub]:
    with grpc.insecure_channel(stack[1].address) as channel:
        yield pb_grpc.ModelRuntimeStub(channel)


# --------------------------------------------------------------------------- service


def test_health_is_serving(stack: tuple[DaemonProcess, RuntimeProcess]) -> None:
    with grpc.insecure_channel(stack[1].address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(stack: tuple[DaemonProcess, RuntimeProcess]) -> None:
    with grpc.insecure_channel(stack[1].address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert SERVICE in services
    assert "grpc.health.v1.Health" in services


def test_complete_streams_text_pieces_then_the_final_record(
        stack: tuple[DaemonProcess, RuntimeProcess], stub: pb_grpc.ModelRuntimeStub,
        tokenize: Callable[[str], list[int]]) -> None:
    tokens = sample_prompt(tokenize, 90)
    events = list(stub.Complete(request(tokens=tokens, max_tokens=12), timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "done" and "done" not in kinds[:-1]
    assert kinds.count("text") >= 1
    done = events[-1].done
    assert done.finish_reason in ("length", "stop")
    assert done.prompt_tokens == len(tokens)
    assert 1 <= len(done.tokens) <= 12
    assert "".join(e.text for e in events[:-1]) == done.text
    assert len(done.finish_key) == 32 and done.cache_hit_kind == "cold"
    assert done.timings.total_ms > 0
    wait_for_entry(stack[0], done.finish_key)

    # A prompt that extends the finished one: the idle sequence still holds it (all but
    # the last generated token, sampled but never decoded) and serves it in place.
    longer = tokens + list(done.tokens) + tokens[1:20]
    events = list(stub.Complete(request(tokens=longer, max_tokens=4), timeout=60))
    again = events[-1].done
    assert again.cache_hit_kind == "partial"
    assert again.cache_delta.tokens_read == len(tokens) + len(done.tokens) - 1
    assert again.cache_tier == "live"


def test_a_request_read_whole_gets_its_text_in_one_message_before_the_final_record(
        stub: pb_grpc.ModelRuntimeStub, tokenize: Callable[[str], list[int]]) -> None:
    """``whole``: the prompt's record, one message of all the text, the final record;
    the same text as streamed."""
    tokens = sample_prompt(tokenize, 70)
    ask = dict(tokens=tokens, max_tokens=10, ignore_eos=True)
    streamed = list(stub.Complete(request(**ask), timeout=60))
    whole = list(stub.Complete(request(**ask, whole=True), timeout=60))
    assert [e.WhichOneof("event") for e in whole] == ["prompt", "text", "done"], whole
    assert whole[1].text == whole[2].done.text == streamed[-1].done.text
    assert list(whole[2].done.tokens) == list(streamed[-1].done.tokens)


def test_the_prompt_is_told_once_before_the_first_token(
        stack: tuple[DaemonProcess, RuntimeProcess], stub: pb_grpc.ModelRuntimeStub,
        tokenize: Callable[[str], list[int]]) -> None:
    """The first event is the prompt's account (what the cache gave it, its saves so
    far), the same figures the final record gives, cold and then restored."""
    tokens = sample_prompt(tokenize, 150)[3:]  # not a prefix of another test's prompt
    for expect_read in (False, True):
        events = list(stub.Complete(request(tokens=tokens, max_tokens=3, prefix_tokens=128),
                                    timeout=60))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "prompt" and kinds.count("prompt") == 1 and kinds[-1] == "done"
        prompt, done = events[0].prompt, events[-1].done
        assert prompt.prompt_tokens == done.prompt_tokens == len(tokens)
        assert (prompt.cache_hit_kind, prompt.cache_tier) == (done.cache_hit_kind,
                                                              done.cache_tier)
        assert prompt.cache_delta.tokens_read == done.cache_delta.tokens_read
        assert (prompt.cache_delta.tokens_read > 0) is expect_read
        # (the final record adds the saves taken at the end: finish, the prompt's end)
        assert list(done.saves)[:len(prompt.saves)] == list(prompt.saves)
        if not expect_read:
            assert [(s.reason, s.tokens) for s in prompt.saves] == [("cold", 128)]
            wait_for_entry(stack[0], prompt.saves[0].key)
            # (the next request restores it: another sequence of the runtime, or live)


def test_each_request_carries_its_timeline_and_each_token_when_it_was_decoded(
        stack: tuple[DaemonProcess, RuntimeProcess], stub: pb_grpc.ModelRuntimeStub,
        tokenize: Callable[[str], list[int]]) -> None:
    """The final record's timings give the steps before the first token (each within
    the TTFT, together no more than it), a cold request looking the cache up and a live
    one not; every text event carries when llama_decode returned its token's scores, on
    this host's monotonic clock, in order and before the event was read."""
    tokens = sample_prompt(tokenize, 120)[5:]
    records = []
    for prompt in (tokens, tokens + tokens[1:9]):  # cold, then the live sequence
        before = time.monotonic_ns()
        stamps: list[tuple[int, int]] = []
        for event in stub.Complete(request(tokens=prompt, max_tokens=6), timeout=60):
            if event.WhichOneof("event") == "text":
                stamps.append((event.decoded_ns, time.monotonic_ns()))
            elif event.WhichOneof("event") == "done":
                records.append(event.done)
        assert stamps and all(before < decoded <= read for decoded, read in stamps)
        assert [d for d, _ in stamps] == sorted(d for d, _ in stamps)
    cold, live = records
    assert (cold.cache_hit_kind, live.cache_tier) == ("cold", "live")
    for t in (cold.timings, live.timings):
        steps = [t.tokenize_ms, t.queue_ms, t.lookup_ms, t.answer_wait_ms, t.restore_ms,
                 t.prefill_ms, t.sample_ms]
        assert all(0 <= step <= t.ttft_ms for step in steps)
        assert sum(steps) <= t.ttft_ms + 0.01 and t.ttft_ms <= t.total_ms
        assert t.tokenize_ms > 0 and t.sample_ms > 0 and t.prefill_ms > 0
    assert cold.timings.lookup_ms > 0  # asked the daemon
    assert live.timings.lookup_ms > 0 or live.cache_delta.tokens_read == len(tokens)


def test_client_record_and_stats(stack: tuple[DaemonProcess, RuntimeProcess]) -> None:
    with RuntimeClient(stack[1].address, timeout=60) as client:
        done = client.complete(prompt="The quick brown fox", max_tokens=5, temperature=0.7,
                               seed=3)
        same = client.complete(prompt="The quick brown fox", max_tokens=5, temperature=0.7,
                               seed=3)
        stats = client.stats()
    assert done["tokens"] == same["tokens"] and len(done["tokens"]) <= 5
    assert {"text", "finish_reason", "cache_hit_kind", "cache_delta", "timings"} <= set(done)
    assert stats["cache_reachable"] is True
    assert int(stats["n_seq_max"]) == 2 and int(stats["n_ctx"]) >= 1024
    assert int(stats["counters"]["requests_completed"]) >= 2


@pytest.mark.parametrize("bad, fragment", [
    (pb.CompleteRequest(max_tokens=4), "exactly one of prompt"),  # no input at all
    (request(tokens=[1, 5, 100000], max_tokens=4), "out of range"),
    (request(prompt="hi", top_p=2.0), "top_p"),
    (request(prompt="hi", temperature=-1.0), "temperature"),
    (request(tokens=[5] * 5000, max_tokens=4), "prompt_too_long"),
    (request(prompt="hi", parent_key="not hex"), "32 hex digits"),
    # Echoed in the message: cut to fit gRPC's 16 KiB of metadata (it came back as
    # RESOURCE_EXHAUSTED).
    (request(prompt="hi", parent_key="x" * 30_000), "32 hex digits"),
])
def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(
        stub: pb_grpc.ModelRuntimeStub, bad: pb.CompleteRequest, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Complete(bad, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert fragment in err.value.details()
    events = list(stub.Complete(request(prompt="still here", max_tokens=2), timeout=60))
    assert events[-1].WhichOneof("event") == "done"


def test_sticky_busy_is_failed_precondition(
        stack: tuple[DaemonProcess, RuntimeProcess], tiny_model_no_eog: Path,
        tmp_path: Path, tokenize: Callable[[str], list[int]]) -> None:
    # A runtime whose requests never end on their own (no reachable EOG token).
    runtime = RuntimeProcess(tiny_model_no_eog, stack[0].address, tmp_path / "rt.log",
                             "--n-ctx", "4096").start()
    try:
        with grpc.insecure_channel(runtime.address) as channel:
            stub = pb_grpc.ModelRuntimeStub(channel)
            first = stub.Complete(request(tokens=sample_prompt(tokenize, 40), max_tokens=4000,
                                          session_id="s"), timeout=60)
            next(first)  # decoding now
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Complete(request(prompt="x", session_id="s"), timeout=60))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "sticky_busy" in err.value.details()
            first.cancel()
    finally:
        runtime.close()


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "model_runtime.cli", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_cli_complete_json_prints_a_parseable_record(
        daemon_factory: Callable[..., DaemonProcess], tiny_model: Path, tmp_path: Path) -> None:
    daemon = daemon_factory()
    system = tmp_path / "system.txt"
    system.write_text("You are a terse assistant. " * 12)
    common = ["--model", str(tiny_model), "--cache", daemon.address, "--threads", "1",
              "--n-ctx", "1024", "--n-seq-max", "1", "--system-file", str(system),
              "--max-tokens", "6", "--json"]
    first = run_cli("complete", "--prompt", "Hello there", *common)
    assert first.returncode == 0, first.stderr
    record = json.loads(first.stdout)
    assert record["cache_hit_kind"] == "cold"
    assert record["completion_tokens"] == len(record["tokens"]) <= 6
    assert record["finish_reason"] in ("length", "stop")
    assert [s["reason"] for s in record["saves"]][:1] == ["cold"]
    boundary = record["saves"][0]["tokens"]
    # A new process with another user message restores the system prompt.
    second = run_cli("complete", "--prompt", "Something else entirely", *common)
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout)
    assert again["cache_hit_kind"] == "partial"
    # At least the system prompt; the first run's last state also holds the opening
    # tokens of the user turn, which the second shares.
    assert boundary <= again["cache_delta"]["tokens_read"] < again["prompt_tokens"]

    without_cache = run_cli("complete", "--prompt", "Something else entirely",
                            *[a if a != daemon.address else "none" for a in common])
    assert without_cache.returncode == 0, without_cache.stderr
    assert json.loads(without_cache.stdout)["tokens"] == again["tokens"]


def test_cli_complete_reports_errors_cleanly(tiny_model: Path) -> None:
    result = run_cli("complete", "--model", str(tiny_model), "--cache", "none", "--threads",
                     "1", "--n-ctx", "256", "--n-seq-max", "1", "--raw",
                     "--prompt", "word " * 400)
    assert result.returncode != 0
    assert "prompt_too_long" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- shutdown


def test_sigterm_mid_decode_saves_shutdown_state_that_a_new_process_restores(
        daemon_factory: Callable[..., DaemonProcess], tiny_model_no_eog: Path,
        tmp_path: Path) -> None:
    daemon = daemon_factory()
    with LlamaModel(tiny_model_no_eog) as m:
        prompt = sample_prompt(m.tokenize, 100)
    # The request cannot end before ~8000 generated tokens (no reachable EOG): it is
    # decoding when SIGTERM arrives. No continued saves: only shutdown can save it.
    args = ("--n-ctx", "8192", "--n-seq-max", "1", "--continued-interval", "0")
    first = RuntimeProcess(tiny_model_no_eog, daemon.address, tmp_path / "rt1.log", *args)
    first.start()
    try:
        with grpc.insecure_channel(first.address) as channel:
            stream = pb_grpc.ModelRuntimeStub(channel).Complete(
                request(tokens=prompt, until_context_full=True), timeout=120)
            next(stream)  # the first generated token: the request is decoding
            first.popen().send_signal(signal.SIGTERM)
            events = list(stream)
        assert events and events[-1].WhichOneof("event") == "done"
        done = events[-1].done
        assert first.popen().wait(60) == 0, first.log()
    finally:
        first.close()
    assert done.finish_reason == "shutdown"
    generated = list(done.tokens)
    assert len(generated) >= 1
    counters = daemon_counters(daemon)
    assert counters.get("saves_committed_shutdown", 0) >= 1
    assert counters.get("saves_committed_finish", 0) == 0

    # A new process restores exactly what was live: prompt + generated but the last
    # token (sampled, not yet decoded). (Its own finished sequences are not reused here:
    # the parent key must be what serves the second request.)
    live = prompt + generated[:-1]
    second = RuntimeProcess(tiny_model_no_eog, daemon.address, tmp_path / "rt2.log", *args,
                            "--no-reuse-live")
    second.start()
    try:
        with RuntimeClient(second.address, timeout=60) as client:
            resumed = client.complete(tokens=live, max_tokens=3)
            by_key = client.complete(tokens=prompt + generated + [5, 6], max_tokens=3,
                                     parent_key=done.finish_key)
            stats = client.stats()
    finally:
        second.close()
    assert resumed["cache_hit_kind"] == "exact"
    assert int(resumed["cache_delta"]["tokens_read"]) == len(live)
    assert by_key["cache_hit_kind"] == "partial"
    assert int(by_key["cache_delta"]["tokens_read"]) == len(live)
    assert int(stats["counters"]["resolved_by_parent"]) == 1


def test_sigterm_when_idle_exits_cleanly(stack: tuple[DaemonProcess, RuntimeProcess],
                                         tiny_model: Path, tmp_path: Path) -> None:
    runtime = RuntimeProcess(tiny_model, stack[0].address, tmp_path / "rt.log").start()
    socket_path = runtime.socket
    try:
        runtime.popen().send_signal(signal.SIGTERM)
        assert runtime.popen().wait(60) == 0, runtime.log()
        assert not socket_path.exists()
    finally:
        runtime.close()
    assert not os.path.exists(socket_path)
