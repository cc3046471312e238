"""The scheduler with no model: admission, sessions, eviction choice and batch plans.

The scheduler decides and returns plain data; the engine carries its decisions out on
llama.cpp. Here nothing does: where the engine would prefill or restore, a test sets
``seq.tokens`` (what the sequence's KV cells would hold) itself.
"""

from __future__ import annotations

import pytest

from model_runtime.request import Phase, Request, Seq
from model_runtime.sampling import SamplingParams
from model_runtime.scheduler import PREFILL_MAX_PASSES, Admission, Binding, Reuse, Row, Scheduler

_ids = iter(range(1, 1_000_000))


def request(tokens: list[int] | int, session: str = "") -> Request:
    """A request for ``tokens`` (or that many tokens no other request's start with)."""
    i = next(_ids)
    toks = list(range(1000 * i, 1000 * i + tokens)) if isinstance(tokens, int) else tokens
    return Request(i, toks, SamplingParams(), session_id=session)


def scheduler(n_seq: int = 2, n_batch: int = 256, *, cut_restored: bool = True,
              cut_live: bool = True) -> Scheduler:
    return Scheduler(n_seq, n_batch, cut_restored=cut_restored, cut_live=cut_live)


def run(s: Scheduler, req: Request, *, hold: list[int] | None = None) -> Seq:
    """Admit ``req`` onto a sequence and start it; its sequence then holds ``hold``
    (default: its prompt), as after a prefill."""
    admission = s.admit(req)
    assert admission.seq is not None and admission.error is None, admission
    s.bind(req, admission.seq)
    s.start(req)
    admission.seq.tokens = list(req.tokens if hold is None else hold)
    return admission.seq


def finish(s: Scheduler, req: Request, when: float | None = None) -> Seq:
    seq = s.release(req)
    assert seq is not None
    if when is not None:
        seq.last_used = when
    return seq


# --------------------------------------------------------------------------- admission


def test_requests_take_free_sequences_then_wait_in_arrival_order() -> None:
    s = scheduler(n_seq=2)
    r1, r2, r3, r4 = (request(10) for _ in range(4))
    seq1, seq2 = run(s, r1), run(s, r2)
    assert seq1 is not seq2
    assert s.admit(r3) == Admission() and s.admit(r4) == Admission()
    assert s.waiting == [r3, r4] and s.next_waiting() is None
    assert (s.busy(), s.free()) == (2, 0)

    assert finish(s, r2) is seq2 and r2.phase is Phase.DONE and s.running == [r1]
    assert s.next_waiting() == (r3, Admission(seq2))  # the oldest first
    s.bind(r3, seq2)
    assert s.waiting == [r4] and s.next_waiting() is None


def test_a_request_of_n_choices_gets_n_sequences_at_once_and_later_ones_wait_behind_it(
        ) -> None:
    s = scheduler(n_seq=3)
    r1 = request(10)
    run(s, r1)
    sessions = request(10, session="a")
    seq_a = run(s, sessions)
    finish(s, sessions, when=1.0)  # an idle session's sequence, one free, one busy
    three = request(10)
    three.n = 3
    assert s.admit(three) == Admission() and s.waiting == [three]
    # A request that one free sequence could serve waits behind it.
    later = request(10)
    assert s.admit(later) == Admission() and s.waiting == [three, later]
    finish(s, r1, when=2.0)
    nxt = s.next_waiting()
    assert nxt is not None and nxt[0] is three
    admission = nxt[1]
    free = [q for q in s.seqs if q is not seq_a]
    # Free sequences first (the one for choice 0 too), then the idle session's (evicted).
    assert admission.seq in free and admission.others[-1] is seq_a
    assert not admission.evict and len(admission.others) == 2
    s.bind(three, admission.seq)
    for held in admission.others:
        if held.session:
            s.unpin(held)  # (the engine saves it first: evict)
        s.hold(three, held)
    assert s.busy() == 3 and s.next_waiting() is None
    finish(s, three)  # ended before its prompt was copied: every held sequence is free
    assert three.reserved == [] and s.free() == 3


def test_a_free_sequence_holding_most_of_the_prompt_is_chosen_else_the_least_recently_used(
        ) -> None:
    s = scheduler(n_seq=3)
    a, b, c = (request(40) for _ in range(3))
    seqs = [run(s, r) for r in (a, b, c)]
    for r, when in zip((a, b, c), (3.0, 1.0, 2.0), strict=True):
        finish(s, r, when)
    # Nothing in common with any: the least recently used sequence.
    assert s.admit(request(20)).seq is seqs[1]
    # Sharing 30 tokens with c's sequence, 5 with a's: c's, however recent.
    prompt = c.tokens[:30] + [1, 2, 3]
    seqs[0].tokens = prompt[:5] + [7] * 30
    assert s.admit(request(prompt)).seq is seqs[2]


