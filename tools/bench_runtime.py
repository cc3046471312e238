"""Runtime benchmark: what the prefix KV cache buys a real model, side by side in one run.

    python tools/bench_runtime.py [--quick] [--threads 1,2] [--out FILE.json] [--model PATH]

Prints ONE JSON document on stdout (progress goes to stderr): machine info (CPUs, platform,
Python, llama-cpp-python, model file and size), then per thread count:

1. ``cold`` vs ``warm_exact``: TTFT of a cold prefill of an N-token shared system prompt
   (N = 2048; 512 with ``--quick``) vs a warm *exact* hit on it, restored from the RAM tier
   of a real kvcache daemon (a child process) by an in-process :class:`Runtime`.
   Target: cold / warm >= 200x.
2. ``floor``: the same state restored in-process from a local file without the daemon
   (read the state and the scores after its last token, ``state_seq_set``, argmax of the
   scores), timed end to end on the runtime's own context and model thread: what an exact
   hit needs at least, since its first token comes from the scores stored with the entry
   (nothing is decoded). Two ways to read the file: ``numpy`` (an uninitialized buffer:
   the floor of the target) and ``bytearray`` (a zero-filled buffer). ``primer`` is the
   floor as it was while exact hits decoded their last token again (set, drop the last
   cell, decode it). The warm path maps the entry's pieces and sets them (a root stored
   as llama.cpp's bytes as it is; pieces joined into llama.cpp's format). Targets: cold /
   warm >= 300x, warm / numpy floor <= 1.1x (median of interleaved pairs).
   ``resolve_breakdown`` times the cache I/O piece by piece; ``stored_logits_bytes`` is
   what the scores add to an entry.
3. ``decode``: generation speed with ``continued`` saves every 64 tokens vs saves off
   (``finish`` saves off in both), after the cached system prompt. The headline is the
   wall-clock rate after the first token (it includes the model thread's
   ``state_seq_get`` and the background sender's CPU use); ``decode_ms`` (llama_decode
   only) is reported too. Target: with / without >= 0.95 (median of interleaved pairs).
4. ``restart_disk``: stop runtime and daemon, delete the daemon's RAM tier directory,
   drop the blob files from the page cache, restart both, request the prompt again: the
   state must come from the disk tier. Reports TTFT and its ratios to cold and warm.

Every measurement is a distribution (median, p10/p90, min/max) and the comparisons are
ratios, because the machines are shared and noisy. Cold requests use distinct prompt
variants (the cache must not help them); every warm request's hit kind and tier is checked.
A full run on 2 cores takes 6-10 minutes; ``--quick`` is a smoke run of under 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import (
    Daemon,
    cached_fraction,
    drop_tree_from_page_cache,
    emit_json,
    log,
    machine_info,
    paired_ratio,
    read_file_into_new_buffer,
    summarize,
    timed,
)
from harness.system_prompt import USER_MESSAGES, build_system_prompt

from kvcache import blob as blobfmt
from kvcache.client import CacheClient, map_file
from kvcache.store import BLOB_SUFFIX
from model_runtime.chat.templates import ChatTemplate
from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion
from model_runtime.runtime import Runtime, default_model_path

STORY_SUBJECTS = [
    "a dragon who learns to sing", "a lighthouse keeper on a distant planet",
    "two rival chefs in Paris", "a clockmaker who can pause time", "a fox who runs a library",
    "the last train across a frozen sea",
]
REQUEST_TIMEOUT_S = 900.0
NOTES = {
    "ttft_ms": "submit to first sampled token, from the Completion's timings",
    "restore_ms": "join (none for a root restored as stored) + state_seq_set + truncate",
    "prefill_ms": "for a warm exact hit: the primer, one decode of the prompt's last token",
    "resolve_ms": "ttft - restore - prefill: queueing, the Lookup RPC (which opens the "
                  "pieces) and the blob load (map, checksums, key check) on the resolver "
                  "thread",
    "ratios": "*_paired: median of per-pair ratios of interleaved runs (robust to drift)",
    "decode.wall_tok_s": "(completion tokens - 1) / (total - ttft): includes state_seq_get "
                         "of continued saves and CPU taken by the sender and the daemon",
}


@dataclass(frozen=True)
class Settings:
    prompt_tokens: int  # N: the shared system prompt, exactly this many tokens
    threads: tuple[int, ...]
    cold_repeats: int  # each a distinct prompt variant (a cold prefill of N tokens)
    warm_repeats: int  # warm exact hits, interleaved with one restore per floor variant
    decode_tokens: int  # generated tokens per decode request
    decode_pairs: int  # (with saves, without) request pairs, order alternating
    continued_interval: int
    restarts: int  # daemon + runtime restart cycles for the disk tier


FULL = Settings(prompt_tokens=2048, threads=(1, 2), cold_repeats=3, warm_repeats=10,
                decode_tokens=256, decode_pairs=4, continued_interval=64, restarts=3)
QUICK = Settings(prompt_tokens=512, threads=(1,), cold_repeats=2, warm_repeats=5,
                 decode_tokens=128, decode_pairs=1, continued_interval=64, restarts=1)


# -- statistics --------------------------------------------------------------------------------


def ms_summary(samples_ms: Sequence[float]) -> dict[str, Any]:
    """median / p10 / p90 / min / max of millisecond samples (empty: n = 0)."""
    if not samples_ms:
        return {"unit": "ms", "n": 0}
    return summarize([x / 1000 for x in samples_ms], unit="ms", tails=False)


def median(samples: Sequence[float]) -> float:
    return float(np.median(samples)) if samples else float("nan")


def safe_ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")


# -- prompts -----------------------------------------------------------------------------------


class Prompts:
    """Token lists built with the model's own tokenizer from the shared system prompt.

    ``system(i)`` is prompt variant ``i``, exactly N tokens (variant 0 is the warm one);
    ``ask(text)`` tokens that continue a system prompt with a user turn (ChatML when the
    model's template uses it, plain text otherwise)."""

    def __init__(self, runtime: Runtime, n_tokens: int) -> None:
        self.model = runtime.model
        self.n = n_tokens
        self.chatml = "<|im_start|>" in (ChatTemplate.of_model(self.model).render(
            [{"role": "user", "content": "x"}]) or "")
        self.text = build_system_prompt(int(n_tokens / 1.1) + 200)

    def system(self, variant: int) -> list[int]:
        head = "<|im_start|>system\n" if self.chatml else ""
        text = f"{head}(Handbook copy {variant}.) {self.text}"
        tokens = self.model.tokenize(text, add_special=True, parse_special=True)
        if len(tokens) < self.n:
            raise ValueError(f"system prompt has only {len(tokens)} tokens, need {self.n}")
        return tokens[: self.n]

    def ask(self, text: str) -> list[int]:
        if self.chatml:
            text = (f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
                    "<|im_start|>assistant\n")
        else:
            text = f"\n\nUser: {text}\nAssistant:"
        return self.model.tokenize(text, add_special=False, parse_special=True)


# -- the system under test -----------------------------------------------------------------------


class Bench:
    """A kvcache daemon (child process) and in-process runtimes for one thread count."""

    def __init__(self, settings: Settings, threads: int, model: Path, workdir: Path) -> None:
        self.settings = settings
        self.threads = threads
        self.model = model
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir = workdir / "data"
        shm = Path("/dev/shm")
        self.ram_parent = Path(tempfile.mkdtemp(prefix="kvbench-ram-",
                                                dir=shm if shm.is_dir() else workdir))
        self.daemon = Daemon(self.data_dir, self.ram_parent, name=f"daemon-t{threads}",
                             log_dir=workdir)
        self.ram_dir = self.daemon.ram_dir
        # reuse_live off: every warm request measures a restore from the daemon.
        self.config = RuntimeConfig(n_threads=threads, save_finish=False, reuse_live=False,
                                    continued_interval=settings.continued_interval)
        self.probe: CacheClient | None = None
        self.runtime: Runtime | None = None

    def start(self) -> None:
        log(f"threads={self.threads}: starting daemon in {self.workdir}")
        self.daemon.start()
        self.probe = CacheClient(self.daemon.address, timeout=10.0)
        self.runtime = self.new_runtime(self.config)

    def new_runtime(self, config: RuntimeConfig) -> Runtime:
        runtime = Runtime(self.model, cache_address=self.daemon.address, config=config)
        # One tiny request: the channel, the block size and llama.cpp's threads are set up
        # before anything is measured (too short to be saved).
        runtime.complete(tokens=runtime.tokenize("Hello"), max_tokens=1,
                         timeout=REQUEST_TIMEOUT_S)
        return runtime

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        self.daemon.close()
        shutil.rmtree(self.ram_parent, ignore_errors=True)

    @property
    def rt(self) -> Runtime:
        assert self.runtime is not None, "not started"
        return self.runtime

    def request(self, tokens: list[int], runtime: Runtime | None = None, **kwargs: Any
                ) -> Completion:
        rt = runtime or self.rt
        done = rt.complete(tokens=tokens, timeout=REQUEST_TIMEOUT_S, **kwargs)
        assert isinstance(done, Completion)
        rt.engine.saver.flush(60)  # a background save must not overlap the next request
        return done

    def wait_saved(self, tokens: list[int], tier: str = "ram", timeout: float = 30.0) -> str:
        """Poll the daemon until an entry of exactly ``tokens`` is published (and placed in
        ``tier``); returns the tier it was last seen in ("" if never)."""
        assert self.probe is not None
        seen = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = self.probe.lookup(self.rt.identity, tokens, max_tokens=len(tokens))
            if hit is not None and hit.matched_tokens == len(tokens):
                seen = hit.tier
                if hit.tier == tier:
                    return seen
            time.sleep(0.02)
        return seen

    def blob_path(self, key: bytes) -> Path:
        """Where the daemon keeps a blob on disk (kvcache.store's layout)."""
        return self.data_dir / "blobs" / key.hex()[:2] / f"{key.hex()}{BLOB_SUFFIX}"

    def ram_path(self, key: bytes) -> Path:
        return self.ram_dir / f"{key.hex()}{BLOB_SUFFIX}"


def timing_row(done: Completion) -> dict[str, Any]:
    t = done.timings
    resolve = t["ttft_ms"] - t["restore_ms"] - t["prefill_ms"]
    return {"hit": done.cache_hit_kind, "tier": done.cache_tier, "ttft_ms": t["ttft_ms"],
            "restore_ms": t["restore_ms"], "prefill_ms": t["prefill_ms"],
            "resolve_ms": round(resolve, 3), "first_token": done.tokens[0] if done.tokens else -1}


def rows_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: ms_summary([r[name] for r in rows]) for name in
                           ("ttft_ms", "restore_ms", "prefill_ms", "resolve_ms")}
    out["hit_kinds"] = dict(Counter(r["hit"] for r in rows))
    out["tiers"] = dict(Counter(r["tier"] or "-" for r in rows))
    return out


