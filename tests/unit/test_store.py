"""The Store in-process, with a real LMDB index and real files under tmp_path.

For behaviour that is slow or awkward to provoke over gRPC: lease and pin expiry with
short timeouts, eviction order, RAM placement, start-up reconciliation details.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
from harness.payloads import payload_for

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.errors import (
    Busy,
    Corrupt,
    DirectoryInUse,
    InvalidArgument,
    LeaseLost,
    NotFound,
    StoreFull,
    WaitTimeout,
)
from kvcache.index import ORDER_TABLES, Index
from kvcache.store import Store, StoreConfig
from kvcache.store.eviction import room_slack
from kvcache.store.ramtier import RAM_MARKER
from tests.support.daemon_proc import wait_for
from tests.support.stores import (
    BLOCK,
    FP,
    LAYOUT,
    NS,
    blob_bytes,
    entry_size,
    present,
    put,
    ram_settled,
    raw,
    read_all,
    recovered,
)

# -- publish protocol -----------------------------------------------------------------------


def test_publish_round_trip_and_duplicates(make_store: Callable[..., Store]) -> None:
    store = make_store()
    tokens = list(range(40))
    record = put(store, tokens)
    assert record.n_tokens == 40
    data = read_all(store, record.key)
    assert bytes(blobfmt.decode_blob(data).payload) == payload_for(tokens, 1000)
    again = store.reserve(NS, raw(tokens), record.size, "cold", FP)
    assert again.status == "already_present"
    assert store.stats()["counters"]["saves_duplicate_present"] == 1
    assert os.listdir(store.tmp_dir) == []


def test_a_second_writer_of_an_in_flight_key_is_told_so(make_store: Callable[..., Store]) -> None:
    store = make_store()
    tokens = list(range(20))
    data = blob_bytes(tokens, payload_for(tokens, 100))
    first = store.reserve(NS, raw(tokens), len(data), "cold", FP)
    second = store.reserve(NS, raw(tokens), len(data), "cold", FP)
    assert (first.status, second.status) == ("granted", "in_flight")
    assert second.lease_id == ""
    store.abort(first.lease_id)
    assert store.reserve(NS, raw(tokens), len(data), "cold", FP).status == "granted"


def test_lease_expiry_removes_the_temp_file_and_frees_the_key(
        make_store: Callable[..., Store]) -> None:
    store = make_store(lease_seconds=0.3)
    tokens = list(range(20))
    data = blob_bytes(tokens, payload_for(tokens, 5000))
    res = store.reserve(NS, raw(tokens), len(data), "cold", FP)  # then silence
    tmp = Path(res.local_path)
    assert tmp.parent == store.tmp_dir
    wait_for(lambda: not tmp.exists(), "the expired lease's temp file to go")
    wait_for(lambda: store.stats()["counters"].get("leases_expired") == 1, "the count")
    stats = store.stats()
    assert stats["in_flight"] == 0 and stats["reserved_bytes"] == 0
    with pytest.raises(LeaseLost):
        store.write(res.lease_id, 0, data)
    with pytest.raises(LeaseLost):
        store.commit(res.lease_id)
    assert store.index.get(res.key) is None
    assert store.reserve(NS, raw(tokens), len(data), "cold", FP).status == "granted"


def test_waiting_reader_times_out_then_sees_the_commit(make_store: Callable[..., Store]) -> None:
    store = make_store()
    tokens = list(range(20))
    data = blob_bytes(tokens, payload_for(tokens, 100))
    res = store.reserve(NS, raw(tokens), len(data), "cold", FP)
    with pytest.raises(WaitTimeout):
        store.open_read(res.key, wait_ms=50)
    store.write(res.lease_id, 0, data)
    store.commit(res.lease_id)
    pin = store.open_read(res.key, wait_ms=50)
    assert pin.size == len(data)
    store.release_read(pin.pin_id)
    with pytest.raises(NotFound):
        store.open_read(keys.entry_key(NS, [1, 2, 3], BLOCK).key, wait_ms=50)


def test_close_drops_open_reservations(make_store: Callable[..., Store]) -> None:
    store = make_store()
    tokens = list(range(20))
    res = store.reserve(NS, raw(tokens), 500, "cold", FP)
    store.close()
    assert not Path(res.local_path).exists()


@pytest.mark.parametrize("tokens,reason,size,match", [
    ([], "cold", 500, "empty token list"),
    ([1, 2], "sometime", 500, "unknown save reason"),
    ([1, 2], "cold", 10, "too small"),
])
def test_reserve_refuses_bad_requests(make_store: Callable[..., Store], tokens: list[int],
                                      reason: str, size: int, match: str) -> None:
    store = make_store()
    with pytest.raises(InvalidArgument, match=match):
        store.reserve(NS, raw(tokens), size, reason, FP)
    assert os.listdir(store.tmp_dir) == []


def test_token_limit(make_store: Callable[..., Store]) -> None:
    store = make_store(max_tokens=100)
    with pytest.raises(InvalidArgument, match="exceed the limit"):
        store.lookup(NS, raw(list(range(101))))
    with pytest.raises(InvalidArgument, match="exceed the limit"):
        store.reserve(NS, raw(list(range(101))), 1000, "cold", FP)
    assert store.lookup(NS, raw(list(range(100))))[0] is None


# -- lookup ---------------------------------------------------------------------------------


def test_longest_prefix_over_aligned_and_unaligned_entries(
        make_store: Callable[..., Store]) -> None:
    store = make_store()
    prompt = [random.Random(7).randrange(50_000) for _ in range(100)]
    lengths = [3, 16, 20, 32, 47, 48, 64, 70]
    for n in lengths:
        put(store, prompt[:n], size=50)
    for q in range(1, 101):
        record, probes = store.lookup(NS, raw(prompt[:q]))
        expected = max((n for n in lengths if n <= q), default=None)
        got = record.n_tokens if record else None
        assert got == expected, f"query of {q} tokens matched {got}, expected {expected}"
        assert probes <= q // BLOCK + 1
        if record:
            assert record.key == keys.entry_key(NS, prompt[:expected], BLOCK).key
    # A prompt that diverges inside the tail of an entry falls back to a shorter one.
    diverging = prompt[:45] + [999_999, *prompt[46:]]
    assert store.lookup(NS, raw(diverging))[0].n_tokens == 32
    # max_tokens caps the answer.
    assert store.lookup(NS, raw(prompt), max_tokens=40)[0].n_tokens == 32
    # Another namespace sees nothing.
    other = keys.namespace(FP, LAYOUT, "tenant-b")
    assert store.lookup(other, raw(prompt))[0] is None


def test_longest_prefix_with_more_entries_under_one_block_than_it_scans(
        make_store: Callable[..., Store]) -> None:
    """Past SCAN_LIMIT rows under one anchor the index probes candidate keys instead of
    reading every row; the answers must not change."""
    from kvcache.index import SCAN_LIMIT

    block = 64
    assert block - 1 > SCAN_LIMIT
    store = make_store(block_size=block)
    rng = random.Random(11)
    prompt = [rng.randrange(50_000) for _ in range(2 * block - 1)]

    def put_tokens(tokens: list[int]) -> None:
        data = blob_bytes(tokens, payload_for(tokens, 20))
        res = store.reserve(NS, raw(tokens), len(data), "cold", FP)
        store.write(res.lease_id, 0, data)
        store.commit(res.lease_id)

    # Under the namespace anchor: many short entries that diverge at once, and one that
    # is a prefix of the prompt. Under the first block's anchor: every longer prefix.
    for i in range(SCAN_LIMIT + 5):
        put_tokens([900_000 + i, *prompt[1:5]])
    put_tokens(prompt[:10])
    for n in range(block + 1, 2 * block):
        put_tokens(prompt[:n])
    for q in (block + 1, block + 5, 2 * block - 1):
        record, _ = store.lookup(NS, raw(prompt[:q]))
        assert record is not None and record.n_tokens == q
    record, _ = store.lookup(NS, raw(prompt), max_tokens=block + 3)
    assert record is not None and record.n_tokens == block + 3
    # Shorter than one block: found among the many rows of the namespace anchor.
    for q in (10, 12, block - 1):
        record, _ = store.lookup(NS, raw(prompt[:q]))
        assert record is not None and record.n_tokens == 10, q
    assert store.lookup(NS, raw(prompt[:9]))[0] is None
    assert store.lookup(NS, raw([1, 2, 3]))[0] is None


def lcp(store: Store, tokens: list[int], max_tokens: int = 0) -> tuple[int | None, int]:
    """(length of the entry found, tokens it shares with the query)."""
    record, shared, _ = store.lookup_common_prefix(NS, raw(tokens), max_tokens)
    return (record.n_tokens if record else None), shared


def test_longest_common_prefix_finds_longer_and_diverging_entries(
        make_store: Callable[..., Store]) -> None:
    store = make_store()
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(120)]
    put(store, prompt[:100], size=50)
    put(store, prompt[:20], size=50)
    # Shorter than the entry, inside a block and at a block's end: the longer entry serves.
    assert lcp(store, prompt[:37]) == (100, 37)
    assert lcp(store, prompt[:48]) == (100, 48)
    # Diverging at token 70 (inside the 5th block): 70 shared, not the block before.
    diverging = prompt[:70] + [999_999] + prompt[71:]
    assert lcp(store, diverging) == (100, 70)
    assert store.lookup(NS, raw(diverging))[0].n_tokens == 20  # whole prefixes only
    # Longer than every entry: the longest whole prefix, as before.
    assert lcp(store, prompt) == (100, 100)
    # Diverging at once, or inside the first block: the entry sharing the most.
    assert lcp(store, [1, 2, 3]) == (None, 0)
    assert lcp(store, prompt[:5] + [7, 7, 7]) == (20, 5)  # a tie: the shorter entry
    assert lcp(store, prompt, max_tokens=60) == (100, 60)
    other = keys.namespace(FP, LAYOUT, "tenant-b")
    assert store.lookup_common_prefix(other, raw(prompt))[0] is None
    # Deleted: nothing of it is found any more.
    store.delete(keys.entry_key(NS, prompt[:100], BLOCK).key)
    assert lcp(store, prompt[:37]) == (20, 20)
    with store.index.env.begin() as txn:
        assert txn.stat(store.index._passes)["entries"] == 1  # the 20-token entry's


def test_longest_common_prefix_probes_at_most_log_blocks_plus_one(
        make_store: Callable[..., Store]) -> None:
    store = make_store()
    prompt = list(range(1000, 1000 + 16 * 64))
    put(store, prompt[: 16 * 40 + 3], size=50)
    record, shared, probes = store.lookup_common_prefix(NS, raw(prompt))
    assert (record.n_tokens, shared) == (16 * 40 + 3, 16 * 40 + 3)
    assert probes <= 8  # binary search over 65 block hashes


def test_longest_common_prefix_with_more_entries_under_one_block_than_it_scans(
        make_store: Callable[..., Store]) -> None:
    """Rows under one block hash past SCAN_LIMIT: entries that end within the next block
    never crowd out one that goes through it, and an exact prefix is always found."""
    from kvcache.index import SCAN_LIMIT

    store = make_store()
    rng = random.Random(5)
    system = [rng.randrange(50_000) for _ in range(BLOCK)]
    # More than SCAN_LIMIT short entries ending within block 2, and one long entry.
    for i in range(SCAN_LIMIT + 8):
        put(store, system + [800_000 + i], size=20)
    long = system + [rng.randrange(50_000) for _ in range(48)]
    put(store, long, size=20)
    assert lcp(store, long[:24] + [7]) == (64, 24)
    # More than SCAN_LIMIT entries going through block 2 as well: the query continues
    # one the scan may not reach, and still gets at least the shared block; an entry
    # that is an exact prefix of the query is found wherever it sits.
    for i in range(SCAN_LIMIT + 8):
        put(store, system + [700_000 + i] * 20, size=20)
    last = system + [700_000 + SCAN_LIMIT + 7] * 20
    found, shared = lcp(store, last[:30])
    assert found is not None and BLOCK <= shared <= 30
    exact = system + [600_000] * 9
    put(store, exact, size=20)
    assert lcp(store, exact + [7]) == (25, 25)


def test_an_entry_without_passes_rows_gets_them_at_start_up_and_keeps_its_row(
        make_store: Callable[..., Store]) -> None:
    """An index of the previous schema, or a start-up killed while adding the rows."""
    store = make_store()
    prompt = list(range(500, 600))
    record = put(store, prompt[:90])
    store.set_pinned(record.key, True)
    ram_settled(store)
    assert store.index.get(record.key).in_ram
    with store.index.env.begin(write=True) as txn:  # what schema 1 wrote: no passes
        txn.drop(store.index._passes, delete=False)
        txn.drop(store.index._entry_passes, delete=False)
    assert lcp(store, prompt[:50]) == (None, 0)
    store.close()
    index = Index(store.root / "index")  # an older version records no clean shutdown
    index.mark_open()
    index.close()
    os.unlink(store.ram_path(record.key))  # as after a reboot: the RAM copy is gone
    reopened = make_store()
    recovered(reopened)  # no clean-shutdown record: checked in the background
    assert lcp(reopened, prompt[:50]) == (90, 50)
    row = reopened.index.get(record.key)
    assert row.pinned and not row.in_ram  # the RAM fix made at start-up stands
    assert reopened.stats()["ram_entries"] == 0


# -- space ----------------------------------------------------------------------------------

A, B, C, D, E = ([i * 1000 + j for j in range(20)] for i in range(1, 6))


def test_disk_eviction_is_least_recently_used_first(make_store: Callable[..., Store]) -> None:
    size = entry_size(A)
    store = make_store(disk_bytes=3 * size + size // 2, ram_bytes=0)
    for tokens in (A, B, C):
        put(store, tokens)
    # Read A: it becomes the most recently used, so B is now the oldest.
    pin = store.open_read(keys.entry_key(NS, A, BLOCK).key)
    store.release_read(pin.pin_id)
    put(store, D)
    assert present(store, A, B, C, D) == [True, False, True, True]
    put(store, E)
    assert present(store, A, B, C, D, E) == [True, False, False, True, True]
    assert store.stats()["counters"]["evictions_disk"] == 2
    assert store.disk_used == 3 * size
    assert sorted(p.name for p in store.blob_dir.rglob("*.kvc")) == sorted(
        f"{keys.entry_key(NS, t, BLOCK).key.hex()}.kvc" for t in (A, D, E))


def test_eviction_never_takes_pinned_or_in_use_entries(make_store: Callable[..., Store]) -> None:
    size = entry_size(A)
    store = make_store(disk_bytes=3 * size + size // 2, ram_bytes=0)
    for tokens in (A, B, C):
        put(store, tokens)
    key_a, key_b = (keys.entry_key(NS, t, BLOCK).key for t in (A, B))
    store.set_pinned(key_a, True)
    pin_b = store.open_read(key_b)  # held: B is being read
    put(store, D)  # A and B are older than C, but protected
    assert present(store, A, B, C, D) == [True, True, False, True]
    put(store, E)
    assert present(store, A, B, C, D, E) == [True, True, False, False, True]
    # Protect the last one too: nothing can go, the save is refused before any write.
    store.set_pinned(keys.entry_key(NS, E, BLOCK).key, True)
    more = [9] * 20
    with pytest.raises(StoreFull, match="pinned or being read"):
        store.reserve(NS, raw(more), size, "cold", FP)
    assert os.listdir(store.tmp_dir) == []
    assert store.stats()["counters"]["saves_refused_full"] == 1
    with pytest.raises(Busy):
        store.delete(key_a)
    with pytest.raises(Busy):
        store.delete(key_b)
    store.release_read(pin_b.pin_id)
    put(store, more)  # B is readable-and-unpinned again: it goes
    assert present(store, A, B, E, more) == [True, False, True, True]


def test_a_save_larger_than_the_disk_budget_is_refused_up_front(
        make_store: Callable[..., Store]) -> None:
    store = make_store(disk_bytes=10_000)
    put(store, A)
    used = store.disk_used
    with pytest.raises(StoreFull, match="exceeds the disk budget"):
        store.reserve(NS, raw(B), 10_001, "cold", FP)
    assert os.listdir(store.tmp_dir) == []
    assert store.disk_used == used and present(store, A) == [True]


def test_a_save_that_cannot_fit_evicts_nothing(make_store: Callable[..., Store]) -> None:
    """When even evicting every evictable entry would not make room (the rest is pinned),
    the save is refused up front instead of emptying the cache for nothing."""
    size = entry_size(A)
    store = make_store(disk_bytes=2 * size + size // 2, ram_bytes=0)
    put(store, A)
    put(store, B)
    store.set_pinned(keys.entry_key(NS, A, BLOCK).key, True)
    with pytest.raises(StoreFull, match="pinned or being read"):
        store.reserve(NS, raw(C), 2 * size, "cold", FP)  # A alone leaves only 1.5 sizes
    assert present(store, A, B) == [True, True], "B was evicted for a save that was refused"
    assert store.stats()["counters"].get("evictions_disk", 0) == 0
    put(store, C)  # a save that fits once B goes still evicts B
    assert present(store, A, B, C) == [True, False, True]


def test_ram_copies_are_dropped_lru_and_the_entry_stays_on_disk(
        make_store: Callable[..., Store]) -> None:
    size = entry_size(A)
    store = make_store(ram_bytes=2 * size + size // 2)
    keys_ = {}
    for name, tokens in (("A", A), ("B", B), ("C", C)):
        keys_[name] = put(store, tokens).key
        ram_settled(store)

    def in_ram() -> dict[str, bool]:
        return {n: store.index.get(k).in_ram for n, k in keys_.items()}

    assert in_ram() == {"A": False, "B": True, "C": True}
    assert not store.ram_path(keys_["A"]).exists()
    assert store.blob_path(keys_["A"]).exists()
    assert store.ram_used == 2 * size
    assert store.stats()["counters"]["evictions_ram"] == 1
    # A is still served, from disk, and the disk hit promotes it (dropping B, now the LRU).
    pin, chunks = store.iter_read(keys_["A"])
    assert pin.tier == "disk"
    assert bytes(blobfmt.decode_blob(b"".join(bytes(c) for c in chunks)).payload) == \
        payload_for(A, 1000)
    ram_settled(store)
    assert in_ram() == {"A": True, "B": False, "C": True}
    pin = store.open_read(keys_["A"])
    assert pin.tier == "ram" and pin.path == store.ram_path(keys_["A"])
    store.release_read(pin.pin_id)


def test_read_pins_expire(make_store: Callable[..., Store]) -> None:
    store = make_store(pin_seconds=1.5)
    key = put(store, A).key
    pin = store.open_read(key)
    with pytest.raises(Busy, match="being read"):
        store.delete(key)
    wait_for(lambda: store.stats()["read_pins"] == 0, "the read pin to expire")
    assert store.stats()["counters"]["read_pins_expired"] == 1
    with pytest.raises(LeaseLost):
        store.release_read(pin.pin_id)
    store.delete(key)
    assert present(store, A) == [False]



def test_a_delete_waits_for_the_daemon_s_own_work_bounded(
        make_store: Callable[..., Store]) -> None:
    """A piece being saved on an entry holds it, as the entry's RAM copy being made does:
    a delete waits for that work (bounded), where a client's read is refused at once."""
    store = make_store(delete_wait_seconds=1.0, ram_bytes=0)
    root = put(store, A).key
    piece = A + [7, 7, 7]

    def reserve_piece() -> str:
        res = store.reserve(NS, raw(piece), entry_size(piece), "finish", FP, parent=root,
                            base=len(A))
        assert res.status == "granted", res
        return res.lease_id

    # Work that never ends within the wait: refused, after waiting, nothing removed.
    lease = reserve_piece()
    started = time.monotonic()
    with pytest.raises(Busy, match="by the daemon.*try again"):
        store.delete(root)
    assert time.monotonic() - started >= 1.0
    assert present(store, A) == [True]
    store.abort(lease)
    # Work that ends while the delete waits: the delete goes through once it has.
    lease = reserve_piece()
    ended = threading.Timer(0.2, store.abort, args=(lease,))
    ended.start()
    started = time.monotonic()
    assert [r.key for r in store.delete(root)] == [root]
    assert 0.15 <= time.monotonic() - started < 1.0
    ended.join()
    assert present(store, A) == [False]
    # A client's read is no work of the daemon's: refused at once.
    key = put(store, B).key
    pin = store.open_read(key)
    started = time.monotonic()
    with pytest.raises(Busy, match="being read$"):
        store.delete(key)
    assert time.monotonic() - started < 0.5
    store.release_read(pin.pin_id)


