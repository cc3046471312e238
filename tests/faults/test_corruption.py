"""Corruption: every damaged blob file or index row is found before any of its bytes is
used, quarantined (a damaged index row over a good blob: repaired from the blob's header),
counted, and the request that hit it completes correctly (a shorter prefix, or cold).

Real daemon processes, real LMDB, real files, real llama.cpp on the tiny model; no mocks.

The campaign is randomized and reproducible: each run draws a seed (or takes
``KVCACHE_CORRUPTION_SEED``), prints it, and names it in every assertion message; the same
seed replays the same kinds, order, offsets, bytes and lengths.

What each kind moves in the daemon's ``Stats`` counters (the contract asserted here; all
other corruption counters stay put):

* a damaged **disk copy**, found by the read that hits it (either client path) — random
  bytes flipped in the header, the metadata or the payload; truncated at a random offset;
  extended with junk; replaced by random bytes; replaced by another entry's *valid* blob
  (other tokens, same size / same tokens in another namespace, same size / the entry's
  own shorter prefix); deleted: ``corrupt_blobs`` +1 and ``quarantined_files`` +1 (a
  deleted file: ``corrupt_blobs`` only, there is nothing to move). The entry is gone
  (List, Lookup, Read: NOT_FOUND), its file is in ``quarantine/``, and a lookup falls back
  to the saved shorter prefix.
* the same damage to the **RAM copy**: ``corrupt_blobs`` +1 and ``quarantined_files`` +1,
  but only the copy goes (to ``quarantine/``; removed where that is another file system),
  since the disk copy verified: the entry stays and is read from disk.
* a damaged disk copy **behind a good RAM copy**: reads are served from the RAM copy (the
  damaged bytes are never used); ``kvcache verify`` finds it: ``corrupt_blobs`` +1,
  ``quarantined_files`` +1, the entry is gone.
* a damaged **index row** (changed size, n_tokens, tail, namespace or reason; a garbled
  msgpack value; a missing or changed anchor row), found at start-up: ``reconcile_removed``
  +1 (the row) and ``reconcile_added`` +1 (the blob re-indexed from its checksummed
  header, keeping the row's hits and pin when they can be read). Nothing is quarantined: the
  blob is good, and the entry is served exactly as saved.
* an index row **deleted**: ``reconcile_added`` +1 (re-indexed from the blob's header).
* a wrong **in_ram flag**: no counter. Start-up sets it from the RAM directory, as after
  every reboot (a wiped memory file system makes every flag disagree: not corruption).
* a disk copy **truncated or extended while the daemon is stopped**: found at start-up by
  its size: ``reconcile_removed`` +1, ``quarantined_files`` +1, the entry is gone.
* a RAM copy **damaged while the daemon is stopped** (same size): found by the read, as
  above for a RAM copy.
* ``Inspect`` of an entry whose file was swapped for another tenant's valid blob:
  ``corrupt_blobs`` +1, ``quarantined_files`` +1, and none of that blob's tokens shown.

The runtime tests run the tiny model over a corrupted entry and compare the output with a
cold run of the same prompt (greedy), through both client paths: payload flipped on disk
(the request's longest prefix: it falls back to a shorter one; its only prefix: it goes
cold), RAM copy flipped, file truncated (reached through ``parent_key``), and the file
swapped for another model's valid state of the same tokens and size (only the key check
tells them apart; without it the request restored the wrong model's state).
"""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import lmdb
import msgpack
import pytest
from harness.payloads import payload_for

from kvcache import blob as blobfmt
from kvcache.client import CacheClient, CacheError, CorruptBlob, Identity
from kvcache.v1 import kvcache_pb2 as pb
from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, DaemonFactory, blob_file, ram_file
from tests.support.runtime_calls import TEXT_A, TEXT_B, flush
from tests.support.tiny_llama import make_tiny_model, sample_prompt

SEED = int(os.environ.get("KVCACHE_CORRUPTION_SEED") or random.SystemRandom().randrange(1 << 32))
N = 40  # tokens of a campaign entry: two full blocks and a tail of 8
PREFIX = 24  # its saved shorter prefix: what a lookup falls back to once it is gone
PAYLOAD = 6000
# Tenant ids are all 16 hex digits, so the blobs of these two identities have equal sizes.
IDENT_A = Identity("fp-corruption", {"type_k": "f16"}, tenant="tenant-a", model_name="m.gguf")
IDENT_B = replace(IDENT_A, tenant="tenant-b")
PATHS = ("fast", "stream")
CORRUPTION_COUNTERS = ("corrupt_blobs", "quarantined_files", "reconcile_removed",
                       "reconcile_added")


