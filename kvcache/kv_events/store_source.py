"""StoreSource: the daemon's entries as block holdings, for an EventPublisher.

Every entry is on the disk tier (written through), so it holds its blocks on ``DISK``, and
on ``CPU`` too while it has a RAM copy. An entry holds the full blocks whose last token its
own blob holds: all of them for a whole state, those ending after its ``base`` for a piece
(the blocks before are its parent's, held by the parent). The blocks' tokens and chain
hashes come from the index (each entry's rows under the blocks it goes through), never
from a blob.

The store tells of each change under its lock (:meth:`notify`: a queue put, nothing
more); the publisher's thread applies them in that order. Changes are applied by entry
key, idempotently, so the start-up walk of the index (:meth:`load`) and changes made while
it runs agree: an entry seen twice is held once, one gone before its rows were read is
skipped (its removal follows it in the queue).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from .. import keys
from ..index import Index, Record
from .blocks import BlockRef, BlockTable
from .wire import MEDIUM_CPU, MEDIUM_DISK, topic

ADDED, REMOVED, RAM_PLACED, RAM_DROPPED = "added", "removed", "ram_placed", "ram_dropped"


@dataclass
class _Held:
    chain_hashes: list[bytes]
    in_ram: bool


class StoreSource:
    def __init__(self, index: Index, block_size: int) -> None:
        self._index = index
        self._block_size = block_size
        self._changes: queue.SimpleQueue[tuple[str, Record]] = queue.SimpleQueue()
        self._held: dict[bytes, _Held] = {}

    def notify(self, change: str, record: Record) -> None:
        """The store's watcher (called under the store lock)."""
        self._changes.put((change, record))

    def load(self, table: BlockTable) -> None:
        for record in self._index.records():
            self._add(table, record)

    def apply(self, table: BlockTable) -> None:
        while True:
            try:
                change, record = self._changes.get_nowait()
            except queue.Empty:
                return
            if change == ADDED:
                self._add(table, record)
            elif change == REMOVED:
                held = self._held.pop(record.key, None)
                if held is not None:
                    table.release(held.chain_hashes, MEDIUM_DISK)
                    if held.in_ram:
                        table.release(held.chain_hashes, MEDIUM_CPU)
            elif change in (RAM_PLACED, RAM_DROPPED):
                held = self._held.get(record.key)
                if held is not None and held.in_ram != (change == RAM_PLACED):
                    held.in_ram = change == RAM_PLACED
                    if held.in_ram:  # blocks it holds on disk already: in the table
                        table.hold_again(held.chain_hashes, MEDIUM_CPU)
                    else:
                        table.release(held.chain_hashes, MEDIUM_CPU)

    def _add(self, table: BlockTable, record: Record) -> None:
        if record.key in self._held:
            return
        rows = self._index.entry_blocks(record.key)
        if rows is None:  # removed meanwhile: its removal is queued behind
            return
        refs = chain(rows, self._block_size)
        own = [ref for ref in refs if ref.position * self._block_size > record.base]
        held = self._held[record.key] = _Held([r.chain_hash for r in own], record.in_ram)
        name = topic(record.model_name, record.namespace)
        table.hold(name, own, MEDIUM_DISK)
        if held.in_ram:
            table.hold(name, own, MEDIUM_CPU)


def chain(rows: list[tuple[bytes, bytes]], block_size: int) -> list[BlockRef]:
    """BlockRefs of an entry's full blocks from its index rows ``(h_{k-1}, block k)``."""
    refs = []
    for k, (prev, block) in enumerate(rows, start=1):
        chain_hash = keys.block_hashes(prev, block, block_size)[1]
        refs.append(BlockRef(chain_hash, prev if k > 1 else None, k, block))
    return refs
