"""The daemon's KV events on the wire, read with raw ZMQ sockets as any subscriber reads
them: topics, sequence numbers, the start-up snapshot, vLLM's replay protocol, the array
layout (read by the real Dynamo indexer), and a late subscriber that catches up by replay.
"""

from __future__ import annotations

import time

import pytest
import zmq

from kvcache.client import Identity
from kvcache.kv_events.wire import (
    TOPIC_ALL,
    Cleared,
    Removed,
    Stored,
    decode_batch,
    namespace_tag,
)
from tests.support.entries import toks
from tests.support.kv_events import (
    BLOCK,
    IDENT,
    DaemonFactory,
    IndexerFactory,
    Subscriber,
    endpoint,
    event_args,
    save,
    tier,
    wait_match,
)


def test_batches_name_model_and_namespace_and_never_the_tenant(
        daemon_factory: DaemonFactory) -> None:
    ev = endpoint()
    d = daemon_factory(*event_args(ev))
    sub = Subscriber(ev)
    try:
        alice = Identity(IDENT.model_fingerprint, IDENT.kv_layout, "alice-corp",
                         IDENT.model_name)
        tokens = toks(50, 2 * BLOCK + 3)
        with d.client() as c:
            ns = c.namespace_of(alice)
            save(c, tokens, identity=alice)
        got = sub.messages(until=lambda m: any(
            any(isinstance(e, Stored) for e in events) and topic != TOPIC_ALL
            for topic, _, events, _ in m) and any(topic == TOPIC_ALL for topic, *_ in m))
    finally:
        sub.close()
    # A new subscriber gets a re-announce, on the topic of every namespace.
    announce = next(events for topic, _, events, _ in got if topic == TOPIC_ALL)
    assert isinstance(announce[0], Cleared)
    topic, _, events, payload = next(m for m in got if m[0] != TOPIC_ALL)
    assert topic == f"kvcache/tiny.gguf/{namespace_tag(ns)}"
    (stored,) = [e for e in events if isinstance(e, Stored)]
    assert stored.block_size == BLOCK and stored.parent is None
    assert list(stored.token_ids) == tokens[: 2 * BLOCK]
    assert stored.medium in ("DISK", "CPU") and len(stored.hashes) == 2
    assert all(0 <= h < 2**64 for h in stored.hashes)
    seqs = [s for _, s, _, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # No frame names the tenant, nor holds its namespace.
    for topic_, _, _, raw in got:
        assert b"alice" not in raw and "alice" not in topic_ and ns not in raw


def test_replay_answers_from_a_start_with_a_snapshot_when_it_is_older_than_the_buffer(
        daemon_factory: DaemonFactory) -> None:
    ev, replay = endpoint(), endpoint()
    d = daemon_factory(*event_args(ev, replay))
    tokens = toks(51, 2 * BLOCK)
    with d.client() as c:
        key = save(c, tokens)
        time.sleep(0.5)  # published
        c.delete(key)
        time.sleep(0.5)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        def ask(start: int) -> list[tuple[int, bytes]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            answer = []
            while dealer.poll(5000):
                _, seq, payload = dealer.recv_multipart()
                answer.append((int.from_bytes(seq, "big", signed=True), payload))
                if answer[-1][0] == -1:
                    return answer
            pytest.fail(f"no end of replay after {answer}")

        everything = ask(0)
        assert everything[-1] == (-1, b"")
        batches = [(s, decode_batch(p)[1]) for s, p in everything[:-1]]
        # A start before the buffer: a snapshot (clear, then what is held now: nothing),
        # numbered just below the oldest batch buffered, then the buffer in order.
        assert batches[0][1] == [Cleared()]
        assert batches[1][0] == batches[0][0] + 1
        assert [s for s, _ in batches] == sorted(s for s, _ in batches)
        kinds = [type(e) for _, events in batches[1:] for e in events]
        assert kinds.index(Stored) < kinds.index(Removed)
        # From the last batch on: only it.
        last = batches[-1][0]
        assert [s for s, _ in ask(last)[:-1]] == [last]
        assert ask(last + 1) == [(-1, b"")]
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_the_array_layout_is_read_by_dynamo(daemon_factory: DaemonFactory,
                                            indexer_factory: IndexerFactory) -> None:
    pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the dev extra) is missing")
    ev = endpoint()
    d = daemon_factory(*event_args(ev), "--kv-events-layout", "array")
    indexer = indexer_factory({1: [ev]})
    tokens = toks(52, 3 * BLOCK)
    with d.client() as c:
        save(c, tokens)
    wait_match(indexer, tokens, lambda r: tier(r, 1) == 3 * BLOCK, "stored, array layout")


def test_a_late_subscriber_catches_up_by_replay(daemon_factory: DaemonFactory,
                                                indexer_factory: IndexerFactory) -> None:
    pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the dev extra) is missing")
    ev, replay = endpoint(), endpoint()
    d = daemon_factory(*event_args(ev, replay))
    early = toks(53, 2 * BLOCK)
    with d.client() as c:
        save(c, early)
    indexer = indexer_factory()
    indexer.register(1, ev, replay)
    # Its first batch is not the first one: the indexer asks for the ones before it.
    wait_match(indexer, early, lambda r: tier(r, 1) == 2 * BLOCK, "published before it came")
    log = indexer.log()
    assert "Requesting replay" in log and "No replay endpoint" not in log


def test_bad_endpoints_are_refused_before_anything_starts(tmp_path) -> None:
    import subprocess
    import sys

    for args, words in [(["--kv-events", "localhost:5557"], "not a ZMQ endpoint"),
                        (["--kv-events-replay", "tcp://127.0.0.1:5558"], "needs --kv-events"),
                        (["--kv-events", "tcp://127.0.0.1:5557", "--kv-events-replay",
                          "tcp://127.0.0.1:5557"], "must differ")]:
        out = subprocess.run([sys.executable, "-m", "kvcache.cli", "serve", "--dir",
                              str(tmp_path / "d"), *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and words in out.stderr, out.stderr
        assert not (tmp_path / "d").exists()