@pytest.fixture(autouse=True)
def print_seed() -> None:
    # Captured, so shown with any failing test's output: rerun with this seed.
    print(f"corruption campaign seed: KVCACHE_CORRUPTION_SEED={SEED}")


# -- helpers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    ident: Identity
    tokens: list[int]
    payload: bytes
    key: bytes


@dataclass(repr=False)
class Case:
    n: int
    kind: str
    tier: str  # the copy damaged: "disk" or "ram"
    path: str  # the client path whose read hits it: "fast" or "stream"
    entry: Saved | None = None
    prefix: Saved | None = None
    detail: str = ""  # exactly what was done (offsets, lengths, variant)

    def __repr__(self) -> str:  # what every assertion message starts with
        return (f"[KVCACHE_CORRUPTION_SEED={SEED}] case {self.n}: {self.kind} on the "
                f"{self.tier} copy, read via the {self.path} path ({self.detail})")


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 60_000) for _ in range(n)]


def save(c: CacheClient, ident: Identity, tokens: list[int]) -> Saved:
    # Distinct per namespace and tokens, so a wrong state can never compare equal.
    payload = payload_for(tokens, PAYLOAD, salt=c.namespace_of(ident))
    done = c.save(ident, tokens, payload, "cold")
    assert done.status == "saved", done
    return Saved(ident, tokens, payload, done.key)


def counters(c: CacheClient) -> Counter[str]:
    return Counter(dict(c.stats().counters))


def corruption_delta(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in CORRUPTION_COUNTERS
            if after[name] != before[name]}


def listed(c: CacheClient) -> dict[bytes, pb.Entry]:
    return {e.key: e for e in c.list_entries()}


def in_ram(c: CacheClient, key: bytes) -> bool:
    entry = listed(c).get(key)
    return entry is not None and pb.TIER_RAM in entry.tiers


def quarantined(d: DaemonProcess) -> set[str]:
    return set(os.listdir(d.data_dir / "quarantine"))


def assert_not_found(c: CacheClient, key: bytes, case: object) -> None:
    with pytest.raises(CacheError) as info:
        c.load(key)
    assert info.value.code == grpc.StatusCode.NOT_FOUND, f"{case}: {info.value}"


def assert_loads(c: CacheClient, saved: Saved, case: object, tier: str | None = None) -> None:
    """The entry loads, and what arrives is exactly what was saved (never a wrong state)."""
    loaded = c.load(saved.key, prefix_of=saved.tokens)
    assert bytes(loaded.payload) == saved.payload, f"{case}: WRONG STATE SERVED"
    assert list(loaded.meta.tokens) == saved.tokens, f"{case}: wrong tokens served"
    assert loaded.meta.namespace == c.namespace_of(saved.ident), f"{case}: wrong namespace served"
    if tier is not None:
        assert loaded.tier == tier, f"{case}: served from {loaded.tier}, expected {tier}"


FLIPS = ("flip_header", "flip_meta", "flip_payload")
SWAPS = ("swap_tokens", "swap_namespace", "swap_prefix")


def damage_file(path: Path, kind: str, rng: random.Random, donor: Path | None = None) -> str:
    """Damage one blob file in place; returns what was done."""
    data = path.read_bytes()
    if kind in FLIPS:
        header = blobfmt.parse_header(data)
        lo, hi = {"flip_header": (0, blobfmt.HEADER_SIZE),
                  "flip_meta": (blobfmt.HEADER_SIZE, header.payload_offset),
                  "flip_payload": (header.payload_offset, len(data))}[kind]
        spots = sorted(rng.sample(range(lo, hi), rng.randint(1, 8)))  # distinct: no undo
        buf = bytearray(data)
        for i in spots:
            buf[i] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(buf))
        return f"bytes {spots} of {len(data)} flipped"
    if kind == "truncate":
        at = rng.randrange(0, len(data))
        os.truncate(path, at)
        return f"truncated to {at} of {len(data)} bytes"
    if kind == "extend":
        junk = rng.randbytes(rng.randint(1, 4096))
        with open(path, "ab") as f:
            f.write(junk)
        return f"{len(junk)} junk bytes appended to {len(data)}"
    if kind == "random":
        size = len(data) if rng.random() < 0.5 else rng.randint(1, 2 * len(data))
        path.write_bytes(rng.randbytes(size))
        return f"replaced by {size} random bytes (was {len(data)})"
    if kind in SWAPS:
        assert donor is not None
        other = donor.read_bytes()
        path.write_bytes(other)
        return f"replaced by the valid blob {donor.name} ({len(other)} bytes, was {len(data)})"
    if kind == "delete":
        path.unlink()
        return "deleted"
    raise AssertionError(f"unknown kind {kind}")


