"""The eviction order kept in the index (kvcache.ordering) against the policy's full sorts
(kvcache.store.policy), on random sequences of changes to a real LMDB index.

After every change: the disk tier gives its entries up in leaf_first_order's order, the
RAM copies go in ram_order's order, and so does each tenant's own order (the full sort's,
that tenant's entries only), the bytes that cannot be evicted are what the full sort
leaves out, the children table is the records' parents, ``by_use`` is the order of last
use, each tenant's sums are what its rows hold and the expiring pins are listed by end. At the end the disk tier is drained one entry at a time in exactly
leaf_first_order's order, and rebuilding the tables from the rows gives the same tables.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.index import Index
from kvcache.ordering import TABLES, record_use_key, sortable, use_key
from kvcache.record import Record
from kvcache.store import policy

TENANTS = ("", "alice", "bob")


def record(key: bytes, parent: bytes, created: float, size: int, tenant_id: str = "",
           n_tokens: int = 2) -> Record:
    return Record(key=key, namespace=b"n" * 16, anchor=key, tail=b"", n_tokens=n_tokens,
                  size=size, codec="none", reason="cold", created=created, model_name="m",
                  model_fingerprint="f", tenant_id=tenant_id, parent=parent,
                  base=0 if not parent else 1)


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    idx = Index(tmp_path / "index")
    yield idx
    idx.close()


class Model:
    """The index plus the daemon-side state the orders take as arguments."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.held: Counter[bytes] = Counter()
        self.pending: dict[bytes, float] = {}
        self.n = 0

    def records(self) -> list[Record]:
        return list(self.index.records())

    def keys(self) -> list[bytes]:
        return list(self.index.keys())

    def keep(self) -> set[bytes]:
        return set(self.held) | {r.key for r in self.records() if r.pinned}

    def dependents(self, key: bytes) -> list[bytes]:
        out, todo = [], [key]
        while todo:
            kids = self.index.children(todo.pop())
            out += kids
            todo += kids
        return out

    def remove(self, key: bytes) -> None:
        for r in self.index.delete_many([key, *self.dependents(key)]):
            self.pending.pop(r.key, None)

    def apply(self, op: tuple[str, int, int, bool]) -> None:
        kind, pick, value, flag = op
        keys_ = self.keys()
        key = keys_[pick % len(keys_)] if keys_ else None
        if kind == "publish" or key is None:
            self.n += 1
            parent = key if flag and key is not None else b""
            # A piece is its parent's tenant's (a parent shares the piece's namespace).
            tenant = self.index.get(parent).tenant_id if parent else TENANTS[value % 3]
            self.index.put(record(self.n.to_bytes(16, "big"), parent, float(value % 7),
                                  100 + value, tenant, n_tokens=2 + value % 5))
        elif kind == "touch":
            self.index.record_usage({key: (1, float(value))})
        elif kind == "read":
            self.pending[key] = max(self.pending.get(key, 0.0), float(value))
        elif kind == "pin":
            # Now and then until a time (kept in pin_ends), else for good or unpinned.
            ends = float(1000 + value) if flag and value % 2 else 0.0
            self.index.update(key, pinned=flag, pin_expires=ends)
        elif kind == "ram":
            self.index.update(key, in_ram=flag)
        elif kind == "hold":
            self.held[key] += 1
        elif kind == "release" and self.held:
            held = sorted(self.held)[pick % len(self.held)]
            self.held[held] -= 1
            if not self.held[held]:
                del self.held[held]
        elif kind == "remove":
            self.remove(key)
        elif kind == "evict":
            victim = self.index.order.disk_victim(set(self.held), self.pending)
            if victim is not None:
                self.remove(victim)

    def check(self) -> None:
        records, keep, order = self.records(), self.keep(), self.index.order
        expected = policy.leaf_first_order(records, self.pending, keep)
        assert list(order.disk_victims(set(self.held), self.pending)) == [
            r.key for r in expected]
        ram = policy.ram_order(records, self.pending, keep)
        assert list(order.ram_victims(set(self.held), self.pending)) == [r.key for r in ram]
        for tenant in TENANTS:  # each tenant's own order: the full sort's, filtered
            assert list(order.disk_victims(set(self.held), self.pending, tenant)) == [
                r.key for r in expected if r.tenant_id == tenant], tenant
            assert list(order.ram_victims(set(self.held), self.pending, tenant)) == [
                r.key for r in ram if r.tenant_id == tenant], tenant
        usage = {}
        for tenant in TENANTS:
            mine = [r for r in records if r.tenant_id == tenant]
            if mine:
                usage[tenant] = (sum(r.size for r in mine), len(mine),
                                 sum(r.logical_size for r in mine),
                                 sum(r.size for r in mine if r.in_ram),
                                 sum(1 for r in mine if r.in_ram))
        assert {t: u.fields() for t, u in order.tenant_usage().items()} == usage
        assert order.pin_end_keys() == [r.key for r in sorted(
            (r for r in records if r.pinned and r.pin_expires),
            key=lambda r: (r.pin_expires, r.key))]
        total = sum(r.size for r in records)
        assert order.unevictable_disk_bytes(set(self.held)) == \
            total - sum(r.size for r in expected)
        assert order.pinned_ram_bytes() == sum(r.size for r in records
                                               if r.pinned and r.in_ram)
        assert sorted(order.ram_keys()) == sorted(r.key for r in records if r.in_ram)
        present = {r.key for r in records}
        for r in records:
            assert self.index.children(r.key) == sorted(
                c.key for c in records if c.parent == r.key), r.key
            assert not r.parent or r.parent in present
        by_use = [use for use, _ in self.index.records_by_use()]
        assert by_use == sorted((record_use_key(r) for r in records), reverse=True)


