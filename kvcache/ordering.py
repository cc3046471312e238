"""The eviction order, kept in the index: which entries are built on which, the order of
last use, and what each tier gives up first when it is full, in kvcache.store.policy's order,
maintained as entries come, go and are used instead of sorted anew for every save.

The tables live in the index's LMDB environment and change in the same write transaction
as the entry rows they describe (kvcache.index.Index calls in), so they agree with the
entries after a crash at any instant, and a start-up after a clean shutdown reads none of
them (tests/unit/test_ordering.py holds each table against a full sort after random changes).

* ``children``  parent(16) || child(16) -> b""
* ``by_use``    use key -> b"" for every entry (``ls``, most recently used first)
* ``leaves``    use key -> b"" for the entries nothing is built on that are not pinned:
  the disk tier's candidates, least recently used first
* ``tree``      key -> subtree key (32) || depth (u32) || pinned below (u32) || children
  (u32), for every entry
* ``kids``      parent(16) || subtree key of the child (32) || child(16) -> b"": the
  largest subtree key among an entry's children, in one seek
* ``ram_order`` subtree key || ~depth (u32) || key -> b"" for the RAM copies of entries
  neither pinned nor built on by a pinned entry
* ``ram_tail``  use key -> b"" for the RAM copies of entries a pinned entry is built on
* ``ram_keys``  key -> b"" for every entry with a RAM copy
* ``tenant_leaves``, ``tenant_ram_order``, ``tenant_ram_tail``: ``leaves``, ``ram_order``
  and ``ram_tail`` again, each row behind its entry's *tenant prefix* (16 bytes of its
  tenant label's hash): one tenant's own order is a range of its own, so a tenant at its
  quota finds its next victim in O(log n), never walking past other tenants' entries (a
  tenant's pieces are built only on its own entries: its tree is its own)
* rows in ``meta``: the bytes that can never be evicted from disk (pinned entries and what
  they are built on) and the bytes of pinned entries' RAM copies; and, with the
  ``pin_ends`` table, the sums of kvcache.index_sums (each tenant's bytes per tier, the
  expiring pins by end)

A *use key* is the entry's last touch (policy.eviction_order's), its creation time and its
key, each packed so that byte order is numeric order: a cursor walks entries in exactly
the order the full sort gives (ties broken by key, as the index iterates). An entry's
*subtree key* is the largest use key in the subtree it roots. policy.leaf_first_order
takes leaves one at a time, a parent once its last child has gone; that order is the
order of (subtree key, deepest first) (a parent goes right after the most recently used
entry below it), which is what ``ram_order`` is keyed by. Entries a pinned entry is built
on follow in ``ram_tail``, by their own last use, as Evictor's RAM order has them.

What is not in the index (holds on entries being read or copied, reads not yet written to
the index) is small and lives in the daemon's memory: the victim iterators here take it
as arguments and merge it in (held entries are skipped, an entry read since its row was
written is moved to where its new use key puts it).

Each change costs O(depth x log n): an entry's change of last use or pin reaches up the
chain it is built on (and stops where nothing changes), never across the tier.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, replace

import lmdb
import xxhash

from . import index_sums
from .index_sums import PIN_ENDS, Usage, entry_usage
from .keys import KEY_BYTES
from .record import Record

USE_BYTES = 16 + KEY_BYTES  # last touch, created, key
_TREE = struct.Struct(">32sIII")  # subtree key, depth, pinned entries below, children
_U64 = struct.Struct(">Q")
_DEPTH_MAX = 0xFFFF_FFFF
_SIGN = 1 << 63
_ALL = (1 << 64) - 1

TABLES = ("children", "by_use", "leaves", "tree", "kids", "ram_order", "ram_tail",
          "ram_keys", "tenant_leaves", "tenant_ram_order", "tenant_ram_tail", PIN_ENDS)
_PROTECTED = b"order.protected_bytes"
_PINNED_RAM = b"order.pinned_ram_bytes"
_IN_SYNC = b"order.in_sync"
# The tables' version, kept in the _IN_SYNC row: tables of another version (1: before
# the tenant tables and the sums) are rebuilt from the rows at start-up.
_VERSION = b"2"
TENANT_PREFIX_BYTES = 16


def tenant_prefix(tenant_id: str) -> bytes:
    """The fixed-length prefix of a tenant's rows in the tenant tables."""
    return xxhash.xxh3_128_digest(tenant_id.encode())


