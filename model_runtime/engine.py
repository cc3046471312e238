"""The scheduler: one model thread owns the llama.cpp context and its sequences.

A request's life:

1. admission (model thread): a free sequence, or its session's pinned one (busy ->
   ``sticky_busy``); with none free, the least recently used idle session is saved
   (``evict``) and released; otherwise the request waits for a sequence.
2. cache resolution (a resolver thread, so cache I/O never stalls decoding):
   ``parent_key``, then the session's in-flight save, then the longest-common-prefix
   lookup. The session's own live sequence skips this (``sticky``); another idle
   sequence's live KV serves when it covers at least as much as the daemon (``live``).
3. restore (set state, cut it after the tokens it shares with the prompt and before the
   prompt's last token, which is decoded again: a restored sequence has no logits), or
   a live sequence cut in place, or cold prefill; prefill runs in chunks, split at the
   ``cold`` save boundary.
4. decode: every active sequence advances in one batched ``llama_decode`` per tick.
5. completion: ``finish`` save, record with hit kind, cache delta and timings.

Only ``state_seq_get`` runs on the model thread for a save; the bytes go to the
background :class:`~model_runtime.saver.Saver`.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvcache import keys
from kvcache.client import (
    CacheClient,
    CacheError,
    CacheUnavailable,
    CorruptBlob,
    Identity,
    LoadedBlob,
)

from . import kv_cells, pieces
from .config import RuntimeConfig
from .counters import COUNTERS
from .kv_cells import StateFormatError
from .llama_backend import LlamaContext, LlamaDecodeError, LlamaModel
from .sampling import SamplingParams, find_stop, sample
from .saver import SaveJob, Saver

log = logging.getLogger("model_runtime")

HIT_EXACT, HIT_PARTIAL, HIT_COLD, HIT_STICKY = "exact", "partial", "cold", "sticky"
# cache_tier of a request served by an idle sequence's KV in place (no restore).
TIER_LIVE = "live"
TIER_REMOTE = "remote"  # the daemon fetched the entry from its shared tier for this hit
# Sessions whose last saved key is remembered (the least recently saved are forgotten):
# one entry per session id ever seen would grow without bound.
MAX_SESSION_KEYS = 4096


class RuntimeError_(Exception):
    """A request the runtime refuses, with a machine-readable ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
            "finish_key": self.finish_key, "cache_hit_kind": self.cache_hit_kind,
            "cache_delta": self.cache_delta, "timings": self.timings,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
            "session_id": self.session_id, "cache_tier": self.cache_tier, "saves": self.saves,
        }


@dataclass
class TokenEvent:
    token: int  # the sampled token, or -1: text flushed when the request ends (see _finish)
    text: str


@dataclass(eq=False)
class Request:
    id: int
    tokens: list[int]
    sampling: SamplingParams
    session_id: str = ""
    parent_key: bytes = b""
    boundary: int = 0  # explicit cold save boundary (end of the system message)
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    # Filled in along the way
    seq: Seq | None = None
    phase: str = "admit"  # admit | resolve | prefill | decode | done
    hit_kind: str = HIT_COLD
    tokens_read: int = 0
    tokens_saved: int = 0
    tier: str = ""
    n_past: int = 0  # prompt tokens in the sequence so far
    save_at: int = 0  # cold save boundary still to take (0: none)
    generated: list[int] = field(default_factory=list)
    pending: int = -1  # sampled, not yet decoded
    # Generated text, decoded incrementally: an incomplete UTF-8 sequence waits in the
    # decoder for its next bytes, invalid bytes become U+FFFD as in the final text.
    text: str = ""
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    emitted_chars: int = 0
    rng: np.random.Generator | None = None
    t_restore: float = 0.0
    t_prefill: float = 0.0
    t_decode: float = 0.0
    t_first: float = 0.0
    saves: list[dict[str, Any]] = field(default_factory=list)
    cancelled: bool = False
    # Prompt tokens an idle sequence's live KV can serve in place (0: none). Resolution
    # restores from the daemon only when that covers more; a live sequence wins a tie.
    live_keep: int = 0


