"""The real daemon process over gRPC: real LMDB, real files, no mocks.

Most tests start their own daemon (``daemon_factory``) so counters are exact; tests that
only look at answers share one daemon per module and use tokens of their own.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness.payloads import blob_bytes, payload_for
from harness.procs import pythonpath_env

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import CacheClient, CacheError, CorruptBlob, Identity, NotAPrefix
from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.support.daemon_proc import DaemonProcess, tcp_address, wait_for
from tests.support.entries import (
    BLOCK,
    IDENT,
    PATHS,
    DaemonFactory,
    blob_file,
    counters,
    flip_payload,
    ram_file,
    reserve,
    save_raw,
    toks,
    write,
)

# -- helpers --------------------------------------------------------------------------------


def client_for(d: DaemonProcess, path: str) -> CacheClient:
    return d.client(fast_path=(path == "fast"))


def wait_counter(client: CacheClient, name: str, at_least: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := counters(client)).get(name, 0) < at_least:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for counter {name} >= {at_least}"
                        f" (counters: {now})")
        time.sleep(0.02)


def rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def assert_serving(d: DaemonProcess) -> None:
    """The daemon still answers, and a fresh save round-trips."""
    with d.client() as c:
        tokens = toks(random.randrange(1 << 30), 20)
        payload = payload_for(tokens, 500)
        saved = c.save(IDENT, tokens, payload, "manual")
        assert saved.status == "saved", saved
        assert bytes(c.load(saved.key).payload) == payload


def tmp_files(d: DaemonProcess) -> list[str]:
    return sorted(os.listdir(d.data_dir / "tmp"))


@pytest.fixture(scope="module")
def shared(module_daemon_factory: DaemonFactory) -> DaemonProcess:
    """A daemon the module's tests of round trips and lookups share (short blocks)."""
    return module_daemon_factory("--block-size", str(BLOCK))


@pytest.fixture
def block_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory("--block-size", str(BLOCK))


# -- round trips and lookups ----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("size", [1 << 10, 100_000, (1 << 20) + 3, 5 << 20])
def test_round_trip_is_byte_identical(shared: DaemonProcess, path: str, size: int) -> None:
    tokens = toks(size + len(path), 37)
    payload = payload_for(tokens, size)
    with client_for(shared, path) as c:
        saved = c.save(IDENT, tokens, payload, "cold")
        assert saved.status == "saved"
        assert saved.key == keys.entry_key(IDENT.namespace, tokens, BLOCK).key
        loaded = c.load(saved.key, prefix_of=tokens + [1, 2, 3])
        assert loaded.payload.nbytes == size
        assert bytes(loaded.payload) == payload, f"{size}-byte payload changed ({path} path)"
        assert list(loaded.meta.tokens) == tokens
        assert loaded.meta.reason == "cold"
        assert loaded.size == saved.size
        assert loaded.tier in ("ram", "disk")


@pytest.mark.parametrize("path", PATHS)
def test_round_trip_64_mib(shared: DaemonProcess, path: str) -> None:
    tokens = toks(640 + len(path), 50)
    payload = os.urandom(64 << 20)
    with client_for(shared, path) as c:
        saved = c.save(IDENT, tokens, payload, "finish")
        assert saved.status == "saved" and saved.size > 64 << 20
        loaded = c.load(saved.key)
        assert loaded.payload.nbytes == len(payload)
        assert bytes(loaded.payload) == payload, f"64 MiB payload changed ({path} path)"
        c.delete(saved.key)  # keep the shared daemon small


def test_zstd_codec_round_trip(shared: DaemonProcess) -> None:
    tokens = toks(5, 30)
    payload = b"\x00\x01\x02\x03" * 50_000
    with shared.client() as c:
        saved = c.save(IDENT, tokens, payload, "cold", codec="zstd")
        assert saved.size < len(payload) // 10
        assert bytes(c.load(saved.key).payload) == payload
        assert c.inspect(saved.key).entry.codec == "zstd"


def test_longest_prefix_over_aligned_and_any_length_entries(shared: DaemonProcess) -> None:
    prompt = toks(11, 100)
    lengths = [5, 16, 21, 32, 47, 64]  # multiples of the block size and not
    with shared.client() as c:
        saved = {n: c.save(IDENT, prompt[:n], payload_for(prompt[:n], 300), "cold").key
                 for n in lengths}
        for q in (4, 5, 15, 16, 20, 21, 22, 31, 32, 46, 47, 48, 63, 64, 100):
            hit = c.lookup(IDENT, prompt[:q])
            expected = max((n for n in lengths if n <= q), default=None)
            if expected is None:
                assert hit is None, f"query of {q} tokens matched {hit}"
                continue
            assert hit is not None, f"query of {q} tokens missed the {expected}-token entry"
            assert (hit.matched_tokens, hit.key) == (expected, saved[expected]), \
                f"query of {q} tokens matched {hit.matched_tokens}, expected {expected}"
            assert hit.probes <= q // BLOCK + 1
        # An entry longer than the query is never returned, even when it starts the same.
        assert c.lookup(IDENT, prompt[:4]) is None
        # A prompt that diverges inside an entry's tail falls back to a shorter entry.
        diverging = prompt[:40] + [0] + prompt[41:]
        assert c.lookup(IDENT, diverging).matched_tokens == 32
        assert c.lookup(IDENT, prompt, max_tokens=30).matched_tokens == 21
        # Another model or KV layout sees none of it.
        assert c.lookup(Identity("fp-other", IDENT.kv_layout), prompt) is None
        assert c.lookup(Identity("fp-test", {"type_k": "q8_0"}), prompt) is None


