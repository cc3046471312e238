"""Speculative decoding that changes no token: what each tick verifies beside each
decoding request's pending token.

A decoding request's row of a batch carries its pending token and ``k`` drafted tokens,
with scores kept at each of the ``k + 1`` places; the engine then samples place by place
with the request's own sampler chain, exactly as ``k + 1`` single steps would, for as long
as the token sampled is the one drafted (:meth:`EngineCore._verify`). The deterministic
kernels compute a token alike alone or anywhere in a batch, so the scores at each place
are those the single steps would have had, and every token is the one a run without
speculation gives: greedy and seeded sampling alike (the chain draws once per token
emitted, from the same scores, in the same order).

Where drafts come from (:mod:`.drafts`): prompt lookup, a client's prediction, or a
draft model (:mod:`.draft_model`). How many of a draft to verify is decided per tick by
:func:`draft_lengths`: a drafted token is worth its place in the batch when the tokens it
is expected to yield per millisecond beat the batch's as planned so far. Its expected
yield is the chance that it and every drafted token before it are accepted, read from
:class:`AcceptanceTable` (learned from every verification, by source and by the draft's
support: how many tokens of history agree with the place it was copied from); its cost is
what one more token adds to a ``llama_decode`` (:class:`StepCost`, measured at start-up).
So a request that copies drafts long runs, one that writes prose drafts only where a long
stretch of history repeats, and with many requests decoding at once (each token of a
batch then yields more already) drafts only surer runs.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .drafts import MODEL, NGRAM, PREDICTION, Draft, Lookup

OFF, NGRAM_MODE, DRAFT_MODE = "off", "ngram", "draft"
#: ``--speculative``: off, drafts by prompt lookup, or drafts by a draft model.
MODES = (OFF, NGRAM_MODE, DRAFT_MODE)

#: Support buckets of the acceptance statistics (the last holds everything above).
SUPPORT_BUCKETS = (0, 1, 2, 3, 5, 8, 12, 16, 24, 32)
#: Where each source's statistics start, by support bucket. Prompt lookup's: measured on
#: SmolLM2-135M's greedy answers to tools/speculation_workloads.py (copying and prose
#: alike: a token copied after 2 agreeing tokens is the model's ~42% of the time, after
#: 9-12 ~88%, after more than 32 ~98%). A prediction is the client's word: trusted at
#: first. A draft model's support is the token's place in its draft (0 first).
PRIORS: dict[str, tuple[float, ...]] = {
    NGRAM: (0.3, 0.35, 0.42, 0.5, 0.78, 0.8, 0.88, 0.9, 0.93, 0.97, 0.98),
    PREDICTION: (0.85,) * (len(SUPPORT_BUCKETS) + 1),
    MODEL: (0.7,) * (len(SUPPORT_BUCKETS) + 1),
}
PRIOR_WEIGHT = 8.0  # verifications the prior counts as
FORGET_AT = 512.0  # a bucket's counts are halved beyond this: recent traffic weighs most


def support_bucket(support: int) -> int:
    for i, top in enumerate(SUPPORT_BUCKETS):
        if support <= top:
            return i
    return len(SUPPORT_BUCKETS)


class AcceptanceTable:
    """How often a drafted token is accepted, by source and support bucket, learned from
    every verification (a token counts when every token drafted before it was accepted:
    its own chance, given theirs)."""

    def __init__(self) -> None:
        self._counts = {source: [[p * PRIOR_WEIGHT, PRIOR_WEIGHT] for p in prior]
                        for source, prior in PRIORS.items()}

    def chance(self, source: str, support: int) -> float:
        hits, seen = self._counts[source][support_bucket(support)]
        return hits / seen

    def chances(self, draft: Draft) -> list[float]:
        """The chance that draft tokens ``0..i`` are all accepted, for each ``i``: each
        token's support is the draft's and one more per token accepted before it (a
        draft model's: its place)."""
        out, p = [], 1.0
        for i in range(len(draft.tokens)):
            p *= self.chance(draft.source, draft.match + i)
            out.append(p)
        return out

    def record(self, draft: Draft, drafted: int, accepted: int) -> None:
        """``drafted`` of the draft's tokens were verified, the first ``accepted`` taken."""
        counts = self._counts[draft.source]
        for i in range(min(accepted + 1, drafted)):
            bucket = counts[support_bucket(draft.match + i)]
            bucket[0] += i < accepted
            bucket[1] += 1
            if bucket[1] > FORGET_AT:
                bucket[0] /= 2
                bucket[1] /= 2


@dataclass(frozen=True)
class StepCost:
    """A ``llama_decode`` of ``n`` tokens takes about ``fixed_ms + per_token_ms * n``; a
    draft model's step (one token for each drafting request) ``draft_step_ms``."""

    fixed_ms: float
    per_token_ms: float
    draft_step_ms: float = 0.0


def draft_lengths(chances: Sequence[Sequence[float]], n_rows: int, cost: StepCost,
                  extra_ms: Sequence[float] = ()) -> list[int]:
    """How many of each request's drafted tokens to verify in a batch of ``n_rows``
    decoding rows (one token each): ``chances[j][i]`` is the chance request ``j``'s draft
    tokens ``0..i`` are all accepted (not increasing in ``i``), its expected yield; a
    token of request ``j`` costs ``per_token_ms + extra_ms[j]`` (0 if not given: a draft
    model's guess costs a step of it too). Tokens are taken best first while the next
    one's yield per millisecond beats the batch's as planned so far (the batch's rate
    then only rises: the best ratio of expected tokens to time, a fractional knapsack)."""
    lengths = [0] * len(chances)
    tokens = float(n_rows)  # expected tokens out: one per row for sure
    ms = cost.fixed_ms + cost.per_token_ms * n_rows
    per_token = [cost.per_token_ms + (extra_ms[j] if j < len(extra_ms) else 0.0)
                 for j in range(len(chances))]
    # Best yield per millisecond first.
    heap = [(-c[0] / per_token[j], j, 0) for j, c in enumerate(chances) if c]
    heapq.heapify(heap)
    while heap:
        _, j, i = heapq.heappop(heap)
        chance, cost_ms = chances[j][i], per_token[j]
        if chance * ms <= cost_ms * tokens:
            break
        tokens += chance
        ms += cost_ms
        lengths[j] = i + 1
        if i + 1 < len(chances[j]):
            heapq.heappush(heap, (-chances[j][i + 1] / cost_ms, j, i + 1))
    return lengths


@dataclass
class Speculation:
    """One choice's speculation: where its drafts come from, and what they gave."""

    lookup: Lookup | None  # prompt lookup and/or a prediction (None: neither)
    use_model: bool  # the draft model drafts for it
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # of them, taken
    accepted_prediction: int = 0  # taken from the prediction
    n_prediction: int = 0  # tokens of the prediction
    # The draft verified this tick (recorded once the row is sampled).
    pending_draft: Draft | None = field(default=None, repr=False)

    def fork(self) -> Speculation:
        """Another choice of the same request: the same sources, nothing drafted yet."""
        return Speculation(self.lookup.fork() if self.lookup is not None else None,
                           self.use_model, n_prediction=self.n_prediction)

    def took(self, draft: Draft) -> None:
        """A token of ``draft`` was verified and taken."""
        self.accepted += 1
        if draft.source == PREDICTION:
            self.accepted_prediction += 1

    def emitted(self, token: int) -> None:
        """A token joined the output (it is the pending token now)."""
        if self.lookup is not None:
            self.lookup.extend((token,))


def measure_step_cost(decode: Callable[[int, int], None], truncate: Callable[[int], None],
                      *, rounds: int = 5, width: int = 9, prefix: int = 32,
                      clock: Callable[[], float] = time.perf_counter) -> StepCost:
    """:class:`StepCost` of a context, from ``decode(n, at)`` (``n`` tokens from position
    ``at`` of one empty sequence) and ``truncate(n_keep)``: the fastest of ``rounds``
    decodes of 1 and of ``width`` tokens after a ``prefix``, alternated (the fastest:
    others' work on the machine only adds). Leaves the sequence empty."""
    one: list[float] = []
    wide: list[float] = []
    decode(prefix, 0)
    for _ in range(rounds):
        for n, times in ((1, one), (width, wide)):
            t0 = clock()
            decode(n, prefix)
            times.append((clock() - t0) * 1000)
            truncate(prefix)
    truncate(0)
    t1, tw = min(one), min(wide)
    # (A wider batch measured as cheap as one token: the cost of a token is taken as a
    # twentieth of a step, never nothing.)
    per_token = max((tw - t1) / (width - 1), t1 / 20)
    return StepCost(fixed_ms=max(t1 - per_token, 0.0), per_token_ms=per_token)
