"""Eviction policy: leaves first, least recently used first among them.

These functions are the policy's definition, as full sorts of every record. The daemon
does not sort: kvcache.ordering keeps the same orders in the index as entries change,
and tests/unit/test_ordering.py holds it to these functions on random sequences of changes.
Operators' prunes (which choose among filtered entries) still sort with them.

LRU is predictable for operators ("what was not used for longest goes first") and fits
the main workload (a few hot system prompts, many one-off conversation states). An entry
other entries are built on (their parent: a shared system prompt) is not a candidate
while they exist, so the prefix every conversation shares outlives the conversations'
tails, as in a radix cache. Pinned entries and entries being read are never candidates,
and neither is anything they are built on.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from ..record import Record


def eviction_order(records: Iterable[Record],
                   pending_use: Mapping[bytes, float] | None = None) -> list[Record]:
    """Records by last use, least recent first (ties: oldest first)."""
    pending_use = pending_use or {}

    def last_touch(record: Record) -> tuple[float, float]:
        return (max(record.last_touch, pending_use.get(record.key, 0.0)), record.created)

    return sorted(records, key=last_touch)


def leaf_first_order(records: Iterable[Record], pending_use: Mapping[bytes, float] | None = None,
                     keep: frozenset[bytes] | set[bytes] = frozenset()) -> list[Record]:
    """The order in which entries may be evicted one at a time, each a leaf when its turn
    comes: least recently used first among the current leaves, a parent joining them
    once its last child has gone. Entries in ``keep`` (pinned, being read) are left out,
    and so is every entry they are built on."""
    ordered = eviction_order(records, pending_use)
    rank = {r.key: i for i, r in enumerate(ordered)}
    children: dict[bytes, int] = {}
    for r in ordered:
        if r.parent in rank:
            children[r.parent] = children.get(r.parent, 0) + 1
    by_key = {r.key: r for r in ordered}
    heap = [rank[r.key] for r in ordered if not children.get(r.key) and r.key not in keep]
    heapq.heapify(heap)
    out: list[Record] = []
    while heap:
        record = ordered[heapq.heappop(heap)]
        out.append(record)
        parent = by_key.get(record.parent)
        if parent is None:
            continue
        children[parent.key] -= 1
        if not children[parent.key] and parent.key not in keep:
            heapq.heappush(heap, rank[parent.key])
    return out


def ram_order(records: Iterable[Record], pending_use: Mapping[bytes, float] | None = None,
              keep: frozenset[bytes] | set[bytes] = frozenset()) -> list[Record]:
    """The order in which RAM copies are dropped. Dropping a copy removes nothing others
    depend on, so every copy not in ``keep`` may go: in leaf_first_order's order first,
    then the copies of the entries a kept entry is built on, least recently used first."""
    records = list(records)
    order = leaf_first_order(records, pending_use, keep)
    listed = {r.key for r in order}
    order += [r for r in eviction_order(records, pending_use)
              if r.key not in listed and r.key not in keep]
    return [r for r in order if r.in_ram]
