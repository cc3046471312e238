"""What the runtime tests share: the configuration of a runtime over a daemon, texts of the
tiny model's vocabulary, prompts cut from them, and saves flushed to the daemon."""

from __future__ import annotations

from kvcache.client import CacheClient
from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime
from tests.support.tiny_llama import sample_prompt

CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, prefill_chunk=128,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       shutdown_deadline_s=10.0,
                       reuse_live=False)  # these tests follow the daemon path
FLUSH_S = 30.0  # upper bound for the background saves to reach the daemon

# Text of the tiny model's vocabulary (ASCII and merged pieces).
TEXT_A = "the cat and the dog sat on the mat with a hat, "
TEXT_B = "in the end it is what it is, or so they say to you. "
TEXT_C = "Numbers: 3.14159, 2718, 42! Letters: abc def ghi. "
TEXT_D = "we went up the hill and down the road to see the sea. "


def prompt(rt: Runtime, n: int, text: str = TEXT_A) -> list[int]:
    return sample_prompt(rt.tokenize, n, text)


def flush(rt: Runtime) -> None:
    assert rt.engine.saver.flush(FLUSH_S), "saves did not reach the daemon"


def daemon_counters(address: str) -> dict[str, int]:
    with CacheClient(address, timeout=10) as c:
        return dict(c.stats().counters)


def delta(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)
