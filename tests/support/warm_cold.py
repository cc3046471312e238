"""Warm equals cold: the prompts, the runtime configuration and the requests the tests
of every reuse path share, and what of a completion must be equal."""

from __future__ import annotations

import random

import pytest

from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion
from model_runtime.runtime import Runtime

# Chunks of 48 tokens, cold saves at 32-token boundaries: prompts of 40 to 260 tokens are
# computed in several chunks, split at several places, and stored as several pieces.
CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, prefill_chunk=48,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       reuse_live=False)
BLOCKS = ("--block-size", "16")
MAX_TOKENS = 6
TEXT = ("the cat and the dog sat on the mat with a hat in the end it is what it is or "
        "so they say to you we went up the hill and down the road to see the sea "
        "numbers 3.14159 2718 42 letters abc def ghi")
WORDS = TEXT.split(" ")


def prompts(rt: Runtime, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(12, 90))
        out.append(rt.tokenize(" ".join(words)))
    return out


def words(rt: Runtime, n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` more tokens (no BOS), to extend a prompt with."""
    rng = random.Random(seed)
    toks: list[int] = []
    while len(toks) < n_tokens:
        toks += rt.tokenize(" " + " ".join(rng.choices(WORDS, k=8)))[1:]
    return toks[:n_tokens]


def outcome(c: Completion) -> tuple[list[int], list[tuple[int, float, tuple]]]:
    return c.tokens, [(lp.token, lp.logprob, lp.top) for lp in c.logprobs]


def ask(rt: Runtime, tokens: list[int], seed: int | None = None, **kw: object) -> Completion:
    sampling = {"temperature": 0.8, "seed": seed} if seed is not None else {}
    return rt.complete(tokens=tokens, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5,
                       **sampling, **kw)  # type: ignore[arg-type]


def kind(c: Completion) -> tuple[str, int]:
    return c.cache_hit_kind, c.cache_delta["tokens_read"]


def agree(warm: Completion, cold: Completion, what: object, *, bitwise: bool = True) -> None:
    """The same tokens and log probabilities: bit for bit (``bitwise``), or within 1e-3
    for a sliding-window model, whose restored window cache holds its cells in other
    places than a cold run's full-size one, so that attention adds the same terms in
    another order (log probabilities measured up to ~1e-4 apart; the tokens the same)."""
    if bitwise:
        assert outcome(warm) == outcome(cold), what
        return
    assert warm.tokens == cold.tokens, what
    for w, c in zip(warm.logprobs, cold.logprobs, strict=True):
        assert w.token == c.token and w.logprob == pytest.approx(c.logprob, abs=1e-3), what


def bitwise(rt: Runtime) -> bool:
    """Whether restores of the model give a cold run's numbers bit for bit (see agree)."""
    return rt.engine.model.n_swa == 0