# -- 1. the live campaign: blob files damaged under a running daemon ------------------------


FILE_KINDS = (*FLIPS, "truncate", "extend", "random", *SWAPS)
BEHIND_RAM = "disk_behind_ram"


def live_cases(rng: random.Random) -> list[Case]:
    """Every kind on both tiers (deleting a RAM copy is no damage: it is a cache), each
    through both client paths, in a seeded order."""
    combos = [(k, t) for k in FILE_KINDS for t in ("disk", "ram")]
    combos += [("delete", "disk"), (BEHIND_RAM, "disk")]
    cases = [(k, t, p) for k, t in combos for p in PATHS]
    rng.shuffle(cases)
    return [Case(i, k, t, p) for i, (k, t, p) in enumerate(cases)]


def test_campaign_damaged_blob_files(daemon_factory: DaemonFactory) -> None:
    rng = random.Random(SEED)
    cases = live_cases(rng)
    daemons = {"disk": daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0",
                                      name="disk-only"),
               "ram": daemon_factory("--block-size", str(BLOCK), name="with-ram")}
    clients = {(name, path): d.client(fast_path=path == "fast")
               for name, d in daemons.items() for path in PATHS}
    try:
        for case in cases:
            ram_tier = case.tier == "ram" or case.kind == BEHIND_RAM
            name = "ram" if ram_tier else "disk"
            run_live_case(case, daemons[name], ram_tier, clients[(name, case.path)],
                          clients[(name, "stream" if case.path == "fast" else "fast")],
                          random.Random(f"{SEED}/{case.n}"))
    finally:
        for c in clients.values():
            c.close()
    kinds = Counter(c.kind for c in cases)
    print(f"seed {SEED}: {len(cases)} blob-file corruptions of {len(kinds)} kinds, "
          f"all detected before use, 0 served")


def run_live_case(case: Case, d: DaemonProcess, ram_tier: bool, c: CacheClient,
                  other: CacheClient, rng: random.Random) -> None:
    tokens = random_tokens(rng, N)
    entry = case.entry = save(c, IDENT_A, tokens)
    prefix = case.prefix = save(c, IDENT_A, tokens[:PREFIX])
    donor = {"swap_tokens": lambda: save(c, IDENT_A, random_tokens(rng, N)),
             "swap_namespace": lambda: save(c, IDENT_B, tokens),
             "swap_prefix": lambda: prefix}.get(case.kind, lambda: None)()
    if case.kind in ("swap_tokens", "swap_namespace"):
        # Same size: only the key check can tell it from the real one.
        assert blob_file(d, donor.key).stat().st_size == blob_file(d, entry.key).stat().st_size
    if ram_tier:  # reads come from the RAM copy once it is placed
        wait_for(lambda: in_ram(c, entry.key), f"{case}: the entry's RAM copy")
    before, q_before = counters(c), quarantined(d)

    target = ram_file(d, entry.key) if case.tier == "ram" else blob_file(d, entry.key)
    kind = rng.choice((*FLIPS, "truncate", "extend", "random")) if case.kind == BEHIND_RAM \
        else case.kind
    case.detail = damage_file(target, kind, rng, donor and blob_file(d, donor.key))
    if case.kind == BEHIND_RAM:
        case.detail = f"{kind}: {case.detail}"

    if case.kind == BEHIND_RAM:
        # The read is served by the good RAM copy: no damaged byte is used, nothing is seen.
        assert_loads(c, entry, case, tier="ram")
        assert corruption_delta(before, counters(c)) == {}, case
        results = list(c.verify([entry.key]))
        assert [(r.key, r.ok) for r in results] == [(entry.key, False)], f"{case}: {results}"
    else:
        with pytest.raises(CorruptBlob):
            c.load(entry.key, prefix_of=tokens)

    delta = corruption_delta(before, counters(c))
    # A deleted file leaves nothing to move aside, so nothing counts as quarantined.
    moved_files = {} if case.kind == "delete" else {"quarantined_files": 1}
    assert delta == {"corrupt_blobs": 1, **moved_files}, f"{case}: {delta}"
    moved = quarantined(d) - q_before
    if case.kind == "delete":
        assert moved == set(), f"{case}: {moved}"
    else:
        assert len(moved) == 1 and next(iter(moved)).startswith(entry.key.hex()), \
            f"{case}: quarantine/ gained {moved}"

    if case.tier == "ram":
        # Only the bad copy went: the verified disk copy still serves the entry.
        assert not ram_file(d, entry.key).exists(), case
        assert not in_ram(c, entry.key) and entry.key in listed(c), case
        assert_loads(other, entry, case, tier="disk")
        hit = other.lookup(IDENT_A, tokens)
        assert hit is not None and (hit.key, hit.matched_tokens) == (entry.key, N), case
    else:
        assert entry.key not in listed(c), f"{case}: still listed"
        assert not blob_file(d, entry.key).exists() and not ram_file(d, entry.key).exists()
        assert_not_found(other, entry.key, case)
        assert_not_found(c, entry.key, case)
        # The request carries on from the shorter prefix saved before.
        hit = other.lookup(IDENT_A, tokens)
        assert hit is not None and (hit.key, hit.matched_tokens) == (prefix.key, PREFIX), case
        assert_loads(other, prefix, case)


