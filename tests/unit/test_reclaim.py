"""The reclaimer (kvcache.store.reclaim) in-process, on real LMDB and real files: room made
ahead of need, between each tier's watermarks, in the eviction order, with the store lock
let go while a batch's files are removed; and a tenant at its quota reading only its own
entries to make room (kvcache.ordering's tenant tables)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from harness.payloads import payload_for

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.errors import NotFound
from kvcache.index import Index
from kvcache.store import Store, TenantQuotas, policy, reclaim
from tests.support.daemon_proc import wait_for
from tests.support.stores import (
    BLOCK,
    FP,
    LAYOUT,
    NS,
    entry_size,
    present,
    put,
    ram_settled,
    raw,
    read_all,
)

LISTS = [[i] * 20 for i in range(1, 301)]
SIZE = entry_size(LISTS[0])


def key_of(tokens: list[int], ns: bytes = NS) -> bytes:
    return keys.entry_key(ns, tokens, BLOCK).key


def disk_share(store: Store) -> float:
    return store.disk_used / store.config.disk_bytes


def test_saves_find_room_made_and_the_tier_stays_between_its_watermarks(
        make_store: Callable[..., Store]) -> None:
    """Saved at a pace the reclaimer keeps up with (here: the next save once the tier is
    back under its high watermark), no save evicts anything itself: the reclaimer's
    thread made the room, and the tier never passes its budget."""
    store = make_store(disk_bytes=100 * SIZE, ram_bytes=0, reclaim_low=0.6, reclaim_high=0.8)
    for tokens in LISTS[:250]:
        put(store, tokens)
        assert store.disk_used <= store.config.disk_bytes
        wait_for(lambda: disk_share(store) <= 0.8, "the reclaimer to make room")
    counters = store.stats()["counters"]
    assert counters["evictions_disk_inline"] == 0, counters
    assert counters["evictions_disk"] == 250 - store.index.count() > 150
    assert counters["reclaims_disk"] >= 1
    assert 0.6 * 100 * SIZE - SIZE < store.disk_used <= 0.8 * 100 * SIZE
    # What went is the least recently used: the oldest saves; the newest are all there.
    assert present(store, *LISTS[200:250]) == [True] * 50


def test_a_save_the_reclaimer_left_no_room_for_evicts_inline_and_is_counted(
        make_store: Callable[..., Store]) -> None:
    """Without a reclaimer (high watermark 100%) every save into a full tier makes its own
    room, and says so in evictions_disk_inline."""
    store = make_store(disk_bytes=20 * SIZE + SIZE // 2, ram_bytes=0)
    for tokens in LISTS[:30]:
        put(store, tokens)
    counters = store.stats()["counters"]
    assert counters["evictions_disk"] == counters["evictions_disk_inline"] == 10
    assert counters["reclaims_disk"] == 0


def test_the_reclaimer_takes_the_eviction_order_never_a_pinned_or_read_entry(
        make_store: Callable[..., Store]) -> None:
    store = make_store(disk_bytes=40 * SIZE, ram_bytes=0, reclaim_low=0.5, reclaim_high=0.99)
    records = [put(store, tokens) for tokens in LISTS[:30]]
    store.set_pinned(records[0].key, True)
    pin = store.open_read(records[1].key)  # being read
    store.release_read(store.open_read(records[2].key).pin_id)  # read: now the newest
    with store._cond:
        pending = store._pins.last_used()
        held = store._pins.busy()
    keep = held | {records[0].key}
    expected = policy.leaf_first_order(list(store.index.records()), pending, keep)
    before = {r.key for r in store.index.records()}
    evicted, dropped = store.reclaim(force=True)  # 30 of 40 held: above the low watermark
    gone = before - {r.key for r in store.index.records()}
    assert evicted == len(gone) == 10 and dropped == 0
    assert gone == {r.key for r in expected[:10]}
    assert {records[0].key, records[1].key, records[2].key}.isdisjoint(gone)
    assert store.disk_used == 20 * SIZE
    store.release_read(pin.pin_id)


def test_the_reclaimer_gives_up_nothing_when_evicting_all_would_not_free_the_disk(
        make_store: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    """Free space below the watermark by more than the tier's entries hold (another file
    filled the disk): evicting is no help, so nothing goes, tick after tick; saves are
    refused meanwhile (tests/faults/test_full_disk.py). Short by less, the reclaimer
    evicts what brings the free space back above the watermark, and no more than its low
    watermark asks."""
    store = make_store(disk_bytes=1000 * SIZE, ram_bytes=0, min_free_bytes=0,
                       reclaim_low=0.9, reclaim_high=0.95)
    for tokens in LISTS[:30]:
        put(store, tokens)
    # The file system's free space from here on: ``short`` below the watermark (0), plus
    # what evictions free.
    held = store.disk_used
    monkeypatch.setattr(store._layout, "disk_free", lambda: held - store.disk_used - short)
    short = 31 * SIZE  # more than the 30 entries hold
    for _ in range(3):
        assert store.reclaim(force=True) == (0, 0)
    assert store.index.count() == 30
    assert store.stats()["counters"]["evictions_disk"] == 0

    short = 10 * SIZE  # by ten entries: they go, and the low watermark's tenth of the rest
    evicted, _ = store.reclaim()
    assert 12 <= evicted <= 13 and store.index.count() == 30 - evicted


def test_the_reclaimer_drops_ram_copies_down_to_the_low_watermark(
        make_store: Callable[..., Store]) -> None:
    store = make_store(ram_bytes=10 * SIZE, reclaim_low=0.5, reclaim_high=0.75)
    saved = []
    for tokens in LISTS[:8]:
        saved.append(put(store, tokens).key)
        ram_settled(store)
        wait_for(lambda: store.ram_used <= 0.75 * 10 * SIZE, "the RAM tier to be reclaimed")
    counters = store.stats()["counters"]
    assert counters["reclaims_ram"] >= 1 and counters["evictions_ram_inline"] == 0
    in_ram = [store.index.get(k).in_ram for k in saved]
    assert in_ram[-1] and not in_ram[0]
    assert store.ram_used == sum(SIZE for flag in in_ram if flag) <= 0.75 * 10 * SIZE
    assert all(store.blob_path(k).exists() for k in saved)  # copies only: entries stay


def test_an_entry_being_reclaimed_is_gone_to_reads_pins_and_saves_until_its_rows_go(
        make_store: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's files are unlinked and fsynced with the store lock let go. Meanwhile its
    entries are as good as gone: a read or a pin is told NOT_FOUND, a save of the same
    tokens waits for the batch and is then saved anew (never a file the batch unlinks
    under the new one's name), and lookups, saves and reads of other entries go on."""
    store = make_store(disk_bytes=40 * SIZE, ram_bytes=0, reclaim_low=0.5, reclaim_high=0.99)
    for tokens in LISTS[:30]:
        put(store, tokens)
    oldest = key_of(LISTS[0])
    in_fsync, go_on = threading.Event(), threading.Event()
    real_sync = reclaim.sync_dirs

    def slow_sync(dirs: object) -> None:
        in_fsync.set()
        assert go_on.wait(30)
        real_sync(dirs)  # type: ignore[arg-type]

    monkeypatch.setattr(reclaim, "sync_dirs", slow_sync)
    worker = threading.Thread(target=store.reclaim, kwargs={"force": True})
    worker.start()
    assert in_fsync.wait(30)
    with pytest.raises(NotFound):
        store.open_read(oldest)
    with pytest.raises(NotFound):
        store.set_pinned(oldest, True)
    assert store.lookup(NS, raw(LISTS[0]))[0] is not None  # the row is still there
    put(store, LISTS[200])  # other saves and reads go on
    assert bytes(blobfmt.decode_blob(read_all(store, key_of(LISTS[29]))).payload) == \
        payload_for(LISTS[29], 1000)
    saved_again: list[object] = []
    again = threading.Thread(target=lambda: saved_again.append(put(store, LISTS[0])))
    again.start()
    time.sleep(0.2)
    assert not saved_again, "a save of an entry being removed did not wait for the batch"
    go_on.set()
    worker.join(30)
    again.join(30)
    assert saved_again and store.index.get(oldest) is not None
    assert bytes(blobfmt.decode_blob(read_all(store, oldest)).payload) == \
        payload_for(LISTS[0], 1000)
    records = list(store.index.records())
    assert store.disk_used == sum(r.size for r in records)
    assert {p.stem for p in store.blob_dir.glob("*/*.kvc")} == {r.key.hex() for r in records}


