"""Making room: which entries (or RAM copies) go when a tier is full, in kvcache.store.policy's
order, and the loops that remove them until a new blob or copy fits.

The order is kept in the index as entries change (kvcache.ordering): making room reads
the next victim in O(log n) and never the whole tier. The reclaimer
(kvcache.store.reclaim) gives entries up ahead of need, in the same order, so a save
makes room here only when the reclaimer has not kept up (counted:
``evictions_disk_inline``, ``evictions_ram_inline``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from ..common import TIER_DISK, TIER_RAM
from ..errors import QuotaExceeded, StoreFull
from ..record import Record
from .core import Part, StoreCore
from .entries import Entries, RamCopies
from .quotas import QUOTA_OPTIONS, TenantQuotas

# When a tier must give something up, it gives up a batch: room for about eight more
# entries of the size being saved (at most 1/64 of its budget left unused), so the index
# transaction and the folders' fsyncs of a removal are shared by a batch of saves
# (tools/bench_full_cache.py: a full cache saves at ~0.8-0.9x the rate of an empty one).
SLACK_ENTRIES = 8
BATCH_MAX = 16  # where the slack cannot be had (a disk filled by other files): enough
# A save that needs room while the reclaimer is removing a batch waits this long for the
# batch (it frees room too) before evicting for itself.
RECLAIM_WAIT_SECONDS = 2.0


def room_slack(size: int, budget: int) -> int:
    """The room made beyond ``size`` when a tier of ``budget`` bytes is full."""
    return min(SLACK_ENTRIES * size, budget // 64)


class Evictor(Part):
    """Chooses and removes what goes to make room. Pinned entries, held ones (read,
    checked, being copied, or the parent of a piece being saved) and everything they are
    built on never go (tests/unit/test_store.py::test_eviction_never_takes_pinned_or_in_use_entries).

    Either tier refuses up front, removing nothing, when removing everything that may go
    would still not make room (tests/unit/test_store.py::test_a_save_that_cannot_fit_evicts_nothing,
    test_a_copy_that_cannot_fit_in_ram_drops_no_other_copy).

    What is held and what was read since the last usage flush live in ReadPins; the
    orders merge them in (kvcache.ordering), as the policy's full sorts do
    (tests/unit/test_ordering.py).

    A tenant with a quota (kvcache.store.quotas) makes room among its own entries first
    (plan_tenant_room_on_disk, make_tenant_room_in_ram), in the same order filtered to
    them: a tenant's pieces are built only on its own entries (a parent must share the
    namespace), so the filtered order is its own tree's leaf-first order, which the index
    keeps for each tenant (kvcache.ordering's tenant tables): its next victim is O(log n)
    away, however many entries of other tenants come before it in the shared order
    (tests/unit/test_ordering.py, tests/daemon/test_quotas.py::
    test_a_tenant_at_its_quota_reads_none_of_the_other_tenants_entries).

    make_room_on_disk, make_room_in_ram and the tenant variants are called with
    Store._cond held."""

    def __init__(self, core: StoreCore, entries: Entries, ram: RamCopies) -> None:
        super().__init__(core)
        self._entries = entries
        self._ram = ram
        self.quotas = TenantQuotas()  # the daemon sets them once the tenant labels are known

    # -- a tenant's quota -------------------------------------------------------------------

    def refuse_over_quota(self, tenant_id: str, size: int) -> None:
        """QuotaExceeded when one entry of ``size`` bytes is more than ``tenant_id``'s disk
        quota (no eviction could make room for it)."""
        quota = self.quotas.of(TIER_DISK, tenant_id)
        if quota is not None and size > quota:
            self.counters["saves_refused_quota"] += 1
            raise QuotaExceeded(f"an entry of {size} bytes exceeds this tenant's disk quota "
                                f"of {quota} bytes ({QUOTA_OPTIONS[TIER_DISK]})")

    def plan_tenant_room_on_disk(self, tenant_id: str, size: int) -> list[Record]:
        """The tenant's own entries that must go for ``size`` more of its bytes to fit its
        disk quota (a batch, as make_room_on_disk takes); nothing without a quota or when
        they fit. QuotaExceeded, choosing nothing, when all of its entries that may go
        would not make room. Removes nothing: the caller removes the plan once the shared
        budget is known to have room too. Store._cond held."""
        quota = self.quotas.of(TIER_DISK, tenant_id)
        if quota is None:
            return []
        usage = self._tally.tenant(tenant_id)

        def fits(freed: int = 0, spare: int = 0) -> bool:
            return usage.disk_bytes - freed + usage.room_bytes + size + spare <= quota

        if fits():
            return []
        self.refuse_over_quota(tenant_id, size)
        slack = room_slack(size, quota)
        chosen: list[Record] = []
        freed = 0
        with contextlib.closing(self._index.order.disk_victims(
                self._held(), self._pins.last_used(), tenant_id)) as go:
            for key in go:
                if fits(freed, slack) or (fits(freed) and len(chosen) >= BATCH_MAX):
                    break
                record = self._index.get(key)
                if record is not None and record.tenant_id == tenant_id:
                    chosen.append(record)
                    freed += record.size
        if not fits(freed):
            self.counters["saves_refused_quota"] += 1
            raise QuotaExceeded(
                f"no room for {size} bytes within this tenant's disk quota of {quota} bytes "
                f"({QUOTA_OPTIONS[TIER_DISK]}): its entries hold {usage.disk_bytes} bytes "
                f"and its saves in flight {usage.room_bytes}; those not pinned or being "
                f"read hold only {freed}")
        return chosen

    def remove_for_tenant(self, chosen: list[Record]) -> None:
        """Remove what plan_tenant_room_on_disk chose. Store._cond held."""
        self._entries.remove_entries(chosen, "evictions_quota_disk")

    def make_tenant_room_in_ram(self, record: Record) -> bool:
        """Drop the tenant's own RAM copies (in the RAM order) until ``record``'s copy fits
        its RAM quota; False, dropping none, when it cannot (larger than the quota, or the
        rest is pinned or being read). Store._cond held."""
        tenant_id, size = record.tenant_id, record.size
        quota = self.quotas.of(TIER_RAM, tenant_id)
        if quota is None:
            return True
        usage = self._tally.tenant(tenant_id)
        if usage.ram_bytes + size <= quota:
            return True
        if size > quota:
            return False
        slack = room_slack(size, quota)
        chosen: list[Record] = []
        freed = 0
        held = self._held() | {record.key}
        with contextlib.closing(self._index.order.ram_victims(
                held, self._pins.last_used(), tenant_id)) as go:
            for key in go:
                after = usage.ram_bytes - freed + size
                if after + slack <= quota or (after <= quota and len(chosen) >= BATCH_MAX):
                    break
                victim = self._index.get(key)
                if victim is not None and victim.in_ram and victim.tenant_id == tenant_id:
                    chosen.append(victim)
                    freed += victim.size
        if usage.ram_bytes - freed + size > quota:
            return False
        self._ram.drop_ram_copies(chosen, "evictions_quota_ram")
        return True

    # -- the shared budgets -----------------------------------------------------------------

    def make_room_on_disk(self, size: int, *, evict: bool = True, on_disk: int = 0) -> None:
        """Evict until a blob of ``size`` fits the disk budget and the free-space watermark.
        Raises StoreFull (before anything is written). Store._cond held. Evictions are
        removals like any other (Entries.remove_entries: files, fsync, then rows), made a
        batch at a time so that a full cache pays one fsync per folder per ~8 saves.
        Without ``evict``, only refuses a size that evicting everything allowed would not
        make room for (what Reserve checks: its room is made as bytes arrive). ``on_disk``:
        bytes of it already written (a local writer's), which the free space already
        lacks."""
        cfg = self._config
        tally = self._tally

        def fits(freed: int = 0, spare: int = 0) -> bool:
            """Whether ``size`` (and ``spare`` more) fits once ``freed`` more bytes go."""
            need = size + spare
            within_budget = tally.disk_used - freed + tally.reserved_bytes + need <= cfg.disk_bytes
            above_watermark = (self._layout.disk_free() + freed - tally.reserved_bytes - need
                               + on_disk >= cfg.min_free_bytes)
            return within_budget and above_watermark

        if fits():
            return
        if size > cfg.disk_bytes:
            self.counters["saves_refused_full"] += 1
            raise StoreFull(f"blob of {size} bytes exceeds the disk budget of {cfg.disk_bytes}")
        if evict and self._wait_for_reclaim(fits):
            return
        held = self._held()
        order = self._index.order
        evictable = tally.disk_used - order.unevictable_disk_bytes(held)
        # Evict only when evicting every candidate would make room (the rest is pinned or
        # being read otherwise): a save that is refused evicts nothing.
        if fits(evictable) and not evict:
            return
        if fits(evictable):
            slack = room_slack(size, cfg.disk_bytes)
            chosen: list[Record] = []
            freed = 0
            with contextlib.closing(order.disk_victims(held, self._pins.last_used())) as go:
                for key in go:
                    if fits(freed, slack) or (fits(freed) and len(chosen) >= BATCH_MAX):
                        break
                    record = self._index.get(key)
                    if record is not None:
                        chosen.append(record)
                        freed += record.size
            removed = self._entries.remove_entries(chosen, "evictions_disk")
            wanted = {r.key for r in chosen}  # (not what went with them: dependents_removed)
            self.counters["evictions_disk_inline"] += sum(r.key in wanted for r in removed)
        if not fits():
            self.counters["saves_refused_full"] += 1
            raise StoreFull(
                f"no space for {size} bytes: disk tier holds {tally.disk_used} of "
                f"{cfg.disk_bytes} budget bytes ({tally.reserved_bytes} reserved), "
                f"{self._layout.disk_free()} bytes free against a watermark of "
                f"{cfg.min_free_bytes}; "
                # Not "the rest is pinned": a disk filled by other files has nothing pinned.
                f"entries not pinned or being read hold only {evictable} bytes"
            )

    def make_room_in_ram(self, size: int, exclude: bytes = b"") -> bool:
        """Drop RAM copies (LRU) until ``size`` more bytes fit; False, dropping none, when
        dropping every copy that may go would not make room. Store._cond held."""
        budget = self._config.ram_bytes
        if self._tally.ram_used + size <= budget:
            return True
        held = self._held() | {exclude}
        order = self._index.order
        kept = order.pinned_ram_bytes() + sum(
            r.size for r in (self._index.get(k) for k in held)
            if r is not None and r.in_ram and not r.pinned)
        if self._tally.ram_used - (self._tally.ram_copies_bytes - kept) + size > budget:
            return False
        slack = room_slack(size, budget)
        chosen: list[Record] = []
        freed = 0
        with contextlib.closing(order.ram_victims(held, self._pins.last_used())) as go:
            for key in go:
                after = self._tally.ram_used - freed + size
                if after + slack <= budget or (after <= budget and len(chosen) >= BATCH_MAX):
                    break
                record = self._index.get(key)
                if record is not None and record.in_ram:
                    chosen.append(record)
                    freed += record.size
        dropped = self._ram.drop_ram_copies(chosen, "evictions_ram")
        self.counters["evictions_ram_inline"] += dropped
        return self._tally.ram_used + size <= budget

    # -- sharing the work with the reclaimer ---------------------------------------------

    def _held(self) -> set[bytes]:
        """What may not go now: entries held (kvcache.store.core.ReadPins) and those the
        reclaimer is removing already (they are going: not chosen twice)."""
        return self._pins.busy() | self._leaving

    def _wait_for_reclaim(self, fits: Callable[[], bool]) -> bool:
        """While the reclaimer removes a batch, wait for it (bounded) rather than evict
        beside it: True once ``fits()``. Store._cond held (the wait lets it go)."""
        deadline = time.monotonic() + RECLAIM_WAIT_SECONDS
        while self._leaving and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
            if fits():
                return True
        return False
