"""Where an entry's bytes are: the disk tier (every entry, write-through), the RAM tier
(copies of hot entries), and the one tally of the bytes each holds.

The RAM tier is a folder of its own on a memory file system (see kvcache.ramtier). Being
a file system, it lets a same-host reader open a blob directly (the fast path) while the
entry is pinned by its read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from .. import ramtier
from ..index import Index, Record

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


class Tally:
    """The byte accounting, and the only code that changes it: bytes each tier holds, RAM
    copies, bytes reserved by open leases, and logical bytes (the sum of
    Record.logical_size: what the entries' whole states would take).

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
        self.reserved_bytes = 0
        self.logical_bytes = 0

    def entry_added(self, record: Record) -> None:
        """A published entry (its blob is on disk)."""
        self.disk_used += record.size
        self.logical_bytes += record.logical_size

    def entry_removed(self, record: Record) -> None:
        """An unpublished entry, with its RAM copy if ``record`` (as removed) had one."""
        self.disk_used -= record.size
        self.logical_bytes -= record.logical_size
        if record.in_ram:
            self.ram_used -= record.size
            self.ram_entries -= 1

    def ram_copy_found(self, size: int) -> None:
        """A RAM copy found whole at start-up."""
        self.ram_used += size
        self.ram_entries += 1

    def claim_ram(self, size: int) -> None:
        """Room taken for a copy about to be made: counted before the copy exists, so no
        other placement takes the same room."""
        self.ram_used += size

    def unclaim_ram(self, size: int) -> None:
        """The copy claimed with claim_ram was not made."""
        self.ram_used -= size

    def ram_copy_placed(self) -> None:
        """The copy claimed with claim_ram is made and indexed."""
        self.ram_entries += 1

    def ram_copy_dropped(self, size: int) -> None:
        self.ram_used -= size
        self.ram_entries -= 1

    def reserve(self, size: int) -> None:
        self.reserved_bytes += size

    def unreserve(self, size: int) -> None:
        self.reserved_bytes -= size


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
        """Drop ``record``'s copy; False when the entry is gone (nothing was dropped).

        The file goes before the index stops saying "in RAM": the RAM tier outlives the
        daemon, and start-up takes a whole copy it finds for the entry's copy, so a crash
        after the flag but before the unlink would bring back a copy a prune had answered
        for (tests/test_durable_removals.py::
        test_a_ram_copy_dropped_by_a_prune_stays_dropped_after_a_kill). In between, the
        store lock keeps every read from choosing the copy."""
        with self._cond:  # held by every caller already; re-entrant
            if self._index.get(record.key) is None:
                return False
            self._layout.ram_path(record.key).unlink(missing_ok=True)
            if self._index.update(record.key, in_ram=False) is None:
                return False
            self._tally.ram_copy_dropped(record.size)
            self.counters[counter] += 1
        return True


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
                if not self._evictor.make_room_in_ram(record.size, exclude=key):
                    return
                self._tally.claim_ram(record.size)
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
                        self._tally.ram_copy_placed()
                        self.counters["ram_placements"] += 1
                    else:
                        self._tally.unclaim_ram(record.size)
                if not ok:
                    self._layout.ram_path(key).unlink(missing_ok=True)
        finally:
            with self._cond:
                self._scheduled.discard(key)
                if held:
                    self._pins.release(key)
