"""BlockTable: which full blocks a publisher holds, in which tiers, and the events that
tell a subscriber what changed.

A block is one of kvcache's full blocks (the daemon's block size), identified by its chain
hash ``h_k`` (which holds the namespace and every token before it). Any number of holders
(the daemon's entries, a runtime's sequences) may hold the same block, each in one tier;
the block is published once, in the fastest tier that holds it (``MEDIA`` order), and
removed when its last holder lets it go. A block whose fastest tier changes (a RAM copy
made or dropped) is stored on the new tier and then removed from the old one, in that
order, so a subscriber never sees it missing in between.

Changes are collected and turned into events by :meth:`flush` (a block held and let go
between two flushes is never published). Not thread-safe: one thread owns a table.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..keys import bytes_to_tokens
from .wire import MEDIA, TOPIC_ALL, Cleared, Event, Removed, Stored, block_id


@dataclass(frozen=True)
class BlockRef:
    """A full block of a chain: its chain hash, its parent's (None for a first block), its
    1-based position and its tokens (packed u32 LE)."""

    chain_hash: bytes
    parent: bytes | None
    position: int
    tokens: bytes


@dataclass
class _Block:
    ref: BlockRef
    topic: str
    holders: list[int] = field(default_factory=lambda: [0] * len(MEDIA))
    published: int | None = None  # the index in MEDIA of the tier published, if any

    def best(self) -> int | None:
        return next((i for i, n in enumerate(self.holders) if n > 0), None)


class BlockTable:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[bytes, _Block] = {}
        self._dirty: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def hold(self, topic: str, blocks: Iterable[BlockRef], medium: str) -> None:
        """One more holder of each of ``blocks`` in ``medium``."""
        tier = MEDIA.index(medium)
        for ref in blocks:
            block = self._blocks.get(ref.chain_hash)
            if block is None:
                block = self._blocks[ref.chain_hash] = _Block(ref, topic)
            block.holders[tier] += 1
            self._dirty.add(ref.chain_hash)

    def hold_again(self, chain_hashes: Iterable[bytes], medium: str) -> None:
        """One more holder in ``medium`` of blocks the table has (others: nothing)."""
        tier = MEDIA.index(medium)
        for chain_hash in chain_hashes:
            block = self._blocks.get(chain_hash)
            if block is not None:
                block.holders[tier] += 1
                self._dirty.add(chain_hash)

    def release(self, chain_hashes: Iterable[bytes], medium: str) -> None:
        """One holder fewer of each block in ``medium`` (a block not held there: nothing)."""
        tier = MEDIA.index(medium)
        for chain_hash in chain_hashes:
            block = self._blocks.get(chain_hash)
            if block is not None and block.holders[tier] > 0:
                block.holders[tier] -= 1
                self._dirty.add(chain_hash)

    def flush(self) -> dict[str, list[Event]]:
        """The events since the last flush, by topic: stores (parents first), then
        removals (children first)."""
        stored: dict[tuple[str, int], list[BlockRef]] = defaultdict(list)
        removed: dict[tuple[str, int], list[BlockRef]] = defaultdict(list)
        for chain_hash in self._dirty:
            block = self._blocks[chain_hash]
            best = block.best()
            if best != block.published:
                if best is not None:
                    stored[(block.topic, best)].append(block.ref)
                if block.published is not None:
                    removed[(block.topic, block.published)].append(block.ref)
                block.published = best
            if best is None:
                del self._blocks[chain_hash]
        self._dirty.clear()
        out: dict[str, list[Event]] = defaultdict(list)
        for (topic, tier), refs in sorted(stored.items()):
            out[topic].extend(self._runs(refs, MEDIA[tier]))
        for (topic, tier), refs in sorted(removed.items()):
            refs.sort(key=lambda r: -r.position)
            out[topic].append(Removed(tuple(block_id(r.chain_hash) for r in refs),
                                      MEDIA[tier]))
        return dict(out)

    def snapshot(self) -> list[Event]:
        """Everything published now, as one batch would restore it: AllBlocksCleared, then
        every block (all namespaces; the batch goes out on TOPIC_ALL)."""
        by_tier: dict[int, list[BlockRef]] = defaultdict(list)
        for block in self._blocks.values():
            if block.published is not None:
                by_tier[block.published].append(block.ref)
        events: list[Event] = [Cleared()]
        for tier, refs in sorted(by_tier.items()):
            events.extend(self._runs(refs, MEDIA[tier]))
        return events

    def _runs(self, refs: Sequence[BlockRef], medium: str) -> list[Event]:
        """BlockStored events for ``refs``: each a run of blocks where every block is the
        parent of the next (what vLLM emits), parents before their children."""
        runs: list[list[BlockRef]] = []
        ends: dict[bytes, list[BlockRef]] = {}  # a run's last chain hash -> the run
        for ref in sorted(refs, key=lambda r: r.position):
            run = ends.pop(ref.parent, None) if ref.parent is not None else None
            if run is None:
                run = []
                runs.append(run)
            run.append(ref)
            ends[ref.chain_hash] = run
        return [Stored(tuple(block_id(r.chain_hash) for r in run),
                       block_id(run[0].parent) if run[0].parent is not None else None,
                       tuple(t for r in run for t in bytes_to_tokens(r.tokens)),
                       self.block_size, medium)
                for run in runs]


__all__ = ["TOPIC_ALL", "BlockRef", "BlockTable"]