def test_a_session_returns_to_its_pinned_sequence_and_keeps_its_kv_sticky() -> None:
    s = scheduler(n_seq=2)
    first = request(30, session="s")
    seq = run(s, first, hold=first.tokens + [7, 8])  # prompt + decoded tokens
    finish(s, first)
    assert s.sessions == {("", "s"): seq} and (s.idle_sessions(), s.free()) == (1, 1)
    # Another request never takes a session's sequence, even sharing its whole prefix.
    other = request(first.tokens + [7, 8, 9])
    assert s.admit(other).seq is not seq

    turn = request(first.tokens + [7, 8, 9, 10], session="s")
    assert s.admit(turn) == Admission(seq)
    assert s.bind(turn, seq) == Binding(Reuse.STICKY, 32)
    # Diverging inside the live sequence: it is cut there.
    s.release(turn)
    back = request(first.tokens[:20] + [1, 2], session="s")
    assert s.bind(back, s.admit(back).seq) == Binding(Reuse.STICKY, 20)  # type: ignore[arg-type]


def test_a_session_with_nothing_reusable_starts_from_an_empty_sequence() -> None:
    s = scheduler()
    first = request(30, session="s")
    seq = run(s, first)
    finish(s, first)
    again = request([1, 2, 3], session="s")
    assert s.bind(again, seq) == Binding(Reuse.NONE)


@pytest.mark.parametrize("busy", ["running", "waiting"])
def test_a_second_request_of_a_busy_session_is_refused_sticky_busy(busy: str) -> None:
    s = scheduler(n_seq=1)
    if busy == "running":
        run(s, request(10, session="s"))
    else:
        run(s, request(10))
        assert s.admit(request(10, session="s")).seq is None  # waits
    refused = s.admit(request(10, session="s"))
    assert refused.seq is None and refused.error is not None
    assert refused.error.code == "sticky_busy"
    assert str(refused.error) == f"session 's' has a request {busy}"
    assert len(s.waiting) == (busy == "waiting")  # the refused one does not wait
    assert s.admit(request(10, session="t")).error is None  # other sessions go on


def test_with_no_free_sequence_the_least_recently_used_idle_session_is_evicted() -> None:
    s = scheduler(n_seq=3)
    reqs = {name: request(20, session=name) for name in ("a", "b", "c")}
    seqs = {name: run(s, r) for name, r in reqs.items()}
    finish(s, reqs["a"], when=2.0)
    finish(s, reqs["b"], when=1.0)  # c is still running
    admission = s.admit(request(20))
    assert admission == Admission(seqs["b"], evict=True)
    s.unpin(seqs["b"])  # (after its evict save)
    assert set(s.sessions) == {("", "a"), ("", "c")} and seqs["b"].session is None


def test_busy_sequences_are_never_evicted_the_request_waits() -> None:
    s = scheduler(n_seq=2)
    run(s, request(20, session="a"))
    run(s, request(20, session="b"))
    waiting = request(20)
    assert s.admit(waiting) == Admission() and s.waiting == [waiting]


def test_an_idle_sequence_sharing_a_prefix_is_reused_live_less_the_last_prompt_token() -> None:
    s = scheduler()
    done = request(50)
    seq = run(s, done, hold=done.tokens + [7, 8])
    finish(s, done)
    longer = request(done.tokens + [7, 8, 9])
    assert s.admit(longer).seq is seq
    assert s.bind(longer, seq) == Binding(Reuse.LIVE, 52) and longer.live_keep == 52
    s.release(longer)
    # The same prompt again: all but its last token (decoded again for fresh logits).
    same = request(done.tokens)
    assert s.bind(same, seq) == Binding(Reuse.LIVE, 49)


@pytest.mark.parametrize("cut_restored, cut_live, restored, expected", [
    (True, True, True, 20),  # plain attention: any state can be cut
    (False, True, False, 20),  # sliding window, live: llama.cpp keeps the whole cache
    (False, True, True, 0),  # sliding window, restored: holds only the last window
    (False, False, False, 0),  # recurrent: never cut
])
def test_a_sequence_is_cut_only_where_llama_cpp_can_cut_it(
        cut_restored: bool, cut_live: bool, restored: bool, expected: int) -> None:
    s = scheduler(cut_restored=cut_restored, cut_live=cut_live)
    seq = Seq(0, tokens=list(range(40)), restored=restored)
    assert s.reusable_prefix(seq, request(list(range(20)) + [99])) == expected
    # Extending the sequence needs no cut: always reusable.
    assert s.reusable_prefix(seq, request(list(range(45)))) == 40


