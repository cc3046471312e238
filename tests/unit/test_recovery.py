"""The start-up after a crash (kvcache.store.recovery), in-process on real LMDB and real
files: the store serves at once, the index and the blob files are checked against each
other in the background, an entry read before the check reaches it is checked first, and
nothing saved, evicted or removed meanwhile is undone.

A crash is made as a kill leaves it: a store closed, its clean-shutdown record taken away
(a killed daemon writes none), and the files damaged as a removal or a publish cut short
leaves them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import lmdb
import pytest
from harness.payloads import payload_for

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.errors import Corrupt, NotFound
from kvcache.index import Index, Record
from kvcache.store import Store
from tests.support.stores import (
    BLOCK,
    FP,
    NS,
    blob_bytes,
    entry_size,
    hold_recovery,
    put,
    ram_settled,
    raw,
    read_all,
    recovered,
)

LISTS = [[i, i + 1, i + 2] * 7 for i in range(1, 400, 3)]  # 133 entries, many folders
SIZE = entry_size(LISTS[0])


def key_of(tokens: list[int]) -> bytes:
    return keys.entry_key(NS, tokens, BLOCK).key


def killed(store: Store) -> None:
    """Leave ``store``'s directory as a kill would: no clean-shutdown record."""
    store.close()
    index = Index(store.root / "index")
    index.mark_open()
    index.close()


