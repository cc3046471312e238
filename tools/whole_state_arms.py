"""The kvcache arm of ``tools/bench_whole_states.py``, two ways: the runtime in this
process (:class:`InProcess`, prompts sent as tokens) or ``model-runtime gateway``'s
``/v1/completions`` (:class:`ThroughGateway`, prompts sent as text, back to back: as an
agent whose tools answer at once drives a raw completion endpoint). Both take the
workload's next text, say which tokens it is (what llama-server is sent too), and report
per request the prompt tokens read from the cache and prefilled.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.procs import Gateway

from model_runtime.client import RuntimeClient
from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import LlamaModel
from model_runtime.runtime import Runtime


@dataclass
class Sent:
    """One request as the kvcache arm sent it: the replay sends the same."""

    text: str
    tokens: list[int]
    prefix_tokens: int  # the declared save boundary (end of the system message), 0: none
    reply: str  # kvcache's generated text


class KvcacheArm(Protocol):
    def prepare(self, text: str, head: str) -> Sent:
        """The request of ``text`` (``head``: its system part, "" for raw text)."""
        ...

    def request(self, sent: Sent, max_tokens: int) -> tuple[dict[str, Any], str]:
        """One greedy request: its row (prompt, read, prefilled, ...) and its text."""
        ...

    def save_counters(self) -> dict[str, int]:
        ...

    def close(self) -> None:
        ...


def row_of(prompt: int, read: int, **more: Any) -> dict[str, Any]:
    return {"prompt": prompt, "read": read, "prefilled": prompt - read, **more}


class InProcess:
    """The runtime in this process; with ``settle`` each request waits for its saves (the
    time an agent's tool call or a user's reading gives them)."""

    def __init__(self, model: Path, address: str, config: RuntimeConfig, settle: bool
                 ) -> None:
        self.rt = Runtime(model, cache_address=address, config=config)
        self.settle = settle

    def prepare(self, text: str, head: str) -> Sent:
        tokens, prefix = (self.rt.tokenize_with_head(text, head) if head
                          else (self.rt.tokenize(text), 0))
        return Sent(text, tokens, prefix, "")

    def request(self, sent: Sent, max_tokens: int) -> tuple[dict[str, Any], str]:
        done = self.rt.complete(tokens=list(sent.tokens), prefix_tokens=sent.prefix_tokens,
                                max_tokens=max_tokens, timeout=600)
        if self.settle:
            assert self.rt.engine.saver.flush(60.0), "saves did not reach the daemon"
        return (row_of(len(sent.tokens), done.cache_delta["tokens_read"],
                       hit=done.cache_hit_kind, tier=done.cache_tier), done.text)

    def settle_all(self) -> None:
        assert self.rt.engine.saver.flush(60.0), "saves did not reach the daemon"

    def state_bytes(self) -> int:
        return int(self.rt.engine.call(lambda: self.rt.ctx.state_seq_size(0)))

    def save_counters(self) -> dict[str, int]:
        """The runtime's save counters: a save dropped (its backlog full on a loaded
        machine, the daemon slow) is a checkpoint a later request, or the run after the
        restart, cannot find."""
        return saves_of(self.rt.stats())

    def close(self) -> None:
        self.rt.close()


def saves_of(counters: dict[str, Any]) -> dict[str, int]:
    return {name: int(n) for name, n in sorted(counters.items()) if name.startswith("saves_")}


class ThroughGateway:
    """``model-runtime gateway`` serving the model with one worker of the runtime's
    defaults (``n_seq_max`` 4, ``min_save_tokens`` 64 ...), raw text to its
    ``/v1/completions``, each request sent as soon as the previous one answered. Only raw
    workloads (no system part: a chat would go to ``/v1/chat/completions``)."""

    def __init__(self, model: Path, address: str, threads: int, log_path: Path,
                 worker_args: Sequence[str] = ()) -> None:
        self.model = LlamaModel(str(model))  # tokenizes as the worker does, for the replay
        args = ["--model", f"m={model}"]
        if worker_args:
            args += ["--worker-args", " ".join(worker_args)]
        self.gateway = Gateway(log_path, *args, cache=address, threads=threads)
        self.gateway.start(timeout=300)

    def prepare(self, text: str, head: str) -> Sent:
        assert not head, "the gateway arm sends raw text only"
        return Sent(text, self.model.tokenize(text), 0, "")

    def request(self, sent: Sent, max_tokens: int) -> tuple[dict[str, Any], str]:
        body = json.dumps({"model": "m", "prompt": sent.text, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.gateway.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
        usage = answer["usage"]
        if usage["prompt_tokens"] != len(sent.tokens):  # the worker tokenized otherwise
            raise AssertionError(f"{usage['prompt_tokens']} prompt tokens, "
                                 f"{len(sent.tokens)} here")
        return (row_of(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]),
                answer["choices"][0]["text"])

    def settle_all(self) -> None:
        """Nothing to wait on from outside: the gateway's worker saves as it serves, and
        stops with a shutdown of its saves."""

    def state_bytes(self) -> int:
        return 0  # (the worker's context is not reachable from here)

    def save_counters(self) -> dict[str, int]:
        (worker,) = self.gateway.status()["workers"]
        with RuntimeClient(f"unix:{worker['socket']}", timeout=10) as client:
            return saves_of(client.stats().get("counters", {}))

    def close(self) -> None:
        self.gateway.close()
        self.model.close()
