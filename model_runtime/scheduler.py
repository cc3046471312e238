"""Which request runs on which sequence, and what each tick decodes.

Owns the sequence pool and the request queues: admission (a free sequence, or the
session's pinned one; with none free, the least recently used idle session's), the
requests waiting for a sequence, and each tick's batch plan (tokens, positions,
sequence ids and which positions want logits) as plain data. Decisions only: it never
touches llama.cpp or the cache. The engine carries them out (a truncate, a clear, an
``evict`` save) and tells it what ran. Called on the model thread only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .request import Phase, Request, RequestError, Seq, SessionKey, common_prefix, servable

# Batches in a row a prefilling request may be passed over for shorter prompts
# (Scheduler._prefill_order).
PREFILL_MAX_PASSES = 4


@dataclass(frozen=True)
class Admission:
    """Where a new request goes: refused (``error``), a sequence, or (neither) it waits."""

    seq: Seq | None = None
    # The sequence is an idle session's: its state is saved (``evict``) and the session
    # unpinned before the request takes it.
    evict: bool = False
    error: RequestError | None = None
    # A request of n > 1 choices: the n - 1 more sequences it holds for its other choices
    # (an idle session's among them is saved and unpinned first, like ``seq``).
    others: tuple[Seq, ...] = ()


class Reuse(enum.Enum):
    """What a bound request keeps of its sequence's live KV."""

    NONE = "none"  # nothing: an empty sequence (cache resolution may restore a state)
    STICKY = "sticky"  # its session's own sequence goes on from ``keep`` tokens
    LIVE = "live"  # an idle sequence's ``keep`` tokens, unless the cache covers more


@dataclass(frozen=True)
class Binding:
    reuse: Reuse
    keep: int = 0  # tokens of the sequence's live KV the prompt can keep


@dataclass(frozen=True)
class Row:
    """One request's part of a batch: ``n`` tokens from batch index ``start``."""

    request: Request
    start: int
    n: int
    decode: bool  # the pending token (and drafted ones); else a chunk of the prompt
    # Tokens drafted after the pending token, with scores kept at every place of the row
    # (the engine verifies them: EngineCore._verify).
    drafts: tuple[int, ...] = ()

    @property
    def last(self) -> int:
        return self.start + self.n - 1


