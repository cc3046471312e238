"""Sends captured states to the cache daemon in the background.

The model thread only copies a sequence's state out of llama.cpp (``get_data``); this
sender does the rest (cutting, blob encoding, checksums, reserve, write, commit) so
decoding never waits for the cache. When the daemon is slow or gone, saves are dropped
and counted, never retried into a growing backlog.

A state that can be cut (plain attention) is stored as a piece: the daemon is asked for
the stored state sharing the most leading tokens with it, and only the cells after
those are sent, built on that state's chain (see pieces.py). So a ``finish`` save after
a restore, or a conversation over a stored system prompt, stores only what is new. A
state with a tail (hybrid, sliding-window) is stored so too, its tail with its new cells.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvcache.client import CacheClient, CacheError, CacheUnavailable, Identity, SaveResult

from .state import pieces
from .state.buffers import StateBuffers
from .state.layout import StateFormatError

log = logging.getLogger("model_runtime.saver")


def holds_more(saved: Sequence[int], tokens: Sequence[int], more_than: int, *,
               whole: bool = False) -> bool:
    """Whether a state of ``saved`` holds more than ``more_than`` leading tokens of
    ``tokens``; with ``whole`` only as a prefix of them (a state that cannot be cut)."""
    shared = more_than + 1
    if len(saved) < shared or len(tokens) < shared:
        return False
    if whole:
        return tuple(saved) == tuple(tokens[:len(saved)])
    return tuple(saved[:shared]) == tuple(tokens[:shared])


@dataclass(frozen=True)
class Waypoint:
    """An entry stored on the way to a save's own, from the same captured state: its
    first ``n_tokens`` cells (a request's prompt within its ``finish`` state), with the
    scores of the token after them."""

    n_tokens: int
    reason: str
    logits: bytes


@dataclass(frozen=True)
class SaveJob:
    identity: Identity  # whose state: the model's identity salted with the tenant's
    namespace: bytes  # that identity's (keys and in-flight saves are per namespace)
    tokens: tuple[int, ...]
    state: bytes | memoryview  # the sequence state as llama.cpp wrote it
    reason: str
    key: bytes  # the key the daemon will give it (computed locally for finish_key)
    as_cells: bool = False  # stored as a run of cells (plain attention, or with a tail)
    tail: bool = False  # cells followed by a part that cannot be cut (see model_runtime.state)
    window: int = 0  # that part is a sliding window's cells, of this many positions
    buffer: np.ndarray | None = None  # holds ``state``: back to Saver.buffers when done
    logits: bytes = b""  # the scores of the token after the state's last ("": unknown)
    waypoints: tuple[Waypoint, ...] = ()  # shorter entries first, shortest first


@dataclass(frozen=True)
class PinJob:
    """An expiring pin of an entry (a cache_control breakpoint's), sent in queue order."""

    key: bytes
    ttl_seconds: float
    tenant: str


class Saver:
    def __init__(self, client: CacheClient | None, counters: Counter[str],
                 counters_lock: threading.Lock, max_pending: int = 8,
                 min_shared_tokens: int = 64, in_flight_wait_ms: int = 1000) -> None:
        self.client = client
        # How long a save waits for another writer's save of a longer shared prefix to be
        # published, so that it stores only what follows it; still in flight after that,
        # the save is dropped (the other writer is storing those cells).
        self.in_flight_wait_ms = in_flight_wait_ms
        # A stored prefix shorter than this is not built on: a piece would keep a whole
        # blob of another entry alive for a few of its cells.
        self.min_shared_tokens = max(1, min_shared_tokens)
        self.counters = counters
        self._lock = counters_lock
        self._queue: queue.Queue[SaveJob | PinJob | None] = queue.Queue(maxsize=max_pending)
        # Saves queued or being sent: key -> (namespace, tokens, set when done).
        self._in_flight: dict[bytes, tuple[bytes, tuple[int, ...], threading.Event]] = {}
        self.buffers = StateBuffers()  # what the model thread copies states into
        # (reason, seconds) of every save the daemon published: reserve, write, commit.
        self.on_saved: Callable[[str, float], None] = lambda reason, seconds: None
        self._thread = threading.Thread(target=self._run, name="kvcache-saver", daemon=True)
        self._thread.start()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def submit(self, job: SaveJob) -> bool:
        """Queue ``job``; False (counted) when the backlog is full. The engine never
        submits without a client (it takes no saves then)."""
        with self._lock:
            self._in_flight.setdefault(job.key, (job.namespace, job.tokens, threading.Event()))
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._finish(job)
            self._count("saves_dropped")
            self._count("saves_dropped_backlog")
            return False
        for point in job.waypoints:
            self._count(f"saves_queued_{point.reason}")
        self._count(f"saves_queued_{job.reason}")
        return True

    def pin(self, key: bytes, ttl_seconds: float, tenant: str) -> None:
        """Queue an expiring pin of ``tenant``'s entry ``key``; dropped (counted) when the
        backlog is full."""
        try:
            self._queue.put_nowait(PinJob(key, ttl_seconds, tenant))
        except queue.Full:
            self._count("pins_dropped")

    def _send_pin(self, job: PinJob) -> None:
        """Pin, on the data path (a token bound to the tenant may, no operator's right is
        needed): a daemon that refuses it (the entry is gone, the ttl is over the
        daemon's longest, or the tenant's pins hold as much as they may) costs the pin,
        never the saves."""
        assert self.client is not None
        try:
            self.client.pin_tenant_entry(job.key, job.ttl_seconds, tenant=job.tenant)
            self._count("pins_sent")
        except Exception as exc:  # this thread must outlive any one pin, as any one save
            self._count("pins_failed")
            log.info("pin of %s for %g s refused: %s", job.key.hex(), job.ttl_seconds, exc,
                     exc_info=not isinstance(exc, CacheError))

    def pending(self) -> int:
        return self._queue.qsize()

    def room(self) -> int:
        """Saves that can be queued now before the backlog is full."""
        return self._queue.maxsize - self._queue.qsize()

    def in_flight(self, key: bytes) -> threading.Event | None:
        """An event set when the save of ``key`` (queued here) has finished, or None."""
        with self._lock:
            entry = self._in_flight.get(key)
        return entry[2] if entry is not None else None

    def in_flight_sharing(self, namespace: bytes, tokens: Sequence[int], more_than: int, *,
                          whole: bool = False) -> list[tuple[tuple[int, ...], threading.Event]]:
        """The saves of ``namespace`` queued here that hold more than ``more_than`` leading
        tokens of ``tokens`` (see :func:`holds_more`): each state's tokens and an event set
        when it is done. Until they are published the daemon cannot serve those tokens (the
        resolver waits for them, bounded). Another tenant's saves are never waited for:
        they could serve nothing."""
        with self._lock:
            queued = list(self._in_flight.values())
        return [(saved, event) for space, saved, event in queued
                if space == namespace and holds_more(saved, tokens, more_than, whole=whole)]

    def _finish(self, job: SaveJob) -> None:
        if job.buffer is not None:  # nothing refers to the state any more
            self.buffers.give_back(job.buffer)
        with self._lock:
            entry = self._in_flight.pop(job.key, None)
        if entry is not None:
            entry[2].set()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, PinJob):
                self._send_pin(job)
                continue
            try:
                assert self.client is not None
                t0 = time.perf_counter()
                result, base = self._send(job)
                if result is None:  # dropped by _send, and counted there
                    continue  # (the finally below still runs)
                if result.status == "saved":
                    self.on_saved(job.reason, time.perf_counter() - t0)
                    self._count_saved(job.reason, len(job.tokens), base)
                else:
                    self._count(f"saves_skipped_{result.status}")
            except CacheUnavailable as exc:
                self._count("saves_dropped")
                self._count("saves_dropped_unavailable")
                log.debug("cache unavailable, save dropped: %s", exc)
            except Exception as exc:  # this thread must outlive any one save
                # A CacheError is expected (refused, full disk); anything else is a bug worth
                # a traceback, but it must not end the thread and with it every later save.
                self._count("saves_dropped")
                self._count("saves_failed")
                log.warning("save of %d tokens (%s) failed: %s", len(job.tokens), job.reason,
                            exc, exc_info=not isinstance(exc, CacheError))
            finally:
                self._finish(job)

    def _count_saved(self, reason: str, n_tokens: int, base: int) -> None:
        self._count(f"saves_{reason}")
        self._count("tokens_saved", n_tokens)
        self._count("tokens_stored", n_tokens - base)
        if base:
            self._count("saves_built_on_prefix")

    def _send(self, job: SaveJob) -> tuple[SaveResult | None, int]:
        """Save the job's state; returns the result (None: dropped, counted here) and the
        tokens taken from a parent."""
        client = self.client
        assert client is not None
        if not job.as_cells:
            return client.save(job.identity, job.tokens, job.state, job.reason,
                               logits=job.logits), 0
        n = len(job.tokens)
        hit, in_flight = client.lookup_before_save(job.identity, job.tokens,
                                                   wait_in_flight_ms=self.in_flight_wait_ms)
        if hit is not None and hit.matched_tokens == hit.entry_tokens == n:
            return SaveResult("already_present", hit.key), 0
        if in_flight >= n:  # another writer is storing all of it (this key or longer)
            return SaveResult("in_flight", job.key), 0
        if in_flight >= self.min_shared_tokens:  # the other writer stores those cells
            self._count("saves_dropped")
            self._count("saves_dropped_in_flight_prefix")
            return None, 0
        # At least the last cell is stored: an entry needs a blob of its own (its key is
        # reported and resumed from), also where a longer entry holds all of it.
        shared = min(hit.matched_tokens, n - 1) if hit is not None else 0
        parent = hit.parent_for(shared) if hit is not None else None
        if job.window and parent is not None and parent.n_tokens > shared:
            # A window's cells are kept only at the end of each piece: build on a piece
            # that ends where this one starts (its window holds what this one's needs).
            assert hit is not None  # the parent came from it
            ends = [p for p in hit.chain if p.n_tokens <= shared]
            parent = ends[-1] if ends else None
            shared = parent.n_tokens if parent is not None else 0
        try:
            if parent is not None and shared >= self.min_shared_tokens:
                try:
                    return self._save_from(job, parent.key, shared)
                except CacheError as exc:
                    if exc.code != grpc.StatusCode.NOT_FOUND:
                        raise
                    self._count("saves_parent_gone")  # evicted since the lookup
            return self._save_from(job, b"", 0)
        except StateFormatError as exc:  # not one run of cells: stored whole
            log.debug("state of %d tokens saved whole: %s", n, exc)
            return client.save(job.identity, job.tokens, job.state, job.reason,
                               logits=job.logits), 0

    def _save_from(self, job: SaveJob, parent: bytes, base: int) -> tuple[SaveResult, int]:
        """Store the job's waypoints past ``base`` and then its own state, each built on
        the one before (the first on ``parent``). Returns the job's result and the tokens
        it took from its parent."""
        for point in job.waypoints:
            if point.n_tokens <= base:
                continue  # the parent's chain holds it already
            result = self._save_cells(job, parent, base, point.n_tokens, point.reason,
                                      point.logits)
            if result.status == "saved":
                self._count_saved(point.reason, point.n_tokens, base)
            elif result.status != "already_present":
                break  # another writer is storing it: the job's own builds on the parent
            parent, base = result.key, point.n_tokens
        return self._save_cells(job, parent, base, len(job.tokens), job.reason, job.logits), base

    def _save_cells(self, job: SaveJob, parent: bytes, base: int, end: int, reason: str,
                    logits: bytes) -> SaveResult:
        """Store the cells ``[base, end)`` of the job's state as the entry of its first
        ``end`` tokens."""
        assert self.client is not None
        piece = pieces.cut(job.state, base, end, tail=job.tail, window=job.window)
        if piece.n_cells != end:
            raise StateFormatError(f"{piece.n_cells} cells for {end} tokens")
        return self.client.save(job.identity, job.tokens[:end], piece.payload, reason,
                                parent=parent, base=base, cell_layout=piece.cell_layout,
                                logits=logits)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued save is done; False if the deadline passed first."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._in_flight:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=1.0)
        self.buffers.close()