def dump(index: Index) -> dict[str, list[tuple[bytes, bytes]]]:
    order = index.order
    with index.env.begin() as txn:
        tables = {name: list(txn.cursor(db=order._db[name])) for name in TABLES}
        tables["meta"] = [(k, v) for k, v in txn.cursor(db=index._meta)
                          if k.startswith(b"order.")]
    return tables


OPS = st.tuples(st.sampled_from(["publish", "publish", "publish", "touch", "read", "pin",
                                 "ram", "ram", "hold", "release", "remove", "evict"]),
                st.integers(0, 1000), st.integers(0, 30), st.booleans())


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=40))
def test_the_kept_order_is_the_full_sort_after_any_changes(index: Index,
                                                            ops: list[tuple]) -> None:
    index.clear()
    model = Model(index)
    for op in ops:
        model.apply(op)
        model.check()
    tables = dump(index)
    index.rebuild_order()
    assert dump(index) == tables, "a rebuild from the rows gives other tables"
    # Drained one entry at a time, the disk tier goes in exactly the full sort's order.
    expected = [r.key for r in policy.leaf_first_order(model.records(), model.pending,
                                                       model.keep())]
    drained = []
    while (victim := index.order.disk_victim(set(model.held), model.pending)) is not None:
        drained.append(victim)
        model.remove(victim)
    assert drained == expected


def test_use_keys_sort_as_the_numbers_do() -> None:
    values = [-1e300, -2.5, -1.0, -0.0, 0.0, 1e-300, 0.5, 1.0, 1.7e9, 1e300]
    packed = [sortable(v) for v in values]
    assert packed == sorted(packed)
    assert sortable(-0.0) == sortable(0.0)
    rng = random.Random(3)
    triples = [(rng.choice(values), rng.choice(values), rng.randbytes(16)) for _ in range(300)]
    assert sorted(triples) == sorted(triples, key=lambda t: use_key(*t))


def test_a_deep_chain_and_a_wide_root_keep_the_order(index: Index) -> None:
    """A conversation of 60 pieces on a system prompt with 200 other conversations: the
    changes reach up the chain, and the disk and RAM orders stay the full sort's."""
    model = Model(index)
    model.index.put(record((1).to_bytes(16, "big"), b"", 1.0, 500))
    model.n = 1
    for i in range(200):
        model.apply(("publish", 0, i % 30, True))  # pick 0: the root, first in key order
    tip = (1).to_bytes(16, "big")
    for i in range(60):
        model.n += 1
        key = model.n.to_bytes(16, "big")
        model.index.put(record(key, tip, 40.0 + i, 100))
        tip = key
    model.index.update(tip, in_ram=True)
    model.index.update((1).to_bytes(16, "big"), in_ram=True)
    model.check()
    model.index.record_usage({(5).to_bytes(16, "big"): (1, 500.0)})
    model.pending[(9).to_bytes(16, "big")] = 600.0
    model.held[(150).to_bytes(16, "big")] += 1
    model.check()
    model.index.update(tip, pinned=True)
    model.check()
    for _ in range(50):
        model.apply(("evict", 0, 0, False))
    model.check()


def test_keys_are_read_a_batch_at_a_time_past_removals(index: Index) -> None:
    for i in range(1, 11):
        index.put(record(i.to_bytes(16, "big"), b"", float(i), 100))
    seen = []
    for key in index.iter_keys(batch=3):
        seen.append(key)
        if len(seen) == 3:  # removed while the walk is between batches
            index.delete_many([(4).to_bytes(16, "big"), (3).to_bytes(16, "big")])
    assert seen == [i.to_bytes(16, "big") for i in (1, 2, 3, 5, 6, 7, 8, 9, 10)]
