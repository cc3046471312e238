"""Per-request sampling over one logits row: pure functions of (logits, settings, rng)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SettingError, check_int, check_number

SEED_MAX = 2**64 - 1  # numpy's generators take any non-negative int; the wire a uint64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A value let through here raises in sample() on the model thread, which fails
        # every request decoding at that moment.
        check_number("temperature", self.temperature, 0)
        check_int("top_k", self.top_k, 0)
        check_number("top_p", self.top_p, 0, above=True, high=1)
        if self.seed is not None:
            check_int("seed", self.seed, 0, SEED_MAX)
        check_int("max_tokens", self.max_tokens, 1)
        if not all(isinstance(s, str) for s in self.stop):
            raise SettingError("stop", f"must be strings, got {self.stop!r}")


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
