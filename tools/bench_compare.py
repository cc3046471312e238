"""Side-by-side TTFT benchmark: kvcache vs llama-cpp-python's own prompt caches.

    python tools/bench_compare.py [--quick] [--threads 2] [--repeats N] [--out-dir docs]
                                   [--no-wait] [--replot]

Workload: a shared system prompt of about 1,000, 2,000 and 4,000 tokens (built with
``tools/system_prompt.build_system_prompt`` and measured with SmolLM2's own chat template),
each followed by different user messages, on SmolLM2-135M-Instruct, greedy, ``max_tokens``
8 (time to first token is the subject). Every user message starts with a different word, so
a saved state can only ever share the system prompt (plus the ``<|im_start|>user`` line)
with a later request, in every arm alike.

Arms (all in this process except the kvcache daemon, all with the same thread count):

1.  no cache, our ``Runtime(cache_address=None)``: a cold prefill every time;
1b. no cache, llama-cpp-python's ``Llama.create_chat_completion`` (the base of arms 2, 3);
2.  ``Llama`` + ``LlamaRAMCache``: the first request fills it, later ones restore from it;
3.  ``Llama`` + ``LlamaDiskCache`` (a ``diskcache`` directory), the same;
4.  kvcache, RAM tier: a daemon child process and an in-process ``Runtime``; the first
    request is cold (it saves the system prompt), later ones are partial hits;
5.  kvcache, disk tier: stop runtime and daemon, delete the RAM tier directory, drop the
    blob files from the page cache, restart both, send one request (a partial hit that must
    come from disk); one restart per repeat;
6.  the floor: a ``LlamaContext`` with the runtime's settings holds the system-prompt state
    (``state_seq_get``) in memory; per repeat ``state_seq_set`` + prefill the user suffix +
    argmax. A warm kvcache request does the same work plus the cache.

Before arms 1b-3 a request runs, ``Llama.reset()`` forgets what the context holds, so
its in-context prefix reuse (a different mechanism, like kvcache's sticky sessions) does not
hide the caches: a restore is the only way to skip the system prompt, as it would be after
other conversations used the context.

TTFT is wall time from the call to the first token: the first ``TokenEvent`` of a streamed
``Runtime.complete``, the first chunk with content of a streamed ``create_chat_completion``.
End-to-end is the call until the stream is exhausted (arms 2 and 3 save their state there).
Reported per arm and prompt length: TTFT median/p10/p90/min/max, end-to-end latency, bytes
the cache stores, ratios to arms 1, 1b and 6, and each warm request's TTFT split into the
cache's own restore cost and the rest (for arms 2 and 3 ``cache[tokens]`` and
``Llama.load_state`` are timed inside the request by thin wrappers); then the targets
(kvcache warm TTFT >= 10x better than arms 2 and 3 at 2,000 tokens, and <= 1.5x arm 6),
machine, versions and load averages.

Outputs ``OUT_DIR/bench_compare.json`` (also printed on stdout; progress goes to stderr) and
the chart ``OUT_DIR/bench_compare.png``. A full run waits (up to 15 min) for the machine's
1-minute load average to stay below 0.7 for 30 s, then takes ~8 min on 2 cores;
``--quick`` (1,000 tokens, 1 repeat, no waiting) is a smoke run of under 3 minutes.

Side-by-side mode (``--workloads`` and/or ``--arms``): kvcache against llama.cpp's own
``llama-server`` (``tools/llama_server_arm.py``; build it with ``tools/build_llama_server.sh``,
the arm is skipped with a message when the binary is absent) and, optionally, a runtime with
neither cache nor live-KV reuse (``cold``), over one ~1,400-token system prompt:

    python tools/bench_compare.py --workloads shared,agent,chat,restart \\
        --arms kvcache,llama-server[,cold] [--llama-server PATH] [--system-tokens N]

* ``shared``: distinct user messages after the system prompt (as above; 1 + ``--repeats``
  requests, default 15 repeats); the ``cold`` arm serves the first two, and no other workload;
* ``agent``: a raw-prompt agent loop of 8 steps; each step appends the reply and an
  observation whose first characters re-tokenize the reply's last token (checked with the
  tokenizer and reported per step);
* ``chat``: 4 chats x 3 turns through the chat template, interleaved turn by turn;
* ``restart``: after ``shared``, stop and start each arm (kvcache: runtime and daemon, RAM tier
  deleted, blobs dropped from the page cache), then one new message.

Each arm and workload reports per request TTFT, prompt tokens prefilled and reused, and the
bytes its cache stores; requests of the arms are interleaved one by one, each after
``--settle-ms`` (250) of idle time. Outputs
``OUT_DIR/bench_llama_server.json`` (also on stdout) and ``OUT_DIR/bench_llama_server.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from harness.procs import Daemon, short_workdir
from harness.system_prompt import USER_MESSAGES, build_system_prompt
from llama_server_arm import DEFAULT_BINARY, LlamaServer

from kvcache.client import CacheClient
from kvcache.v1 import kvcache_pb2 as pb
from model_runtime.chat.templates import ChatTemplate
from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
from model_runtime.request import Completion, TokenEvent, common_prefix
from model_runtime.runtime import Runtime, default_model_path

TOOLS = Path(__file__).resolve().parent
Message = dict[str, str]
REQUEST_TIMEOUT_S = 900.0
TARGET_SPEEDUP_OVER_LLAMA_CACHES = 10.0
TARGET_OVER_FLOOR = 1.5
TARGET_AT_TOKENS = 2000
# First words of the user messages: all different, so no two prompts share a token after
# the "<|im_start|>user\n" line.
NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Goran", "Hiro", "Ines",
         "Jonas", "Kofi", "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa",
         "Sven", "Tariq", "Umar", "Vera", "Wanda", "Xavier", "Yusuf", "Zoe"]


@dataclass(frozen=True)
class Arm:
    id: str
    label: str  # short, for the chart
    color: str


ARMS = [
    Arm("1", "1 no cache (Runtime)", "#7f7f7f"),
    Arm("1b", "1b no cache (Llama)", "#b0b0b0"),
    Arm("2", "2 LlamaRAMCache", "#d62728"),
    Arm("3", "3 LlamaDiskCache", "#ff7f0e"),
    Arm("4", "4 kvcache RAM tier", "#1f77b4"),
    Arm("5", "5 kvcache disk tier (restart)", "#17becf"),
    Arm("6", "6 floor: in-process state_seq_set", "#2ca02c"),
]


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...]  # target system-prompt sizes, tokens
    repeats: int  # warm requests per caching arm, restarts of arm 5, floor repeats
    cold_repeats: int  # cold requests of arms 1 and 1b
    threads: int
    max_tokens: int = 8
    n_ctx: int = 8192
    quick: bool = False
    settle_s: float = 0.0  # side by side: idle time before every request (see --settle-ms)


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the JSON document."""
    print(f"[bench_compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- statistics --------------------------------------------------------------------------------


def summary_ms(samples_ms: Sequence[float]) -> dict[str, Any]:
    """median / p10 / p90 / min / max / n of millisecond samples."""
    if not samples_ms:
        return {"n": 0}
    arr = np.asarray(samples_ms, dtype=float)
    stats = {"median": np.median(arr), "p10": np.percentile(arr, 10),
             "p90": np.percentile(arr, 90), "min": arr.min(), "max": arr.max()}
    return {"n": len(arr), **{k: round(float(v), 2) for k, v in stats.items()}}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# -- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One shared system prompt and the token layout of its chat requests."""

    target_tokens: int
    words: int
    system: str
    system_tokens: int  # tokens of the rendered system message (the shared prefix)

    def messages(self, i: int) -> list[Message]:
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": user_message(i)}]


def user_message(i: int) -> str:
    return f"{NAMES[i % len(NAMES)]} here. {USER_MESSAGES[i % len(USER_MESSAGES)]}"


def chat_tokens(model: LlamaModel, messages: list[Message]) -> tuple[list[int], int]:
    """Tokens of a chat rendered with the model's template, and the end of its system
    message (the same computation as ``Runtime.render_chat``)."""
    tokens = model.tokenize(ChatTemplate.of_model(model).render(messages))
    head = model.tokenize(ChatTemplate.of_model(model).render(messages[:1], add_generation_prompt=False))
    return tokens, common_prefix(head, tokens)


def size_workload(model: LlamaModel, target: int) -> Workload:
    """A system prompt whose rendered system message is within a few % of ``target`` tokens
    (secant steps on the word count; ``build_system_prompt`` grows in whole sections)."""
    words = int(target / 1.7)
    best: Workload | None = None
    for _ in range(8):
        text = build_system_prompt(words)
        _, n = chat_tokens(model, [{"role": "system", "content": text},
                                   {"role": "user", "content": "x"}])
        candidate = Workload(target, words, text, n)
        if best is None or abs(n - target) < abs(best.system_tokens - target):
            best = candidate
        if abs(n - target) <= 0.03 * target:
            break
        words = max(20, int(words * target / n))
    assert best is not None
    return best


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


def stream_runtime(rt: Runtime, max_tokens: int, **prompt: Any
                   ) -> tuple[float, float, Completion]:
    """One streamed ``Runtime.complete``: (TTFT ms at the first sampled token's event,
    end-to-end ms, the completion)."""
    t0 = time.perf_counter()
    first = 0.0
    done: Completion | None = None
    events = rt.complete(stream=True, max_tokens=max_tokens, timeout=REQUEST_TIMEOUT_S,
                         **prompt)
    assert isinstance(events, Iterator)
    for event in events:
        if isinstance(event, TokenEvent) and event.token >= 0 and not first:
            first = time.perf_counter()
        elif isinstance(event, Completion):
            done = event
    end = time.perf_counter()
    assert done is not None
    return ((first or end) - t0) * 1e3, (end - t0) * 1e3, done


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


# -- arms 1, 4, 5: our Runtime, with and without the kvcache daemon ------------------------------


def runtime_config(st: Settings, reuse_live: bool = True) -> RuntimeConfig:
    return RuntimeConfig(n_ctx=st.n_ctx, n_threads=st.threads, reuse_live=reuse_live)


def new_runtime(model: Path, st: Settings, cache_address: str | None,
                reuse_live: bool = True) -> Runtime:
    rt = Runtime(model, cache_address=cache_address,
                 config=runtime_config(st, reuse_live))
    # a tiny request (too short to be saved) sets up threads and the cache channel
    rt.complete(tokens=rt.tokenize("Hello"), max_tokens=1, timeout=REQUEST_TIMEOUT_S)
    return rt


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


class KvStack:
    """A kvcache daemon (child process, fresh directories) and an in-process Runtime."""

    def __init__(self, model: Path, st: Settings, workdir: Path) -> None:
        self.model = model
        self.settings = st
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir = workdir / "data"
        shm = Path("/dev/shm")
        self.ram_dir = Path(tempfile.mkdtemp(prefix="kvbc-ram-",
                                             dir=shm if shm.is_dir() else workdir))
        self.daemon = Daemon(self.data_dir, "--ram-bytes", "8G", "--log-level", "WARNING",
                             ram_parent=self.ram_dir, socket=workdir / "kv.sock",
                             log_path=workdir / "daemon.log", name="kvcache daemon")
        self.address = self.daemon.address
        self.runtime: Runtime | None = None

    def start(self) -> None:
        self.daemon.start(timeout=120)
        self.runtime = new_runtime(self.model, self.settings, self.address)

    def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        self.daemon.stop(timeout=60)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.ram_dir, ignore_errors=True)

    @property
    def rt(self) -> Runtime:
        assert self.runtime is not None, "not started"
        return self.runtime

    def request(self, wl: Workload, i: int) -> Sample:
        sample, _ = time_runtime(self.rt, wl.messages(i), self.settings.max_tokens, i)
        # background saves must not overlap the next request
        self.rt.engine.saver.flush(120)
        return sample

    def wait_in_ram(self, tokens: list[int], timeout: float = 60.0) -> str:
        """Poll until an entry of exactly ``tokens`` is in the RAM tier; the tier seen."""
        seen = ""
        deadline = time.monotonic() + timeout
        with CacheClient(self.address, timeout=10.0) as probe:
            while time.monotonic() < deadline:
                hit = probe.lookup(self.rt.identity, tokens, max_tokens=len(tokens))
                if hit is not None and hit.matched_tokens == len(tokens):
                    seen = hit.tier
                    if seen == "ram":
                        break
                time.sleep(0.05)
        return seen

    def entries(self) -> list[dict[str, Any]]:
        with CacheClient(self.address, timeout=30.0) as probe:
            return [{"n_tokens": e.n_tokens, "size": e.size, "reason": e.reason,
                     "tiers": len(e.tiers)} for e in probe.list_entries()]

    def restart_cold_ram(self) -> dict[str, Any]:
        """Stop both, delete the RAM tier, drop the blobs from the page cache, restart."""
        self.stop()
        shutil.rmtree(self.ram_dir, ignore_errors=True)
        self.ram_dir.mkdir()
        dropped = drop_from_page_cache(self.data_dir)
        t0 = time.perf_counter()
        self.start()
        return {"files_dropped_from_page_cache": dropped,
                "restart_s": round(time.perf_counter() - t0, 2)}


