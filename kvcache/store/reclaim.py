"""The reclaimer: room made ahead of need. A background thread keeps each tier between a
low and a high watermark (StoreConfig.reclaim_low, reclaim_high: shares of its budget, the
disk's also of what the free-space watermark leaves), as LMCache's and SGLang's evictors
do: once a tier holds more than the high one, it gives up entries (the disk tier) or RAM
copies (the RAM tier) in kvcache.store.policy's order until it holds the low one. A save
then finds its room made and evicts nothing itself; only when the reclaimer cannot keep
up does a save make room inline (kvcache.store.eviction, counted as
``evictions_disk_inline``; a RAM placement's as ``evictions_ram_inline``).

A disk round takes a batch of victims (up to CHUNK_ENTRIES) under the store lock and
marks them *leaving* (StoreCore.leaving: as good as gone to every call that decides
under the lock), then, with the lock let go, removes them as every removal does: the blob
files (each before its RAM copy, each piece before what it is built on), one fsync per
folder, then the rows in one index transaction; then it accounts for them under the lock
again. So saves, reads and lookups go on while a batch's files are unlinked and fsynced,
and a crash at any step leaves what a crash inside any removal leaves: rows whose files
are gone, which start-up drops, never a file whose row is gone
(tests/faults/test_durable_removals.py::
test_a_removal_with_pieces_and_ram_copies_killed_at_every_step_is_never_undone).

RAM copies go a smaller batch at a time with the store lock held throughout
(RamCopies.drop_ram_copies): a read must never be sent to a copy being unlinked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from ..index import Record
from .core import Part, StoreConfig, StoreCore
from .entries import Entries, RamCopies, sync_dirs

log = logging.getLogger("kvcache")
RECLAIM_TICK_SECONDS = 0.1  # how often the thread looks at the tiers
CHUNK_ENTRIES = 512  # entries removed per disk round: one fsync per folder, one transaction
RAM_CHUNK_ENTRIES = 128  # RAM copies dropped per round (the store lock held throughout)


def check_watermarks(config: StoreConfig) -> None:
    """ValueError unless 0 < reclaim_low <= reclaim_high <= 1."""
    if not 0 < config.reclaim_low <= config.reclaim_high <= 1:
        raise ValueError(f"the reclaimer's watermarks must be 0 < low <= high <= 1 (shares of "
                         f"each tier's budget); got low {config.reclaim_low}, high "
                         f"{config.reclaim_high}")


class Reclaimer(Part):
    """Keeps each tier between its watermarks, on a thread of its own (none when the high
    watermark is 100%: saves then make their own room).

    Locking: takes Store._cond to measure a tier, choose a batch and account for it,
    never while a blob file is unlinked or a folder fsynced; ``_pass_lock`` keeps one pass
    at a time (the thread's, or one run_now asked for)."""

    def __init__(self, core: StoreCore, entries: Entries, ram: RamCopies) -> None:
        super().__init__(core)
        self._entries = entries
        self._ram = ram
        self._closed = core.closed
        self._wake = threading.Event()
        self._pass_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._config.reclaim_high < 1.0

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvcache-reclaim",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the store is closing: Store.closed is set)."""
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(RECLAIM_TICK_SECONDS)
            self._wake.clear()
            try:
                self.run_now()
            except Exception:  # a disk error: logged, tried again (saves evict meanwhile)
                log.exception("the reclaimer failed; trying again in a second")
                self._closed.wait(1.0)

    def run_now(self, *, force: bool = False) -> tuple[int, int]:
        """One pass over both tiers: each one above its high watermark (any above its low
        one, with ``force``) gives up entries down to the low one. Returns the entries
        evicted and the RAM copies dropped."""
        with self._pass_lock:
            return self._reclaim_disk(force), self._reclaim_ram(force)

    # -- how far above ---------------------------------------------------------------------

    def disk_over(self, share: float) -> int:
        """Bytes the disk tier holds (its entries and its saves' room) above ``share`` of
        its budget, or of what the free-space watermark leaves it when that is less.
        Store._cond held."""
        cfg, tally = self._config, self._tally
        used = tally.disk_used + tally.reserved_bytes
        room = self._layout.disk_free() - tally.reserved_bytes - cfg.min_free_bytes
        if room < 0 and -room > tally.disk_used - self._index.order.unevictable_disk_bytes(
                self._pins.busy() | self._leaving):
            # Other files took the free space: evicting every entry that may go would not
            # bring it back to the watermark, so evicting any is no help (saves are refused
            # meanwhile, and say why: the rule a save's own eviction keeps). Without this
            # the tier would give up a tenth of itself every tick until it was empty.
            return used - int(share * cfg.disk_bytes)
        return used - int(share * max(0, min(cfg.disk_bytes, used + room)))

    def ram_over(self, share: float) -> int:
        """Bytes the RAM tier holds above ``share`` of its budget. Store._cond held."""
        return self._tally.ram_used - int(share * self._config.ram_bytes)

    # -- the disk tier ---------------------------------------------------------------------

    def _reclaim_disk(self, force: bool) -> int:
        cfg = self._config
        with self._cond:
            if self.disk_over(cfg.reclaim_low if force else cfg.reclaim_high) <= 0:
                return 0
            self.counters["reclaims_disk"] += 1
        evicted = 0
        while not self._closed.is_set():
            with self._cond:
                batch = self._choose(self.disk_over(cfg.reclaim_low))
                self._leaving.update(r.key for r in batch)
            if not batch:
                break
            try:
                removed = self._remove(batch)
            finally:
                with self._cond:
                    self._leaving.difference_update(r.key for r in batch)
                    self._cond.notify_all()  # saves waiting for room or for their key
            evicted += removed
            if removed < len(batch):
                break
        return evicted

    def _choose(self, want: int) -> list[Record]:
        """The next victims in the disk tier's order, up to ``want`` bytes (at most
        CHUNK_ENTRIES), never one held or already leaving. Store._cond held."""
        chosen: list[Record] = []
        freed = 0
        held = self._pins.busy() | self._leaving
        with contextlib.closing(self._index.order.disk_victims(
                held, self._pins.last_used())) as go:
            for key in go:
                if freed >= want or len(chosen) >= CHUNK_ENTRIES:
                    break
                record = self._index.get(key)
                if record is not None:
                    chosen.append(record)
                    freed += record.size
        return chosen

    def _remove(self, batch: list[Record]) -> int:
        """Remove a leaving batch, the store lock let go: files, folders fsynced, rows;
        then account for them under it. How many went (a file that cannot be removed
        stops the batch there; those after it stay)."""
        gone: list[Record] = []
        for record in batch:  # pieces come before what they are built on
            try:
                self._layout.blob_path(record.key).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("the reclaimer could not remove the blob of entry %s: %s; the "
                            "entries not yet removed stay", record.key.hex(), exc)
                break
            gone.append(record)
            with contextlib.suppress(OSError):  # a copy left over goes at start-up
                self._layout.ram_path(record.key).unlink(missing_ok=True)
        sync_dirs({self._layout.blob_path(r.key).parent for r in gone})
        removed = self._index.delete_many([r.key for r in gone])
        with self._cond:
            self._entries.forget_removed(removed, "evictions_disk", {r.key for r in gone})
        return len(gone)

    # -- the RAM tier ----------------------------------------------------------------------

    def _reclaim_ram(self, force: bool) -> int:
        cfg = self._config
        with self._cond:
            if self.ram_over(cfg.reclaim_low if force else cfg.reclaim_high) <= 0:
                return 0
            self.counters["reclaims_ram"] += 1
        dropped = 0
        while not self._closed.is_set():
            with self._cond:
                batch = list(self._ram_batch(self.ram_over(cfg.reclaim_low)))
                n = self._ram.drop_ram_copies(batch, "evictions_ram")
            dropped += n
            if not n:
                break
        return dropped

    def _ram_batch(self, want: int) -> Iterator[Record]:
        """The next RAM copies in the RAM tier's order, up to ``want`` bytes. Store._cond
        held."""
        held = self._pins.busy() | self._leaving
        freed = n = 0
        with contextlib.closing(self._index.order.ram_victims(
                held, self._pins.last_used())) as go:
            for key in go:
                if freed >= want or n >= RAM_CHUNK_ENTRIES:
                    return
                record = self._index.get(key)
                if record is not None and record.in_ram:
                    yield record
                    freed += record.size
                    n += 1