@pytest.fixture
def held_recovery(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background check waits before its first folder until the event is set (so a
    test sees the store serving with nothing checked yet)."""
    go_on = hold_recovery(monkeypatch)
    yield go_on
    go_on.set()


def assert_index_and_files_agree(store: Store) -> list[Record]:
    records = list(store.index.records())
    blobs = {bytes.fromhex(p.stem): p.stat().st_size for p in store.blob_dir.glob("*/*.kvc")}
    assert blobs == {r.key: r.size for r in records}, "index rows and blob files differ"
    copies = {bytes.fromhex(p.stem) for p in store.ram_dir.glob("*.kvc")}
    assert copies == {r.key for r in records if r.in_ram}, "RAM flags and copies differ"
    s = store.stats()
    assert (s["disk_entries"], s["disk_used"]) == (len(records), sum(r.size for r in records))
    in_ram = [r for r in records if r.in_ram]
    assert (s["ram_entries"], s["ram_used"]) == (len(in_ram), sum(r.size for r in in_ram))
    return records


def test_after_a_crash_the_store_serves_at_once_and_checks_what_is_read_first(
        make_store: Callable[..., Store], held_recovery: threading.Event) -> None:
    store = make_store(ram_bytes=20 * SIZE)
    saved = [put(store, tokens) for tokens in LISTS]
    ram_settled(store)
    killed(store)
    gone, damaged, in_ram_lost, good = saved[0], saved[1], saved[-1], saved[5]
    assert in_ram_lost.in_ram or store.ram_path(in_ram_lost.key).exists()
    store.blob_path(gone.key).unlink()  # a removal cut short: the row is left
    with open(store.blob_path(damaged.key), "r+b") as f:  # damaged in place (a checksum)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    store.ram_path(in_ram_lost.key).unlink()  # the RAM copy lost
    orphan_tokens = [999, 998, 997] * 7  # a publish cut short: the blob without its row
    orphan = key_of(orphan_tokens)
    store.blob_path(orphan).parent.mkdir(exist_ok=True)
    store.blob_path(orphan).write_bytes(blob_bytes(orphan_tokens, payload_for(orphan_tokens,
                                                                              1000)))
    reopened = make_store(ram_bytes=20 * SIZE)
    assert not reopened.clean_start
    progress = reopened.recovery()
    assert progress.state == "running" and progress.entries_checked == 0
    assert reopened.disk_used == sum(r.size for r in saved)  # the index's sums, no row read
    # Lookups and saves are answered; reads check their entry first.
    assert reopened.lookup(NS, raw(LISTS[7]))[0].key == saved[7].key
    put(reopened, [5000] * 21)
    with pytest.raises(NotFound):
        reopened.open_read(gone.key)
    with pytest.raises(Corrupt):
        read_all(reopened, damaged.key)
    assert bytes(blobfmt.decode_blob(read_all(reopened, good.key)).payload) == \
        payload_for(LISTS[5], 1000)
    pin = reopened.open_read(in_ram_lost.key)
    assert pin.tier == "disk" and pin.path.exists()
    reopened.release_read(pin.pin_id)
    counters = reopened.stats()["counters"]
    assert (counters["reconcile_removed"], counters["corrupt_blobs"]) == (1, 1)
    # good, in_ram_lost and damaged (whose row and file agree: its checksum, which the
    # read verifies, does not)
    assert reopened.recovery().checked_on_read == 3
    held_recovery.set()
    recovered(reopened)
    done = reopened.recovery()
    assert done.state == "done" and done.folders_checked == 256
    assert reopened.stats()["counters"]["reconcile_added"] == 1
    records = assert_index_and_files_agree(reopened)
    assert {gone.key, damaged.key}.isdisjoint(r.key for r in records)
    assert {orphan, key_of([5000] * 21)} <= {r.key for r in records}


def test_the_background_check_fixes_what_nobody_read(
        make_store: Callable[..., Store]) -> None:
    store = make_store(ram_bytes=20 * SIZE)
    saved = [put(store, tokens) for tokens in LISTS]
    ram_settled(store)
    in_ram = [r.key for r in store.index.records() if r.in_ram]
    killed(store)
    for record in saved[:10]:
        store.blob_path(record.key).unlink()
    with open(store.blob_path(saved[10].key), "r+b") as f:
        f.truncate(saved[10].size - 5)
    for key in in_ram:  # a reboot emptied the RAM tier
        store.ram_path(key).unlink()
    (store.blob_path(saved[20].key).parent / f"{'ab' * 16}.part").write_bytes(b"x")
    reopened = make_store(ram_bytes=20 * SIZE)
    recovered(reopened)
    counters = reopened.stats()["counters"]
    assert counters["reconcile_removed"] == 11 and counters["orphans_swept"] == 1
    assert counters["quarantined_files"] == 1  # the truncated blob, kept
    records = assert_index_and_files_agree(reopened)
    assert len(records) == len(saved) - 11 and not any(r.in_ram for r in records)


def test_a_crash_start_reads_no_row_before_serving(
        make_store: Callable[..., Store], held_recovery: threading.Event,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What takes a full reconcile tens of seconds at a million entries is left to the
    background: start-up reads neither every row nor every blob."""
    store = make_store()
    for tokens in LISTS[:20]:
        put(store, tokens)
    killed(store)
    with monkeypatch.context() as m:
        def refused(*args: object, **kwargs: object) -> None:
            raise AssertionError("a per-entry read before serving")

        for name in ("audit", "records", "drop_rows", "publish_many"):
            m.setattr(Index, name, refused)
        m.setattr(blobfmt, "read_header_and_meta", refused)
        reopened = make_store()
    assert reopened.recovery().state == "running"
    held_recovery.set()
    recovered(reopened)
    assert len(assert_index_and_files_agree(reopened)) == 20


def test_saves_evictions_and_deletes_during_the_check_are_not_undone(
        make_store: Callable[..., Store], held_recovery: threading.Event) -> None:
    settings = {"disk_bytes": 100 * SIZE, "ram_bytes": 0, "reclaim_low": 0.5,
                "reclaim_high": 0.9}
    store = make_store(**settings)
    for tokens in LISTS[:80]:
        put(store, tokens)
    killed(store)
    reopened = make_store(**settings)
    assert reopened.recovery().state == "running"
    new = [put(reopened, [7000 + i] * 21) for i in range(40)]  # past the high watermark
    wait = threading.Event()
    wait.wait(0.5)  # the reclaimer's thread evicts while nothing is checked yet
    deleted = reopened.delete(key_of(LISTS[79]))[0]
    assert reopened.stats()["counters"]["evictions_disk"] > 0
    held_recovery.set()
    recovered(reopened)
    records = {r.key for r in assert_index_and_files_agree(reopened)}
    assert {r.key for r in new} <= records, "a save made during the check is gone"
    assert deleted.key not in records
    counters = reopened.stats()["counters"]
    assert counters["reconcile_removed"] == counters["reconcile_added"] == 0


def test_a_save_during_the_check_is_not_lost_to_a_row_whose_blob_is_gone(
        make_store: Callable[..., Store], held_recovery: threading.Event) -> None:
    """A removal cut short by the kill leaves rows without their blobs. A save of such an
    entry's tokens before the check reaches it is a new save, not "already present" (the
    check would then drop the row and the save with it), and no piece is built on such a
    parent (it would go with it)."""
    store = make_store()
    saved = [put(store, tokens) for tokens in LISTS[:3]]
    killed(store)
    for record in saved[:2]:
        store.blob_path(record.key).unlink()
    reopened = make_store()
    assert reopened.recovery().state == "running"
    again = put(reopened, LISTS[0])  # granted, not already_present
    assert again.key == saved[0].key
    piece = LISTS[1] + [4242] * 20
    with pytest.raises(NotFound, match="parent"):
        reopened.reserve(NS, raw(piece), entry_size(piece), "cold", FP, parent=saved[1].key,
                         base=len(LISTS[1]))
    held_recovery.set()
    recovered(reopened)
    assert bytes(blobfmt.decode_blob(read_all(reopened, again.key)).payload) == \
        payload_for(LISTS[0], 1000)
    records = {r.key for r in assert_index_and_files_agree(reopened)}
    assert records == {saved[0].key, saved[2].key}
    assert reopened.stats()["counters"]["reconcile_removed"] == 2


def test_a_store_closed_before_its_check_ended_checks_again_at_the_next_start(
        make_store: Callable[..., Store], held_recovery: threading.Event) -> None:
    store = make_store()
    saved = [put(store, tokens) for tokens in LISTS[:10]]
    killed(store)
    store = make_store()
    assert store.recovery().state == "running"
    store.blob_path(saved[3].key).unlink()
    store.close()  # unfinished: no clean-shutdown record is written
    held_recovery.set()
    reopened = make_store()
    assert not reopened.clean_start
    recovered(reopened)
    assert reopened.stats()["counters"]["reconcile_removed"] == 1
    assert len(assert_index_and_files_agree(reopened)) == 9


def test_a_row_found_damaged_after_a_crash_is_not_served_and_rebuilt_at_the_next_start(
        make_store: Callable[..., Store]) -> None:
    """Only something else than the daemon damages a row; the background check will not
    rebuild the eviction tables under running saves, so the entry is not served and the
    next start-up runs the full reconcile, which rebuilds it from its blob."""
    store = make_store()
    saved = [put(store, tokens) for tokens in LISTS[:10]]
    killed(store)
    env = lmdb.open(str(store.root / "index"), max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(saved[4].key, b"\xc1 not a record", db=env.open_db(b"entries", txn=txn))
    env.close()
    reopened = make_store()
    recovered(reopened)
    with pytest.raises(NotFound, match="damaged"):
        reopened.open_read(saved[4].key)
    assert bytes(blobfmt.decode_blob(read_all(reopened, saved[5].key)).payload) == \
        payload_for(LISTS[5], 1000)
    reopened.close()
    again = make_store()
    assert not again.clean_start and again.recovery().state == "none"  # the full reconcile
    assert bytes(blobfmt.decode_blob(read_all(again, saved[4].key)).payload) == \
        payload_for(LISTS[4], 1000)
    ram_settled(again)  # the read promoted it to RAM
    assert len(assert_index_and_files_agree(again)) == 10
    again.close()
    assert make_store().clean_start  # and only once
