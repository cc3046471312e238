"""Tenants share workers: one worker serves alice and bob, each request carrying its key's
tenant to the runtime, and neither reuses the other's KV (from the daemon, from a live
sequence, through a session id), while each tenant's repeat still hits. A tenant holds at
most its share of a model's slots; the others are still served. /health says nothing
of tenants.

One real gateway (one worker of two slots, the tiny model that never ends a reply by
itself), a real daemon, three keys: alice's, bob's and an operator's (tenant alice).
Two tenants: each may hold one slot at once by default (half of two).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from model_runtime.client import RuntimeClient
from tests.support.daemon_proc import DaemonProcess
from tests.support.gateway_proc import (
    ALICE,
    BOB,
    OPERATOR,
    GatewayProcess,
    Gateways,
    chat,
    metrics,
)

PROMPT_TOKENS = 400  # long enough to be saved, and a leak would show as hundreds cached


@pytest.fixture(scope="module")
def gw(module_daemon: DaemonProcess, gateways: Gateways,
       tiny_model_no_eog: Path) -> GatewayProcess:
    return gateways.start(
        "gateway_tenants", keys=f"{ALICE} alice\n{BOB} bob\n{OPERATOR} alice role=admin\n",
        args=("--model", f"tiny={tiny_model_no_eog}", "--n-ctx", "4096", "--n-seq-max", "2"),
        cache=module_daemon, admin_key=OPERATOR, clean_stop=False)


def tokens(first: int) -> list[int]:
    """A prompt of token ids of its own: prompts with different ``first`` share nothing
    (no template, no BOS), so a tenant's own earlier prompts give it no hit either."""
    return [first] + [5 + (first * 7 + i) % 290 for i in range(PROMPT_TOKENS - 1)]


def complete(gw: GatewayProcess, key: str, prompt: list[int]) -> Any:
    return gw.client(api_key=key).completions.create(model="tiny", prompt=prompt,
                                                     max_tokens=2, temperature=0)


def cached(done: Any) -> int:
    return int(done.usage.prompt_tokens_details.cached_tokens)


def details(done: Any) -> dict[str, Any]:
    return dict(done.model_extra["kvcache"])


def the_worker(gw: GatewayProcess) -> dict[str, Any]:
    (worker,) = gw.status()["workers"]  # one worker for both tenants
    return worker


def wait_saves_settled(gw: GatewayProcess, quiet_s: float = 0.5) -> None:
    """Until the worker's save counters have not moved for ``quiet_s`` (a save of the tiny
    model takes milliseconds): what is in the daemon then stays there for the next
    request."""
    with RuntimeClient(f"unix:{the_worker(gw)['socket']}", timeout=30) as runtime:
        deadline = time.monotonic() + 30
        last, since = None, time.monotonic()
        while True:
            counters = runtime.stats()["counters"]
            now = {k: v for k, v in counters.items() if k.startswith("saves")}
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            assert time.monotonic() < deadline, now
            time.sleep(0.05)


def test_one_worker_serves_both_tenants_and_bob_reuses_nothing_of_alice_s(
        gw: GatewayProcess) -> None:
    """Alice's prompt is live in the worker and saved in the daemon: her repeat hits it,
    bob's identical prompt on the same worker process is computed cold, with the same
    output."""
    prompt = tokens(11)
    first = complete(gw, ALICE, prompt)
    wait_saves_settled(gw)
    again = complete(gw, ALICE, prompt)
    assert cached(again) >= PROMPT_TOKENS - 1, details(again)
    assert details(again)["tier"] == "live"
    pid = the_worker(gw)["pid"]
    bob = complete(gw, BOB, prompt)
    assert cached(bob) == 0 and details(bob)["hit_kind"] == "cold", details(bob)
    assert details(bob)["tokens_restored"] == 0
    assert details(bob)["tenant"] == "bob" and details(again)["tenant"] == "alice"
    assert details(bob)["worker"] == details(again)["worker"] == details(first)["worker"]
    assert the_worker(gw)["pid"] == pid  # the same process served both
    assert bob.choices[0].text == first.choices[0].text


def test_bob_gets_nothing_from_the_daemon_that_alice_saved(gw: GatewayProcess) -> None:
    """Alice's prompt is in the daemon only (her two later prompts took both sequences):
    bob's identical prompt is cold; alice's own repeat is restored from the daemon."""
    prompt = tokens(23)
    complete(gw, ALICE, prompt)
    for other in (31, 37):  # the worker's two sequences now hold these
        complete(gw, ALICE, tokens(other))
    wait_saves_settled(gw)
    bob = complete(gw, BOB, prompt)
    assert cached(bob) == 0 and details(bob)["hit_kind"] == "cold", details(bob)
    alice = complete(gw, ALICE, prompt)
    assert cached(alice) >= PROMPT_TOKENS // 2, details(alice)
    assert details(alice)["tier"] not in ("", "live"), details(alice)  # the daemon's
    assert details(alice)["worker"] == details(bob)["worker"]


