"""The gateway behind the real vllm-router (PyPI, Rust): chat, streams and tool calls pass
through with every field the router adds, and a client's own values of those fields are
applied; the endpoints routers call answer; ``kv_aware``,
fed by the hosts' daemons' KV events, sends a conversation back to the host holding its
prefix where ``round_robin`` does not.

Two hosts on this machine, each a daemon publishing KV events and a gateway on it (the
tiny Hermes model, one worker, one thread)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.procs import Daemon, Gateway
from harness.routers import VllmRouter

from tests.support.daemon_proc import wait_for
from tests.support.gateway_proc import kill_leftovers
from tests.support.kv_events import endpoint
from tests.support.router_traffic import chat_stream_and_tool_call, fields_applied

BLOCK = 64
SYSTEM = ("You are the dispatcher of a delivery company. Answer briefly; look parcels up "
          "with the tools rather than guessing. ") * 8
# What vllm-router adds to every chat body it passes on (seen by running it).
ROUTER_FIELDS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                 "continue_final_message": False, "skip_special_tokens": True,
                 "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False, "include_reasoning": True}


class Host:
    def __init__(self, tmp: Path, name: str, model: Path) -> None:
        self.events = endpoint()
        self.daemon = Daemon(tmp / f"{name}-data", "--block-size", str(BLOCK),
                             "--kv-events", self.events)
        self.gateway = Gateway(tmp / f"{name}-gateway.log", "--model", f"hermes={model}",
                               "--n-ctx", "2048", cache=self.daemon.address)

    def start(self) -> Host:
        self.daemon.start()
        self.gateway.start()
        return self

    def served(self) -> int:
        return sum(w["served"] for w in self.gateway.status()["workers"])

    def close(self) -> None:
        pids: list[int] = []
        with contextlib.suppress(OSError, ValueError):
            pids = [w["pid"] for w in self.gateway.status()["workers"]]
        self.gateway.close()
        kill_leftovers(pids)
        self.daemon.close()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory,
          tiny_hermes_model: Path) -> Iterator[list[Host]]:
    tmp = tmp_path_factory.mktemp("fleet")
    started: list[Host] = []
    try:
        for name in ("a", "b"):
            started.append(Host(tmp, name, tiny_hermes_model).start())
        yield started
    finally:
        for host in started:
            host.close()


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[VllmRouter] = []

    def start(hosts: list[Host], policy: str) -> VllmRouter:
        sources = {h.gateway.url: [h.events] for h in hosts} if policy == "kv_aware" else None
        r = VllmRouter(tmp_path / f"router-{policy}.log", [h.gateway.url for h in hosts],
                       policy, kv_sources=sources, block_size=BLOCK, model="hermes")
        started.append(r)
        return r.start()

    yield start
    for r in started:
        r.close()


def ask(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
def test_chat_streams_and_tool_calls_pass_through_the_router(hosts: list[Host],
                                                              router_factory: Any,
                                                              policy: str) -> None:
    router = router_factory(hosts, policy)
    client = router.client()
    before = [h.served() for h in hosts]
    chat_stream_and_tool_call(client, ask)
    if policy == "round_robin":  # both hosts served
        assert all(h.served() > b for h, b in zip(hosts, before, strict=True))


def test_the_router_fields_are_taken_at_their_neutral_values_and_refused_at_others(
        hosts: list[Host]) -> None:
    gw = hosts[0].gateway
    body = {"model": "hermes", "messages": ask("Hi"), "max_tokens": 2, **ROUTER_FIELDS}
    status, _, raw = gw.http("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, raw
    for name, value in [("return_hidden_states", True)]:
        status, _, raw = gw.http("POST", "/v1/chat/completions",
                                 json.dumps({**body, name: value}).encode())
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == name, (name, raw)
        assert error["code"] == "unsupported_parameter"
    text = {"model": "hermes", "prompt": "Hi", "max_tokens": 2, "stream": False, "echo": False,
            "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
            "return_hidden_states": False}
    status, _, raw = gw.http("POST", "/v1/completions", json.dumps(text).encode())
    assert status == 200, raw


def test_a_clients_values_of_the_fields_the_router_adds_are_applied(
        hosts: list[Host], router_factory: Any) -> None:
    client = router_factory(hosts, "round_robin").client()
    base, text = fields_applied(client, ask)
    # continue_final_message (with add_generation_prompt false): the reply goes on with the
    # last assistant message.
    opened = [*ask("Say more."), {"role": "assistant", "content": text[:6]}]
    going = {**base, "messages": opened,
             "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    going_on = client.chat.completions.create(**going)
    direct = hosts[0].gateway.client().chat.completions.create(**going)
    assert going_on.choices[0].message.content == direct.choices[0].message.content
    new_turn = client.chat.completions.create(**{**base, "messages": opened})
    assert going_on.usage.prompt_tokens == direct.usage.prompt_tokens < \
        new_turn.usage.prompt_tokens


def test_the_endpoints_routers_call_answer(hosts: list[Host]) -> None:
    gw = hosts[0].gateway
    for path in ("/health", "/health_generate", "/v1/models", "/model_info", "/get_model_info",
                 "/server_info", "/get_server_info", "/version", "/get_load"):
        status, _, raw = gw.http("GET", path)
        assert status == 200, (path, raw)
    for path in ("/model_info", "/server_info"):  # what sglang-router names the model by
        assert json.loads(gw.http("GET", path)[2])["served_model_name"] == "hermes"
    assert json.loads(gw.http("GET", "/get_load")[2])["load"] == 0
    status, _, raw = gw.http("POST", "/flush_cache")
    assert status == 403 and b"kvcache prune" in raw
    # Render: the tokens the worker prefills for the request, nothing computed.
    body = {"model": "hermes", "messages": ask("Render me."), "max_tokens": 3}
    status, _, raw = gw.http("POST", "/v1/chat/completions/render", json.dumps(body).encode())
    assert status == 200, raw
    rendered = json.loads(raw)
    reply = gw.client().chat.completions.create(model="hermes", messages=ask("Render me."),
                                                max_tokens=3, temperature=0)
    assert len(rendered["token_ids"]) == reply.usage.prompt_tokens
    assert rendered["model"] == "hermes" and rendered["sampling_params"]["max_tokens"] == 3
    status, _, raw = gw.http("POST", "/v1/completions/render",
                             json.dumps({"model": "hermes", "prompt": [5, 6, 7]}).encode())
    assert status == 200 and json.loads(raw)["token_ids"][-3:] == [5, 6, 7], raw
    status, _, raw = gw.http("POST", "/v1/chat/completions/render",
                             json.dumps({**body, "ignore_eos": True}).encode())
    assert status == 200 and json.loads(raw)["sampling_params"]["ignore_eos"] is True, raw
    status, _, raw = gw.http("POST", "/v1/chat/completions/render",
                             json.dumps({**body, "return_hidden_states": True}).encode())
    assert status == 400 and json.loads(raw)["error"]["param"] == "return_hidden_states"


def test_kv_aware_sends_a_conversation_back_to_the_host_holding_its_prefix(
        hosts: list[Host], router_factory: Any) -> None:
    router = router_factory(hosts, "kv_aware")
    client = router.client()
    system = "(kv_aware) " + SYSTEM
    before = [h.served() for h in hosts]
    first = client.chat.completions.create(model="hermes", messages=ask("Q0", system),
                                           max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 3 * BLOCK
    (holder,) = [h for h, b in zip(hosts, before, strict=True) if h.served() > b]
    # Its daemon saved the prompt, and its events told the router (the router reads them
    # within milliseconds; its state is not visible from outside: give it a moment).
    wait_for(lambda: bool(holder.daemon.client().list_entries(reason="finish")),
             "the first reply's finish save")
    time.sleep(0.5)
    served = holder.served()
    for i in range(1, 4):
        reply = client.chat.completions.create(model="hermes", messages=ask(f"Q{i}", system),
                                               max_tokens=2, temperature=0)
        details = reply.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens >= 3 * BLOCK, (i, reply.usage)
    assert holder.served() == served + 3