# -- 1. cold prefill vs warm exact hit; 2. vs the in-process floor -------------------------------


def measure_cold(bench: Bench, prompts: Prompts) -> tuple[dict[str, Any], list[int]]:
    """Cold prefills of distinct variants; each also saves its N-token system prompt.
    Returns the summary and the tokens of variant 0 (now cached, for the warm hits)."""
    rows = []
    suffix = prompts.ask(USER_MESSAGES[0])
    for variant in range(bench.settings.cold_repeats):
        system = prompts.system(variant)
        done = bench.request(system + suffix, prefix_tokens=len(system), max_tokens=1)
        row = timing_row(done)
        row["saves"] = [(s["reason"], s["tokens"]) for s in done.saves]
        rows.append(row)
        log(f"  cold #{variant}: {row['hit']} ttft {row['ttft_ms']:.0f} ms "
            f"(prefill {row['prefill_ms']:.0f} ms), saves {row['saves']}")
    out = rows_summary(rows)
    out["prompt_tokens"] = prompts.n + len(suffix)
    out["samples"] = rows
    return out, prompts.system(0)


def read_numpy(path: Path) -> np.ndarray:
    """The lean read: an uninitialized numpy buffer (no zero-fill; numpy asks for huge
    pages) filled by one ``readinto``."""
    buf = np.empty(path.stat().st_size, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        if f.readinto(memoryview(buf)) != len(buf):
            raise RuntimeError(f"short read of {path}")
    return buf


def read_bytearray(path: Path) -> bytearray:
    """The read kvcache.client does for a local load: ``bytearray(size)`` + ``readinto``."""
    return read_file_into_new_buffer(path, path.stat().st_size)


#: How the floor reads its state file ("numpy": the floor the target is measured against),
#: and whether it decodes the last token again instead of reading the stored scores.
FLOOR_READS: dict[str, tuple[Callable[[Path], Any], bool]] = {
    "numpy": (read_numpy, False), "bytearray": (read_bytearray, False),
    "primer": (read_numpy, True)}


def floor_restore(bench: Bench, path: Path, tokens: list[int], read: Callable[[Path], Any],
                  primer: bool) -> dict[str, float | int]:
    """Read a state file and the scores after its last token, set the state into a spare
    sequence and take the argmax of the scores (``primer``: drop the last cell, decode it
    and take the argmax of its scores instead): on the model thread, timed end to end,
    then clear the sequence."""
    rt = bench.rt
    ctx = rt.ctx
    n = len(tokens)
    scores_path = path.with_suffix(".scores")

    def run() -> dict[str, float | int]:
        spare = [s.id for s in rt.engine.seqs if s.request is None and not s.session][-1]
        t0 = time.perf_counter()
        data = read(path)
        scores = None if primer else np.frombuffer(read(scores_path), dtype="<f4")
        t1 = time.perf_counter()
        ok = ctx.state_seq_set(spare, data) > 0
        t2 = time.perf_counter()
        if primer:
            ok = ok and ctx.seq_truncate(spare, n - 1)
            ctx.decode([tokens[-1]], [n - 1], [spare], [True])
            scores = ctx.logits(0)
        t3 = time.perf_counter()
        token = int(np.argmax(scores))
        t4 = time.perf_counter()
        ctx.seq_clear(spare)
        if not ok:
            raise RuntimeError("floor restore was rejected by llama.cpp")
        return {"total_ms": (t4 - t0) * 1e3, "read_ms": (t1 - t0) * 1e3,
                "set_ms": (t2 - t1) * 1e3, "primer_ms": (t3 - t2) * 1e3,
                "first_token": token}

    return rt.engine.call(run)


def capture_state(bench: Bench, tokens: list[int], path: Path, repeats: int = 5
                  ) -> dict[str, Any]:
    """Write the state of exactly ``tokens`` to ``path``, from ``ctx.state_seq_get`` of a
    session sequence that holds them (an exact hit with ``max_tokens=1`` leaves it so).
    ``state_seq_get`` is timed ``repeats`` times: it is what a save costs the model thread."""
    rt = bench.rt
    session = "bench-floor"
    done = bench.request(tokens, session_id=session, max_tokens=1)
    seq = rt.engine.sessions[rt.config.tenant, session]

    def get() -> tuple[bytes, list[float], int, bytes]:
        times = []
        state = b""
        for _ in range(repeats):
            seconds, state = timed(lambda: rt.ctx.state_seq_get(seq.id))
            times.append(seconds * 1e3)
        scores = seq.logits[len(tokens)].astype("<f4").tobytes()
        return state, times, len(seq.tokens), scores

    state, times, held, scores = rt.engine.call(get)
    if held != len(tokens):
        raise RuntimeError(f"session sequence holds {held} tokens, expected {len(tokens)}")
    path.write_bytes(state)
    path.with_suffix(".scores").write_bytes(scores)
    return {"hit": done.cache_hit_kind, "state_bytes": len(state),
            "stored_logits_bytes": len(scores),
            "stored_logits_over_state": round(len(scores) / len(state), 5),
            "state_seq_get_ms": ms_summary(times)}


def resolve_breakdown(bench: Bench, tokens: list[int], repeats: int) -> dict[str, Any]:
    """The cache I/O of a warm hit, piece by piece, from this process, as the runtime's
    resolver does it: the Lookup RPC that also opens the pieces, the load of the chain
    (map, checksums, key check; the read pins are released in the background), and on
    its own ``decode_blob`` of a freshly mapped RAM-tier file (its checksum pass faults
    the pages in)."""
    probe = bench.probe
    assert probe is not None
    identity = bench.rt.identity
    rows: dict[str, list[float]] = {"lookup_ms": [], "load_ms": [], "decode_blob_ms": []}
    key = b""
    for _ in range(repeats):
        t, hit = timed(lambda: probe.lookup(identity, tokens, max_tokens=len(tokens),
                                            common_prefix=True, open_min_tokens=1))
        rows["lookup_ms"].append(t * 1e3)
        assert hit is not None
        key = hit.key
        t, _chain = timed(lambda: probe.load_chain(  # noqa: B023
            hit.key, prefix_of=tokens, shares=hit.matched_tokens,  # noqa: B023
            pieces=hit.pieces_for(hit.matched_tokens), block_size=hit.block_size))  # noqa: B023
        rows["load_ms"].append(t * 1e3)
        del _chain
        path = bench.ram_path(key)
        if path.exists():
            with open(path, "rb", buffering=0) as f:
                mapped = map_file(f, path.stat().st_size)
            t, _ = timed(lambda: blobfmt.decode_blob(mapped))  # noqa: B023
            rows["decode_blob_ms"].append(t * 1e3)
            del mapped, _  # unmapped
    out = {name: ms_summary(values) for name, values in rows.items()}
    out["key"] = key.hex()
    return out


def measure_warm_and_floor(bench: Bench, tokens: list[int], cold_ttft_ms: float
                           ) -> dict[str, Any]:
    tier = bench.wait_saved(tokens, "ram")
    log(f"  entry of {len(tokens)} tokens published (tier {tier or 'none'})")
    floor_file = bench.ram_parent / "floor.state"
    capture = capture_state(bench, tokens, floor_file)
    warm: list[dict[str, Any]] = []
    floors: dict[str, list[dict[str, float | int]]] = {name: [] for name in FLOOR_READS}

    def warm_step() -> None:
        warm.append(timing_row(bench.request(tokens, max_tokens=1)))

    def floor_step(name: str) -> Callable[[], None]:
        return lambda: floors[name].append(
            floor_restore(bench, floor_file, tokens, *FLOOR_READS[name]))

    steps = [warm_step, *(floor_step(name) for name in FLOOR_READS)]
    try:
        for i in range(bench.settings.warm_repeats):
            # interleaved, order rotating: drift in machine load hits all alike
            for step in steps[i % len(steps):] + steps[: i % len(steps)]:
                step()
    finally:
        floor_file.unlink(missing_ok=True)
        floor_file.with_suffix(".scores").unlink(missing_ok=True)
    bad = [r for r in warm if r["hit"] != "exact"]
    if bad:
        log(f"  WARNING: {len(bad)} warm requests were not exact hits: {bad}")
    warm_ttft = [r["ttft_ms"] for r in warm]
    floor_total = {name: [float(f["total_ms"]) for f in rows] for name, rows in floors.items()}
    log(f"  warm exact ttft median {median(warm_ttft):.1f} ms, floor medians " + ", ".join(
        f"{name} {median(v):.1f} ms" for name, v in floor_total.items()))
    return {
        "warm_exact": {**rows_summary(warm), "all_exact": not bad, "samples": warm},
        "floor": {name: floor_summary(rows, warm) for name, rows in floors.items()},
        "state_capture": {**capture, "state_file_dir": str(floor_file.parent)},
        "resolve_breakdown": resolve_breakdown(bench, tokens, bench.settings.warm_repeats),
        "ratios": {
            "cold_over_warm_median": safe_ratio(cold_ttft_ms, median(warm_ttft)),
            **{f"warm_over_floor_{name}_paired": paired_ratio(
                [x / 1e3 for x in warm_ttft], [x / 1e3 for x in totals])
               for name, totals in floor_total.items()},
            **{f"warm_over_floor_{name}_median": safe_ratio(median(warm_ttft), median(totals))
               for name, totals in floor_total.items()},
        },
    }


def floor_summary(rows: list[dict[str, float | int]], warm: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    out: dict[str, Any] = {name: ms_summary([float(f[name]) for f in rows]) for name in
                           ("total_ms", "read_ms", "set_ms", "primer_ms")}
    out["same_first_token_as_warm"] = all(
        f["first_token"] == w["first_token"] for f, w in zip(rows, warm, strict=True))
    return out


# -- 3. decode speed with continued saves vs without ---------------------------------------------


def decode_row(done: Completion) -> dict[str, Any]:
    t = done.timings
    n = len(done.tokens)
    after_first_ms = t["total_ms"] - t["ttft_ms"]
    steps = max(n - 1, 1)  # the first token comes from the prompt's last logits
    return {"completion_tokens": n, "finish_reason": done.finish_reason,
            "hit": done.cache_hit_kind, "ttft_ms": t["ttft_ms"], "decode_ms": t["decode_ms"],
            "after_first_ms": round(after_first_ms, 3),
            # model-thread time after the first token outside llama_decode: sampling, and
            # for the runtime that saves, state_seq_get of every continued save
            "outside_decode_ms": round(after_first_ms - t["decode_ms"], 3),
            "wall_tok_s": round(steps / after_first_ms * 1e3, 3) if after_first_ms else 0.0,
            "decode_tok_s": round(steps / t["decode_ms"] * 1e3, 3) if t["decode_ms"] else 0.0,
            "saves": [(s["reason"], s["tokens"]) for s in done.saves]}


def decode_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "wall_tok_s": {"median": round(median([r["wall_tok_s"] for r in rows]), 3),
                       "min": min(r["wall_tok_s"] for r in rows),
                       "max": max(r["wall_tok_s"] for r in rows)},
        "decode_tok_s": {"median": round(median([r["decode_tok_s"] for r in rows]), 3),
                         "min": min(r["decode_tok_s"] for r in rows),
                         "max": max(r["decode_tok_s"] for r in rows)},
        "outside_decode_ms": ms_summary([r["outside_decode_ms"] for r in rows]),
        "completion_tokens": [r["completion_tokens"] for r in rows],
        "samples": rows,
    }


def measure_decode(bench: Bench, prompts: Prompts, system: list[int]) -> dict[str, Any]:
    """Pairs of identical greedy requests (same subject) on the runtime: continued saves
    every ``continued_interval`` tokens vs none, its config switched between requests. (A
    second runtime in this process would slow both: see the README's "One runtime per
    process".)"""
    s = bench.settings
    rt = bench.rt
    configs = {"with_saves": bench.config,
               "without_saves": replace(bench.config, continued_interval=0)}
    rows: dict[str, list[dict[str, Any]]] = {"with_saves": [], "without_saves": []}
    try:
        for i in range(s.decode_pairs):
            ask = f"Write a very long story about {STORY_SUBJECTS[i % len(STORY_SUBJECTS)]}. " \
                  "Use many chapters and describe everything in detail."
            tokens = system + prompts.ask(ask)
            names = ["with_saves", "without_saves"]
            for name in names if i % 2 == 0 else names[::-1]:
                rt.engine.config = configs[name]
                row = decode_row(bench.request(tokens, prefix_tokens=len(system),
                                               max_tokens=s.decode_tokens))
                rows[name].append(row)
                log(f"  decode {name} #{i}: {row['completion_tokens']} tokens "
                    f"{row['wall_tok_s']:.1f} tok/s wall ({row['decode_tok_s']:.1f} in decode), "
                    f"hit {row['hit']}, saves {row['saves']}")
    finally:
        rt.engine.config = bench.config
    wall_with = [1 / r["wall_tok_s"] for r in rows["with_saves"]]
    wall_without = [1 / r["wall_tok_s"] for r in rows["without_saves"]]
    dec_with = [1 / r["decode_tok_s"] for r in rows["with_saves"]]
    dec_without = [1 / r["decode_tok_s"] for r in rows["without_saves"]]
    short = [r["completion_tokens"] for rs in rows.values() for r in rs
             if r["completion_tokens"] < s.decode_tokens]
    n_saves = median([len(r["saves"]) for r in rows["with_saves"]])
    extra = median([r["outside_decode_ms"] for r in rows["with_saves"]]) - median(
        [r["outside_decode_ms"] for r in rows["without_saves"]])
    return {
        "max_tokens": s.decode_tokens, "continued_interval": s.continued_interval,
        "saves_per_request": n_saves,
        "outside_decode_ms_per_save": round(extra / n_saves, 3) if n_saves else None,
        "prompt_tokens": len(tokens), "all_full_length": not short,
        "with_saves": decode_summary(rows["with_saves"]),
        "without_saves": decode_summary(rows["without_saves"]),
        "ratios": {  # throughput with saves / without (per pair: time without / time with)
            "wall_paired": paired_ratio(wall_without, wall_with),
            "decode_only_paired": paired_ratio(dec_without, dec_with),
        },
    }


# -- 4. warm TTFT from the disk tier after a restart ---------------------------------------------


def restart_cycle(bench: Bench, tokens: list[int]) -> dict[str, Any]:
    """Stop runtime and daemon, delete the RAM tier, drop blobs from the page cache,
    restart both and request ``tokens`` (an exact hit expected from disk)."""
    key = bench.rt.engine.key_of(tokens)
    bench.rt.close()
    bench.runtime = None
    bench.daemon.stop()
    shutil.rmtree(bench.ram_dir, ignore_errors=True)
    dropped = drop_tree_from_page_cache(bench.data_dir / "blobs")
    blob = bench.blob_path(key)
    cached_before = cached_fraction(blob)
    bench.daemon.start()
    t_start, bench.runtime = timed(lambda: bench.new_runtime(bench.config))
    cached_after_start = cached_fraction(blob)
    first = timing_row(bench.request(tokens, max_tokens=1))
    again_tier = bench.wait_saved(tokens, "ram", timeout=10.0)
    second = timing_row(bench.request(tokens, max_tokens=1))
    log(f"  restart: {first['hit']} from {first['tier'] or '-'} ttft {first['ttft_ms']:.1f} ms "
        f"(page cache {cached_before} -> {cached_after_start}); next from "
        f"{second['tier'] or '-'} {second['ttft_ms']:.1f} ms")
    return {"first": first, "second": second, "promoted_tier": again_tier,
            "files_dropped_from_page_cache": dropped,
            "blob_page_cache_fraction_before_request": cached_after_start,
            "blob_page_cache_fraction_after_drop": cached_before,
            "runtime_start_s": round(t_start, 3)}


def measure_restart(bench: Bench, tokens: list[int], cold_ms: float, warm_ms: float
                    ) -> dict[str, Any]:
    cycles = [restart_cycle(bench, tokens) for _ in range(bench.settings.restarts)]
    firsts = [c["first"] for c in cycles]
    disk_ttft = median([r["ttft_ms"] for r in firsts])
    return {
        "first_request": rows_summary(firsts),
        "second_request": rows_summary([c["second"] for c in cycles]),
        "exact_from_disk_fraction": round(sum(r["hit"] == "exact" and r["tier"] == "disk"
                                              for r in firsts) / len(firsts), 3),
        "ratios": {"cold_over_disk": safe_ratio(cold_ms, disk_ttft),
                   "disk_over_warm": safe_ratio(disk_ttft, warm_ms)},
        "cycles": cycles,
    }


# -- driver --------------------------------------------------------------------------------------


def run_threads(settings: Settings, threads: int, model: Path, root: Path,
                decode_only: bool = False) -> dict[str, Any]:
    bench = Bench(settings, threads, model, root / f"t{threads}")
    started = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    try:
        bench.start()
        prompts = Prompts(bench.rt, settings.prompt_tokens)
        log(f"threads={threads}: cold prefills of {settings.prompt_tokens}-token prompts")
        cold, system = measure_cold(bench, prompts)
        cold_ms = cold["ttft_ms"]["median"]
        sections: dict[str, Any] = {}
        if not decode_only:
            log(f"threads={threads}: warm exact hits vs the in-process floor")
            sections.update(measure_warm_and_floor(bench, system, cold_ms))
        log(f"threads={threads}: decode with continued saves vs without")
        sections["decode"] = measure_decode(bench, prompts, system)
        if not decode_only:
            log(f"threads={threads}: restarts, disk tier")
            sections["restart_disk"] = measure_restart(
                bench, system, cold_ms, sections["warm_exact"]["ttft_ms"]["median"])
        daemon_stats = daemon_counters(bench)
    finally:
        bench.close()
    return {"threads": threads, "loadavg_at_start": load_at_start, "cold": cold, **sections,
            "daemon_counters": daemon_stats,
            "elapsed_s": round(time.perf_counter() - started, 1)}


def daemon_counters(bench: Bench) -> dict[str, int]:
    assert bench.probe is not None
    with contextlib.suppress(Exception):
        return dict(sorted(bench.probe.stats().counters.items()))
    return {}


def check(name: str, value: float, op: str, limit: float) -> dict[str, Any]:
    ok = value >= limit if op == ">=" else value <= limit
    return {"name": name, "value": value, "limit": f"{op} {limit}", "pass": bool(ok)}


def targets_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    t = result["threads"]
    decode = [check(f"t{t}: decode speed with continued saves / without (paired, wall)",
                    result["decode"]["ratios"]["wall_paired"], ">=", 0.95)]
    if "restart_disk" not in result:  # --decode-only
        return decode
    return [
        check(f"t{t}: cold TTFT / warm exact TTFT", result["ratios"]["cold_over_warm_median"],
              ">=", 300.0),
        check(f"t{t}: warm exact TTFT / in-process floor (paired)",
              result["ratios"]["warm_over_floor_numpy_paired"], "<=", 1.1),
        *decode,
        check(f"t{t}: restarts that served an exact hit from the disk tier (fraction)",
              result["restart_disk"]["exact_from_disk_fraction"], ">=", 1.0),
    ]


def model_info(path: Path) -> dict[str, Any]:
    return {"path": str(path), "file": path.name, "bytes": path.stat().st_size}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of under 2 minutes")
    parser.add_argument("--threads", default=None,
                        help="comma-separated thread counts (default 1,2; --quick: 1)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M)")
    parser.add_argument("--decode-only", action="store_true",
                        help="measure only decode with continued saves vs without")
    parser.add_argument("--decode-pairs", type=int, default=None,
                        help="request pairs for the decode measurement (default 4; --quick: 1)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.threads:
        settings = replace(settings, threads=tuple(int(x) for x in args.threads.split(",")))
    if args.decode_pairs:
        settings = replace(settings, decode_pairs=args.decode_pairs)
    model = args.model or default_model_path()
    started = time.perf_counter()
    machine = machine_info()
    machine["llama_cpp_python"] = importlib.metadata.version("llama_cpp_python")
    machine["model"] = model_info(model)
    root = Path(tempfile.mkdtemp(prefix="kvbench-rt-", dir="/tmp"))
    results: list[dict[str, Any]] = []
    try:
        for threads in settings.threads:
            results.append(run_threads(settings, threads, model, root, args.decode_only))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = {
        "benchmark": "bench_runtime", "mode": "quick" if args.quick else "full",
        "settings": asdict(settings), "notes": NOTES, "machine": machine,
        "targets": [check for r in results for check in targets_of(r)],
        "results": {f"threads_{r['threads']}": r for r in results},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
