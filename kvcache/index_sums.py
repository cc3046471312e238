"""Sums kept in the index with the eviction order (kvcache.ordering files every entry
through here): what each tenant's entries hold in each tier, and the entries whose pin
ends at a time, by that time.

They change in the write transaction of the entry rows they describe, so after a crash at
any instant they are what the rows say: a start-up after a kill takes the byte tally from
them instead of reading every row (kvcache.store.recovery), and the expiring pins are
found without a scan of the entries (kvcache.store.entries.ExpiringPins).

* rows in ``meta``: ``order.usage.<tenant label>`` -> five u64 (disk bytes, disk entries,
  logical bytes, RAM bytes, RAM entries) for every tenant holding anything (entries
  without a tenant: the label "")
* ``pin_ends``: sortable end time || key -> b"" for every entry pinned until a time

Pure bookkeeping on a transaction: no state of its own, no lock.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lmdb

from .keys import KEY_BYTES

USAGE_PREFIX = b"order.usage."
_USAGE = struct.Struct(">5Q")
PIN_ENDS = "pin_ends"  # the table's name, among kvcache.ordering's TABLES


@dataclass(frozen=True)
class Usage:
    """What one tenant's entries hold, as the sums have it."""

    disk_bytes: int = 0
    disk_entries: int = 0
    logical_bytes: int = 0
    ram_bytes: int = 0
    ram_entries: int = 0

    def pack(self) -> bytes:
        return _USAGE.pack(self.disk_bytes, self.disk_entries, self.logical_bytes,
                           self.ram_bytes, self.ram_entries)

    def plus(self, other: Usage, sign: int) -> Usage:
        # Never below 0: an entry left out of a rebuild was never counted.
        return Usage(*(max(0, a + sign * b) for a, b in zip(self.fields(), other.fields(),
                                                              strict=True)))

    def fields(self) -> tuple[int, int, int, int, int]:
        return (self.disk_bytes, self.disk_entries, self.logical_bytes, self.ram_bytes,
                self.ram_entries)


def entry_usage(size: int, logical: int, in_ram: bool) -> Usage:
    """What one entry adds to its tenant's sums."""
    return Usage(size, 1, logical, size if in_ram else 0, int(in_ram))


def add_usage(txn: lmdb.Transaction[bytes], meta: lmdb._Database, tenant_id: str,
              usage: Usage, sign: int) -> None:
    """Add (``sign`` 1) or take away (-1) ``usage`` from ``tenant_id``'s sums; a tenant
    left holding nothing has no row."""
    name = USAGE_PREFIX + tenant_id.encode()
    row = txn.get(name, db=meta)
    now = (Usage(*_USAGE.unpack(row)) if row else Usage()).plus(usage, sign)
    if any(now.fields()):
        txn.put(name, now.pack(), db=meta)
    else:
        txn.delete(name, db=meta)


def tenant_usage(txn: lmdb.Transaction[bytes], meta: lmdb._Database) -> dict[str, Usage]:
    """Every tenant's sums (tenants holding nothing have none)."""
    out: dict[str, Usage] = {}
    cursor = txn.cursor(db=meta)
    if cursor.set_range(USAGE_PREFIX):
        for name, row in cursor:
            if not name.startswith(USAGE_PREFIX):
                break
            out[name[len(USAGE_PREFIX):].decode()] = Usage(*_USAGE.unpack(row))
    return out


def clear_usage(txn: lmdb.Transaction[bytes], meta: lmdb._Database) -> None:
    names = []
    cursor = txn.cursor(db=meta)
    if cursor.set_range(USAGE_PREFIX):
        for name in cursor.iternext(values=False):
            if not name.startswith(USAGE_PREFIX):
                break
            names.append(name)
    for name in names:
        txn.delete(name, db=meta)


def pin_end_keys(txn: lmdb.Transaction[bytes], pin_ends: lmdb._Database
                 ) -> Iterator[bytes]:
    """The keys of the entries pinned until a time, soonest end first."""
    for row in txn.cursor(db=pin_ends).iternext(values=False):
        yield row[-KEY_BYTES:]
