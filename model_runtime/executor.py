"""The model thread's hands on llama.cpp: everything the engine does to the context.

A thin layer over :class:`~model_runtime.llama_backend.LlamaContext` that keeps each
``Seq.tokens`` equal to what its KV cells hold: restore a saved chain (join its pieces,
set the state, cut it where it leaves the prompt), reuse a live sequence in place,
truncate or clear a sequence, run a batch plan, sample from a row of logits, and copy
a sequence's state out for a save (the one place ``state_seq_get`` is called; the
bytes go to the background :class:`~model_runtime.saver.Saver`). Drafted tokens a batch
put in a sequence's cells are ``Seq.unverified`` until the engine verifies them: each
either joins ``Seq.tokens`` (:meth:`Executor.accept_draft`) or is taken out
(:meth:`Executor.settle`) before anything can read the sequence. Model thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvcache.client import CacheClient, LoadedBlob
from kvcache.common import HIT_EXACT, HIT_PARTIAL, TIER_LIVE

from .config import RuntimeConfig
from .identity import Identities
from .llama_backend import LlamaContext, LlamaError
from .request import Request, Seq, common_prefix, servable
from .sampler import RequestSampler
from .sampling import TokenLogprob, token_logprob
from .saver import SaveJob, Saver, Waypoint
from .scheduler import BatchPlan
from .state import build as kv_build
from .state import pieces
from .state.layout import StateFormatError

log = logging.getLogger("model_runtime")


class Executor:
    def __init__(self, ctx: LlamaContext, identities: Identities, cache: CacheClient | None,
                 saver: Saver, config: RuntimeConfig, *, count: Callable[[str], None],
                 key_of: Callable[[Sequence[int], str], bytes],
                 on_latency: Callable[[str, float], None]) -> None:
        self.ctx = ctx
        self.identities = identities  # each tenant's identity
        self.cache = cache
        self.saver = saver
        self.config = config
        self.count = count
        # The key of a state of a tenant (b"" while the block size is unknown).
        self.key_of = key_of
        self.on_latency = on_latency
        # Restores build llama.cpp's bytes here: kept across restores so its pages are
        # faulted in once, not on every restore.
        self._join_scratch = kv_build.Scratch()

    # -- reuse: a saved state, or a live sequence -----------------------------------------

    def restore(self, req: Request, seq: Seq, chain: list[LoadedBlob]) -> bool:
        """Restore a saved state into the request's sequence. False when llama.cpp
        refuses it: the sequence is left empty (the request goes cold)."""
        t0 = time.perf_counter()
        entry = chain[-1]
        # Tokens the state shares with the prompt are kept, and whatever follows is cut:
        # pieces are joined up to there, a state set as stored is cut after its restore.
        # The whole prompt is kept only where a piece ending with it carries the scores
        # of its next token; otherwise its last token is decoded again, for them.
        shared = common_prefix(entry.meta.tokens, req.tokens)
        scores = pieces.stored_logits(chain, self.ctx.model.n_vocab)
        keep = servable(shared, len(req.tokens), len(req.tokens) in scores)
        try:
            joined = pieces.join(chain, keep, seq.id, self._join_scratch,
                                 n_stream=self.ctx.state_streams)
            ok = self.ctx.state_seq_set(seq.id, joined.state) > 0
        except StateFormatError as exc:
            log.warning("state of %s not restorable: %s", entry.key.hex(), exc)
            ok = False
        if ok:
            seq.tokens = list(joined.tokens)
            seq.restored = True
            seq.logits = {n: row for n, row in scores.items() if n <= len(seq.tokens)}
            seq.decoded_at = -1
            # The state of an entry of these tokens: its key is computed when needed (a
            # live sequence's previous key no longer names it).
            seq.saved_len, seq.saved_key = len(seq.tokens), b""
            if keep < len(seq.tokens) and not self.truncate(seq, keep):
                ok = False
        if ok:
            req.restored_from = chain
            self._served(req, shared, entry.tier, len(seq.tokens))
            self.count(f"restores_{req.cache.hit_kind}")
        else:
            self.clear(seq)
            self.count("restore_failed")
        req.timings.restore = time.perf_counter() - t0
        return ok

    def reuse_live(self, req: Request, seq: Seq) -> None:
        """Serve the prompt's first ``live_keep`` tokens from the sequence's own KV."""
        t0 = time.perf_counter()
        keep = req.live_keep
        shared = min(common_prefix(seq.tokens, req.tokens), len(req.tokens))
        if self.truncate(seq, keep):
            self._served(req, shared, TIER_LIVE, keep)
            self.count("live_reuses")
        else:
            self.clear(seq)
        req.timings.restore = time.perf_counter() - t0

    @staticmethod
    def _served(req: Request, shared: int, tier: str, n_past: int) -> None:
        # Exact when the state held the whole prompt. Tokens read: those not computed
        # again (all of an exact hit's with the scores of its end, else all but one).
        req.cache.hit_kind = HIT_EXACT if shared >= len(req.tokens) else HIT_PARTIAL
        req.cache.tokens_read = n_past
        req.cache.tier = tier
        req.n_past = n_past

    # -- sequences ------------------------------------------------------------------------

    def truncate(self, seq: Seq, n_keep: int) -> bool:
        """Keep the sequence's first ``n_keep`` tokens; False if llama.cpp refuses."""
        if (n_keep < len(seq.tokens) or seq.unverified) and \
                not self.ctx.seq_truncate(seq.id, n_keep):
            return False
        seq.unverified = 0
        del seq.tokens[n_keep:]
        seq.forget_logits_after(n_keep)
        if n_keep < seq.saved_len:
            # The last save no longer matches this sequence. Left as it was, a later state
            # of the same length but other tokens would be taken as saved: its save skipped
            # and its key reported as finish_key although no such entry exists
            # (tests/runtime/test_runtime.py::test_sticky_truncation_then_finish_key_names_a_real_entry).
            seq.saved_len, seq.saved_key = 0, b""
        return True

    def clear(self, seq: Seq) -> None:
        self.ctx.seq_clear(seq.id)
        seq.tokens.clear()
        seq.unverified = 0
        seq.saved_len, seq.saved_key = 0, b""
        seq.restored = False
        seq.forget_logits_after(0)

    # -- a tick ---------------------------------------------------------------------------

    def run(self, plan: BatchPlan) -> None:
        """One ``llama_decode`` of the plan; raises LlamaDecodeError or ValueError."""
        self.ctx.decode(plan.tokens, plan.positions, plan.seq_ids, plan.logits)
        for row in plan.rows:
            if row.drafts:
                assert row.request.seq is not None
                row.request.seq.unverified = len(row.drafts)

    def accept_draft(self, seq: Seq, token: int) -> None:
        """The next drafted token in the sequence's cells was verified (it is ``token``):
        it joins the sequence's tokens."""
        if seq.unverified <= 0:
            raise LlamaError(f"sequence {seq.id} has no drafted token to accept")
        seq.tokens.append(token)
        seq.unverified -= 1

    def settle(self, seq: Seq) -> None:
        """Take the drafted tokens not verified out of the sequence's cells: it holds its
        tokens and nothing else (a save, a live reuse, the next batch see only those)."""
        if seq.unverified and not self.truncate(seq, len(seq.tokens)):
            # (Only sequences that can be cut draft: see EngineCore._drafts.)
            raise LlamaError(f"llama.cpp refused to remove the drafted tokens of sequence "
                             f"{seq.id}")

    def keep_logits(self, req: Request, batch_index: int, *, decoded: bool = False) -> None:
        """Keep the scores the last batch computed at ``batch_index`` (the request's
        sequence's last cell) with that sequence."""
        assert req.seq is not None
        req.seq.note_logits(self.ctx.logits(batch_index), decoded=decoded)

    def logprob(self, req: Request, token: int) -> TokenLogprob:
        """``token``'s log probability where it was just sampled (before it is decoded)."""
        seq = req.seq
        assert seq is not None
        return token_logprob(seq.logits[len(seq.tokens)], token, req.sampling.top_logprobs)

    def copy(self, src: Seq, dst: Seq) -> None:
        """Make the empty ``dst`` hold what ``src`` holds (a prompt copied to another
        choice's sequence): its KV (llama_memory_seq_cp; across KV streams llama.cpp
        makes the copy at the next decode, see LlamaContext.seq_copy), its tokens, the
        scores kept after them, and what is known of its last save."""
        assert not dst.tokens
        self.ctx.seq_copy(src.id, dst.id)
        dst.tokens = list(src.tokens)
        dst.logits = dict(src.logits)  # (rows are never written to: shared)
        dst.decoded_at = src.decoded_at
        dst.restored = src.restored
        dst.tenant = src.tenant
        dst.saved_len, dst.saved_key = src.saved_len, src.saved_key

    def copy_pending(self, seq: Seq) -> bool:
        """Whether the sequence is part of a copy the next decode makes (its state can be
        neither read nor set before)."""
        return self.ctx.copy_pending(seq.id)

    def new_sampler(self, req: Request) -> None:
        """Make the request's sampler chain (it has its sequence now)."""
        req.sampler = RequestSampler(self.ctx.model, req.sampling, prompt=req.tokens,
                                     choice=req.choice, n_ctx=self.ctx.n_ctx)

    def sample(self, req: Request) -> int:
        """The request's next token, from the scores after its sequence's cells, taken by
        its chain (which records it). Raises GrammarDeadEnd."""
        seq = req.seq
        assert seq is not None and req.sampler is not None
        return req.sampler.take(seq.logits[len(seq.tokens)])

    # -- saves ----------------------------------------------------------------------------

    def save(self, seq: Seq, reason: str, req: Request | None, *, leave_room: int = 0
             ) -> bytes:
        """Copy a sequence's state out (model thread) and queue it for the daemon; with
        ``leave_room``, only where the backlog keeps that many places free after it (else
        dropped and counted, before any copy). Returns the key of the sequence's saved
        state (also when it was saved before, or restored as it is), or b"" for none.
        Drafted tokens not verified are taken out first: a state never holds them."""
        self.settle(seq)
        n = len(seq.tokens)
        if n < self.config.min_save_tokens or self.cache is None:
            return b""
        if n == seq.saved_len:
            return seq.saved_key or self.key_of(seq.tokens, seq.tenant)
        if leave_room and self.saver.room() <= leave_room:
            self.count("saves_dropped")
            self.count("saves_dropped_backlog")
            return b""
        if self.copy_pending(seq):
            # A prompt just copied to other choices' sequences, before the decode that
            # makes the copy: its state cannot be read yet. Only a state of the prompt
            # itself is asked for then (a choice ending at its first token); the prompt's
            # entry goes with the first save past it of any of the request's choices.
            self.count("saves_skipped_copy_pending")
            return b""
        key = self.key_of(seq.tokens, seq.tenant)
        if not key:
            self.count("saves_dropped")
            self.count("saves_dropped_unavailable")
            return b""
        t0 = time.perf_counter()
        buffer = self.saver.buffers.take(self.ctx.state_seq_size(seq.id))
        state = self.ctx.state_seq_get(seq.id, out=buffer)
        self.on_latency("state_get", time.perf_counter() - t0)
        # Cells are stored as pieces, a state with a tail too (its cells built on a stored
        # prefix, its tail whole); only a plain state has shorter entries on the way,
        # whose cells it holds (a tail is the state at the end only).
        plain = self.ctx.can_truncate_restored()
        # The tenant whose requests made this KV: saved under its namespace only.
        job = SaveJob(self.identities.of(seq.tenant), self.identities.namespace(seq.tenant),
                      tuple(seq.tokens), state, reason, key,
                      as_cells=plain or self.ctx.state_has_tail,
                      tail=self.ctx.state_has_tail, window=self.ctx.state_window,
                      buffer=buffer,
                      logits=_scores_bytes(seq, n),
                      waypoints=self._prompt_waypoint(seq, req) if plain else ())
        if not self.saver.submit(job):  # dropped (counted): no entry to name or skip
            return b""
        seq.saved_len, seq.saved_key = n, key
        if req is not None:
            req.cache.tokens_saved = max(req.cache.tokens_saved, n - req.cache.tokens_read)
            for point in job.waypoints:
                req.cache.saves.append({"reason": point.reason, "tokens": point.n_tokens,
                                        "key": self.key_of(seq.tokens[:point.n_tokens],
                                                           seq.tenant).hex()})
            req.cache.saves.append({"reason": reason, "tokens": n, "key": key.hex()})
        return key

    def pin(self, tokens: Sequence[int], tenant: str, ttl_seconds: int) -> None:
        """Queue an expiring pin of the tenant's entry of ``tokens`` (behind the saves
        queued so far, so one saved just now is published first)."""
        if self.cache is None:
            return
        key = self.key_of(tokens, tenant)
        if key:
            self.saver.pin(key, ttl_seconds, tenant)

    @staticmethod
    def _prompt_waypoint(seq: Seq, req: Request | None) -> tuple[Waypoint, ...]:
        """The request's prompt as an entry of its own on the way to a longer state (its
        ``finish``), with the scores its first token was sampled from: the same prompt
        again restores it and decodes nothing before its first token."""
        if req is None:
            return ()
        owner = req.first or req  # the choices of a request share its prompt: saved once
        if owner.cache.prompt_saved:
            return ()
        n = len(req.tokens)
        scores = _scores_bytes(seq, n)
        if not scores or n >= len(seq.tokens) or seq.tokens[:n] != req.tokens:
            return ()
        owner.cache.prompt_saved = True  # with the first save past it (continued or finish)
        return (Waypoint(n, "prompt", scores),)


def _scores_bytes(seq: Seq, n: int) -> bytes:
    """The kept scores after the sequence's first ``n`` cells, as stored ("" if none)."""
    row = seq.logits.get(n)
    return b"" if row is None else row.astype("<f4", copy=False).tobytes()
