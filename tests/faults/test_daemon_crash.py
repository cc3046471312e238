"""Crashes (kill -9) and start-up recovery of the real daemon: nothing published is lost,
nothing half-written becomes visible, and index and files always end up agreeing. After a
kill the daemon serves at once and checks index and files in the background
(kvcache.store.recovery): what a read gets is checked first, the rest follows."""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from harness import payloads
from harness.payloads import blob_bytes

from kvcache import keys
from kvcache.client import CacheClient, CacheError, Identity
from kvcache.server import Daemon
from kvcache.store import StoreConfig
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.commands import cli_many, ok
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import (
    BLOCK,
    IDENT,
    DaemonFactory,
    blob_file,
    counters,
    leftovers,
    recovered,
    toks,
)
from tests.support.stores import hold_recovery

# payload_for(tokens): 1 kB to 300 kB, size and bytes following from the tokens.
payload_for = functools.partial(payloads.payload_for, size=(1_000, 300_000))


def check_every_entry(d: DaemonProcess, c: CacheClient) -> int:
    """Every visible entry is whole and holds exactly the bytes its tokens imply."""
    entries = c.list_entries()
    for e in entries:
        loaded = c.load(e.key)
        tokens = list(loaded.meta.tokens)
        assert len(tokens) == e.n_tokens
        assert bytes(loaded.payload) == payload_for(tokens), \
            f"entry {e.key.hex()} ({e.n_tokens} tokens) holds other bytes than were saved"
    bad = [(r.key.hex(), r.error) for r in c.verify() if not r.ok]
    assert bad == [], f"verify after restart found bad blobs: {bad}"
    return len(entries)


# -- kill -9 while saving -------------------------------------------------------------------


def crash_round(d: DaemonProcess, round_: int, acknowledged: dict[bytes, list[int]]) -> None:
    """Four writers save as fast as they can, one save hangs half-written; kill -9;
    restart; check that everything acknowledged is there and nothing partial is."""
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        with d.client(fast_path=i % 2 == 0, timeout=5.0) as c:
            j = 0
            while not stop.is_set():
                tokens = toks(round_ * 10_000 + i * 1000 + j, 20 + (j * 7) % 60)
                j += 1
                try:
                    saved = c.save(IDENT, tokens, payload_for(tokens), "cold")
                except CacheError as exc:  # the daemon died under us: expected
                    errors.append(exc)
                    return
                if saved.status == "saved":
                    with lock:
                        acknowledged[saved.key] = tokens

    # A save that is certainly half-written when the daemon dies.
    held = d.client()
    half = toks(round_ * 10_000 + 999, 40)
    data = blob_bytes(IDENT, half, payload_for(half))
    lease = held.stub.Reserve(pb.ReserveRequest(identity=IDENT.message(), tokens=half,
                                                size=len(data), reason="cold"), timeout=10)
    release = threading.Event()

    def stalled() -> Iterator[pb.WriteChunk]:
        yield pb.WriteChunk(lease_id=lease.lease_id, offset=0, data=data[: len(data) // 2])
        release.wait(30)

    stream = held.stub.Write.future(stalled(), timeout=60)
    tmp = Path(lease.local_path)
    wait_for(lambda: tmp.exists() and tmp.stat().st_size == len(data) // 2,
             "the half-written temp file")

    before = len(acknowledged)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acknowledged) >= before + 12, "a dozen saves before the crash",
             timeout=60)
    d.kill()  # SIGKILL, with saves in every stage of the protocol
    stop.set()
    release.set()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a writer hung on a dead daemon"
    with pytest.raises(grpc.RpcError):
        stream.result(timeout=30)
    held.close()
    assert all(isinstance(e, CacheError) for e in errors), errors

    d.start()
    assert leftovers(d) == [], "temp files survived the restart"
    with d.client() as c:
        assert c.stats().recovery.state in ("running", "done")  # serving while it checks
        assert counters(c).get("orphans_swept", 0) >= 1, counters(c)
        assert c.lookup(IDENT, half) is None, "a half-written save became visible"
        for key, tokens in acknowledged.items():
            hit = c.lookup(IDENT, tokens)
            assert hit is not None and hit.key == key, \
                f"acknowledged save {key.hex()} lost in crash {round_ + 1}"
            assert hit.matched_tokens == len(tokens)
        recovered(c)
        assert check_every_entry(d, c) >= len(acknowledged)