def test_another_tenant_never_reuses_a_sequence_s_kv_nor_its_session() -> None:
    s = scheduler(n_seq=2)
    mine = request(30, session="s")
    seq = run(s, mine)
    finish(s, mine)
    theirs = request(mine.tokens + [1])
    theirs.tenant = "other"
    assert s.reusable_prefix(seq, theirs) == 0
    same = request(mine.tokens + [1])
    assert s.reusable_prefix(seq, same) == 30
    # A session id names a session per tenant: the other tenant's "s" is another one.
    their_s = request(mine.tokens + [1], session="s")
    their_s.tenant = "other"
    admission = s.admit(their_s)
    assert admission.seq is not seq and admission.seq is not None
    assert s.bind(their_s, admission.seq).reuse is Reuse.NONE
    assert set(s.sessions) == {("", "s"), ("other", "s")}


# --------------------------------------------------------------------------- batch plans


def decoding(s: Scheduler, n_prompt: int, pending: int) -> Request:
    req = request(n_prompt)
    seq = run(s, req)
    req.phase, req.n_past, req.pending = Phase.DECODE, n_prompt, pending
    assert seq.tokens == req.tokens
    return req


def prefilling(s: Scheduler, n_prompt: int, save_at: int = 0) -> Request:
    req = request(n_prompt)
    seq = run(s, req, hold=[])
    req.save_at = save_at
    assert seq.tokens == []
    return req


def test_nothing_running_plans_nothing() -> None:
    assert scheduler().plan(128) is None


def test_a_batch_holds_one_token_per_decoding_request_then_prompt_chunks() -> None:
    s = scheduler(n_seq=3, n_batch=256)
    d1, p, d2 = decoding(s, 10, pending=7), prefilling(s, 300), None
    d2 = decoding(s, 4, pending=9)
    plan = s.plan(128)
    assert plan is not None
    assert plan.rows == [Row(d1, 0, 1, True), Row(d2, 1, 1, True), Row(p, 2, 128, False)]
    assert plan.tokens == [7, 9] + p.tokens[:128]
    assert plan.positions == [10, 4, *range(128)]
    assert plan.seq_ids == [d1.seq.id, d2.seq.id] + [p.seq.id] * 128  # type: ignore[union-attr]
    # Logits where a token is sampled: every decode token; no prompt token before its end.
    assert plan.logits == [True, True] + [False] * 128


def test_prefill_runs_in_chunks_and_only_the_last_prompt_token_wants_logits() -> None:
    s = scheduler(n_seq=1, n_batch=256)
    p = prefilling(s, 300)
    chunks = []
    while p.phase is Phase.PREFILL:
        plan = s.plan(128)
        assert plan is not None and [r.request for r in plan.rows] == [p]
        (row,) = plan.rows
        chunks.append((plan.positions[0], row.n, plan.logits.count(True)))
        done = s.advance(row)
        assert done == (p.n_past == 300)
    assert chunks == [(0, 128, 0), (128, 128, 0), (256, 44, 1)]
    assert p.seq is not None and p.seq.tokens == p.tokens and p.phase is Phase.DECODE


def test_prefill_stops_at_the_cold_save_boundary() -> None:
    s = scheduler(n_seq=1, n_batch=256)
    p = prefilling(s, 100, save_at=64)
    plan = s.plan(256)
    assert plan is not None and plan.rows[0].n == 64  # the state of 64 tokens is saved here
    s.advance(plan.rows[0])
    assert p.n_past == 64 and p.seq.tokens == p.tokens[:64]  # type: ignore[union-attr]
    p.save_at = 0  # (taken by the engine)
    plan = s.plan(256)
    assert plan is not None and (plan.positions[0], plan.rows[0].n) == (64, 36)


def test_a_boundary_already_passed_does_not_split_the_prompt() -> None:
    s = scheduler(n_seq=1)
    p = prefilling(s, 100, save_at=64)
    p.n_past = 80  # e.g. a restore served 80 tokens
    p.seq.tokens = p.tokens[:80]  # type: ignore[union-attr]
    plan = s.plan(256)
    assert plan is not None and plan.rows[0].n == 20