def test_inspect_shows_nothing_of_a_swapped_blob(daemon_factory: DaemonFactory) -> None:
    """Inspect reads only a header and metadata, which a valid blob of another entry passes:
    it would have shown another tenant's prompt tokens under this tenant's entry."""
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    rng = random.Random(f"{SEED}/inspect")
    with d.client() as c:
        mine = save(c, IDENT_A, random_tokens(rng, N))
        theirs = save(c, IDENT_B, random_tokens(rng, N))
        assert list(c.inspect(mine.key, tenant="tenant-a").tokens) == mine.tokens
        shutil.copyfile(blob_file(d, theirs.key), blob_file(d, mine.key))
        before = counters(c)
        with pytest.raises(CorruptBlob):
            c.inspect(mine.key, tenant="tenant-a")
        assert corruption_delta(before, counters(c)) == {"corrupt_blobs": 1,
                                                         "quarantined_files": 1}
        assert mine.key not in listed(c)
        assert_loads(c, theirs, "the other tenant's entry")


# -- 2. index rows damaged, and files damaged, while the daemon is stopped ------------------


BAD_ROW = ("size", "n_tokens", "tail", "namespace", "reason", "garble", "anchor_row")
REST_KINDS = (*BAD_ROW, "delete_row", "in_ram", "truncate_at_rest", "extend_at_rest",
              "flip_ram_at_rest")
GARBLES = ("random_bytes", "cut_short", "not_a_map", "missing_field", "unknown_field",
           "wrong_type", "unsealed")


