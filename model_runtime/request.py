"""A request and the plain types that travel with it: its phase, the sequence it runs
on, what it streams and how it ends, and the messages of the model thread's inbox.

Data only. A request is created by ``Engine.submit`` (any thread) and from then on
written by the model thread alone; its caller reads ``events`` (PromptDone once its prompt
is in place, TokenEvent pieces, then a Completion or a RequestError).
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache.client import LoadedBlob
from kvcache.common import HIT_COLD

from .sampling import SamplingParams, TextStream, TokenLogprob

if TYPE_CHECKING:
    from .sampler import RequestSampler
    from .speculation import Speculation


SessionKey = tuple[str, str]  # (tenant, session id)


class RequestError(Exception):
    """A request the runtime refuses, with a machine-readable ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Phase(enum.Enum):
    ADMIT = "admit"  # submitted, or waiting for a free sequence
    RESOLVE = "resolve"  # bound to a sequence, cache resolution on a resolver thread
    PREFILL = "prefill"  # its prompt runs through the model, in chunks
    DECODE = "decode"  # one token per tick
    DONE = "done"  # completed, failed or cancelled: its sequence is released


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def servable(shared: int, n_prompt: int, has_end_scores: bool) -> int:
    """Prompt tokens a state sharing ``shared`` leading tokens with a prompt of
    ``n_prompt`` serves: all it shares, except that a state holding the whole prompt
    serves all of it only with the scores after its last token (else that token is
    decoded again, for them)."""
    if shared >= n_prompt:
        return n_prompt if has_end_scores else n_prompt - 1
    return shared


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str  # stop | length | shutdown
    finish_key: str  # hex key of the finish save ("" when none was made)
    cache_hit_kind: str  # exact | partial | cold | sticky
    cache_delta: dict[str, int]  # tokens_read, tokens_saved
    timings: dict[str, float]  # milliseconds: ttft, restore, prefill, decode, total
    prompt_tokens: int
    session_id: str = ""
    cache_tier: str = ""  # where reused KV came from: ram | disk | remote | live ("" if none)
    saves: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked
    choice: int = 0  # which of the request's n choices (0 when n is 1)
    stop_sequence: str = ""  # the stop string that ended the text ("": none)
    # Speculation: tokens drafted and verified, of them accepted (taken as drafted); the
    # prediction's tokens and how many of them were accepted.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "choice": self.choice,
            "text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
            "finish_key": self.finish_key, "cache_hit_kind": self.cache_hit_kind,
            "cache_delta": self.cache_delta, "timings": self.timings,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
            "session_id": self.session_id, "cache_tier": self.cache_tier, "saves": self.saves,
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "prediction_tokens": self.prediction_tokens,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            **({"logprobs": [{"token": lp.token, "logprob": lp.logprob,
                              "top": [list(t) for t in lp.top]} for lp in self.logprobs]}
               if self.logprobs else {}),
        }


@dataclass
class PromptDone:
    """The request's prompt is in its sequence (restored, reused in place or computed):
    what the cache gave it and the saves queued for it so far. Put once, by choice 0,
    before the first token; the Completion repeats these figures."""

    prompt_tokens: int
    cache_hit_kind: str
    cache_tier: str
    cache_delta: dict[str, int]  # tokens_read, tokens_saved
    saves: list[dict[str, Any]]


@dataclass
class TokenEvent:
    token: int  # the sampled token, or -1: text flushed when the request ends
    text: str
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    choice: int = 0  # which of the request's n choices it belongs to
    # time.monotonic_ns() when llama_decode returned the scores this token was sampled
    # from (0: none, flushed text): the start of the token's way to its reader, which
    # any process on this host can measure against (CLOCK_MONOTONIC is system-wide).
    decoded_ns: int = 0


