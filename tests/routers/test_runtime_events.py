"""The runtime's live sequences as the device tier, read by the real Dynamo indexer: a
host is a daemon (disk and host-memory tiers, data-parallel rank 0) and a gateway whose
worker publishes its live sequences (rank 1, passed on by ``model-runtime gateway
--kv-events``). What a worker holds live is matched on the device tier; a sequence reused
for another prompt takes its blocks with it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.procs import Daemon, Gateway

from tests.support.gateway_proc import kill_leftovers
from tests.support.kv_events import BLOCK, IndexerFactory, endpoint, event_args, tier, wait_match

pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the dev extra) is missing")


@pytest.fixture
def host(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Daemon, Gateway, str, str]]:
    daemon_events, worker_events = endpoint(), endpoint()
    daemon = Daemon(tmp_path / "data", *event_args(daemon_events)).start()
    gateway = Gateway(tmp_path / "gateway.log", "--model", f"tiny={tiny_model}",
                      "--n-ctx", "1024", "--n-seq-max", "1", "--kv-events", worker_events,
                      cache=daemon.address)
    pids: list[int] = []
    try:
        gateway.start()
        pids = [w["pid"] for w in gateway.status()["workers"]]
        yield daemon, gateway, daemon_events, worker_events
    finally:
        gateway.close()
        kill_leftovers(pids)
        daemon.close()


def rendered(gw: Gateway, messages: list[dict[str, str]]) -> list[int]:
    body = json.dumps({"model": "tiny", "messages": messages}).encode()
    status, _, raw = gw.http("POST", "/v1/chat/completions/render", body)
    assert status == 200, raw
    return list(json.loads(raw)["token_ids"])


def test_a_workers_live_sequence_is_the_device_tier(host, indexer_factory: IndexerFactory
                                                     ) -> None:
    daemon, gw, daemon_events, worker_events = host
    indexer = indexer_factory({1: [daemon_events, worker_events]})
    first = [{"role": "system", "content": "You sort parcels. " * 12},
             {"role": "user", "content": "Where does A1 go?"}]
    tokens = rendered(gw, first)
    gw.client().chat.completions.create(model="tiny", messages=first, max_tokens=2,
                                        temperature=0)
    full = len(tokens) // BLOCK * BLOCK
    live = wait_match(indexer, tokens, lambda r: tier(r, 1, "gpu") == full,
                      "the live sequence on the device tier")
    assert live["1"]["dp"]["1"] == full  # rank 1: the worker's events
    # One sequence: another prompt takes it over, and the first prompt's blocks leave
    # the device tier (the daemon still holds what it saved of them).
    other = [{"role": "system", "content": "You count boxes. " * 12},
             {"role": "user", "content": "How many?"}]
    gw.client().chat.completions.create(model="tiny", messages=other, max_tokens=2,
                                        temperature=0)
    after = wait_match(indexer, tokens, lambda r: tier(r, 1, "gpu") < full,
                       "the first prompt off the device tier")
    assert tier(after, 1, "disk") > tier(after, 1, "gpu")
