"""Where an entry's bytes are: the disk tier (every entry, write-through), the RAM tier
(copies of hot entries), and the one tally of the bytes each holds.

The RAM tier is a folder of its own on a memory file system (see kvcache.store.ramtier). Being
a file system, it lets a same-host reader open a blob directly (the fast path) while the
entry is pinned by its read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..index import Index, Record
from . import ramtier

if TYPE_CHECKING:
    from .eviction import Evictor
    from .reads import ReadPins
    from .settings import StoreConfig

BLOB_SUFFIX = ".kvc"
TMP_SUFFIX = ".part"


class Layout:
    """The data directory's folders and the name of every file in them and in the RAM
    tier's folder (the layout is drawn in the package docstring). Fixed once made: safe
    from any thread, no lock."""

    def __init__(self, root: Path, ram_parent: Path | None) -> None:
        self.root = root
        self.ram_dir = ramtier.tier_dir(root, ram_parent)
        self.blob_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"

    def make_dirs(self) -> None:
        # Owner-only from creation: these hold the cached prompts. The data directory
        # itself keeps whatever mode it was given.
        for d in (self.blob_dir, self.tmp_dir, self.quarantine_dir):
            d.mkdir(mode=0o700, exist_ok=True)

    def blob_path(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.blob_dir / hexkey[:2] / f"{hexkey}{BLOB_SUFFIX}"

    def ram_path(self, key: bytes) -> Path:
        return self.ram_dir / f"{key.hex()}{BLOB_SUFFIX}"

    def ram_tmp_path(self, key: bytes) -> Path:
        return self.ram_dir / f"{key.hex()}{TMP_SUFFIX}"

    def tmp_path(self, lease_id: str) -> Path:
        return self.tmp_dir / f"{lease_id}{TMP_SUFFIX}"

    def disk_free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


@dataclass
class TenantUsage:
    """What one tenant's entries hold (entries without a tenant count as one, "")."""

    disk_bytes: int = 0
    disk_entries: int = 0
    ram_bytes: int = 0  # RAM copies made, and room claimed for one being made
    ram_entries: int = 0
    room_bytes: int = 0  # disk room its open saves hold (part of Tally.reserved_bytes)

    def idle(self) -> bool:
        return not (self.disk_bytes or self.disk_entries or self.ram_bytes
                    or self.ram_entries or self.room_bytes)

    def state(self) -> list[int]:
        return [self.disk_bytes, self.disk_entries, self.ram_bytes, self.ram_entries]


class Tally:
    """The byte accounting, and the only code that changes it: bytes each tier holds, RAM
    copies, bytes reserved by open leases, and logical bytes (the sum of
    Record.logical_size: what the entries' whole states would take), in all and per
    tenant (what tenant quotas are held to: kvcache.store.quotas).

    Kept as entries come and go rather than counted from the index: Stats and every
    metrics scrape read them, and counting index rows costs ~20 ms at 10,000 entries. The
    numbers equal what the index and the files hold after every change
    (tests/test_store.py::test_tier_counts_follow_every_change).

    Not thread-safe: every method is called with Store._cond held (or at start-up, before
    any other thread runs). Reading an attribute without it sees a recent value."""

    def __init__(self) -> None:
        self.disk_used = 0
        self.ram_used = 0
        self.ram_entries = 0  # the index counts disk entries itself (every entry is on disk)
        self.ram_claimed = 0  # room taken for copies being made (part of ram_used)
        self.reserved_bytes = 0
        self.logical_bytes = 0
        # Tenant label -> its usage; a tenant holding nothing has no row.
        self.tenants: dict[str, TenantUsage] = {}

    @property
    def ram_copies_bytes(self) -> int:
        """Bytes of the RAM copies made (ram_used without the room claimed for copies)."""
        return self.ram_used - self.ram_claimed

    def tenant(self, tenant_id: str) -> TenantUsage:
        """``tenant_id``'s usage (a zero one, not kept, for a tenant holding nothing)."""
        return self.tenants.get(tenant_id) or TenantUsage()

    def _change(self, tenant_id: str, **deltas: int) -> None:
        usage = self.tenants.setdefault(tenant_id, TenantUsage())
        for name, delta in deltas.items():
            setattr(usage, name, getattr(usage, name) + delta)
        if usage.idle():
            del self.tenants[tenant_id]

    def state(self) -> dict[str, object]:
        """What a clean shutdown records (see restore)."""
        return {"disk_used": self.disk_used, "logical_bytes": self.logical_bytes,
                "ram_used": self.ram_used, "ram_entries": self.ram_entries,
                "tenants": {t: u.state() for t, u in self.tenants.items()}}

    def restore(self, state: dict[str, object]) -> None:
        """Counts recorded by the last clean shutdown, instead of counting every entry."""
        for name in ("disk_used", "logical_bytes", "ram_used", "ram_entries"):
            value = state.get(name)
            if type(value) is not int:
                raise ValueError(f"clean-shutdown record without {name}")
            setattr(self, name, value)
        tenants = state.get("tenants")
        # A record written before per-tenant usage was kept: ValueError means the full
        # reconcile, which counts every entry.
        if not isinstance(tenants, dict) or not all(
                isinstance(t, str) and isinstance(u, list) and len(u) == 4
                and all(type(v) is int for v in u) for t, u in tenants.items()):
            raise ValueError("clean-shutdown record without per-tenant usage")
        self.tenants = {t: TenantUsage(*u) for t, u in tenants.items()}

    def entry_added(self, record: Record) -> None:
        """A published entry (its blob is on disk)."""
        self.disk_used += record.size
        self.logical_bytes += record.logical_size
        self._change(record.tenant_id, disk_bytes=record.size, disk_entries=1)

    def entry_removed(self, record: Record) -> None:
        """An unpublished entry, with its RAM copy if ``record`` (as removed) had one."""
        self.disk_used -= record.size
        self.logical_bytes -= record.logical_size
        self._change(record.tenant_id, disk_bytes=-record.size, disk_entries=-1)
        if record.in_ram:
            self.ram_used -= record.size
            self.ram_entries -= 1
            self._change(record.tenant_id, ram_bytes=-record.size, ram_entries=-1)

    def ram_copy_found(self, record: Record) -> None:
        """A RAM copy found whole at start-up."""
        self.ram_used += record.size
        self.ram_entries += 1
        self._change(record.tenant_id, ram_bytes=record.size, ram_entries=1)

    def claim_ram(self, record: Record) -> None:
        """Room taken for a copy about to be made: counted before the copy exists, so no
        other placement takes the same room."""
        self.ram_used += record.size
        self.ram_claimed += record.size
        self._change(record.tenant_id, ram_bytes=record.size)

    def unclaim_ram(self, record: Record) -> None:
        """The copy claimed with claim_ram was not made."""
        self.ram_used -= record.size
        self.ram_claimed -= record.size
        self._change(record.tenant_id, ram_bytes=-record.size)

    def ram_copy_placed(self, record: Record) -> None:
        """The copy claimed with claim_ram is made and indexed."""
        self.ram_entries += 1
        self.ram_claimed -= record.size
        self._change(record.tenant_id, ram_entries=1)

    def ram_copy_dropped(self, record: Record) -> None:
        self.ram_used -= record.size
        self.ram_entries -= 1
        self._change(record.tenant_id, ram_bytes=-record.size, ram_entries=-1)

    def reserve(self, size: int, tenant_id: str) -> None:
        self.reserved_bytes += size
        self._change(tenant_id, room_bytes=size)

    def unreserve(self, size: int, tenant_id: str) -> None:
        self.reserved_bytes -= size
        self._change(tenant_id, room_bytes=-size)