def sortable(x: float) -> bytes:
    """``x`` as 8 bytes whose byte order is numeric order (-0.0 counts as 0.0)."""
    bits = _U64.unpack(struct.pack(">d", x + 0.0))[0]
    return _U64.pack(bits ^ _ALL if bits & _SIGN else bits | _SIGN)


def use_key(last_touch: float, created: float, key: bytes) -> bytes:
    """The position of an entry in the order of last use (policy.eviction_order's)."""
    return sortable(last_touch) + sortable(created) + key


def record_use_key(record: Record, pending: float = 0.0) -> bytes:
    """``record``'s use key, with a read not yet written to the index (``pending``)."""
    return use_key(max(record.last_touch, pending), record.created, record.key)


def touched(use: bytes, pending: float | None) -> bytes:
    """A use key moved to a read at ``pending`` (unchanged when the read is not later)."""
    if pending is None:
        return use
    return max(use, sortable(pending) + use[8:])


@dataclass(frozen=True)
class _Node:
    """An entry as the tables file it."""

    key: bytes
    parent: bytes
    size: int
    pinned: bool
    in_ram: bool
    use: bytes
    subtree: bytes  # the largest use key in the subtree this entry roots
    depth: int
    pinned_below: int  # pinned entries built on it, directly or not
    kids: int  # entries built directly on it
    tenant_id: str
    logical: int  # Record.logical_size
    pin_expires: float

    @property
    def protected(self) -> bool:
        """Never evicted from disk while so: pinned, or a pinned entry is built on it."""
        return self.pinned or self.pinned_below > 0

    @property
    def usage(self) -> Usage:
        return entry_usage(self.size, self.logical, self.in_ram)


def _node_of(record: Record, use: bytes, subtree: bytes, depth: int, below: int,
             kids: int) -> _Node:
    return _Node(record.key, record.parent, record.size, record.pinned, record.in_ram, use,
                 subtree, depth, below, kids, record.tenant_id, record.logical_size,
                 record.pin_expires if record.pinned else 0.0)


