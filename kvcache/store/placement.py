"""Copies of hot entries in the RAM tier: placed after a commit and on a disk hit, one at
a time, on the RAM worker's thread, making room (kvcache.store.eviction) for each.

The RAM tier is a folder of its own on a memory file system (see kvcache.store.ramtier).
Being a file system, it lets a same-host reader open a blob directly (the fast path)
while the entry is pinned by its read. Copies are dropped by RamCopies
(kvcache.store.entries)."""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

from ..common import create_private_file
from .core import Part, StoreCore
from .eviction import Evictor


class RamPlacer(Part):
    """Places copies of entries in the RAM tier: after a commit and on a disk hit, one at a
    time, on its own worker thread.

    Takes Store._cond around its bookkeeping (the scheduled set, the entry's hold, the
    room it claims); the copy itself is made without it. While copying, the entry is held
    like a read, so it is not evicted from disk under the copy."""

    def __init__(self, core: StoreCore, evictor: Evictor) -> None:
        super().__init__(core)
        self._evictor = evictor
        self._closed = core.closed
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
                if key in self._leaving:  # the reclaimer is removing it
                    return
                self._pins.hold(key)  # keep it from being evicted from disk while copying
                held = True
                # The tenant's quota first: its own copies go before the shared budget's
                # order reaches anyone else's.
                if not self._evictor.make_tenant_room_in_ram(record) \
                        or not self._evictor.make_room_in_ram(record.size, exclude=key):
                    return
                self._tally.claim_ram(record)
            ok = False
            tmp = self._layout.ram_tmp_path(key)
            try:
                # Owner-only whatever the umask: copyfile truncates the file made here and
                # keeps its mode (and its fast in-kernel copy).
                os.close(create_private_file(tmp))
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
                if not ok:  # (the copy made first: its blob may be gone meanwhile)
                    tmp.unlink(missing_ok=True)
                    self._layout.ram_path(key).unlink(missing_ok=True)
        finally:
            with self._cond:
                self._scheduled.discard(key)
                if held:
                    self._pins.release(key)
