"""Prune: removing entries, or only their RAM copies, as an operator asks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..record import Record
from .core import Part, StoreCore, with_usage
from .entries import Entries, RamCopies
from .policy import eviction_order, leaf_first_order


@dataclass(frozen=True)
class PruneResult:
    removed: list[Record]
    bytes_freed: int
    skipped_pinned: int
    skipped_in_use: int
    skipped_shared: int = 0  # kept because entries outside the filters are built on them
    ram_dropped: int = 0  # RAM copies dropped (or, in a dry run, that would be)
    ram_bytes_freed: int = 0
    ram_dropped_entries: list[Record] = field(default_factory=list)


@dataclass
class _PrunePlan:
    """What one prune removes, drops and leaves alone (each entry counted once)."""

    busy: set[bytes]
    removed: list[Record] = field(default_factory=list)
    ram_dropped: list[Record] = field(default_factory=list)
    pinned: set[bytes] = field(default_factory=set)
    in_use: set[bytes] = field(default_factory=set)
    shared: int = 0  # candidates kept because other entries are built on them

    def may_touch(self, record: Record) -> bool:
        """False for pinned entries and entries being read (noted as skipped)."""
        if record.pinned:
            self.pinned.add(record.key)
            return False
        if record.key in self.busy:
            self.in_use.add(record.key)
            return False
        return True


class Pruner(Part):
    """Decides and removes under Store._cond, held for the whole prune (taken in
    ``prune``): a pin or a read either lands before the plan sees it or after the
    removal (tests/faults/test_load.py::
    test_a_pin_is_never_lost_to_a_concurrent_eviction_prune_or_delete)."""

    def __init__(self, core: StoreCore, entries: Entries, ram: RamCopies) -> None:
        super().__init__(core)
        self._entries = entries
        self._ram = ram

    def prune(self, predicate: Callable[[Record], bool] | None = None, *,
              max_disk_bytes: int = 0, max_ram_bytes: int = 0, dry_run: bool = False,
              ram_predicate: Callable[[Record], bool] | None = None) -> PruneResult:
        """Remove entries, or only their RAM copies, as an operator asked.

        ``predicate`` (the operator's filters) chooses the candidates, and every target
        works within them: with no byte target every candidate is removed;
        ``max_disk_bytes`` removes candidates, least recently used first, until the disk
        tier holds at most that; ``max_ram_bytes`` only drops candidates' RAM copies (the
        entries stay on disk) until the RAM tier holds at most that. Pinned entries and
        entries being read are never touched, and are counted as skipped. An entry goes
        only after (or with) every entry built on it, so one that entries outside the
        filters build on stays (counted in ``skipped_shared``), as does everything a
        pinned entry or one being read is built on. ``ram_predicate``, when given,
        chooses the RAM-copy candidates instead.
        """
        with self._cond:
            busy = self._pins.busy()
            pending = self._pins.last_used()
            # Entries the reclaimer is removing are gone already.
            records = [r for r in self._index.records() if r.key not in self._leaving]
            ordered = eviction_order(records, pending)
            # Judged with the reads not yet flushed to the index (once a second), so
            # `--unused-for` spares an entry that was just read.
            candidates = [r for r in ordered
                          if predicate is None or predicate(self._with_pending(r))]
            plan = _PrunePlan(busy)
            if max_disk_bytes or not max_ram_bytes:
                self._prune_entries(records, candidates, pending, plan, max_disk_bytes,
                                    predicate is not None, dry_run)
            if max_ram_bytes:
                if ram_predicate is not None:
                    candidates = [r for r in ordered if ram_predicate(self._with_pending(r))]
                self._prune_ram_copies(candidates, plan, max_ram_bytes, dry_run)
        return PruneResult(plan.removed, sum(r.size for r in plan.removed),
                           len(plan.pinned), len(plan.in_use), plan.shared,
                           len(plan.ram_dropped), sum(r.size for r in plan.ram_dropped),
                           plan.ram_dropped)

    def _with_pending(self, record: Record) -> Record:
        return with_usage(record, self._pins.usage(record.key))

    def _prune_entries(self, records: list[Record], candidates: list[Record],
                       pending: dict[bytes, float], plan: _PrunePlan, max_disk_bytes: int,
                       filtered: bool, dry_run: bool) -> None:
        """Remove candidates (all of them, or down to ``max_disk_bytes``), leaves first.
        Without a filter or a target nothing is a candidate."""
        if not (filtered or max_disk_bytes):
            return
        touchable = {r.key for r in candidates if plan.may_touch(r)}
        keep = {r.key for r in records} - touchable
        order = leaf_first_order(records, pending, keep)
        plan.shared = len(touchable) - len(order)
        disk_after = self._tally.disk_used
        for record in order:
            if max_disk_bytes and disk_after <= max_disk_bytes:
                return
            plan.removed.append(record)
            disk_after -= record.size
            if not dry_run:
                self._entries.remove_entry(record, "prune_removed")

    def _prune_ram_copies(self, candidates: list[Record], plan: _PrunePlan,
                          max_ram_bytes: int, dry_run: bool) -> None:
        """Drop candidates' RAM copies down to ``max_ram_bytes``."""
        gone = {r.key for r in plan.removed}
        # A removed entry's copy went with it (in a dry run it is still counted in ram_used).
        ram_after = self._tally.ram_used - (sum(r.size for r in plan.removed if r.in_ram)
                                            if dry_run else 0)
        for candidate in candidates:
            if ram_after <= max_ram_bytes:
                return
            # As it is now: the snapshot's tier may be stale after the removals above.
            record = candidate if dry_run else self._index.get(candidate.key)
            if record is None or record.key in gone or not record.in_ram:
                continue
            if not plan.may_touch(record):
                continue
            if dry_run or self._ram.drop_ram_copy(record, "prune_ram_dropped"):
                plan.ram_dropped.append(record)
                ram_after -= record.size
