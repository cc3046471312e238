"""Supervision, provoked: a worker killed mid-stream, a worker stopped (SIGSTOP) with a
request in flight, one that stops answering its health check, a long prefill that must not
count as a stall, a crash loop, and the gateway itself killed or interrupted.

Real processes throughout: the gateway, its ``model-runtime serve`` workers (the tiny
model whose requests only end at max_tokens or the context's end), a cache daemon.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon_proc import DaemonProcess
from tests.support.gateway_proc import (
    GatewayProcess,
    Gateways,
    kill_leftovers,
    model_entry,
    wait_gone,
)

STALL_WINDOW = 1.0
PROMPT = "Kilo lima mike november oscar papa. " * 24  # > 512 tokens: a cold save is taken


def supervised(tmp: Path, name: str, model: Path, cache: str, supervision: dict[str, Any],
               *args: str, workers: int = 1) -> GatewayProcess:
    config = tmp / f"{name}.json"
    config.write_text(json.dumps({
        "models": [{"name": "long", "path": str(model), "workers": workers,
                    "args": ["--n-ctx", "16384", "--n-seq-max", "2",
                             "--continued-interval", "0", *args]}],
        "supervision": {"kill_grace_s": 1.0, "backoff_s": 0.1, **supervision}}))
    return GatewayProcess(tmp / f"{name}.log", "--config", str(config), cache=cache)


@pytest.fixture(scope="module")
def gw(module_daemon: DaemonProcess, gateways: Gateways,
       tiny_model_no_eog: Path) -> GatewayProcess:
    """Stall window 1 s; health checks too lenient to act first."""
    return gateways.start("gw", models=[
        model_entry("long", tiny_model_no_eog, "--n-ctx", "16384", "--n-seq-max", "2",
                    "--continued-interval", "0")],
        supervision={"kill_grace_s": 1.0, "backoff_s": 0.1, "stall_window_s": STALL_WINDOW,
                     "health_interval_s": 0.5, "health_failures": 30},
        cache=module_daemon, clean_stop=False)


def read_until_failure(stream: Any) -> tuple[openai.APIError, int]:
    chunks = 0
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            chunks += 1
    return err.value, chunks


def wait_saved(daemon: DaemonProcess, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    with daemon.client() as c:
        while not any(t.entries for t in c.stats().tiers):
            assert time.monotonic() < deadline, "nothing was saved"
            time.sleep(0.05)


def test_worker_killed_mid_stream_fails_at_once_and_the_next_request_is_warm(
        gw: GatewayProcess, module_daemon: DaemonProcess) -> None:
    client = gw.client()
    before = gw.worker("w0")
    stream = client.completions.create(model="long", prompt=PROMPT, stream=True)
    iterator = iter(stream)
    for _ in range(5):
        next(iterator)
    wait_saved(module_daemon)  # the prompt's cold save is in the daemon
    killed = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    error, _ = read_until_failure(iterator)
    assert time.monotonic() - killed < 2.0
    assert error.code == "worker_died", error.body

    # The next request waits for the restarted worker and finds the prompt in the daemon.
    again = client.completions.create(model="long", prompt=PROMPT, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 256
    assert again.model_extra["kvcache"]["tier"] in ("ram", "disk")
    after = gw.worker("w0")
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    assert after["restart_history"][-1]["text"].startswith("worker_died")
    assert after["last_start_s"] > 0


def test_stopped_worker_is_restarted_after_the_stall_window(gw: GatewayProcess) -> None:
    client = gw.client()
    before = gw.wait_worker("w0", lambda w: w["state"] == "ready")
    stream = client.completions.create(model="long", prompt="Quebec romeo", stream=True)
    iterator = iter(stream)
    next(iterator)
    stopped = time.monotonic()
    os.kill(before["pid"], signal.SIGSTOP)
    try:
        error, _ = read_until_failure(iterator)
        waited = time.monotonic() - stopped
    finally:
        if not wait_gone([before["pid"]], timeout=15):
            os.kill(before["pid"], signal.SIGKILL)
    assert error.code == "stall_timeout", error.body
    assert STALL_WINDOW <= waited < STALL_WINDOW + 4
    after = gw.wait_worker("w0", lambda w: w["state"] == "ready")
    assert after["pid"] != before["pid"]
    assert after["restart_history"][-1]["text"].startswith("stall_timeout")
    done = client.completions.create(model="long", prompt="Sierra tango", max_tokens=3)
    assert done.usage.completion_tokens == 3


def test_a_long_prefill_is_not_a_stall(gw: GatewayProcess) -> None:
    before = gw.wait_worker("w0", lambda w: w["state"] == "ready")
    tokens = [5 + i % 290 for i in range(12_000)]  # ~3 s of prefill with no event at all
    done = gw.client().completions.create(model="long", prompt=tokens, max_tokens=1)
    assert done.usage.prompt_tokens == len(tokens)
    assert done.model_extra["kvcache"]["prefill_ms"] > 1000 * STALL_WINDOW
    after = gw.worker("w0")
    assert after["restarts"] == before["restarts"] and after["pid"] == before["pid"]


def test_worker_failing_its_health_checks_is_restarted(
        tmp_path: Path, tiny_model_no_eog: Path) -> None:
    gateway = supervised(tmp_path, "health", tiny_model_no_eog, "none",
                         {"stall_window_s": 60, "health_interval_s": 0.2,
                          "health_timeout_s": 0.3, "health_failures": 2})
    pids: list[int] = []
    try:
        gateway.start()
        before = gateway.worker("w0")
        pids = [before["pid"]]
        stream = gateway.client().completions.create(model="long", prompt="Uniform",
                                                     stream=True)
        iterator = iter(stream)
        next(iterator)
        os.kill(before["pid"], signal.SIGSTOP)
        error, _ = read_until_failure(iterator)
        assert error.code == "worker_restarted", error.body
        after = gateway.wait_worker("w0", lambda w: w["state"] == "ready")
        pids.append(after["pid"])
        assert "health check failed" in after["restart_history"][-1]["text"]
    finally:
        gateway.close()
        kill_leftovers(pids)


def test_crash_loop_gives_up_and_says_so(tmp_path: Path, tiny_model: Path) -> None:
    # --n-batch 0 is refused by every start: the worker exits at once, again and again.
    gateway = supervised(tmp_path, "crash", tiny_model, "none",
                         {"crash_loop_restarts": 2, "backoff_s": 0.05}, "--n-batch", "0")
    try:
        gateway.start(workers_ready=False)
        failed = gateway.wait_worker("w0", lambda w: w["state"] == "failed", timeout=60)
        history = [line["text"] for line in failed["restart_history"]]
        assert [h.split(":")[0] for h in history[:3]] == ["start_failed"] * 3
        assert "crash loop" in history[-1]
        assert any("--n-batch" in line["text"] for line in failed["recent_logs"])
        status, _, body = gateway.http("GET", "/health")
        assert status == 503
        with pytest.raises(openai.InternalServerError) as err:
            gateway.client().completions.create(model="long", prompt="x", max_tokens=1)
        assert err.value.status_code == 503 and err.value.code == "worker_failed"
    finally:
        gateway.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_stopping_the_gateway_leaves_no_worker(tmp_path: Path, tiny_model: Path,
                                               sig: signal.Signals) -> None:
    gateway = GatewayProcess(tmp_path / "gateway.log", "--model", f"tiny={tiny_model}",
                             "--workers", "2", "--n-ctx", "512", "--n-seq-max", "1")
    pids: list[int] = []
    try:
        gateway.start()
        pids = [w["pid"] for w in gateway.status()["workers"]]
        assert len(pids) == 2 and all(pids)
        stream = gateway.client().completions.create(model="tiny", prompt="Victor",
                                                     max_tokens=50, stream=True)
        next(iter(stream))
        os.kill(gateway.pid, sig)
        assert gateway.proc is not None
        code = gateway.proc.wait(30)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), gateway.log()
        assert wait_gone(pids, timeout=10), "a worker outlived the gateway"
    finally:
        gateway.close()
        kill_leftovers(pids)
