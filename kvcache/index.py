"""The LMDB index: which entries are published, where they live, and how they are used.

Six named databases:

* ``entries``  key(16) -> msgpack record (see :class:`Record`)
* ``anchors``  anchor(16) || key(16) -> tail tokens (packed u32 LE). An entry hangs under
  the block hash of its last full block, so a longest-prefix lookup walks the prompt's
  block hashes longest first and reads the tails stored there: O(L/B) probes.
* ``passes``   h_k(16) || key(16) -> the entry's block k+1 (B tokens, packed u32 LE), for
  every full block an entry goes *through* (k < n_tokens // B). With the anchors they
  answer a longest-*common*-prefix lookup: the deepest block hash of the prompt with any
  row names the entries sharing the prompt up to there, and the tokens stored with each
  row say how far into the next block each one goes on agreeing.
* ``entry_passes`` key(16) -> the hashes it has ``passes`` rows under, so a delete finds them
* ``seals``    key(16) -> :meth:`Record.seal` (see :meth:`Index.audit`)
* ``meta``     index-wide settings (schema, block size, the clean-shutdown record)

and the tables of kvcache.ordering (which entry is built on which, the order of last use
and each tier's eviction order), changed in the same transactions as the entry rows.

An entry may be a *piece*: its record names the ``parent`` entry whose chain holds its
first ``base`` tokens. A piece is published only in a transaction that finds its parent
published (:class:`ParentGone` otherwise), and removed no later than its parent (the
store removes an entry together with what is built on it, :meth:`Index.delete_many`).

Only published entries are ever written here; reservations live in the daemon's memory
and vanish with it. Each publish or delete is one write transaction, and LMDB's commit
is durable (``sync=True``), so an entry is either fully visible or absent after a crash.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from .common import make_private_dirs
from .keys import KEY_BYTES, common_prefix_tokens, key_under
from .ordering import TABLES as ORDER_TABLES
from .ordering import OrderTables
from .record import Record

# 2: the passes databases. Entries without passes rows (a version-1 index) get them from
# their blob headers at start-up (store.reconcile.Reconcile), every other row kept as it is.
# 3: the ordering tables, built from the entry rows at the first start-up that lacks them.
SCHEMA_VERSION = 3


_CLEAN = b"clean_shutdown"


class ParentGone(LookupError):
    """A piece's parent entry is not (or no longer) published."""
# An anchor with more rows than this is probed by key instead of scanned (see below).
SCAN_LIMIT = 32


