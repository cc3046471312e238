"""The runtime engine: one model thread owns the llama.cpp context and its sequences.

A request's life, and the module that owns each step:

1. admission (:mod:`.scheduler`): a free sequence, or its session's pinned one (busy ->
   ``sticky_busy``); with none free, the least recently used idle session is saved
   (``evict``) and released; otherwise the request waits for a sequence.
2. cache resolution (:mod:`.resolver`, on a resolver thread so cache I/O never stalls
   decoding): ``parent_key``, then the session's in-flight save, then the
   longest-common-prefix lookup. The session's own live sequence skips this
   (``sticky``); another idle sequence's live KV serves when it covers at least as much
   as the daemon (``live``).
3. restore (:mod:`.executor`: set state, cut it after the tokens it shares with the
   prompt and before the prompt's last token, which is decoded again: a restored
   sequence has no logits), or a live sequence cut in place, or cold prefill; prefill
   runs in chunks, split at the ``cold`` save boundary (:mod:`.save_points`).
4. decode: every active sequence advances in one batched ``llama_decode`` per tick
   (the scheduler plans the batch, the executor runs it); a row may carry drafted
   tokens after the pending one (:mod:`.speculator` drafts them), verified here
   (:meth:`EngineCore._verify`): every token is the one a run without them gives.
5. completion (here): ``finish`` save, record with hit kind, cache delta and timings.

A request of ``n`` choices holds ``n`` sequences from admission on; its prompt runs
through steps 2 and 3 once (as choice 0), then is copied to the other sequences
(:meth:`EngineCore._fork`), where each other choice runs steps 4 and 5 as a request of
its own.

This module: :class:`Engine`, the public API (any thread), which builds the parts and
starts the model thread (:mod:`.model_thread`, its loop over the inbox); and
:class:`EngineCore`, what the model thread does with each message and each tick,
completion and shutdown included. Only ``state_seq_get`` runs on the model thread for a
save; the bytes go to the background :class:`~model_runtime.saver.Saver`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvcache.client import CacheClient, Identity, LoadedBlob
from kvcache.common import HIT_COLD, HIT_STICKY

from .config import RuntimeConfig, SettingError, check_int
from .counters import COUNTERS
from .executor import Executor
from .identity import Identities
from .llama_backend import GrammarDeadEnd, LlamaContext, LlamaDecodeError, LlamaError, LlamaModel
from .model_thread import ModelThread
from .request import (
    Call,
    Cancel,
    Completion,
    EventQueue,
    HandOffs,
    Message,
    Phase,
    Request,
    RequestError,
    Resolved,
    Seq,
    SessionKey,
    Shutdown,
    Submit,
    TokenEvent,
)
from .resolver import Resolver
from .sampling import SamplingParams
from .save_points import SavePoints
from .saver import Saver
from .scheduler import Admission, BatchPlan, Reuse, Row, Scheduler
from .speculation import OFF, StepCost
from .speculator import Candidate, Speculator

log = logging.getLogger("model_runtime")


class Engine:
    """The runtime's public face (any thread): submit, cancel, run code on the model
    thread, close; counters and gauges. Builds the parts and runs the model thread,
    which takes the inbox's messages one at a time and hands them to the core."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext, identity: Identity,
                 cache: CacheClient | None, config: RuntimeConfig,
                 speculator: Speculator | None = None) -> None:
        self.model = model
        self.ctx = ctx
        self.identity = identity  # the runtime's own tenant's (config.tenant)
        self.identities = Identities(  # any tenant's
            identity, cache.namespace_of if cache is not None else None)
        self.cache = cache
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.saver = Saver(cache, self.counters, self._lock, config.max_pending_saves,
                           min_shared_tokens=config.min_save_tokens,
                           in_flight_wait_ms=config.in_flight_wait_ms)
        self.observers: list[Callable[[Completion], None]] = []  # e.g. metrics
        self.on_latency: Callable[[str, float], None] = lambda name, seconds: None
        # Shown the sequences once per loop (model thread; idle: before it waits): the KV
        # events of the live sequences (model_runtime.kv_events).
        self.on_sequences: Callable[[list[Seq], bool], None] | None = None
        self.scheduler = Scheduler(ctx.n_seq_max, ctx.n_batch,
                                   cut_restored=ctx.can_truncate_restored(),
                                   cut_live=not model.is_recurrent)
        self.executor = Executor(ctx, self.identities, cache, self.saver, config,
                                 count=self.count,
                                 key_of=self.key_of,
                                 on_latency=lambda name, s: self.on_latency(name, s))
        self.save_points = SavePoints(config, self.executor, self.count)
        self.resolver = Resolver(cache, self.identities, self.saver, config,
                                 plain_kv=ctx.can_truncate_restored(), count=self.count,
                                 session_keys=self.save_points.session_last_key)
        # (Without one: drafts only from a request's prediction, judged by a nominal cost.)
        self.speculator = speculator or Speculator(OFF, config.draft_max, StepCost(1.0, 0.5),
                                                   possible=not model.is_recurrent)
        self.speculator.count = self.count
        self.thread = ModelThread(self)
        self.core = EngineCore(self, config, post=self.thread.put)
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._submit_lock = threading.Lock()  # orders submits against close()
        self.thread.start()

    @property
    def config(self) -> RuntimeConfig:
        return self.core.config

    @config.setter
    def config(self, config: RuntimeConfig) -> None:
        # Each part reads its settings where it uses them: a new config reaches them all.
        for part in (self.core, self.executor, self.save_points, self.resolver):
            part.config = config

    @property
    def seqs(self) -> list[Seq]:
        return self.scheduler.seqs

    @property
    def sessions(self) -> dict[SessionKey, Seq]:
        """(tenant, session id) -> the sequence pinned to it."""
        return self.scheduler.sessions

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def submit(self, tokens: list[int], sampling: SamplingParams, *, session_id: str = "",
               parent_key: bytes = b"", boundary: int = 0,
               boundaries: tuple[tuple[int, int], ...] = (), n: int = 1,
               tenant: str | None = None, received: float = 0.0,
               speculative: bool | None = None, prediction: Sequence[int] = (),
               events: EventQueue | None = None) -> Request:
        """Queue a request of ``n`` choices under ``tenant`` (None: the runtime's).
        ``received``: when its caller got it (perf_counter), for its timeline.
        ``speculative`` and ``prediction``: see Speculator.for_request. ``events``: where
        its events go (default: an EventQueue; WholeAnswerEvents, ChannelEvents)."""
        if not tokens:
            raise RequestError("invalid_argument", "empty prompt")
        if len(tokens) + 1 > self.ctx.n_ctx:
            raise RequestError("prompt_too_long",
                               f"prompt of {len(tokens)} tokens does not fit the context of "
                               f"{self.ctx.n_ctx} tokens per sequence")
        check_int("n", n, 1)
        if n > self.ctx.n_seq_max:
            raise RequestError("invalid_argument",
                               f"n {n} needs {n} sequences at once; this runtime has "
                               f"{self.ctx.n_seq_max} (n_seq_max)")
        if n > 1 and session_id:
            raise RequestError("invalid_argument", "n > 1 cannot be combined with a "
                                                   "session_id (a session is one sequence)")
        tenant = self.identity.tenant if tenant is None else tenant
        if not isinstance(tenant, str):
            raise SettingError("tenant", f"must be a string, got {tenant!r}")
        req = Request(next(self._ids), list(tokens), sampling, session_id, parent_key,
                      boundary if 0 < boundary < len(tokens) else 0,
                      boundaries=tuple((at, ttl) for at, ttl in boundaries
                                       if 0 < at < len(tokens)), n=n, tenant=tenant,
                      spec=self.speculator.for_request(tokens, speculative, prediction),
                      events=events if events is not None else EventQueue())
        req.timings.received = received
        # Checked and queued under the lock close() takes to set _stopping: a request is
        # either refused here or queued before the shutdown message (which answers it).
        # Queued after it, nothing would ever answer it and its caller would hang.
        with self._submit_lock:
            if self._stopping.is_set():
                raise RequestError("unavailable", "the runtime is shutting down")
            self.thread.put(Submit(req))
        return req

    def cancel(self, req: Request) -> None:
        self.thread.put(Cancel(req))

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the model thread (the only thread that may touch the context)."""
        result: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self.thread.put(Call(fn, result))
        ok, value = result.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Finish: stop admitting, save every live sequence (``shutdown``), flush saves."""
        with self._submit_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()  # submit() refuses from here on
        done = threading.Event()
        self.thread.put(Shutdown(done))
        done.wait(self.config.shutdown_deadline_s + 5)
        self.thread.join(timeout=5)
        self.resolver.close()
        self.saver.close(timeout=self.config.shutdown_deadline_s)

    def stats(self) -> dict[str, int]:
        """Every declared counter (zeros included) and any other counted."""
        with self._lock:
            return {**dict.fromkeys(COUNTERS, 0), **self.counters}

    def gauges(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        sched = self.scheduler
        return {
            ("sequences", (("state", "busy"),)): sched.busy(),
            ("sequences", (("state", "idle_session"),)): sched.idle_sessions(),
            ("sequences", (("state", "free"),)): sched.free(),
            ("requests_waiting", ()): len(sched.waiting),
            ("save_queue", ()): self.saver.pending(),
        }

    def key_of(self, tokens: Sequence[int], tenant: str | None = None) -> bytes:
        """The daemon's key for a state of ``tokens`` of ``tenant`` (None: the runtime's
        own), b"" while the daemon's block size is unknown. On the model thread this
        never waits for the daemon."""
        namespace = self.identities.namespace(self.identity.tenant if tenant is None else tenant)
        return self.resolver.key_of(tokens, namespace,
                                    wait=not self.thread.is_current())

class EngineCore:
    """What the model thread does with each message and each tick: it carries out the
    scheduler's decisions with the executor, the resolver and the save points, and
    completes, fails and releases requests. Model thread only."""

    def __init__(self, engine: Engine, config: RuntimeConfig, *,
                 post: Callable[[Message], None]) -> None:
        self.config = config
        self.model = engine.model
        self.n_ctx = engine.ctx.n_ctx
        self.has_cache = engine.cache is not None
        self.scheduler = engine.scheduler
        self.executor = engine.executor
        self.resolver = engine.resolver
        self.save_points = engine.save_points
        self.speculator = engine.speculator
        self.observers = engine.observers
        self.count = engine.count
        self._post = post  # into the model thread's inbox
        # When the last llama_decode returned (time.monotonic_ns): the start of the way
        # of each token sampled from its scores to its reader (TokenEvent.decoded_ns).
        self._decoded_ns = 0
        self.ticks, self.step_s = 0, 0.0  # batches run, the last one's time
        self.hand_offs = HandOffs()  # this step's tokens, sent before the next step
        # A step's finished requests end once every row's token is out: a finish copies a
        # state to save it (~4 ms for 1,000 tokens of SmolLM2), which they would wait for.
        self._ending: list[tuple[Request, str]] | None = None

    def handle(self, msg: Message) -> None:
        match msg:
            case Submit(req):
                self._admit(req)
            case Resolved(req, chain):
                self.scheduler.resolved(req)
                if self.scheduler.running:  # (did a batch run while it was looked up?)
                    self.count("lookups_awaited" if req.admitted_tick == self.ticks
                               else "lookups_after_batch")
                self._start(req, chain)
            case Cancel(req):
                req.cancelled = True
                for choice in req.choices:  # (every choice of a request of n)
                    if choice in self.scheduler.running or choice in self.scheduler.waiting:
                        # End it now rather than at the next tick: a request queued right
                        # behind the cancel (the same session's next turn) must find the
                        # session free, not fail with sticky_busy.
                        self._finish(choice, "cancelled")
            case Call(fn, result):  # tests and tools run code on the model thread
                try:
                    result.put((True, fn()))
                except Exception as exc:  # handed back to the caller
                    result.put((False, exc))

    def fail_running(self, exc: Exception) -> None:
        for req in list(self.scheduler.running):
            self._fail(req, exc)

    # -- admission, resolution, restore ---------------------------------------------------

    def _admit(self, req: Request) -> None:
        admission = self.scheduler.admit(req)
        if admission.error is not None:
            self._fail(req, admission.error)
        elif admission.seq is None:
            self.count("admission_waits")
        else:
            self._place(req, admission)

    def _place(self, req: Request, admission: Admission) -> None:
        seq = admission.seq
        assert seq is not None
        if admission.evict:
            self._evict(seq)
        for other in admission.others:  # held, empty, for the other choices
            if other.session:
                self._evict(other)
            else:
                self.executor.clear(other)
            self.scheduler.hold(req, other)
        binding = self.scheduler.bind(req, seq)
        req.timings.admitted = time.perf_counter()
        req.admitted_tick = self.ticks
        try:
            self.executor.new_sampler(req)
        except LlamaError as exc:  # (a grammar is checked before, so hardly ever)
            self._fail(req, RequestError("invalid_argument", str(exc)))
            return
        # Sticky: the session's live sequence already holds a prefix of this prompt.
        if binding.reuse is Reuse.STICKY and self.executor.truncate(seq, binding.keep):
            req.cache.hit_kind = HIT_STICKY
            req.cache.tokens_read = req.n_past = binding.keep
            self._begin_prefill(req)
            return
        if binding.reuse is not Reuse.LIVE:  # (also a sticky sequence that could not be cut)
            self.executor.clear(seq)
        elif binding.keep >= len(req.tokens) - 1 or not self.has_cache or \
                self.resolver.live_serves_best(req):  # no state found would be restored
            self.resolver.note_use(req)
            self._start(req, None)
            return
        # Cache resolution; a live sequence's KV is kept until it is known whether the
        # daemon covers more of the prompt.
        self.scheduler.resolve(req)
        self.resolver.submit(req, lambda r, chain: self._post(Resolved(r, chain)))

    def _evict(self, seq: Seq) -> None:
        """An idle session's sequence: saved, then taken from it."""
        self.save_points.evict(seq)
        self.count("sessions_evicted")
        self.scheduler.unpin(seq)
        self.executor.clear(seq)

    def _start(self, req: Request, chain: list[LoadedBlob] | None) -> None:
        """Resolution is done: restore the state found, or reuse the live sequence in
        place, or nothing (cold); then prefill the rest."""
        seq = req.seq
        assert seq is not None
        req.timings.resolved = time.perf_counter()
        if req.cancelled:
            self._finish(req, "cancelled")
            return
        if chain and self.executor.copy_pending(seq):
            # Its sequence took part in a copy to a request's choices that ended at their
            # first token, and no decode has made the copy yet: no state can be set into
            # it before one. The state found is good, so it is not forgotten; this
            # request computes its prompt instead (which makes the copy).
            self.count("restores_skipped_copy_pending")
            chain = None
        if chain:
            if not self.executor.restore(req, seq, chain):
                self.resolver.forget_later(chain[-1])  # llama.cpp refused it
        elif req.live_keep:
            self.executor.reuse_live(req, seq)
        if req.cache.hit_kind == HIT_COLD:
            self.count("cold_prefills")
        self._begin_prefill(req)

    def _begin_prefill(self, req: Request) -> None:
        self.save_points.plan_cold(req)
        self.scheduler.start(req)
        if req.n_past == len(req.tokens):
            # Served whole, with the scores after its last token: nothing to decode
            # before the first token, which is exactly the one a cold prefill gives.
            self._first_token(req)

    def _first_token(self, req: Request) -> None:
        req.timings.prompt_done = time.perf_counter()
        req.events.put(req.prompt_done())  # the prompt's side is known: told at once
        if req.n_past == req.cache.tokens_read:  # served whole: scores came with its state
            self._decoded_ns = time.monotonic_ns()
        others = self._fork(req) if req.reserved else []
        for choice in (req, *others):
            self._next_token(choice)
        req.timings.first = time.perf_counter()
        req.restored_from = []  # unmapped now, after the first token

    def _fork(self, req: Request) -> list[Request]:
        """Choice 0's prompt is done (computed, restored or reused in place, once): it is
        copied to the sequences held for the other choices, each of which gets its own
        sampler chain (its own seed) and runs as a request of its own from here, its
        events in the same queue. Every choice's first token is sampled from the same
        scores, the prompt end's (tests/runtime/test_n_choices.py)."""
        assert req.seq is not None
        for choice, seq in enumerate(req.reserved, start=1):
            self.executor.copy(req.seq, seq)
            other = req.fork_choice(choice, seq)
            self.executor.new_sampler(other)
            self.scheduler.start_choice(other)
            req.others.append(other)
        req.reserved = []
        return req.others

    def _next_token(self, req: Request) -> None:
        try:
            token = self.executor.sample(req)
        except GrammarDeadEnd as exc:
            self._fail(req, RequestError(
                "grammar_dead_end", f"after {len(req.generated)} generated tokens: {exc}"))
            return
        self._after_sample(req, token)

    # -- one tick: a batch over every active sequence -------------------------------------

    def tick(self) -> None:
        plan = self.scheduler.plan(self.config.prefill_chunk, self._drafts())
        if plan is None:
            return
        try:
            self._step(plan)
        finally:  # the streams keeping up send between steps (HandOffs)
            if not self.hand_offs.wait(self.config.hand_off_ms / 1000):
                self.count("hand_offs_cut_short")

    def _step(self, plan: BatchPlan) -> None:
        self.ticks += 1
        t0 = time.perf_counter()
        try:
            self.executor.run(plan)
        except (LlamaDecodeError, ValueError) as exc:
            for row in plan.rows:
                self._fail(row.request, RequestError("decode_failed",
                                                     f"llama_decode failed: {exc}"))
            return
        self._decoded_ns = time.monotonic_ns()
        elapsed = self.step_s = time.perf_counter() - t0
        self._ending = []
        try:
            for row in plan.rows:
                req = row.request
                share = elapsed * row.n / len(plan.tokens)
                prompt_done = self.scheduler.advance(row)
                if row.decode:
                    req.timings.decode += share
                    if row.drafts:
                        self._verify(req, row)
                    else:
                        self.executor.keep_logits(req, row.start, decoded=True)
                        self._next_token(req)
                    continue
                req.timings.prefill += share
                if plan.logits[row.last]:  # the prompt's end or a save boundary
                    self.executor.keep_logits(req, row.last)
                self.save_points.after_prefill(req)
                if prompt_done:
                    self._first_token(req)
        finally:
            ending, self._ending = self._ending, None
            for req, reason in ending:
                self._finish(req, reason)

    def _drafts(self) -> dict[Request, tuple[int, ...]]:
        """What each decoding request that speculates drafts this tick (see
        :mod:`.speculator`): never more than its context and max_tokens leave room for,
        never past a token its grammar refuses or an end of generation, and only on a
        sequence that can be cut (its rejected drafts are taken out again)."""
        decoding = [r for r in self.scheduler.running if r.phase is Phase.DECODE]
        drafting = [r for r in decoding if r.spec is not None and r.seq is not None
                    and r.sampler is not None and self.scheduler.can_cut(r.seq)]
        if not drafting:
            return {}
        candidates = []
        for req in drafting:
            seq = req.seq
            assert seq is not None and req.spec is not None
            # The cells the batch fills must fit the context; the tokens it can give (one
            # more than drafted) must fit max_tokens.
            limit = min(self.n_ctx - len(seq.tokens) - 1,
                        req.sampling.max_tokens - len(req.generated) - 1)
            candidates.append(Candidate(req.spec, seq.id, req.tenant,
                                        functools.partial(_history, req), limit))
        out = {}
        for req, draft in zip(drafting, self.speculator.drafts(candidates, len(decoding)),
                              strict=True):
            assert req.spec is not None and req.sampler is not None
            n = req.sampler.draftable(draft.tokens) if draft.tokens else 0
            req.spec.pending_draft = replace(draft, tokens=draft.tokens[:n]) if n else None
            if n:
                out[req] = draft.tokens[:n]
        return out

    def _verify(self, req: Request, row: Row) -> None:
        """The row held the request's pending token and drafted tokens, with scores at
        each place. Sampled place by place with the request's own chain, exactly as
        single steps would be: while the token sampled is the one drafted it is taken and
        its cell, computed from the same tokens as a single step's, kept; the first other
        token sampled is the next pending token and the cells after it are taken out. A
        token that ends the request (end of generation, a stop string, max_tokens) ends
        it as without drafts: nothing after it is emitted or kept. Saves wait for the end
        of the row: none ever holds a drafted token not verified."""
        seq, spec = req.seq, req.spec
        assert seq is not None and spec is not None and spec.pending_draft is not None
        draft, spec.pending_draft = spec.pending_draft, None
        # Counted before any token is emitted: a token that ends the request makes its
        # Completion at once, with these counts.
        self.speculator.verifying(spec, draft)
        accepted = 0
        try:
            for i in range(len(row.drafts) + 1):
                self.executor.keep_logits(req, row.start + i, decoded=True)
                try:
                    token = self.executor.sample(req)
                except GrammarDeadEnd as exc:
                    self._fail(req, RequestError(
                        "grammar_dead_end",
                        f"after {len(req.generated)} generated tokens: {exc}"))
                    return
                hit = i < len(row.drafts) and token == row.drafts[i]
                if hit:
                    accepted += 1
                    spec.took(draft)
                else:
                    self.executor.settle(seq)
                if not self._after_sample(req, token, save=False):
                    return
                if not hit:
                    break
                self.executor.accept_draft(seq, token)
            self.save_points.after_token(req, emitted=accepted + 1)
        finally:
            self.speculator.learn(draft, accepted)

    def _after_sample(self, req: Request, token: int, *, save: bool = True) -> bool:
        """``token`` was sampled for the request: emitted, or its end. True while the
        request goes on. ``save``: the ``continued`` save is its caller's."""
        seq = req.seq
        assert seq is not None
        # (ignore_eos is read only for an end-of-generation token: the common path pays
        # nothing for it). With it, an end still ends the output where a complete grammar
        # lets nothing else follow, which would otherwise fill it with ends.
        if self.model.is_eog(token) and (not req.sampling.ignore_eos or (
                req.sampler is not None and req.sampler.grammar_ended())):
            self._finish(req, "stop")
            return False
        logprob = self.executor.logprob(req, token) if req.sampling.logprobs else None
        req.generated.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        req.pending = token
        if req.spec is not None:
            req.spec.emitted(token)
        text, stopped = req.stream.add(self.model.token_to_piece(
            token, render_special=req.sampling.special_tokens))
        self.hand_offs.put(req.events, TokenEvent(token, text, logprob, choice=req.choice,
                                                  decoded_ns=self._decoded_ns))
        if stopped:
            self._finish(req, "stop")
            return False
        if save:
            self.save_points.after_token(req)
        if len(req.generated) >= req.sampling.max_tokens or len(seq.tokens) + 1 >= self.n_ctx:
            self._finish(req, "length")
            return False
        return True

    # -- completion and shutdown ----------------------------------------------------------

    def _finish(self, req: Request, reason: str) -> None:
        if self._ending is not None:  # after the step's other tokens (see __init__)
            self._ending.append((req, reason))
            return
        if req.seq is not None:
            self.executor.settle(req.seq)  # (its last token is never in its cells)
        finish_key = self.save_points.at_end(req, reason)
        now = time.perf_counter()
        text, rest = req.stream.close()
        if rest:
            # Text held back while it could have started a stop string (or an incomplete
            # UTF-8 sequence) is streamed now: the pieces always add up to the final text.
            req.events.put(TokenEvent(-1, rest, choice=req.choice))
        completion = req.completion(reason, finish_key, text, now)
        # Choices never started (the request ended before its prompt was done): each ends
        # with a record too, as its caller waits for one per choice.
        unstarted = [replace(completion, choice=i, saves=list(completion.saves))
                     for i in range(len(req.others) + 1, req.n)] if req.choice == 0 else []
        # A request of n choices counts once (its prompt was served once): by choice 0.
        if req.choice == 0:
            self.count(f"hits_{req.cache.hit_kind}")
            self.count("requests_completed")
        self._release(req)
        for observe in self.observers if req.choice == 0 else ():
            try:
                observe(completion)
            except Exception:  # an observer must never break a request
                log.exception("completion observer failed")
        req.events.put(completion)
        for record in unstarted:
            req.events.put(record)

    def _fail(self, req: Request, exc: Exception) -> None:
        self.count("requests_failed")
        if req.seq is not None:
            self.executor.clear(req.seq)
        self._release(req)
        req.events.put(exc)

    def _release(self, req: Request) -> None:
        req.restored_from = []
        if req.sampler is not None:  # whatever ended it: finish, failure, cancel
            req.sampler.close()
            req.sampler = None
        seq = self.scheduler.release(req)
        if seq is not None and not seq.session and not self.config.reuse_live:
            self.executor.clear(seq)
        while (nxt := self.scheduler.next_waiting()) is not None:
            self._place(*nxt)

    def shutdown(self) -> None:
        """End every request (those running as ``shutdown``, with their save), then save
        the idle sessions within the deadline."""
        deadline = time.monotonic() + self.config.shutdown_deadline_s
        sched = self.scheduler
        # Requests that have not started are failed first: a running one's end releases
        # its sequence, which would be handed to a waiting request (evicting an idle
        # session for it and starting a lookup) only for that request to fail next
        # (tests/runtime/test_runtime.py::test_close_fails_waiting_requests_without_evicting_a_session_for_them).
        for req in [*sched.waiting, *sched.resolving, *sched.running]:
            if req.seq is not None and req.phase in (Phase.PREFILL, Phase.DECODE):
                self._finish(req, "shutdown")
            else:
                self._fail(req, RequestError("unavailable", "the runtime is shutting down"))
        self.save_points.shutdown(sched.seqs, deadline)


def _history(req: Request) -> list[int]:
    """A decoding request's history: the tokens in its sequence, then its pending one."""
    assert req.seq is not None
    return [*req.seq.tokens, req.pending]