def test_the_batch_budget_goes_to_decoding_requests_first() -> None:
    s = scheduler(n_seq=5, n_batch=8)
    d = [decoding(s, 5, pending=i) for i in range(3)]
    p1, p2 = prefilling(s, 50), prefilling(s, 50)
    plan = s.plan(128)
    assert plan is not None
    assert [(r.request, r.n) for r in plan.rows] == [(d[0], 1), (d[1], 1), (d[2], 1), (p1, 5)]
    assert len(plan.tokens) == 8 and p2 not in [r.request for r in plan.rows]
    s.n_batch = 2
    plan = s.plan(128)
    assert plan is not None and [r.request for r in plan.rows] == d[:2]


def prefilled_in_turn(s: Scheduler) -> list[tuple[Request, int]]:
    """Batches planned and run until no prompt is left: whose prompt each ran, how much."""
    turns = []
    while (plan := s.plan(128)) is not None and \
            (rows := [r for r in plan.rows if not r.decode]):
        (row,) = rows  # one prompt a batch
        turns.append((row.request, row.n))
        for r in plan.rows:
            s.advance(r)
    return turns


def test_one_prompt_a_batch_the_one_with_fewest_tokens_left_first() -> None:
    """Prompts one after another, shortest first (ties to the older): each first token
    waits only for the prompts before it, not for all of them side by side."""
    s = scheduler(n_seq=4, n_batch=512)
    long, short, short2, mid = (prefilling(s, 300), prefilling(s, 19), prefilling(s, 19),
                                prefilling(s, 40))
    assert prefilled_in_turn(s) == [(short, 19), (short2, 19), (mid, 40), (long, 128),
                                    (long, 128), (long, 44)]


def test_a_prompt_passed_over_again_and_again_goes_first() -> None:
    """Shorter prompts arriving all the time never hold a long one back for good: one
    passed over PREFILL_MAX_PASSES batches in a row runs next."""
    s = scheduler(n_seq=2 + PREFILL_MAX_PASSES, n_batch=512)
    long = prefilling(s, 300)
    shorts = [prefilling(s, 10) for _ in range(PREFILL_MAX_PASSES + 1)]
    turns = prefilled_in_turn(s)
    assert turns[:PREFILL_MAX_PASSES + 1] == \
        [(r, 10) for r in shorts[:PREFILL_MAX_PASSES]] + [(long, 128)]
    assert turns[PREFILL_MAX_PASSES + 1] == (shorts[-1], 10)


def test_a_released_request_leaves_no_count_behind() -> None:
    s = scheduler(n_seq=2)
    a, b = prefilling(s, 50), prefilling(s, 20)
    assert s.plan(128) is not None and s.passed_over == {a: 1, b: 0}
    s.release(a)
    s.release(b)
    assert s.passed_over == {}


def test_decode_and_prefill_advance_their_sequences() -> None:
    s = scheduler(n_seq=2)
    d, p = decoding(s, 10, pending=7), prefilling(s, 20)
    plan = s.plan(128)
    assert plan is not None
    assert [s.advance(row) for row in plan.rows] == [False, True]
    assert d.seq.tokens == d.tokens + [7]  # type: ignore[union-attr]
    assert p.seq.tokens == p.tokens and p.n_past == 20  # type: ignore[union-attr]
    assert p.phase is Phase.DECODE
    assert plan.rows[1].last == plan.rows[1].start + 19  # where p's first token is sampled


# --------------------------------------------------------------------------- release


def test_a_cancelled_request_frees_its_sequence_for_the_next_waiting_one() -> None:
    s = scheduler(n_seq=1)
    running = request(20)
    seq = run(s, running)
    waiting = request(20)
    s.admit(waiting)
    assert s.release(running) is seq  # cancelled: released like any ended request
    assert running.phase is Phase.DONE and s.running == [] and seq.request is None
    assert seq.tokens == running.tokens  # its KV stays, for a later prompt to reuse
    assert s.next_waiting() == (waiting, Admission(seq))


def test_a_cancelled_waiting_request_leaves_the_queue() -> None:
    s = scheduler(n_seq=1)
    run(s, request(20))
    waiting = request(20)
    s.admit(waiting)
    assert s.release(waiting) is None and s.waiting == [] and waiting.phase is Phase.DONE


def test_phases_follow_the_request() -> None:
    s = scheduler(n_seq=1)
    req = request(20)
    assert req.phase is Phase.ADMIT
    seq = s.admit(req).seq
    assert seq is not None
    s.bind(req, seq)
    s.resolve(req)
    assert req.phase is Phase.RESOLVE and s.resolving == {req}
    s.resolved(req)
    s.start(req)
    assert req.phase is Phase.PREFILL and s.resolving == set() and s.running == [req]
    plan = s.plan(128)
    assert plan is not None and s.advance(plan.rows[0]) and req.phase is Phase.DECODE
    s.release(req)
    assert req.phase is Phase.DONE