def damage_row(txn: lmdb.Transaction, dbs: dict[str, object], key: bytes, kind: str,
               rng: random.Random) -> str:
    """Change one index row the way a bad disk or a bug would (straight in LMDB: the
    daemon's own writes would make the damage consistent)."""
    entries, anchors = dbs["entries"], dbs["anchors"]
    raw = txn.get(key, db=entries)
    row = msgpack.unpackb(raw, raw=False)
    if kind == "delete_row":
        txn.delete(key, db=entries)  # its anchor row stays behind
        return "row deleted"
    if kind == "anchor_row":
        composite = row["anchor"] + key
        if rng.random() < 0.5:
            txn.delete(composite, db=anchors)
            return "anchor row deleted"
        tail = bytearray(txn.get(composite, db=anchors))
        tail[rng.randrange(len(tail))] ^= rng.randrange(1, 256)
        txn.put(composite, bytes(tail), db=anchors)
        return "anchor row's tail changed"
    if kind == "garble":
        variant = rng.choice(GARBLES)
        if variant == "random_bytes":
            new = rng.randbytes(rng.randint(0, 80))
        elif variant == "cut_short":
            new = raw[: rng.randrange(len(raw))]
        elif variant == "not_a_map":
            new = msgpack.packb(rng.choice([1, "x", [1, 2], None]))
        elif variant == "unsealed":  # a row as an older version published it: no seal
            txn.delete(key, db=dbs["seals"])
            new = raw
        else:
            if variant == "missing_field":
                del row[rng.choice(sorted(row))]
            elif variant == "unknown_field":
                row["bogus"] = 1
            else:
                row[rng.choice(["hits", "pinned", "last_used", "in_ram", "size", "tail"])] = "x"
            new = msgpack.packb(row, use_bin_type=True)
        txn.put(key, new, db=entries)
        return f"value garbled: {variant}"
    old = row[kind]
    if kind == "size":
        row[kind] = old + rng.choice((-1, 1)) * rng.randint(1, 64)
    elif kind == "n_tokens":
        row[kind] = old + rng.choice((-1, 1)) * rng.randint(1, N)
    elif kind == "tail":
        row[kind] = rng.choice((old[:-4], b"", old[:4] + bytes(4) + old[8:]))
    elif kind == "namespace":
        row[kind] = rng.randbytes(16)
    elif kind == "reason":
        row[kind] = rng.choice([r for r in blobfmt.SAVE_REASONS if r != old])
    elif kind == "in_ram":
        row[kind] = not old
    assert row[kind] != old
    txn.put(key, msgpack.packb(row, use_bin_type=True), db=entries)
    return f"{kind} {old!r} -> {row[kind]!r}"


def test_campaign_damaged_index_rows_and_files_at_rest(daemon_factory: DaemonFactory) -> None:
    rng = random.Random(SEED ^ 0x5EED)
    kinds = (*BAD_ROW, *REST_KINDS)  # the row kinds twice: garble has many variants
    cases = [Case(i, k, "ram" if k in ("in_ram", "flip_ram_at_rest") else "disk",
                  rng.choice(PATHS)) for i, k in enumerate(kinds)]
    rng.shuffle(cases)
    d = daemon_factory("--block-size", str(BLOCK), name="at-rest")
    with d.client() as c:
        for case in cases:
            tokens = random_tokens(rng, N)
            case.entry = save(c, IDENT_A, tokens)
            case.prefix = save(c, IDENT_A, tokens[:PREFIX])
            c.pin(case.entry.key)  # a pin and a hit to see survive a re-index
            assert_loads(c, case.entry, case)
        keys_ = [k for case in cases for k in (case.entry.key, case.prefix.key)]
        wait_for(lambda: all(in_ram(c, k) for k in keys_), "every entry's RAM copy")
        before = listed(c)
    d.stop()  # flushes usage (hits) into the index

    env = lmdb.open(str(d.data_dir / "index"), map_size=1 << 34, max_dbs=4, subdir=True)
    try:
        dbs = {name: env.open_db(name.encode()) for name in ("entries", "anchors", "seals")}
        with env.begin(write=True) as txn:
            for case in cases:
                if case.kind in (*BAD_ROW, "delete_row", "in_ram"):
                    case.detail = damage_row(txn, dbs, case.entry.key, case.kind, rng)
    finally:
        env.close()
    for case in cases:
        if case.kind in ("truncate_at_rest", "extend_at_rest"):
            case.detail = damage_file(blob_file(d, case.entry.key), case.kind.split("_")[0], rng)
        elif case.kind == "flip_ram_at_rest":
            case.detail = damage_file(ram_file(d, case.entry.key), rng.choice(FLIPS), rng)

    d.start()
    count = Counter(case.kind for case in cases)
    n_bad = sum(count[k] for k in BAD_ROW)
    n_resized = count["truncate_at_rest"] + count["extend_at_rest"]
    with d.client(fast_path=True) as fast, d.client(fast_path=False) as stream:
        clients = {"fast": fast, "stream": stream}
        at_start = counters(fast)  # a fresh process: everything here is start-up's doing
        summary = "; ".join(str(case) for case in cases)
        assert {name: at_start[name] for name in CORRUPTION_COUNTERS} == {
            "corrupt_blobs": 0, "quarantined_files": n_resized,
            "reconcile_removed": n_bad + n_resized,
            "reconcile_added": n_bad + count["delete_row"]}, summary
        after = listed(fast)
        for case in cases:
            check_after_restart(case, d, clients[case.path],
                                clients["stream" if case.path == "fast" else "fast"],
                                before[case.entry.key], after)
            assert case.prefix.key in after, case  # the neighbours are untouched
            assert_loads(clients[case.path], case.prefix, case)
        assert counters(fast)["corrupt_blobs"] == count["flip_ram_at_rest"]
    print(f"seed {SEED}: {len(cases)} index-row and at-rest corruptions of {len(count)} kinds, "
          f"all detected, 0 served, {len(cases) - n_resized} good entries kept")


