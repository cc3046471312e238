"""Cache resolution: the saved state a request starts from, found on resolver threads
so that cache I/O never stalls decoding.

In order: the request's ``parent_key``; the session's last saved state (waiting up to
``session_resume_wait_ms`` for its save to be published); the daemon's longest common
prefix of the prompt (asked again after waiting as long for this runtime's own queued
saves that would serve more of it). A state is used only where it covers more of the
prompt than an idle sequence's live KV (``Request.live_keep``), a plain-attention state by
at least ``min_save_tokens`` (:meth:`Resolver.beats_live`): the live sequence needs no
restore. A corrupt or missing blob is counted and skipped (the lookup is
tried once more); a daemon that is down or slow makes the request cold, never fail.

Also the runtime's other cache I/O that must stay off the model thread: the daemon's
block size (keys depend on it) and deleting a state llama.cpp refused. Runs on the
resolver pool; reads the session keys the model thread writes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvcache import keys
from kvcache.client import (
    CacheClient,
    CacheError,
    CacheUnavailable,
    CorruptBlob,
    LoadedBlob,
    LookupResult,
    NotAPrefix,
)
from kvcache.common import TIER_REMOTE

from .config import RuntimeConfig
from .identity import Identities
from .request import Request, SessionKey, common_prefix, servable
from .saver import Saver, holds_more

log = logging.getLogger("model_runtime")

Chain = list[LoadedBlob]  # a saved state's blobs, root first


class Resolver:
    def __init__(self, cache: CacheClient | None, identities: Identities, saver: Saver,
                 config: RuntimeConfig, *, plain_kv: bool, count: Callable[[str], None],
                 session_keys: Mapping[SessionKey, tuple[bytes, int]]) -> None:
        self.cache = cache
        self.identities = identities  # each tenant's identity and namespace
        self.saver = saver
        self.config = config
        # A restored plain-attention state can be cut anywhere (see llama_backend's
        # LlamaContext.can_truncate_restored); SWA and recurrent states cannot.
        self.plain_kv = plain_kv
        self._count = count
        self.session_keys = session_keys  # (tenant, session) -> (key, n_tokens) of its last save
        self._block_size: int | None = None
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-resolve")

    def submit(self, req: Request, done: Callable[[Request, Chain | None], None]) -> None:
        """Resolve ``req`` on a resolver thread; ``done(req, chain or None)`` follows."""
        self.pool.submit(self._run, req, done)

    def _run(self, req: Request, done: Callable[[Request, Chain | None], None]) -> None:
        chain = None
        try:
            chain = self.find_state(req)
        except Exception:  # a cache problem must never fail the request
            log.exception("cache resolution failed; going cold")
            self._count("cache_errors")
        if chain and not self.beats_live(self.serves(chain, req), req):
            chain = None  # the live sequence serves (about) as much without a restore
        req.timings.answered = time.perf_counter()
        done(req, chain)

    def beats_live(self, served: int, req: Request) -> bool:
        """Whether restoring a state that serves ``served`` prompt tokens is worth more
        than going on from an idle sequence's live KV (``live_keep`` tokens, 0: none). A
        plain-attention state must serve at least ``min_save_tokens`` more: fewer are
        cheaper to prefill on the live sequence than a whole state is to load and set
        (a ~1,000-token SmolLM2 state is 25 MB; four clients sharing a system prompt had
        most requests restore one to save the few tokens their previous turn shared with
        the new one). A state that cannot be cut needs only one more; a tie goes to the
        live sequence."""
        if not req.live_keep:
            return served > 0
        margin = self.config.min_save_tokens if self.plain_kv else 1
        return served >= req.live_keep + max(1, margin)

    def live_serves_best(self, req: Request) -> bool:
        """Whether an idle sequence's live KV serves the request as well as any saved
        state could: the prompt's rest is shorter than the margin by which a state must
        beat it (:meth:`beats_live`), so no answer of the daemon would be restored."""
        return bool(req.live_keep) and not self.beats_live(len(req.tokens), req)

    def note_use(self, req: Request) -> None:
        """A request that a live sequence serves without waiting for a cache answer
        (:meth:`live_serves_best`): its lookup is still sent, in the background and its
        answer dropped, so the daemon counts the use of the entries the prompt shares
        (hit counts and last use, which its eviction order and prune read)."""
        cache, tokens = self.cache, list(req.tokens)
        if cache is None:
            return
        identity = self.identities.of(req.tenant)

        def ask() -> None:
            with contextlib.suppress(CacheError):
                cache.lookup(identity, tokens, max_tokens=len(tokens),
                             common_prefix=self.plain_kv,
                             timeout=self.config.cache_timeout_s)  # (opens no pieces)

        with contextlib.suppress(RuntimeError):  # the pool is shutting down
            self.pool.submit(ask)

    @staticmethod
    def serves(chain: Chain, req: Request) -> int:
        """Prompt tokens a restore of ``chain`` would not compute again."""
        n = len(req.tokens)
        ends_with_scores = any(len(b.meta.tokens) == n and b.meta.logits for b in chain)
        return servable(common_prefix(chain[-1].meta.tokens, req.tokens), n, ends_with_scores)

    def find_state(self, req: Request) -> Chain | None:
        """The blobs of the best saved state for the request, root first (one blob for
        a whole state, a chain of pieces otherwise), or None: cold, or a live sequence
        serves as much."""
        if self.cache is None:
            return None
        self.fetch_block_size()  # off the model thread: later saves need it for keys
        tokens = req.tokens
        timeout = self.config.cache_timeout_s
        wait_ms = self.config.session_resume_wait_ms
        candidates: list[tuple[str, bytes]] = []
        if req.parent_key:
            candidates.append(("parent", req.parent_key))
        last = self.session_keys.get(req.session_key) if req.session_key else None
        # (Not worth loading when a live sequence already serves as much.)
        if last and last[1] <= len(tokens) and min(last[1], len(tokens) - 1) > req.live_keep:
            candidates.append(("session", last[0]))
        for source, key in candidates:
            event = self.saver.in_flight(key)
            if event is not None:  # still being sent from this process
                event.wait(wait_ms / 1000)
            try:
                chain = self.cache.load_chain(key, prefix_of=tokens, wait_ms=wait_ms,
                                              timeout=timeout + wait_ms / 1000)
            except CacheUnavailable:
                self._count("cache_unavailable")
                return None
            except NotAPrefix as exc:
                # The prompt does not extend the state it names: the conversation before
                # its new input was rendered otherwise (a Responses continuation with other
                # instructions, which are not carried over; an edited earlier turn). What
                # the two share is found by the longest-prefix lookup below.
                self._count(f"{source}_key_unusable")
                log.info("%s state %s is not a prefix of the prompt: they share its first "
                         "%d of %d tokens (what came before the new input differs, e.g. "
                         "other instructions or an earlier turn written otherwise); the "
                         "prompt reuses the longest prefix it shares with a live or saved "
                         "state instead",
                         source, key.hex()[:16], exc.shared, exc.n_tokens)
                continue
            except CacheError as exc:
                if isinstance(exc, CorruptBlob):  # quarantined: counted like a lookup hit's
                    self._count("corrupt_blobs")
                self._count(f"{source}_key_unusable")
                log.info("%s key %s unusable: %s", source, key.hex(), exc)
                continue
            if chain[-1].meta.namespace != self.identities.namespace(req.tenant):
                # Another tenant's entry (or another model's): a key is no pass into a
                # namespace (tests/runtime/test_tenants_per_request.py).
                self._count(f"{source}_key_unusable")
                continue
            if self.usable(chain, req):
                self._count(f"resolved_by_{source}")
                return chain
            # The whole prompt without its end's scores, where a restored state cannot
            # be cut (sliding-window, recurrent, hybrid).
            self._count(f"{source}_key_unusable")
        return self._longest_prefix(req)

    def usable(self, chain: Chain, req: Request) -> bool:
        """Whether a restore of ``chain`` serves ``req`` without cutting a state that
        cannot be cut (sliding-window, recurrent, hybrid): one strictly shorter than the
        prompt, or of the whole prompt with the scores after it (nothing decoded again).
        A plain-attention state is cut wherever it leaves the prompt."""
        n = len(chain[-1].meta.tokens)
        return self.plain_kv or n < len(req.tokens) or self.serves(chain, req) == n

    def _longest_prefix(self, req: Request) -> Chain | None:
        # A plain-attention state can be cut anywhere: any entry sharing leading tokens
        # with the prompt serves them (longer or diverging ones are cut after restore).
        # Other states serve only whole: the deepest one at or below the prompt (an
        # entry of the whole prompt only with its end's scores, else the next shorter).
        assert self.cache is not None
        tokens = req.tokens
        limit = len(tokens)
        timeout = self.config.cache_timeout_s
        # A corrupt hit is quarantined: look again, once; so is a whole-prompt state
        # without scores where states cannot be cut (then only shorter ones are asked).
        for _attempt in range(2 if self.plain_kv else 3):
            try:
                hit = self._lookup(req, limit)
                if hit is None:
                    return None
                if not self.beats_live(min(hit.matched_tokens, len(tokens) - 1), req) or \
                        hit.entry_tokens > hit.matched_tokens < self.config.min_save_tokens:
                    # A live sequence serves about as much without a restore, or restoring
                    # a whole state for a few tokens costs more than prefilling them.
                    self.cache.release(hit)
                    return None
                chain = self.cache.load_chain(hit.key, prefix_of=tokens,
                                              shares=hit.matched_tokens,
                                              pieces=hit.pieces_for(hit.matched_tokens),
                                              block_size=hit.block_size,
                                              timeout=timeout * 4)
                if not self.usable(chain, req):
                    limit = len(tokens) - 1
                    continue
                if hit.tier == TIER_REMOTE:  # fetched into the daemon's tiers for this hit
                    chain[-1] = replace(chain[-1], tier=TIER_REMOTE)
                self._count(f"restored_from_{chain[-1].tier or 'cache'}")
                return chain
            except CacheUnavailable:
                self._count("cache_unavailable")
                return None
            except CorruptBlob:
                self._count("corrupt_blobs")
            except NotAPrefix as exc:
                # The daemon matched these tokens by their block hashes, and the entry it
                # gave holds others: a hash collision, or an index out of step with its blobs.
                self._count("cache_errors")
                log.warning("cache lookup answered an entry that is not the prompt's "
                            "(hash collision?): %s", exc)
                return None
            except CacheError as exc:
                self._count("cache_errors")
                log.warning("cache lookup failed: %s", exc)
                return None
        return None

    def _lookup(self, req: Request, limit: int) -> LookupResult | None:
        """The daemon's longest-common-prefix answer; asked again after waiting (up to
        ``session_resume_wait_ms``) where a save still queued in this runtime would serve
        more of the prompt than that answer or a live sequence: at least
        ``min_save_tokens`` more for a plain state, any more for one that cannot be cut
        (see below). Otherwise a conversation's next turn whose sequence another request has
        taken since would be prefilled cold when it comes back before its ``finish`` save
        is published
        (tests/runtime/test_runtime.py::test_a_prompt_waits_for_this_runtime_s_queued_save_of_its_prefix)."""
        cache, tokens = self.cache, req.tokens
        assert cache is not None

        # A hit that will be restored has its pieces opened in the same call (a restore
        # needs no more); one that serves no more than the live sequence, or only a few
        # tokens of a longer state, would not be restored (see _longest_prefix).
        open_min = max(req.live_keep + (self.config.min_save_tokens if self.plain_kv else 1),
                       self.config.min_save_tokens)

        identity = self.identities.of(req.tenant)

        def ask() -> LookupResult | None:
            return cache.lookup(identity, tokens, max_tokens=limit,
                                common_prefix=self.plain_kv, open_min_tokens=open_min,
                                timeout=self.config.cache_timeout_s)

        whole = not self.plain_kv
        # Listed before the daemon is asked: a save published in between is then in its
        # answer or, listed here, waited for (done already) and asked again.
        queued = self.saver.in_flight_sharing(self.identities.namespace(req.tenant), tokens,
                                              more_than=req.live_keep, whole=whole)
        hit = ask()
        served = max(req.live_keep, min(hit.matched_tokens, len(tokens) - 1) if hit else 0)
        # A plain state: worth a wait only for at least min_save_tokens more, fewer are
        # cheaper to prefill. A state that cannot be cut is served only by a checkpoint at
        # or before where the prompt leaves it: in an agent loop sent back to back, the
        # previous request's (its prompt's end, or the one before it, where the reply
        # re-tokenized) is still queued here, and the one the daemon holds is a whole turn
        # older; worth its wait, as llama.cpp's server rolls back to the checkpoints it
        # kept (tests/runtime/test_seam_checkpoints.py).
        more_than = served + (self.config.min_save_tokens - 1 if self.plain_kv else 0)
        waits = [event for saved, event in queued
                 if holds_more(saved, tokens, more_than, whole=whole)]
        if more_than >= len(tokens) - 1 or not waits:
            return hit
        self._count("lookups_waited_own_save")
        deadline = time.monotonic() + self.config.session_resume_wait_ms / 1000
        for event in waits:
            event.wait(max(0.0, deadline - time.monotonic()))
        if hit is not None:
            cache.release(hit)
        return ask()

    # -- keys -----------------------------------------------------------------------------

    def block_size(self, *, wait: bool) -> int | None:
        """The daemon's block size (keys depend on it); None while it is unknown. Without
        ``wait`` (the model thread) an unknown block size is fetched in the background
        and the caller goes without a key this time."""
        if self._block_size is None and self.cache is not None:
            if wait:
                self.fetch_block_size()
            else:
                with contextlib.suppress(RuntimeError):  # the pool is shutting down
                    self.pool.submit(self.fetch_block_size)
        return self._block_size

    def fetch_block_size(self) -> None:
        if self._block_size is None and self.cache is not None:
            with contextlib.suppress(CacheError):
                self._block_size = int(self.cache.stats().block_size) or None

    def key_of(self, tokens: Sequence[int], namespace: bytes, *, wait: bool) -> bytes:
        """The daemon's key for a state of ``tokens`` in ``namespace``; b"" while the
        block size is unknown."""
        bs = self.block_size(wait=wait)
        if bs is None:
            return b""
        return keys.entry_key(namespace, tokens, bs).key

    # -- rejected states ------------------------------------------------------------------

    def forget_later(self, blob: LoadedBlob) -> None:
        """Delete a state llama.cpp refused: kept, every later request with its prefix
        would try it again, and its key would stop a good state from ever being saved."""
        cache, tokens, namespace = self.cache, list(blob.meta.tokens), blob.meta.namespace
        if cache is None:
            return

        def forget() -> None:
            key = self.key_of(tokens, namespace, wait=True)
            # The daemon refuses to delete an entry while another runtime reads it (its
            # own work on it, such as its RAM copy, it waits for): that passes in
            # moments, so retry (tests/daemon/test_counters.py holds a read open across the
            # delete). A pinned entry stays, as it should.
            for delay in (0.05, 0.2, 0.5, 1.0, 0.0):
                try:
                    if key:
                        cache.delete(key)
                        self._count("rejected_states_deleted")
                    return
                except CacheError as exc:
                    if not delay or exc.code is None or exc.code.name != "FAILED_PRECONDITION":
                        return
                time.sleep(delay)

        with contextlib.suppress(RuntimeError):
            self.pool.submit(forget)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
