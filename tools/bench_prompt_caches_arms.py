"""The arms of tools/bench_prompt_caches.py, each serving the shared-system-prompt
requests its own way and timed to the first token: llama-cpp-python's ``Llama`` without a
cache and with its RAM and disk caches (1b, 2, 3), our Runtime without a cache (1), with
the kvcache daemon's RAM and disk tiers (4, 5), and the in-process floor (6)."""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from benchlib import log as bench_log
from benchlib import summary_ms
from ttft_harness import (
    KvStack,
    Message,
    Settings,
    Workload,
    chat_tokens,
    new_runtime,
    runtime_config,
    stream_runtime,
)

from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
from model_runtime.request import Completion
from model_runtime.runtime import Runtime


def log(message: str) -> None:
    bench_log(message, "bench_prompt_caches")


# -- timing one request ------------------------------------------------------------------------


@dataclass
class Sample:
    message: int
    ttft_ms: float
    e2e_ms: float
    text: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def time_llama(rig: LlamaRig, messages: list[Message], max_tokens: int, message: int
               ) -> Sample:
    """One streamed chat completion on a context that holds nothing (``reset()`` first)."""
    llm = rig.llm
    llm.reset()
    rig.take()
    quiet = isinstance(llm.cache, llama_cpp.LlamaDiskCache)
    sink = contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext()
    text: list[str] = []
    first = last = 0.0
    with sink:  # LlamaDiskCache prints on every save
        t0 = time.perf_counter()
        for chunk in llm.create_chat_completion(messages, max_tokens=max_tokens,
                                                temperature=0.0, stream=True):
            content = chunk["choices"][0]["delta"].get("content")
            if content:
                last = time.perf_counter()
                first = first or last
                text.append(content)
        end = time.perf_counter()
    first = first or end  # no content at all (an immediate end of generation)
    return Sample(message, (first - t0) * 1e3, (end - t0) * 1e3, "".join(text),
                  {"after_last_chunk_ms": round((end - (last or end)) * 1e3, 2),
                   "n_tokens_in_context": llm.n_tokens, **rig.take()})


def time_runtime(rt: Runtime, messages: list[Message], max_tokens: int, message: int
                 ) -> tuple[Sample, Completion]:
    ttft_ms, e2e_ms, done = stream_runtime(rt, max_tokens, messages=messages)
    t = done.timings
    info = {"hit": done.cache_hit_kind, "tier": done.cache_tier,
            "tokens_read": done.cache_delta["tokens_read"], "prompt_tokens": done.prompt_tokens,
            "engine_ttft_ms": t["ttft_ms"], "restore_ms": t["restore_ms"],
            "prefill_ms": t["prefill_ms"], "saves": [(s["reason"], s["tokens"])
                                                     for s in done.saves]}
    return Sample(message, ttft_ms, e2e_ms, done.text, info), done


def describe(arm: str, s: Sample) -> str:
    extra = ""
    if "hit" in s.info:
        extra = f" {s.info['hit']}/{s.info['tier'] or '-'} read {s.info['tokens_read']}"
    return f"  arm {arm} msg {s.message}: ttft {s.ttft_ms:.0f} ms, e2e {s.e2e_ms:.0f} ms{extra}"


def arm_result(samples: list[Sample], **extra: Any) -> dict[str, Any]:
    return {"ttft_ms": summary_ms([s.ttft_ms for s in samples]),
            "e2e_ms": summary_ms([s.e2e_ms for s in samples]), **extra,
            "samples": [asdict(s) for s in samples]}


# -- arms 1b, 2, 3: llama-cpp-python's high-level Llama ------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class TimedGet:
    """Mixin for llama-cpp-python's caches: records how long ``cache[tokens]`` took (the
    longest-prefix scan, plus unpickling for the disk cache)."""

    get_ms: float = 0.0

    def __getitem__(self, key: Sequence[int]) -> Any:
        t0 = time.perf_counter()
        try:
            return super().__getitem__(key)  # type: ignore[misc]
        finally:
            self.get_ms += (time.perf_counter() - t0) * 1e3


class TimedRAMCache(TimedGet, llama_cpp.LlamaRAMCache):
    pass


class TimedDiskCache(TimedGet, llama_cpp.LlamaDiskCache):
    pass