def test_a_tenant_at_its_quota_reads_none_of_the_other_tenants_entries(
        make_store: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    """Bob's 200 entries come first in the shared order (older); alice at her quota
    evicts her own least recently used without reading one of his: her own order is a
    range of its own in the index."""
    alice, bob = keys.tenant_id("alice"), keys.tenant_id("bob")
    ns_a, ns_b = keys.namespace(FP, LAYOUT, "alice"), keys.namespace(FP, LAYOUT, "bob")
    store = make_store(ram_bytes=0)
    store.set_tenant_quotas(TenantQuotas(disk={alice: 3 * SIZE + SIZE // 2}))
    bobs = {put(store, tokens, tenant_id=bob, ns=ns_b).key for tokens in LISTS[:200]}
    alices = [put(store, tokens, tenant_id=alice, ns=ns_a).key for tokens in LISTS[200:203]]
    read: list[bytes] = []
    real_get = Index.get

    def counted_get(self: Index, key: bytes) -> object:
        read.append(key)
        return real_get(self, key)

    monkeypatch.setattr(Index, "get", counted_get)
    put(store, LISTS[203], tenant_id=alice, ns=ns_a)
    monkeypatch.undo()
    assert store.index.get(alices[0]) is None and store.index.get(alices[1]) is not None
    assert bobs.isdisjoint(read), "a tenant at its quota read another tenant's entries"
    assert all(store.index.get(k) is not None for k in bobs)
    assert store.stats()["counters"]["evictions_quota_disk"] == 1