def drop_from_page_cache(root: Path) -> int:
    """posix_fadvise(DONTNEED) on every file under ``root`` (clean pages only)."""
    count = 0
    for path in root.rglob("*"):
        if path.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    count += 1
                finally:
                    os.close(fd)
    return count


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
    fill = stack.request(wl, 0)
    log(describe("4", fill) + " (fills the cache)")
    tier = stack.wait_in_ram(prefix)
    warm: list[Sample] = []
    for i in range(1, st.repeats + 1):
        warm.append(stack.request(wl, i))
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
        disk.append(stack.request(wl, i))
        log(describe("5", disk[-1]))
    return arm_result(disk, restarts=restarts, engine=engine_summary(disk),
                      bytes_stored=stored_bytes(stack.entries(), n_prefix))


def engine_summary(samples: list[Sample]) -> dict[str, Any]:
    """The runtime's own split of TTFT: restore (cache load + set) and suffix prefill."""
    return {name: summary_ms([s.info[name] for s in samples])
            for name in ("engine_ttft_ms", "restore_ms", "prefill_ms")}


def check_hits(result: dict[str, Any], kind: str, tier: str) -> dict[str, Any]:
    infos = [s["info"] for s in result["samples"]]
    return {"expected": f"{kind}/{tier}",
            "matched": sum(x["hit"] == kind and x["tier"] == tier for x in infos),
            "of": len(infos)}


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


