"""The remote tier against real redis-server processes (one server, a three-node cluster).

Blobs are real kvcache blobs (blob.encode_blob) under real keys; no model is needed. Each
fault named by the remote tier's issue is provoked for real: a server killed or paused
(SIGSTOP), full (maxmemory with noeviction), values deleted, overwritten or signed with
another key, two hosts saving at once, tenants, a password file, an ACL user.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from harness.procs import REPO

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.counters import REMOTE_SECTION
from kvcache.remote import (
    ChainLink,
    RemoteConfig,
    RemoteConfigError,
    RemoteRecord,
    RemoteTier,
    load_signing_key,
    parse_url,
)
from kvcache.remote import tier as tier_module
from kvcache.remote import upload as upload_module
from kvcache.remote.layout import Names, seal
from kvcache.remote.tier import servable_tokens
from tests.support.daemon_proc import wait_for
from tests.support.redis_proc import RedisServer, redis_cluster, redis_server, tls_redis_server
from tests.support.remote_tier import B, copy_entry, entry_keys

MODEL = "fingerprint-of-a-model"
LAYOUT = {"n_ctx": "512", "type_k": "f16"}
NS = keys.namespace(MODEL, LAYOUT)
KEY1 = b"k" * 32
KEY2 = b"q" * 32
NAMES = Names("kvc")  # an unsigned tier's (the keys' hex)
NAMES1 = Names("kvc", KEY1)  # keyed by the fleet's key
# Every remote counter the tests below moved, summed over every tier they made (checked
# by the last test: each declared counter must be provoked somewhere in this module).
MOVED: Counter[str] = Counter()
# Counted by the daemon's use of the tier (kvcache/remote/sync.py), provoked in
# tests/remote/test_remote_daemon.py.
PROVOKED_BY_A_DAEMON = {"remote_fetched_stored", "remote_fetched_not_stored"}


# --------------------------------------------------------------------------- blobs


def make_blob(tokens: list[int], *, ns: bytes = NS, parent: bytes = b"", base: int = 0,
              payload_bytes: int = 20_000, tenant: str = "", created: float | None = None
              ) -> bytes:
    meta = blobfmt.BlobMeta(namespace=ns, model_fingerprint=MODEL, kv_layout=LAYOUT,
                            tokens=tokens, reason="cold", parent=parent, base=base,
                            tenant_id=keys.tenant_id(tenant),
                            **({"created": created} if created is not None else {}))
    payload = bytes((i * 7 + len(tokens)) % 251 for i in range(payload_bytes))
    return b"".join(bytes(p) for p in blobfmt.encode_blob(meta, payload))


@dataclass
class Chain:
    """Entries ending at ``ends`` of ``tokens``, each a piece of the one before."""

    tokens: list[int]
    links: list[ChainLink]
    blobs: dict[bytes, bytes]

    @property
    def keys(self) -> list[bytes]:
        return [link.key for link in self.links]

    def read_blob(self, key: bytes) -> bytes:
        return self.blobs[key]


def make_chain(tokens: list[int], ends: list[int], *, ns: bytes = NS,
               payload_bytes: int = 20_000, **kwargs: object) -> Chain:
    links: list[ChainLink] = []
    blobs: dict[bytes, bytes] = {}
    base = 0
    for end in ends:
        parent = links[-1].key if links else b""
        data = make_blob(tokens[:end], ns=ns, parent=parent, base=base,
                         payload_bytes=payload_bytes, **kwargs)  # type: ignore[arg-type]
        key = keys.entry_key(ns, tokens[:end], B).key
        links.append(ChainLink(key, base, end, len(data)))
        blobs[key] = data
        base = end
    return Chain(tokens, links, blobs)


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 1000 + i) % 50_000 for i in range(n)]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def tiers() -> Iterator[Callable[..., RemoteTier]]:
    """Make started tiers: ``tiers(url, chunk_bytes=4096)``; all closed after the test,
    their counters added to MOVED."""
    made: list[RemoteTier] = []

    def make(url: str, *, connect: bool = True, **settings: object) -> RemoteTier:
        tier = RemoteTier(RemoteConfig(url, **settings), B)  # type: ignore[arg-type]
        made.append(tier)
        tier.start()
        if connect:
            assert tier.wait_connected(5), tier.stats()
        return tier

    yield make
    for tier in made:
        tier.close()
        MOVED.update(tier.stats()["counters"])  # type: ignore[arg-type]


def counters(tier: RemoteTier) -> dict[str, int]:
    return tier.stats()["counters"]  # type: ignore[return-value]


def publish_all(tier: RemoteTier, chain: Chain) -> None:
    assert tier.publish(chain.links, chain.read_blob)
    assert tier.drain(10)


def command_calls(client: redis.Redis) -> Counter[str]:
    """Calls per command, from INFO commandstats (INFO itself left out)."""
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): value["calls"]
                    for name, value in stats.items() if name != "cmdstat_info"})


def of_namespace(ns: bytes) -> Callable[[RemoteRecord], bool]:
    return lambda r: r.namespace == ns


# --------------------------------------------------------------------------- round trips


def test_multi_part_chain_round_trip(server: RedisServer,
                                     tiers: Callable[..., RemoteTier]) -> None:
    a = tiers(server.url, chunk_bytes=4096)
    chain = make_chain(prompt(1), [40, 70, 100])
    # Only the last entry is published: the uploader brings its ancestors along.
    publish_all(a, chain)
    assert counters(a)["remote_puts"] == 3
    c = server.client()
    for link in chain.links:
        parts = -(-link.size // 4096)
        assert parts >= 5
        assert entry_keys(c, link.key, NAMES) == {NAMES.record(link.key)} | {
            NAMES.part(link.key, i) for i in range(parts)}
        assert c.strlen(NAMES.part(link.key, 0)) <= 4096 + 64  # the chunk plus its header

    # Another host (another tier) finds and fetches it.
    b = tiers(server.url, chunk_bytes=4096)
    match = b.find(NS, chain.tokens + [7, 8, 9])
    assert match is not None and (match.shared, match.n_tokens) == (100, 100)
    assert match.chain_keys == chain.keys
    assert [(x.base, x.n_tokens) for x in match.chain] == [(0, 40), (40, 70), (70, 100)]
    assert b.fetch(match.chain_keys, NS) == [chain.blobs[k] for k in chain.keys]

    # A prompt diverging inside the chain shares its common prefix, token by token.
    match = b.find(NS, chain.tokens[:55] + [99_999] * 30)
    assert match is not None and match.shared == 55
    assert b.find(NS, chain.tokens, max_tokens=33).shared == 33  # type: ignore[union-attr]
    assert b.find(NS, prompt(2)) is None  # nothing shared
    # A prompt shorter than a block still finds the namespace's pointer.
    assert b.find(NS, chain.tokens[:5]).shared == 5  # type: ignore[union-attr]

    # Publishing again stores nothing new.
    publish_all(b, chain)
    assert counters(b)["remote_put_skipped_present"] == 1 and counters(b)["remote_puts"] == 0

    listed = b.list_entries(of_namespace(NS))
    assert sorted(r.key for r in listed) == sorted(chain.keys)
    assert {r.n_tokens for r in listed} == {40, 70, 100}
    assert len(b.list_entries(of_namespace(NS), limit=2)) == 2
    s = b.stats()
    assert s["connected"] and s["url"] == server.url and s["queue_depth"] == 0
    assert counters(b)["remote_bytes_fetched"] == sum(len(v) for v in chain.blobs.values())


def test_whole_states_a_longer_one_hides_from_the_pointers_are_found(
        server: RedisServer, tiers: Callable[..., RemoteTier]) -> None:
    # States that cannot be cut are whole entries, no pieces: a prompt's checkpoint (70)
    # and its finish (100), published after it, whose block pointers then name only the
    # finish. A whole-prefix lookup of the prompt still finds the checkpoint (its own key
    # read with the records: no third round trip), and of a longer prompt the finish.
    tier = tiers(server.url)
    tokens = prompt(6)
    checkpoint, finish = make_chain(tokens, [70]), make_chain(tokens, [100])
    publish_all(tier, checkpoint)
    publish_all(tier, finish)
    c = server.client()
    assert tier.find(NS, tokens[:70]).key == finish.keys[0]  # type: ignore[union-attr]
    before = command_calls(c)
    match = tier.find(NS, tokens[:70], whole_prefix=True)
    assert match is not None and (match.key, match.shared) == (checkpoint.keys[0], 70)
    assert command_calls(c) - before == Counter({"mget": 2})
    match = tier.find(NS, tokens + [7, 8], whole_prefix=True)
    assert match is not None and (match.key, servable_tokens(match, True)) == (
        finish.keys[0], 100)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "known gap (README, Model kinds: a checkpoint shorter than the prompt that a longer "
    "entry saved after it hides is not yet found in the shared tier): a block pointer "
    "names only the last entry through its block, and a prompt between two whole states "
    "is neither's exact key, so the runtime prefills from its local tiers, or cold"))
def test_a_prompt_between_two_whole_states_finds_the_shorter_one(
        server: RedisServer, tiers: Callable[..., RemoteTier]) -> None:
    # A whole state cannot be cut: the deepest whole prefix of a prompt of 80 tokens is
    # the checkpoint of its first 70, not the finish of 100 that shares them all.
    tier = tiers(server.url)
    tokens = prompt(7)
    checkpoint, finish = make_chain(tokens, [70]), make_chain(tokens, [100])
    for chain in (checkpoint, finish):  # (not asserts: they would pass for the gap)
        if not (tier.publish(chain.links, chain.read_blob) and tier.drain(10)):
            pytest.fail("the states were not published")
    exact = tier.find(NS, tokens[:70], whole_prefix=True)
    if exact is None or exact.key != checkpoint.keys[0]:
        pytest.fail(f"the checkpoint is not in the tier: {exact}")
    match = tier.find(NS, tokens[:80], whole_prefix=True)
    assert match is not None and (match.key, servable_tokens(match, True)) == (
        checkpoint.keys[0], 70)


def test_find_and_fetch_take_one_round_trip_each(server: RedisServer,
                                                 tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, chunk_bytes=4096)
    chain = make_chain(prompt(3, 300), [100, 200, 300])
    publish_all(tier, chain)
    c = server.client()
    query = chain.tokens + prompt(4, 50)
    assert tier.find(NS, query) is not None  # warm up: connections made, names set

    before = command_calls(c)
    match = tier.find(NS, query)
    assert match is not None and match.shared == 300
    # 20 block pointers in one MGET, the deepest entry's record in another.
    assert command_calls(c) - before == Counter({"mget": 2})

    before = command_calls(c)
    blobs = tier.fetch(match.chain_keys, NS)
    assert blobs is not None and len(blobs) == 3
    # The 3 records in one MGET, then all 3 pieces' parts (15+) in one.
    assert command_calls(c) - before == Counter({"mget": 2})

    before = command_calls(c)
    other = keys.namespace(MODEL, LAYOUT, tenant="nobody")
    assert tier.find(other, prompt(5, 300)) is None  # no pointer: no second round trip
    assert command_calls(c) - before == Counter({"mget": 1})


def test_cluster_of_three_nodes(tiers: Callable[..., RemoteTier]) -> None:
    with redis_cluster() as cluster:
        a = tiers(cluster.url, chunk_bytes=4096)
        chain = make_chain(prompt(6), [40, 70, 100])
        publish_all(a, chain)
        assert counters(a)["remote_puts"] == 3
        b = tiers(cluster.url, chunk_bytes=4096)
        assert b.stats()["cluster"] is True
        match = b.find(NS, chain.tokens)
        assert match is not None and match.shared == 100
        assert b.fetch(match.chain_keys, NS) == [chain.blobs[k] for k in chain.keys]
        assert sorted(r.key for r in b.list_entries()) == sorted(chain.keys)

        # Each entry's keys share one slot; the block pointers spread over the nodes.
        node_keys = [set(n.client().keys("*")) for n in cluster.nodes]
        for link in chain.links:
            holders = [i for i, ks in enumerate(node_keys) if NAMES.record(link.key) in ks]
            assert len(holders) == 1
            assert {NAMES.part(link.key, 0), NAMES.part(link.key, 1)} <= node_keys[holders[0]]
        pointers = [keys for keys in node_keys if any(k.startswith(b"kvc:b:") for k in keys)]
        assert len(pointers) >= 2

        # A node paused: lookups come back within the deadline, never raise.
        holder = next(i for i, ks in enumerate(node_keys) if NAMES.record(chain.keys[-1]) in ks)
        cluster.nodes[holder].pause()
        try:
            started = time.monotonic()
            assert b.find(NS, chain.tokens) is None
            assert time.monotonic() - started < 0.25 + 0.35
        finally:
            cluster.nodes[holder].resume()
        assert b.wait_connected(10)
        wait_for(lambda: b.find(NS, chain.tokens) is not None, "the cluster to answer again")


# --------------------------------------------------------------------------- faults


def test_server_killed_mid_upload_then_restarted(server: RedisServer,
                                                 tiers: Callable[..., RemoteTier],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tier = tiers(server.url, chunk_bytes=4096)
    chain = make_chain(prompt(7), [40, 100])
    # One part per pipeline, and the server dies once the first part is written (the
    # claim was the pipeline before).
    monkeypatch.setattr(upload_module, "UPLOAD_BATCH_BYTES", 1)
    real_pipeline = tier._core.pipeline
    calls = []

    def pipeline_then_kill(client: redis.Redis, build: Callable[[object], None]) -> list[object]:
        replies = real_pipeline(client, build)
        calls.append(len(replies))
        if len(calls) == 2:
            assert server.client().exists(NAMES.part(chain.keys[0], 0))
            server.kill()
        return replies

    monkeypatch.setattr(tier._core, "pipeline", pipeline_then_kill)
    assert tier.publish(chain.links, chain.read_blob)
    assert tier.drain(5)
    assert len(calls) == 2
    got = counters(tier)
    assert got["remote_put_errors"] == 1 and got["remote_errors_connection"] >= 1
    assert got["remote_puts"] == 0 and not tier.connected
    # Down: lookups and uploads answer at once, without waiting on the remote.
    started = time.monotonic()
    assert tier.find(NS, chain.tokens) is None
    assert tier.fetch(chain.keys) is None
    assert not tier.publish(chain.links, chain.read_blob)
    # Waiting on the remote would cost op_timeout_s (0.25 s) per call: all three, less.
    assert time.monotonic() - started < 0.25
    got = counters(tier)
    assert got["remote_skipped_disconnected"] == 2 and got["remote_dropped_disconnected"] == 1

    server.start()  # the same port: the tier reconnects by itself
    assert tier.wait_connected(10)
    assert counters(tier)["remote_reconnects"] == 1
    monkeypatch.undo()
    publish_all(tier, chain)
    assert tier.find(NS, chain.tokens).shared == 100  # type: ignore[union-attr]


def test_server_killed_mid_fetch(server: RedisServer, tiers: Callable[..., RemoteTier],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tier = tiers(server.url, chunk_bytes=4096)
    chain = make_chain(prompt(8), [40, 70, 100])
    publish_all(tier, chain)
    # One part per round trip, and the server dies once the records and the root's parts
    # were read: the fetch returns the root, verified.
    monkeypatch.setattr(tier_module, "FETCH_BATCH_BYTES", 1)
    kill_after = 1 + -(-chain.links[0].size // 4096)
    real_mget = tier._core.mget
    calls = []

    def mget_then_kill(client: redis.Redis, names: list[bytes]) -> list[bytes | None]:
        values = real_mget(client, names)
        calls.append(len(names))
        if len(calls) == kill_after:
            server.kill()
        return values

    monkeypatch.setattr(tier._core, "mget", mget_then_kill)
    started = time.monotonic()
    blobs = tier.fetch(chain.keys, NS)
    assert time.monotonic() - started < 1.0
    assert blobs == [chain.blobs[chain.keys[0]]]
    got = counters(tier)
    assert got["remote_fetch_short"] == 1 and got["remote_errors_connection"] == 1
    assert not tier.connected
    server.start()
    assert tier.wait_connected(10)


def test_server_paused_past_the_deadline(server: RedisServer,
                                         tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, op_timeout_s=0.25, reconnect_min_s=0.05)
    chain = make_chain(prompt(9), [40])
    publish_all(tier, chain)
    server.pause()
    try:
        started = time.monotonic()
        assert tier.find(NS, chain.tokens) is None
        assert time.monotonic() - started < 0.25 + 0.15
        assert counters(tier)["remote_errors_timeout"] == 1 and not tier.connected
        started = time.monotonic()
        assert tier.find(NS, chain.tokens) is None  # no waiting while it is down
        assert tier.fetch(chain.keys, NS) is None
        assert time.monotonic() - started < 0.25  # one wait on the paused server: 0.25 s
        time.sleep(0.5)  # the reconnect thread keeps trying (and timing out)
        assert not tier.connected
    finally:
        server.resume()
    assert tier.wait_connected(10)
    assert tier.find(NS, chain.tokens).shared == 40  # type: ignore[union-attr]
    assert counters(tier)["remote_reconnects"] == 1


def test_full_server_refuses_uploads_lookups_go_on(server: RedisServer,
                                                   tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, chunk_bytes=64 * 1024)
    small = make_chain(prompt(10), [40])
    publish_all(tier, small)
    used = server.client().info("memory")["used_memory"]
    server.set_config(maxmemory=used + 512 * 1024, maxmemory_policy="noeviction")
    big = make_chain(prompt(11), [60], payload_bytes=4 << 20)
    publish_all(tier, big)
    got = counters(tier)
    assert got["remote_full"] == 1 and got["remote_put_errors"] == 1 and got["remote_puts"] == 1
    assert tier.connected  # full is not down
    # What the failed upload wrote was removed again (DEL works on a full server).
    assert entry_keys(server.client(), big.keys[0], NAMES) == set()
    assert tier.find(NS, big.tokens) is None
    match = tier.find(NS, small.tokens)
    assert match is not None and tier.fetch(match.chain_keys, NS) == [small.blobs[small.keys[0]]]


def test_piece_evicted_mid_chain_serves_the_prefix(server: RedisServer,
                                                   tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, chunk_bytes=4096)
    chain = make_chain(prompt(12), [40, 70, 100])
    publish_all(tier, chain)
    c = server.client()
    c.delete(NAMES.part(chain.keys[1], 2))  # the middle piece loses a part
    match = tier.find(NS, chain.tokens)
    assert match is not None and match.shared == 100  # the records are all there
    assert tier.fetch(match.chain_keys, NS) == [chain.blobs[chain.keys[0]]]
    assert counters(tier)["remote_fetch_short"] == 1
    c.delete(NAMES.record(chain.keys[0]))  # the root's record goes: nothing to serve
    assert tier.fetch(match.chain_keys, NS) is None
    assert counters(tier)["remote_fetch_failed"] == 1
    assert counters(tier)["remote_verify_failures"] == 0  # missing is not refused


def test_garbage_and_foreign_values_are_refused(server: RedisServer,
                                                tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, chunk_bytes=4096)
    chain = make_chain(prompt(13), [40, 70, 100])
    publish_all(tier, chain)
    c = server.client()
    # A part overwritten with garbage: the blob fails its checksum.
    name = NAMES.part(chain.keys[2], 1)
    c.set(name, seal(name, os.urandom(4096), None))
    assert tier.fetch(chain.keys, NS) == [chain.blobs[k] for k in chain.keys[:2]]
    assert counters(tier)["remote_verify_failures"] == 1
    # Raw garbage where a part belongs (not even a value header).
    c.set(NAMES.part(chain.keys[1], 0), b"\x00garbage")
    assert tier.fetch(chain.keys, NS) == [chain.blobs[chain.keys[0]]]
    assert counters(tier)["remote_verify_failures"] == 2
    # A record overwritten with garbage: the lookup refuses it.
    c.set(NAMES.record(chain.keys[2]), seal(NAMES.record(chain.keys[2]), b"\x81\xa1v\x01", None))
    assert tier.find(NS, chain.tokens) is None
    assert counters(tier)["remote_verify_failures"] == 3

    # Well-formed but wrong: another entry's valid blob (same size) under this key.
    x = make_chain(prompt(14), [40])
    y = make_chain(prompt(15), [40])
    publish_all(tier, x)
    publish_all(tier, y)
    for i in range(-(-x.links[0].size // 4096)):
        c.set(NAMES.part(y.keys[0], i), c.get(NAMES.part(x.keys[0], i)))
    assert tier.fetch(y.keys, NS) is None
    assert counters(tier)["remote_verify_failures"] == 4
    assert tier.fetch(x.keys, NS) == [x.blobs[x.keys[0]]]


def test_signatures(server: RedisServer, tiers: Callable[..., RemoteTier]) -> None:
    signed = tiers(server.url, chunk_bytes=4096, signing_key=KEY1)
    chain = make_chain(prompt(16), [40, 70])
    publish_all(signed, chain)
    match = signed.find(NS, chain.tokens)
    assert match is not None and signed.fetch(match.chain_keys, NS) is not None

    # Signed with another key: not even found (its names are keyed by the other key),
    # and refused once copied under the names that key reads.
    other = tiers(server.url, chunk_bytes=4096, signing_key=KEY2)
    assert other.find(NS, chain.tokens) is None
    c = server.client()
    assert copy_entry(c, chain.keys[-1], NS, chain.tokens, NAMES1, Names("kvc", KEY2)) > 3
    assert copy_entry(c, chain.keys[0], NS, chain.tokens[:40], NAMES1, Names("kvc", KEY2))
    assert other.find(NS, chain.tokens) is None
    assert other.fetch(chain.keys, NS) is None
    assert counters(other)["remote_signature_failures"] >= 2

    # A signed part moved to another name: refused (the name is signed too).
    c.set(NAMES1.part(chain.keys[1], 0), c.get(NAMES1.part(chain.keys[1], 1)))
    assert signed.fetch(chain.keys, NS) == [chain.blobs[chain.keys[0]]]
    assert counters(signed)["remote_signature_failures"] == 1

    # Unsigned values where a key is set: refused.
    plain = tiers(server.url, chunk_bytes=4096)
    unsigned = make_chain(prompt(17), [40])
    publish_all(plain, unsigned)
    assert plain.find(NS, unsigned.tokens) is not None
    assert signed.find(NS, unsigned.tokens) is None
    assert copy_entry(c, unsigned.keys[0], NS, unsigned.tokens, NAMES, NAMES1) >= 3
    assert signed.find(NS, unsigned.tokens) is None
    assert signed.fetch(unsigned.keys, NS) is None
    assert counters(signed)["remote_signature_failures"] >= 3


@pytest.mark.parametrize("encrypt", [False, True])
def test_keyed_names_tell_nothing_without_the_fleet_key(
        server: RedisServer, tiers: Callable[..., RemoteTier], encrypt: bool) -> None:
    """Entries without a tenant have keys and block hashes anyone can compute from a
    model and a guessed prompt; with the fleet's key no name on the server holds one, so
    listing the server confirms no guess. Lookups, fetches and listings work as before,
    and a fleet turning encryption on host by host still shares names."""
    host = tiers(server.url, chunk_bytes=4096, signing_key=KEY1, encrypt=encrypt)
    chain = make_chain(prompt(21), [40, 70])
    publish_all(host, chain)
    guessed = {k.hex() for k in chain.keys} | {h.hex() for h in keys.block_hashes(
        NS, keys.tokens_to_bytes(chain.tokens), B)}
    c = server.client()
    names = [n.decode() for n in c.scan_iter(match="*", count=1000)]
    assert len(names) >= 2 + 2 + len(chain.tokens) // B  # records, parts, block pointers
    assert all(n.startswith("kvc:2:") for n in names), names
    assert not [n for n in names if any(g in n for g in guessed)]
    # The guessed prompt's plain names are not there either.
    assert not any(c.exists(NAMES.record(k)) for k in chain.keys)

    # A host of the fleet that does not encrypt reads encrypted values under the same
    # names; one that encrypts finds values in clear there and refuses them.
    peer = tiers(server.url, chunk_bytes=4096, signing_key=KEY1, encrypt=not encrypt)
    match = peer.find(NS, chain.tokens)
    if encrypt:
        assert match is not None and match.key == chain.keys[-1]
        assert peer.fetch(match.chain_keys, NS) == [chain.blobs[k] for k in chain.keys]
    else:
        assert match is None and counters(peer)["remote_signature_failures"] >= 1
    assert host.fetch(chain.keys, NS) == [chain.blobs[k] for k in chain.keys]
    assert sorted(r.key for r in host.list_entries(of_namespace(NS))) == sorted(chain.keys)
    # A record copied under another entry's keyed name: refused by the listing too.
    c.set(NAMES1.record(b"\x07" * 16), c.get(NAMES1.record(chain.keys[0])))
    assert sorted(r.key for r in host.list_entries()) == sorted(chain.keys)


def test_two_hosts_saving_the_same_prefix_store_it_once(
        server: RedisServer, tiers: Callable[..., RemoteTier]) -> None:
    hosts = [tiers(server.url, chunk_bytes=4096) for _ in range(2)]
    tokens = prompt(18)
    # Each host has its own blob of the same entry (made at another time: other bytes).
    chains = [make_chain(tokens, [40, 80], created=1000.0 + i) for i in range(2)]
    assert chains[0].blobs != chains[1].blobs
    go = threading.Barrier(2)

    def save(i: int) -> None:
        go.wait()
        assert hosts[i].publish(chains[i].links, chains[i].read_blob)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in hosts:
        assert h.drain(10)
    totals = Counter[str]()
    for h in hosts:
        totals.update(counters(h))
    assert totals["remote_puts"] == 2  # two entries, each written by one host
    assert totals["remote_put_skipped_present"] + totals["remote_put_skipped_in_flight"] == 1
    c = server.client()
    for link in chains[0].links:
        parts = -(-link.size // 4096)
        assert entry_keys(c, link.key, NAMES) == {NAMES.record(link.key)} | {
            NAMES.part(link.key, i) for i in range(parts)}
    # Each entry is one host's blob, whole (the root may be one's, the piece the other's:
    # a piece needs its parent's key and tokens, not its bytes).
    blobs = hosts[0].fetch(chains[0].keys, NS)
    assert blobs is not None and len(blobs) == 2
    for key, got in zip(chains[0].keys, blobs, strict=True):
        assert got in (chains[0].blobs[key], chains[1].blobs[key])

    # An upload claimed by another host and not finished: skipped, not doubled.
    third = make_chain(prompt(19), [40])
    c.set(NAMES.lock(third.keys[0]), b"another-host", px=60_000)
    publish_all(hosts[0], third)
    assert counters(hosts[0])["remote_put_skipped_in_flight"] >= 1
    assert entry_keys(c, third.keys[0], NAMES) == {NAMES.lock(third.keys[0])}


def test_tenants_never_see_each_other(server: RedisServer,
                                      tiers: Callable[..., RemoteTier]) -> None:
    ns_a = keys.namespace(MODEL, LAYOUT, tenant="tenant-a")
    ns_b = keys.namespace(MODEL, LAYOUT, tenant="tenant-b")
    host_a = tiers(server.url)
    host_b = tiers(server.url)
    tokens = prompt(20)
    chain = make_chain(tokens, [64], ns=ns_a, tenant="tenant-a")
    publish_all(host_a, chain)
    assert host_b.find(ns_a, tokens) is not None  # the same tenant on another host
    assert host_b.find(ns_b, tokens) is None
    assert host_b.find(NS, tokens) is None  # no tenant
    assert [r.key for r in host_b.list_entries(of_namespace(ns_a))] == chain.keys
    assert host_b.list_entries(of_namespace(ns_b)) == []
    assert host_b.fetch(chain.keys, ns_b) is None  # keys of another tenant: refused
    # A pointer under tenant b's block hash naming tenant a's entry: refused.
    c = server.client()
    name = NAMES.block(keys.block_hashes(ns_b, tokens, B)[2])
    c.set(name, seal(name, chain.keys[0], None))
    assert host_b.find(ns_b, tokens) is None
    assert counters(host_b)["remote_verify_failures"] == 2


def test_password_from_a_file_or_the_environment(tmp_path: Path,
                                                 tiers: Callable[..., RemoteTier],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cret-" + os.urandom(8).hex()
    with redis_server(password=secret) as server:
        url = server.url
        with pytest.raises(RemoteConfigError, match="embeds a password"):
            RemoteConfig(f"redis://:{secret}@127.0.0.1:{server.port}/0")
        password_file = tmp_path / "redis-password"
        password_file.write_text(secret + "\n")
        password_file.chmod(0o600)
        tier = tiers(url, password_file=password_file)
        chain = make_chain(prompt(21), [40])
        publish_all(tier, chain)
        assert tier.find(NS, chain.tokens) is not None
        monkeypatch.setenv("KVC_TEST_REDIS_PASSWORD", secret)
        assert tiers(url, password_env="KVC_TEST_REDIS_PASSWORD").find(NS, chain.tokens)

        # No password or a wrong one: never connected, every call a miss at once.
        wrong = tmp_path / "wrong"
        wrong.write_text("not-it")
        wrong.chmod(0o600)
        for settings in ({}, {"password_file": wrong}):
            denied = tiers(url, connect=False, **settings)
            assert not denied.connected and denied.find(NS, chain.tokens) is None
            assert counters(denied)["remote_errors_auth"] >= 1
            assert "auth" in str(denied.stats()["last_error"])

        # An ACL user that may only read: lookups work, uploads fail with an error reply.
        server.client().execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw",
                                        "~*", "+@read", "+ping", "+client|setname")
        reader_pw = tmp_path / "reader"
        reader_pw.write_text("reader-pw")
        reader_pw.chmod(0o600)
        reader = tiers(f"redis://reader@127.0.0.1:{server.port}/0", password_file=reader_pw)
        assert reader.find(NS, chain.tokens) is not None
        publish_all(reader, make_chain(prompt(22), [40]))
        got = counters(reader)
        assert got["remote_errors_response"] == 1 and got["remote_put_errors"] == 1
        assert reader.connected  # an error reply is not a lost remote


def test_tls_with_the_server_s_ca_and_refused_without_it(
        tiers: Callable[..., RemoteTier]) -> None:
    """rediss://: with the CA that issued the server's certificate (``tls_ca_file``) a tier
    connects, uploads and another fetches what it stored; trusting only the system's CAs,
    or speaking plain text to the TLS port, it never connects and every call is a miss at
    once, counted."""
    with tls_redis_server() as server:
        a = tiers(server.url, tls_ca_file=server.ca_file)
        chain = make_chain(prompt(27), [40, 70])
        publish_all(a, chain)
        b = tiers(server.url, tls_ca_file=server.ca_file)
        match = b.find(NS, chain.tokens)
        assert match is not None and match.shared == 70
        assert b.fetch(match.chain_keys, NS) == [chain.blobs[k] for k in chain.keys]
        assert entry_keys(server.client(), chain.keys[-1], NAMES)  # stored on the server

        plain_url = server.url.replace("rediss://", "redis://")
        for url, error in ((server.url, "CERTIFICATE_VERIFY_FAILED"), (plain_url, "")):
            started = time.monotonic()
            refused = tiers(url, connect=False)
            assert refused.find(NS, chain.tokens) is None and not refused.connected
            assert time.monotonic() - started < 5
            wait_for(lambda: counters(refused)["remote_errors_connection"] >= 1,  # noqa: B023
                     "the refused connection to be counted")
            assert error in str(refused.stats()["last_error"])


def test_upload_queue_is_bounded_and_never_blocks(server: RedisServer,
                                                  tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, queue_max=1)
    chain = make_chain(prompt(23), [40])
    release = threading.Event()
    entered = threading.Event()

    def slow_read(key: bytes) -> bytes:
        entered.set()
        release.wait(10)
        return chain.read_blob(key)

    try:
        assert tier.publish(chain.links, slow_read)  # taken by the uploader, which waits
        assert entered.wait(5)
        assert tier.publish(chain.links, chain.read_blob)  # queued
        started = time.monotonic()
        assert not tier.publish(chain.links, chain.read_blob)  # full: dropped at once
        assert time.monotonic() - started < 1.0  # blocking would last until the release
        assert tier.stats()["queue_depth"] == 1
        assert counters(tier)["remote_dropped_queue_full"] == 1
    finally:
        release.set()
    assert tier.drain(10)
    got = counters(tier)
    assert got["remote_puts"] == 1 and got["remote_put_skipped_present"] == 1


def test_unreadable_local_blob_is_not_uploaded(server: RedisServer,
                                               tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url)
    chain = make_chain(prompt(24), [40, 70])

    def gone(key: bytes) -> bytes:
        raise FileNotFoundError(key.hex())

    assert tier.publish(chain.links, gone)
    assert tier.drain(5)
    # A corrupt local blob (a flipped payload byte) is not spread either.
    corrupt = bytearray(chain.blobs[chain.keys[0]])
    corrupt[-1] ^= 0xFF
    assert tier.publish(chain.links, lambda key: bytes(corrupt))
    assert tier.drain(5)
    got = counters(tier)
    assert got["remote_put_unreadable"] == 2 and got["remote_puts"] == 0
    assert tier.find(NS, chain.tokens) is None  # nor the piece built on it
    with pytest.raises(ValueError, match="not a chain"):
        tier.publish(chain.links[1:], chain.read_blob)  # a piece without its root


def test_fetch_budget(server: RedisServer, tiers: Callable[..., RemoteTier]) -> None:
    tier = tiers(server.url, fetch_budget_s=1e-6)
    chain = make_chain(prompt(25), [40])
    publish_all(tier, chain)
    assert tier.fetch(chain.keys, NS) is None  # the records alone took longer
    assert counters(tier)["remote_fetch_budget_exceeded"] == 1


# --------------------------------------------------------------------------- configuration


def test_urls_and_secrets(tmp_path: Path) -> None:
    e = parse_url("redis://127.0.0.1:7000/3")
    assert (e.nodes, e.db, e.tls, e.cluster) == (((("127.0.0.1", 7000),)), 3, False, False)
    e = parse_url("rediss+cluster://a:1,b:2")
    assert (e.nodes, e.tls, e.cluster) == ((("a", 1), ("b", 2)), True, True)
    assert parse_url("redis://acl-user@h:1").username == "acl-user"
    for bad, why in [("http://h:1", "scheme"), ("redis://u:pw@h:1", "embeds a password"),
                     ("redis://h:1/0?password=x", "embeds a password"),
                     ("redis://a:1,b:2", "several servers"),
                     ("redis+cluster://a:1/2", "only database 0"), ("redis://h:x", "HOST:PORT")]:
        with pytest.raises(RemoteConfigError, match=why):
            parse_url(bad)
    with pytest.raises(RemoteConfigError, match="not both"):
        RemoteConfig("redis://h:1", password_file=tmp_path / "p", password_env="X")
    with pytest.raises(RemoteConfigError, match="key prefix"):
        RemoteConfig("redis://h:1", key_prefix="a{b}")

    key_file = tmp_path / "signing-key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    key_file.chmod(0o600)
    assert load_signing_key(key_file) == b"0123456789abcdef0123456789abcdef"
    key_file.chmod(0o644)
    with pytest.raises(RemoteConfigError, match="other users"):
        load_signing_key(key_file)
    key_file.chmod(0o600)
    key_file.write_bytes(b"\n")
    with pytest.raises(RemoteConfigError, match="empty"):
        load_signing_key(key_file)
    key_file.write_bytes(b"short")
    with pytest.raises(RemoteConfigError, match="at least 16"):
        load_signing_key(key_file)
    with pytest.raises(RemoteConfigError, match="cannot read"):
        load_signing_key(tmp_path / "missing")


def test_unreachable_remote_costs_nothing(tiers: Callable[..., RemoteTier]) -> None:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        started = time.monotonic()
        tier = tiers(f"redis://127.0.0.1:{port}/0", connect=False)
        assert time.monotonic() - started < 0.5
        assert not tier.connected
        assert tier.find(NS, prompt(26)) is None
        assert tier.stats()["connected"] is False
        assert counters(tier)["remote_errors_connection"] >= 1
        started = time.monotonic()
        tier.close()
        assert time.monotonic() - started < 1.0


# --------------------------------------------------------------------------- counters


def test_remote_counters_declared_used_and_provoked(request: pytest.FixtureRequest) -> None:
    """Every remote counter is declared (kvcache/counters.py REMOTE_SECTION) where it is
    counted, and each was moved by the tests above (when the whole module ran)."""
    from tests.support.counter_uses import counter_uses

    literals, patterns = counter_uses(sorted((REPO / "kvcache" / "remote").glob("*.py")))
    used = set(literals) | {name for name in REMOTE_SECTION
                            if any(re.fullmatch(p, name) for p in patterns)}
    assert set(literals) <= set(REMOTE_SECTION), set(literals) - set(REMOTE_SECTION)
    assert used == set(REMOTE_SECTION), set(REMOTE_SECTION) - used
    module_tests = {item.name for item in request.session.items
                    if item.module is request.module}
    everything = {name for name in dir(request.module) if name.startswith("test_")}
    if module_tests != everything:
        pytest.skip("only checks which counters moved when the whole module runs")
    unmoved = [name for name in REMOTE_SECTION
               if MOVED[name] <= 0 and name not in PROVOKED_BY_A_DAEMON]
    assert not unmoved, f"remote counters no test provoked: {unmoved}"