def test_kill_during_writes_then_restart(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    acknowledged: dict[bytes, list[int]] = {}
    for round_ in range(2):
        crash_round(d, round_, acknowledged)
    assert len(acknowledged) >= 24


# -- start-up reconciliation ----------------------------------------------------------------


def test_blob_renamed_but_not_indexed_is_reindexed(daemon_factory: DaemonFactory) -> None:
    """kill -9 between the rename into blobs/ and the index commit leaves a valid blob
    that the index does not know: start-up indexes it from its header."""
    d = daemon_factory("--block-size", str(BLOCK))
    with d.client() as c:
        kept = toks(1, 30)
        c.save(IDENT, kept, payload_for(kept), "cold")
    d.kill()
    tokens = toks(2, 45)
    payload = payload_for(tokens)
    key = keys.entry_key(IDENT.namespace, tokens, BLOCK).key
    path = blob_file(d, key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(blob_bytes(IDENT, tokens, payload, "finish"))
    # A file in blobs/ that is not a blob at all is set aside, not indexed.
    junk_key = bytes(range(16))
    junk = blob_file(d, junk_key)
    junk.parent.mkdir(mode=0o700, exist_ok=True)
    junk.write_bytes(b"this is not a blob" * 10)
    d.start()
    with d.client() as c:
        recovered(c)
        n = counters(c)
        assert n.get("reconcile_added") == 1, n
        hit = c.lookup(IDENT, tokens + [5, 6])
        assert hit is not None and (hit.key, hit.matched_tokens) == (key, 45)
        loaded = c.load(key, prefix_of=tokens)
        assert bytes(loaded.payload) == payload and loaded.meta.reason == "finish"
        assert {e.key for e in c.list_entries()} == {key, c.lookup(IDENT, kept).key}
        assert not junk.exists()
        assert any(p.startswith(junk_key.hex()) for p in os.listdir(d.data_dir / "quarantine"))
        with pytest.raises(CacheError):
            c.inspect(junk_key)
        check_every_entry(d, c)


def test_index_row_whose_file_is_gone_is_removed(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    gone, kept = toks(3, 20), toks(4, 20)
    with d.client() as c:
        gone_key = c.save(IDENT, gone, payload_for(gone), "cold").key
        kept_key = c.save(IDENT, kept, payload_for(kept), "cold").key
        wait_for(lambda: counters(c).get("ram_placements", 0) == 2, "RAM placement")
    d.kill()
    blob_file(d, gone_key).unlink()  # its RAM copy is still there: it must not count
    assert (d.ram_dir / f"{gone_key.hex()}.kvc").exists()
    d.start()
    with d.client() as c:
        # Read at once, before (or while) the background check gets to it: checked first.
        err = pytest.raises(CacheError, c.load, gone_key).value
        assert err.code == grpc.StatusCode.NOT_FOUND
        recovered(c)
        assert counters(c).get("reconcile_removed") == 1, counters(c)
        assert c.lookup(IDENT, gone) is None
        assert [e.key for e in c.list_entries()] == [kept_key]
        assert not (d.ram_dir / f"{gone_key.hex()}.kvc").exists()
        disk = [t for t in c.stats().tiers if t.tier == pb.TIER_DISK][0]
        assert disk.entries == 1 and disk.bytes == blob_file(d, kept_key).stat().st_size
        assert bytes(c.load(kept_key).payload) == payload_for(kept)


def test_start_up_rebuilds_the_index_from_blobs_alone(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    tenant = Identity("fp-test", {"type_k": "f16"}, tenant="t1", model_name="tiny.gguf")
    other = Identity("fp-other", {"type_k": "q8_0"}, model_name="other.gguf")
    saves = [  # aligned and any-length entries, tenants, models, reasons
        (IDENT, toks(10, 16), "cold"), (IDENT, toks(11, 37), "finish"),
        (IDENT, toks(11, 37)[:32], "continued"), (tenant, toks(12, 50), "evict"),
        (other, toks(13, 5), "shutdown"),
    ]
    with d.client() as c:
        before = {c.save(ident, t, payload_for(t), reason).key: (ident, t, reason)
                  for ident, t, reason in saves}
        listed_before = {e.key: e for e in c.list_entries()}
    d.stop()
    shutil.rmtree(d.data_dir / "index")
    d.start()
    with d.client() as c:
        assert counters(c).get("reconcile_added") == len(saves), counters(c)
        listed = {e.key: e for e in c.list_entries()}
        assert set(listed) == set(before)
        for key, (ident, tokens, reason) in before.items():
            hit = c.lookup(ident, tokens + [1])
            assert hit is not None and hit.key == key, f"{reason} entry not found again"
            assert hit.matched_tokens == len(tokens)
            e, old = listed[key], listed_before[key]
            assert (e.reason, e.n_tokens, e.tenant_id, e.model_name, e.size, e.created) == \
                (old.reason, old.n_tokens, old.tenant_id, old.model_name, old.size, old.created)
            assert bytes(c.load(key).payload) == payload_for(tokens)
        assert c.lookup(IDENT, toks(12, 50)) is None, "the tenant's entry leaked"
        check_every_entry(d, c)


def test_a_daemon_killed_while_it_checks_after_a_crash_loses_nothing(
        daemon_factory: DaemonFactory) -> None:
    """Killed again while the background check after a first kill runs, with saves and a
    delete answered meanwhile: the next start-up checks again, every acknowledged save is
    there and whole, and neither the deleted entry nor the rows whose blob the first kill
    took come back."""
    d = daemon_factory("--block-size", str(BLOCK))
    small = functools.partial(payloads.payload_for, size=500)
    with d.client() as c:
        saved = {}
        for i in range(600):  # enough that the check is still running at the second kill
            tokens = toks(50_000 + i, 20)
            saved[c.save(IDENT, tokens, small(tokens), "cold").key] = tokens
    d.kill()
    cut_short = list(saved)[:5]
    for key in cut_short:  # removals cut short by the kill: rows without their blobs
        blob_file(d, key).unlink()
    d.start()
    with d.client() as c:
        for i in range(20):
            tokens = toks(60_000 + i, 25)
            result = c.save(IDENT, tokens, small(tokens), "cold")
            assert result.status == "saved", result
            saved[result.key] = tokens
        deleted = list(saved)[10]
        assert c.delete(deleted) == 0  # nothing built on it
        assert c.lookup(IDENT, saved[deleted]) is None
        assert c.stats().recovery.state == "running", "the check ended before the kill"
    d.kill()
    d.start()
    with d.client() as c:
        recovered(c)
        expected = {k: t for k, t in saved.items() if k not in {*cut_short, deleted}}
        assert {e.key for e in c.list_entries()} == set(expected)
        for key, tokens in expected.items():
            assert bytes(c.load(key).payload) == small(tokens), f"{key.hex()} changed"
        assert [r.key.hex() for r in c.verify() if not r.ok] == []
    # The operator sees what the check found.
    summary, data = cli_many(("stats", "-a", d.address), ("stats", "--json", "-a", d.address))
    recovery = json.loads(ok(data))["recovery"]
    assert recovery["state"] == "done" and len(expected) <= recovery["entries"] < len(saved)
    assert recovery["entries_checked"] >= len(expected)
    assert f"after a crash: {recovery['entries_checked']} entries checked" in ok(summary)
    assert leftovers(d) == []


def test_stats_shows_the_check_after_a_crash_while_it_runs(
        daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvcache stats`` while the background check after a kill runs: a line saying how
    far it got (share of folders, entries checked of all, what reads had checked before
    their turn), and once it is over, what it checked. The daemon restarted after the kill
    runs in this process so that its check can be held before its first folder (as
    tests/unit/test_recovery.py holds a store's): the stats are asked of it by the real
    command over its socket while the check is certainly still running."""
    d = daemon_factory("--block-size", str(BLOCK))
    small = functools.partial(payloads.payload_for, size=500)
    with d.client() as c:
        saved = {}
        for i in range(30):
            tokens = toks(70_000 + i, 20)
            saved[c.save(IDENT, tokens, small(tokens), "cold").key] = tokens
    d.kill()
    go_on = hold_recovery(monkeypatch)
    restarted = Daemon(StoreConfig(root=d.data_dir, ram_dir=d.ram_parent, min_free_bytes=0,
                                   block_size=BLOCK), socket_path=d.socket)
    try:
        restarted.start()
        with d.client() as c:  # an entry read before the check reaches it: checked first
            key, tokens = next(iter(saved.items()))
            assert bytes(c.load(key).payload) == small(tokens)
        summary, data = cli_many(("stats", "-a", d.address), ("stats", "--json", "-a", d.address))
        recovery = json.loads(ok(data))["recovery"]
        assert (recovery["state"], recovery["entries"], recovery["entries_checked"],
                recovery["folders_checked"], recovery["checked_on_read"]) == \
            ("running", len(saved), 0, 0, 1), recovery
        shown = " ".join(ok(summary).split())  # a long value may wrap
        assert ("recovery checking index and files after a crash: 0% (0 of 30 entries, 0 of "
                "256 folders, ") in shown, shown
        assert ("0 rows dropped, 0 blobs re-indexed so far; an entry read before its turn is "
                "checked first (1 so far)") in shown, shown
        go_on.set()
        with d.client() as c:
            recovered(c)
        shown = " ".join(ok(cli_many(("stats", "-a", d.address))[0]).split())
        assert "recovery after a crash: 30 entries checked in " in shown, shown
        assert "s while serving; 0 rows dropped, 0 blobs re-indexed" in shown, shown
        assert "checking index and files" not in shown
    finally:
        go_on.set()
        restarted.stop()
    assert leftovers(d) == []
