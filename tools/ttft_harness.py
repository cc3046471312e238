"""What the two TTFT benchmarks share (tools/bench_prompt_caches.py against
llama-cpp-python's prompt caches, tools/bench_llama_server.py against llama.cpp's own
server): their settings and common flags, the shared-system-prompt workload, one streamed
``Runtime.complete`` timed to its first token, and a kvcache daemon with a runtime beside
it (``KvStack``)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from benchlib import cpu_model, drop_tree_from_page_cache, package_version
from harness.procs import Daemon
from harness.system_prompt import USER_MESSAGES, build_system_prompt

from kvcache.client import CacheClient
from model_runtime.chat.templates import ChatTemplate
from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import LlamaModel
from model_runtime.request import Completion, TokenEvent, common_prefix
from model_runtime.runtime import Runtime

TOOLS = Path(__file__).resolve().parent
Message = dict[str, str]
REQUEST_TIMEOUT_S = 900.0
# First words of the user messages: all different, so no two prompts share a token after
# the "<|im_start|>user\n" line.
NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Goran", "Hiro", "Ines",
         "Jonas", "Kofi", "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa",
         "Sven", "Tariq", "Umar", "Vera", "Wanda", "Xavier", "Yusuf", "Zoe"]


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


# -- flags -------------------------------------------------------------------------------------


def add_common_options(parser: argparse.ArgumentParser, *, quick_help: str,
                       repeats_help: str) -> None:
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help=repeats_help)
    parser.add_argument("--out-dir", type=Path, default=TOOLS.parent / "docs")


def add_replot_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the chart from the JSON in OUT_DIR")


def machine_info(threads: int) -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
            "platform": platform.platform(), "threads": threads,
            "versions": {"python": platform.python_version(),
                         "llama_cpp_python": llama_cpp.__version__,
                         "kvcache": package_version("kvcache"),
                         "diskcache": package_version("diskcache"),
                         "numpy": np.__version__}}


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


# -- our Runtime, with and without the kvcache daemon --------------------------------------------


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


def runtime_config(st: Settings, reuse_live: bool = True) -> RuntimeConfig:
    return RuntimeConfig(n_ctx=st.n_ctx, n_threads=st.threads, reuse_live=reuse_live)


def new_runtime(model: Path, st: Settings, cache_address: str | None,
                reuse_live: bool = True) -> Runtime:
    rt = Runtime(model, cache_address=cache_address,
                 config=runtime_config(st, reuse_live))
    # a tiny request (too short to be saved) sets up threads and the cache channel
    rt.complete(tokens=rt.tokenize("Hello"), max_tokens=1, timeout=REQUEST_TIMEOUT_S)
    return rt


class KvStack:
    """A kvcache daemon (child process, fresh directories) and an in-process Runtime."""

    def __init__(self, model: Path, st: Settings, workdir: Path) -> None:
        self.model = model
        self.settings = st
        self.workdir = workdir
        # The daemon refuses a socket folder others can enter.
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        dropped = drop_tree_from_page_cache(self.data_dir)
        t0 = time.perf_counter()
        self.start()
        return {"files_dropped_from_page_cache": dropped,
                "restart_s": round(time.perf_counter() - t0, 2)}
