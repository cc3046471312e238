"""When a sequence's state is saved: the five save points, and each session's last key.

====================  =====================================================================
``cold``              during prefill, at the save boundary: the request's explicit boundary
                      (the end of the system message, or a declared prefix length), else
                      the last ``save_block``-aligned position at least ``trim`` tokens
                      before the prompt's end. The scheduler stops prefill chunks there.
                      For states that cannot be cut (sliding-window, recurrent, hybrid
                      models) also every ``checkpoint_interval`` tokens of a prefill and
                      ``checkpoint_before_end`` tokens before the prompt's end (where a
                      next prompt that tokenizes this one's end otherwise still finds a
                      state); these without the scores after them.
``prompt``            states that cannot be cut: at the prompt's end, with the scores of
                      its next token (the same prompt again decodes nothing; a next turn
                      whose template re-renders the reply still finds the prompt's end).
                      Plain-attention states store the prompt's end inside their
                      ``finish`` save instead (a waypoint: :meth:`Executor.save`).
``continued``         every ``continued_interval`` generated tokens
``finish``            when a request ends: the whole sequence; its key is ``finish_key``
``evict``             an idle session's sequence taken for another request
``shutdown``          at close: requests still running, then every idle session, within
                      ``shutdown_deadline_s``
====================  =====================================================================

A session's last saved key is remembered so that its next request, on another sequence
after an eviction, resumes from it (the resolver tries it before the longest-prefix
lookup). Model thread only; the copy is :meth:`Executor.save`'s, the sending the
:class:`~model_runtime.saver.Saver`'s.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from .config import RuntimeConfig
from .executor import Executor
from .request import Request, Seq, SessionKey

# Sessions whose last saved key is remembered (the least recently saved are forgotten):
# one entry per session id ever seen would grow without bound.
MAX_SESSION_KEYS = 4096


class SavePoints:
    max_session_keys = MAX_SESSION_KEYS

    def __init__(self, config: RuntimeConfig, executor: Executor,
                 count: Callable[[str], None]) -> None:
        self.config = config
        self.executor = executor
        self._count = count
        # (tenant, session) -> (key, n_tokens), least recently saved first; written on the
        # model thread only (resolver threads just read it)
        self.session_last_key: OrderedDict[SessionKey, tuple[bytes, int]] = OrderedDict()

    def plan_cold(self, req: Request) -> None:
        """Where prefill must stop next to save a reusable prefix (``req.save_at``; 0:
        nowhere): the cold save boundary, with the scores after it (``req.save_scores``);
        and for states that cannot be cut, checkpoints for the prefill's sake, without
        them: every ``checkpoint_interval`` tokens, and ``checkpoint_before_end`` tokens
        before the prompt's end (tests/runtime/test_seam_checkpoints.py)."""
        cfg = self.config
        past = max(req.n_past, req.cache.tokens_read)
        # Explicit boundaries (the system message's end, cache_control breakpoints) replace
        # the aligned one: a caller that says where its prefixes end is taken at its word.
        scored = [at for at in (req.boundary, *(at for at, _ in req.boundaries)) if at] or \
            [(len(req.tokens) - cfg.trim) // cfg.save_block * cfg.save_block]
        unscored = []
        if not self.executor.ctx.can_truncate_restored():
            if cfg.checkpoint_interval:
                step = cfg.checkpoint_interval
                unscored.append((past // step + 1) * step)
            if cfg.checkpoint_before_end:
                # The next prompt of an agent loop is this one's text and more, tokenized
                # again: where its first new characters merge with this prompt's last
                # tokens, the state at the prompt's end is no prefix of it, this one is.
                unscored.append(len(req.tokens) - cfg.checkpoint_before_end)
            unscored = [at for at in unscored if at < len(req.tokens)]
        stops = [at for at in (*scored, *unscored) if at >= cfg.min_save_tokens and at > past]
        req.save_at = min(stops, default=0)
        req.save_scores = req.save_at in scored

    def after_prefill(self, req: Request) -> None:
        """A prefill chunk ran: the ``cold`` save when it reached the next stop, and the
        ``prompt`` checkpoint of a state that cannot be cut when it reached the end."""
        seq = req.seq
        assert seq is not None
        if req.save_at and req.n_past == req.save_at:
            # A checkpoint for the prefill's sake leaves the backlog room for the saves of
            # the prompt's end and of its finish, which serve more (a next request that
            # re-tokenizes nothing, or the same prompt again).
            self.executor.save(seq, "cold", req, leave_room=0 if req.save_scores else 2)
            self.plan_cold(req)
        elif req.n_past == len(req.tokens) and not self.executor.ctx.can_truncate_restored():
            self.executor.save(seq, "prompt", req)

    def after_token(self, req: Request, emitted: int = 1) -> None:
        """``emitted`` tokens were generated (more than one: drafted tokens verified in
        one batch): the ``continued`` save when they reached the next interval's end."""
        assert req.seq is not None
        interval = self.config.continued_interval
        n = len(req.generated)
        if interval and n // interval > (n - emitted) // interval:
            self.executor.save(req.seq, "continued", req)

    def at_end(self, req: Request, reason: str) -> bytes:
        """The request ends for ``reason``: its ``finish`` save (``shutdown`` at close;
        none when cancelled). Returns the key of the sequence's state, or b"" for none."""
        seq = req.seq
        if seq is None or reason == "cancelled":
            return b""
        key = b""
        if reason == "shutdown":
            enabled, save_reason = self.config.save_shutdown, "shutdown"
        else:
            enabled, save_reason = self.config.save_finish, "finish"
        if enabled:
            key = self.executor.save(seq, save_reason, req)
        if req.first is None:  # the choices of a request share its prompt: pinned once
            self._pin_boundaries(req)
        if req.session_key is not None and key:
            self._remember(req.session_key, key, len(seq.tokens))
        return key

    def _pin_boundaries(self, req: Request) -> None:
        """Pin the entries at the request's boundaries that carry a ttl (cache_control's),
        whether this request saved them or restored them: each request naming one extends
        its pin. Queued behind the request's saves, so a boundary saved just now is
        published before its pin."""
        for at, ttl in req.boundaries:
            if ttl and at >= self.config.min_save_tokens:
                self.executor.pin(req.tokens[:at], req.tenant, ttl)

    def evict(self, seq: Seq) -> None:
        """An idle session's sequence is taken: its ``evict`` save, which the session's
        next request resumes from."""
        if self.config.save_evict and seq.session is not None:
            key = self.executor.save(seq, "evict", None)
            if key:
                self._remember(seq.session, key, len(seq.tokens))

    def shutdown(self, seqs: Iterable[Seq], deadline: float) -> None:
        """The ``shutdown`` save of every idle session's sequence until ``deadline``
        (time.monotonic). A free sequence's state was saved as ``finish`` when its request
        ended, unless finish saves are off or that save was dropped."""
        if not self.config.save_shutdown:
            return
        for seq in (s for s in seqs if s.session):
            if time.monotonic() > deadline:
                self._count("shutdown_saves_skipped")
                continue
            self.executor.save(seq, "shutdown", None)

    def _remember(self, session: SessionKey, key: bytes, n_tokens: int) -> None:
        last = self.session_last_key
        last[session] = (key, n_tokens)
        last.move_to_end(session)
        while len(last) > self.max_session_keys:
            last.popitem(last=False)