# -- one prompt length -------------------------------------------------------------------------


def add_ratios(arms: dict[str, dict[str, Any]]) -> None:
    med = {k: v["ttft_ms"].get("median") for k, v in arms.items()}
    for k, arm in arms.items():
        arm["ratios"] = {"ttft_over_arm1": ratio(med[k], med.get("1")),
                         "ttft_over_arm1b": ratio(med[k], med.get("1b")),
                         "ttft_over_arm6": ratio(med[k], med.get("6")),
                         "speedup_vs_arm1": ratio(med.get("1"), med[k])}


def split_ttft(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each warm arm's TTFT split, per request, into the cache's own cost (``restore``) and
    the rest (mostly the prefill of the user suffix, which every warm arm does):

    * arms 2, 3: ``cache[tokens]`` (prefix scan; unpickling for the disk cache) +
      ``Llama.load_state``;
    * arms 4, 5: the runtime's TTFT minus its prefill: lookup RPC + blob load + checksums +
      ``state_seq_set``;
    * arm 6: ``state_seq_set``.
    """
    def restore(k: str, info: dict[str, Any]) -> float:
        if k in ("2", "3"):
            return info.get("cache_get_ms", 0.0) + info.get("load_state_ms", 0.0)
        if k in ("4", "5"):
            return info["engine_ttft_ms"] - info["prefill_ms"]
        return info["set_ms"]

    out = {}
    for k in ("2", "3", "4", "5", "6"):
        samples = arms[k]["samples"]
        cost = [restore(k, s["info"]) for s in samples]
        out[k] = {"restore_ms": summary_ms(cost),
                  "rest_ms": summary_ms([s["ttft_ms"] - c for s, c in zip(samples, cost,
                                                                            strict=True)])}
    return out


def agreement(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy outputs per user message across arms (the floor: its first token only)."""
    by_message: dict[int, dict[str, str]] = {}
    for k, arm in arms.items():
        for s in arm["samples"] + [arm[x] for x in ("fill_request",) if x in arm]:
            by_message.setdefault(s["message"], {})[k] = s["text"]
    compared = same = 0
    for texts in by_message.values():
        full = {k: t.strip() for k, t in texts.items() if k != "6"}
        if len(full) > 1:
            compared += 1
            same += len(set(full.values())) == 1
    floor_ok = [texts["6"].strip() == texts["4"].strip()[: len(texts["6"].strip())]
                for texts in by_message.values() if "6" in texts and "4" in texts]
    return {"messages_compared": compared, "identical_completions": same,
            "floor_first_token_matches_arm4": f"{sum(floor_ok)}/{len(floor_ok)}",
            "texts": {str(m): t for m, t in sorted(by_message.items())}}


def run_length(target: int, st: Settings, model_path: Path, model: LlamaModel,
               rig: LlamaRig, workdir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    wl = size_workload(model, target)
    prompt_lengths = [len(chat_tokens(model, wl.messages(i))[0])
                      for i in range(2 * st.repeats + 1)]
    log(f"{target}: system prompt {wl.system_tokens} tokens ({wl.words} words), "
        f"prompts {min(prompt_lengths)}-{max(prompt_lengths)} tokens")
    arms: dict[str, dict[str, Any]] = {}
    arms.update(run_llama_arms(rig, wl, st, workdir))
    log(f"{target}: arm 1, Runtime without a cache")
    arms["1"] = arm_runtime_cold(model_path, wl, st)
    arms.update(run_kvcache_arms(model_path, model, wl, st, workdir))
    arms["4"]["hits"] = check_hits(arms["4"], "partial", "ram")
    arms["5"]["hits"] = check_hits(arms["5"], "partial", "disk")
    add_ratios(arms)
    ordered = {a.id: {"label": a.label, **arms[a.id]} for a in ARMS}
    return {
        "system_prompt": {"target_tokens": target, "tokens": wl.system_tokens,
                          "words": wl.words, "within_10pct":
                          abs(wl.system_tokens - target) <= 0.1 * target},
        "prompt_tokens": {"min": min(prompt_lengths), "max": max(prompt_lengths)},
        "arms": ordered, "ttft_split": split_ttft(arms),
        "output_agreement": agreement(arms),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


# -- targets, machine, load ------------------------------------------------------------------------


def targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    at = str(TARGET_AT_TOKENS) if str(TARGET_AT_TOKENS) in results else max(results, key=int)
    arms = results[at]["arms"]
    med = {k: arms[k]["ttft_ms"]["median"] for k in arms}
    out = []
    for other in ("2", "3"):
        value = ratio(med[other], med["4"])
        out.append(check(f"arm {other} TTFT / kvcache warm (arm 4) TTFT at {at} tokens",
                         value, ">=", TARGET_SPEEDUP_OVER_LLAMA_CACHES))
    out.append(check(f"kvcache warm (arm 4) TTFT / floor (arm 6) TTFT at {at} tokens",
                     ratio(med["4"], med["6"]), "<=", TARGET_OVER_FLOOR))
    # Not targets: the same bars applied to the disk tier, and to the caches' own cost.
    restore = {k: v["restore_ms"]["median"] for k, v in results[at]["ttft_split"].items()}
    for other in ("2", "3"):
        out.append(check(f"arm {other} TTFT / kvcache disk tier (arm 5) TTFT at {at} tokens",
                         ratio(med[other], med["5"]), ">=", TARGET_SPEEDUP_OVER_LLAMA_CACHES,
                         primary=False))
        out.append(check(f"arm {other} restore cost (cache get + load_state) / kvcache warm "
                         f"restore cost (arm 4 TTFT - prefill) at {at} tokens",
                         ratio(restore[other], restore["4"]),
                         ">=", TARGET_SPEEDUP_OVER_LLAMA_CACHES, primary=False))
    out.append(check(f"kvcache disk tier (arm 5) TTFT / floor (arm 6) TTFT at {at} tokens",
                     ratio(med["5"], med["6"]), "<=", TARGET_OVER_FLOOR, primary=False))
    return out


def check(name: str, value: float | None, op: str, limit: float, primary: bool = True
          ) -> dict[str, Any]:
    ok = value is not None and (value >= limit if op == ">=" else value <= limit)
    return {"name": name, "value": value, "limit": f"{op} {limit}", "pass": ok,
            "primary": primary}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu or platform.processor(),
            "platform": platform.platform(), "threads": threads,
            "versions": {"python": platform.python_version(),
                         "llama_cpp_python": llama_cpp.__version__,
                         "kvcache": version("kvcache"), "diskcache": version("diskcache"),
                         "numpy": np.__version__}}


def fresh_memory_probe(mb: int = 96, rounds: int = 5, idle_s: float = 3.0) -> dict[str, Any]:
    """Time to fill a freshly allocated ``mb`` MB buffer right after freeing memory and after
    ``idle_s`` of idleness. On a VM that hands freed guest pages back to the host (virtio
    free page reporting, e.g. Firecracker) the second is much slower: every restore path that
    allocates its buffers per request (``load_state``'s copies, a blob read, a state copy)
    pays it, depending on what the machine freed just before."""
    size = mb << 20

    def fill_fresh() -> float:
        t0 = time.perf_counter()
        buf = np.empty(size, dtype=np.uint8)
        buf.fill(1)
        return (time.perf_counter() - t0) * 1e3

    hot, idle = [], []
    for _ in range(rounds):
        np.ones(3 * size, dtype=np.uint8)  # allocated, touched and freed at once
        hot.append(fill_fresh())
        time.sleep(idle_s)
        idle.append(fill_fresh())
    return {"mb": mb, "right_after_free_ms": summary_ms(hot),
            f"after_{idle_s:g}s_idle_ms": summary_ms(idle)}


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def wait_for_quiet(below: float = 0.7, quiet_s: float = 30.0, give_up_s: float = 900.0
                   ) -> dict[str, Any]:
    """Wait until the 1-minute load average stays below ``below`` for ``quiet_s``."""
    start = time.monotonic()
    quiet_since: float | None = None
    log(f"waiting for a quiet machine (load {load1()}, need < {below} for {quiet_s:.0f} s)")
    while True:
        now = time.monotonic()
        if os.getloadavg()[0] < below:
            quiet_since = quiet_since or now
            if now - quiet_since >= quiet_s:
                return {"quiet": True, "waited_s": round(now - start, 1), "load1": load1()}
        else:
            quiet_since = None
        if now - start >= give_up_s:
            log(f"gave up waiting after {give_up_s:.0f} s (load {load1()}); running anyway")
            return {"quiet": False, "waited_s": round(now - start, 1), "load1": load1()}
        time.sleep(2.0)


# -- the chart ---------------------------------------------------------------------------------------


def plot(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars: TTFT median per arm per prompt length, min-max whiskers, log y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    lengths = sorted(results, key=int)
    width = 0.8 / len(ARMS)
    fig, ax = plt.subplots(figsize=(12, 6.2))
    for j, arm in enumerate(ARMS):
        xs, meds, lo, hi, tops = [], [], [], [], []
        for g, length in enumerate(lengths):
            t = results[length]["arms"][arm.id]["ttft_ms"]
            xs.append(g + (j - (len(ARMS) - 1) / 2) * width)
            meds.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
            tops.append(t["max"])
        ax.bar(xs, meds, width * 0.92, label=arm.label, color=arm.color,
               yerr=[lo, hi], capsize=2, error_kw={"elinewidth": 0.8})
        for x, m, top in zip(xs, meds, tops, strict=True):
            ax.text(x, top * 1.1, fmt_ms(m), ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_yscale("log")
    low = min(results[n]["arms"][a.id]["ttft_ms"]["min"] for n in lengths for a in ARMS)
    ax.set_ylim(low / 3, ax.get_ylim()[1] * 4)
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([f"~{int(n):,}-token system prompt\n"
                        f"({results[n]['system_prompt']['tokens']:,} tokens)" for n in lengths])
    ax.set_ylabel("time to first token, ms (median; whiskers min-max; log scale)")
    m = doc["machine"]
    ax.set_title(f"TTFT with a shared system prompt: SmolLM2-135M, {m['threads']} threads, "
                 f"{m['cpu_count']} CPUs, llama-cpp-python {m['versions']['llama_cpp_python']}",
                 fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.25)
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def table(doc: dict[str, Any]) -> str:
    """TTFT medians per arm (rows) and prompt length (columns), with the ratio to arm 1."""
    results = doc["results"]
    lengths = sorted(results, key=int)
    head = f"{'arm':36}" + "".join(f"{int(n):>22,}" for n in lengths)
    rows = [head, "-" * len(head)]
    for arm in ARMS:
        cells = []
        for n in lengths:
            a = results[n]["arms"][arm.id]
            cells.append(f"{fmt_ms(a['ttft_ms']['median']):>10} "
                         f"({a['ratios']['ttft_over_arm1']:.3f}x)".rjust(22))
        rows.append(f"{arm.label:36}" + "".join(cells))
    return "\n".join(rows)


def fmt_ms(ms: float) -> str:
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


# -- side by side: kvcache, llama.cpp's own server and a cold runtime over four workloads ----------
#
# ``--workloads`` / ``--arms`` select this mode (see the module docstring). Every arm serves the
# same requests, interleaved request by request (the order alternates), so a slow spell of a
# shared machine hits all arms alike.

SIDE_WORKLOADS = ("shared", "agent", "chat", "restart")
SIDE_ARMS = ("kvcache", "llama-server", "cold")
SIDE_DEFAULT_ARMS = "kvcache,llama-server"
SIDE_SYSTEM_TOKENS = 1400
SIDE_COLORS = {"kvcache": "#1f77b4", "llama-server": "#d62728", "cold": "#7f7f7f"}
AGENT_STEPS = 8
REPLY_TOKENS = 16  # generated per agent step and per chat turn
CHATS = 4
CHAT_TURNS = 3
FOLLOW_UPS = ["Thanks. What should I check first?", "And if that does not help, what then?"]
AGENT_TASK = ("\n\nYou now work as an agent: think one step at a time; after every thought a "
              "tool runs and its observation follows.\nTask: find out why order 44721 is late "
              "and tell the customer what happens next.\nThought:")
# An observation starts with text that merges with a common reply ending when the prompt is
# tokenized again ("." + ".." -> "...", a word + "s" -> one token, a cut-off word + its next
# letter). The first lead that changes the reply's last token is taken, so every step
# provokes a re-tokenization.
OBSERVATION_LEADS = ("..", "\n", "s", "'s", "ing", "ed", "o", "e", "a", "i", "!", ".", ":",
                     ")", ",")


@dataclass
class Served:
    """One request as one arm served it."""

    ttft_ms: float
    e2e_ms: float
    prompt_tokens: int
    prefilled: int  # prompt tokens computed by this request (at least 1: the last is decoded)
    reused: int  # prompt tokens taken from a cache or from live KV
    text: str
    tokens: list[int]  # generated token ids
    info: dict[str, Any] = field(default_factory=dict)


class SideArm:
    """A system under test: serves raw prompts and chats, restarts, reports stored bytes."""

    name = ""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def restart(self) -> dict[str, Any]:
        raise NotImplementedError

    def request(self, *, max_tokens: int, prompt: str | None = None,
                messages: list[Message] | None = None) -> Served:
        raise NotImplementedError

    def stored(self) -> dict[str, Any]:
        raise NotImplementedError


def serve_runtime(rt: Runtime, max_tokens: int, **prompt: Any) -> Served:
    ttft_ms, e2e_ms, done = stream_runtime(rt, max_tokens, **prompt)
    read = done.cache_delta["tokens_read"]
    t = done.timings
    return Served(ttft_ms, e2e_ms, done.prompt_tokens, max(1, done.prompt_tokens - read), read,
                  done.text, list(done.tokens),
                  {"hit": done.cache_hit_kind, "tier": done.cache_tier,
                   "finish_reason": done.finish_reason, "engine_ttft_ms": t["ttft_ms"],
                   "restore_ms": t["restore_ms"], "prefill_ms": t["prefill_ms"],
                   "saves": [(s["reason"], s["tokens"]) for s in done.saves]})


class KvArm(SideArm):
    """kvcache: the daemon as a child process, the runtime in this process (``KvStack``)."""

    name = "kvcache"

    def __init__(self, model_path: Path, st: Settings, workdir: Path) -> None:
        self.stack = KvStack(model_path, st, workdir)

    def start(self) -> None:
        self.stack.start()

    def close(self) -> None:
        self.stack.close()

    def restart(self) -> dict[str, Any]:
        """Stop runtime and daemon, delete the RAM tier, drop the blobs from the page cache,
        start both: what is left is the disk tier."""
        return self.stack.restart_cold_ram()

    def request(self, *, max_tokens: int, prompt: str | None = None,
                messages: list[Message] | None = None) -> Served:
        served = serve_runtime(self.stack.rt, max_tokens,
                               **({"prompt": prompt} if prompt is not None
                                  else {"messages": messages}))
        self.stack.rt.engine.saver.flush(120)  # saves must not overlap the next request
        return served

    def stored(self) -> dict[str, Any]:
        with CacheClient(self.stack.address, timeout=30.0) as probe:
            stats = probe.stats()
        tiers = {pb.Tier.Name(t.tier).removeprefix("TIER_").lower(): t for t in stats.tiers}
        disk, ram = tiers.get("disk"), tiers.get("ram")
        return {"bytes": disk.bytes if disk else None,
                "entries": disk.entries if disk else None,
                "ram_tier_bytes": ram.bytes if ram else None,
                "source": "daemon Stats: disk tier (every entry is written through to disk)"}


class ColdArm(SideArm):
    """No cache and no reuse of live KV: every request prefills its whole prompt."""

    name = "cold"

    def __init__(self, model_path: Path, st: Settings) -> None:
        self.model_path = model_path
        self.settings = st
        self.runtime: Runtime | None = None

    def start(self) -> None:
        self.runtime = new_runtime(self.model_path, self.settings, None, reuse_live=False)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def restart(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.close()
        self.start()
        return {"restart_s": round(time.perf_counter() - t0, 2)}

    def request(self, *, max_tokens: int, prompt: str | None = None,
                messages: list[Message] | None = None) -> Served:
        assert self.runtime is not None, "not started"
        return serve_runtime(self.runtime, max_tokens,
                             **({"prompt": prompt} if prompt is not None
                                else {"messages": messages}))

    def stored(self) -> dict[str, Any]:
        return {"bytes": 0, "source": "stores nothing"}


class ServerArm(SideArm):
    """llama.cpp's ``llama-server``: raw ``/completion`` requests; a chat is rendered with the
    model's own template here, as the runtime renders it, and sent as text."""

    name = "llama-server"

    def __init__(self, binary: Path, model_path: Path, model: LlamaModel, st: Settings,
                 log_path: Path) -> None:
        self.model = model
        self.server = LlamaServer(binary, model_path, threads=st.threads, n_ctx=st.n_ctx,
                                  log_path=log_path)

    def start(self) -> None:
        self.server.start()
        self.server.complete("Hello", n_predict=1)  # as the runtime's first request

    def close(self) -> None:
        self.server.stop()

    def restart(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.server.stop()
        self.start()
        return {"restart_s": round(time.perf_counter() - t0, 2)}

    def request(self, *, max_tokens: int, prompt: str | None = None,
                messages: list[Message] | None = None) -> Served:
        text = prompt if prompt is not None else ChatTemplate.of_model(self.model).render(messages or [])
        reply = self.server.complete(text, n_predict=max_tokens)
        return Served(reply.ttft_ms, reply.e2e_ms, reply.prompt_tokens, reply.prompt_n,
                      reply.cache_n, reply.text, reply.tokens,
                      {"stop_type": reply.stop_type,
                       "server_prompt_ms": reply.timings.get("prompt_ms")})

    def stored(self) -> dict[str, Any]:
        state = self.server.prompt_cache_state()
        slots = self.server.slots()
        log_text = self.server.log_text()
        return {"bytes": state["bytes"], "prompts_in_ram_cache": state["prompts"],
                "slots": len(slots),
                "ram_cache_updates": log_text.count("updating prompt cache"),
                "slot_kept_by_prefix_similarity": log_text.count("selected slot by LCP"),
                "source": f"--cache-ram prompt cache in host memory ({state['source']}); the "
                          "live slot's KV is not counted; nothing survives a restart. "
                          "ram_cache_updates: requests that saved the slot's state into that "
                          "cache and searched it; slot_kept_by_prefix_similarity: requests "
                          "that kept the slot because it shared a prefix (its state then is "
                          "saved only if less than half of it is kept)"}


def new_side_arm(name: str, model_path: Path, model: LlamaModel, st: Settings, workdir: Path,
                 binary: Path, workload: str) -> SideArm:
    if name == "kvcache":
        return KvArm(model_path, st, workdir / f"kv-{workload}")
    if name == "llama-server":
        return ServerArm(binary, model_path, model, st, workdir / f"llama-server-{workload}.log")
    return ColdArm(model_path, st)


@contextlib.contextmanager
def started(arms: list[SideArm]) -> Iterator[list[SideArm]]:
    """Start every arm; close every one that was created, whatever happens."""
    try:
        for arm in arms:
            arm.start()
        yield arms
    finally:
        for arm in arms:
            with contextlib.suppress(Exception):
                arm.close()


def in_turn(arms: list[SideArm], step: int) -> list[SideArm]:
    """The arms in the order they serve request ``step``: reversed every other request."""
    return arms if step % 2 == 0 else arms[::-1]


def settled(arm: SideArm, st: Settings, **request: Any) -> Served:
    """``arm.request`` after ``st.settle_s`` of idle time: what one arm does after its reply
    (its llama.cpp threads spinning down, its background work) does not run into the next
    arm's request. Without it the arm that went second was slowed by the first one's tail
    (alternating the order only shared that out), as if two servers shared these cores."""
    time.sleep(st.settle_s)
    return arm.request(**request)


def record(step: int, served: Served, **extra: Any) -> dict[str, Any]:
    return {"step": step, **asdict(served), **extra}


def log_served(workload: str, arm: str, step: int, s: Served) -> None:
    hit = f" {s.info['hit']}/{s.info['tier'] or '-'}" if "hit" in s.info else ""
    log(f"  {workload} {arm} #{step}: ttft {s.ttft_ms:.0f} ms, prompt {s.prompt_tokens}, "
        f"prefilled {s.prefilled}, reused {s.reused}{hit}")


def run_shared_side(arms: list[SideArm], wl: Workload, st: Settings, want_shared: bool,
                    want_restart: bool) -> dict[str, dict[str, Any]]:
    """Workload (a), distinct user messages after the shared system prompt, and (d): restart
    every caching arm and send one more message (the restart follows (a) on the same arms;
    without (a), message 0 only fills the caches first)."""
    turns: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    n = st.repeats + 1 if want_shared else 1
    for i in range(n):
        for arm in in_turn(arms, i):
            if arm.name == "cold" and i >= st.cold_repeats:
                continue
            served = settled(arm, st, max_tokens=st.max_tokens, messages=wl.messages(i))
            log_served("shared", arm.name, i, served)
            turns[arm.name].append(record(i, served))
        if i == st.cold_repeats - 1:
            # Done with the cold arm: its idle runtime would slow the kvcache arm's. Two
            # llama.cpp contexts driven from two threads of one process make libgomp
            # count more threads than cores and stop spinning at its barriers, so every
            # graph node waits on a futex: prefill here was ~30% slower after an idle
            # pause with the cold runtime alive, back to normal once it was closed.
            for arm in arms:
                if arm.name == "cold":
                    arm.close()
    out: dict[str, dict[str, Any]] = {}
    if want_shared:
        out["shared"] = {a.name: {"turns": turns[a.name], "stored": a.stored()} for a in arms}
    if want_restart:
        restarted = {}
        for arm in arms:
            if arm.name == "cold":
                continue
            facts = arm.restart()
            served = settled(arm, st, max_tokens=st.max_tokens, messages=wl.messages(n))
            log_served("restart", arm.name, n, served)
            restarted[arm.name] = {"turns": [record(n, served, restart=facts)],
                                   "stored": arm.stored()}
        out["restart"] = restarted
    return out


def retokenization(model: LlamaModel, prompt_tokens: list[int], generated: list[int],
                   next_text: str) -> dict[str, Any]:
    """Where the next prompt's tokens leave (this prompt + the generated tokens)."""
    before = prompt_tokens + generated
    after = model.tokenize(next_text)
    at = common_prefix(before, after)

    def piece(tokens: list[int], i: int) -> str | None:
        return (model.token_to_piece(tokens[i], render_special=True).decode(errors="replace")
                if i < len(tokens) else None)

    return {"last_generated_at": len(before) - 1, "first_difference_at": at,
            "diverges_at_last_generated_token": at == len(before) - 1,
            "generated_piece": piece(before, at), "retokenized_piece": piece(after, at),
            "retokenized_next_piece": piece(after, at + 1)}


def observation(step: int) -> str:
    return (f"\nObservation {step}: the order tool returned status {200 + step} for order "
            f"44721, carrier scan {step} of {AGENT_STEPS}.\nThought:")


def next_agent_prompt(model: LlamaModel, text: str, prompt_tokens: list[int], served: Served,
                      step: int) -> tuple[str, dict[str, Any]]:
    """The prompt of the next step: this prompt, the reply and an observation whose first
    characters merge with the reply's last token (the first lead that does so)."""
    first_try: tuple[str, dict[str, Any]] | None = None
    for lead in OBSERVATION_LEADS:
        candidate = text + served.text + lead + observation(step)
        check_ = retokenization(model, prompt_tokens, served.tokens, candidate)
        if check_["diverges_at_last_generated_token"]:
            return candidate, {"lead": lead, **check_}
        first_try = first_try or (candidate, {"lead": lead, **check_})
    assert first_try is not None
    return first_try


def run_agent_side(arms: list[SideArm], model: LlamaModel, wl: Workload, st: Settings
                   ) -> dict[str, dict[str, Any]]:
    """Workload (b): a raw-prompt agent loop. Each arm continues its own transcript (greedy:
    the same one when the arms agree); each step appends the reply's text and an observation
    that re-tokenizes the reply's last token."""
    texts = {a.name: wl.system + AGENT_TASK for a in arms}
    turns: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    for step in range(AGENT_STEPS):
        for arm in in_turn(arms, step):
            text = texts[arm.name]
            prompt_tokens = model.tokenize(text)
            served = settled(arm, st, max_tokens=REPLY_TOKENS, prompt=text)
            log_served("agent", arm.name, step, served)
            texts[arm.name], check_ = next_agent_prompt(model, text, prompt_tokens, served,
                                                        step + 1)
            extra = {"retokenization": check_}
            if isinstance(arm, ServerArm):
                extra["server_tokenizer_agrees"] = (
                    arm.server.tokenize(texts[arm.name]) == model.tokenize(texts[arm.name]))
            log(f"    next prompt: lead {check_['lead']!r}: token {check_['generated_piece']!r}"
                f" at {check_['first_difference_at']} becomes {check_['retokenized_piece']!r}"
                f" (last generated token: {check_['diverges_at_last_generated_token']})")
            turns[arm.name].append(record(step, served, **extra))
    return {a.name: {"turns": turns[a.name], "stored": a.stored()} for a in arms}


def run_chat_side(arms: list[SideArm], wl: Workload, st: Settings) -> dict[str, dict[str, Any]]:
    """Workload (c): CHATS chats of CHAT_TURNS turns over the system prompt, through the chat
    template, the chats interleaved turn by turn (every turn follows another chat's)."""
    chats = {a.name: [[{"role": "system", "content": wl.system}] for _ in range(CHATS)]
             for a in arms}
    turns: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    step = 0
    for turn in range(CHAT_TURNS):
        for c in range(CHATS):
            user = user_message(c) if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
            for arm in in_turn(arms, step):
                history = chats[arm.name][c]
                history.append({"role": "user", "content": user})
                served = settled(arm, st, max_tokens=REPLY_TOKENS, messages=list(history))
                history.append({"role": "assistant", "content": served.text})
                log_served("chat", arm.name, step, served)
                turns[arm.name].append(record(step, served, chat=c, turn=turn))
            step += 1
    return {a.name: {"turns": turns[a.name], "stored": a.stored()} for a in arms}


def side_summary(result: dict[str, Any]) -> dict[str, Any]:
    turns = result["turns"]
    ttft = [t["ttft_ms"] for t in turns]
    return {"requests": len(turns), "ttft_ms": summary_ms(ttft),
            "ttft_ms_after_first": summary_ms(ttft[1:]),
            "prompt_tokens_total": sum(t["prompt_tokens"] for t in turns),
            "prefilled_total": sum(t["prefilled"] for t in turns),
            "reused_total": sum(t["reused"] for t in turns),
            "stored_bytes": result["stored"].get("bytes")}


def side_agreement(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy replies per request compared across arms."""
    names = list(results)
    if len(names) < 2:
        return {"compared": 0}
    firsts = results[names[0]]["turns"]
    same = sum(all(results[n]["turns"][i]["text"] == t["text"] for n in names[1:]
                   if i < len(results[n]["turns"]))
               for i, t in enumerate(firsts))
    return {"compared": len(firsts), "identical_replies": same}


SIDE_DESCRIPTIONS = {
    "shared": "distinct user messages after a shared system prompt (chat template); request "
              "0 fills the caches",
    "agent": f"raw-prompt agent loop, {AGENT_STEPS} steps of {REPLY_TOKENS} tokens; each step "
             "appends the reply and an observation that re-tokenizes the reply's last token",
    "chat": f"{CHATS} chats x {CHAT_TURNS} turns over the system prompt (chat template), "
            "interleaved turn by turn",
    "restart": "after 'shared': stop and start every arm (kvcache: runtime and daemon, RAM "
               "tier deleted, blobs dropped from the page cache), then one new message",
}


def run_side(args: argparse.Namespace, st: Settings, workloads: list[str], arm_names: list[str]
             ) -> dict[str, Any]:
    started_at = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    model_path = default_model_path()
    workdir = short_workdir("kvbs")
    model = LlamaModel(model_path)
    binary: Path = args.llama_server
    if "llama-server" in arm_names and not binary.is_file():
        log(f"llama-server arm skipped: no binary at {binary} "
            "(build it with: bash tools/build_llama_server.sh)")
        arm_names = [a for a in arm_names if a != "llama-server"]
    results: dict[str, dict[str, Any]] = {}
    retok: dict[str, Any] = {}
    try:
        wl = size_workload(model, args.system_tokens)
        log(f"side by side: system prompt {wl.system_tokens} tokens, arms {arm_names}, "
            f"workloads {workloads}")

        def arms_for(workload: str, cold: bool = False) -> list[SideArm]:
            return [new_side_arm(n, model_path, model, st, workdir, binary, workload)
                    for n in arm_names if cold or n != "cold"]

        if "shared" in workloads or "restart" in workloads:
            with started(arms_for("shared", cold="shared" in workloads)) as arms:
                results.update(run_shared_side(arms, wl, st, "shared" in workloads,
                                               "restart" in workloads))
        if "agent" in workloads:
            with started(arms_for("agent")) as arms:
                results["agent"] = run_agent_side(arms, model, wl, st)
            retok = agent_retokenization(results["agent"])
        if "chat" in workloads:
            with started(arms_for("chat")) as arms:
                results["chat"] = run_chat_side(arms, wl, st)
    finally:
        model.close()
        shutil.rmtree(workdir, ignore_errors=True)
    ordered = {w: results[w] for w in SIDE_WORKLOADS if w in results}
    return {
        "benchmark": "bench_compare side by side",
        "command": "python tools/bench_compare.py " + " ".join(sys.argv[1:]),
        "settings": {**asdict(st), "system_prompt_tokens": wl.system_tokens,
                     "system_prompt_words": wl.words, "reply_tokens": REPLY_TOKENS,
                     "agent_steps": AGENT_STEPS, "chats": CHATS, "chat_turns": CHAT_TURNS},
        "arms": arm_names,
        "model": {"file": model_path.name, "bytes": model_path.stat().st_size},
        "llama_server": {"binary": str(binary), "argv_example": LlamaServer(
            binary, model_path, threads=st.threads, n_ctx=st.n_ctx,
            log_path=Path("server.log")).argv()[1:]} if "llama-server" in arm_names else None,
        "machine": machine_info(st.threads),
        "load": {"loadavg_at_start": load_start,
                 "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "definitions": {
            "ttft_ms": "client wall time from sending the request to the first generated token "
                       "(Runtime: first TokenEvent; llama-server: first streamed chunk with a "
                       "token)",
            "prefilled": "prompt tokens computed by the request: kvcache/cold: prompt_tokens - "
                         "cache_delta.tokens_read (at least 1); llama-server: timings.prompt_n",
            "reused": "kvcache/cold: cache_delta.tokens_read (daemon restore or live KV); "
                      "llama-server: timings.cache_n",
            "stored_bytes": "kvcache: daemon disk-tier bytes after the workload; llama-server: "
                            "its RAM prompt cache as logged; cold: 0"},
        "workloads": {w: {"description": SIDE_DESCRIPTIONS[w],
                          "summary": {a: side_summary(r) for a, r in res.items()},
                          "ratios": side_ratios(res),
                          "agreement": side_agreement(res), "arms": res}
                      for w, res in ordered.items()},
        "agent_retokenization": retok,
        "elapsed_s": round(time.perf_counter() - started_at, 1),
    }


def side_ratios(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if "kvcache" not in res or "llama-server" not in res:
        return {}
    kv, srv = side_summary(res["kvcache"]), side_summary(res["llama-server"])
    key = "ttft_ms_after_first" if kv["requests"] > 1 else "ttft_ms"
    # Requests were interleaved: the ratio of each pair is immune to slow drifts in load.
    pairs = [a["ttft_ms"] / b["ttft_ms"] for a, b in
             zip(res["kvcache"]["turns"], res["llama-server"]["turns"], strict=True)
             if a["step"] == b["step"] and b["ttft_ms"] > 0]
    skip = 1 if len(pairs) > 1 else 0
    return {f"kvcache_over_llama_server_{key}_median":
            ratio(kv[key].get("median"), srv[key].get("median")),
            "kvcache_over_llama_server_paired_ttft_median":
            round(float(np.median(pairs[skip:])), 3) if pairs else None,
            "kvcache_over_llama_server_prefilled_total":
            ratio(kv["prefilled_total"], srv["prefilled_total"])}


def agent_retokenization(result: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the steps whose next prompt re-tokenized the reply's last token."""
    out = {}
    for arm, res in result.items():
        checks = [t["retokenization"] for t in res["turns"][:-1]]
        out[arm] = {"steps_checked": len(checks),
                    "diverged_at_last_generated_token":
                    sum(c["diverges_at_last_generated_token"] for c in checks),
                    "examples": [{"lead": c["lead"], "generated": c["generated_piece"],
                                  "retokenized": c["retokenized_piece"],
                                  "retokenized_next": c["retokenized_next_piece"],
                                  "position": c["first_difference_at"]} for c in checks]}
    return out


def plot_side(doc: dict[str, Any], path: Path) -> None:
    """Agent loop per step (TTFT, prompt tokens prefilled) and each workload's medians and
    totals, one color per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = doc["workloads"]
    arms = doc["arms"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    if "agent" in workloads:
        agent = workloads["agent"]["arms"]
        width = 0.8 / len(arms)
        for j, arm in enumerate(a for a in arms if a in agent):
            turns = agent[arm]["turns"]
            steps = [t["step"] + 1 for t in turns]
            axes[0][0].plot(steps, [t["ttft_ms"] for t in turns], marker="o", label=arm,
                            color=SIDE_COLORS[arm])
            axes[0][1].bar([s + (j - (len(arms) - 1) / 2) * width for s in steps],
                           [t["prefilled"] for t in turns], width * 0.92, label=arm,
                           color=SIDE_COLORS[arm])
        axes[0][0].set_yscale("log")
        axes[0][0].set_title("agent loop: TTFT per step (log)", fontsize=10)
        axes[0][0].set_xlabel("step")
        axes[0][0].set_ylabel("ms")
        axes[0][1].set_yscale("log")
        axes[0][1].set_title("agent loop: prompt tokens prefilled per step (log)", fontsize=10)
        axes[0][1].set_xlabel("step")
    names = list(workloads)
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        xs = [g + (j - (len(arms) - 1) / 2) * width for g in range(len(names))]
        med, pre = [], []
        for w in names:
            s = workloads[w]["summary"].get(arm)
            key = "ttft_ms_after_first" if s and s["requests"] > 1 else "ttft_ms"
            med.append(s[key]["median"] if s else 0)
            pre.append(s["prefilled_total"] if s else 0)
        axes[1][0].bar(xs, med, width * 0.92, label=arm, color=SIDE_COLORS[arm])
        axes[1][1].bar(xs, pre, width * 0.92, label=arm, color=SIDE_COLORS[arm])
        for x, m in zip(xs, med, strict=True):
            if m:
                axes[1][0].text(x, m * 1.1, fmt_ms(m), ha="center", fontsize=7, rotation=90)
    for ax, title in ((axes[1][0], "median TTFT per workload (after the first request; log)"),
                      (axes[1][1], "prompt tokens prefilled, workload total (log)")):
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_title(title, fontsize=10)
    for ax in axes[1]:
        ax.set_ylim(top=ax.get_ylim()[1] * 6)  # room for the labels and the legend
    for ax in axes.flat:
        ax.grid(axis="y", which="both", alpha=0.25)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left" if ax in axes[1] else "upper right")
    m = doc["machine"]
    fig.suptitle(f"kvcache vs llama-server: SmolLM2-135M, {doc['settings']['system_prompt_tokens']}"
                 f"-token system prompt, {m['threads']} threads, {m['cpu_count']} CPUs",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def side_table(doc: dict[str, Any]) -> str:
    rows = [f"{'workload':9} {'arm':13} {'median TTFT':>12} {'prefilled':>10} "
            f"{'of prompt':>10} {'stored bytes':>14}"]
    for w, res in doc["workloads"].items():
        for arm, s in res["summary"].items():
            key = "ttft_ms_after_first" if s["requests"] > 1 else "ttft_ms"
            stored = "-" if s["stored_bytes"] is None else f"{s['stored_bytes']:,}"
            rows.append(f"{w:9} {arm:13} {fmt_ms(s[key]['median']):>12} "
                        f"{s['prefilled_total']:>10,} {s['prompt_tokens_total']:>10,} "
                        f"{stored:>14}")
    return "\n".join(rows)


# -- driver ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1,000 tokens only, 1 repeat, no waiting: a smoke run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None,
                        help="warm requests per arm (default 7, side by side 15; --quick: 1)")
    parser.add_argument("--out-dir", type=Path, default=TOOLS.parent / "docs")
    parser.add_argument("--no-wait", action="store_true",
                        help="do not wait for a quiet machine before a full run")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the chart from the JSON in OUT_DIR")
    parser.add_argument("--workloads", default=None,
                        help=f"side-by-side mode: comma-separated of {','.join(SIDE_WORKLOADS)}")
    parser.add_argument("--arms", default=None,
                        help=f"side-by-side arms, comma-separated of {','.join(SIDE_ARMS)} "
                             f"(default {SIDE_DEFAULT_ARMS})")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY,
                        help="llama-server binary (tools/build_llama_server.sh builds it)")
    parser.add_argument("--system-tokens", type=int, default=SIDE_SYSTEM_TOKENS,
                        help="side-by-side system prompt size, tokens")
    parser.add_argument("--settle-ms", type=float, default=250.0,
                        help="side by side: idle time before every request, so that one "
                             "arm's work after its reply does not overlap the next arm's "
                             "request (default 250)")
    args = parser.parse_args(argv)
    if args.workloads is not None or args.arms is not None:
        args.side_workloads = choices(parser, "--workloads", args.workloads or
                                      ",".join(SIDE_WORKLOADS), SIDE_WORKLOADS)
        args.side_arms = choices(parser, "--arms", args.arms or SIDE_DEFAULT_ARMS, SIDE_ARMS)
    else:
        args.side_workloads = args.side_arms = None
    return args


def choices(parser: argparse.ArgumentParser, flag: str, value: str, allowed: Sequence[str]
            ) -> list[str]:
    """A comma-separated list of known names, in the order given (exit 2 otherwise)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        parser.error(f"{flag}: unknown or empty {unknown or value!r}; choose from "
                     f"{', '.join(allowed)}")
    return list(dict.fromkeys(names))


def settings_of(args: argparse.Namespace) -> Settings:
    repeats = args.repeats or (1 if args.quick else 7)
    lengths = (1000,) if args.quick else (1000, 2000, 4000)
    return Settings(lengths=lengths, repeats=repeats, cold_repeats=min(2, repeats),
                    threads=args.threads, quick=args.quick)


def main_side(args: argparse.Namespace) -> None:
    """Side-by-side mode: OUT_DIR/bench_llama_server.json and .png."""
    out = args.out_dir / "bench_llama_server.json"
    chart = args.out_dir / "bench_llama_server.png"
    if args.replot:
        plot_side(json.loads(out.read_text()), chart)
        return
    repeats = args.repeats or (1 if args.quick else 15)
    st = Settings(lengths=(args.system_tokens,), repeats=repeats,
                  cold_repeats=min(2, repeats), threads=args.threads, quick=args.quick,
                  settle_s=args.settle_ms / 1000)
    doc = run_side(args, st, args.side_workloads, args.side_arms)
    text = json.dumps(doc, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    plot_side(doc, chart)
    print(text, flush=True)
    log("median TTFT (after each workload's first request), prompt tokens prefilled, "
        "stored bytes:\n" + side_table(doc))
    log(f"wrote {out} and {chart} in {doc['elapsed_s']} s")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.side_workloads is not None:
        main_side(args)
        return
    if args.replot:
        plot(json.loads((args.out_dir / "bench_compare.json").read_text()),
             args.out_dir / "bench_compare.png")
        return
    st = settings_of(args)
    wait = None if (st.quick or args.no_wait) else wait_for_quiet()
    started = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    memory_probe = fresh_memory_probe()
    model_path = default_model_path()
    workdir = short_workdir("kvbc")
    model = LlamaModel(model_path)
    rig = new_llama(model_path, st)
    results: dict[str, dict[str, Any]] = {}
    try:
        for target in st.lengths:
            results[str(target)] = run_length(target, st, model_path, model, rig, workdir)
    finally:
        rig.llm.close()
        model.close()
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "benchmark": "bench_compare",
        "command": "python tools/bench_compare.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
        "mode": "quick" if st.quick else "full",
        "settings": asdict(st), "model": {"file": model_path.name,
                                          "bytes": model_path.stat().st_size},
        "machine": {**machine_info(st.threads), "fresh_memory_probe": memory_probe},
        "load": {"wait": wait, "loadavg_at_start": load_start,
                 "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "ttft_definition": "call to first token: first TokenEvent (Runtime), first chunk with "
                           "content (Llama streaming), argmax after the suffix (floor)",
        "targets": targets(results),
        "results": results,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    out = args.out_dir / "bench_compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2)
    out.write_text(text + "\n")
    plot(doc, args.out_dir / "bench_compare.png")
    print(text, flush=True)
    log("TTFT median (ratio to arm 1):\n" + table(doc))
    log(f"wrote {out} and {args.out_dir / 'bench_compare.png'} in {doc['elapsed_s']} s")


if __name__ == "__main__":
    main()
