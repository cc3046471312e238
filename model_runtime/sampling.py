"""Per-request sampling settings and text: what a request asks of its sampler (checked
here, so every entry point refuses a bad setting with the same message), a token's log
probability from its raw scores, and the generated text as it streams out, cut at the
first stop string.

The sampling itself runs on llama.cpp's sampler chain, one per request (see
:mod:`model_runtime.sampler`). Run on the model thread, one request at a time.
"""

from __future__ import annotations

import codecs
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .config import SettingError, check_int, check_number

SEED_MAX = 2**64 - 1  # the wire's uint64
DEFAULT_MAX_TOKENS = 128  # when a request gives no max_tokens
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
DEFAULT_PENALTY_LAST_N = 64  # llama.cpp's default window for the penalties
MAX_LOGIT_BIAS = 100.0  # as OpenAI's API; -inf bans a token outright
# Below this a temperature samples the most likely token, as 0 does: scores divided by a
# smaller one overflow llama.cpp's float32, and inf - inf is NaN.
GREEDY_BELOW = 1e-6
MAX_GRAMMAR_BYTES = 1 << 20


@dataclass(frozen=True)
class GrammarTrigger:
    """Where a lazy grammar starts constraining the output: the first place the literal
    ``value`` occurs in the generated text, or, with ``pattern``, where the regular
    expression ``value`` (Python's ``re`` syntax) first matches it. From there on (from
    the start of a pattern's first capturing group, when it has one that matched) the
    text must follow the grammar, so the grammar itself starts with the trigger (e.g.
    ``root ::= "<tool_call>" ...``)."""

    value: str
    pattern: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not self.value:
            raise SettingError("grammar_triggers", f"must be non-empty strings, got "
                                                   f"{self.value!r}")
        if self.pattern:
            try:
                self.regex()
            except re.error as exc:
                raise SettingError("grammar_triggers", f"pattern {self.value!r} is not a "
                                                       f"regular expression: {exc}") from None

    def regex(self) -> re.Pattern[bytes]:
        """The trigger as a pattern over the output's UTF-8 bytes."""
        value = self.value.encode()
        return re.compile(value if self.pattern else re.escape(value))


@dataclass(frozen=True)
class Sampling:
    """How each token of a request is drawn: the request's sampling part, and what a
    sampler chain is made of (llama_backend.SamplerChain). Checked when it is made, so a
    bad setting is refused before any work on the request (what each field does:
    model_runtime.completion_request)."""

    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None  # None: a random draw
    repeat_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N  # 0: no penalties; -1: the whole context
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    def __post_init__(self) -> None:
        # A value let through here would reach llama.cpp on the model thread, where some
        # abort the process (a NaN) and others fail every request decoding.
        check_number("temperature", self.temperature, 0)
        check_int("top_k", self.top_k, 0)
        check_number("top_p", self.top_p, 0, above=True, high=1)
        check_number("min_p", self.min_p, 0, high=1)
        if self.seed is not None:
            check_int("seed", self.seed, 0, SEED_MAX)
        check_number("repeat_penalty", self.repeat_penalty, 0, above=True)
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), -math.inf)
        check_int("penalty_last_n", self.penalty_last_n, -1)
        for token, bias in self.logit_bias:
            check_int("logit_bias", token, 0)
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and (
                    -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS or bias == -math.inf)):
                raise SettingError("logit_bias", f"values must be numbers from "
                                                 f"{-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g} "
                                                 f"(or -inf to ban a token), got {bias!r} "
                                                 f"for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SamplingParams:
    """What one request (one choice of it) asks of its sampler: its :class:`Sampling`,
    and the output's grammar, length, stop strings and log probabilities, as the engine
    applies them (made by Runtime.submit from a CompletionRequest)."""

    sampling: Sampling = Sampling()
    grammar: str = ""  # GBNF; "" for none
    grammar_triggers: tuple[GrammarTrigger, ...] = ()  # lazy grammar: free text until one
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    keep_stop: bool = False  # the stop string that ended the text stays at its end
    ignore_eos: bool = False  # an end-of-generation token does not end the output
    special_tokens: bool = False  # control tokens show in the text
    logprobs: bool = False  # report each generated token's log probability
    top_logprobs: int = 0  # and that many of the most likely tokens at its place

    def __post_init__(self) -> None:
        # As for Sampling's fields: a value let through here would reach llama.cpp.
        if not isinstance(self.grammar, str):
            raise SettingError("grammar", f"must be a string, got {type(self.grammar).__name__}")
        if len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise SettingError("grammar", f"must be at most {MAX_GRAMMAR_BYTES} bytes")
        if self.grammar_triggers and not self.grammar:
            raise SettingError("grammar_triggers", "need a grammar (or json_schema) to start")
        check_int("max_tokens", self.max_tokens, 1)
        if not all(isinstance(s, str) for s in self.stop):
            raise SettingError("stop", f"must be strings, got {self.stop!r}")
        check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise SettingError("top_logprobs", "needs logprobs")


def logit_bias_pairs(bias: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
    """A request's ``logit_bias`` mapping as Sampling holds it (ids ascending)."""
    if not bias:
        return ()
    if not isinstance(bias, Mapping):
        raise SettingError("logit_bias", f"must map token ids to biases, got {bias!r}")
    pairs = []
    for token, value in bias.items():
        check_int("logit_bias", token, 0)
        pairs.append((int(token), value))
    return tuple(sorted(pairs))


def as_triggers(triggers: Sequence[str | GrammarTrigger]) -> tuple[GrammarTrigger, ...]:
    """Triggers as given (a plain string is a literal), as SamplingParams holds them."""
    if isinstance(triggers, (str, bytes)):
        raise SettingError("grammar_triggers", "must be a list of triggers, not one string")
    return tuple(t if isinstance(t, GrammarTrigger) else GrammarTrigger(t) for t in triggers)


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
    before it (after it with ``keep_stop``). The pieces handed out always add up to the
    final text (see close)."""

    def __init__(self, stops: Sequence[str], keep_stop: bool = False) -> None:
        self.text = ""
        self.emitted = 0  # characters of text handed out so far
        self.stopped = False  # a stop string ended the text
        self.stop_sequence = ""  # which one (Anthropic's stop_reason names it)
        self._stop_strings = tuple(stops)
        self._keep_stop = keep_stop
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopScanner(stops)

    def add(self, piece: bytes) -> tuple[str, bool]:
        """Append one token's bytes. Returns the text that may be streamed now, and
        whether a stop string ended the text (it then ends where the stop string began)."""
        self.text += self._decoder.decode(piece)
        at = self._stops.find(self.text)
        if at >= 0:
            self.stop_sequence = next((s for s in self._stop_strings
                                       if self.text.startswith(s, at)), "")
            end = at + len(self.stop_sequence) if self._keep_stop else at
            self.text, self.stopped = self.text[:end], True
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
