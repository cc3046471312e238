"""Per-request sampling and text: a token from one logits row (a pure function of
logits, settings and rng), and the generated text as it streams out, cut at the first
stop string. Run on the model thread, one request at a time.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .config import SettingError, check_int, check_number

SEED_MAX = 2**64 - 1  # numpy's generators take any non-negative int; the wire a uint64
DEFAULT_MAX_TOKENS = 128  # when a request gives no max_tokens
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # report each generated token's log probability
    top_logprobs: int = 0  # and that many of the most likely tokens at its place

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
        check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise SettingError("top_logprobs", "needs logprobs")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model (its raw scores, before any
    sampling setting), and the most likely tokens at its place, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """Log-softmax of ``logits`` at ``token``, and the ``top`` best (ties: lower id first)."""
    scores = logits.astype(np.float64)
    peak = float(np.max(scores))
    with np.errstate(under="ignore"):
        log_total = peak + float(np.log(np.sum(np.exp(scores - peak))))
    best: tuple[tuple[int, float], ...] = ()
    if top:
        top = min(top, scores.size)
        ids = np.argpartition(-scores, top - 1)[:top]
        ids = ids[np.lexsort((ids, -scores[ids]))]
        best = tuple((int(i), float(scores[i]) - log_total) for i in ids)
    return TokenLogprob(int(token), float(scores[token]) - log_total, best)


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


class StopScanner:
    """Finds the earliest stop string in a text that only grows, scanning each character
    a bounded number of times: per call, the new text and the last ``hold`` characters
    before it (where a stop string split across tokens starts). Empty stop strings never
    match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        #: Characters at the end of the text that may still begin a stop string.
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self._clean = 0  # text[:_clean] holds no stop string

    def find(self, text: str) -> int:
        """Index where the earliest stop string starts in ``text`` (the text of the
        previous call with more appended), or -1."""
        start = max(0, self._clean - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            return min(hits)
        self._clean = len(text)
        return -1


class TextStream:
    """A request's generated text as it is streamed: token bytes in, text out.

    An incomplete UTF-8 sequence waits in the decoder for its next bytes; invalid bytes
    become U+FFFD, as in the final text. Text that could still be the start of a stop
    string is held back until it is known not to be, and a stop string ends the text
    before it. The pieces handed out always add up to the final text (see close)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.text = ""
        self.emitted = 0  # characters of text handed out so far
        self.stopped = False  # a stop string ended the text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopScanner(stops)

    def add(self, piece: bytes) -> tuple[str, bool]:
        """Append one token's bytes. Returns the text that may be streamed now, and
        whether a stop string ended the text (it then ends where the stop string began)."""
        self.text += self._decoder.decode(piece)
        at = self._stops.find(self.text)
        if at >= 0:
            self.text, self.stopped = self.text[:at], True
            return self._take(self.text), True
        return self._take(self.text[: max(self.emitted, len(self.text) - self._stops.hold)]), False

    def close(self) -> tuple[str, str]:
        """The final text, and its end not streamed yet (held back, or bytes still in the
        decoder; "" when nothing is left)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self.text, self._take(self.text)

    def _take(self, upto: str) -> str:
        piece = upto[self.emitted :]
        self.emitted = max(self.emitted, len(upto))
        return piece
