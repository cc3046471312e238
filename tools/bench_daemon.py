"""Benchmark the kvcache daemon against plain file I/O, measured side by side.

Run::

    /work/venv/bin/python tools/bench_daemon.py [--quick] [--out FILE.json]

It starts real daemons (``python -m kvcache.cli serve``) in a temporary directory (the RAM
tier on /dev/shm) and prints ONE JSON document on stdout (progress goes to stderr). The
machines this runs on are shared and noisy, so every kvcache number comes with a baseline
measured in the same run, interleaved sample by sample, and is reported as a ratio:

1. read path, a 47 MB blob (a 2048-token SmolLM2 state): RAM tier via the same-host fast
   path vs a plain read of the same bytes from the page cache (baseline A); disk tier
   (a daemon with ``--ram-bytes 0``) vs a plain read after dropping both files from the
   page cache (baseline B); the streaming path of remote clients vs baseline A.
2. longest-prefix lookup of a 32k-token prompt against 10,000 entries: end to end over
   gRPC and ``Store.lookup`` in-process, with a breakdown of where the time goes.
3. save of 47 MB (committed, durable) vs write+fsync of the same bytes (with and without
   rename + directory fsync); fast path and streaming path.
4. start-up with 10,000 entries (index present, and index deleted: rebuilt from blob
   headers) vs start-up on an empty directory.
5. payload codecs on synthetic f16 KV data: none, zstd 1/3, byte-plane split + zstd;
   restore time per tier = read time at the stored size + decode time.

Baselines A and B read into a fresh zero-filled bytearray, as agreed; since the client may
read into an uninitialized buffer (numpy.empty) instead, both also come in that stricter
variant (``*_into_uninitialized_buffer``), reported beside the agreed ratio.

Each measurement reports its raw samples as median / p10 / p90 (/ p99) / n, and
``ratio_vs_<baseline>`` (ratio of medians) plus ``paired_ratio_vs_<baseline>`` (median of
per-pair ratios). ``targets`` at the end checks the agreed bars; breakdowns (``*_breakdown``,
``of_which``) time the steps of a path one by one to show where a miss comes from.

``--quick`` shrinks entry counts and repeats for a smoke run (under a minute); the full run
takes a few minutes on 2 cores. Daemons and temporary directories are removed on exit,
including on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchlib as bl
import numpy as np
import xxhash
import zstandard

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import CacheClient, Identity
from kvcache.store import Store, StoreConfig
from kvcache.tenancy import TenantSalts
from kvcache.v1 import kvcache_pb2 as pb

IDENTITY = Identity(model_fingerprint="bench-fingerprint-0001",
                    kv_layout={"type_k": "f16", "type_v": "f16", "n_layer": "30",
                               "n_head_kv": "3", "head_dim": "64", "flash_attn": "0"},
                    model_name="bench-smollm2-shape")
VOCAB = 49152
BLOCK_SIZE = 256  # the daemon's default


@dataclass(frozen=True)
class Settings:
    mode: str
    blob_bytes: int
    blob_tokens: int
    read_repeats: int
    disk_repeats: int
    stream_repeats: int
    n_entries: int
    prompt_tokens: int
    lookup_repeats: int
    save_repeats: int
    stream_save_repeats: int
    startup_repeats: int
    codec_bytes: int
    codec_repeats: int


def make_settings(quick: bool) -> Settings:
    if quick:
        return Settings("quick", 47_000_000, 2048, read_repeats=5, disk_repeats=3,
                        stream_repeats=3, n_entries=1_000, prompt_tokens=32_768,
                        lookup_repeats=150, save_repeats=3, stream_save_repeats=2,
                        startup_repeats=2, codec_bytes=16_000_000, codec_repeats=1)
    return Settings("full", 47_000_000, 2048, read_repeats=30, disk_repeats=20,
                    stream_repeats=10, n_entries=10_000, prompt_tokens=32_768,
                    lookup_repeats=1000, save_repeats=8, stream_save_repeats=8,
                    startup_repeats=5, codec_bytes=47_000_000, codec_repeats=3)


# -- workspace -------------------------------------------------------------------------------


class Workspace:
    """Temporary directories (data on disk, RAM tiers on /dev/shm) and every daemon started
    in them; ``close()`` stops the daemons and removes it all."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvbench-daemon-"))
        shm = Path("/dev/shm")
        self.ram_root = Path(tempfile.mkdtemp(prefix="kvbench-daemon-ram-",
                                              dir=shm if shm.is_dir() else self.root))
        self.daemons: list[bl.Daemon] = []

    def daemon(self, name: str, *args: str, data_dir: Path | None = None) -> bl.Daemon:
        d = bl.Daemon(data_dir or self.root / name, self.ram_root / name, *args, name=name,
                      log_dir=self.root)
        self.daemons.append(d)
        return d

    def close(self) -> None:
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.close()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.ram_root, ignore_errors=True)


@contextlib.contextmanager
def running(daemon: bl.Daemon) -> Iterator[bl.Daemon]:
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