SEALED = ("namespace", "n_tokens", "size", "reason", "tenant_id", "model_name",
          "model_fingerprint", "created", "codec")


def check_after_restart(case: Case, d: DaemonProcess, c: CacheClient, other: CacheClient,
                        was: pb.Entry, after: dict[bytes, pb.Entry]) -> None:
    entry = case.entry
    assert entry is not None and case.prefix is not None
    key = entry.key
    if case.kind in ("truncate_at_rest", "extend_at_rest"):
        assert key not in after, case
        assert any(name.startswith(key.hex()) for name in quarantined(d)), case
        assert_not_found(c, key, case)
        hit = c.lookup(IDENT_A, entry.tokens)
        assert hit is not None and hit.key == case.prefix.key, case
        return
    now = after.get(key)
    assert now is not None, f"{case}: a good entry was lost"
    # Every field the blob vouches for is back as saved, whatever the row said.
    assert {f: getattr(now, f) for f in SEALED} == {f: getattr(was, f) for f in SEALED}, case
    hit = c.lookup(IDENT_A, entry.tokens)
    assert hit is not None and (hit.key, hit.matched_tokens, hit.size) == (key, N, was.size), \
        case
    if case.kind in BAD_ROW or case.kind == "delete_row":
        # Re-indexed from the header: the RAM copy was dropped with the row.
        assert list(now.tiers) == [pb.TIER_DISK], case
        assert not ram_file(d, key).exists(), case
        if case.kind in BAD_ROW and (case.kind != "garble" or "unsealed" in case.detail):
            # A readable row: its hits and pin are kept.
            assert (now.pinned, now.hits) == (was.pinned, was.hits), case
        assert_loads(c, entry, case, tier="disk")
        assert_loads(other, entry, case)
    elif case.kind == "in_ram":
        assert pb.TIER_RAM in now.tiers, f"{case}: the flag was not set from the RAM directory"
        assert (now.pinned, now.hits) == (was.pinned, was.hits), case
        assert_loads(c, entry, case, tier="ram")
    else:  # flip_ram_at_rest: same size, so start-up cannot see it; the read does
        assert pb.TIER_RAM in now.tiers, case
        before = counters(c)
        with pytest.raises(CorruptBlob):
            c.load(key, prefix_of=entry.tokens)
        delta = corruption_delta(before, counters(c))
        assert delta == {"corrupt_blobs": 1, "quarantined_files": 1}, f"{case}: {delta}"
        assert_loads(other, entry, case, tier="disk")


# -- 3. the runtime: a request over a corrupt entry completes exactly like a cold one --------


CONFIG = RuntimeConfig(n_ctx=512, n_batch=256, n_seq_max=1, n_threads=1, prefill_chunk=128,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       shutdown_deadline_s=10.0,
                       reuse_live=False)  # these tests follow the daemon path
# payload_flip_cold damages the request's only usable state (the cold entry, once the
# finish entry that also holds the prompt is deleted): it goes cold.
RUNTIME_KINDS = ("payload_flip_disk", "payload_flip_cold", "ram_copy_flip",
                 "truncated_parent_key", "swapped")


@pytest.fixture(scope="module")
def runtime_daemons(module_daemon_factory: DaemonFactory) -> dict[str, DaemonProcess]:
    """A disk-only daemon (reads hit the disk copy) and one with a RAM tier."""
    return {"disk": module_daemon_factory("--block-size", "32", "--ram-bytes", "0",
                                          name="disk"),
            "ram": module_daemon_factory("--block-size", "32", name="ram")}