@dataclass
class LlamaRig:
    """The high-level ``Llama`` with its ``load_state``/``save_state`` timed per request
    (instance-level wrappers: the library's code paths are unchanged)."""

    llm: llama_cpp.Llama
    ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("load_state", "save_state"):
            setattr(self.llm, name, self._timed(name, getattr(self.llm, name)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.ms[f"{name}_ms"] = self.ms.get(f"{name}_ms", 0.0) + (
                    time.perf_counter() - t0) * 1e3
        return call

    def take(self) -> dict[str, float]:
        """The cache steps of the last request, in ms (and reset them)."""
        cache = self.llm.cache
        if isinstance(cache, TimedGet):
            self.ms["cache_get_ms"] = cache.get_ms
            cache.get_ms = 0.0
        out = {k: round(v, 2) for k, v in self.ms.items()}
        self.ms = {}
        return out


def new_llama(model_path: Path, st: Settings) -> LlamaRig:
    llm = llama_cpp.Llama(str(model_path), n_ctx=st.n_ctx, n_threads=st.threads,
                          n_threads_batch=st.threads, verbose=False)
    llm.create_completion("Hello", max_tokens=1)  # sets up threads before any measurement
    return LlamaRig(llm)


def arm_llama_cold(rig: LlamaRig, wl: Workload, st: Settings) -> dict[str, Any]:
    rig.llm.set_cache(None)
    samples = []
    for i in range(st.cold_repeats):
        samples.append(time_llama(rig, wl.messages(i), st.max_tokens, i))
        log(describe("1b", samples[-1]))
    return arm_result(samples, bytes_stored=None)


def arm_llama_cache(arm: str, rig: LlamaRig, wl: Workload, st: Settings,
                    cache: llama_cpp.BaseLlamaCache, size: Callable[[], int]) -> dict[str, Any]:
    """Message 0 fills the cache (cold); messages 1..repeats restore from it."""
    rig.llm.set_cache(cache)
    try:
        fill = time_llama(rig, wl.messages(0), st.max_tokens, 0)
        log(describe(arm, fill) + " (fills the cache)")
        after_fill = size()
        samples = []
        for i in range(1, st.repeats + 1):
            samples.append(time_llama(rig, wl.messages(i), st.max_tokens, i))
            log(describe(arm, samples[-1]))
    finally:
        rig.llm.set_cache(None)
    steps = {name: summary_ms([s.info.get(name, 0.0) for s in samples])
             for name in ("cache_get_ms", "load_state_ms", "save_state_ms")}
    return arm_result(samples, fill_request=asdict(fill), cache_steps=steps,
                      bytes_stored={"after_first_request": after_fill, "at_end": size(),
                                    **entry_facts(cache)})


def entry_facts(cache: llama_cpp.BaseLlamaCache) -> dict[str, Any]:
    """What llama-cpp-python keeps per entry: the whole context state after prompt +
    completion, plus a copy of the logits buffer (``LlamaState.scores``)."""
    if isinstance(cache, llama_cpp.LlamaRAMCache):
        states = list(cache.cache_state.values())
        return {"entries_at_end": len(states),
                "llama_state_bytes_per_entry": int(states[-1].llama_state_size),
                "scores_bytes_per_entry": int(states[-1].scores.nbytes),
                "held_in_ram_at_end": sum(int(x.llama_state_size) + x.scores.nbytes
                                          + x.input_ids.nbytes for x in states),
                "note": "cache_size (after_first_request, at_end) counts only the llama.cpp "
                        "state; every request adds an entry of its prompt + completion"}
    assert isinstance(cache, llama_cpp.LlamaDiskCache)
    return {"entries_at_end": len(cache.cache),
            "note": "bytes of the diskcache directory (pickled LlamaState: state + logits "
                    "copy); an entry is deleted when it is read, the request saves a new one"}


def arm_llama_ram(rig: LlamaRig, wl: Workload, st: Settings) -> dict[str, Any]:
    cache = TimedRAMCache(capacity_bytes=16 << 30)
    return arm_llama_cache("2", rig, wl, st, cache, lambda: int(cache.cache_size))


def arm_llama_disk(rig: LlamaRig, wl: Workload, st: Settings, workdir: Path
                   ) -> dict[str, Any]:
    cache_dir = workdir / f"llama-disk-cache-{wl.target_tokens}"
    cache = TimedDiskCache(cache_dir=str(cache_dir), capacity_bytes=16 << 30)
    try:
        return arm_llama_cache("3", rig, wl, st, cache, lambda: dir_bytes(cache_dir))
    finally:
        cache.cache.close()
        shutil.rmtree(cache_dir, ignore_errors=True)


def run_llama_arms(rig: LlamaRig, wl: Workload, st: Settings, workdir: Path
                   ) -> dict[str, Any]:
    log(f"{wl.target_tokens}: arm 1b, Llama without a cache")
    out = {"1b": arm_llama_cold(rig, wl, st)}
    log(f"{wl.target_tokens}: arm 2, Llama + LlamaRAMCache")
    out["2"] = arm_llama_ram(rig, wl, st)
    log(f"{wl.target_tokens}: arm 3, Llama + LlamaDiskCache")
    out["3"] = arm_llama_disk(rig, wl, st, workdir)
    return out


# -- arms 1, 4, 5: our Runtime, without and with the kvcache daemon ------------------------------

def arm_runtime_cold(model: Path, wl: Workload, st: Settings) -> dict[str, Any]:
    rt = new_runtime(model, st, None, reuse_live=False)  # every request a full prefill
    samples = []
    try:
        for i in range(st.cold_repeats):
            sample, _ = time_runtime(rt, wl.messages(i), st.max_tokens, i)
            samples.append(sample)
            log(describe("1", sample))
    finally:
        rt.close()
    return arm_result(samples, bytes_stored=None)



def kv_request(stack: KvStack, wl: Workload, i: int) -> Sample:
    sample, _ = time_runtime(stack.rt, wl.messages(i), stack.settings.max_tokens, i)
    # background saves must not overlap the next request
    stack.rt.engine.saver.flush(120)
    return sample


def stored_bytes(entries: list[dict[str, Any]], prefix_tokens: int) -> dict[str, Any]:
    prefix = [e for e in entries if e["reason"] == "cold" and e["n_tokens"] == prefix_tokens]
    return {"system_prompt_entry": prefix[0]["size"] if prefix else None,
            "all_entries": sum(e["size"] for e in entries), "entries": len(entries),
            "note": "the cold save of the system prompt, plus one finish save per request"}


def run_kvcache_arms(model_path: Path, model: LlamaModel, wl: Workload, st: Settings,
                     workdir: Path) -> dict[str, Any]:
    """Arms 4, 6 and 5, in that order. The floor's requests run as a block of their own
    while the daemon is idle: interleaved with kvcache requests they would inherit the
    page-fault cost of the memory those requests churn (see ``fresh_memory_probe``)."""
    floor = Floor(model, st)
    try:
        log(f"{wl.target_tokens}: arm 6 holds the system-prompt state in memory")
        floor.hold(wl)
        log(f"{wl.target_tokens}: arm 4, kvcache RAM tier")
        stack = KvStack(model_path, st, workdir / f"kv-{wl.target_tokens}")
        try:
            stack.start()
            out = {"4": measure_warm(stack, wl, st, floor.prefix)}
            log(f"{wl.target_tokens}: arm 6, the in-process floor")
            out["6"] = measure_floor(floor, wl, st)
            log(f"{wl.target_tokens}: arm 5, kvcache disk tier after restarts")
            out["5"] = measure_disk(stack, wl, st, len(floor.prefix))
        finally:
            stack.close()
    finally:
        floor.close()
    return out


def measure_warm(stack: KvStack, wl: Workload, st: Settings, prefix: list[int]
                 ) -> dict[str, Any]:
    fill = kv_request(stack, wl, 0)
    log(describe("4", fill) + " (fills the cache)")
    tier = stack.wait_in_ram(prefix)
    warm: list[Sample] = []
    for i in range(1, st.repeats + 1):
        warm.append(kv_request(stack, wl, i))
        log(describe("4", warm[-1]))
    cold_save = [n for reason, n in fill.info["saves"] if reason == "cold"]
    return arm_result(warm, fill_request=asdict(fill), prefix_entry_tier=tier,
                      cold_save_is_system_prompt=cold_save == [len(prefix)],
                      engine=engine_summary(warm),
                      bytes_stored=stored_bytes(stack.entries(), len(prefix)))


def measure_floor(floor: Floor, wl: Workload, st: Settings) -> dict[str, Any]:
    samples = []
    for i in range(1, st.repeats + 1):
        samples.append(floor.request(wl, i))
        log(describe("6", samples[-1]))
    return arm_result(samples, **floor.facts())


def measure_disk(stack: KvStack, wl: Workload, st: Settings, n_prefix: int) -> dict[str, Any]:
    disk: list[Sample] = []
    restarts = []
    for i in range(st.repeats + 1, 2 * st.repeats + 1):
        restarts.append(stack.restart_cold_ram())
        disk.append(kv_request(stack, wl, i))
        log(describe("5", disk[-1]))
    return arm_result(disk, restarts=restarts, engine=engine_summary(disk),
                      bytes_stored=stored_bytes(stack.entries(), n_prefix))


def engine_summary(samples: list[Sample]) -> dict[str, Any]:
    """The runtime's own split of TTFT: restore (cache load + set) and suffix prefill."""
    return {name: summary_ms([s.info[name] for s in samples])
            for name in ("engine_ttft_ms", "restore_ms", "prefill_ms")}


# -- arm 6: the floor ------------------------------------------------------------------------------


class Floor:
    """A ``LlamaContext`` with the runtime's settings holding the system-prompt state in
    memory; a request is ``state_seq_set`` + prefill of the user suffix + argmax."""

    def __init__(self, model: LlamaModel, st: Settings) -> None:
        cfg = runtime_config(st)
        self.model = model
        self.ctx = LlamaContext(model, ContextParams(
            n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_batch,
            n_seq_max=cfg.n_seq_max, n_threads=cfg.n_threads, type_k=cfg.type_k,
            type_v=cfg.type_v, flash_attn=cfg.flash_attn))
        self.prefix: list[int] = []
        self.state = b""
        self.timings: dict[str, float] = {}

    def hold(self, wl: Workload) -> None:
        tokens, boundary = chat_tokens(self.model, wl.messages(0))
        self.prefix = tokens[:boundary]
        t0 = time.perf_counter()
        prefill(self.ctx, self.prefix, 0)
        t1 = time.perf_counter()
        self.state = self.ctx.state_seq_get(0)
        t2 = time.perf_counter()
        self.ctx.seq_clear(0)
        self.timings = {"prefix_prefill_ms": round((t1 - t0) * 1e3, 1),
                        "state_get_ms": round((t2 - t1) * 1e3, 2)}

    def request(self, wl: Workload, message: int) -> Sample:
        tokens, boundary = chat_tokens(self.model, wl.messages(message))
        if tokens[:boundary] != self.prefix:
            raise RuntimeError("the system prompt must be the shared prefix")
        n = len(self.prefix)
        t0 = time.perf_counter()
        if self.ctx.state_seq_set(0, self.state) == 0:
            raise RuntimeError("llama.cpp rejected the floor state")
        t1 = time.perf_counter()
        last = prefill(self.ctx, tokens[n:], n)
        token = int(np.argmax(self.ctx.logits(last)))
        t2 = time.perf_counter()
        self.ctx.seq_clear(0)
        piece = self.model.token_to_piece(token).decode("utf-8", errors="replace")
        return Sample(message, (t2 - t0) * 1e3, (t2 - t0) * 1e3, piece,
                      {"set_ms": round((t1 - t0) * 1e3, 2), "suffix_tokens": len(tokens) - n,
                       "suffix_prefill_ms": round((t2 - t1) * 1e3, 2), "first_token": token})

    def facts(self) -> dict[str, Any]:
        return {"prefix_tokens": len(self.prefix), "bytes_stored": len(self.state),
                **self.timings, "note": "end-to-end = TTFT: the floor stops at the first token"}

    def close(self) -> None:
        self.ctx.close()


def prefill(ctx: LlamaContext, tokens: Sequence[int], start: int) -> int:
    """Decode ``tokens`` at positions ``start``.. of sequence 0 in ``n_batch`` chunks;
    returns the batch index of the last token's logits in the last decode."""
    for lo in range(0, len(tokens), ctx.n_batch):
        chunk = tokens[lo: lo + ctx.n_batch]
        n = len(chunk)
        ctx.decode(chunk, range(start + lo, start + lo + n), [0] * n,
                   [False] * (n - 1) + [lo + n == len(tokens)])
    return (len(tokens) - 1) % ctx.n_batch


