"""Eviction policy: least recently used first, by the entry's last read (or creation).

LRU is predictable for operators ("what was not used for longest goes first") and fits
the main workload (a few hot system prompts, many one-off conversation states). Pinned
entries and entries being read are never candidates; the caller filters them out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .index import Record


def eviction_order(records: Iterable[Record],
                   pending_use: Mapping[bytes, float] | None = None) -> list[Record]:
    """Records in the order they should be evicted (first = first to go)."""
    pending_use = pending_use or {}

    def last_touch(record: Record) -> tuple[float, float]:
        return (max(record.last_touch, pending_use.get(record.key, 0.0)), record.created)

    return sorted(records, key=last_touch)
