"""The runtime's live sequences as KV events: the device tier (``GPU``), so that a router
prefers the host whose worker holds a prompt's KV live over one that must restore it.

Each sequence holds the full blocks of the tokens its KV cells hold (``Seq.tokens``), with
the daemon's block size and chain hashes in its tenant's namespace: the same block ids the
daemon publishes for the same tokens. The model thread only compares each sequence's full
blocks with what it last saw, at most every ``OBSERVE_S`` and whenever it goes idle
(:meth:`SequenceSource.observe`, a list comparison); hashing and publishing run on the
publisher's thread. Published with kvcache's EventPublisher (snapshots, replay).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence

from kvcache import keys
from kvcache.kv_events.blocks import BlockRef, BlockTable
from kvcache.kv_events.wire import MEDIUM_GPU, topic

from .request import Seq

OBSERVE_S = 0.02  # the model thread looks at its sequences at most this often while busy


class SequenceSource:
    """A Source (kvcache.kv_events.publisher) of live sequences. ``block_size``: the
    daemon's, None while unknown (nothing is published until it is);
    ``namespace``: a tenant's namespace (may ask the daemon: publisher thread only)."""

    def __init__(self, model_name: str, block_size: Callable[[], int | None],
                 namespace: Callable[[str], bytes]) -> None:
        self._model_name = model_name
        self._block_size = block_size
        self._namespace = namespace
        self._seen: dict[int, tuple[str, list[int]]] = {}  # model thread only
        self._last = 0.0
        self._changes: queue.SimpleQueue[tuple[int, str, list[int], int]] = queue.SimpleQueue()
        self._held: dict[int, list[bytes]] = {}  # publisher thread only

    def observe(self, seqs: Sequence[Seq], *, idle: bool = False) -> None:
        """Model thread: note each sequence whose full blocks changed since last seen."""
        now = time.monotonic()
        if not idle and now - self._last < OBSERVE_S:
            return
        self._last = now
        block = self._block_size()
        if not block:
            return
        for seq in seqs:
            full = seq.tokens[: len(seq.tokens) // block * block]
            if self._seen.get(seq.id) != (seq.tenant, full):
                self._seen[seq.id] = (seq.tenant, full)
                self._changes.put((seq.id, seq.tenant, full, block))

    def load(self, table: BlockTable) -> None:
        """A runtime starts with no live sequence: nothing to hold."""

    def apply(self, table: BlockTable) -> None:
        while True:
            try:
                seq_id, tenant, tokens, block = self._changes.get_nowait()
            except queue.Empty:
                return
            table.release(self._held.pop(seq_id, []), MEDIUM_GPU)
            if not tokens or block != table.block_size:
                continue
            ns = self._namespace(tenant)
            hashes = keys.block_hashes(ns, tokens, block)
            raw = keys.tokens_to_bytes(tokens)
            refs = [BlockRef(hashes[k], hashes[k - 1] if k > 1 else None, k,
                             raw[(k - 1) * block * 4 : k * block * 4])
                    for k in range(1, len(hashes))]
            table.hold(topic(self._model_name, ns), refs, MEDIUM_GPU)
            self._held[seq_id] = [r.chain_hash for r in refs]