@pytest.fixture(scope="module")
def plain(tiny_model: Path) -> Iterator[Runtime]:
    """No cache: the cold reference for every output."""
    with Runtime(tiny_model, cache_address=None, config=CONFIG) as rt:
        yield rt


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model of the same shape: its states fit, and are wrong."""
    return make_tiny_model(tmp_path_factory, seed=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_request_over_a_corrupt_entry_completes_like_a_cold_run(
        kind: str, path: str, request: pytest.FixtureRequest, tiny_model: Path,
        other_model: Path, plain: Runtime, runtime_daemons: dict[str, DaemonProcess]) -> None:
    d = runtime_daemons["ram" if kind == "ram_copy_flip" else "disk"]
    config = replace(CONFIG, tenant=request.node.name)  # entries of its own

    def runtime(model: Path) -> Runtime:
        cache = CacheClient(d.address, timeout=config.cache_timeout_s,
                            fast_path=path == "fast")
        return Runtime(model, cache=cache, config=config)

    rng = random.Random(f"{SEED}/{request.node.name}")
    with runtime(tiny_model) as rt, d.client() as admin:
        p = sample_prompt(rt.tokenize, 100, TEXT_A)
        first = rt.complete(tokens=p, max_tokens=8)
        assert first.cache_hit_kind == "cold"
        # Saved: cold at 64 tokens, the prompt (100) and finish at 107 (the prompt and all
        # but the last token), each a piece on the one before.
        assert [(s["reason"], s["tokens"]) for s in first.saves] == \
            [("cold", 64), ("prompt", 100), ("finish", 107)]
        flush(rt)
        finish = bytes.fromhex(first.finish_key)
        # The next turn's lookup finds the finish entry, its longest saved prefix. The
        # same prompt again would find it or the prompt's entry (both hold the whole
        # prompt): without them, the cold entry is the only state that prompt can use.
        if kind == "payload_flip_cold":
            admin.delete(bytes.fromhex(first.saves[1]["key"]))  # finish goes with it
            q, victim = p, bytes.fromhex(first.saves[0]["key"])
        else:
            q, victim = p + first.tokens[:-1] + sample_prompt(rt.tokenize, 12, TEXT_B)[1:], finish
        cold = plain.complete(tokens=q, max_tokens=8)

        if kind == "ram_copy_flip":
            wait_for(lambda: in_ram(admin, finish), "the finish entry's RAM copy")
            target = ram_file(d, finish)
        else:
            target = blob_file(d, victim)
        if kind == "swapped":
            # The other model's finish entry of the same request: the same size (a piece
            # of 7 cells on its 100-token prompt entry), valid checksums, the prompt's
            # first 100 tokens. Only its namespace, parent and generated tokens (hence its
            # key) differ.
            with runtime(other_model) as rt_b:
                b = rt_b.complete(tokens=p, max_tokens=8)
                flush(rt_b)
            donor = blob_file(d, bytes.fromhex(b.finish_key))
            assert donor.stat().st_size == target.stat().st_size
            shutil.copyfile(donor, target)
        else:
            damage_file(target, "truncate" if kind.startswith("truncated") else "flip_payload",
                        rng)
        before, q_before = counters(admin), quarantined(d)

        extra = {"parent_key": first.finish_key} if kind == "truncated_parent_key" else {}
        done = rt.complete(tokens=q, max_tokens=8, **extra)

        assert done.tokens == cold.tokens and done.text == cold.text, \
            f"[seed {SEED}] {kind}/{path}: output differs from a cold run"
        stats = rt.stats()
        assert stats.get("corrupt_blobs") == 1, stats
        delta = corruption_delta(before, counters(admin))
        assert delta == {"corrupt_blobs": 1, "quarantined_files": 1}, delta
        assert len(quarantined(d) - q_before) == 1
        if kind == "ram_copy_flip":
            # Only the RAM copy went; the retry restored the same entry from disk.
            assert (done.cache_hit_kind, done.cache_delta["tokens_read"], done.cache_tier) \
                == ("partial", 107, "disk")
            assert finish in listed(admin)
        elif kind == "payload_flip_cold":
            assert (done.cache_hit_kind, done.cache_delta["tokens_read"]) == ("cold", 0)
            # The cold run saved the same prefix again, under the freed key: a good blob.
            flush(rt)
            assert admin.load(victim, prefix_of=q).meta.tokens == q[:64]
        else:
            # Quarantined: the retry found the shorter entry of the prompt (the finish
            # piece's parent).
            assert (done.cache_hit_kind, done.cache_delta["tokens_read"]) == ("partial", 100)
            assert finish not in listed(admin)
        if kind == "truncated_parent_key":
            assert stats.get("parent_key_unusable") == 1, stats