class EventQueue(queue.Queue[Any]):
    """A request's events, from the model thread to their reader, who says when it comes
    back for more: the model thread can then wait, between two steps, for a reader that
    keeps up to have sent the token it was just given (:class:`HandOffs`), rather than
    have it send while llama.cpp's threads need both cores."""

    def __init__(self) -> None:
        super().__init__()
        self._readers_waiting = 0
        self._comebacks = 0  # blocking gets begun so far
        self._came_back = threading.Condition(self.mutex)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not block:
            return super().get(block, timeout)
        with self.mutex:
            self._readers_waiting += 1
            self._comebacks += 1
            self._came_back.notify_all()
        try:
            return super().get(block, timeout)
        finally:
            with self.mutex:
                self._readers_waiting -= 1

    def reader_waiting(self) -> bool:
        """Whether a reader waits for events now."""
        return self._readers_waiting > 0

    def put_watched(self, item: Any) -> int | None:
        """Put ``item``; when its reader was waiting for events (keeping up: it takes all
        that is there when it wakes), the mark that :meth:`wait_taken` waits past."""
        with self.mutex:
            keeping_up = self.reader_waiting()
            mark = self._comebacks
        self.put(item)
        return mark if keeping_up else None

    def wait_taken(self, mark: int, timeout: float) -> bool:
        """Wait until the reader has taken everything put and come back for more since
        ``mark``, up to ``timeout`` seconds (the GIL released meanwhile)."""
        with self.mutex:
            return self._came_back.wait_for(
                lambda: self._comebacks > mark and not self._qsize(), max(0.0, timeout))