def test_common_prefix_lookup_over_grpc_and_the_load_that_checks_it(
        shared: DaemonProcess) -> None:
    prompt = toks(13, 100)
    with shared.client() as c:
        key = c.save(IDENT, prompt[:70], payload_for(prompt[:70], 300), "finish").key
        diverging = prompt[:40] + [0] + prompt[41:]
        assert c.lookup(IDENT, diverging) is None  # no whole prefix of it is stored
        hit = c.lookup(IDENT, diverging, common_prefix=True)
        assert hit is not None
        assert (hit.key, hit.matched_tokens, hit.entry_tokens) == (key, 40, 70)
        assert c.lookup(IDENT, prompt[:25], common_prefix=True).matched_tokens == 25
        assert c.lookup(IDENT, prompt, common_prefix=True, max_tokens=30).matched_tokens == 30
        # The load proves the shared tokens, and refuses a claim beyond them.
        loaded = c.load(key, prefix_of=diverging, shares=hit.matched_tokens)
        assert list(loaded.meta.tokens) == prompt[:70]
        with pytest.raises(CacheError, match="first 41 tokens"):
            c.load(key, prefix_of=diverging, shares=41)
        with pytest.raises(CacheError, match="first 70 tokens"):
            c.load(key, prefix_of=diverging)  # whole prefix by default


def test_duplicate_save_is_dropped(shared: DaemonProcess) -> None:
    tokens = toks(12, 20)
    with shared.client() as c:
        first = c.save(IDENT, tokens, b"a" * 100, "cold")
        again = c.save(IDENT, tokens, b"b" * 100, "finish")
        assert (first.status, again.status) == ("saved", "already_present")
        assert again.key == first.key
        assert bytes(c.load(first.key).payload) == b"a" * 100


def test_tenants_are_isolated(shared: DaemonProcess) -> None:
    tokens = toks(13, 40)
    alice = Identity("fp-test", IDENT.kv_layout, tenant="alice")
    bob = Identity("fp-test", IDENT.kv_layout, tenant="bob")
    with shared.client() as c:
        saved = c.save(alice, tokens, payload_for(tokens, 200), "cold")
        assert c.lookup(alice, tokens).key == saved.key
        assert c.lookup(bob, tokens) is None, "bob found alice's entry"
        assert c.lookup(IDENT, tokens) is None, "a tenant-less request found alice's entry"
        assert saved.key not in {e.key for e in c.list_entries(tenant="bob")}
        assert saved.key in {e.key for e in c.list_entries(tenant="alice")}
        assert {e.tenant_id for e in c.list_entries(tenant="alice")} == {c.resolve(alice)[1]}
        err = pytest.raises(CacheError, c.inspect, saved.key, tenant="bob").value
        assert err.code == grpc.StatusCode.NOT_FOUND
        assert "alice" not in str(err)
        assert c.inspect(saved.key, tenant="alice").entry.key == saved.key
        # Bob's save of the same tokens is a different entry.
        bobs = c.save(bob, tokens, payload_for(tokens, 200), "cold")
        assert bobs.status == "saved" and bobs.key != saved.key
        assert {e.key for e in c.list_entries(tenant="bob")} == {bobs.key}
        # The salt itself is never stored or shown.
        detail = c.inspect(saved.key)
        assert "alice" not in str(detail)


def test_load_proves_the_tokens_are_a_prefix(shared: DaemonProcess) -> None:
    tokens = toks(14, 24)
    with shared.client() as c:
        saved = c.save(IDENT, tokens, b"state", "cold")
        c.load(saved.key, prefix_of=tokens)
        c.load(saved.key, prefix_of=tokens + [7])
        for other, shared in ((tokens[:-1], 23), ([tokens[0] + 1, *tokens[1:]], 0),
                              (tokens[:10] + [0] * 20, 10)):
            with pytest.raises(NotAPrefix, match="does not hold the prompt's first") as err:
                c.load(saved.key, prefix_of=other)
            assert (err.value.needed, err.value.n_tokens, err.value.shared) == (24, 24, shared)


# -- concurrency and the publish protocol ---------------------------------------------------