def test_prune_targets_and_protection(make_store: Callable[..., Store]) -> None:
    store = make_store(ram_bytes=0)
    records = [put(store, t, reason="finish" if t in (C, D) else "cold") for t in (A, B, C, D)]
    key_a, key_c = (keys.entry_key(NS, t, BLOCK).key for t in (A, C))
    store.set_pinned(key_c, True)
    dry = store.prune(lambda r: r.reason == "finish", dry_run=True)
    assert [r.n_tokens for r in dry.removed] == [20] and dry.skipped_pinned == 1
    assert present(store, A, B, C, D) == [True] * 4
    result = store.prune(lambda r: r.reason == "finish")
    assert present(store, A, B, C, D) == [True, True, True, False]
    assert result.bytes_freed == records[3].size
    # A byte target removes LRU entries (A first), never the pinned one.
    pin = store.open_read(key_a)
    result = store.prune(max_disk_bytes=1)
    assert present(store, A, B, C) == [True, False, True]
    assert (result.skipped_pinned, result.skipped_in_use) == (1, 1)
    store.release_read(pin.pin_id)


# -- persistence and reconciliation ---------------------------------------------------------


def test_usage_is_written_to_the_index(make_store: Callable[..., Store],
                                       tmp_path: Path) -> None:
    store = make_store()
    key = put(store, A).key
    for _ in range(3):
        store.release_read(store.open_read(key).pin_id)
    assert store.list().records[0].hits == 3  # pending usage is already visible
    store.close()
    reopened = make_store()
    record = reopened.index.get(key)
    assert record.hits == 3 and record.last_used >= record.created