def test_a_session_id_is_each_tenant_s_own(gw: GatewayProcess) -> None:
    """The same session id from alice and bob: two sessions, bob's cold and not busy
    while alice's is pinned."""
    messages = chat("Session test of the shared worker. " * 20, "Hello")

    def session(key: str) -> Any:
        return gw.client(api_key=key).chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0,
            extra_body={"session_id": "same-id"})

    alice = session(ALICE)
    bob = session(BOB)
    assert cached(bob) == 0 and details(bob)["hit_kind"] == "cold", details(bob)
    assert details(bob)["worker"] == details(alice)["worker"]
    again = session(ALICE)
    assert details(again)["hit_kind"] == "sticky" and cached(again) > 100


def hold_slot(gw: GatewayProcess, key: str, started: threading.Event,
              stop: threading.Event) -> threading.Thread:
    """A streamed request of ``key``'s tenant that holds its slot until ``stop``."""
    def run() -> None:
        client = gw.client(api_key=key)
        with client.completions.create(model="tiny", prompt="hold", max_tokens=4000,
                                       stream=True) as events:
            for _ in events:
                started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_tenant_at_its_share_waits_while_the_other_is_served(gw: GatewayProcess) -> None:
    """Alice holds one of the two slots (her share): her next request is a 429
    ``tenant_slots_busy`` before its body is read (a malformed one), bob's is served on
    the free slot; alice's numbers show her slot, bob's show neither hers nor the pool's.
    """
    started, stop = threading.Event(), threading.Event()
    holder = hold_slot(gw, ALICE, started, stop)
    try:
        assert started.wait(60)
        code, headers, body = gw.http("POST", "/v1/completions", b'{"model": "tiny", "pr',
                                      headers={"Authorization": f"Bearer {ALICE}"})
        error = json.loads(body)["error"]
        assert code == 429 and error["code"] == "tenant_slots_busy", body
        assert error["type"] == "rate_limit_error" and headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError):
            gw.client(api_key=ALICE).completions.create(model="tiny", prompt="more",
                                                        max_tokens=1)
        done = gw.client(api_key=BOB).completions.create(model="tiny", prompt="bob's turn",
                                                         max_tokens=1)
        assert done.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as err:  # n=2 exceeds bob's share
            gw.client(api_key=BOB).completions.create(model="tiny", prompt="two", n=2,
                                                      max_tokens=1)
        assert err.value.body["param"] == "n"  # type: ignore[index]
        assert the_worker(gw)["slots_busy_by_tenant"] == {"alice": 1}
        assert 'kvcache_gateway_tenant_slots{model="tiny",tenant="alice"} 1.0' in \
            metrics(gw, ALICE)
        bob_view = metrics(gw, BOB)
        assert 'tenant="alice"' not in bob_view
        assert "kvcache_gateway_slots{" not in bob_view  # the pool's moves with alice's
        assert 'kvcache_gateway_slots{model="tiny",state="busy"} 1.0' in metrics(gw, OPERATOR)
    finally:
        stop.set()
        holder.join(60)
    # Her slot freed, alice is served again.
    deadline = time.monotonic() + 10
    while the_worker(gw)["slots_busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert complete(gw, ALICE, tokens(41)).choices[0].finish_reason == "length"


def test_health_says_nothing_of_tenants(gw: GatewayProcess) -> None:
    code, _, body = gw.http("GET", "/health")  # no key: load balancers probe it
    assert code == 200
    assert json.loads(body) == {"status": "ok", "workers_ready": 1, "workers": 1}
    status = gw.status()
    assert status["models"][0]["max_slots_per_tenant"] == 1
    assert "tenant" not in status["workers"][0]


def test_anthropic_messages_carry_the_key_s_tenant_too(gw: GatewayProcess) -> None:
    """The tenant reaches the worker on every route, not only OpenAI's: bob's Anthropic
    request with alice's system prompt reads nothing of hers; her repeat does; all three
    replies alike."""
    import anthropic

    system = "Anthropic route, shared worker. " * 40

    def send(key: str) -> Any:
        client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0,
                                     timeout=60.0)
        return client.messages.create(model="tiny", max_tokens=2, system=system,
                                      extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": "Hello"}])

    first = send(ALICE)
    wait_saves_settled(gw)
    again = send(ALICE)
    assert again.usage.cache_read_input_tokens > 100, again.usage
    bob = send(BOB)
    # (bob's own earlier chats on this worker share the template's first tokens at most)
    assert bob.usage.cache_read_input_tokens < 16, bob.usage
    # Greedy (the Messages API samples at temperature 1 unless told): bob's cold prefill
    # and alice's live reuse of her own give the same reply.
    assert first.content[0].text == again.content[0].text == bob.content[0].text