def test_eight_concurrent_writers_publish_once(block_daemon: DaemonProcess) -> None:
    tokens = toks(21, 64)
    payload = payload_for(tokens, 2 << 20)
    barrier = threading.Barrier(8)
    results: list[object] = [None] * 8

    def writer(i: int) -> None:
        with block_daemon.client(fast_path=i % 2 == 0) as c:
            barrier.wait(timeout=30)
            try:
                results[i] = c.save(IDENT, tokens, payload, "cold").status
            except Exception as exc:  # reported below with the others
                results[i] = exc

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results.count("saved") == 1, results
    assert all(r in ("in_flight", "already_present") for r in results if r != "saved"), results
    with block_daemon.client() as c:
        n = counters(c)
        assert n.get("saves_committed") == 1, n
        assert n.get("saves_duplicate") == 7, n
        entries = c.list_entries()
        assert len(entries) == 1
        assert bytes(c.load(entries[0].key).payload) == payload
    assert tmp_files(block_daemon) == []


@pytest.mark.parametrize("path", PATHS)
def test_reader_waiting_on_an_in_flight_key_gets_it_when_published(
        block_daemon: DaemonProcess, path: str) -> None:
    tokens = toks(22, 40)
    payload = payload_for(tokens, 50_000)
    data = blob_bytes(IDENT, tokens, payload)
    writer = block_daemon.client()
    lease = reserve(writer, tokens, len(data))
    assert lease.status == pb.ReserveResponse.GRANTED
    got: dict[str, object] = {}

    def reader() -> None:
        with client_for(block_daemon, path) as c:
            try:
                got["blob"] = c.load(lease.key, wait_ms=20_000)
            except Exception as exc:
                got["error"] = exc

    t = threading.Thread(target=reader)
    t.start()
    wait_counter(writer, "read_waits", 1)
    write(writer, lease.lease_id, data)
    writer.stub.Commit(pb.CommitRequest(lease_id=lease.lease_id), timeout=10)
    t.join(timeout=30)
    assert "error" not in got, got
    assert bytes(got["blob"].payload) == payload  # type: ignore[attr-defined]
    writer.close()


def test_reader_waiting_on_an_aborted_save_is_answered(block_daemon: DaemonProcess) -> None:
    tokens = toks(23, 40)
    writer = block_daemon.client()
    lease = reserve(writer, tokens, 5000)
    errors: list[BaseException] = []

    def reader() -> None:
        with block_daemon.client() as c:
            try:
                c.load(lease.key, wait_ms=20_000)
            except BaseException as exc:
                errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    wait_counter(writer, "read_waits", 1)
    writer.stub.Abort(pb.AbortRequest(lease_id=lease.lease_id), timeout=10)
    t.join(timeout=30)
    assert not t.is_alive(), "the waiting reader was not woken by the abort"
    assert len(errors) == 1 and isinstance(errors[0], CacheError), errors
    assert errors[0].code == grpc.StatusCode.NOT_FOUND
    assert "aborted" in str(errors[0])
    assert counters(writer).get("read_wait_aborted") == 1
    writer.close()


@pytest.mark.parametrize("path", PATHS)
def test_reader_waiting_on_a_silent_writer_gets_a_deadline(block_daemon: DaemonProcess,
                                                           path: str) -> None:
    tokens = toks(24, 40)
    payload = payload_for(tokens, 1000)
    data = blob_bytes(IDENT, tokens, payload)
    with block_daemon.client() as writer, client_for(block_daemon, path) as reader:
        lease = reserve(writer, tokens, len(data))
        err = pytest.raises(CacheError, reader.load, lease.key, wait_ms=300).value
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
        assert "still being written" in str(err)
        assert counters(writer).get("read_wait_timeouts") == 1
        # Without waiting, an in-flight key is not readable either.
        err = pytest.raises(CacheError, reader.load, lease.key).value
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The writer is unaffected and can still publish.
        write(writer, lease.lease_id, data)
        writer.stub.Commit(pb.CommitRequest(lease_id=lease.lease_id), timeout=10)
        assert bytes(reader.load(lease.key).payload) == payload