# -- sampling helpers ------------------------------------------------------------------------


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, *, warmup: int = 1,
                before: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, alternating the order every round so that
    drifts in machine load hit all of them alike. ``before(name)`` runs untimed."""
    for _ in range(warmup):
        for name, fn in fns.items():
            if before:
                before(name)
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for i in range(repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            if before:
                before(name)
            samples[name].append(bl.timed(fns[name])[0])
    return samples


def compare(samples: list[float], baseline: list[float], baseline_name: str,
            n_bytes: int = 0, tails: bool = False) -> dict[str, Any]:
    """Summary of ``samples`` with its ratios against interleaved ``baseline`` samples."""
    out = bl.summarize(samples, tails=tails)
    base = bl.summarize(baseline, tails=tails)
    out[f"ratio_vs_{baseline_name}"] = bl.ratio(out, base)
    out[f"paired_ratio_vs_{baseline_name}"] = bl.paired_ratio(samples, baseline)
    if n_bytes:
        out["throughput_mb_s"] = bl.throughput_mb_s(n_bytes, out["median"] / 1e3)
    return out


def with_throughput(samples: list[float], n_bytes: int) -> dict[str, Any]:
    out = bl.summarize(samples, tails=False)
    out["throughput_mb_s"] = bl.throughput_mb_s(n_bytes, out["median"] / 1e3)
    return out


def medians_ms(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(bl.percentile(v, 50) * 1e3, 3) for name, v in samples.items()}


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n, dtype=np.int64).tolist()


def wait_for_tier(client: CacheClient, tokens: list[int], tier: str,
                  timeout: float = 60.0) -> float:
    """Poll lookups until the entry of ``tokens`` is served from ``tier``; returns seconds."""
    start = time.perf_counter()
    while True:
        hit = client.lookup(IDENTITY, tokens)
        if hit is not None and hit.matched_tokens == len(tokens) and hit.tier == tier:
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"entry did not reach the {tier} tier in {timeout} s ({hit})")
        time.sleep(0.01)


# -- 1. read path ----------------------------------------------------------------------------


def local_load_breakdown(client: CacheClient, key: bytes, repeats: int) -> dict[str, float]:
    """The steps of the client's same-host load, timed one by one (medians, ms). The
    buffer is timed both ways a client may allocate it: zero-filled (bytearray, then a
    read into faulted-in pages) and uninitialized (numpy.empty: the page faults move into
    the read)."""
    steps: dict[str, list[float]] = {k: [] for k in (
        "open_read_rpc", "alloc_zeroed_bytearray", "readinto_prefaulted",
        "alloc_and_readinto_uninitialized", "decode_blob_total", "of_which_payload_xxh3",
        "release_read_rpc")}
    for _ in range(repeats):
        t, resp = bl.timed(lambda: client.stub.OpenRead(pb.OpenReadRequest(key=key), timeout=10))
        steps["open_read_rpc"].append(t)
        t, buf = bl.timed(lambda r=resp: bytearray(r.size))
        steps["alloc_zeroed_bytearray"].append(t)
        steps["readinto_prefaulted"].append(bl.timed(
            lambda b=buf, p=resp.path: read_into(p, b))[0])
        steps["alloc_and_readinto_uninitialized"].append(bl.timed(lambda r=resp: read_into(
            r.path, memoryview(np.empty(r.size, dtype=np.uint8))))[0])
        steps["decode_blob_total"].append(bl.timed(lambda b=buf: blobfmt.decode_blob(b))[0])
        steps["of_which_payload_xxh3"].append(bl.timed(
            lambda b=buf: xxhash.xxh3_64_intdigest(b))[0])
        steps["release_read_rpc"].append(bl.timed(lambda r=resp: client.stub.ReleaseRead(
            pb.ReleaseReadRequest(pin_id=r.pin_id), timeout=10))[0])
    return medians_ms(steps)


def read_into(path: str | Path, buf: bytearray | memoryview) -> int:
    with open(path, "rb", buffering=0) as f:
        return f.readinto(buf)


def stream_load_breakdown(client: CacheClient, key: bytes, repeats: int) -> dict[str, float]:
    """Streaming load split into receiving the chunks and decoding the assembled blob."""
    steps: dict[str, list[float]] = {"receive_chunks": [], "decode_blob": []}
    for _ in range(repeats):
        def receive() -> bytearray:
            buf = bytearray()
            for chunk in client.stub.Read(pb.ReadRequest(key=key), timeout=60):
                if chunk.offset == 0 and chunk.total_size:
                    buf = bytearray(chunk.total_size)
                buf[chunk.offset: chunk.offset + len(chunk.data)] = chunk.data
            return buf

        t, buf = bl.timed(receive)
        steps["receive_chunks"].append(t)
        steps["decode_blob"].append(bl.timed(lambda b=buf: blobfmt.decode_blob(b))[0])
    return medians_ms(steps)


def check_roundtrip(client: CacheClient, key: bytes, payload: bytes) -> None:
    loaded = client.load(key)
    if loaded.payload != payload:
        raise RuntimeError(f"payload of {key.hex()} did not round-trip")


def bench_ram_and_stream(ws: Workspace, s: Settings, payload: bytes,
                         baseline_file: Path) -> dict[str, Any]:
    daemon = ws.daemon("read-ram")
    tokens = random_tokens(np.random.default_rng(11), s.blob_tokens)
    with running(daemon), CacheClient(daemon.address) as fast, \
            CacheClient(daemon.address, fast_path=False) as remote:
        key = fast.save(IDENTITY, tokens, payload, "cold").key
        ram_wait = wait_for_tier(fast, tokens, "ram")
        check_roundtrip(fast, key, payload)
        check_roundtrip(remote, key, payload)

        def baseline_a() -> bytearray:
            return bl.read_file_into_new_buffer(baseline_file, len(payload))

        def baseline_a_uninitialized() -> int:
            return read_into(baseline_file, memoryview(np.empty(len(payload), dtype=np.uint8)))

        bl.log(f"read: RAM fast path vs page-cache read, {s.read_repeats} rounds")
        ram = interleaved({"a": baseline_a, "a_uninit": baseline_a_uninitialized,
                           "ram": lambda: fast.load(key)}, s.read_repeats)
        bl.log(f"read: streaming path vs page-cache read, {s.stream_repeats} rounds")
        stream = interleaved({"a": baseline_a, "stream": lambda: remote.load(key)},
                             s.stream_repeats)
        breakdown = local_load_breakdown(fast, key, max(5, s.read_repeats // 2))
        stream_split = stream_load_breakdown(remote, key, max(2, s.stream_repeats // 2))
        blob_size = fast.lookup(IDENTITY, tokens).size
    return {
        "baseline_a_page_cache_read": with_throughput(ram["a"], len(payload)),
        "ram_tier_fast_path": {
            **compare(ram["ram"], ram["a"], "baseline_a", len(payload)),
            "ratio_vs_page_cache_read_into_uninitialized_buffer": bl.ratio(
                bl.summarize(ram["ram"], tails=False), bl.summarize(ram["a_uninit"], tails=False)),
        },
        "page_cache_read_into_uninitialized_buffer": with_throughput(ram["a_uninit"],
                                                                     len(payload)),
        "stream_path": compare(stream["stream"], stream["a"], "baseline_a", len(payload)),
        "stream_baseline_a_same_run": bl.summarize(stream["a"], tails=False),
        "ram_fast_path_breakdown_ms": breakdown,
        "stream_path_breakdown_ms": stream_split,
        "blob_file_bytes": blob_size,
        "seconds_until_in_ram_tier_after_save": round(ram_wait, 3),
    }


def bench_disk(ws: Workspace, s: Settings, payload: bytes, baseline_file: Path,
               baseline_a_ms: float) -> dict[str, Any]:
    daemon = ws.daemon("read-disk", "--ram-bytes", "0")
    tokens = random_tokens(np.random.default_rng(12), s.blob_tokens)
    with running(daemon), CacheClient(daemon.address) as client:
        key = client.save(IDENTITY, tokens, payload, "cold").key
        blob_file = Path(client.inspect(key).path)
        check_roundtrip(client, key, payload)
        files = {"b": baseline_file, "b_uninit": baseline_file, "disk": blob_file}
        resident: dict[str, list[float]] = {"b": [], "disk": []}

        def drop_then_probe(name: str) -> None:
            for path in files.values():
                bl.drop_from_page_cache(path)
            frac = bl.cached_fraction(files[name])
            if frac is not None and name in resident:
                resident[name].append(frac)

        bl.log(f"read: disk tier vs dropped-cache read, {s.disk_repeats} rounds")
        samples = interleaved(
            {"b": lambda: bl.read_file_into_new_buffer(baseline_file, len(payload)),
             "b_uninit": lambda: read_into(baseline_file,
                                           memoryview(np.empty(len(payload), dtype=np.uint8))),
             "disk": lambda: client.load(key)},
            s.disk_repeats, before=drop_then_probe)
        tier = client.lookup(IDENTITY, tokens).tier
    baseline_b = with_throughput(samples["b"], len(payload))
    return {
        "baseline_b_dropped_cache_read": baseline_b,
        "disk_tier_fast_path": {
            **compare(samples["disk"], samples["b"], "baseline_b", len(payload)),
            "ratio_vs_dropped_cache_read_into_uninitialized_buffer": bl.ratio(
                bl.summarize(samples["disk"], tails=False),
                bl.summarize(samples["b_uninit"], tails=False)),
        },
        "dropped_cache_read_into_uninitialized_buffer": with_throughput(samples["b_uninit"],
                                                                        len(payload)),
        "disk_tier_reported_by_lookup": tier,
        "page_cache_drop": drop_report(resident, len(payload), baseline_a_ms,
                                       baseline_b["median"]),
    }


def drop_report(resident: dict[str, list[float]], n_bytes: int, a_ms: float,
                b_ms: float) -> dict[str, Any]:
    """Was each 'cold' read really cold? mincore answers for the guest kernel; the extra
    time over a page-cache read gives the rate the layers below delivered (a VM host's
    cache can make a 'cold' read much faster than the disk)."""
    worst = {name: max(v) if v else None for name, v in resident.items()}
    known = [w for w in worst.values() if w is not None]
    effective = bool(known) and max(known) < 0.05
    if effective:
        note = "posix_fadvise(DONTNEED) emptied the guest page cache before every read"
    elif known:
        note = f"the drop was not effective: up to {max(known):.0%} stayed resident"
    else:
        note = "the drop could not be checked (mincore unavailable)"
    implied = bl.throughput_mb_s(n_bytes, (b_ms - a_ms) / 1e3) if b_ms > a_ms else None
    note += (f"; the cold read took {b_ms - a_ms:.1f} ms more than a page-cache read, i.e. the "
             f"device side delivered about {implied} MB/s (a VM host's cache may be behind it)")
    return {"max_resident_fraction_after_drop": worst, "effective_in_guest": effective,
            "implied_device_read_mb_s": implied, "note": note}


def bench_read_path(ws: Workspace, s: Settings, payload: bytes) -> dict[str, Any]:
    baseline_file = ws.root / "baseline-read.bin"
    bl.write_file(baseline_file, payload, fsync=True)  # clean pages, so they can be dropped
    out: dict[str, Any] = {"blob_payload_bytes": len(payload), "blob_tokens": s.blob_tokens}
    out.update(bench_ram_and_stream(ws, s, payload, baseline_file))
    out.update(bench_disk(ws, s, payload, baseline_file,
                          baseline_a_ms=out["baseline_a_page_cache_read"]["median"]))
    baseline_file.unlink()
    return out


# -- 2. lookup -------------------------------------------------------------------------------


@dataclass
class LookupCorpus:
    query: list[int]  # the 32k-token prompt; its longest stored prefix is deep
    shallow_query: list[int]  # shares only a few hundred tokens: every anchor is probed
    entries: list[list[int]]
    expect_deep: int
    expect_shallow: int


def exact_max(n: int) -> int:
    """The deepest exact prefix stored: 31,337 tokens of a 32,768-token prompt."""
    return 31_337 * n // 32_768


def build_corpus(s: Settings, seed: int = 7) -> LookupCorpus:
    """Entries sharing prefixes with the query at log-uniform depths, then diverging (so
    their anchors sit on the query's block-hash chain and get probed), plus 1% exact
    prefixes of the query, the deepest at 31,337 tokens."""
    rng = np.random.default_rng(seed)
    n = s.prompt_tokens
    query = random_tokens(rng, n)
    n_exact = max(10, s.n_entries // 100)
    exact = {exact_max(n), 200}
    while len(exact) < n_exact:
        exact.add(int(rng.integers(1, exact_max(n))))
    entries = [query[:length] for length in sorted(exact)]
    while len(entries) < s.n_entries:
        depth = int(math.exp(rng.uniform(0, math.log(n))))
        tail = random_tokens(rng, int(rng.integers(1, 513)))
        if depth < n and tail[0] == query[depth]:
            tail[0] = (tail[0] + 1) % VOCAB
        entries.append(query[:depth] + tail)
    shallow_len = 300
    shallow = query[:shallow_len] + random_tokens(rng, n - shallow_len)
    if shallow[shallow_len] == query[shallow_len]:
        shallow[shallow_len] = (shallow[shallow_len] + 1) % VOCAB
    return LookupCorpus(query, shallow, entries, expect_deep=max(exact),
                        expect_shallow=max(x for x in exact if x <= shallow_len))


def write_entries(store: Store, entries: list[list[int]]) -> int:
    """Write blob files straight into the store's disk tier (no fsync: benchmark data);
    the next Store opened on the directory indexes them from their headers."""
    ns = IDENTITY.namespace
    small_payload = bytes(64)
    total = 0
    for tokens in entries:
        meta = blobfmt.BlobMeta(namespace=ns, model_fingerprint=IDENTITY.model_fingerprint,
                                kv_layout=IDENTITY.kv_layout, tokens=tokens, reason="cold",
                                model_name=IDENTITY.model_name)
        parts = blobfmt.encode_blob(meta, small_payload)
        path = store.blob_path(keys.entry_key(ns, tokens, BLOCK_SIZE).key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        with open(path, "wb") as f:
            for part in parts:
                f.write(part)
        total += blobfmt.blob_size(parts)
    return total


def populate(data_dir: Path, ram_dir: Path, corpus: LookupCorpus) -> dict[str, Any]:
    config = StoreConfig(root=data_dir, ram_dir=ram_dir, min_free_bytes=0, block_size=BLOCK_SIZE)
    store = Store(config)
    try:
        t_write, n_bytes = bl.timed(lambda: write_entries(store, corpus.entries))
    finally:
        store.close()
    t_index, store = bl.timed(lambda: Store(config))  # re-indexes every file from its header
    try:
        n_indexed = store.index.count()
    finally:
        store.close()
    if n_indexed != len(corpus.entries):
        raise RuntimeError(f"indexed {n_indexed} of {len(corpus.entries)} entries")
    return {"method": "blob files written in-process with kvcache.blob.encode_blob at "
                      "Store.blob_path (no fsync), then indexed by opening a Store in-process "
                      "(its start-up reconcile reads each blob's header and metadata)",
            "entries": n_indexed, "blob_bytes_total": n_bytes,
            "write_files_seconds": round(t_write, 3),
            "in_process_index_from_headers_seconds": round(t_index, 3)}


def anchor_rows_scanned(corpus: LookupCorpus, query: list[int], expect: int) -> int:
    """How many stored entries hang under the anchors a lookup of ``query`` probes (from
    the longest block hash down to the block holding the answer): each is one row the
    index walks through. Computed from the corpus with kvcache.keys alone."""
    ns = IDENTITY.namespace
    hashes = keys.block_hashes(ns, query, BLOCK_SIZE)
    probed = set(hashes[expect // BLOCK_SIZE:])
    return sum(keys.entry_key(ns, tokens, BLOCK_SIZE).anchor in probed
               for tokens in corpus.entries)


def bench_lookup_in_process(data_dir: Path, ram_dir: Path, corpus: LookupCorpus,
                            repeats: int) -> dict[str, Any]:
    config = StoreConfig(root=data_dir, ram_dir=ram_dir, min_free_bytes=0, block_size=BLOCK_SIZE)
    store = Store(config)
    ns = IDENTITY.namespace
    out: dict[str, Any] = {}
    try:
        for name, query, expect in (("deep_hit", corpus.query, corpus.expect_deep),
                                    ("shallow_hit_all_anchors", corpus.shallow_query,
                                     corpus.expect_shallow)):
            raw = keys.tokens_to_bytes(query)
            record, probes = store.lookup(ns, raw)
            if record is None or record.n_tokens != expect:
                raise RuntimeError(f"{name}: in-process lookup found {record}, expected {expect}")
            hashes = keys.block_hashes(ns, raw, BLOCK_SIZE)
            samples = interleaved({
                "store_lookup": lambda r=raw: store.lookup(ns, r),
                "block_hashes": lambda r=raw: keys.block_hashes(ns, r, BLOCK_SIZE),
                "index_longest_prefix": lambda h=hashes, r=raw: store.index.longest_prefix(
                    h, r, BLOCK_SIZE),
            }, repeats, warmup=5)
            out[name] = {"matched_tokens": record.n_tokens, "probes": probes,
                         "entries_under_probed_anchors": anchor_rows_scanned(corpus, query,
                                                                             expect),
                         "store_lookup": bl.summarize(samples["store_lookup"]),
                         "of_which_median_ms": medians_ms({
                             "block_hashes": samples["block_hashes"],
                             "index_longest_prefix": samples["index_longest_prefix"]})}
    finally:
        store.close()
    return out


def message_costs(query: list[int], repeats: int) -> dict[str, float]:
    """The per-request work around Store.lookup, timed in this process: building and
    serializing the request (client), parsing it and packing its tokens (server)."""
    data = pb.LookupRequest(identity=IDENTITY.message(), tokens=query).SerializeToString()
    parsed = pb.LookupRequest.FromString(data)
    salts = TenantSalts(bytes(32))  # the daemon's own derivation, with a tenant's salt

    def identity_namespace(identity: pb.Identity) -> bytes:
        return salts.namespace(identity.model_fingerprint, dict(identity.kv_layout),
                               identity.tenant)

    samples = interleaved({
        "client_build_and_serialize": lambda: pb.LookupRequest(
            identity=IDENTITY.message(), tokens=query).SerializeToString(),
        "server_parse": lambda: pb.LookupRequest.FromString(data),
        "server_tokens_to_bytes": lambda: keys.tokens_to_bytes(parsed.tokens),
        "server_identity_namespace": lambda: identity_namespace(parsed.identity),
    }, repeats, warmup=5)
    out = medians_ms(samples)
    out["request_bytes"] = len(data)
    return out


def bench_lookup_grpc(daemon: bl.Daemon, corpus: LookupCorpus, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with CacheClient(daemon.address) as client:
        for name, query, expect in (("deep_hit", corpus.query, corpus.expect_deep),
                                    ("shallow_hit_all_anchors", corpus.shallow_query,
                                     corpus.expect_shallow)):
            hit = client.lookup(IDENTITY, query)
            if hit is None or hit.matched_tokens != expect:
                raise RuntimeError(f"{name}: gRPC lookup found {hit}, expected {expect}")
            common = client.lookup(IDENTITY, query, common_prefix=True)
            samples = interleaved({
                "grpc": lambda q=query: client.lookup(IDENTITY, q),
                "grpc_common_prefix": lambda q=query: client.lookup(IDENTITY, q,
                                                                    common_prefix=True)},
                repeats, warmup=20)
            out[name] = {"matched_tokens": hit.matched_tokens, "probes": hit.probes,
                         "client_lookup_e2e": bl.summarize(samples["grpc"]),
                         # What the runtime asks for on plain-attention models: the entry
                         # sharing the most tokens, also a longer or diverging one.
                         "common_prefix": {
                             "matched_tokens": common.matched_tokens if common else 0,
                             "probes": common.probes if common else 0,
                             "client_lookup_e2e": bl.summarize(samples["grpc_common_prefix"])}}
    return out


def lookup_breakdown(lookup: dict[str, Any]) -> dict[str, Any]:
    """Median end-to-end time split into the parts timed in-process; the remainder is
    gRPC itself (HTTP/2 framing over the socket, thread hand-offs, response handling)."""
    costs = lookup["per_request_message_costs_ms"]
    message_ms = sum(v for k, v in costs.items() if k != "request_bytes")
    out: dict[str, Any] = {}
    for name, v in lookup["grpc"].items():
        e2e = v["client_lookup_e2e"]["median"]
        store_ms = lookup["in_process"][name]["store_lookup"]["median"]
        out[name] = {"e2e_median": e2e, "store_lookup": store_ms,
                     "message_build_parse_pack": round(message_ms, 3),
                     "grpc_remainder": round(e2e - store_ms - message_ms, 3)}
    return out


# -- 3. save path ----------------------------------------------------------------------------


def bench_save(ws: Workspace, s: Settings, payload: bytes) -> dict[str, Any]:
    daemon = ws.daemon("save")
    scratch = daemon.data_dir.parent / "save-baseline"
    scratch.mkdir()
    base_tokens = random_tokens(np.random.default_rng(13), s.blob_tokens)
    counter = iter(range(1_000_000, 2_000_000))
    with running(daemon), CacheClient(daemon.address) as fast, \
            CacheClient(daemon.address, fast_path=False) as remote:
        saved: list[list[int]] = []

        def save_with(client: CacheClient) -> None:
            tokens = [next(counter)] + base_tokens[1:]
            result = client.save(IDENTITY, tokens, payload, "cold")
            if result.status != "saved":
                raise RuntimeError(f"save returned {result.status}")
            saved.append(tokens)

        def settle(_name: str) -> None:
            """Untimed: let the last save's RAM copy finish, then delete old entries, so
            that no background copy overlaps the next sample and disk use stays flat."""
            while saved:
                tokens = saved.pop()
                wait_for_tier(fast, tokens, "ram")
                fast.delete(fast.lookup(IDENTITY, tokens).key)
            for f in scratch.iterdir():
                f.unlink()

        fns = {
            "write_fsync": lambda: bl.write_file(scratch / "plain.bin", payload),
            "write_fsync_rename_dirsync": lambda: bl.write_file(
                scratch / "tmp.part", payload, rename_to=scratch / "final.bin"),
            "save_fast_path": lambda: save_with(fast),
        }
        bl.log(f"save: fast path vs write+fsync, {s.save_repeats} rounds")
        fast_samples = interleaved(fns, s.save_repeats, before=settle)
        bl.log(f"save: streaming path vs write+fsync, {s.stream_save_repeats} rounds")
        stream_samples = interleaved({"write_fsync": fns["write_fsync"],
                                      "save_stream": lambda: save_with(remote)},
                                     s.stream_save_repeats, before=settle)
        split = save_breakdown(fast, payload, base_tokens, max(3, s.save_repeats // 2), settle,
                               saved)
        settle("")
    plain = fast_samples["write_fsync"]
    return {
        "baseline_write_fsync": with_throughput(plain, len(payload)),
        "baseline_write_fsync_rename_dirsync": compare(
            fast_samples["write_fsync_rename_dirsync"], plain, "write_fsync", len(payload)),
        "save_fast_path": {
            **compare(fast_samples["save_fast_path"], plain, "write_fsync", len(payload)),
            "ratio_vs_write_fsync_rename_dirsync": bl.ratio(
                bl.summarize(fast_samples["save_fast_path"], tails=False),
                bl.summarize(fast_samples["write_fsync_rename_dirsync"], tails=False)),
        },
        "save_stream_path": compare(stream_samples["save_stream"], stream_samples["write_fsync"],
                                    "write_fsync", len(payload)),
        "stream_baseline_write_fsync_same_run": bl.summarize(stream_samples["write_fsync"],
                                                             tails=False),
        "save_fast_path_breakdown_ms": split,
    }


def save_breakdown(client: CacheClient, payload: bytes, base_tokens: list[int], repeats: int,
                   settle: Callable[[str], None], saved: list[list[int]]) -> dict[str, float]:
    """The client's fast-path save, step by step: encode (msgpack + payload xxh3),
    Reserve RPC, writing the reserved temp file, Commit RPC (the daemon re-reads and
    verifies the file, fsyncs it, renames, fsyncs the directory, commits LMDB)."""
    steps: dict[str, list[float]] = {k: [] for k in
                                     ("encode_blob", "reserve_rpc", "write_temp_file",
                                      "commit_rpc")}
    for i in range(repeats):
        settle("")
        tokens = [3_000_000 + i] + base_tokens[1:]
        meta = blobfmt.BlobMeta(namespace=IDENTITY.namespace,
                                model_fingerprint=IDENTITY.model_fingerprint,
                                kv_layout=IDENTITY.kv_layout, tokens=tokens, reason="cold",
                                model_name=IDENTITY.model_name)
        t, parts = bl.timed(lambda m=meta: blobfmt.encode_blob(m, payload))
        steps["encode_blob"].append(t)
        request = pb.ReserveRequest(identity=IDENTITY.message(), tokens=tokens,
                                    size=blobfmt.blob_size(parts), reason="cold")
        t, resp = bl.timed(lambda r=request: client.stub.Reserve(r, timeout=30))
        steps["reserve_rpc"].append(t)

        def write(path: str = resp.local_path, ps: list = parts) -> None:
            with open(path, "r+b", buffering=0) as f:
                for part in ps:
                    f.write(part)

        steps["write_temp_file"].append(bl.timed(write)[0])
        steps["commit_rpc"].append(bl.timed(lambda r=resp: client.stub.Commit(
            pb.CommitRequest(lease_id=r.lease_id, local_write=True), timeout=60))[0])
        saved.append(tokens)
    return medians_ms(steps)


# -- 4. start-up -----------------------------------------------------------------------------


def bench_startup(ws: Workspace, populated: Path, repeats: int) -> dict[str, Any]:
    """Spawn-to-first-Stats, interleaved: empty dir, N entries with index, N entries with
    the index deleted (rebuilt from blob headers); then once each after dropping every
    file of the data dir from the page cache."""
    daemon = ws.daemon("startup", data_dir=populated)
    counter = iter(range(10_000))

    def start_stop(d: bl.Daemon) -> float:
        seconds = d.start().start_seconds
        d.stop()
        return seconds

    def empty() -> float:
        d = ws.daemon(f"startup-empty-{next(counter)}")
        try:
            return start_stop(d)
        finally:
            d.close()
            shutil.rmtree(d.data_dir, ignore_errors=True)

    def rebuild() -> float:
        shutil.rmtree(populated / "index")
        return start_stop(daemon)

    runs = {"empty_dir": empty, "with_index": lambda: start_stop(daemon), "rebuild": rebuild}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up round: imports and files in the page cache
        fn()
    for i in range(repeats):
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            samples[name].append(runs[name]())
    cold: dict[str, float] = {}
    for name in ("with_index", "rebuild"):
        if name == "rebuild":
            shutil.rmtree(populated / "index")
        bl.drop_tree_from_page_cache(populated)
        cold[name] = round(start_stop(daemon), 3)
    empty_s = bl.summarize(samples["empty_dir"], unit="s", tails=False)
    result: dict[str, Any] = {"empty_dir": empty_s}
    for name in ("with_index", "rebuild"):
        summary = bl.summarize(samples[name], unit="s", tails=False)
        summary["ratio_vs_empty_dir"] = bl.ratio(summary, empty_s)
        summary["paired_ratio_vs_empty_dir"] = bl.paired_ratio(samples[name],
                                                               samples["empty_dir"])
        summary["after_page_cache_drop_seconds"] = cold[name]
        result[name] = summary
    return result


# -- 5. codecs -------------------------------------------------------------------------------


def synthetic_f16(n_bytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).normal(0, 1, n_bytes // 2).astype(np.float16).tobytes()


def byteplane_encode(payload: bytes, level: int, high_only: bool = False) -> bytes:
    """Split f16 values into a plane of low bytes and a plane of high bytes (sign, exponent,
    top mantissa bits: the compressible part), then zstd. With ``high_only`` the low plane
    is stored raw. Output: 1 flag byte + (raw low plane) + zstd frame."""
    planes = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 2).T
    cctx = zstandard.ZstdCompressor(level=level)
    if high_only:
        return b"\x01" + planes[0].tobytes() + cctx.compress(planes[1].tobytes())
    return b"\x00" + cctx.compress(np.ascontiguousarray(planes).tobytes())


def byteplane_decode(stored: bytes, raw_len: int) -> memoryview:
    half = raw_len // 2
    out = np.empty((half, 2), dtype=np.uint8)
    dctx = zstandard.ZstdDecompressor()
    view = memoryview(stored)
    if view[0] == 1:
        out[:, 0] = np.frombuffer(view[1: 1 + half], dtype=np.uint8)
        out[:, 1] = np.frombuffer(dctx.decompress(view[1 + half:], max_output_size=half),
                                  dtype=np.uint8)
    else:
        planes = np.frombuffer(dctx.decompress(view[1:], max_output_size=raw_len),
                               dtype=np.uint8).reshape(2, half)
        out[:, 0] = planes[0]
        out[:, 1] = planes[1]
    return memoryview(out).cast("B")


def codec_variants() -> dict[str, tuple[Callable[[bytes], Any], Callable[[Any, int], Any]]]:
    def kv(codec: str, level: int) -> tuple[Callable[[bytes], Any], Callable[[Any, int], Any]]:
        return (lambda p: blobfmt.encode_payload(p, codec, level),
                lambda s, n: blobfmt.decode_payload(s, codec, n))

    return {
        "none": kv("none", 1),
        "zstd-1": kv("zstd", 1),
        "zstd-3": kv("zstd", 3),
        "byteplane+zstd-1": (lambda p: byteplane_encode(p, 1), byteplane_decode),
        "byteplane+zstd-3": (lambda p: byteplane_encode(p, 3), byteplane_decode),
        "byteplane-high-only+zstd-1": (lambda p: byteplane_encode(p, 1, high_only=True),
                                       byteplane_decode),
    }


def bench_codecs(s: Settings, read_path: dict[str, Any]) -> dict[str, Any]:
    payload = synthetic_f16(s.codec_bytes)
    variants: dict[str, dict[str, Any]] = {}
    for name, (encode, decode) in codec_variants().items():
        bl.log(f"codec: {name}")
        enc_samples, dec_samples = [], []
        stored: Any = b""
        for _ in range(s.codec_repeats):
            t, stored = bl.timed(lambda e=encode: e(payload))
            enc_samples.append(t)
            t, decoded = bl.timed(lambda d=decode, st=stored: d(st, len(payload)))
            dec_samples.append(t)
        if bytes(decoded) != payload:
            raise RuntimeError(f"codec {name} did not round-trip")
        variants[name] = {
            "stored_bytes": len(stored), "ratio": round(len(payload) / len(stored), 4),
            "encode_ms": round(bl.percentile(enc_samples, 50) * 1e3, 2),
            "decode_ms": round(bl.percentile(dec_samples, 50) * 1e3, 2),
            "encode_mb_s": mb_s_or_zero_copy(len(payload), enc_samples),
            "decode_mb_s": mb_s_or_zero_copy(len(payload), dec_samples),
        }
    return {"payload": f"{s.codec_bytes} bytes of float16 drawn from N(0, 1)",
            "repeats": s.codec_repeats, "variants": variants,
            "restore_estimate": restore_estimates(variants, read_path, s.codec_bytes)}


def mb_s_or_zero_copy(n_bytes: int, samples: list[float]) -> float | None:
    """Throughput, or None for a step that copies nothing (codec "none")."""
    seconds = bl.percentile(samples, 50)
    return bl.throughput_mb_s(n_bytes, seconds) if seconds > 1e-4 else None


def restore_estimates(variants: dict[str, dict[str, Any]], read_path: dict[str, Any],
                      raw_bytes: int) -> dict[str, Any]:
    """restore = (the tier's measured load time, scaled to the stored size) + decode time,
    per tier; the default per tier is the fastest restore."""
    per_byte_ms = {}
    for tier, field_name in (("ram", "ram_tier_fast_path"), ("disk", "disk_tier_fast_path"),
                             ("remote_stream", "stream_path")):
        load = read_path.get(field_name)
        if load:
            per_byte_ms[tier] = load["median"] / read_path["blob_payload_bytes"]
    out: dict[str, Any] = {"model": "load_ms(tier) * stored_bytes / raw_bytes + decode_ms; "
                                    "load_ms from the read-path medians of this run",
                           "raw_bytes": raw_bytes, "tiers": {}}
    for tier, cost in per_byte_ms.items():
        rows = {name: round(cost * v["stored_bytes"] + v["decode_ms"], 2)
                for name, v in variants.items()}
        best = min(rows, key=rows.__getitem__)
        out["tiers"][tier] = {"restore_ms": rows, "default": best,
                              "read_mb_s": round(1e-3 / cost, 1) if cost else None}
    return out


# -- main ------------------------------------------------------------------------------------


def section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """Run one benchmark; record its result or its error and carry on with the others."""
    bl.log(f"== {name}")
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # a broken section must not hide the others' numbers
        bl.log(f"{name} failed: {exc!r}")
        results[name] = {"error": repr(exc), "traceback": traceback.format_exc()}
    results["_section_seconds"][name] = round(time.perf_counter() - start, 1)
    return results[name]


def run_lookup_and_startup(ws: Workspace, s: Settings, results: dict[str, Any]) -> None:
    corpus = build_corpus(s)
    data_dir = ws.root / "lookup"
    ram_dir = ws.ram_root / "lookup"
    lookup: dict[str, Any] = {"prompt_tokens": s.prompt_tokens, "block_size": BLOCK_SIZE}

    def prepare() -> dict[str, Any]:
        lookup["populate"] = populate(data_dir, ram_dir, corpus)
        lookup["in_process"] = bench_lookup_in_process(data_dir, ram_dir, corpus,
                                                       s.lookup_repeats)
        lookup["per_request_message_costs_ms"] = message_costs(corpus.query, s.lookup_repeats)
        daemon = ws.daemon("lookup", data_dir=data_dir)
        with running(daemon):
            lookup["grpc"] = bench_lookup_grpc(daemon, corpus, s.lookup_repeats)
        lookup["grpc_breakdown_ms"] = lookup_breakdown(lookup)
        return lookup

    section(results, "lookup", prepare)
    if "error" not in results["lookup"]:
        section(results, "startup", lambda: {
            "entries": len(corpus.entries),
            **bench_startup(ws, data_dir, s.startup_repeats)})


def collect_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The brief's targets; a section that failed contributes none (its error is in the
    document)."""
    out: list[dict[str, Any]] = []
    with contextlib.suppress(KeyError, TypeError):
        read = r["read_path"]
        out.append(bl.target("RAM tier load / page-cache read (median ratio)",
                             read["ram_tier_fast_path"]["ratio_vs_baseline_a"], 2.0))
        out.append(bl.target("disk tier load / dropped-cache read (median ratio)",
                             read["disk_tier_fast_path"]["ratio_vs_baseline_b"], 1.5))
    with contextlib.suppress(KeyError, TypeError):
        for name, v in r["lookup"]["grpc"].items():
            out.append(bl.target(f"lookup p99 over gRPC, {name} (ms)",
                                 v["client_lookup_e2e"]["p99"], 5.0, "<", " ms"))
            out.append(bl.target(f"common-prefix lookup p99 over gRPC, {name} (ms)",
                                 v["common_prefix"]["client_lookup_e2e"]["p99"], 5.0, "<",
                                 " ms"))
    with contextlib.suppress(KeyError, TypeError):
        out.append(bl.target("save fast path / write+fsync (median ratio)",
                             r["save"]["save_fast_path"]["ratio_vs_write_fsync"], 3.0, "<"))
        out.append(bl.target("save streaming path / write+fsync (median ratio)",
                             r["save"]["save_stream_path"]["ratio_vs_write_fsync"], 3.0, "<",
                             primary=False))
    with contextlib.suppress(KeyError, TypeError):
        n = r["startup"]["entries"]
        out.append(bl.target(f"start-up with {n} entries and their index (s)",
                             r["startup"]["with_index"]["median"], 2.0, "<", " s"))
        out.append(bl.target(f"start-up with {n} entries, index rebuilt from blob headers (s)",
                             r["startup"]["rebuild"]["median"], 2.0, "<", " s", primary=False))
    return out


def run(s: Settings, out_path: Path | None) -> int:
    started = time.time()
    results: dict[str, Any] = {"benchmark": "kvcache daemon vs plain file I/O",
                               "mode": s.mode, "settings": asdict(s),
                               "machine": bl.machine_info()}
    results["_section_seconds"] = {}
    ws = Workspace()
    results["filesystems"] = {"data": bl.filesystem_of(ws.root),
                              "ram_tier": bl.filesystem_of(ws.ram_root)}
    try:
        payload = np.random.default_rng(1).bytes(s.blob_bytes)
        read = section(results, "read_path", lambda: bench_read_path(ws, s, payload))
        section(results, "save", lambda: bench_save(ws, s, payload))
        run_lookup_and_startup(ws, s, results)
        section(results, "codec", lambda: bench_codecs(s, read))
    finally:
        ws.close()
    results["section_seconds"] = results.pop("_section_seconds")
    results["targets"] = collect_targets(results)
    results["primary_targets_pass"] = all(t["pass"] for t in results["targets"] if t["primary"])
    results["all_targets_pass"] = all(t["pass"] for t in results["targets"])
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["duration_seconds"] = round(time.time() - started, 1)
    bl.emit_json(results, out_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (< 60 s)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    # A background job of a non-interactive shell starts with SIGINT ignored: restore it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(make_settings(args.quick), args.out)
    except KeyboardInterrupt:
        bl.log("interrupted: daemons stopped, temporary directories removed")
        return 130


if __name__ == "__main__":
    sys.exit(main())
