"""Per-request sampling over one logits row: pure functions of (logits, settings, rng)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Written so that NaN fails them too. A value let through here raises in sample()
        # on the model thread, which fails every request decoding at that moment.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, Integral) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not self.max_tokens >= 1:
            raise ValueError("max_tokens must be >= 1")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be strings")


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    # Shifted before dividing: logits / a tiny temperature overflow to inf, and inf - inf
    # is NaN. Shifted, the best score is 0 and the others lie below it, down to -inf.
    scores = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # to -inf: a probability of 0, as it should be
        scores = (scores - np.max(scores)) / params.temperature
    if params.top_k and params.top_k < scores.size:
        cut = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores >= cut, scores, -np.inf)
    probs = np.exp(scores)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(probs.size, p=probs))


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1
