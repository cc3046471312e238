"""The LMDB index: which entries are published, where they live, and how they are used.

Three named databases:

* ``entries``  key(16) -> msgpack record (see :class:`Record`)
* ``anchors``  anchor(16) || key(16) -> tail tokens (packed u32 LE). An entry hangs under
  the block hash of its last full block, so a longest-prefix lookup walks the prompt's
  block hashes longest first and reads the tails stored there: O(L/B) probes.
* ``meta``     index-wide settings (schema, block size)

Only published entries are ever written here; reservations live in the daemon's memory
and vanish with it. Each publish or delete is one write transaction, and LMDB's commit
is durable (``sync=True``), so an entry is either fully visible or absent after a crash.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import lmdb
import msgpack
import xxhash

from .keys import KEY_BYTES, key_under

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Record:
    key: bytes
    namespace: bytes
    anchor: bytes
    tail: bytes
    n_tokens: int
    size: int  # bytes of the blob file
    codec: str
    reason: str
    created: float
    model_name: str
    model_fingerprint: str
    tenant_id: str
    in_ram: bool = False
    hits: int = 0
    last_used: float = 0.0
    pinned: bool = False

    def pack(self) -> bytes:
        # Not dataclasses.asdict: it deep-copies every field (4x slower on rebuilds).
        return msgpack.packb({name: getattr(self, name) for name in _RECORD_FIELDS},
                             use_bin_type=True)

    def seal(self) -> bytes:
        """xxh3_64 of the fields its blob vouches for, kept in the ``seals`` database at
        publish: a row whose size, n_tokens, tail, namespace, reason... changed on disk no
        longer matches it. (Not a field: older versions reject rows with unknown fields.)"""
        return xxhash.xxh3_64_digest(
            msgpack.packb([getattr(self, name) for name in _SEALED_FIELDS], use_bin_type=True))

    @property
    def usage_ok(self) -> bool:
        return (type(self.in_ram) is bool and type(self.pinned) is bool
                and type(self.hits) is int and type(self.last_used) is float)

    @classmethod
    def unpack(cls, data: bytes) -> Record:
        return cls(**msgpack.unpackb(data, raw=False))

    @property
    def last_touch(self) -> float:
        """When the entry was last useful: its last read, else its creation."""
        return max(self.last_used, self.created)


_RECORD_FIELDS = tuple(f.name for f in fields(Record))
# What a blob's header and metadata determine; the rest (tier, usage, pin) changes in place.
_SEALED_FIELDS = tuple(name for name in _RECORD_FIELDS
                       if name not in ("in_ram", "hits", "last_used", "pinned"))
# An anchor with more rows than this is probed by key instead of scanned (see below).
SCAN_LIMIT = 32


class Index:
    def __init__(self, path: Path, *, map_size: int = 1 << 34) -> None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # map_size is an upper bound on a sparse file, not an allocation.
        self.env = lmdb.open(
            str(path), map_size=map_size, max_dbs=4, subdir=True, sync=True, metasync=True,
            readahead=False, max_readers=512, mode=0o600,
        )
        self._entries = self.env.open_db(b"entries")
        self._anchors = self.env.open_db(b"anchors")
        self._meta = self.env.open_db(b"meta")
        self._seals = self.env.open_db(b"seals")  # key -> Record.seal() (see audit)

    def close(self) -> None:
        self.env.close()

    # -- settings ---------------------------------------------------------------------------

    def get_setting(self, name: str) -> str | None:
        with self.env.begin(db=self._meta) as txn:
            value = txn.get(name.encode())
        return None if value is None else value.decode()

    def set_setting(self, name: str, value: str) -> None:
        with self.env.begin(write=True, db=self._meta) as txn:
            txn.put(name.encode(), value.encode())

    # -- entries ----------------------------------------------------------------------------

    def get(self, key: bytes) -> Record | None:
        with self.env.begin(db=self._entries) as txn:
            data = txn.get(key)
        return None if data is None else Record.unpack(data)

    def put(self, record: Record) -> None:
        """Publish (or overwrite) an entry: record and anchor in one transaction."""
        with self.env.begin(write=True) as txn:
            txn.put(record.key, record.pack(), db=self._entries)
            txn.put(record.anchor + record.key, record.tail, db=self._anchors)
            txn.put(record.key, record.seal(), db=self._seals)

    def delete(self, key: bytes) -> Record | None:
        with self.env.begin(write=True) as txn:
            data = txn.pop(key, db=self._entries)
            if data is None:
                return None
            record = Record.unpack(data)
            txn.delete(record.anchor + record.key, db=self._anchors)
            txn.delete(key, db=self._seals)
            return record

    def update(self, key: bytes, **changes: object) -> Record | None:
        with self.env.begin(write=True, db=self._entries) as txn:
            data = txn.get(key)
            if data is None:
                return None
            record = replace(Record.unpack(data), **changes)
            txn.put(key, record.pack())
            return record

    def record_usage(self, usage: Mapping[bytes, tuple[int, float]]) -> None:
        """Add hits and set last-use times for many entries in one transaction."""
        if not usage:
            return
        with self.env.begin(write=True, db=self._entries) as txn:
            for key, (hits, last_used) in usage.items():
                data = txn.get(key)
                if data is None:
                    continue
                record = Record.unpack(data)
                record = replace(record, hits=record.hits + hits,
                                 last_used=max(record.last_used, last_used))
                txn.put(key, record.pack())

    def records(self) -> Iterator[Record]:
        with self.env.begin(db=self._entries) as txn:
            for _, data in txn.cursor():
                yield Record.unpack(data)

    def audit(self) -> tuple[list[Record], dict[bytes, dict[str, object]]]:
        """Check every row without reading a blob (start-up): the records that hold
        together, and the keys of those that do not (undecodable, not matching their seal,
        filed under another key, with a missing or different anchor row), each with its
        well-typed usage fields, so that re-indexing its blob from the header keeps hits
        and pin."""
        good: list[Record] = []
        bad: dict[bytes, dict[str, object]] = {}
        with self.env.begin() as txn:
            for key, data in txn.cursor(db=self._entries):
                try:
                    raw = msgpack.unpackb(data, raw=False)
                    # Every field, as pack() writes them: a missing one would take a default.
                    if set(raw) != set(_RECORD_FIELDS):
                        raise ValueError(f"fields {sorted(raw)}")
                    record = Record(**raw)
                except Exception:  # garbled bytes: msgpack and the constructor raise many types
                    bad[key] = {}
                    continue
                # (A row an older version published has no seal: re-indexed, usage kept.)
                if (record.usage_ok and record.key == key
                        and txn.get(key, db=self._seals) == record.seal()
                        and txn.get(record.anchor + key, db=self._anchors) == record.tail):
                    good.append(record)
                    continue
                usage = {"hits": record.hits, "last_used": record.last_used,
                         "pinned": record.pinned}
                bad[key] = {k: v for k, v in usage.items()
                            if type(v) is type(getattr(Record, k))}
        return good, bad

    def drop_rows(self, keys_: Iterable[bytes]) -> None:
        """Delete entry rows without decoding them, then every anchor row left pointing at
        no entry (a garbled row's anchor cannot be read back; a stale anchor row would
        shadow the valid entries under the same anchor in longest_prefix)."""
        with self.env.begin(write=True) as txn:
            for key in keys_:
                txn.delete(key, db=self._entries)
                txn.delete(key, db=self._seals)
            orphans = [composite for composite, _ in txn.cursor(db=self._anchors)
                       if txn.get(composite[KEY_BYTES:], db=self._entries) is None]
            for composite in orphans:
                txn.delete(composite, db=self._anchors)

    def count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._entries)["entries"]

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self._entries, delete=False)
            txn.drop(self._anchors, delete=False)
            txn.drop(self._seals, delete=False)

    def put_many(self, records: Iterable[Record]) -> None:
        with self.env.begin(write=True) as txn:
            for record in records:
                txn.put(record.key, record.pack(), db=self._entries)
                txn.put(record.anchor + record.key, record.tail, db=self._anchors)
                txn.put(record.key, record.seal(), db=self._seals)

    # -- lookup -----------------------------------------------------------------------------

    def longest_prefix(self, hashes: list[bytes], raw_tokens: bytes, block_size: int,
                       max_tokens: int = 0) -> tuple[Record | None, int]:
        """The longest published entry whose tokens are a prefix of ``raw_tokens``.

        ``hashes`` are the block hashes of ``raw_tokens`` (``hashes[0]`` the namespace).
        Entries under ``hashes[k]`` hold between k*B and k*B+B-1 tokens, so the first
        anchor (walking down) with a matching tail holds the answer. Returns the record
        and the number of anchors probed.
        """
        n_query = len(raw_tokens) // 4
        limit = min(n_query, max_tokens) if max_tokens else n_query
        probes = 0
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self._anchors)
            for k in range(len(hashes) - 1, -1, -1):
                base = k * block_size
                if base > limit:
                    continue
                probes += 1
                anchor = hashes[k]
                best_key, best_n = None, -1
                rows = 0
                if cursor.set_range(anchor):
                    for composite, tail in cursor:
                        if composite[:KEY_BYTES] != anchor:
                            break
                        rows += 1
                        if rows > SCAN_LIMIT:
                            break
                        n = base + len(tail) // 4
                        if n == 0 or n > limit or n <= best_n:
                            continue
                        start = base * 4
                        if raw_tokens[start : start + len(tail)] == tail:
                            best_key, best_n = composite[KEY_BYTES:], n
                if rows > SCAN_LIMIT:
                    # Many entries share this block (e.g. thousands of short prompts):
                    # instead of reading them all, try the at most B keys the query could
                    # match here, longest first.
                    best_key = self._probe_tails(txn, anchor, raw_tokens, base,
                                                 min(block_size - 1, limit - base))
                if best_key is not None:
                    data = txn.get(best_key, db=self._entries)
                    if data is not None:
                        return Record.unpack(data), probes
        return None, probes

    def _probe_tails(self, txn: lmdb.Transaction, anchor: bytes, raw_tokens: bytes,
                     base: int, max_tail: int) -> bytes | None:
        start = base * 4
        for t in range(max_tail, -1, -1):
            if base + t == 0:
                break
            key = key_under(anchor, raw_tokens[start : start + 4 * t])
            if txn.get(key, db=self._entries) is not None:
                return key
        return None


def dir_fsync(path: Path) -> None:
    """fsync a directory so a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
