"""Operators' listings, page by page: ``ls`` shows its first page at once however many
entries there are, and each page continues where the last one stopped.

In the usual order (most recently used first) a page is one seek into the index's order
of last use (kvcache.ordering's ``by_use``) and a step per entry shown, reads not yet
written to the index merged in at their place; a listing by key prefix reads only the
keys with that prefix. The other orders (oldest first, largest first, most hits first)
keep no table: each of their pages reads every entry (a scan, kept to the page's size in
memory). Pages are continued by a token (the position of the last entry shown), so a
listing holds nothing in the daemon between pages; an entry used while a listing pages
on may show twice or not at all, as in any listing of a changing set
(tests/unit/test_store.py::test_a_listing_pages_in_order_with_reads_not_yet_in_the_index).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import msgpack

from ..errors import InvalidArgument
from ..index import Index
from ..ordering import record_use_key, sortable
from ..record import Record
from .core import with_usage

# How each order ranks an entry: ascending bytes, ties broken by key.
SORTS: dict[str, Callable[[Record], bytes]] = {
    "used": lambda r: _complement(record_use_key(r)),  # most recently used first
    "age": lambda r: sortable(r.created) + r.key,  # oldest first
    "size": lambda r: _descending(r.size) + r.key,  # largest first
    "tokens": lambda r: _descending(r.n_tokens) + r.key,
    "hits": lambda r: _descending(r.hits) + r.key,
}


def _complement(b: bytes) -> bytes:
    return bytes(x ^ 0xFF for x in b)


def _descending(n: int) -> bytes:
    return ((1 << 64) - 1 - max(0, min(n, (1 << 64) - 1))).to_bytes(8, "big")


@dataclass(frozen=True)
class Page:
    records: list[Record]
    next_token: bytes  # b"": nothing follows


def page(index: Index, usage: Mapping[bytes, list[float]],
         predicate: Callable[[Record], bool] | None, *, sort: str = "used",
         token: bytes = b"", limit: int = 0, key_prefix: str = "") -> Page:
    """Up to ``limit`` entries (0: all) that ``predicate`` accepts, in ``sort``'s order,
    after the position ``token`` names; ``usage`` is the reads not yet in the index
    (key -> [hits, last use])."""
    if sort not in SORTS:
        raise InvalidArgument(f"unknown sort {sort!r} (one of {', '.join(SORTS)})")
    after = _read_token(token, sort)
    rank = SORTS[sort]
    if key_prefix:
        candidates: Iterator[Record] = _sorted(_with_prefix(index, key_prefix, usage), rank)
    elif sort == "used":
        candidates = _by_use(index, usage, after)
    else:
        candidates = _scan(index, usage, predicate, rank, after, limit)
    shown: list[Record] = []
    for record in candidates:
        if after is not None and rank(record) <= after:
            continue
        if predicate is not None and not predicate(record):
            continue
        shown.append(record)
        if limit and len(shown) == limit:
            return Page(shown, msgpack.packb([sort, rank(record)]))
    return Page(shown, b"")


def _read_token(token: bytes, sort: str) -> bytes | None:
    if not token:
        return None
    try:
        token_sort, position = msgpack.unpackb(token)
    except Exception:  # anything msgpack raises on garbage
        raise InvalidArgument("malformed page token") from None
    if token_sort != sort or not isinstance(position, bytes):
        raise InvalidArgument(f"the page token is of another listing (sort {token_sort!r})")
    return position


def _sorted(records: Iterator[Record], rank: Callable[[Record], bytes]) -> Iterator[Record]:
    return iter(sorted(records, key=rank))


def _with_prefix(index: Index, key_prefix: str, usage: Mapping[bytes, list[float]]
                 ) -> Iterator[Record]:
    """The entries whose key (in hex) starts with ``key_prefix``: one seek."""
    prefix = key_prefix.lower()
    even = prefix[: len(prefix) // 2 * 2]
    try:
        start = bytes.fromhex(even)
    except ValueError:
        return  # not hex digits: no key starts so
    for record in index.records_from(start):
        if not record.key.startswith(start):
            return
        if record.key.hex().startswith(prefix):
            yield with_usage(record, usage.get(record.key))


def _by_use(index: Index, usage: Mapping[bytes, list[float]], after: bytes | None
            ) -> Iterator[Record]:
    """Every entry, most recently used first, from after ``after``: the index's order
    with the entries read since their row was written moved to where those reads put
    them."""
    rank = SORTS["used"]
    moved: list[tuple[bytes, bytes, Record]] = []
    for key, use in usage.items():
        record = index.get(key)
        if record is None:
            continue
        now = with_usage(record, use)
        if rank(now) != rank(record):
            moved.append((rank(now), key, now))
    moved.sort()
    gone = {key for _, key, _ in moved}
    start = _complement(after) if after is not None else None
    for _, record in index.records_by_use(start):
        if record.key in gone:
            continue
        record = with_usage(record, usage.get(record.key))
        position = rank(record)
        while moved and moved[0][0] < position:
            yield moved.pop(0)[2]
        yield record
    for _, _, record in moved:
        yield record


def _scan(index: Index, usage: Mapping[bytes, list[float]],
          predicate: Callable[[Record], bool] | None, rank: Callable[[Record], bytes],
          after: bytes | None, limit: int) -> Iterator[Record]:
    """Every entry read, the page's worth kept (the first ``limit`` in ``rank``'s order
    after ``after``)."""
    def wanted() -> Iterator[tuple[bytes, bytes, Record]]:
        for record in index.records():
            record = with_usage(record, usage.get(record.key))
            position = rank(record)
            if (after is None or position > after) and (predicate is None
                                                         or predicate(record)):
                yield position, record.key, record
    found = heapq.nsmallest(limit, wanted()) if limit else sorted(wanted())
    return (record for _, _, record in found)