def test_start_up_sweeps_orphan_temp_files(make_store: Callable[..., Store],
                                           tmp_path: Path) -> None:
    store = make_store()
    key = put(store, A).key
    store.close()
    # Temp names are a lease id or key in hex (16 bytes): only those are kvcache's.
    (store.tmp_dir / f"{'de' * 16}.part").write_bytes(b"half a blob")
    (store.blob_path(key).parent / f"{'ca' * 16}.part").write_bytes(b"x")
    reopened = make_store()
    assert os.listdir(reopened.tmp_dir) == []
    assert [p.name for p in reopened.blob_dir.rglob("*.part")] == []
    assert reopened.stats()["counters"]["orphans_swept"] == 2
    assert present(reopened, A) == [True]


def test_a_ram_copy_cut_short_by_a_crash_is_not_taken_for_the_copy(
        make_store: Callable[..., Store]) -> None:
    """A crash between copying a blob into the RAM tier and renaming it into place leaves
    <key>.part there. It must be swept, not treated as the entry's RAM copy (which would
    send readers to a file that does not exist and then quarantine the good entry)."""
    store = make_store()
    key = put(store, A).key
    ram_settled(store)
    assert store.index.get(key).in_ram
    store.close()
    os.rename(store.ram_path(key), store.ram_dir / f"{key.hex()}.part")
    reopened = make_store()
    assert [p.name for p in reopened.ram_dir.iterdir()] == [RAM_MARKER]
    assert reopened.index.get(key).in_ram is False
    assert reopened.ram_used == 0
    pin = reopened.open_read(key)
    assert pin.path.exists(), f"the daemon sends readers to a missing file: {pin.path}"
    assert reopened.release_read(pin.pin_id, corrupt=True) is False  # it checks out fine
    assert present(reopened, A) == [True]