def test_lease_expiry_cleans_up(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--lease-seconds", "0.5")
    tokens = toks(25, 40)
    data = blob_bytes(IDENT, tokens, payload_for(tokens, 1000))
    with d.client() as c:
        lease = reserve(c, tokens, len(data))  # ... and then nothing is ever written
        assert lease.status == pb.ReserveResponse.GRANTED and lease.lease_seconds == 0.5
        tmp = Path(lease.local_path)
        assert tmp.parent == d.data_dir / "tmp"
        wait_for(lambda: not tmp.exists(), "the temp file of the expired lease to go")
        wait_for(lambda: counters(c).get("leases_expired") == 1, "the expiry to be counted")
        stats = c.stats()
        assert stats.in_flight == 0
        assert [t.reserved_bytes for t in stats.tiers if t.tier == pb.TIER_DISK] == [0]
        assert tmp_files(d) == []
        err = rpc_error(lambda: c.stub.Commit(pb.CommitRequest(lease_id=lease.lease_id),
                                              timeout=10))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        again = reserve(c, tokens, len(data))
        assert again.status == pb.ReserveResponse.GRANTED, "the key stayed in flight"
        write(c, again.lease_id, data)
        c.stub.Commit(pb.CommitRequest(lease_id=again.lease_id), timeout=10)
        assert c.lookup(IDENT, tokens).matched_tokens == 40


def test_writer_cancelling_its_stream_loses_the_reservation(
        block_daemon: DaemonProcess) -> None:
    tokens = toks(26, 40)
    data = blob_bytes(IDENT, tokens, payload_for(tokens, 100_000))
    release = threading.Event()
    with block_daemon.client() as c:
        lease = reserve(c, tokens, len(data))
        tmp = Path(lease.local_path)

        def chunks() -> Iterator[pb.WriteChunk]:
            yield pb.WriteChunk(lease_id=lease.lease_id, offset=0, data=data[:4096])
            release.wait(30)  # the writer stalls mid-blob ...

        future = c.stub.Write.future(chunks(), timeout=60)
        wait_for(lambda: tmp.exists() and tmp.stat().st_size == 4096, "the first chunk")
        future.cancel()  # ... and goes away
        release.set()
        wait_for(lambda: not tmp.exists(), "the cancelled writer's temp file to go")
        wait_for(lambda: c.stats().in_flight == 0, "the reservation to go")
        assert counters(c).get("saves_disconnected") == 1
        assert c.lookup(IDENT, tokens) is None
        assert reserve(c, tokens, len(data)).status == pb.ReserveResponse.GRANTED


WRITER_SCRIPT = """
import time
from kvcache.client import CacheClient, Identity
from kvcache.v1 import kvcache_pb2 as pb
from harness.payloads import blob_bytes, payload_for
from tests.support.entries import IDENT, reserve
tokens = {tokens!r}
data = blob_bytes(IDENT, tokens, payload_for(tokens, 100_000))
c = CacheClient({address!r}, fast_path=False)
lease = reserve(c, tokens, len(data))
def chunks():
    yield pb.WriteChunk(lease_id=lease.lease_id, offset=0, data=data[:4096])
    print(lease.local_path, flush=True)
    time.sleep(600)
c.stub.Write(chunks(), timeout=600)
"""


def test_writer_process_killed_mid_stream_loses_the_reservation(
        block_daemon: DaemonProcess) -> None:
    tokens = toks(27, 40)
    script = WRITER_SCRIPT.format(tokens=tokens, address=block_daemon.address)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=pythonpath_env())
    try:
        tmp = Path(proc.stdout.readline().strip())  # type: ignore[union-attr]
        assert tmp.parent == block_daemon.data_dir / "tmp", f"writer said {tmp}"
        wait_for(lambda: tmp.exists() and tmp.stat().st_size == 4096, "the first chunk")
    finally:
        proc.kill()
        proc.wait()
    with block_daemon.client() as c:
        wait_for(lambda: not tmp.exists(), "the dead writer's temp file to go")
        wait_for(lambda: c.stats().in_flight == 0, "the reservation to go")
        assert counters(c).get("saves_disconnected") == 1
        assert c.lookup(IDENT, tokens) is None
    assert_serving(block_daemon)


# -- budgets --------------------------------------------------------------------------------


