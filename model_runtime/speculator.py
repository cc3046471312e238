"""The model thread's part of speculation (see :mod:`.speculation`): each request's
draft sources, each tick's drafts for the decoding requests, and what verifying them
teaches. The engine verifies (:meth:`EngineCore._verify`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .draft_model import DraftJob, DraftModel
from .drafts import MODEL, NO_DRAFT, Draft, Lookup
from .speculation import (
    DRAFT_MODE,
    OFF,
    AcceptanceTable,
    Speculation,
    StepCost,
    draft_lengths,
)


@dataclass
class Candidate:
    """A decoding request that may draft this tick: its speculation, its sequence and
    tenant, its history (prompt, output, the pending token last: read only for a draft
    model) and how many tokens it may draft at most (its context and max_tokens)."""

    spec: Speculation
    seq_id: int
    tenant: str
    history: Callable[[], Sequence[int]]
    limit: int


class Speculator:
    """``mode``: the runtime's default (:data:`~.speculation.MODES`); ``cost``: the main
    context's :class:`StepCost`; ``draft_model``: with mode ``draft``; ``catch_up``: tokens
    a draft sequence computes per tick at most (the prefill chunk)."""

    def __init__(self, mode: str, draft_max: int, cost: StepCost, *,
                 draft_model: DraftModel | None = None, catch_up: int = 256,
                 possible: bool = True,
                 count: Callable[[str, int], None] = lambda name, n: None) -> None:
        self.mode = mode
        self.draft_max = draft_max
        self.cost = cost
        self.draft_model = draft_model
        self.catch_up = catch_up
        # False where a drafted token's cell could not be taken out again (a recurrent or
        # hybrid model's state cannot be cut): nothing is ever drafted.
        self.possible = possible
        self.count = count
        self.table = AcceptanceTable()

    def for_request(self, prompt: Sequence[int], speculative: bool | None,
                    prediction: Sequence[int] = ()) -> Speculation | None:
        """A request's speculation (None: it drafts nothing). ``speculative``: None for
        the runtime's mode; False: none; True: the runtime's draft model if it has one,
        else prompt lookup. A prediction is a draft source whenever the request
        speculates (on a runtime whose mode is off too, unless it says False). Built on
        the caller's thread (the prompt's n-gram table)."""
        if not self.possible or speculative is False:
            return None
        on = self.mode != OFF if speculative is None else True
        if not on and not prediction:
            return None
        use_model = on and self.mode == DRAFT_MODE and self.draft_model is not None
        ngrams = on and not use_model
        lookup = Lookup.of_prompt(prompt, prediction=prediction, ngrams=ngrams) \
            if ngrams or prediction else None
        return Speculation(lookup, use_model, n_prediction=len(prediction))

    def drafts(self, candidates: Sequence[Candidate], n_rows: int) -> list[Draft]:
        """This tick's draft of each candidate (empty: none), in a batch of ``n_rows``
        decoding rows: each source's guess, as long as :func:`draft_lengths` finds it worth
        verifying; a draft model's guesses made once its sequence has caught up."""
        guesses: list[Draft] = []
        for c in candidates:
            k = min(c.limit, self.draft_max)
            guess = c.spec.lookup.draft(k) if c.spec.lookup is not None else NO_DRAFT
            if not guess.tokens and c.spec.use_model and k > 0:
                guess = Draft((0,) * k, 0, MODEL)  # (its chances depend on places only)
            guesses.append(guess)
        step_ms = self.draft_model.step_ms if self.draft_model is not None else 0.0
        lengths = draft_lengths([self.table.chances(g) for g in guesses], n_rows, self.cost,
                                [step_ms if g.source == MODEL else 0.0 for g in guesses])
        out = [replace(g, tokens=g.tokens[:n]) if n else NO_DRAFT
               for g, n in zip(guesses, lengths, strict=True)]
        jobs = [(i, DraftJob(c.seq_id, c.tenant, c.history(), lengths[i]))
                for i, c in enumerate(candidates)
                if out[i].source == MODEL and out[i].tokens]
        if jobs:
            assert self.draft_model is not None
            ready = [(i, job) for i, job in jobs if self.draft_model.catch_up(job, self.catch_up)]
            made = self.draft_model.draft([job for _, job in ready])
            for i, _ in jobs:
                out[i] = NO_DRAFT
            for (i, _), tokens in zip(ready, made, strict=True):
                out[i] = Draft(tuple(tokens), 0, MODEL)
        return out

    def verifying(self, spec: Speculation, draft: Draft) -> None:
        """``draft`` is about to be verified: its tokens count as drafted."""
        spec.drafted += len(draft.tokens)
        self.count("draft_tokens", len(draft.tokens))

    def learn(self, draft: Draft, accepted: int) -> None:
        """``draft`` was verified, its first ``accepted`` tokens taken (each told to its
        request's :meth:`Speculation.took` as it was): the acceptance statistics learn."""
        self.table.record(draft, len(draft.tokens), accepted)
        self.count("draft_tokens_accepted", accepted)
