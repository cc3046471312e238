"""The systems tools/bench_llama_server.py compares, behind one interface (``SideArm``):
kvcache (its daemon as a child process, the runtime in this process), llama.cpp's
``llama-server``, and a runtime with neither cache nor live-KV reuse; started and closed
together, served in turn with idle time between requests."""


from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import log as bench_log
from llama_server_arm import LlamaServer
from ttft_harness import KvStack, Message, Settings, new_runtime, stream_runtime

from kvcache.client import CacheClient
from kvcache.v1 import kvcache_pb2 as pb
from model_runtime.chat.templates import ChatTemplate
from model_runtime.llama_backend import LlamaModel
from model_runtime.runtime import Runtime


def log(message: str) -> None:
    bench_log(message, "bench_llama_server")


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


# The runtime's steps before a first token (Completion.timings), in order.
TIMELINE_STEPS = ("tokenize", "queue", "lookup", "answer_wait", "restore", "prefill", "sample")


def serve_runtime(rt: Runtime, max_tokens: int, **prompt: Any) -> Served:
    ttft_ms, e2e_ms, done = stream_runtime(rt, max_tokens, **prompt)
    read = done.cache_delta["tokens_read"]
    t = done.timings
    return Served(ttft_ms, e2e_ms, done.prompt_tokens, max(1, done.prompt_tokens - read), read,
                  done.text, list(done.tokens),
                  {"hit": done.cache_hit_kind, "tier": done.cache_tier,
                   "finish_reason": done.finish_reason, "engine_ttft_ms": t["ttft_ms"],
                   "restore_ms": t["restore_ms"], "prefill_ms": t["prefill_ms"],
                   "timeline_ms": {step: t[f"{step}_ms"] for step in TIMELINE_STEPS},
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