def test_a_ram_copy_whose_blob_went_meanwhile_leaves_nothing_in_the_ram_tier(
        make_store: Callable[..., Store]) -> None:
    """A RAM placement whose disk blob is gone by the time it copies (evicted or deleted
    meanwhile) fails: its temporary copy goes with it. A <key>.part left behind made the
    RAM tier look busy for ever (tests/faults/test_load.py waits for it to settle)."""
    store = make_store()
    gate = threading.Event()
    store._ram_worker.submit(gate.wait, 30)  # the placement of A waits behind this
    key = put(store, A).key
    store.blob_path(key).unlink()
    gate.set()
    ram_settled(store)
    assert [p.name for p in store.ram_dir.iterdir()] == [RAM_MARKER]
    assert store.ram_used == 0 and not store.index.get(key).in_ram


def test_a_new_block_size_rekeys_the_entries(make_store: Callable[..., Store]) -> None:
    store = make_store()
    prompt = list(range(100, 200))
    for n in (5, 20, 32, 47):
        put(store, prompt[:n])
    store.close()
    reopened = make_store(block_size=8)
    assert reopened.stats()["counters"].get("quarantined_files", 0) == 0
    assert os.listdir(reopened.quarantine_dir) == []
    assert reopened.index.count() == 4
    for n in (5, 20, 32, 47):
        record, _ = reopened.lookup(NS, raw(prompt[: n + 2]))
        assert record is not None and record.n_tokens == n, f"entry of {n} tokens lost"
        assert record.key == keys.entry_key(NS, prompt[:n], 8).key
        data = read_all(reopened, record.key)
        assert bytes(blobfmt.decode_blob(data).payload) == payload_for(prompt[:n], 1000)


