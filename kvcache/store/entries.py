"""The entry table: published entries by key (the index's records), which entries are
built on each one, removing an entry together with everything built on it, and dropping
RAM copies (RamCopies): the two ways something leaves a tier."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

from .. import blob as blobfmt
from .. import keys
from ..errors import Busy, InvalidArgument, NotFound, QuotaExceeded, StoreError
from ..index import dir_fsync
from ..record import Record
from .core import Part, Seen, StoreCore

log = logging.getLogger("kvcache")


def check_tokens(raw_tokens: bytes, max_tokens: int) -> None:
    """Refuse an empty token list or one longer than ``max_tokens``."""
    n = len(raw_tokens) // 4
    if n == 0:
        raise InvalidArgument("empty token list")
    if n > max_tokens:
        raise InvalidArgument(f"{n} tokens exceed the limit of {max_tokens}")


def record_from(entry: keys.EntryKey, header: blobfmt.BlobHeader, meta: blobfmt.BlobMeta,
                size: int) -> Record:
    """The index record of a blob, from its checksummed header and metadata."""
    return Record(
        key=entry.key, namespace=meta.namespace, anchor=entry.anchor, tail=entry.tail,
        n_tokens=entry.n_tokens, size=size, codec=header.codec, reason=meta.reason,
        created=meta.created, model_name=meta.model_name,
        model_fingerprint=meta.model_fingerprint, tenant_id=meta.tenant_id,
        parent=meta.parent, base=meta.base,
    )


class ExpiringPins:
    """The entries pinned until a time: each one's end and tenant, and each tenant's
    keys (what a tenant's pins hold is counted over its own keys only). Not thread-safe:
    Store._cond held."""

    def __init__(self, records: Iterable[Record | None]) -> None:
        self.ends: dict[bytes, float] = {}
        self._tenant: dict[bytes, str] = {}
        self._by_tenant: dict[str, set[bytes]] = {}
        for r in records:
            if r is not None and r.pin_expires:
                self.add(r.key, r.pin_expires, r.tenant_id)

    def add(self, key: bytes, end: float, tenant_id: str) -> None:
        self.drop(key)
        self.ends[key] = end
        self._tenant[key] = tenant_id
        self._by_tenant.setdefault(tenant_id, set()).add(key)

    def drop(self, key: bytes) -> None:
        self.ends.pop(key, None)
        tenant_id = self._tenant.pop(key, None)
        if tenant_id is not None:
            keys_ = self._by_tenant[tenant_id]
            keys_.discard(key)
            if not keys_:
                del self._by_tenant[tenant_id]

    def of_tenant(self, tenant_id: str) -> set[bytes]:
        return self._by_tenant.get(tenant_id, set())


@dataclass(frozen=True)
class TenantPin:
    """An expiring pin the data path made: the entry as pinned, what its tenant's
    expiring pins hold now, and the most they may hold."""

    record: Record
    held_bytes: int
    bound: int


class Entries(Part):
    """Published entries and the pieces built on each (parent -> children): eviction takes
    only leaves, and removing an entry removes what is built on it, in one index
    transaction, so no piece is ever visible without its parent (tests/daemon/test_pieces.py::
    test_a_corrupt_piece_takes_what_is_built_on_it,
    test_prune_removes_an_entry_only_with_what_is_built_on_it).

    The published pieces built on each entry are in the index (kvcache.ordering's
    ``children`` table, written with the pieces). A piece being committed is added to a
    map here before its publish makes it visible and leaves it once the index has it (see
    Publisher.commit), so a removal of its parent either takes it or makes its publish find
    the parent gone.

    Locking: the children map changes with Store._cond held (add_child, drop_child);
    children, dependents, set_pinned, delete and remove_entries take it themselves (it is
    re-entrant); remove_entries holds it over its file removals too (see there)."""

    def __init__(self, core: StoreCore) -> None:
        super().__init__(core)
        self._children: dict[bytes, set[bytes]] = {}  # pieces being committed, by parent
        # Expiring pins (None until first needed: read from the index then).
        self._pin_ends: ExpiringPins | None = None

    # -- pieces being committed (Store._cond held) -------------------------------------------

    def add_child(self, record: Record) -> None:
        if record.parent:
            self._children.setdefault(record.parent, set()).add(record.key)

    def drop_child(self, parent: bytes, key: bytes) -> None:
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[parent]

    # -- queries ----------------------------------------------------------------------------

    def _kids(self, key: bytes) -> list[bytes]:
        return sorted(set(self._index.children(key)) | self._children.get(key, set()))

    def children(self, key: bytes) -> int:
        """How many entries are built directly on ``key``."""
        with self._cond:
            return len(self._kids(key))

    def dependents(self, key: bytes) -> list[bytes]:
        """Every entry built on ``key`` (its pieces, theirs, ...), nearest first."""
        with self._cond:
            out: list[bytes] = []
            todo = [key]
            while todo:
                kids = self._kids(todo.pop())
                out += kids
                todo += kids
            return out

    def get(self, key: bytes, tenants: Seen = None) -> Record:
        """The entry ``key``; NotFound when there is none that ``tenants`` may see."""
        record = self._core.visible(key, tenants)
        if record is None:
            raise NotFound(f"no entry {key.hex()}")
        return record

    def chain(self, record: Record) -> list[Record]:
        """The entries whose blobs make up ``record``'s state, root first (``record``
        last). Raises NotFound when a link is missing (removed meanwhile)."""
        links = [record]
        while links[-1].parent:
            parent = self._index.get(links[-1].parent)
            if parent is None or len(links) > self._config.max_tokens:
                raise NotFound(f"entry {record.key.hex()} lost a part of its chain")
            links.append(parent)
        return links[::-1]

    # -- changes ----------------------------------------------------------------------------

    def set_pinned(self, key: bytes, pinned: bool, ttl_seconds: float = 0.0,
                   tenants: Seen = None, counter: str = "pins") -> Record:
        """Pin (until unpinned; with ``ttl_seconds``, until then) or unpin. An expiring pin
        is extended by a later one, never shortened, and never turns a pin without end
        into one that ends."""
        # Under the lock evictions, prunes and deletes decide under: a pin answered OK is
        # never undone by a removal that chose the entry before it (tests/faults/test_load.py::
        # test_a_pin_is_never_lost_to_a_concurrent_eviction_prune_or_delete).
        with self._cond:
            old = self.get(key, tenants)
            expires = 0.0
            if pinned and ttl_seconds > 0 and not (old.pinned and not old.pin_expires):
                expires = max(old.pin_expires, time.time() + ttl_seconds)
            record = self._index.update(key, pinned=pinned, pin_expires=expires)
            if record is None:
                raise NotFound(f"no entry {key.hex()}")
            if self._pin_ends is not None:
                self._pin_ends.drop(key)
                if expires:
                    self._pin_ends.add(key, expires, record.tenant_id)
            self.counters[counter if pinned else "unpins"] += 1
            return record

    def pin_for_tenant(self, key: bytes, ttl_seconds: float, tenants: frozenset[str],
                       bound: Callable[[str], int]) -> TenantPin:
        """An expiring pin on an entry of ``tenants`` (the data path's: a runtime keeping a
        cache_control breakpoint), refused (QuotaExceeded) when the tenant's expiring pins
        would hold more than ``bound(its label)`` bytes: the entries pinned until a time,
        this one included, and every entry they are built on (pins protect those too),
        each counted once. An entry pinned without end stays so, and holds nothing here."""
        with self._cond:
            record = self.get(key, tenants)
            limit = bound(record.tenant_id)
            if record.pinned and not record.pin_expires:
                return TenantPin(record, self.held_by_pins(record.tenant_id), limit)
            held = self.held_by_pins(record.tenant_id, adding=record)
            if held > limit:
                self.counters["tenant_pins_refused"] += 1
                raise QuotaExceeded(
                    f"pinning entry {key.hex()} would make this tenant's expiring pins hold "
                    f"{held} bytes (with the entries they are built on), over its limit of "
                    f"{limit} (--max-pinned-bytes-per-tenant, and its disk quota if any)")
            record = self.set_pinned(key, True, ttl_seconds, tenants, counter="tenant_pins")
            return TenantPin(record, held, limit)

    def held_by_pins(self, tenant_id: str, adding: Record | None = None) -> int:
        """Bytes the expiring pins of ``tenant_id`` hold: its entries pinned until a time
        and every entry they are built on, each once (with ``adding`` as if pinned too).
        Store._cond held."""
        pinned = [r for key in self._expiring_pins().of_tenant(tenant_id)
                  if (r := self._index.get(key)) is not None and r.pinned and r.pin_expires]
        held: dict[bytes, int] = {}
        for record in pinned + ([adding] if adding is not None else []):
            with contextlib.suppress(NotFound):  # a link removed meanwhile holds nothing
                held.update((link.key, link.size) for link in self.chain(record))
        return sum(held.values())

    def _expiring_pins(self) -> ExpiringPins:
        """The expiring pins: read from the index once (they outlive restarts there: its
        pin_ends table lists them, no entry is scanned), then kept here. Store._cond held."""
        if self._pin_ends is None:
            self._pin_ends = ExpiringPins(
                self._index.get(key) for key in self._index.order.pin_end_keys())
        return self._pin_ends

    def release_expired_pins(self, now: float) -> int:
        """Unpin every entry whose expiring pin ended by ``now`` (time.time()); how many.
        The ends are read from the index once (they outlive restarts there), then kept
        here: a tick looks at them, not at every row."""
        with self._cond:
            pins = self._expiring_pins()
            due = [key for key, end in pins.ends.items() if end <= now]
            if not due:
                return 0
            for key in due:
                pins.drop(key)
            # An entry pinned again since is not due: its row holds the later end.
            still_due = [key for key in due if (r := self._index.get(key)) is not None
                         and r.pin_expires and r.pin_expires <= now]
            released = self._index.update_many(still_due, pinned=False, pin_expires=0.0)
            self.counters["pins_expired"] += len(released)
            return len(released)

    def delete(self, key: bytes, tenants: Seen = None) -> list[Record]:
        """Remove an entry and the entries built on it (they cannot be restored without
        it); refused while any of them is pinned or read by a client. Held only by the
        daemon's own work (its RAM copy being made, a check, a piece being saved on it),
        it is waited for, up to ``delete_wait_seconds``: an operator's delete right after
        a save must not fail on a copy it cannot see (tests/daemon/test_pieces.py::
        test_a_delete_waits_for_the_daemon_s_own_work_on_an_entry). Returns what went,
        the entry first. Takes the store lock (and gives it up while waiting)."""
        deadline = time.monotonic() + self._config.delete_wait_seconds
        with self._cond:
            while True:
                record = self.get(key, tenants)
                dependents = self.dependents(key)
                busy = ""
                for k in (key, *dependents):
                    r = record if k == key else self._index.get(k)
                    whose = "" if k == key else f" (built on {key.hex()})"
                    if r is not None and r.pinned:
                        raise Busy(f"entry {k.hex()}{whose} is pinned; unpin it first")
                    if self._pins.is_read(k):
                        raise Busy(f"entry {k.hex()}{whose} is being read")
                    if not busy and self._pins.is_held(k):
                        busy = f"entry {k.hex()}{whose} is being read (by the daemon: a " \
                               "copy, a check or a piece saved on it); try again"
                if not busy:
                    return self.remove_entry(record, "deletes")  # the entry first
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(busy)
                self._cond.wait(left)  # woken whenever an entry stops being held

    def remove_entry(self, record: Record, counter: str) -> list[Record]:
        """Remove an entry and everything built on it (see remove_entries). Returns what
        was removed, the entry first (nothing when the entry is gone already)."""
        return self.remove_entries([record], counter)

    def remove_entries(self, records: Sequence[Record], counter: str) -> list[Record]:
        """Remove entries and everything built on them: their files first, durably, then
        their rows, in one index transaction (no piece stays visible without its parent).
        Eviction removes a batch at a time (kvcache.store.eviction). Returns what was
        removed (nothing for an entry gone already).

        Files before rows, so that no crash undoes a removal anyone could have seen
        (the invariant in the package docstring): until the rows go, a lookup still finds
        the entry, and a crash leaves rows whose blob is gone, which start-up drops
        (Reconcile); once the rows are gone, no blob is left to re-index. In between, the
        store lock is held throughout, so no read opens a file that is going: a reader
        waits, then finds the entry gone. Each blob goes before its RAM copy (a crash
        between leaves a copy without a blob, removed at start-up) and each piece before
        what it is built on (a crash between leaves a shorter chain, never a broken one).
        The blob folders are fsynced (each once) before the rows go: a power cut cannot
        bring back a blob whose row is gone.

        Evictions too: an evicted entry that came back would be whole and valid, but a
        daemon that says it evicted must not find it again, nor would its pieces' removals
        hold (tests/faults/test_durable_removals.py). A batch pays one fsync per folder.

        A piece whose commit is under way is in the children map before it is visible, so
        its file is removed here and its row either goes with the others or is never
        written (its publish finds the parent gone). A file that cannot be removed (an
        I/O error, not a missing file) stops the removal there: the entries whose files
        went leave the index too (only pieces of those that stay: no chain breaks), the
        others stay published, and StoreError says why."""
        if not records:
            return []
        chosen = {r.key for r in records}
        with self._cond:
            doomed = list(dict.fromkeys(
                k for r in records if self._index.get(r.key) is not None
                for k in (r.key, *self.dependents(r.key))))
            gone: list[bytes] = []  # files removed, pieces before their parents
            failure = ""
            for key in reversed(doomed):  # each entry's pieces are listed after it
                try:
                    self._layout.blob_path(key).unlink(missing_ok=True)
                except OSError as exc:
                    failure = f"could not remove the blob of entry {key.hex()}: {exc}"
                    break
                gone.append(key)
                with contextlib.suppress(OSError):  # a copy left over goes at start-up
                    self._layout.ram_path(key).unlink(missing_ok=True)
            sync_dirs({self._layout.blob_path(k).parent for k in gone})
            removed = self._index.delete_many(gone[::-1])  # the entries first, as listed
            self.forget_removed(removed, counter, chosen)
        if failure:
            raise StoreError(f"{failure}; the removal stopped there, the entries not yet "
                             "removed stay")
        return removed


    def forget_removed(self, removed: Iterable[Record], counter: str,
                       chosen: Set[bytes]) -> None:
        """Account for entries whose rows are gone (as ``removed``: their tiers as they
        were when the rows went, not as when chosen): counted under ``counter``, or as
        dependents_removed for those that went only with what they are built on.
        Store._cond held."""
        for r in removed:
            self._tally.entry_removed(r)
            self._pins.forget_usage(r.key)
            self.drop_child(r.parent, r.key)
            self._children.pop(r.key, None)
            self.counters[counter if r.key in chosen else "dependents_removed"] += 1


def sync_dirs(dirs: Iterable[Path]) -> None:
    """fsync folders whose blobs were removed. An error is logged, not raised: the files
    are gone, only their durability is unknown."""
    for d in sorted(dirs):
        try:
            dir_fsync(d)
        except OSError as exc:
            log.warning("could not fsync %s after removing blobs: %s", d, exc)


class RamCopies(Part):
    """Drops RAM copies: for eviction, prune and quarantine.

    Called with Store._cond held, by a caller that saw the entry in RAM under it (eviction,
    prune and quarantine all decide under it), so each copy is uncounted once."""

    def drop_ram_copy(self, record: Record, counter: str) -> bool:
        """Drop ``record``'s copy; False when the entry is gone (nothing was dropped)."""
        return bool(self.drop_ram_copies([record], counter))

    def drop_ram_copies(self, records: Sequence[Record], counter: str) -> int:
        """Drop the copies of ``records`` (each in RAM when chosen), in one index
        transaction; how many were dropped (an entry gone meanwhile has none to drop).

        The files go before the index stops saying "in RAM": the RAM tier outlives the
        daemon, and start-up takes a whole copy it finds for the entry's copy, so a crash
        after the flag but before the unlink would bring back a copy a prune had answered
        for (tests/faults/test_durable_removals.py::
        test_a_ram_copy_dropped_by_a_prune_stays_dropped_after_a_kill). In between, the
        store lock keeps every read from choosing the copy."""
        if not records:
            return 0
        with self._cond:  # held by every caller already; re-entrant
            present = [r.key for r in records
                       if (now := self._index.get(r.key)) is not None and now.in_ram]
            for key in present:
                self._layout.ram_path(key).unlink(missing_ok=True)
            dropped = self._index.update_many(present, in_ram=False)
            for r in dropped:
                self._tally.ram_copy_dropped(r)
                self.counters[counter] += 1
        return len(dropped)