class OrderTables:
    """The tables above, for one Index. Called with the index's transactions: every
    change inside the write transaction of the entry rows it follows. Not thread-safe
    beyond what LMDB gives (one writer at a time, readers on snapshots)."""

    def __init__(self, env: lmdb.Environment, entries: lmdb._Database, meta: lmdb._Database,
                 unpack: Callable[[bytes], Record]) -> None:
        self._env = env
        self._entries = entries
        self._meta = meta
        self._unpack = unpack
        self._db = {name: env.open_db(name.encode()) for name in TABLES}
        with env.begin(write=True) as txn:
            if txn.stat(entries)["entries"] == 0 and txn.get(_IN_SYNC, db=meta) != _VERSION:
                self._clear(txn)  # a new index: empty tables describe it
        with env.begin() as txn:
            self.in_sync = txn.get(_IN_SYNC, db=meta) == _VERSION

    # -- reading ----------------------------------------------------------------------------

    def _record(self, txn: lmdb.Transaction[bytes], key: bytes) -> Record | None:
        data = txn.get(key, db=self._entries)
        return None if data is None else self._unpack(data)

    def _count_kids(self, txn: lmdb.Transaction[bytes], key: bytes) -> int:
        return len(self.children(txn, key))

    def _max_kid(self, txn: lmdb.Transaction[bytes], key: bytes) -> bytes:
        """The largest subtree key among ``key``'s children (b"" without children): the
        last row with its prefix, the one before the first row past it."""
        cursor = txn.cursor(db=self._db["kids"])
        past = _next_prefix(key)
        found = cursor.prev() if past and cursor.set_range(past) else cursor.last()
        row = cursor.key() if found else b""
        return row[KEY_BYTES : KEY_BYTES + USE_BYTES] if row[:KEY_BYTES] == key else b""

    def _node(self, txn: lmdb.Transaction[bytes], record: Record) -> _Node:
        """``record`` as filed: its tree row, its use key as the row it was filed with
        (``record``) says; defaults for one not filed yet."""
        row = txn.get(record.key, db=self._db["tree"])
        use = record_use_key(record)
        if row:
            subtree, depth, below, kids = _TREE.unpack(row)
        else:
            subtree, depth, below, kids = use, 0, 0, self._count_kids(txn, record.key)
        return _node_of(record, use, subtree, depth, below, kids)

    def children(self, txn: lmdb.Transaction[bytes], key: bytes) -> list[bytes]:
        cursor = txn.cursor(db=self._db["children"])
        out = []
        if cursor.set_range(key):
            for row in cursor.iternext(values=False):
                if row[:KEY_BYTES] != key:
                    break
                out.append(row[KEY_BYTES:])
        return out

    def _sum(self, txn: lmdb.Transaction[bytes], name: bytes) -> int:
        value = txn.get(name, db=self._meta)
        return _U64.unpack(value)[0] if value else 0

    def _add(self, txn: lmdb.Transaction[bytes], name: bytes, delta: int) -> None:
        if not delta:
            return
        # Never below 0: an entry left out of a rebuild was never counted.
        total = max(0, self._sum(txn, name) + delta)
        if total:
            txn.put(name, _U64.pack(total), db=self._meta)
        else:
            txn.delete(name, db=self._meta)

    # -- filing -----------------------------------------------------------------------------

    def _file(self, txn: lmdb.Transaction[bytes], n: _Node, sums: bool = True) -> None:
        db = self._db
        tenant = tenant_prefix(n.tenant_id)
        txn.put(n.key, _TREE.pack(n.subtree, n.depth, n.pinned_below, n.kids), db=db["tree"])
        txn.put(n.use, b"", db=db["by_use"])
        if n.parent:
            txn.put(n.parent + n.subtree + n.key, b"", db=db["kids"])
        if not n.kids and not n.pinned:
            txn.put(n.use, b"", db=db["leaves"])
            txn.put(tenant + n.use, b"", db=db["tenant_leaves"])
        if n.in_ram:
            txn.put(n.key, b"", db=db["ram_keys"])
            if not n.pinned:
                if n.pinned_below:
                    txn.put(n.use, b"", db=db["ram_tail"])
                    txn.put(tenant + n.use, b"", db=db["tenant_ram_tail"])
                else:
                    txn.put(_ram_order_key(n), b"", db=db["ram_order"])
                    txn.put(tenant + _ram_order_key(n), b"", db=db["tenant_ram_order"])
        if n.pin_expires:
            txn.put(sortable(n.pin_expires) + n.key, b"", db=db[PIN_ENDS])
        self._add(txn, _PROTECTED, n.size if n.protected else 0)
        self._add(txn, _PINNED_RAM, n.size if n.pinned and n.in_ram else 0)
        if sums:
            index_sums.add_usage(txn, self._meta, n.tenant_id, n.usage, 1)

    def _unfile(self, txn: lmdb.Transaction[bytes], n: _Node, sums: bool = True) -> None:
        db = self._db
        tenant = tenant_prefix(n.tenant_id)
        txn.delete(n.key, db=db["tree"])
        txn.delete(n.use, db=db["by_use"])
        if n.parent:
            txn.delete(n.parent + n.subtree + n.key, db=db["kids"])
        txn.delete(n.use, db=db["leaves"])
        txn.delete(tenant + n.use, db=db["tenant_leaves"])
        txn.delete(n.key, db=db["ram_keys"])
        txn.delete(n.use, db=db["ram_tail"])
        txn.delete(tenant + n.use, db=db["tenant_ram_tail"])
        txn.delete(_ram_order_key(n), db=db["ram_order"])
        txn.delete(tenant + _ram_order_key(n), db=db["tenant_ram_order"])
        if n.pin_expires:
            txn.delete(sortable(n.pin_expires) + n.key, db=db[PIN_ENDS])
        self._add(txn, _PROTECTED, -n.size if n.protected else 0)
        self._add(txn, _PINNED_RAM, -n.size if n.pinned and n.in_ram else 0)
        if sums:
            index_sums.add_usage(txn, self._meta, n.tenant_id, n.usage, -1)

    def _refile(self, txn: lmdb.Transaction[bytes], old: _Node, new: _Node) -> None:
        if old != new:
            # The sums change only when what the entry holds does (not on a read).
            sums = (old.tenant_id, old.usage) != (new.tenant_id, new.usage)
            self._unfile(txn, old, sums)
            self._file(txn, new, sums)

    def _up(self, txn: lmdb.Transaction[bytes], key: bytes, pinned_delta: int,
            kids_delta: int = 0) -> None:
        """Bring ``key`` and the entries it is built on up to date after a change among
        its children (``kids_delta`` added or gone, or one with a new subtree key or pin
        count)."""
        while key:
            record = self._record(txn, key)
            if record is None:  # a broken chain (start-up removes it)
                return
            old = self._node(txn, record)
            new = replace(old, subtree=max(old.use, self._max_kid(txn, key)),
                          pinned_below=old.pinned_below + pinned_delta,
                          kids=old.kids + kids_delta)
            kids_delta = 0
            if new == old:
                return
            self._refile(txn, old, new)
            if new.subtree == old.subtree and not pinned_delta:
                return
            key = record.parent

    # -- changes (in the entry rows' write transaction) --------------------------------------

    def added(self, txn: lmdb.Transaction[bytes], record: Record) -> None:
        """A published entry (nothing is built on it yet)."""
        if not self.in_sync:
            return
        depth = 0
        if record.parent:
            parent = txn.get(record.parent, db=self._db["tree"])
            depth = _TREE.unpack(parent)[1] + 1 if parent else 0
            txn.put(record.parent + record.key, b"", db=self._db["children"])
        use = record_use_key(record)
        self._file(txn, _node_of(record, use, max(use, self._max_kid(txn, record.key)),
                                 depth, 0, self._count_kids(txn, record.key)))
        if record.parent:
            self._up(txn, record.parent, int(record.pinned), 1)

    def removed(self, txn: lmdb.Transaction[bytes], records: Iterable[Record]) -> None:
        """Unpublished entries, together with everything built on them."""
        if not self.in_sync:
            return
        records = list(records)
        gone = {r.key for r in records}
        # Parents that stay -> [pinned entries lost below them, children lost].
        boundary: dict[bytes, list[int]] = {}
        for record in records:
            node = self._node(txn, record)
            self._unfile(txn, node)
            if record.parent:
                txn.delete(record.parent + record.key, db=self._db["children"])
                if record.parent not in gone:
                    lost = boundary.setdefault(record.parent, [0, 0])
                    lost[0] += node.pinned + node.pinned_below
                    lost[1] += 1
        for parent, (pinned, kids) in boundary.items():
            self._up(txn, parent, -pinned, -kids)

    def changed(self, txn: lmdb.Transaction[bytes], old: Record, new: Record) -> None:
        """An entry's usage, pin or RAM copy changed (its row rewritten)."""
        if not self.in_sync:
            return
        if (old.parent, old.size, old.tenant_id) != (new.parent, new.size, new.tenant_id):
            self.removed(txn, [old])
            self.added(txn, new)
            return
        before = self._node(txn, old)
        use = record_use_key(new)
        after = replace(before, pinned=new.pinned, in_ram=new.in_ram, use=use,
                        subtree=max(use, self._max_kid(txn, new.key)),
                        pin_expires=new.pin_expires if new.pinned else 0.0)
        if after == before:
            return
        self._refile(txn, before, after)
        if new.parent and (after.subtree != before.subtree or after.pinned != before.pinned):
            self._up(txn, new.parent, int(after.pinned) - int(before.pinned))

    # -- whole tables -----------------------------------------------------------------------

    def _clear(self, txn: lmdb.Transaction[bytes]) -> None:
        for db in self._db.values():
            txn.drop(db, delete=False)
        for name in (_PROTECTED, _PINNED_RAM):
            txn.delete(name, db=self._meta)
        index_sums.clear_usage(txn, self._meta)
        txn.put(_IN_SYNC, _VERSION, db=self._meta)

    def cleared(self, txn: lmdb.Transaction[bytes]) -> None:
        """Every entry row was dropped: the tables are emptied too."""
        self._clear(txn)
        self.in_sync = True

    def invalidate(self, txn: lmdb.Transaction[bytes]) -> None:
        """Entry rows changed without the tables (rows that could not be decoded): they
        are rebuilt by :meth:`rebuild` before anything reads them (start-up does)."""
        txn.delete(_IN_SYNC, db=self._meta)
        self.in_sync = False

    def rebuild(self, records: Iterable[Record],
                progress: Callable[[int], None] | None = None) -> None:
        """Fill the tables from every entry (an index of an older version, or one whose
        rows were changed without them). One transaction; O(n log n)."""
        nodes: dict[bytes, _Node] = {}
        kids: dict[bytes, list[bytes]] = {}
        for i, r in enumerate(records, 1):
            use = record_use_key(r)
            nodes[r.key] = _node_of(r, use, use, 0, 0, 0)
            if progress is not None and i % 100_000 == 0:
                progress(i)
        for node in nodes.values():
            if node.parent in nodes:
                kids.setdefault(node.parent, []).append(node.key)
        # Depth top-down from the roots, then subtree keys and pin counts bottom-up.
        order: list[bytes] = [k for k, n in nodes.items() if n.parent not in nodes]
        depth = dict.fromkeys(order, 0)
        i = 0
        while i < len(order):
            for kid in kids.get(order[i], ()):
                depth[kid] = depth[order[i]] + 1
                order.append(kid)
            i += 1
        subtree = {k: n.use for k, n in nodes.items()}
        below = dict.fromkeys(nodes, 0)
        for key in reversed(order):  # children before their parents
            parent = nodes[key].parent
            if parent in nodes:
                subtree[parent] = max(subtree[parent], subtree[key])
                below[parent] += below[key] + nodes[key].pinned
        with self._env.begin(write=True) as txn:
            self._clear(txn)
            txn.delete(_IN_SYNC, db=self._meta)
            for key in order:  # entries in a cycle (forged headers only) are left out
                n = nodes[key]
                parent = n.parent if n.parent in nodes else b""
                if parent:
                    txn.put(parent + key, b"", db=self._db["children"])
                self._file(txn, replace(n, parent=parent, subtree=subtree[key],
                                        depth=depth[key], pinned_below=below[key],
                                        kids=len(kids.get(key, ()))))
            txn.put(_IN_SYNC, _VERSION, db=self._meta)
        self.in_sync = True

    # -- what goes first --------------------------------------------------------------------

    def disk_victims(self, held: Set[bytes], pending: Mapping[bytes, float],
                     tenant_id: str | None = None) -> Generator[bytes, None, None]:
        """The entries in the order the disk tier gives them up, each as if the ones
        before it were gone (policy.leaf_first_order's order): least recently used first
        among the leaves neither pinned nor ``held``, a parent joining once every entry
        built on it has come. Reads not yet in the index (``pending``: key -> time) are
        counted in. With ``tenant_id``, that tenant's entries only, in the same order.
        One snapshot: O(log n) per entry, whatever the tier (or other tenants) hold."""
        with self._env.begin() as txn:
            joined: list[bytes] = []  # use keys: parents now leaves, leaves read since
            left: dict[bytes, int] = {}  # parent -> its children not yet come
            leaves = self._leaves(txn, held, pending, joined, tenant_id)
            upcoming = next(leaves, None)
            while upcoming is not None or joined:
                if upcoming is None or (joined and joined[0] < upcoming):
                    use = heapq.heappop(joined)
                else:
                    use, upcoming = upcoming, next(leaves, None)
                key = use[-KEY_BYTES:]
                yield key
                record = self._record(txn, key)
                parent = record.parent if record is not None else b""
                if not parent:
                    continue
                if parent not in left:
                    row = txn.get(parent, db=self._db["tree"])
                    left[parent] = _TREE.unpack(row)[3] if row else 0
                left[parent] -= 1
                above = self._record(txn, parent)
                if not left[parent] and above is not None and not above.pinned \
                        and parent not in held:
                    heapq.heappush(joined, record_use_key(above, pending.get(parent, 0.0)))

    def _leaves(self, txn: lmdb.Transaction[bytes], held: Set[bytes], pending: Mapping[bytes, float],
                moved: list[bytes], tenant_id: str | None) -> Iterator[bytes]:
        """The ``leaves`` table's use keys in order (a tenant's range of
        ``tenant_leaves``), without the held entries; one read since its row was written
        goes onto the heap ``moved`` at its new place."""
        for use in self._rows(txn, "leaves", tenant_id):
            key = use[-KEY_BYTES:]
            if key in held:
                continue
            now = touched(use, pending.get(key))
            if now != use:
                heapq.heappush(moved, now)
                continue
            yield use

    def _rows(self, txn: lmdb.Transaction[bytes], table: str, tenant_id: str | None
              ) -> Iterator[bytes]:
        """The rows of ``table`` in order, or of its tenant table those of ``tenant_id``
        (without their prefix): one seek, then a row a step."""
        if tenant_id is None:
            yield from txn.cursor(db=self._db[table]).iternext(values=False)
            return
        prefix = tenant_prefix(tenant_id)
        cursor = txn.cursor(db=self._db[f"tenant_{table}"])
        if cursor.set_range(prefix):
            for row in cursor.iternext(values=False):
                if row[:TENANT_PREFIX_BYTES] != prefix:
                    return
                yield row[TENANT_PREFIX_BYTES:]

    def disk_victim(self, held: Set[bytes], pending: Mapping[bytes, float],
                    tenant_id: str | None = None) -> bytes | None:
        """The entry the disk tier gives up next (None when nothing may go)."""
        return next(self.disk_victims(held, pending, tenant_id), None)

    def ram_victims(self, held: Set[bytes], pending: Mapping[bytes, float],
                    tenant_id: str | None = None) -> Generator[bytes, None, None]:
        """The RAM copies in the order the RAM tier gives them up (Evictor's RAM order:
        policy.leaf_first_order's, then the entries a pinned or ``held`` entry is built on
        by their own last use), without the pinned and ``held`` ones; with ``tenant_id``,
        that tenant's copies only. Dropping a copy changes no other's place: one pass
        over one snapshot serves a whole make-room."""
        with self._env.begin() as txn:
            behind_held = self._ancestors(txn, held)
            raised = self._subtree_reads(txn, pending)
            moved: list[bytes] = []
            tail: list[bytes] = []  # the held entries' ancestors, by own use key
            for row in self._rows(txn, "ram_order", tenant_id):
                key = row[-KEY_BYTES:]
                if key in held:
                    continue
                if key in behind_held:
                    tail.append(self._own_use(txn, key, pending))
                    continue
                now = max(row[:USE_BYTES], raised.get(key, b"")) + row[USE_BYTES:]
                if now != row:
                    heapq.heappush(moved, now)
                    continue
                while moved and moved[0] < row:
                    yield heapq.heappop(moved)[-KEY_BYTES:]
                yield key
            while moved:
                yield heapq.heappop(moved)[-KEY_BYTES:]
            heapq.heapify(tail)
            for use in self._rows(txn, "ram_tail", tenant_id):
                key = use[-KEY_BYTES:]
                if key in held:
                    continue
                now = touched(use, pending.get(key))
                if now != use:
                    heapq.heappush(tail, now)
                    continue
                while tail and tail[0] < use:
                    yield heapq.heappop(tail)[-KEY_BYTES:]
                yield key
            while tail:
                yield heapq.heappop(tail)[-KEY_BYTES:]

    def _own_use(self, txn: lmdb.Transaction[bytes], key: bytes, pending: Mapping[bytes, float]
                 ) -> bytes:
        record = self._record(txn, key)
        return b"" if record is None else record_use_key(record, pending.get(key, 0.0))

    def _ancestors(self, txn: lmdb.Transaction[bytes], keys_: Iterable[bytes]) -> set[bytes]:
        """Every entry the given ones are built on (not themselves, unless built on each
        other)."""
        found: set[bytes] = set()
        for key in keys_:
            record = self._record(txn, key)
            parent = record.parent if record is not None else b""
            while parent and parent not in found:
                found.add(parent)
                record = self._record(txn, parent)
                parent = record.parent if record is not None else b""
        return found

    def _subtree_reads(self, txn: lmdb.Transaction[bytes], pending: Mapping[bytes, float]
                       ) -> dict[bytes, bytes]:
        """Subtree keys raised by reads not yet in the index: key -> its new subtree key,
        for each entry read and each entry it is built on (latest reads first, so each
        chain is walked up once)."""
        raised: dict[bytes, bytes] = {}
        for key, when in sorted(pending.items(), key=lambda kv: kv[1], reverse=True):
            record = self._record(txn, key)
            if record is None:
                continue
            use = record_use_key(record, when)
            while True:
                if raised.get(record.key, b"") >= use:
                    break
                raised[record.key] = use
                if not record.parent:
                    break
                parent = self._record(txn, record.parent)
                if parent is None:
                    break
                record = parent
        return raised

    # -- sums -------------------------------------------------------------------------------

    def unevictable_disk_bytes(self, held: Iterable[bytes]) -> int:
        """Bytes the disk tier cannot give up now: pinned entries, ``held`` ones, and every
        entry any of them is built on."""
        with self._env.begin() as txn:
            total = self._sum(txn, _PROTECTED)
            seen: set[bytes] = set()
            for key in held:
                while key and key not in seen:
                    seen.add(key)
                    record = self._record(txn, key)
                    if record is None:
                        break
                    node = self._node(txn, record)
                    if node.protected:  # counted already, and so is all it is built on
                        break
                    total += record.size
                    key = record.parent
            return total

    def tenant_usage(self) -> dict[str, Usage]:
        """What each tenant's entries hold in each tier (kvcache.index_sums)."""
        with self._env.begin() as txn:
            return index_sums.tenant_usage(txn, self._meta)

    def pin_end_keys(self) -> list[bytes]:
        """The entries pinned until a time, soonest end first."""
        with self._env.begin() as txn:
            return list(index_sums.pin_end_keys(txn, self._db[PIN_ENDS]))

    def pinned_ram_bytes(self) -> int:
        """Bytes of the RAM copies of pinned entries."""
        with self._env.begin() as txn:
            return self._sum(txn, _PINNED_RAM)

    def ram_keys(self) -> list[bytes]:
        """The entries with a RAM copy (as many as the RAM tier holds)."""
        with self._env.begin(db=self._db["ram_keys"]) as txn:
            return list(txn.cursor().iternext(values=False))

    def by_use(self, txn: lmdb.Transaction[bytes], *, after: bytes | None = None
               ) -> Iterator[bytes]:
        """Use keys, most recently used first, from just before ``after`` when given."""
        cursor = txn.cursor(db=self._db["by_use"])
        # From the row before the first one >= ``after`` (the last row when none is).
        found = cursor.prev() if after is not None and cursor.set_range(after) \
            else cursor.last()
        while found:
            yield cursor.key()
            found = cursor.prev()


def _next_prefix(key: bytes) -> bytes:
    """The smallest key past every key starting with ``key`` (b"" when there is none)."""
    if key == b"\xff" * len(key):
        return b""
    return (int.from_bytes(key, "big") + 1).to_bytes(len(key), "big")


def _ram_order_key(n: _Node) -> bytes:
    return n.subtree + struct.pack(">I", _DEPTH_MAX - n.depth) + n.key