def test_index_rows_and_files_are_reconciled(make_store: Callable[..., Store]) -> None:
    store = make_store()
    gone = put(store, A)
    kept = put(store, B)
    truncated = put(store, C)
    store.close()
    store.blob_path(gone.key).unlink()
    with open(store.blob_path(truncated.key), "r+b") as f:
        f.truncate(truncated.size - 10)
    # A valid blob with no index row (a crash between rename and index commit).
    orphan = keys.entry_key(NS, D, BLOCK)
    path = store.blob_path(orphan.key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(blob_bytes(D, payload_for(D, 1000)))
    reopened = make_store()
    counters = reopened.stats()["counters"]
    assert counters["reconcile_removed"] == 2, counters
    assert counters["reconcile_added"] == 1, counters
    assert present(reopened, A, B, C, D) == [False, True, False, True]
    assert reopened.disk_used == kept.size + len(path.read_bytes())
    assert len(os.listdir(reopened.quarantine_dir)) == 1  # the truncated file, kept


def blob_reads_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every per-entry step of a full reconcile fail: reading every index row,
    listing the blob folders, reading a blob's header."""
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a per-entry read at start-up")

    monkeypatch.setattr(Index, "audit", refused)
    monkeypatch.setattr(Index, "records", refused)
    monkeypatch.setattr(blobfmt, "read_header_and_meta", refused)
    monkeypatch.setattr("kvcache.store.reconcile.Reconcile._blob_files", refused)


def test_a_clean_restart_reads_no_entry_and_trusts_the_recorded_tally(
        make_store: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    size = entry_size(A)
    store = make_store(ram_bytes=2 * size + size // 2)
    for tokens in (A, B, C):
        put(store, tokens)
        ram_settled(store)
    counts = {k: store.stats()[k] for k in ("disk_entries", "disk_used", "ram_entries",
                                            "ram_used")}
    assert counts["ram_entries"] == 2
    store.close()
    os.unlink(store.ram_path(keys.entry_key(NS, C, BLOCK).key))  # a reboot took one copy
    with monkeypatch.context() as m:
        blob_reads_refused(m)
        reopened = make_store(ram_bytes=2 * size + size // 2)
    assert reopened.clean_start
    assert {k: reopened.stats()[k] for k in counts} == {
        **counts, "ram_entries": 1, "ram_used": counts["ram_used"] - size}
    assert [reopened.index.get(keys.entry_key(NS, t, BLOCK).key).in_ram for t in (B, C)] == \
        [True, False]
    assert reopened.lookup(NS, raw(C))[0].n_tokens == len(C)
    assert bytes(blobfmt.decode_blob(read_all(reopened, keys.entry_key(NS, A, BLOCK).key))
                 .payload) == payload_for(A, 1000)


@pytest.mark.parametrize("change", ["blob added", "blob removed", "index written"])
def test_a_change_after_a_clean_shutdown_means_the_full_reconcile(
        make_store: Callable[..., Store], change: str) -> None:
    store = make_store()
    a, b = put(store, A), put(store, B)
    store.close()
    if change == "blob added":  # a valid blob with no index row, dropped in by hand
        orphan = keys.entry_key(NS, D, BLOCK)
        path = store.blob_path(orphan.key)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(blob_bytes(D, payload_for(D, 1000)))
    elif change == "blob removed":
        store.blob_path(a.key).unlink()
    else:  # another process (or another version) wrote to the index
        index = Index(store.root / "index")
        index.update(b.key, pinned=True)
        index.close()
    reopened = make_store()
    assert not reopened.clean_start
    expected = {"blob added": [True, True, True], "blob removed": [False, True, False],
                "index written": [True, True, False]}[change]
    assert present(reopened, A, B, D) == expected
    records = list(reopened.index.records())
    assert reopened.disk_used == sum(r.size for r in records)
    assert reopened.index.get(b.key).pinned == (change == "index written")


def test_a_blob_damaged_in_place_after_a_clean_shutdown_is_found_on_read(
        make_store: Callable[..., Store]) -> None:
    """In place (same name, same folder) a change leaves the folders as they were: the
    clean start trusts the index, and the blob's checksums find the damage on its first
    read, before any of its bytes is used."""
    store = make_store(ram_bytes=0)
    a, b = put(store, A), put(store, B)
    store.close()
    with open(store.blob_path(a.key), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with open(store.blob_path(b.key), "r+b") as f:
        f.truncate(b.size - 10)
    reopened = make_store(ram_bytes=0)
    assert reopened.clean_start
    for key in (a.key, b.key):
        with pytest.raises(Corrupt):
            read_all(reopened, key)
    assert present(reopened, A, B) == [False, False]
    assert reopened.stats()["counters"]["corrupt_blobs"] == 2
    assert reopened.disk_used == 0


def test_the_eviction_order_of_an_older_index_is_built_at_start_up(
        make_store: Callable[..., Store]) -> None:
    """An index written before the order was kept in it (no ordering tables, no
    clean-shutdown record): the tables are built from its rows at start-up, and evict in
    the policy's order."""
    size = entry_size(A)
    store = make_store(disk_bytes=3 * size + size // 2, ram_bytes=0)
    for tokens in (A, B, C):
        put(store, tokens)
    store.release_read(store.open_read(keys.entry_key(NS, A, BLOCK).key).pin_id)
    store.close()
    env = lmdb.open(str(store.root / "index"), max_dbs=20)
    with env.begin(write=True) as txn:
        for name in ORDER_TABLES:
            txn.drop(env.open_db(name.encode(), txn=txn), delete=True)
        meta = env.open_db(b"meta", txn=txn)
        for row in [k for k, _ in txn.cursor(db=meta) if k.startswith(b"order.")]:
            txn.delete(row, db=meta)
        txn.delete(b"clean_shutdown", db=meta)
    env.close()
    reopened = make_store(disk_bytes=3 * size + size // 2, ram_bytes=0)
    assert not reopened.clean_start and reopened.index.order.in_sync
    put(reopened, D)  # B is the least recently used (A was read after C was saved)
    assert present(reopened, A, B, C, D) == [True, False, True, True]


def test_making_room_reads_only_what_it_evicts(make_store: Callable[..., Store],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A full tier gives up its next entry (and RAM copy) from the order kept in the
    index: no save reads every entry to choose (a scan made a full cache save at a few
    per second)."""
    size = entry_size(A)
    lists = [[i] * 20 for i in range(1, 41)]
    store = make_store(disk_bytes=30 * size + size // 2, ram_bytes=10 * size + size // 2)
    for tokens in lists[:30]:
        put(store, tokens)
        ram_settled(store)
    monkeypatch.setattr(Index, "records", lambda self: (_ for _ in ()).throw(
        AssertionError("every entry read to make room")))
    for tokens in lists[30:]:
        put(store, tokens)
        ram_settled(store)
    assert present(store, *lists) == [False] * 10 + [True] * 30
    in_ram = [store.index.get(keys.entry_key(NS, t, BLOCK).key).in_ram for t in lists[10:]]
    assert in_ram == [False] * 20 + [True] * 10
    counters = store.stats()["counters"]
    assert (counters["evictions_disk"], counters["evictions_ram"]) == (10, 30)


def test_a_full_tier_evicts_a_batch_that_the_next_saves_share(
        make_store: Callable[..., Store]) -> None:
    """Making room gives up a little more than one save needs (room_slack: about eight
    entries' worth, at most 1/64 of the budget), in one index transaction, so the next
    saves find room without evicting: the removal's fsyncs are shared."""
    size = entry_size(A)
    lists = [[i] * 20 for i in range(1, 136)]
    store = make_store(disk_bytes=130 * size + size // 2, ram_bytes=0)
    assert room_slack(size, store.config.disk_bytes) == (130 * size + size // 2) // 64
    for tokens in lists[:130]:
        put(store, tokens)
    evictions = []
    for tokens in lists[130:]:
        put(store, tokens)
        evictions.append(store.stats()["counters"]["evictions_disk"])
    # 0.5 of a size free, 1 + 2.04 wanted: three go; the next two saves fit in what is left.
    assert evictions == [3, 3, 3, 6, 6]
    assert present(store, *lists) == [False] * 6 + [True] * 129


def test_a_listing_pages_in_order_with_reads_not_yet_in_the_index(
        make_store: Callable[..., Store]) -> None:
    store = make_store(ram_bytes=0)
    saved = [put(store, [i] * 10 + list(range(i, i + 5)), size=100 + 37 * i)
             for i in range(1, 24)]
    for record in (saved[3], saved[9]):  # read now: first, unflushed
        store.release_read(store.open_read(record.key).pin_id)
    whole = store.list()
    assert [r.key for r in whole.records[:2]] == [saved[9].key, saved[3].key]
    assert [r.key for r in whole.records[2:]] == [r.key for r in saved[::-1]
                                                  if r not in (saved[3], saved[9])]
    assert whole.records[0].hits == 1 and not whole.next_token
    for sort, order in (("used", whole.records),
                        ("size", sorted(saved, key=lambda r: (-r.size, r.key))),
                        ("age", sorted(saved, key=lambda r: (r.created, r.key)))):
        pages, token = [], b""
        while True:
            page = store.list(sort=sort, token=token, limit=5)
            pages.append([r.key for r in page.records])
            token = page.next_token
            if not token:
                break
        assert [k for p in pages for k in p] == [r.key for r in order], sort
        assert all(len(p) == 5 for p in pages[:-1])
    odd = store.list(lambda r: r.size % 2 == 1, limit=3)
    assert [r.key for r in odd.records] == [r.key for r in whole.records
                                            if r.size % 2 == 1][:3]
    prefix = saved[5].key.hex()[:3]
    assert [r.key for r in store.list(key_prefix=prefix.upper()).records] == sorted(
        (r.key for r in saved if r.key.hex().startswith(prefix)),
        key=lambda k: [r.key for r in whole.records].index(k))
    assert store.list(key_prefix="zz").records == []
    with pytest.raises(InvalidArgument, match="another listing"):
        store.list(sort="size", token=whole.next_token or store.list(limit=1).next_token)
    with pytest.raises(InvalidArgument, match="malformed"):
        store.list(token=b"\xc1garbage")
    with pytest.raises(InvalidArgument, match="unknown sort"):
        store.list(sort="colour")


def test_config_is_a_frozen_dataclass() -> None:
    config = StoreConfig(root=Path("/nonexistent"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 3  # type: ignore[misc]


def test_one_store_per_data_directory(make_store: Callable[..., Store], tmp_path: Path) -> None:
    """A second daemon on the same directory would sweep the first one's temp files."""
    first = make_store()
    with pytest.raises(DirectoryInUse, match="another kvcache daemon"):
        Store(StoreConfig(root=first.root, ram_dir=first.config.ram_dir, min_free_bytes=0))
    first.close()
    again = Store(StoreConfig(root=first.root, ram_dir=first.config.ram_dir, min_free_bytes=0))
    again.close()


def test_a_store_that_fails_to_start_holds_nothing(tmp_path: Path) -> None:
    config = StoreConfig(root=tmp_path / "data", ram_dir=tmp_path / "ram", min_free_bytes=0)
    Store(config).close()
    index = tmp_path / "data" / "index"
    moved = index.rename(tmp_path / "index-aside")
    index.write_text("not an LMDB directory")
    with pytest.raises(Exception) as failed:  # LMDB's own error
        Store(config)
    assert not isinstance(failed.value, DirectoryInUse)
    index.unlink()
    moved.rename(index)
    # The failed attempt (its traceback still alive here) released the directory and
    # its RAM tier.
    Store(config).close()


def test_inspect_for_another_tenant_is_not_found_even_when_unreadable(
        make_store: Callable[..., Store]) -> None:
    store = make_store()
    record = put(store, list(range(40)))
    store.blob_path(record.key).write_bytes(b"garbage")  # would be DATA_LOSS for its owner
    with pytest.raises(NotFound):
        store.inspect(record.key, frozenset({keys.tenant_id("someone-else")}))
    assert store.index.get(record.key) is not None  # not quarantined by the probe


def test_tier_counts_follow_every_change(make_store: Callable[..., Store]) -> None:
    """Stats keeps entries and bytes per tier as they change, instead of reading every
    index row per call: commits, RAM placements and drops, evictions, deletes, prunes,
    quarantine and a restart must all leave them equal to what the index says."""
    size = entry_size(A)
    store = make_store(ram_bytes=2 * size + size // 2, disk_bytes=4 * size + size // 2)

    def check() -> None:
        ram_settled(store)
        records = list(store.index.records())
        s = store.stats()
        assert (s["disk_entries"], s["disk_used"]) == (len(records),
                                                       sum(r.size for r in records))
        in_ram = [r for r in records if r.in_ram]
        assert (s["ram_entries"], s["ram_used"]) == (len(in_ram), sum(r.size for r in in_ram))
        # And per tenant (what quotas hold tenants to): entries without a tenant here.
        expected = {"": (len(records), sum(r.size for r in records), len(in_ram),
                         sum(r.size for r in in_ram))} if records else {}
        assert {t: (u["disk_entries"], u["disk_bytes"], u["ram_entries"], u["ram_bytes"])
                for t, u in store.tenant_usage().items()} == expected

    lists = [[i] * 20 + list(range(100 + i, 110 + i)) for i in range(1, 8)]
    for tokens in lists[:5]:  # the fifth evicts the first from disk, RAM copies churn
        put(store, tokens)
        check()
    assert store.stats()["counters"]["evictions_disk"] == 1
    read_all(store, keys.entry_key(NS, lists[1], BLOCK).key)  # a disk hit: promoted
    check()
    store.delete(keys.entry_key(NS, lists[2], BLOCK).key)
    check()
    victim = keys.entry_key(NS, lists[3], BLOCK).key
    with open(store.blob_path(victim), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    assert store.check_entry(victim) is not None  # quarantined
    check()
    store.prune(max_ram_bytes=1)
    check()
    store.prune(lambda r: True)
    check()
    for tokens in lists[5:]:
        put(store, tokens)
    check()
    store.close()
    store = make_store(ram_bytes=2 * size + size // 2)  # start-up counts from the files
    check()


def test_a_copy_that_cannot_fit_in_ram_drops_no_other_copy(
        make_store: Callable[..., Store]) -> None:
    """With A pinned and B evictable in RAM, a larger C fits only if A went too: so C is not
    placed, and B keeps its copy (dropping it first emptied the RAM tier for nothing)."""
    small = entry_size(A)
    big_c = [3000 + j for j in range(20)]
    store = make_store(ram_bytes=2 * small + small // 2)
    key_a, key_b = put(store, A).key, put(store, B).key
    ram_settled(store)
    store.set_pinned(key_a, True)
    key_c = put(store, big_c, size=2 * small).key  # larger than the room B's copy frees
    ram_settled(store)
    assert [store.index.get(k).in_ram for k in (key_a, key_b, key_c)] == [True, True, False]
    assert store.stats()["counters"]["evictions_ram"] == 0
    assert store.ram_used == 2 * small