class RamCopies:
    """Drops RAM copies: for eviction, prune and quarantine.

    Called with Store._cond held, by a caller that saw the entry in RAM under it (eviction,
    prune and quarantine all decide under it), so each copy is uncounted once."""

    def __init__(self, layout: Layout, index: Index, tally: Tally, counters: Counter[str],
                 cond: threading.Condition) -> None:
        self._layout = layout
        self._index = index
        self._tally = tally
        self.counters = counters
        self._cond = cond

    def drop_ram_copy(self, record: Record, counter: str) -> bool:
        """Drop ``record``'s copy; False when the entry is gone (nothing was dropped)."""
        return bool(self.drop_ram_copies([record], counter))

    def drop_ram_copies(self, records: Sequence[Record], counter: str) -> int:
        """Drop the copies of ``records`` (each in RAM when chosen), in one index
        transaction; how many were dropped (an entry gone meanwhile has none to drop).

        The files go before the index stops saying "in RAM": the RAM tier outlives the
        daemon, and start-up takes a whole copy it finds for the entry's copy, so a crash
        after the flag but before the unlink would bring back a copy a prune had answered
        for (tests/test_durable_removals.py::
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


class RamPlacer:
    """Places copies of entries in the RAM tier: after a commit and on a disk hit, one at a
    time, on its own worker thread.

    Takes Store._cond around its bookkeeping (the scheduled set, the entry's hold, the
    room it claims); the copy itself is made without it. While copying, the entry is held
    like a read, so it is not evicted from disk under the copy."""

    def __init__(self, config: StoreConfig, layout: Layout, index: Index, tally: Tally,
                 pins: ReadPins, evictor: Evictor, counters: Counter[str],
                 cond: threading.Condition, closed: threading.Event) -> None:
        self._config = config
        self._layout = layout
        self._index = index
        self._tally = tally
        self._pins = pins
        self._evictor = evictor
        self.counters = counters
        self._cond = cond
        self._closed = closed
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-ram")
        self._scheduled: set[bytes] = set()  # keys queued or being placed; under _cond

    def schedule(self, key: bytes) -> None:
        with self._cond:
            if key in self._scheduled or self._closed.is_set():
                return
            self._scheduled.add(key)
        with contextlib.suppress(RuntimeError):  # the worker is shutting down
            self.worker.submit(self._place, key)

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)

    def _place(self, key: bytes) -> None:
        # Releases only a hold it took: an entry it returns early for (gone, already in
        # RAM, larger than the tier) keeps every hold its readers have on it.
        held = False
        try:
            record = self._index.get(key)
            if record is None or record.in_ram or record.size > self._config.ram_bytes:
                return
            with self._cond:
                self._pins.hold(key)  # keep it from being evicted from disk while copying
                held = True
                # The tenant's quota first: its own copies go before the shared budget's
                # order reaches anyone else's.
                if not self._evictor.make_tenant_room_in_ram(record) \
                        or not self._evictor.make_room_in_ram(record.size, exclude=key):
                    return
                self._tally.claim_ram(record)
            ok = False
            try:
                tmp = self._layout.ram_tmp_path(key)
                shutil.copyfile(self._layout.blob_path(key), tmp)
                os.rename(tmp, self._layout.ram_path(key))
                ok = self._index.update(key, in_ram=True) is not None
            except OSError:
                pass
            finally:
                with self._cond:
                    if ok:
                        self._tally.ram_copy_placed(record)
                        self.counters["ram_placements"] += 1
                    else:
                        self._tally.unclaim_ram(record)
                if not ok:
                    self._layout.ram_path(key).unlink(missing_ok=True)
        finally:
            with self._cond:
                self._scheduled.discard(key)
                if held:
                    self._pins.release(key)