@dataclass
class BatchPlan:
    """One ``llama_decode``: entry i is ``tokens[i]`` at ``positions[i]`` of sequence
    ``seq_ids[i]``, with logits kept where ``logits[i]``."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def add(self, req: Request, tokens: Sequence[int], first_pos: int, decode: bool,
            wants_logits: bool, drafts: Sequence[int] = ()) -> None:
        """``tokens`` (then ``drafts``, scores kept at each place) from ``first_pos``."""
        assert req.seq is not None
        n = len(tokens) + len(drafts)
        self.rows.append(Row(req, len(self.tokens), n, decode, tuple(drafts)))
        self.tokens.extend(tokens)
        self.tokens.extend(drafts)
        self.positions.extend(range(first_pos, first_pos + n))
        self.seq_ids.extend([req.seq.id] * n)
        self.logits.extend([False] * (len(tokens) - 1) + [wants_logits] +
                           [True] * len(drafts))


class Scheduler:
    def __init__(self, n_seq: int, n_batch: int, *, cut_restored: bool,
                 cut_live: bool = True) -> None:
        self.seqs = [Seq(i) for i in range(n_seq)]
        self.sessions: dict[SessionKey, Seq] = {}  # (tenant, session id) -> its sequence
        self.waiting: list[Request] = []  # admitted, waiting for a sequence (oldest first)
        self.resolving: set[Request] = set()  # waiting for cache I/O
        self.running: list[Request] = []  # prefill or decode, in the order they started
        # Prefilling requests and the batches in a row that ran another's prompt (plan).
        self.passed_over: dict[Request, int] = {}
        self.n_batch = n_batch  # tokens per llama_decode, across sequences
        # Whether a sequence may be cut: a restored one where states can be cut (plain
        # attention); a live one unless the model is recurrent (see can_cut).
        self.cut_restored = cut_restored
        self.cut_live = cut_live

    # -- admission ------------------------------------------------------------------------

    def admit(self, req: Request) -> Admission:
        """A session's request goes to its pinned sequence (busy: ``sticky_busy``);
        any other to a free sequence (n of them for n choices), else an idle session's;
        else, or while other requests wait, it waits (queued here)."""
        key, sid = req.session_key, req.session_id
        if key is not None and key in self.sessions:
            seq = self.sessions[key]
            if seq.request is not None:
                return Admission(error=RequestError(
                    "sticky_busy", f"session {sid!r} has a request running"))
            return Admission(seq)
        if key is not None and any(r.session_key == key for r in self.waiting):
            return Admission(error=RequestError(
                "sticky_busy", f"session {sid!r} has a request waiting"))
        # Behind a waiting request, a new one waits too: a request of n choices waits
        # for n sequences, which later requests must not take one by one.
        admission = self._place(req) if not self.waiting else Admission()
        if admission.seq is None:
            self.waiting.append(req)
        return admission

    def next_waiting(self) -> tuple[Request, Admission] | None:
        """The oldest waiting request, taken off the queue, and the sequence it gets now;
        None while no sequence is free for it."""
        if not self.waiting:
            return None
        admission = self._place(self.waiting[0])
        if admission.seq is None:
            return None
        return self.waiting.pop(0), admission

    def _place(self, req: Request) -> Admission:
        """A request of n choices gets n sequences at once or waits (the oldest waiting
        request goes first: a later one never takes the sequences it waits for)."""
        free = [s for s in self.seqs if s.request is None and not s.session]
        idle = [s for s in self.seqs if s.request is None and s.session]
        if len(free) + len(idle) < req.n:
            return Admission()
        if free:
            # The one whose live KV serves the most of the prompt; else the least recently
            # used, so the most recent finished states stay reusable longest.
            seq = max(free, key=lambda s: (self.reusable_prefix(s, req), -s.last_used))
        else:
            seq = min(idle, key=lambda s: s.last_used)
        # The other choices' sequences: free ones before idle sessions', least recently
        # used first.
        rest = [s for s in sorted(free, key=lambda s: s.last_used) if s is not seq]
        rest += [s for s in sorted(idle, key=lambda s: s.last_used) if s is not seq]
        return Admission(seq, evict=not free, others=tuple(rest[:req.n - 1]))

    def unpin(self, seq: Seq) -> None:
        """The sequence no longer belongs to its session (it was evicted)."""
        assert seq.session is not None
        del self.sessions[seq.session]
        seq.session = None

    def bind(self, req: Request, seq: Seq) -> Binding:
        """Put ``req`` on ``seq`` (pinning its session there) and say what of the
        sequence's live KV it can keep."""
        key = req.session_key
        own_session = key is not None and seq.session == key
        req.seq = seq
        seq.request = req
        seq.last_used = time.monotonic()
        keep = self.reusable_prefix(seq, req)
        seq.tenant = req.tenant  # (what it keeps is the same tenant's)
        if key is not None:
            seq.session = key
            self.sessions[key] = seq
        if own_session and keep:
            return Binding(Reuse.STICKY, keep)
        if own_session or not keep:
            return Binding(Reuse.NONE)
        req.live_keep = keep
        return Binding(Reuse.LIVE, keep)

    def reusable_prefix(self, seq: Seq, req: Request) -> int:
        """How many of the request's prompt tokens the sequence's live KV can serve in
        place: the common prefix; all of them only where the sequence kept the scores
        after them (else the last is decoded again for them); 0 where cutting the
        sequence is not safe (a restored SWA/recurrent state), and 0 for another tenant's
        KV (tests/runtime/test_tenants_per_request.py)."""
        if seq.tenant != req.tenant:
            return 0
        tokens = req.tokens
        keep = servable(common_prefix(seq.tokens, tokens), len(tokens),
                        len(tokens) in seq.logits)
        if keep <= 0 or (keep < len(seq.tokens) and not self.can_cut(seq)):
            return 0
        return keep

    def can_cut(self, seq: Seq) -> bool:
        """Whether the sequence may be cut: a plain-attention one always; a live
        sliding-window one too (llama.cpp keeps its full-size SWA cache by default); a
        restored SWA state or a recurrent/hybrid state never (llama.cpp would empty it,
        or refuses a partial removal)."""
        return self.cut_restored or (not seq.restored and self.cut_live)

    # -- phases ---------------------------------------------------------------------------

    def resolve(self, req: Request) -> None:
        req.phase = Phase.RESOLVE
        self.resolving.add(req)

    def resolved(self, req: Request) -> None:
        self.resolving.discard(req)

    def hold(self, req: Request, seq: Seq) -> None:
        """Keep the empty ``seq`` for one of the request's other choices."""
        seq.request = req
        seq.last_used = time.monotonic()
        req.reserved.append(seq)

    def start_choice(self, choice: Request) -> None:
        """Another choice of a request runs, on the sequence held for it (which holds a
        copy of the prompt now): it decodes from the next tick."""
        assert choice.seq is not None
        choice.seq.request = choice
        self.running.append(choice)

    def start(self, req: Request) -> None:
        """Its sequence holds what it reuses: the rest of the prompt runs from the next
        tick; a prompt served whole (its first token is sampled from kept scores)
        decodes from then on."""
        req.phase = Phase.DECODE if req.n_past == len(req.tokens) else Phase.PREFILL
        self.running.append(req)

    def release(self, req: Request) -> Seq | None:
        """The request is done: off every queue, its sequence (returned) free again. A
        finished sequence keeps its KV: the next request sharing a prefix with it can
        reuse it in place, as llama.cpp's server does with its slots."""
        req.phase = Phase.DONE
        self.passed_over.pop(req, None)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        for held in req.reserved:  # (ended before its prompt was copied to them)
            held.request = None
        req.reserved = []
        seq = req.seq
        if seq is not None:
            seq.request = None
            seq.last_used = time.monotonic()
        return seq

    # -- one tick -------------------------------------------------------------------------

    def plan(self, prefill_chunk: int, drafts: Mapping[Request, Sequence[int]] | None = None
             ) -> BatchPlan | None:
        """The next batch: one token of every decoding request and the tokens ``drafts``
        has for it while the batch has room beyond one token of each, then a chunk of
        one prompt, of at most ``prefill_chunk`` tokens, while the batch has room (None:
        nothing runs). A chunk stops at the request's cold save boundary: a state can
        only be taken of the whole sequence, so prefill pauses there for the save.

        One prompt a batch, the one with the fewest tokens left (see _prefill_order):
        on the CPU a batch's time grows with its tokens, so prompts run side by side
        all wait for the sum of them, where one after another each waits only for
        those before it (four clients' 19-token prompts arriving together: the first
        token of each after one batch of 76 tokens, or after 19, 38, 57 and 76)."""
        plan = BatchPlan()
        budget = self.n_batch
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        spare = max(0, budget - len(decoding))  # for drafted tokens
        for req in decoding:
            if budget == 0:
                break
            assert req.seq is not None
            drafted = list((drafts or {}).get(req, ()))[:spare]
            plan.add(req, [req.pending], len(req.seq.tokens), decode=True, wants_logits=True,
                     drafts=drafted)
            budget -= 1 + len(drafted)
            spare -= len(drafted)
        prefilling = [r for r in self.running if r.phase is Phase.PREFILL]
        if prefilling and budget:
            req = min(prefilling, key=self._prefill_order)
            for other in prefilling:
                self.passed_over[other] = 0 if other is req else \
                    self.passed_over.get(other, 0) + 1
            at_boundary = req.save_at > req.n_past
            stop = req.save_at if at_boundary else len(req.tokens)
            n = min(prefill_chunk, budget, stop - req.n_past)
            # Scores at the prompt's end, and at the cold save boundary (saved with that
            # state, so a prompt ending there needs no decode after its restore); not at a
            # checkpoint taken for the prefill's sake (see SavePoints.plan_cold).
            plan.add(req, req.tokens[req.n_past : req.n_past + n], req.n_past, decode=False,
                     wants_logits=req.n_past + n == stop and (req.save_scores or
                                                              not at_boundary))
        return plan if plan.rows else None

    def _prefill_order(self, req: Request) -> tuple[int, ...]:
        """Which prompt runs first: the one with the fewest tokens left (the order that
        gets the most first tokens out soonest), ties to the older; but one passed over
        PREFILL_MAX_PASSES batches in a row goes before any other (the oldest such
        first): shorter prompts arriving all the time never hold a long one back for
        good."""
        order = self.running.index(req)
        if self.passed_over.get(req, 0) >= PREFILL_MAX_PASSES:
            return (0, order)
        return (1, len(req.tokens) - req.n_past, order)

    def advance(self, row: Row) -> bool:
        """The batch ran: the row's tokens are in its sequence (a decode row's drafted
        tokens join its tokens as they are verified). True when that completed the prompt
        (the request decodes from now on)."""
        req = row.request
        seq = req.seq
        assert seq is not None
        if row.decode:
            seq.tokens.append(req.pending)
            return False
        seq.tokens.extend(req.tokens[req.n_past : req.n_past + row.n])
        req.n_past += row.n
        if req.n_past < len(req.tokens):
            return False
        req.phase = Phase.DECODE
        return True

    # -- gauges ---------------------------------------------------------------------------

    def busy(self) -> int:
        return sum(s.request is not None for s in self.seqs)

    def idle_sessions(self) -> int:
        return sum(s.request is None and bool(s.session) for s in self.seqs)

    def free(self) -> int:
        return sum(s.request is None and not s.session for s in self.seqs)
