"""The shared tier as a fleet meets it: real ``redis-server`` processes, real daemons
started with ``--remote``, real gRPC and, where the model runtime is involved, the tiny
generated llama.cpp model.

Two daemons with separate data directories stand for two hosts. Host A saves; its
daemon uploads in the background; host B's lookup finds the longer prefix remotely,
fetches and verifies the pieces, stores them locally and answers with tier ``remote``.
Each fault of the issue is provoked against the daemons: the remote killed (while
saving, while a fetch reads parts) and restarted, paused past the deadline, full,
evicting a piece mid-chain, returning garbage, signed with another key; two hosts
saving one prefix at once; tenants across hosts; the operator commands. The tier alone
(no daemon) is tested in test_remote.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvcache import keys
from kvcache.cli.render import human_bytes
from kvcache.client import Identity, LookupResult
from kvcache.remote.layout import Names, open_value, seal
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.metrics import metrics_port, scrape
from tests.support.redis_proc import RedisServer, redis_cluster, redis_server, tls_redis_server
from tests.support.remote_tier import (
    FLEET_NAMES,
    B,
    Host,
    copy_entry,
    counters,
    entry_keys,
    key_file,
    remote_state,
    wait_connected,
    wait_uploads,
)
from tests.support.runtime_calls import CONFIG, TEXT_A, TEXT_B, TEXT_C, flush, prompt

IDENT = Identity("fp-remote-fleet", {"type_k": "f16"}, model_name="tiny.gguf")
WIDTH = 64  # payload bytes per token of the daemon-level entries
LAYOUT = b"layout-1"  # opaque to the daemon
NAMES = FLEET_NAMES  # the names of the fleet's entries on the server
PLAIN_NAMES = Names("kvc")  # an unsigned fleet's
REMOTE_TIMEOUT = 0.2  # --remote-timeout of the fault tests
# The runtime gives up a cache call after this long (RuntimeConfig.cache_timeout_s).
RUNTIME_CACHE_DEADLINE = CONFIG.cache_timeout_s
# A lookup facing a stalled remote answers within its op deadline plus this.
SLACK = 0.5
RUNTIME_CONFIG = replace(CONFIG, n_seq_max=1)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def tiny_runtimes(tiny_model: Path) -> Iterator[Callable[[str | None], Runtime]]:
    """``runtime(address)``: a Runtime on the tiny model using that daemon (None: no
    cache, a cold reference); all closed after the test."""
    made: list[Runtime] = []

    def make(address: str | None) -> Runtime:
        rt = Runtime(tiny_model, cache_address=address, config=RUNTIME_CONFIG)
        made.append(rt)
        return rt

    yield make
    for rt in reversed(made):
        rt.close()


# --------------------------------------------------------------------------- helpers


def toks(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(n)]


def cells(tokens: list[int], start: int, width: int = WIDTH) -> bytes:
    """The payload of tokens[start:] (deterministic, so a fetched copy can be compared)."""
    return b"".join(((t * 131 + i) % 251).to_bytes(1, "little") * width
                    for i, t in enumerate(tokens[start:], start))


def save(d: DaemonProcess, tokens: list[int], *, parent: bytes = b"", base: int = 0,
         identity: Identity = IDENT, width: int = WIDTH) -> bytes:
    with d.client() as c:
        result = c.save(identity, tokens, cells(tokens, base, width), "finish", parent=parent,
                        base=base, cell_layout=LAYOUT)
    assert result.status == "saved", result
    return result.key


def lookup(d: DaemonProcess, tokens: list[int], identity: Identity = IDENT,
           **kwargs: object) -> LookupResult | None:
    with d.client() as c:
        return c.lookup(identity, tokens, **kwargs)  # type: ignore[arg-type]


def timed_lookup(d: DaemonProcess, tokens: list[int], **kwargs: object
                 ) -> tuple[LookupResult | None, float]:
    with d.client() as c:
        c.wait_ready(5)  # the channel is up: what is timed is the daemon's answer
        t0 = time.monotonic()
        hit = c.lookup(IDENT, tokens, **kwargs)  # type: ignore[arg-type]
        return hit, time.monotonic() - t0


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def local_keys(d: DaemonProcess) -> set[bytes]:
    with d.client() as c:
        return {e.key for e in c.list_entries()}


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # Wide enough that no line of the summary wraps.
    env = {**{k: v for k, v in os.environ.items() if k != "LINES"}, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "kvcache.cli", *args], env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                          check=False)


# --------------------------------------------------------------------------- A computes, B restores


def test_host_a_computes_host_b_restores(host: Host,
                                         tiny_runtimes: Callable[[str | None], Runtime]) -> None:
    a, b = host("a"), host("b")
    rt_a, rt_b, plain = tiny_runtimes(a.address), tiny_runtimes(b.address), tiny_runtimes(None)
    system = prompt(plain, 200, TEXT_A)
    question = system + plain.tokenize(TEXT_B)[1:]
    first = rt_a.complete(tokens=question, prefix_tokens=len(system), max_tokens=8)
    assert first.cache_hit_kind == "cold"
    # The system prompt, then the question and the conversation as pieces on it.
    assert [s["reason"] for s in first.saves] == ["cold", "prompt", "finish"]
    assert first.saves[0]["tokens"] == len(system)
    assert first.saves[1]["tokens"] == len(question) <= first.saves[2]["tokens"]
    flush(rt_a)
    assert wait_uploads(a, 3)["remote_puts"] == 3

    # Only the system prompt is shared (the new text is longer): B fetches A's chain up to
    # it and serves it, as a partial hit from the remote.
    other = system + plain.tokenize(" question: " + TEXT_C * 3)[1:]
    partial = rt_b.complete(tokens=other, max_tokens=8)
    assert (partial.cache_hit_kind, partial.cache_tier) == ("partial", "remote")
    assert partial.cache_delta["tokens_read"] >= len(system)
    assert partial.tokens == plain.complete(tokens=other, max_tokens=8).tokens

    # The whole question: B lacks its piece and fetches only that.
    before = counters(b)
    restored = rt_b.complete(tokens=question, max_tokens=8)
    assert restored.cache_tier == "remote"
    assert restored.cache_delta["tokens_read"] >= len(question) - 1
    assert restored.tokens == first.tokens  # greedy output equals A's cold prefill's
    flush(rt_b)
    moved = delta(before, counters(b))
    # Two pieces come from A: the question's, which the restore needs, and, once B has
    # generated what A did, A's `finish` piece, which the lookup behind B's own finish
    # save finds deeper than B's tiers and fetches instead of B writing it again.
    assert [s["key"] for s in restored.saves] == [s["key"] for s in first.saves[1:]]
    assert moved["remote_fetches"] == 2 and moved["remote_fetch_pieces"] == 2
    assert moved["remote_fetched_stored"] == 2
    assert rt_b.stats()["restored_from_remote"] == 2

    # The next request is served from B's own tiers.
    before = counters(b)
    again = rt_b.complete(tokens=question, max_tokens=8)
    assert again.cache_tier in ("ram", "disk") and again.tokens == first.tokens
    assert delta(before, counters(b)).get("remote_fetches", 0) == 0
    assert rt_b.stats()["restored_from_remote"] == 2


# --------------------------------------------------------------------------- cluster


def test_a_three_node_cluster_serves_the_fleet(daemon_factory: Callable[..., DaemonProcess]
                                               ) -> None:
    with redis_cluster(3) as cluster:
        def start(name: str) -> DaemonProcess:
            d = daemon_factory("--remote", cluster.url, "--block-size", str(B),
                               "--remote-unsigned", name=name)
            wait_connected(d)
            return d

        a, b = start("a"), start("b")
        t = toks(1, 300)
        root = save(a, t[:100])
        piece = save(a, t[:300], parent=root, base=100)
        wait_uploads(a, 2)

        hit = lookup(b, t, common_prefix=True)
        assert hit is not None and (hit.key, hit.tier, hit.matched_tokens) == (piece, "remote",
                                                                                300)
        assert [(p.key, p.base) for p in hit.chain] == [(root, 0), (piece, 100)]
        with b.client() as c:
            chain = c.load_chain(hit.key, prefix_of=t, pieces=hit.pieces_for(300))
            assert c.stats().remote.cluster
        assert b"".join(bytes(x.payload) for x in chain) == cells(t, 0)
        assert lookup(b, t, common_prefix=True).tier in ("ram", "disk")  # type: ignore[union-attr]
        assert counters(b)["remote_fetched_stored"] == 2

        # Each entry's record and parts sit on one node (its hash tag's slot).
        clients = [n.client() for n in cluster.nodes]
        try:
            for key in (root, piece):
                held = [found for c in clients if (found := entry_keys(c, key, PLAIN_NAMES))]
                assert held == [{PLAIN_NAMES.record(key), PLAIN_NAMES.part(key, 0)}]
        finally:
            for c in clients:
                c.close()


# --------------------------------------------------------------------------- killed


def test_remote_killed_mid_fetch_and_mid_save_then_restarted(host: Host,
                                                             server: RedisServer) -> None:
    a, b = host("a", "--remote-timeout", str(REMOTE_TIMEOUT)), \
        host("b", "--remote-timeout", str(REMOTE_TIMEOUT))
    t = toks(2, 400)
    mine = save(b, t[:32])  # B's own, shorter prefix
    theirs = save(a, t, width=8192)  # 3 MiB: its parts come back in one reply
    wait_uploads(a, 1)

    # Mid-fetch: the server drops B's connection while sending the parts (a reply over
    # the output buffer limit), after the lookup's pointers and records came back.
    server.set_config(client_output_buffer_limit="normal 1mb 0 0")
    hit, took = timed_lookup(b, t)
    assert hit is not None and hit.key == mine and hit.tier in ("ram", "disk")  # B's own
    assert took < REMOTE_TIMEOUT + SLACK
    moved = counters(b)
    assert moved["remote_hits"] == 1 and moved["remote_fetch_failed"] == 1
    assert moved["remote_errors_connection"] >= 1 and moved["remote_fetched_stored"] == 0
    assert theirs not in local_keys(b)
    server.set_config(client_output_buffer_limit="normal 0 0 0")
    wait_connected(b)

    # Killed mid-save: A's commit succeeds locally; its upload, waiting on a stalled
    # server when that server dies, fails and is counted.
    before = counters(a)
    u = toks(4, 200)
    server.pause()
    k1 = save(a, u[:64])
    server.kill()
    wait_for(lambda: delta(before, counters(a)).get("remote_put_errors", 0) == 1,
             "the failed upload counted")
    assert not remote_state(a)[0]

    # Killed: B's lookups answer from its own tiers (or a miss), at once, without error.
    hit, took = timed_lookup(b, t)
    assert hit is not None and hit.key == mine and hit.tier in ("ram", "disk")
    assert took < REMOTE_TIMEOUT + SLACK
    assert lookup(b, toks(3, 100)) is None
    assert not remote_state(b)[0]

    # A keeps saving and serving; uploads meanwhile are dropped at once, counted.
    k2 = save(a, u)
    moved = delta(before, counters(a))
    assert moved["remote_dropped_disconnected"] == 1 and moved.get("remote_puts", 0) == 0
    assert lookup(a, u).key == k2  # type: ignore[union-attr]
    assert {k1, k2} <= local_keys(a)

    # Restarted on the same port (empty): both reconnect; later uploads work.
    server.restart()
    wait_connected(a)
    wait_connected(b)
    assert counters(a)["remote_reconnects"] >= 1 and counters(b)["remote_reconnects"] >= 1
    puts = counters(a)["remote_puts"]
    v = toks(5, 120)
    later = save(a, v)
    assert wait_uploads(a, puts + 1)["remote_puts"] == puts + 1
    hit = lookup(b, v)
    assert hit is not None and (hit.key, hit.tier) == (later, "remote")


# --------------------------------------------------------------------------- paused


def test_remote_paused_past_the_deadline(host: Host, server: RedisServer,
                                         tiny_runtimes: Callable[[str | None], Runtime]) -> None:
    a = host("a")
    b = host("b", "--remote-timeout", str(REMOTE_TIMEOUT))
    rt_a, plain = tiny_runtimes(a.address), tiny_runtimes(None)
    p = prompt(plain, 150, TEXT_B)
    first = rt_a.complete(tokens=p, max_tokens=6)
    flush(rt_a)
    wait_uploads(a, len(first.saves))

    server.pause()
    try:
        # A lookup that would hit remotely answers within the op deadline: a miss.
        hit, took = timed_lookup(b, p, common_prefix=True)
        assert hit is None
        assert took < REMOTE_TIMEOUT + SLACK < RUNTIME_CACHE_DEADLINE / 2
        moved = counters(b)
        assert moved["remote_errors_timeout"] >= 1 and moved["remote_misses"] == 1
        assert not remote_state(b)[0]
    finally:
        server.resume()
    wait_connected(b)

    # A runtime request meeting a stalled remote completes (cold), within the deadline.
    rt_b = tiny_runtimes(b.address)
    server.pause()
    try:
        t0 = time.monotonic()
        out = rt_b.complete(tokens=p, max_tokens=6)
        took = time.monotonic() - t0
    finally:
        server.resume()
    assert out.cache_tier == "" and out.cache_hit_kind == "cold"
    assert counters(b)["remote_errors_timeout"] >= 2  # its lookup met the stall
    assert out.tokens == first.tokens
    assert took < RUNTIME_CACHE_DEADLINE
    assert rt_b.stats().get("cache_unavailable", 0) == 0  # the daemon answered (a miss)

    # Resumed: B reconnects, and the remote serves again.
    wait_connected(b)
    assert counters(b)["remote_reconnects"] >= 2
    u = toks(15, 100)
    key = save(a, u)
    wait_uploads(a, len(first.saves) + 1)
    hit = lookup(b, u)
    assert hit is not None and (hit.key, hit.tier) == (key, "remote")


# --------------------------------------------------------------------------- full


def test_remote_full_with_noeviction(host: Host, server: RedisServer) -> None:
    a = host("a")
    with server.client() as c:
        used = int(c.info("memory")["used_memory"])
    server.set_config(maxmemory=str(used + 200_000), maxmemory_policy="noeviction")
    t = toks(6, 300)
    key = save(a, t, width=4096)  # 1.2 MB: over the limit once its part is written
    wait_for(lambda: counters(a)["remote_full"] == 1, "the full remote counted")
    moved = counters(a)
    assert moved["remote_put_errors"] == 1 and moved["remote_puts"] == 0
    with server.client() as c:
        assert entry_keys(c, key, NAMES) == set()  # what was written was removed
    # Local saves and lookups go on; the remote stays connected (it answered).
    small = save(a, toks(7, 40))
    hit = lookup(a, t)
    assert hit is not None and hit.key == key and hit.tier in ("ram", "disk")
    assert lookup(a, toks(7, 40)).key == small  # type: ignore[union-attr]
    assert remote_state(a)[0]
    wait_for(lambda: sum(counters(a)[k] for k in ("remote_puts", "remote_put_errors")) == 2
             and remote_state(a)[1] == 0, "the small entry's upload done")
    # Room again: uploads work.
    server.set_config(maxmemory="0")
    puts = counters(a)["remote_puts"]
    save(a, toks(8, 50))
    assert wait_uploads(a, puts + 1)["remote_puts"] == puts + 1


# --------------------------------------------------------------------------- evicted


def test_a_piece_evicted_mid_chain_serves_the_shorter_prefix(host: Host,
                                                             server: RedisServer) -> None:
    a, b = host("a"), host("b")
    t = toks(9, 200)
    root = save(a, t[:100])
    piece = save(a, t, parent=root, base=100)
    wait_uploads(a, 2)
    with server.client() as c:
        assert c.delete(NAMES.part(piece, 0)) == 1

    hit = lookup(b, t)
    assert hit is not None and (hit.key, hit.matched_tokens, hit.tier) == (root, 100, "remote")
    moved = counters(b)
    assert moved["remote_fetch_short"] == 1 and moved["remote_fetched_stored"] == 1
    assert local_keys(b) == {root}
    with b.client() as c:
        assert bytes(c.load(root, prefix_of=t).payload) == cells(t[:100], 0)

    # An exact lookup (a model whose states cannot be cut) of a prompt diverging inside
    # the piece: the remote match is longer than the prompt, its root a whole prefix.
    c = host("c")
    hit = lookup(c, t[:150] + toks(19, 30))
    assert hit is not None and (hit.key, hit.matched_tokens, hit.tier) == (root, 100, "remote")
    assert counters(c)["remote_fetch_pieces"] == 1  # the root alone


# --------------------------------------------------------------------------- garbage


def test_values_overwritten_with_garbage_are_refused(host: Host, server: RedisServer) -> None:
    # Unsigned hosts: what the blob checks catch without a signature (a signed host
    # refuses every one of these by its signature). Their names are the keys' hex.
    a, b = host("a", "--remote-unsigned"), host("b", "--remote-unsigned")
    c = server.client()

    def damage_part(key: bytes) -> None:  # random bytes: not even a remote value
        c.set(PLAIN_NAMES.part(key, 0), os.urandom(c.strlen(PLAIN_NAMES.part(key, 0))))

    def damage_blob(key: bytes) -> None:  # a sound envelope around a blob with a byte flipped
        name = PLAIN_NAMES.part(key, 0)
        body = bytearray(open_value(name, c.get(name), None))
        body[-100] ^= 0xFF
        c.set(name, seal(name, body, None))

    def damage_record(key: bytes) -> None:
        name = PLAIN_NAMES.record(key)
        c.set(name, seal(name, os.urandom(300), None))

    try:
        for seed, damage in ((10, damage_part), (11, damage_blob), (12, damage_record)):
            t = toks(seed, 120)
            key = save(a, t)
            wait_uploads(a, seed - 9)
            damage(key)
            before = counters(b)
            assert lookup(b, t) is None, damage.__name__
            moved = delta(before, counters(b))
            assert moved["remote_verify_failures"] >= 1, damage.__name__
            assert moved.get("remote_fetched_stored", 0) == 0
            assert local_keys(b) == set()
    finally:
        c.close()


# --------------------------------------------------------------------------- signed


def test_values_signed_with_another_key_are_refused(host: Host, server: RedisServer,
                                                   tmp_path: Path) -> None:
    """Hosts of another key (or none) do not even find the fleet's entries (their names
    are keyed by another key); its values copied under the names they read are refused
    by their signature."""
    k1 = key_file(tmp_path / "k1", "a-fleet-signing-key-number-one\n")
    k2 = key_file(tmp_path / "k2", "another-fleet-key-number-two\n")
    names1 = Names("kvc", b"a-fleet-signing-key-number-one")
    names2 = Names("kvc", b"another-fleet-key-number-two")
    a = host("a", "--remote-signing-key-file", str(k1))
    b = host("b", "--remote-signing-key-file", str(k2))
    c = host("c", "--remote-signing-key-file", str(k1))
    t = toks(13, 150)
    key = save(a, t)
    wait_uploads(a, 1)

    assert lookup(b, t) is None
    with server.client() as r:
        assert copy_entry(r, key, IDENT.namespace, t, names1, names2) >= 3
    assert lookup(b, t) is None
    assert counters(b)["remote_signature_failures"] >= 1
    hit = lookup(c, t)
    assert hit is not None and (hit.key, hit.tier) == (key, "remote")
    assert counters(c)["remote_signature_failures"] == 0

    # An unsigned value (a host without a key wrote it) is refused by hosts with one.
    d = host("d", "--remote-unsigned")
    u = toks(14, 150)
    unsigned = save(d, u)
    wait_uploads(d, 1)
    for signed, names in ((b, names2), (c, names1)):
        assert lookup(signed, u) is None
        with server.client() as r:
            assert copy_entry(r, unsigned, IDENT.namespace, u, PLAIN_NAMES, names) >= 3
        before = counters(signed)
        assert lookup(signed, u) is None
        assert delta(before, counters(signed))["remote_signature_failures"] >= 1
    assert local_keys(b) == set() and local_keys(c) == {key}


# --------------------------------------------------------------------------- stored once


def commit_at_once(d: DaemonProcess, tokens: list[int], barrier: threading.Barrier,
                   saved: list[bytes]) -> None:
    with d.client() as c:
        c.wait_ready(5)
        barrier.wait(5)  # both hosts' saves start together
        saved.append(c.save(IDENT, tokens, cells(tokens, 0), "finish").key)


def test_two_hosts_saving_one_prefix_at_once_store_it_once(host: Host,
                                                           server: RedisServer) -> None:
    a, b = host("a"), host("b")
    pointers: set[bytes] = set()
    saved_keys: list[bytes] = []
    for round_ in range(3):
        t = toks(20 + round_, 160)
        barrier = threading.Barrier(2)
        saved: list[bytes] = []
        threads = [threading.Thread(target=commit_at_once, args=(d, t, barrier, saved))
                   for d in (a, b)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(saved) == 2 and saved[0] == saved[1]
        key = saved[0]
        # Each host's upload ended (stored, or skipped: the other stored it or was at it).
        of_a, of_b = wait_uploads(a, round_ + 1), wait_uploads(b, round_ + 1)
        assert of_a["remote_puts"] + of_b["remote_puts"] == round_ + 1
        assert of_a["remote_put_errors"] + of_b["remote_put_errors"] == 0
        with server.client() as c:
            # One record and one set of parts, no claim left; the block pointers.
            assert entry_keys(c, key, NAMES) == {NAMES.record(key), NAMES.part(key, 0)}
            pointers |= {NAMES.block(h) for h in keys.block_hashes(
                IDENT.namespace, keys.tokens_to_bytes(t), B)}
            assert set(c.scan_iter(match="kvc:*", count=1000)) == pointers | {
                name for k in saved_keys + [key] for name in (NAMES.record(k), NAMES.part(k, 0))}
        saved_keys.append(key)


# --------------------------------------------------------------------------- tenants


def test_tenants_stay_apart_across_hosts(host: Host) -> None:
    a, b = host("a"), host("b")
    x, y = replace(IDENT, tenant="tenant-x"), replace(IDENT, tenant="tenant-y")
    t = toks(30, 150)
    key = save(a, t, identity=x)
    wait_uploads(a, 1)
    assert lookup(b, t, identity=y) is None
    assert lookup(b, t, identity=IDENT) is None
    assert lookup(b, t, identity=y, common_prefix=True) is None
    assert counters(b)["remote_fetches"] == 0
    hit = lookup(b, t, identity=x)
    assert hit is not None and (hit.key, hit.tier) == (key, "remote")
    with b.client() as c:
        assert [e.key for e in c.list_entries(tier="remote", tenant="tenant-x")] == [key]
        assert c.list_entries(tier="remote", tenant="tenant-y") == []


# --------------------------------------------------------------------------- operators


def test_cli_shows_the_remote_and_refuses_secrets_in_the_url(
        host: Host, daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    a, b = host("a"), host("b", "--metrics-port", "0")
    t = toks(40, 150)
    key = save(a, t)
    wait_uploads(a, 1)
    assert lookup(b, t).tier == "remote"  # type: ignore[union-attr]
    fetched = counters(b)["remote_bytes_fetched"]
    assert fetched > 0

    done = cli("stats", "--address", b.address)
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("remote")]
    assert "connected" in line and "DISCONNECTED" not in line
    assert "1 hits" in line and f"{human_bytes(fetched)} fetched" in line

    done = cli("stats", "--json", "--address", b.address)
    data = json.loads(done.stdout)
    assert data["remote"]["connected"] is True and data["remote"]["url"].startswith("redis://")
    assert data["counters"]["remote_hits"] == 1
    assert data["counters"]["remote_bytes_fetched"] == fetched

    metrics = scrape(metrics_port(b))
    assert metrics["kvcache_remote_connected"] == 1 and metrics["kvcache_remote_queue_depth"] == 0
    assert metrics["kvcache_remote_hits_total"] == 1
    assert metrics["kvcache_remote_bytes_fetched_total"] == fetched

    done = cli("ls", "--tier", "remote", "--json", "--address", b.address)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["key"] for r in rows] == [key.hex()] and rows[0]["tiers"] == ["remote"]
    done = cli("ls", "--tier", "remote", "--address", a.address)
    assert key.hex() in done.stdout and "1 entry" in done.stdout

    # Refused before the data directory is touched.
    never = tmp_path / "never"
    done = cli("serve", "--dir", str(never), "--remote", "redis://:secret@127.0.0.1:1/0",
               "--remote-unsigned")
    assert done.returncode != 0 and "password" in done.stderr
    assert "secret" not in done.stderr + done.stdout and "Traceback" not in done.stderr
    missing = tmp_path / "no-such-password-file"
    done = cli("serve", "--dir", str(never), "--remote", "redis://127.0.0.1:1/0",
               "--remote-unsigned", "--remote-password-file", str(missing))
    assert done.returncode != 0 and str(missing) in done.stderr
    assert "Traceback" not in done.stderr
    assert not never.exists()

    # A password from a file reaches a server that requires one.
    with redis_server(password="s3cret-of-the-fleet") as guarded:
        secret = key_file(tmp_path / "password", "s3cret-of-the-fleet\n")
        d = daemon_factory("--remote", guarded.url, "--remote-unsigned",
                           "--remote-password-file", str(secret),
                           name="guarded")
        wait_connected(d)
        d.close()


def test_a_tls_remote_verified_with_its_ca(daemon_factory: Callable[..., DaemonProcess],
                                           tmp_path: Path) -> None:
    """rediss:// with --remote-tls-ca: the daemon connects and uploads over TLS; without
    that CA the server's certificate is refused (said in stats); a CA given for a plain
    redis:// URL is refused at start-up."""
    with tls_redis_server() as server:
        d = daemon_factory("--remote", server.url, "--remote-unsigned",
                           "--remote-tls-ca", str(server.ca_file),
                           name="tls")
        wait_connected(d)
        key = save(d, toks(60, 100))
        wait_uploads(d, 1)
        assert entry_keys(server.client(), key, PLAIN_NAMES)  # on the server
        d.close()

        untrusted = daemon_factory("--remote", server.url, "--remote-unsigned",
                                   name="untrusted")
        wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in cli(
            "stats", "--json", "--address", untrusted.address).stdout,
            "the refused certificate in stats")
        assert remote_state(untrusted)[0] is False
        untrusted.close()

    never = tmp_path / "never"
    done = cli("serve", "--dir", str(never), "--remote", "redis://127.0.0.1:1/0",
               "--remote-unsigned", "--remote-tls-ca", str(tmp_path / "missing.pem"))
    assert done.returncode != 0 and "missing.pem" in done.stderr
    ca = key_file(tmp_path / "ca.pem", "not used")
    done = cli("serve", "--dir", str(never), "--remote", "redis://127.0.0.1:1/0",
               "--remote-unsigned", "--remote-tls-ca", str(ca))
    assert done.returncode != 0 and "rediss://" in done.stderr
    assert "Traceback" not in done.stderr and not never.exists()


# --------------------------------------------------------------------------- stored locally


def test_fetched_pieces_stored_or_refused_by_the_local_budget(host: Host) -> None:
    a = host("a")
    b = host("b", "--disk-bytes", "64K")
    small, big = toks(50, 100), toks(51, 200)
    k_small = save(a, small)  # ~8 KB
    save(a, big, width=2048)  # ~400 KB: over B's disk budget
    wait_uploads(a, 2)

    hit = lookup(b, small)
    assert hit is not None and (hit.key, hit.tier) == (k_small, "remote")
    assert counters(b)["remote_fetched_stored"] == 1

    before = counters(b)
    assert lookup(b, big) is None  # fetched and verified, but B cannot keep it
    moved = delta(before, counters(b))
    assert moved["remote_fetch_pieces"] == 1 and moved["remote_fetched_not_stored"] == 1
    assert moved.get("remote_fetched_stored", 0) == 0
    assert local_keys(b) == {k_small}
