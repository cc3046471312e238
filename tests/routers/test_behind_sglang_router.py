"""The gateway behind the real sglang-router (PyPI, Rust): it registers the gateways (it
asks each for ``/health``, ``/server_info`` and ``/model_info``, then ``/health`` every
few seconds) and lists their model at its own ``/v1/models``; chat, streams and tool
calls pass through with every field it adds to a body (``no_stop_trim``, ``ignore_eos``,
``continue_final_message``, ``skip_special_tokens``, ``separate_reasoning``,
``stream_reasoning``, ``return_hidden_states``, ``logprobs``), and a client's own values of
those fields are applied.

Two gateways on this machine (the tiny Hermes model, one worker, one thread, no cache
daemon), behind ``round_robin``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.procs import Gateway
from harness.routers import SglangRouter, http_json

from tests.support.gateway_proc import kill_leftovers
from tests.support.router_traffic import chat_stream_and_tool_call, fields_applied


def served(gateway: Gateway) -> int:
    return sum(w["served"] for w in gateway.status()["workers"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory,
          tiny_hermes_model: Path) -> Iterator[tuple[list[Gateway], SglangRouter]]:
    tmp = tmp_path_factory.mktemp("sglang-fleet")
    gateways: list[Gateway] = []
    router = None
    try:
        for name in ("a", "b"):
            gateways.append(Gateway(tmp / f"{name}-gateway.log", "--model",
                                    f"hermes={tiny_hermes_model}", "--n-ctx", "2048").start())
        router = SglangRouter(tmp / "router.log", [g.url for g in gateways],
                              "round_robin").start()
        yield gateways, router
    finally:
        if router is not None:
            router.close()
        for gateway in gateways:
            pids: list[int] = []
            with contextlib.suppress(OSError, ValueError):
                pids = [w["pid"] for w in gateway.status()["workers"]]
            gateway.close()
            kill_leftovers(pids)


def ask(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a dispatcher. Answer briefly."},
            {"role": "user", "content": user}]


def test_models_chat_streams_and_tool_calls_pass_through_the_router(
        fleet: tuple[list[Gateway], SglangRouter]) -> None:
    gateways, router = fleet
    status, models = http_json("GET", router.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["hermes"], models
    client = router.client()
    before = [served(g) for g in gateways]
    chat_stream_and_tool_call(client, ask)
    assert all(served(g) > b for g, b in zip(gateways, before, strict=True))  # round_robin


def test_a_clients_values_of_the_fields_the_router_adds_are_applied(
        fleet: tuple[list[Gateway], SglangRouter]) -> None:
    _, router = fleet
    fields_applied(router.client(), ask)
