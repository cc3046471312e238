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

from .keys import key_under

SCHEMA_VERSION = 1
KEY_LEN = 16


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

    @classmethod
    def unpack(cls, data: bytes) -> Record:
        return cls(**msgpack.unpackb(data, raw=False))

    @property
    def last_touch(self) -> float:
        """When the entry was last useful: its last read, else its creation."""
        return max(self.last_used, self.created)


_RECORD_FIELDS = tuple(f.name for f in fields(Record))
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

    def delete(self, key: bytes) -> Record | None:
        with self.env.begin(write=True) as txn:
            data = txn.pop(key, db=self._entries)
            if data is None:
                return None
            record = Record.unpack(data)
            txn.delete(record.anchor + record.key, db=self._anchors)
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

    def count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._entries)["entries"]

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self._entries, delete=False)
            txn.drop(self._anchors, delete=False)

    def put_many(self, records: Iterable[Record]) -> None:
        with self.env.begin(write=True) as txn:
            for record in records:
                txn.put(record.key, record.pack(), db=self._entries)
                txn.put(record.anchor + record.key, record.tail, db=self._anchors)

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
                        if composite[:KEY_LEN] != anchor:
                            break
                        rows += 1
                        if rows > SCAN_LIMIT:
                            break
                        n = base + len(tail) // 4
                        if n == 0 or n > limit or n <= best_n:
                            continue
                        start = base * 4
                        if raw_tokens[start : start + len(tail)] == tail:
                            best_key, best_n = composite[KEY_LEN:], n
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