def test_disk_budget_evicts_lru_and_never_pinned_or_in_use(
        daemon_factory: DaemonFactory) -> None:
    names = "ABCDEF"
    t = {n: toks(30 + i, 20) for i, n in enumerate(names)}
    size = len(blob_bytes(IDENT, t["A"], payload_for(t["A"], 2000)))
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0",
                       "--disk-bytes", str(3 * size + size // 2))
    c = d.client()

    def save(n: str) -> bytes:
        saved = c.save(IDENT, t[n], payload_for(t[n], 2000), "cold")
        assert saved.status == "saved" and saved.size == size
        return saved.key

    def present() -> str:
        return "".join(n for n in names if c.lookup(IDENT, t[n]) is not None)

    k = {n: save(n) for n in "ABC"}
    c.load(k["A"])  # A is now more recently used than B and C
    k["D"] = save("D")
    assert present() == "ACD", "B, the least recently used, should have gone"
    c.pin(k["A"])
    pin_c = c.stub.OpenRead(pb.OpenReadRequest(key=k["C"]), timeout=10)  # C is being read
    k["E"] = save("E")
    assert present() == "ACE", "only D was neither pinned nor in use"
    c.pin(k["E"])
    err = pytest.raises(CacheError, c.save, IDENT, t["F"], payload_for(t["F"], 2000),
                        "cold").value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "pinned or being read" in str(err)
    assert present() == "ACE" and tmp_files(d) == []
    c.stub.ReleaseRead(pb.ReleaseReadRequest(pin_id=pin_c.pin_id), timeout=10)
    k["F"] = save("F")
    assert present() == "AEF"
    n = counters(c)
    assert n.get("evictions_disk") == 3 and n.get("saves_refused_full") == 1, n
    for name in "AEF":
        assert bytes(c.load(k[name]).payload) == payload_for(t[name], 2000)
    c.close()


def test_a_save_bigger_than_the_disk_budget_is_refused_with_nothing_written(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--disk-bytes", "64K")
    tokens = toks(40, 20)
    with d.client() as c:
        for path in PATHS:
            c.fast_path = path == "fast"
            err = pytest.raises(CacheError, c.save, IDENT, tokens, b"x" * 100_000, "cold").value
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert tmp_files(d) == []
        assert not list((d.data_dir / "blobs").rglob("*.kvc"))
        stats = c.stats()
        disk = [t for t in stats.tiers if t.tier == pb.TIER_DISK][0]
        assert (disk.entries, disk.bytes, disk.reserved_bytes) == (0, 0, 0)
        assert stats.in_flight == 0
        assert counters(c).get("saves_refused_full") == 2
        assert c.lookup(IDENT, tokens) is None
        assert c.save(IDENT, tokens, b"x" * 10_000, "cold").status == "saved"


def test_ram_budget_drops_copies_lru_and_keeps_the_entry_on_disk(
        daemon_factory: DaemonFactory) -> None:
    t = {n: toks(50 + i, 20) for i, n in enumerate("ABC")}
    size = len(blob_bytes(IDENT, t["A"], payload_for(t["A"], 3000)))
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", str(2 * size + size // 2))
    c = d.client()
    k = {}
    for i, n in enumerate("ABC", 1):
        k[n] = c.save(IDENT, t[n], payload_for(t[n], 3000), "cold").key
        wait_counter(c, "ram_placements", i)

    def in_ram() -> str:
        return "".join(n for n in "ABC" if ram_file(d, k[n]).exists())

    assert in_ram() == "BC"
    assert {e.key for e in c.list_entries(tier="ram")} == {k["B"], k["C"]}
    assert counters(c).get("evictions_ram") == 1
    ram = [tier for tier in c.stats().tiers if tier.tier == pb.TIER_RAM][0]
    assert (ram.entries, ram.bytes) == (2, 2 * size)
    # A is still there, on disk, and byte-identical.
    assert blob_file(d, k["A"]).exists()
    assert len(c.list_entries()) == 3
    loaded = c.load(k["A"])
    assert loaded.tier == "disk"
    assert bytes(loaded.payload) == payload_for(t["A"], 3000)
    # The disk hit promotes A; B (now the least recently used copy) makes room.
    wait_counter(c, "ram_placements", 4)
    assert in_ram() == "AC"
    assert c.load(k["A"]).tier == "ram"
    c.close()


# -- corruption -----------------------------------------------------------------------------


def assert_quarantined(d: DaemonProcess, c: CacheClient, key: bytes, tokens: list[int]) -> None:
    n = counters(c)
    assert n.get("corrupt_blobs") == 1, n
    quarantined = os.listdir(d.data_dir / "quarantine")
    assert len(quarantined) == 1 and quarantined[0].startswith(key.hex()), quarantined
    assert not blob_file(d, key).exists()
    assert not ram_file(d, key).exists()
    assert c.lookup(IDENT, tokens) is None, "a quarantined entry is still found"
    assert c.list_entries() == []
    err = pytest.raises(CacheError, c.load, key).value
    assert err.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("path", PATHS)
def test_flipped_payload_bytes_are_detected_and_quarantined(
        daemon_factory: DaemonFactory, path: str) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    tokens = toks(60, 30)
    with client_for(d, path) as c:
        key = c.save(IDENT, tokens, payload_for(tokens, 20_000), "cold").key
        wait_counter(c, "ram_placements", 1)
        flip_payload(blob_file(d, key))
        flip_payload(ram_file(d, key))
        with pytest.raises(CorruptBlob):
            c.load(key, prefix_of=tokens)
        assert_quarantined(d, c, key, tokens)
    assert_serving(d)


@pytest.mark.parametrize("path", PATHS)
def test_truncated_blob_is_detected_and_quarantined(daemon_factory: DaemonFactory,
                                                    path: str) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")  # disk tier only
    tokens = toks(61, 30)
    with client_for(d, path) as c:
        saved = c.save(IDENT, tokens, payload_for(tokens, 20_000), "cold")
        with open(blob_file(d, saved.key), "r+b") as f:
            f.truncate(saved.size - 1000)
        with pytest.raises(CorruptBlob):
            c.load(saved.key)
        assert_quarantined(d, c, saved.key, tokens)
    assert_serving(d)


# -- bad input ------------------------------------------------------------------------------


def test_bad_keys_and_leases_get_their_statuses(shared: DaemonProcess) -> None:
    c = shared.client()
    s = c.stub
    unknown = bytes(range(16))
    for name, call in {
        "Read": lambda k: list(s.Read(pb.ReadRequest(key=k), timeout=10)),
        "OpenRead": lambda k: s.OpenRead(pb.OpenReadRequest(key=k), timeout=10),
        "Inspect": lambda k: s.Inspect(pb.InspectRequest(key=k), timeout=10),
        "Pin": lambda k: s.Pin(pb.KeyRequest(key=k), timeout=10),
        "Unpin": lambda k: s.Unpin(pb.KeyRequest(key=k), timeout=10),
        "Delete": lambda k: s.Delete(pb.KeyRequest(key=k), timeout=10),
    }.items():
        assert rpc_error(lambda call=call: call(unknown)).code() == grpc.StatusCode.NOT_FOUND, \
            f"{name} of an unknown key"
        for bad in (b"", b"short", bytes(17)):
            code = rpc_error(lambda call=call, bad=bad: call(bad)).code()
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{name} of a {len(bad)}-byte key"
    code = rpc_error(lambda: list(s.Verify(pb.VerifyRequest(keys=[b"abc"]), timeout=10))).code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    err = pytest.raises(CacheError, c.load, unknown).value
    assert err.code == grpc.StatusCode.NOT_FOUND
    for name, call in {
        "Write": lambda: write(c, "no-such-lease", b"data"),
        "Commit": lambda: s.Commit(pb.CommitRequest(lease_id="no-such-lease"), timeout=10),
        "Abort": lambda: s.Abort(pb.AbortRequest(lease_id="no-such-lease"), timeout=10),
        "ReleaseRead": lambda: s.ReleaseRead(pb.ReleaseReadRequest(pin_id="nope"), timeout=10),
    }.items():
        assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND, f"{name} of a bad lease"
    assert rpc_error(lambda: s.Write(iter([]), timeout=10)).code() == \
        grpc.StatusCode.INVALID_ARGUMENT
    c.close()
    assert_serving(shared)


def test_bad_identity_tokens_and_reasons_are_refused(shared: DaemonProcess) -> None:
    c = shared.client()
    s = c.stub
    tokens = toks(70, 20)
    ident = IDENT.message()
    too_many = [1] * ((1 << 20) + 1)  # one over the daemon's default limit
    cases = {
        "empty token list (Lookup)": lambda: s.Lookup(
            pb.LookupRequest(identity=ident, tokens=[]), timeout=10),
        "empty token list (Reserve)": lambda: reserve(c, [], 1000),
        "no fingerprint (Lookup)": lambda: s.Lookup(
            pb.LookupRequest(identity=pb.Identity(), tokens=tokens), timeout=10),
        "no fingerprint (Reserve)": lambda: reserve(c, tokens, 1000, identity=Identity("")),
        "unknown reason": lambda: reserve(c, tokens, 1000, reason="whenever"),
        "empty reason": lambda: reserve(c, tokens, 1000, reason=""),
        "size too small": lambda: reserve(c, tokens, 10),
        "too many tokens (Lookup)": lambda: s.Lookup(
            pb.LookupRequest(identity=ident, tokens=too_many), timeout=30),
        "too many tokens (Reserve)": lambda: reserve(c, too_many, 1000),
        "prune without criteria": lambda: s.Prune(pb.PruneRequest(), timeout=10),
        "packed tokens not a multiple of 4 bytes": lambda: s.Lookup(
            pb.LookupRequest(identity=ident, packed_tokens=b"\x01\x00\x00"), timeout=10),
        "both tokens and packed_tokens": lambda: s.Lookup(
            pb.LookupRequest(identity=ident, tokens=tokens,
                             packed_tokens=keys.tokens_to_bytes(tokens)), timeout=10),
    }
    for what, call in cases.items():
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {err}"
    assert tmp_files(shared) == []
    assert c.stats().in_flight == 0
    assert c.lookup(IDENT, [1] * (1 << 20)) is None  # exactly the limit is fine
    # Both token encodings name the same entry.
    saved = c.save(IDENT, tokens, b"p" * 100, "cold")
    for request in (pb.LookupRequest(identity=ident, tokens=tokens),
                    pb.LookupRequest(identity=ident, packed_tokens=keys.tokens_to_bytes(tokens))):
        assert s.Lookup(request, timeout=10).key == saved.key
    c.close()
    assert_serving(shared)


def test_bad_chunks_get_their_statuses(block_daemon: DaemonProcess) -> None:
    c = block_daemon.client()
    tokens = toks(71, 20)
    data = blob_bytes(IDENT, tokens, payload_for(tokens, 5000))

    def lease() -> pb.ReserveResponse:
        res = reserve(c, tokens, len(data))
        assert res.status == pb.ReserveResponse.GRANTED, "the key is still in flight"
        return res

    # Garbage under a valid lease: refused, and the lease is aborted.
    res = lease()
    err = rpc_error(lambda: write(c, res.lease_id, os.urandom(200)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.details()
    assert not Path(res.local_path).exists() and c.stats().in_flight == 0

    # A chunk at the wrong offset: OUT_OF_RANGE; the lease itself survives it.
    res = lease()
    chunks = [pb.WriteChunk(lease_id=res.lease_id, offset=0, data=data[:100]),
              pb.WriteChunk(offset=200, data=data[200:300])]
    err = rpc_error(lambda: c.stub.Write(iter(chunks), timeout=10))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE, err
    assert "offset 200" in err.details()
    c.stub.Abort(pb.AbortRequest(lease_id=res.lease_id), timeout=10)

    # More bytes than reserved: OUT_OF_RANGE, and the lease is aborted.
    res = lease()
    err = rpc_error(lambda: write(c, res.lease_id, data + b"extra"))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE, err
    assert not Path(res.local_path).exists() and c.stats().in_flight == 0

    # A chunk over the 16 MiB message limit: gRPC itself refuses it (a channel without a
    # client-side limit, so the daemon's limit is what is tested).
    res = lease()
    with grpc.insecure_channel(block_daemon.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        chunks = iter([pb.WriteChunk(lease_id=res.lease_id, offset=0, data=data[:100]),
                       pb.WriteChunk(lease_id=res.lease_id, offset=100,
                                     data=bytes(17 << 20))])
        err = rpc_error(lambda: stub.Write(chunks, timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    wait_for(lambda: c.stats().in_flight == 0, "the oversized writer's lease to go")
    assert not Path(res.local_path).exists()

    # A blob of other tokens (same length, so same size) than reserved: refused at commit.
    res = lease()
    other = blob_bytes(IDENT, toks(72, 20), payload_for(tokens, 5000))
    assert len(other) == len(data)
    write(c, res.lease_id, other)
    err = rpc_error(lambda: c.stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in err.details()
    # ... also when written through the same-host file instead of streamed.
    res = lease()
    Path(res.local_path).write_bytes(other)
    err = rpc_error(lambda: c.stub.Commit(
        pb.CommitRequest(lease_id=res.lease_id, local_write=True), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in err.details()
    # A blob of another identity (namespace) than reserved.
    res = lease()
    write(c, res.lease_id, blob_bytes(Identity("fp-test", {"type_k": "f32"}, model_name="tiny.gguf"), tokens,
                                      payload_for(tokens, 5000)))
    err = rpc_error(lambda: c.stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in err.details()

    assert c.lookup(IDENT, tokens) is None, "a refused blob was published"
    assert tmp_files(block_daemon) == [] and c.stats().in_flight == 0
    n = counters(c)
    assert n.get("saves_committed", 0) == 0 and n.get("saves_invalid") == 3, n
    # After all that, the same key saves normally.
    assert c.save(IDENT, tokens, payload_for(tokens, 5000), "cold").status == "saved"
    c.close()
    assert_serving(block_daemon)


# -- administration -------------------------------------------------------------------------


def test_admin_through_the_client(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    c = d.client()
    other_model = Identity("fp-other", {"type_k": "f16"}, model_name="other.gguf")
    tenant = Identity("fp-test", {"type_k": "f16"}, tenant="t1", model_name="tiny.gguf")
    t = {n: toks(80 + i, 20 + 10 * i) for i, n in enumerate("abcde")}
    k = {
        "a": c.save(IDENT, t["a"], payload_for(t["a"], 1000), "cold").key,
        "b": c.save(IDENT, t["b"], payload_for(t["b"], 1000), "finish").key,
        "c": c.save(tenant, t["c"], payload_for(t["c"], 1000), "finish").key,
        "d": c.save(other_model, t["d"], payload_for(t["d"], 1000), "continued").key,
        "e": save_raw(c, IDENT, t["e"], payload_for(t["e"], 1000), "evict",
                      created=time.time() - 7200),
    }
    by_key = {v: n for n, v in k.items()}

    def listed(**filters: object) -> str:
        return "".join(sorted(by_key[e.key] for e in c.list_entries(**filters)))

    # stats
    stats = c.stats()
    disk = [tier for tier in stats.tiers if tier.tier == pb.TIER_DISK][0]
    assert disk.entries == 5
    assert disk.bytes == sum(e.size for e in c.list_entries())
    assert stats.block_size == BLOCK and stats.version
    assert stats.counters["saves_committed"] == 5
    # list filters
    assert listed() == "abcde"
    assert listed(reason="finish") == "bc"
    assert listed(tenant="t1") == "c"
    assert listed(model="other.gguf") == "d"
    assert listed(model="fp-oth") == "d"  # a fingerprint prefix
    assert listed(min_tokens=50) == "de"
    assert listed(tier="ram") == ""
    assert len(c.list_entries(limit=2)) == 2
    # pages: every entry once, in the listing's order, a page at a time, also filtered
    for sort in ("", "size", "age"):
        whole = [e.key for e in c.list_entries(sort=sort)]
        pages = [[e.key for e in page] for page in c.iter_entries(sort=sort, page_size=2)]
        assert [len(p) for p in pages] == [2, 2, 1] and sum(pages, []) == whole, sort
    assert [len(p) for p in c.iter_entries(page_size=2, limit=3)] == [2, 1]
    assert [e.key for p in c.iter_entries(reason="finish", page_size=1) for e in p] == [
        e.key for e in c.list_entries(reason="finish")]
    sizes = [e.size for e in c.list_entries(sort="size")]
    assert sizes == sorted(sizes, reverse=True)
    err = pytest.raises(CacheError, c.list_entries, sort="colour").value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "unknown sort" in str(err)
    # inspect
    detail = c.inspect(k["c"])
    assert list(detail.tokens) == t["c"]
    assert dict(detail.kv_layout) == {"type_k": "f16"}
    assert detail.entry.reason == "finish" and detail.entry.n_tokens == len(t["c"])
    assert detail.entry.tenant_id == c.resolve(tenant)[1] != keys.tenant_id("t1")
    assert detail.entry.model_name == "tiny.gguf"
    assert detail.raw_payload_size == 1000 and detail.format_version == blobfmt.FORMAT_VERSION
    assert Path(detail.path) == blob_file(d, k["c"]) and Path(detail.path).exists()
    c.load(k["c"])
    wait_for(lambda: c.inspect(k["c"]).entry.hits == 1, "the hit to be counted")
    # pin / unpin / delete
    c.pin(k["a"])
    assert [e.pinned for e in c.list_entries() if e.key == k["a"]] == [True]
    err = pytest.raises(CacheError, c.delete, k["a"]).value
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "pinned" in str(err)
    c.unpin(k["a"])
    c.delete(k["a"])
    assert c.lookup(IDENT, t["a"]) is None and not blob_file(d, k["a"]).exists()
    assert pytest.raises(CacheError, c.pin, k["a"]).value.code == grpc.StatusCode.NOT_FOUND
    # prune: dry run lists and removes nothing
    c.pin(k["b"])
    dry = c.prune(reason="finish", dry_run=True)
    assert {by_key[e.key] for e in dry.removed} == {"c"} and dry.skipped_pinned == 1
    assert listed() == "bcde"
    # by age
    old = c.prune(older_than_seconds=3600)
    assert [by_key[e.key] for e in old.removed] == ["e"]
    assert listed() == "bcd"
    # by reason; the pinned one stays
    by_reason = c.prune(reason="finish")
    assert [by_key[e.key] for e in by_reason.removed] == ["c"]
    assert by_reason.skipped_pinned == 1 and listed() == "bd"
    # by bytes: everything that is not pinned goes
    by_bytes = c.prune(max_disk_bytes=1)
    assert [by_key[e.key] for e in by_bytes.removed] == ["d"]
    assert by_bytes.bytes_freed == by_bytes.removed[0].size
    assert listed() == "b"
    assert c.lookup(IDENT, t["b"]).matched_tokens == len(t["b"])
    c.close()


def test_verify_finds_a_corrupted_blob(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    with d.client() as c:
        t = {n: toks(90 + i, 20) for i, n in enumerate("abc")}
        k = {n: c.save(IDENT, t[n], payload_for(t[n], 4000), "cold").key for n in "abc"}
        assert all(r.ok for r in c.verify())
        flip_payload(blob_file(d, k["b"]))
        results = {r.key: r for r in c.verify()}
        assert set(results) == set(k.values())
        assert [r.ok for r in (results[k[n]] for n in "abc")] == [True, False, True]
        assert "checksum" in results[k["b"]].error
        assert results[k["b"]].total == 3
        assert c.lookup(IDENT, t["b"]) is None
        assert counters(c).get("corrupt_blobs") == 1
        assert len(os.listdir(d.data_dir / "quarantine")) == 1
        only = list(c.verify([k["a"]]))
        assert [(r.key, r.ok) for r in only] == [(k["a"], True)]


# -- service surface and security -----------------------------------------------------------


def test_health_and_reflection(shared: DaemonProcess) -> None:
    with grpc.insecure_channel(shared.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvcache.v1.KVCache"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in responses[0].list_services_response.service}
        assert "kvcache.v1.KVCache" in names, names
        assert "grpc.health.v1.Health" in names


def test_tcp_with_the_insecure_flag_streams(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--listen", "127.0.0.1:0", "--insecure-tcp")
    tokens = toks(110, 30)
    payload = payload_for(tokens, 300_000)
    with CacheClient(tcp_address(d)) as c:
        assert not c.fast_path
        saved = c.save(IDENT, tokens, payload, "cold")
        assert bytes(c.load(saved.key).payload) == payload


def test_socket_and_directories_are_owner_only(shared: DaemonProcess) -> None:
    mode = stat.S_IMODE(shared.socket.stat().st_mode)
    assert stat.S_ISSOCK(shared.socket.stat().st_mode)
    assert mode == 0o600, f"socket mode {mode:o}"
    for sub in ("", "blobs", "tmp", "quarantine", "index"):
        path = shared.data_dir / sub
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o700, f"{path} has mode {mode:o}"
    assert stat.S_IMODE(shared.ram_dir.stat().st_mode) == 0o700
    for blob in (shared.data_dir / "blobs").rglob("*.kvc"):
        assert stat.S_IMODE(blob.stat().st_mode) & 0o077 == 0, f"{blob} is readable by others"