class Index:
    def __init__(self, path: Path, *, map_size: int = 1 << 34) -> None:
        make_private_dirs(path)
        # map_size is an upper bound on a sparse file, not an allocation.
        self.env = lmdb.open(
            str(path), map_size=map_size, max_dbs=6 + len(ORDER_TABLES), subdir=True,
            sync=True, metasync=True, readahead=False, max_readers=512, mode=0o600,
        )
        # The last transaction before this process wrote anything (the clean-shutdown
        # record names the last one it wrote: equal, nobody else wrote since).
        self.opened_txnid: int = self.env.info()["last_txnid"]
        self._entries = self.env.open_db(b"entries")
        self._anchors = self.env.open_db(b"anchors")
        self._meta = self.env.open_db(b"meta")
        self._seals = self.env.open_db(b"seals")  # key -> Record.seal() (see audit)
        self._passes = self.env.open_db(b"passes")
        self._entry_passes = self.env.open_db(b"entry_passes")
        self.order = OrderTables(self.env, self._entries, self._meta, Record.unpack)

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
        data = self.row(key)
        return None if data is None else Record.unpack(data)

    def row(self, key: bytes) -> bytes | None:
        """The entry's packed row (Record.unpack reads it), None when there is none."""
        with self.env.begin(db=self._entries) as txn:
            return txn.get(key)

    def put(self, record: Record, passes: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Publish (or overwrite) an entry: record, anchor and passes in one transaction.
        ``passes`` are ``(h_k, block k+1)`` for the blocks it goes through (keys.passes)."""
        with self.env.begin(write=True) as txn:
            self._put_rows(txn, record, passes)

    def _put_rows(self, txn: lmdb.Transaction[bytes], record: Record,
                  passes: Sequence[tuple[bytes, bytes]]) -> None:
        # In the publishing transaction: a piece is never visible without its parent.
        if record.parent and txn.get(record.parent, db=self._entries) is None:
            raise ParentGone(f"parent {record.parent.hex()} of {record.key.hex()} is gone")
        self._write_record(txn, record)
        if passes:
            self._put_passes(txn, record.key, passes)

    def _write_record(self, txn: lmdb.Transaction[bytes], record: Record) -> None:
        """An entry's own rows, and the ordering tables following them."""
        old = txn.get(record.key, db=self._entries)
        txn.put(record.key, record.pack(), db=self._entries)
        txn.put(record.anchor + record.key, record.tail, db=self._anchors)
        txn.put(record.key, record.seal(), db=self._seals)
        if old is None:
            self.order.added(txn, record)
        else:
            self.order.changed(txn, Record.unpack(old), record)

    def _put_passes(self, txn: lmdb.Transaction[bytes], key: bytes,
                    passes: Sequence[tuple[bytes, bytes]]) -> None:
        for block_hash, block in passes:
            txn.put(block_hash + key, block, db=self._passes)
        txn.put(key, b"".join(h for h, _ in passes), db=self._entry_passes)

    def _delete_passes(self, txn: lmdb.Transaction[bytes], key: bytes) -> None:
        hashes = txn.pop(key, db=self._entry_passes) or b""
        for i in range(0, len(hashes), KEY_BYTES):
            txn.delete(hashes[i : i + KEY_BYTES] + key, db=self._passes)

    def delete_many(self, keys_: Sequence[bytes]) -> list[Record]:
        """Delete several entries in one transaction (an entry and the pieces built on it:
        none stays visible without the other). Returns the records that were there."""
        removed = []
        with self.env.begin(write=True) as txn:
            for key in keys_:
                data = txn.pop(key, db=self._entries)
                if data is None:
                    continue
                record = Record.unpack(data)
                txn.delete(record.anchor + record.key, db=self._anchors)
                txn.delete(key, db=self._seals)
                self._delete_passes(txn, key)
                removed.append(record)
            self.order.removed(txn, removed)
        return removed

    def shares_prefix(self, key: bytes, hashes: Sequence[bytes], raw_tokens: bytes,
                      n_shared: int, block_size: int) -> bool:
        """Whether entry ``key`` holds the first ``n_shared`` tokens of ``raw_tokens``
        (``hashes`` their block hashes): it has a row under the hash of block k = n_shared
        // B (every entry has one under each block hash it shares), and that row's next
        tokens agree with the query for the rest. Two reads, no blob."""
        k, rest = divmod(n_shared, block_size)
        if k >= len(hashes):
            return False
        want = raw_tokens[k * block_size * 4 : (k * block_size + rest) * 4]
        with self.env.begin() as txn:
            for db in (self._passes, self._anchors):
                tokens = txn.get(hashes[k] + key, db=db)
                if tokens is not None and tokens[: len(want)] == want and len(tokens) >= len(want):
                    return True
        return False

    def entry_blocks(self, key: bytes) -> list[tuple[bytes, bytes]] | None:
        """``(h_{k-1}, block k)`` for each full block k of entry ``key``, in order (its passes
        rows: what KV events publish of it); None when it is not published."""
        with self.env.begin() as txn:
            if txn.get(key, db=self._entries) is None:
                return None
            hashes = txn.get(key, db=self._entry_passes) or b""
            return [(hashes[i : i + KEY_BYTES],
                     txn.get(hashes[i : i + KEY_BYTES] + key, db=self._passes) or b"")
                    for i in range(0, len(hashes), KEY_BYTES)]

    def lacking_passes(self, keys_: Iterable[bytes]) -> set[bytes]:
        """Which of these entries have no passes rows (one read transaction)."""
        with self.env.begin(db=self._entry_passes) as txn:
            return {key for key in keys_ if txn.get(key) is None}

    def add_passes(self, items: Iterable[tuple[bytes, Sequence[tuple[bytes, bytes]]]]) -> None:
        """Add the passes rows of published entries, leaving their entry rows alone."""
        with self.env.begin(write=True) as txn:
            for key, passes in items:
                if txn.get(key, db=self._entries) is not None:
                    self._put_passes(txn, key, passes)

    def update(self, key: bytes, **changes: Any) -> Record | None:
        with self.env.begin(write=True, db=self._entries) as txn:
            data = txn.get(key)
            if data is None:
                return None
            old = Record.unpack(data)
            record = replace(old, **changes)
            txn.put(key, record.pack())
            self.order.changed(txn, old, record)
            return record

    def update_many(self, keys_: Iterable[bytes], **changes: Any) -> list[Record]:
        """:meth:`update` for many entries in one transaction; the records changed (those
        still published)."""
        changed = []
        with self.env.begin(write=True, db=self._entries) as txn:
            for key in keys_:
                data = txn.get(key)
                if data is None:
                    continue
                old = Record.unpack(data)
                record = replace(old, **changes)
                txn.put(key, record.pack())
                self.order.changed(txn, old, record)
                changed.append(record)
        return changed

    def record_usage(self, usage: Mapping[bytes, tuple[int, float]]) -> None:
        """Add hits and set last-use times for many entries in one transaction."""
        if not usage:
            return
        with self.env.begin(write=True, db=self._entries) as txn:
            for key, (hits, last_used) in usage.items():
                data = txn.get(key)
                if data is None:
                    continue
                old = Record.unpack(data)
                record = replace(old, hits=old.hits + hits,
                                 last_used=max(old.last_used, last_used))
                txn.put(key, record.pack())
                self.order.changed(txn, old, record)

    def records(self) -> Iterator[Record]:
        with self.env.begin(db=self._entries) as txn:
            for _, data in txn.cursor():
                yield Record.unpack(data)

    def keys(self) -> Iterator[bytes]:
        """Every entry's key (no row decoded)."""
        with self.env.begin(db=self._entries) as txn:
            yield from txn.cursor().iternext(values=False)

    def iter_keys(self, batch: int = 1000) -> Iterator[bytes]:
        """Every entry's key, in key order, read a batch at a time (one short read
        transaction each: a slow consumer pins no old snapshot of the index)."""
        start = b""
        while True:
            with self.env.begin(db=self._entries) as txn:
                cursor = txn.cursor()
                got: list[bytes] = []
                if cursor.set_range(start):
                    for key in cursor.iternext(values=False):
                        got.append(key)
                        if len(got) == batch:
                            break
            yield from got
            if len(got) < batch:
                return
            start = got[-1] + b"\x00"  # the first key after it

    def records_by_use(self, after: bytes | None = None) -> Iterator[tuple[bytes, Record]]:
        """``(use key, record)``, most recently used first (reads not yet written to the
        index aside), starting below ``after`` when given: one seek, then a row a step."""
        with self.env.begin() as txn:
            for use in self.order.by_use(txn, after=after):
                data = txn.get(use[-KEY_BYTES:], db=self._entries)
                if data is not None:
                    yield use, Record.unpack(data)

    def records_from(self, start: bytes = b"") -> Iterator[Record]:
        """Records in key order from the first key >= ``start`` (one seek)."""
        with self.env.begin(db=self._entries) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return
            for _, data in cursor:
                yield Record.unpack(data)

    def children(self, key: bytes) -> list[bytes]:
        """The published entries built directly on ``key``."""
        with self.env.begin() as txn:
            return self.order.children(txn, key)

    def rebuild_order(self, progress: Callable[[int], None] | None = None) -> None:
        """Fill the ordering tables from the entry rows (see OrderTables.rebuild)."""
        self.order.rebuild(self.records(), progress)

    # -- clean shutdown ---------------------------------------------------------------------

    def mark_clean(self, state: Mapping[str, object]) -> None:
        """Record a clean shutdown: ``state`` (what the store cannot read back cheaply)
        with the id of this, the last, write transaction."""
        with self.env.begin(write=True, db=self._meta) as txn:
            txn.put(_CLEAN, msgpack.packb({**state, "txnid": txn.id()}, use_bin_type=True))

    def clean_shutdown(self) -> dict[str, object] | None:
        """What :meth:`mark_clean` recorded, when no transaction has written to the index
        since (not even another process: LMDB counts every write transaction); None
        otherwise."""
        with self.env.begin(db=self._meta) as txn:
            data = txn.get(_CLEAN)
        if data is None:
            return None
        try:
            state = msgpack.unpackb(data, raw=False)
        except Exception:  # garbled: as good as none
            return None
        if not isinstance(state, dict) or state.get("txnid") != self.opened_txnid:
            return None
        return state

    def has_shutdown_record(self) -> bool:
        """Whether a clean-shutdown record is there, current or not (none: the last
        daemon on this index was killed, or never shut down cleanly)."""
        with self.env.begin(db=self._meta) as txn:
            return txn.get(_CLEAN) is not None

    def mark_open(self) -> None:
        """Forget the clean-shutdown record: from now on a crash is possible."""
        with self.env.begin(write=True, db=self._meta) as txn:
            txn.delete(_CLEAN)

    def audit(self, start: bytes = b"", stop: bytes | None = None
              ) -> tuple[list[Record], dict[bytes, dict[str, Any]]]:
        """Check every row (of the keys from ``start`` up to ``stop``, when given) without
        reading a blob: the records that hold together, and the keys of those that do not
        (undecodable, not matching their seal, filed under another key, with a missing or
        different anchor row), each with its well-typed usage fields, so that re-indexing
        its blob from the header keeps hits and pin."""
        good: list[Record] = []
        bad: dict[bytes, dict[str, Any]] = {}  # field -> a value of its type
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self._entries)
            found = cursor.set_range(start)
            for key, data in cursor if found else ():
                if stop is not None and key >= stop:
                    break
                try:
                    raw = msgpack.unpackb(data, raw=False)
                    # Every field, as pack() writes them: a missing one would take a default.
                    record = Record(**raw)
                    if set(raw) != set(record._fields()):
                        raise ValueError(f"fields {sorted(raw)}")
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
                         "pinned": record.pinned, "pin_expires": record.pin_expires}
                bad[key] = {k: v for k, v in usage.items()
                            if type(v) is type(getattr(Record, k))}
        return good, bad

    def drop_rows(self, keys_: Iterable[bytes]) -> None:
        """Delete entry rows without decoding them, then every anchor row left pointing at
        no entry (a garbled row's anchor cannot be read back; a stale anchor row would
        shadow the valid entries under the same anchor in longest_prefix)."""
        with self.env.begin(write=True) as txn:
            self.order.invalidate(txn)  # rows it cannot decode: rebuilt (Reconcile does)
            for key in keys_:
                txn.delete(key, db=self._entries)
                txn.delete(key, db=self._seals)
                self._delete_passes(txn, key)
            for db in (self._anchors, self._passes):
                orphans = [composite for composite, _ in txn.cursor(db=db)
                           if txn.get(composite[KEY_BYTES:], db=self._entries) is None]
                for composite in orphans:
                    txn.delete(composite, db=db)

    def count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._entries)["entries"]

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self._entries, delete=False)
            txn.drop(self._anchors, delete=False)
            txn.drop(self._seals, delete=False)
            txn.drop(self._passes, delete=False)
            txn.drop(self._entry_passes, delete=False)
            self.order.cleared(txn)

    def put_many(self, records: Iterable[Record]) -> None:
        """Rewrite rows of published entries (their passes rows stay as they are)."""
        with self.env.begin(write=True) as txn:
            for record in records:
                self._write_record(txn, record)

    def publish_many(self, items: Iterable[tuple[Record, Sequence[tuple[bytes, bytes]]]]
                     ) -> None:
        """:meth:`put` for many entries in one transaction (start-up re-indexing)."""
        with self.env.begin(write=True) as txn:
            for record, passes in items:
                self._put_rows(txn, record, passes)

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

    def _probe_tails(self, txn: lmdb.Transaction[bytes], anchor: bytes, raw_tokens: bytes,
                     base: int, max_tail: int) -> bytes | None:
        start = base * 4
        for t in range(max_tail, -1, -1):
            if base + t == 0:
                break
            key = key_under(anchor, raw_tokens[start : start + 4 * t])
            if txn.get(key, db=self._entries) is not None:
                return key
        return None


    def longest_common_prefix(self, hashes: list[bytes], raw_tokens: bytes, block_size: int,
                              max_tokens: int = 0) -> tuple[Record | None, int, int]:
        """The published entry sharing the most leading tokens with ``raw_tokens``, also
        one that is longer than the query or diverges from it. Returns the record, the
        number of tokens shared (at most ``max_tokens`` when given) and the probes made.

        Where an entry shares h_k with the query it has a row under h_k: in ``anchors``
        when it ends within block k+1, in ``passes`` when it goes through it. Those rows
        exist for every k up to the entry's last block, so the deepest k with any row is
        found by binary search, and the answer is among that k's rows: each row's tokens
        say how far into block k+1 its entry agrees with the query. Of the entries that
        share as much, the smallest wins (the fewest bytes to load). Where more than
        SCAN_LIMIT entries end within block k+1, or more than SCAN_LIMIT go through it,
        the first SCAN_LIMIT of each and the entries the query could match exactly there
        are judged: the answer may then fall short of the best by less than a block.
        """
        n_query = len(raw_tokens) // 4
        limit = min(n_query, max_tokens) if max_tokens else n_query
        probes = 0
        with self.env.begin() as txn:
            anchors = txn.cursor(db=self._anchors)
            passes = txn.cursor(db=self._passes)

            def rows(cursor: lmdb.Cursor[bytes], k: int) -> Iterator[tuple[bytes, bytes]]:
                if cursor.set_range(hashes[k]):
                    for composite, tokens in cursor:
                        if composite[:KEY_BYTES] != hashes[k]:
                            break
                        yield composite[KEY_BYTES:], tokens

            def present(k: int) -> bool:
                nonlocal probes
                probes += 1
                return any(next(rows(c, k), None) is not None for c in (anchors, passes))

            lo, hi = -1, len(hashes) - 1  # rows exist under hashes[lo] (-1: none anywhere)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if present(mid):
                    lo = mid
                else:
                    hi = mid - 1
            for k in range(lo, -1, -1):  # further down only past max_tokens or vanished rows
                base = k * block_size
                if base > limit:
                    continue
                best_keys: list[bytes] = []
                best_n = 0
                crowded = False
                nxt = raw_tokens[base * 4 : (base + block_size) * 4]
                # Entries ending within the next block, then those going through it: each
                # scanned up to SCAN_LIMIT rows, so neither crowds the other out.
                for cursor in (anchors, passes):
                    for scanned, (key, tokens) in enumerate(rows(cursor, k)):
                        if scanned == SCAN_LIMIT:
                            crowded = True
                            break
                        shared = min(base + common_prefix_tokens(tokens, nxt), limit)
                        if shared > best_n:
                            best_keys, best_n = [key], shared
                        elif shared == best_n and shared:
                            best_keys.append(key)
                if crowded:  # an exact prefix of the query ending here is still found
                    exact = self._probe_tails(txn, hashes[k], raw_tokens, base,
                                              min(block_size - 1, limit - base))
                    data = None if exact is None else txn.get(exact, db=self._entries)
                    if exact is not None and data is not None \
                            and Record.unpack(data).n_tokens > best_n:
                        best_keys, best_n = [exact], Record.unpack(data).n_tokens
                # Of those sharing as much, the smallest: the fewest bytes to load.
                records = [Record.unpack(data) for data in
                           (txn.get(key, db=self._entries) for key in best_keys) if data]
                if records:
                    return min(records, key=lambda r: r.size), best_n, probes
        return None, 0, probes



def dir_fsync(path: Path) -> None:
    """fsync a directory so a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