@dataclass
class Seq:
    id: int
    tokens: list[int] = field(default_factory=list)  # exactly what the KV cells hold
    session: str = ""
    request: Request | None = None
    last_used: float = 0.0
    saved_len: int = 0  # length of the last state saved from this sequence
    saved_key: bytes = b""  # its key, when this process computed it
    restored: bool = False  # holds a restored state (matters for SWA/recurrent models)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    max_session_keys = MAX_SESSION_KEYS

    def __init__(self, model: LlamaModel, ctx: LlamaContext, identity: Identity,
                 cache: CacheClient | None, config: RuntimeConfig) -> None:
        self.model = model
        self.ctx = ctx
        self.identity = identity
        self._namespace = identity.namespace  # computed once: key_of runs on every save
        self.cache = cache
        self.config = config
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.saver = Saver(cache, self.counters, self._lock, config.max_pending_saves,
                           min_shared_tokens=config.min_save_tokens,
                           in_flight_wait_ms=config.in_flight_wait_ms)
        self.seqs = [Seq(i) for i in range(ctx.n_seq_max)]
        self.sessions: dict[str, Seq] = {}
        # session -> (key, n_tokens), least recently saved first; written on the model
        # thread only (resolver threads just read it)
        self.session_last_key: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # Restores build llama.cpp's bytes here (model thread only): kept across restores
        # so its pages are faulted in once, not on every restore.
        self._join_scratch = kv_cells.Scratch()
        self._waiting: list[Request] = []  # admitted requests wait here for a sequence
        self._active: list[Request] = []
        self._resolving: set[Request] = set()  # waiting for cache I/O on a resolver thread
        self._ids = itertools.count(1)
        self._block_size: int | None = None
        self.observers: list[Callable[[Completion], None]] = []  # e.g. metrics
        self.on_latency: Callable[[str, float], None] = lambda name, seconds: None
        self._resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-resolve")
        self._stopping = threading.Event()
        self._submit_lock = threading.Lock()  # orders submits against close()
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()

    # -- public (any thread) ----------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def submit(self, tokens: list[int], sampling: SamplingParams, *, session_id: str = "",
               parent_key: bytes = b"", boundary: int = 0) -> Request:
        if not tokens:
            raise RuntimeError_("invalid_argument", "empty prompt")
        if len(tokens) + 1 > self.ctx.n_ctx:
            raise RuntimeError_("prompt_too_long",
                                f"prompt of {len(tokens)} tokens does not fit the context of "
                                f"{self.ctx.n_ctx} tokens per sequence")
        req = Request(next(self._ids), list(tokens), sampling, session_id, parent_key,
                      boundary if 0 < boundary < len(tokens) else 0)
        req.rng = np.random.default_rng(sampling.seed)
        # Checked and queued under the lock close() takes to set _stopping: a request is
        # either refused here or queued before the shutdown message (which answers it).
        # Queued after it, nothing would ever answer it and its caller would hang.
        with self._submit_lock:
            if self._stopping.is_set():
                raise RuntimeError_("unavailable", "the runtime is shutting down")
            self._inbox.put(("new", req))
        return req

    def cancel(self, req: Request) -> None:
        self._inbox.put(("cancel", req))

    def close(self) -> None:
        """Finish: stop admitting, save every live sequence (``shutdown``), flush saves."""
        with self._submit_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()  # submit() refuses from here on
        done = threading.Event()
        self._inbox.put(("shutdown", done))
        done.wait(self.config.shutdown_deadline_s + 5)
        self._thread.join(timeout=5)
        self._resolver.shutdown(wait=False, cancel_futures=True)
        self.saver.close(timeout=self.config.shutdown_deadline_s)

    def stats(self) -> dict[str, int]:
        """Every declared counter (zeros included) and any other counted."""
        with self._lock:
            return {**dict.fromkeys(COUNTERS, 0), **self.counters}

    def gauges(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        busy = sum(s.request is not None for s in self.seqs)
        return {
            ("sequences", (("state", "busy"),)): busy,
            ("sequences", (("state", "idle_session"),)): sum(
                s.request is None and bool(s.session) for s in self.seqs),
            ("sequences", (("state", "free"),)): sum(
                s.request is None and not s.session for s in self.seqs),
            ("requests_waiting", ()): len(self._waiting),
            ("save_queue", ()): self.saver.pending(),
        }

    # -- keys -------------------------------------------------------------------------------

    def block_size(self) -> int | None:
        """The daemon's block size (keys depend on it); None while it is unknown.

        On the model thread this never waits for the daemon: an unknown block size is
        fetched in the background and the caller goes without a key this time."""
        if self._block_size is None and self.cache is not None:
            if threading.current_thread() is self._thread:
                self._fetch_block_size_later()
            else:
                self._fetch_block_size()
        return self._block_size

    def _fetch_block_size(self) -> None:
        if self._block_size is None and self.cache is not None:
            with contextlib.suppress(CacheError):
                self._block_size = int(self.cache.stats().block_size) or None

    def _fetch_block_size_later(self) -> None:
        with contextlib.suppress(RuntimeError):  # the resolver pool is shutting down
            self._resolver.submit(self._fetch_block_size)

    def key_of(self, tokens: Sequence[int]) -> bytes:
        bs = self.block_size()
        if bs is None:
            return b""
        return keys.entry_key(self._namespace, tokens, bs).key

    # -- model thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                # Block only when there is no work; otherwise just pick up what arrived.
                kind, item = self._inbox.get_nowait() if self._active else self._inbox.get()
            except queue.Empty:
                kind = ""
            if kind:
                if kind == "shutdown":
                    self._shutdown(item)
                    return
                self._guarded(self._handle, kind, item)
                # drain everything that arrived before running a tick
                with contextlib.suppress(queue.Empty):
                    while True:
                        kind, item = self._inbox.get_nowait()
                        if kind == "shutdown":
                            self._shutdown(item)
                            return
                        self._guarded(self._handle, kind, item)
            if self._active:
                self._guarded(self._tick)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """A bug in one step must not kill the model thread and strand every caller:
        fail the requests in flight and keep serving."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("model thread step failed")
            self.count("internal_errors")
            for req in list(self._active):
                self._fail(req, RuntimeError_("internal", f"internal error: {exc!r}"))

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "new":
            self._admit(item)
        elif kind == "resolved":
            req, chain = item
            self._resolving.discard(req)
            self._start(req, chain)
        elif kind == "cancel":
            item.cancelled = True
            if item in self._active or item in self._waiting:
                # End it now rather than at the next tick: a request queued right behind
                # the cancel (the same session's next turn) must find the session free,
                # not fail with sticky_busy.
                self._finish(item, "cancelled")
        elif kind == "call":  # run a function on the model thread (tests, tools)
            fn, result = item
            try:
                result.put((True, fn()))
            except Exception as exc:  # handed back to the caller
                result.put((False, exc))

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the model thread (the only thread that may touch the context)."""
        result: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._inbox.put(("call", (fn, result)))
        ok, value = result.get(timeout=timeout)
        if not ok:
            raise value
        return value

    # admission -----------------------------------------------------------------------------

    def _admit(self, req: Request) -> None:
        if req.session_id and req.session_id in self.sessions:
            seq = self.sessions[req.session_id]
            if seq.request is not None:
                self._fail(req, RuntimeError_("sticky_busy",
                                              f"session {req.session_id!r} has a request running"))
                return
            self._bind(req, seq)
            return
        if req.session_id and any(r.session_id == req.session_id for r in self._waiting):
            self._fail(req, RuntimeError_("sticky_busy",
                                          f"session {req.session_id!r} has a request waiting"))
            return
        seq = self._free_seq(req)
        if seq is None:
            self._waiting.append(req)
            self.count("admission_waits")
            return
        self._bind(req, seq)

    def _free_seq(self, req: Request) -> Seq | None:
        free = [s for s in self.seqs if s.request is None and not s.session]
        if free:
            # The one whose live KV serves the most of the prompt; else the least recently
            # used, so the most recent finished states stay reusable longest.
            return max(free, key=lambda s: (self._reusable_prefix(s, req.tokens),
                                            -s.last_used))
        idle = [s for s in self.seqs if s.request is None and s.session]
        if not idle:
            return None
        victim = min(idle, key=lambda s: s.last_used)
        if self.config.save_evict:
            key = self._save(victim, "evict", None)
            if key:  # the session's next request resumes from it
                self._remember_session_key(victim.session, key, len(victim.tokens))
        self.count("sessions_evicted")
        del self.sessions[victim.session]
        victim.session = ""
        self._clear(victim)
        return victim

    def _remember_session_key(self, session: str, key: bytes, n_tokens: int) -> None:
        last = self.session_last_key
        last[session] = (key, n_tokens)
        last.move_to_end(session)
        while len(last) > self.max_session_keys:
            last.popitem(last=False)

    def _bind(self, req: Request, seq: Seq) -> None:
        own_session = bool(req.session_id) and seq.session == req.session_id
        req.seq = seq
        seq.request = req
        seq.last_used = time.monotonic()
        if req.session_id:
            seq.session = req.session_id
            self.sessions[req.session_id] = seq
        keep = self._reusable_prefix(seq, req.tokens)
        if own_session and keep:
            # Sticky: the session's live sequence already holds a prefix of this prompt.
            if self._truncate(seq, keep):
                req.hit_kind = HIT_STICKY
                req.tokens_read = keep
                req.n_past = keep
                self._plan_cold_save(req)
                req.phase = "prefill"
                self._active.append(req)
                return
            keep = 0
        if own_session or not keep:
            self._clear(seq)
        else:
            # An idle sequence's KV is kept until resolution knows whether the daemon
            # covers more of the prompt (see _start).
            req.live_keep = keep
            if keep == len(req.tokens) - 1 or self.cache is None:
                self._start(req, None)  # nothing can cover more
                return
        req.phase = "resolve"
        self._resolving.add(req)
        self._resolver.submit(self._resolve, req)

    def _reusable_prefix(self, seq: Seq, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the sequence's live KV can serve in place: the common
        prefix, less the last prompt token (decoded again for fresh logits), and 0 where
        cutting the sequence is not safe (a restored SWA/recurrent state)."""
        keep = min(common_prefix(seq.tokens, tokens), len(tokens) - 1)
        if keep <= 0 or (keep < len(seq.tokens) and not self._can_truncate(seq)):
            return 0
        return keep

    def _can_truncate(self, seq: Seq) -> bool:
        """Whether the sequence may be cut: a plain-attention one always; a live
        sliding-window one too (llama.cpp keeps its full-size SWA cache by default); a
        restored SWA state or a recurrent/hybrid state never (llama.cpp would empty it,
        or refuses a partial removal)."""
        return self.ctx.can_truncate_restored() or not (seq.restored or
                                                        self.model.is_recurrent)

    def _truncate(self, seq: Seq, n_keep: int) -> bool:
        if n_keep < len(seq.tokens) and not self.ctx.seq_truncate(seq.id, n_keep):
            return False
        del seq.tokens[n_keep:]
        if n_keep < seq.saved_len:
            # The last save no longer matches this sequence. Left as it was, a later state
            # of the same length but other tokens would be taken as saved: its save skipped
            # and its key reported as finish_key although no such entry exists.
            seq.saved_len, seq.saved_key = 0, b""
        return True

    def _clear(self, seq: Seq) -> None:
        self.ctx.seq_clear(seq.id)
        seq.tokens.clear()
        seq.saved_len, seq.saved_key = 0, b""
        seq.restored = False

    # resolution (resolver thread: cache I/O only, never the context) --------------------------

    def _resolve(self, req: Request) -> None:
        chain = None
        try:
            chain = self._find_state(req)
        except Exception:  # a cache problem must never fail the request
            log.exception("cache resolution failed; going cold")
            self.count("cache_errors")
        self._inbox.put(("resolved", (req, chain)))

    def _find_state(self, req: Request) -> list[LoadedBlob] | None:
        """The blobs of the best saved state for the request, root first (one blob for
        a whole state, a chain of pieces otherwise), or None: cold, or a live sequence
        serves as much."""
        if self.cache is None:
            return None
        self._fetch_block_size()  # off the model thread: later saves need it for keys
        tokens = req.tokens
        # A restored state needs its last cell dropped to get fresh logits; where that
        # is impossible (SWA/recurrent), only strictly shorter states are usable.
        limit = len(tokens) if self.ctx.can_truncate_restored() else len(tokens) - 1
        timeout = self.config.cache_timeout_s
        wait_ms = self.config.session_resume_wait_ms
        candidates: list[tuple[str, bytes]] = []
        if req.parent_key:
            candidates.append(("parent", req.parent_key))
        last = self.session_last_key.get(req.session_id) if req.session_id else None
        # (Not worth loading when a live sequence already serves as much: see _start.)
        if last and last[1] <= limit and min(last[1], len(tokens) - 1) > req.live_keep:
            candidates.append(("session", last[0]))
        for source, key in candidates:
            event = self.saver.in_flight(key)
            if event is not None:  # still being sent from this process
                event.wait(wait_ms / 1000)
            try:
                chain = self.cache.load_chain(key, prefix_of=tokens, wait_ms=wait_ms,
                                              timeout=timeout + wait_ms / 1000)
            except CacheUnavailable:
                self.count("cache_unavailable")
                return None
            except CacheError as exc:
                if isinstance(exc, CorruptBlob):  # quarantined: counted like a lookup hit's
                    self.count("corrupt_blobs")
                self.count(f"{source}_key_unusable")
                log.info("%s key %s unusable: %s", source, key.hex(), exc)
                continue
            if len(chain[-1].meta.tokens) <= limit:
                self.count(f"resolved_by_{source}")
                return chain
            # The whole prompt, where a restored state cannot be cut (SWA/recurrent).
            self.count(f"{source}_key_unusable")
        # A plain-attention state can be cut anywhere: any entry sharing leading tokens
        # with the prompt serves them (longer or diverging ones are cut after restore).
        common = self.ctx.can_truncate_restored()
        for _attempt in range(2):  # a corrupt hit is quarantined: look again, once
            try:
                hit = self.cache.lookup(self.identity, tokens, max_tokens=limit,
                                        common_prefix=common, timeout=timeout)
                if hit is None or min(hit.matched_tokens, len(tokens) - 1) <= req.live_keep:
                    return None  # a live sequence serves as much without a restore
                if hit.entry_tokens > hit.matched_tokens < self.config.min_save_tokens:
                    return None  # restoring a whole state for a few tokens costs more
                chain = self.cache.load_chain(hit.key, prefix_of=tokens,
                                              shares=hit.matched_tokens,
                                              pieces=hit.pieces_for(hit.matched_tokens),
                                              timeout=timeout * 4)
                if hit.tier == TIER_REMOTE:  # fetched into the daemon's tiers for this hit
                    chain[-1] = replace(chain[-1], tier=TIER_REMOTE)
                self.count(f"restored_from_{chain[-1].tier or 'cache'}")
                return chain
            except CacheUnavailable:
                self.count("cache_unavailable")
                return None
            except CorruptBlob:
                self.count("corrupt_blobs")
            except CacheError as exc:
                self.count("cache_errors")
                log.warning("cache lookup failed: %s", exc)
                return None
        return None

    # restore / prefill (model thread) ---------------------------------------------------------

    def _start(self, req: Request, chain: list[LoadedBlob] | None) -> None:
        seq = req.seq
        assert seq is not None
        if req.cancelled:
            self._finish(req, "cancelled")
            return
        if chain and min(common_prefix(chain[-1].meta.tokens, req.tokens),
                         len(req.tokens) - 1) <= req.live_keep:
            chain = None  # the live sequence covers as much: a tie goes to it (no restore)
        if chain:
            self._restore(req, seq, chain)
        elif req.live_keep:
            self._reuse_live(req, seq)
        if req.hit_kind == HIT_COLD:
            self.count("cold_prefills")
        self._plan_cold_save(req)
        req.phase = "prefill"
        self._active.append(req)

    def _restore(self, req: Request, seq: Seq, chain: list[LoadedBlob]) -> None:
        t0 = time.perf_counter()
        entry = chain[-1]
        # Tokens the state shares with the prompt; all but the prompt's last are kept
        # (that one is decoded again for fresh logits), and whatever follows is cut:
        # pieces are joined up to there, a whole state is cut after its restore.
        shared = common_prefix(entry.meta.tokens, req.tokens)
        keep = min(shared, len(req.tokens) - 1)
        try:
            joined = pieces.join(chain, keep, seq.id, self._join_scratch,
                                 n_stream=self.ctx.state_streams)
            ok = self.ctx.state_seq_set(seq.id, joined.state) > 0
        except StateFormatError as exc:
            log.warning("state of %s not restorable: %s", entry.key.hex(), exc)
            ok = False
        if ok:
            seq.tokens = list(entry.meta.tokens[: joined.n_tokens])
            seq.restored = True
            # The state of an entry of these tokens: its key is computed when needed (a
            # live sequence's previous key no longer names it).
            seq.saved_len, seq.saved_key = len(seq.tokens), b""
            if keep < len(seq.tokens) and not self._truncate(seq, keep):
                ok = False
        if ok:
            req.hit_kind = HIT_EXACT if shared == len(req.tokens) else HIT_PARTIAL
            req.tokens_read = shared
            req.tier = entry.tier
            req.n_past = len(seq.tokens)
            self.count(f"restores_{req.hit_kind}")
        else:
            self._clear(seq)
            self.count("restore_failed")
            # llama.cpp refused it: keeping it would make every later request retry
            # it, and its key would stop a good state from ever being saved.
            self._forget_later(entry)
        req.t_restore = time.perf_counter() - t0

    def _reuse_live(self, req: Request, seq: Seq) -> None:
        """Serve the prompt's first ``live_keep`` tokens from the sequence's own KV."""
        t0 = time.perf_counter()
        keep = req.live_keep
        shared = min(common_prefix(seq.tokens, req.tokens), len(req.tokens))
        if self._truncate(seq, keep):
            # As for a restore: exact when it held the whole prompt.
            req.hit_kind = HIT_EXACT if shared == len(req.tokens) else HIT_PARTIAL
            req.tokens_read = shared
            req.tier = TIER_LIVE
            req.n_past = keep
            self.count("live_reuses")
        else:
            self._clear(seq)
        req.t_restore = time.perf_counter() - t0

    def _forget_later(self, blob: LoadedBlob) -> None:
        cache, tokens = self.cache, list(blob.meta.tokens)
        if cache is None:
            return

        def forget() -> None:
            key = self.key_of(tokens)
            # The daemon refuses to delete an entry while it is read (by another runtime,
            # or by its own copy into the RAM tier): that passes in moments, so retry.
            # Given up at once, the rejected state stayed and every later request with
            # that prefix tried to restore it again. A pinned entry stays, as it should.
            for delay in (0.05, 0.2, 0.5, 1.0, 0.0):
                try:
                    if key:
                        cache.delete(key)
                        self.count("rejected_states_deleted")
                    return
                except CacheError as exc:
                    if not delay or exc.code is None or exc.code.name != "FAILED_PRECONDITION":
                        return
                time.sleep(delay)

        with contextlib.suppress(RuntimeError):
            self._resolver.submit(forget)

    def _plan_cold_save(self, req: Request) -> None:
        """Where prefill must stop to save a reusable prefix (0: nowhere)."""
        cfg = self.config
        at = req.boundary or (len(req.tokens) - cfg.trim) // cfg.save_block * cfg.save_block
        if at >= cfg.min_save_tokens and at > req.n_past and at > req.tokens_read:
            req.save_at = at

    # one tick: a batch over every active sequence -----------------------------------------------

    def _tick(self) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        logits: list[bool] = []
        plan: list[tuple[Request, int, int]] = []  # (request, first batch index, n tokens)
        budget = self.ctx.n_batch
        decoding = [r for r in self._active if r.phase == "decode"]
        prefilling = [r for r in self._active if r.phase == "prefill"]
        for req in decoding:
            if budget == 0:
                break
            seq = req.seq
            assert seq is not None
            plan.append((req, len(tokens), 1))
            tokens.append(req.pending)
            positions.append(len(seq.tokens))
            seq_ids.append(seq.id)
            logits.append(True)
            budget -= 1
        for req in prefilling:
            if budget == 0:
                break
            seq = req.seq
            assert seq is not None
            stop = req.save_at if req.save_at > req.n_past else len(req.tokens)
            n = min(self.config.prefill_chunk, budget, stop - req.n_past)
            chunk = req.tokens[req.n_past : req.n_past + n]
            plan.append((req, len(tokens), n))
            tokens.extend(chunk)
            positions.extend(range(req.n_past, req.n_past + n))
            seq_ids.extend([seq.id] * n)
            logits.extend([False] * (n - 1) + [req.n_past + n == len(req.tokens)])
            budget -= n
        if not plan:
            return
        t0 = time.perf_counter()
        try:
            self.ctx.decode(tokens, positions, seq_ids, logits)
        except (LlamaDecodeError, ValueError) as exc:
            for req, _, _ in plan:
                self._fail(req, RuntimeError_("decode_failed", f"llama_decode failed: {exc}"))
            return
        elapsed = time.perf_counter() - t0
        n_total = len(tokens)
        for req, start, n in plan:
            share = elapsed * n / n_total
            seq = req.seq
            assert seq is not None
            if req.phase == "decode":
                req.t_decode += share
                seq.tokens.append(req.pending)
                self._after_sample(req, self._sample(req, start))
                continue
            req.t_prefill += share
            seq.tokens.extend(req.tokens[req.n_past : req.n_past + n])
            req.n_past += n
            if req.save_at and req.n_past == req.save_at:
                self._save(seq, "cold", req)
                req.save_at = 0
            if req.n_past == len(req.tokens):
                req.phase = "decode"
                req.t_first = time.perf_counter()
                self._after_sample(req, self._sample(req, start + n - 1))

    def _sample(self, req: Request, batch_index: int) -> int:
        assert req.rng is not None
        return sample(self.ctx.logits(batch_index), req.sampling, req.rng)

    def _after_sample(self, req: Request, token: int) -> None:
        seq = req.seq
        assert seq is not None
        if self.model.is_eog(token):
            self._finish(req, "stop")
            return
        req.generated.append(token)
        req.pending = token
        req.text += req.decoder.decode(self.model.token_to_piece(token))
        text = req.text
        stop_at = find_stop(text, req.sampling.stop)
        if stop_at >= 0:
            self._emit(req, text[:stop_at], token)
            self._finish(req, "stop", text[:stop_at])
            return
        # Hold back text that might be the start of a stop string.
        hold = max((len(s) - 1 for s in req.sampling.stop), default=0)
        self._emit(req, text[: max(req.emitted_chars, len(text) - hold)], token)
        interval = self.config.continued_interval
        if interval and len(req.generated) % interval == 0:
            self._save(seq, "continued", req)
        if len(req.generated) >= req.sampling.max_tokens or len(seq.tokens) + 1 >= self.ctx.n_ctx:
            self._finish(req, "length")

    def _emit(self, req: Request, text: str, token: int) -> None:
        piece = text[req.emitted_chars:]
        req.emitted_chars = max(req.emitted_chars, len(text))
        req.events.put(TokenEvent(token, piece))

    # saves ---------------------------------------------------------------------------------------

    def _save(self, seq: Seq, reason: str, req: Request | None) -> bytes:
        """Copy a sequence's state out (model thread) and queue it for the daemon.
        Returns the key of the sequence's saved state (also when it was saved before, or
        restored as it is), or b"" when there is none."""
        n = len(seq.tokens)
        if n < self.config.min_save_tokens or self.cache is None:
            return b""
        if n == seq.saved_len:
            return seq.saved_key or self.key_of(seq.tokens)
        key = self.key_of(seq.tokens)
        if not key:
            self.count("saves_dropped")
            self.count("saves_dropped_unavailable")
            return b""
        t0 = time.perf_counter()
        buffer = self.saver.buffers.take(self.ctx.state_seq_size(seq.id))
        state = self.ctx.state_seq_get(seq.id, out=buffer)
        self.on_latency("state_get", time.perf_counter() - t0)
        job = SaveJob(self.identity, tuple(seq.tokens), state, reason, key,
                      as_cells=self.ctx.can_truncate_restored(), buffer=buffer)
        if not self.saver.submit(job):  # dropped (counted): no entry to name or skip
            return b""
        seq.saved_len, seq.saved_key = n, key
        if req is not None:
            req.tokens_saved = max(req.tokens_saved, n - req.tokens_read)
            req.saves.append({"reason": reason, "tokens": n, "key": key.hex()})
        return key

    # completion ----------------------------------------------------------------------------------

    def _finish(self, req: Request, reason: str, text: str | None = None) -> None:
        seq = req.seq
        finish_key = b""
        if seq is not None and reason not in ("cancelled",):
            if reason == "shutdown":
                enabled, save_reason = self.config.save_shutdown, "shutdown"
            else:
                enabled, save_reason = self.config.save_finish, "finish"
            if enabled:
                finish_key = self._save(seq, save_reason, req)
            if req.session_id and finish_key:
                self._remember_session_key(req.session_id, finish_key, len(seq.tokens))
        now = time.perf_counter()
        full_text = req.text + req.decoder.decode(b"", final=True) if text is None else text
        if len(full_text) > req.emitted_chars:
            # Text held back while it could have started a stop string (or an incomplete
            # UTF-8 sequence) is streamed now: the pieces always add up to the final text.
            self._emit(req, full_text, -1)
        completion = Completion(
            text=full_text, tokens=list(req.generated), finish_reason=reason,
            finish_key=finish_key.hex(), cache_hit_kind=req.hit_kind,
            cache_delta={"tokens_read": req.tokens_read, "tokens_saved": req.tokens_saved},
            timings={
                "ttft_ms": round(((req.t_first or now) - req.arrived) * 1000, 3),
                "restore_ms": round(req.t_restore * 1000, 3),
                "prefill_ms": round(req.t_prefill * 1000, 3),
                "decode_ms": round(req.t_decode * 1000, 3),
                "total_ms": round((now - req.arrived) * 1000, 3),
            },
            prompt_tokens=len(req.tokens), session_id=req.session_id, cache_tier=req.tier,
            saves=req.saves)
        self.count(f"hits_{req.hit_kind}")
        self.count("requests_completed")
        self._release(req)
        for observe in self.observers:
            try:
                observe(completion)
            except Exception:  # an observer must never break a request
                log.exception("completion observer failed")
        req.events.put(completion)

    def _fail(self, req: Request, exc: Exception) -> None:
        self.count("requests_failed")
        if req.seq is not None:
            self._clear(req.seq)
        self._release(req)
        req.events.put(exc)

    def _release(self, req: Request) -> None:
        req.phase = "done"
        if req in self._active:
            self._active.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        seq = req.seq
        if seq is not None:
            # A finished sequence keeps its KV: the next request sharing a prefix with it
            # reuses it in place (_bind), as llama.cpp's server does with its slots.
            seq.request = None
            seq.last_used = time.monotonic()
            if not seq.session and not self.config.reuse_live:
                self._clear(seq)
        while self._waiting:
            nxt = self._free_seq(self._waiting[0])
            if nxt is None:
                break
            self._bind(self._waiting.pop(0), nxt)

    def _shutdown(self, done: threading.Event) -> None:
        deadline = time.monotonic() + self.config.shutdown_deadline_s
        # Requests that have not started are failed first: a running one's end releases
        # its sequence, which would be handed to a waiting request (evicting an idle
        # session for it and starting a lookup) only for that request to fail next.
        for req in list(self._waiting) + list(self._resolving) + list(self._active):
            if req.seq is not None and req.phase in ("prefill", "decode"):
                self._finish(req, "shutdown")
            else:
                self._fail(req, RuntimeError_("unavailable", "the runtime is shutting down"))
        if self.config.save_shutdown:
            # Idle sessions. (A free sequence's state was saved as `finish` when its
            # request ended, unless finish saves are off or that save was dropped.)
            for seq in (s for s in self.seqs if s.session):
                if time.monotonic() > deadline:
                    self.count("shutdown_saves_skipped")
                    continue
                self._save(seq, "shutdown", None)
        done.set()