class HandOffs:
    """A step's tokens given to readers that were waiting for them (EventQueue), and the
    wait, after the step, until those readers have sent them: the GIL released, which a
    reader (a gRPC stream's thread) needs to send. Without it a reader gets the GIL only
    when the next step enters llama_decode, and takes a core from llama.cpp's threads in
    the middle of it, where both wait for the slower at every barrier. A reader that is
    behind is not waited for. Model thread only."""

    def __init__(self) -> None:
        self._handed: list[tuple[EventQueue, int]] = []

    def put(self, events: EventQueue, item: Any) -> None:
        mark = events.put_watched(item)
        if mark is not None:
            self._handed.append((events, mark))

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` in all for this step's readers to have sent their tokens;
        False when one had not by then (the wait cut short). Then a new step begins."""
        handed, self._handed = self._handed, []
        if not handed or seconds <= 0:
            return True
        deadline = time.perf_counter() + seconds
        return all(events.wait_taken(mark, deadline - time.perf_counter())
                   for events, mark in handed)


class WholeAnswerEvents(EventQueue):
    """The events of a request whose caller reads its answer whole (it streams nothing to
    anyone: the gateway's requests without ``stream``). Its text pieces are held and
    queued with the final record or error that ends it, in their order, at once: the
    caller and the process serving it wake once, not once a token, beside llama.cpp's
    threads. Only the model thread puts."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[TokenEvent] = []

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, TokenEvent):
            self._held.append(item)
            return
        items, self._held = [*self._held, item], []
        with self.not_full:  # (unbounded: never waits) one wake-up for all of them
            for event in items:
                self._put(event)
            self.unfinished_tasks += len(items)
            self.not_empty.notify()

    def put_watched(self, item: Any) -> int | None:
        self.put(item)
        return None  # nothing to hand off before the end


@dataclass
class CacheUse:
    """What the cache gave a request and what was saved of it."""

    hit_kind: str = HIT_COLD
    tier: str = ""  # where reused KV came from (Completion.cache_tier)
    tokens_read: int = 0  # prompt tokens served from a saved or live state
    tokens_saved: int = 0  # tokens its saves hold beyond those read
    saves: list[dict[str, Any]] = field(default_factory=list)  # reason, tokens, key (hex)
    prompt_saved: bool = False  # its prompt went with a save (see Executor._prompt_waypoint)


@dataclass
class Timings:
    """A request's timeline, in seconds (perf_counter): when the runtime received it
    (before its prompt was tokenized), queued it, gave it a sequence, had its cache
    lookup's answer (on the resolver thread) and took it (on the model thread, once the
    batch it was running ended), had its prompt in the sequence and sampled its first
    token; and the time spent restoring, prefilling and decoding (a batch's time is
    shared by its tokens). A step that did not happen keeps 0 (a live hit waits for no
    answer)."""

    arrived: float = field(default_factory=time.perf_counter)  # queued (Engine.submit)
    received: float = 0.0  # Runtime.submit called (0: the engine was called directly)
    admitted: float = 0.0
    answered: float = 0.0  # the resolver had the cache answer (0: none was asked)
    resolved: float = 0.0  # the model thread took it (or, with none asked, went on)
    prompt_done: float = 0.0
    first: float = 0.0
    restore: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0

    def to_ms(self, now: float) -> dict[str, float]:
        """Milliseconds: ``ttft`` and ``total`` from receipt; the steps before the first
        token (``tokenize`` .. ``sample``, which add up to ``ttft`` with the gaps between
        them: the model thread finishing the batch it was running), and the time spent
        restoring, prefilling and decoding."""
        start = self.received or self.arrived

        def span(a: float, b: float) -> float:
            return round((b - a) * 1000, 3) if a and b else 0.0

        return {
            "ttft_ms": span(start, self.first or now),
            "restore_ms": round(self.restore * 1000, 3),
            "prefill_ms": round(self.prefill * 1000, 3),
            "decode_ms": round(self.decode * 1000, 3),
            "total_ms": span(start, now),
            "tokenize_ms": span(self.received, self.arrived),
            "queue_ms": span(self.arrived, self.admitted),
            "lookup_ms": span(self.admitted, self.answered or self.resolved),
            "answer_wait_ms": span(self.answered, self.resolved),
            "sample_ms": span(self.prompt_done, self.first),
        }


@dataclass(eq=False)
class Request:
    """One completion request: what was asked, where it stands, what it produced."""

    # -- what was asked (fixed at submit)
    id: int
    tokens: list[int]
    sampling: SamplingParams
    session_id: str = ""
    parent_key: bytes = b""
    boundary: int = 0  # explicit cold save boundary (end of the system message); 0: none
    # More explicit boundaries (cache_control breakpoints), each with the seconds its
    # entry stays pinned in the daemon (0: not pinned).
    boundaries: tuple[tuple[int, int], ...] = ()
    n: int = 1  # choices asked for
    tenant: str = ""  # the salt of its cache namespace: tenants share nothing
    choice: int = 0  # which of the n choices this is (see fork_choice)
    # Choice 0's request, for choices 1..n-1 (None for choice 0 itself).
    first: Request | None = None
    # -- where it stands
    phase: Phase = Phase.ADMIT
    seq: Seq | None = None
    n_past: int = 0  # prompt tokens in the sequence so far
    save_at: int = 0  # cold save boundary still to take (0: none)
    # Whether the state at save_at is saved with the scores after it: the cold boundary's
    # is, a checkpoint taken for the prefill's sake is not (no prompt is expected to end
    # there; Gemma 3's scores are 1 MB).
    save_scores: bool = False
    # Prompt tokens an idle sequence's live KV can serve in place (0: none). Resolution
    # restores from the daemon only when that covers more; a live sequence wins a tie.
    live_keep: int = 0
    admitted_tick: int = 0  # the batches the engine had run when it got a sequence
    # The blobs a restore set the state from, kept mapped until the first token: unmapping
    # a 47 MB state costs ~1.5 ms, better spent after the first token than before it.
    restored_from: list[LoadedBlob] = field(default_factory=list)
    cancelled: bool = False
    # Choice 0 of n > 1, until its prompt is done: the n - 1 sequences held for the other
    # choices (empty, bound to it); then the other choices' requests, which run on them.
    reserved: list[Seq] = field(default_factory=list)
    others: list[Request] = field(default_factory=list)
    # -- what it produced
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of generated, when asked
    pending: int = -1  # sampled, not yet decoded
    cache: CacheUse = field(default_factory=CacheUse)
    timings: Timings = field(default_factory=Timings)
    events: EventQueue = field(default_factory=EventQueue)
    stream: TextStream = field(init=False)
    # Its llama.cpp sampler chain: made when it gets a sequence, closed when it ends.
    sampler: RequestSampler | None = None
    # Where its drafts come from and what they gave (None: it drafts nothing).
    spec: Speculation | None = None

    def __post_init__(self) -> None:
        self.stream = TextStream(self.sampling.stop, self.sampling.keep_stop)

    @property
    def choices(self) -> list[Request]:
        """Every choice of this request that runs (choice 0 first); asked of choice 0."""
        return [self, *self.others]

    def fork_choice(self, choice: int, seq: Seq) -> Request:
        """Choice ``choice`` of this request (choice 0, its prompt done): the same prompt
        and settings on ``seq`` (which holds a copy of the prompt's KV), its own output,
        events into the same queue, and the cache use and timings so far (the prompt's,
        shared). Its sampler is made by the caller."""
        assert self.choice == 0 and self.n_past == len(self.tokens)
        cache = CacheUse(hit_kind=self.cache.hit_kind, tier=self.cache.tier,
                         tokens_read=self.cache.tokens_read,
                         tokens_saved=self.cache.tokens_saved, saves=list(self.cache.saves))
        return Request(self.id, self.tokens, self.sampling, parent_key=self.parent_key,
                       boundary=self.boundary, boundaries=self.boundaries, n=self.n,
                       tenant=self.tenant, choice=choice,
                       first=self, phase=Phase.DECODE, seq=seq, n_past=self.n_past,
                       cache=cache, timings=dataclasses.replace(self.timings),
                       events=self.events,
                       spec=self.spec.fork() if self.spec is not None else None)

    @property
    def session_key(self) -> SessionKey | None:
        """Its session, as the runtime names sessions: each tenant has its own ids."""
        return (self.tenant, self.session_id) if self.session_id else None

    def prompt_done(self) -> PromptDone:
        return PromptDone(len(self.tokens), self.cache.hit_kind, self.cache.tier,
                          {"tokens_read": self.cache.tokens_read,
                           "tokens_saved": self.cache.tokens_saved}, list(self.cache.saves))

    def completion(self, reason: str, finish_key: bytes, text: str, now: float) -> Completion:
        spec = self.spec
        return Completion(
            text=text, tokens=list(self.generated), finish_reason=reason,
            finish_key=finish_key.hex(), cache_hit_kind=self.cache.hit_kind,
            cache_delta={"tokens_read": self.cache.tokens_read,
                         "tokens_saved": self.cache.tokens_saved},
            timings=self.timings.to_ms(now), prompt_tokens=len(self.tokens),
            session_id=self.session_id, cache_tier=self.cache.tier, saves=self.cache.saves,
            logprobs=list(self.logprobs), choice=self.choice,
            stop_sequence=self.stream.stop_sequence,
            drafted_tokens=spec.drafted if spec else 0,
            accepted_tokens=spec.accepted if spec else 0,
            prediction_tokens=spec.n_prediction if spec else 0,
            accepted_prediction_tokens=spec.accepted_prediction if spec else 0)


@dataclass(eq=False)
class Seq:
    """One of the context's sequences, as the model thread sees it: its KV cells hold
    ``tokens`` (and, while a tick verifies drafts, ``unverified`` more)."""

    id: int
    tokens: list[int] = field(default_factory=list)  # exactly what the KV cells hold
    session: SessionKey | None = None  # the session pinned to it
    # The tenant whose request put its KV there: only that tenant's requests reuse it.
    tenant: str = ""
    request: Request | None = None  # the request running on it
    last_used: float = 0.0  # time.monotonic() of its last bind or release
    saved_len: int = 0  # length of the last state saved from this sequence
    saved_key: bytes = b""  # its key, when this process computed it
    restored: bool = False  # holds a restored state (matters for SWA/recurrent models)
    # Scores of the token after the first n cells, by n, where this process has them: a
    # prompt's end, a save boundary, the last decoded token. A request whose prompt is
    # exactly those n tokens samples its first token from them and decodes nothing
    # before it (see ``note_logits`` for what is kept).
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    decoded_at: int = -1  # the length whose scores came from a decode step (replaced)
    # KV cells after ``tokens`` that hold drafted tokens not verified yet: only between a
    # batch that verifies drafts and the end of its verification (Executor.settle).
    unverified: int = 0

    def note_logits(self, row: np.ndarray, *, decoded: bool = False) -> None:
        """Keep ``row`` as the scores after the cells the sequence holds now. A decode
        step's scores replace the previous step's, so a long generation keeps one row."""
        n = len(self.tokens)
        if decoded:
            if self.decoded_at != n:
                self.logits.pop(self.decoded_at, None)
            self.decoded_at = n
        elif self.decoded_at == n:
            self.decoded_at = -1  # kept from now on
        self.logits[n] = row

    def forget_logits_after(self, n_keep: int) -> None:
        """The sequence keeps only its first ``n_keep`` cells: scores after later cells go."""
        for n in [n for n in self.logits if n > n_keep]:
            del self.logits[n]
        if self.decoded_at > n_keep:
            self.decoded_at = -1


# -- the model thread's inbox ---------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    request: Request


@dataclass(frozen=True)
class Cancel:
    request: Request


@dataclass(frozen=True)
class Resolved:
    """Cache resolution is done: the saved state to restore (root first), or None."""

    request: Request
    chain: list[LoadedBlob] | None


@dataclass(frozen=True)
class Call:
    """Run ``fn`` on the model thread; ``(True, value)`` or ``(False, error)`` goes to
    ``result``."""

    fn: Callable[[], Any]
    result: queue.Queue[tuple[bool, Any]]


@dataclass(frozen=True)
class Shutdown:
    done: threading.Event


Message = Submit | Cancel | Resolved | Call | Shutdown
