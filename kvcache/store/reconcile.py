"""Start-up reconcile: make the index and the files agree, reading blob headers only
(never whole payloads), and count what is there into the tally.

After a clean shutdown that nothing has disturbed since, none of that is needed: the
shutdown recorded the tally, the id of the index's last write transaction and a
signature of the blob folders (see seal_clean_shutdown), and a start-up that finds all
three unchanged reads no entry and no blob file, only the names in the RAM tier, so a
million entries start in about a second (tools/bench_full_cache.py).

After a crash (no clean-shutdown record, the index otherwise as this daemon left it),
the check runs in the background while the daemon serves (kvcache.store.recovery); the
tally comes from the sums the index keeps. Anything else (an index or blob folders
changed after a clean shutdown, another block size or schema, eviction tables to build,
rows a background check found damaged) means the full reconcile, before serving."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import xxhash

from .. import blob as blobfmt
from .. import keys
from ..index import SCHEMA_VERSION, Index, dir_fsync
from ..record import Record
from . import ramtier
from .core import BLOB_SUFFIX, TMP_SUFFIX, Layout, Part, StoreConfig, StoreCore, Tally
from .entries import Entries, record_from
from .integrity import Integrity
from .ownership import is_own_file_name

log = logging.getLogger("kvcache")
REINDEX_BATCH = 10_000
# How a store started (Reconcile.run).
CLEAN, RECOVER, FULL = "clean", "recover", "full"
# The index setting a background check leaves when it found damaged rows: the next
# start-up runs the full reconcile, which rebuilds them from their blobs.
DAMAGED = "damaged_rows"


class Progress:
    """Logs how far a long start-up step got, every PROGRESS_SECONDS."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.t0 = self.last = time.monotonic()

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            log.info("start-up: %d of %d %s (%.0f s)", self.done, self.total, self.what,
                     now - self.t0)


PROGRESS_SECONDS = 5.0

# A blob to publish at start-up, with its passes rows (see keys.passes).
_Indexed = tuple[Record, list[tuple[bytes, bytes]]]


class Reconcile(Part):
    """Runs once, from Store's constructor, before the reaper starts and before anything
    is scheduled on the RAM worker: nothing else touches the store meanwhile, so it takes
    no lock of its own (the Entries and Integrity methods it calls take Store._cond as
    they always do).

    What it holds, and the tests that hold it:

    * temp files kvcache made are swept, anything else is left alone with a warning
      (tests/unit/test_store.py::test_start_up_sweeps_orphan_temp_files);
    * an index row whose blob is missing or of another size is dropped, the blob
      quarantined (tests/unit/test_store.py::test_index_rows_and_files_are_reconciled,
      tests/faults/test_daemon_crash.py::test_index_row_whose_file_is_gone_is_removed);
    * a blob the index does not know is re-indexed from its checksummed header, each
      piece after its parent (tests/faults/test_daemon_crash.py::
      test_blob_renamed_but_not_indexed_is_reindexed, tests/daemon/test_pieces.py::
      test_a_lost_index_is_rebuilt_parents_first). That never undoes a removal: removals
      take the files, durably, before the rows (Entries.remove_entry), so such a blob is
      a publish that a crash cut short between its rename and its index commit
      (tests/faults/test_durable_removals.py);
    * a piece whose chain is broken goes, with what is built on it
      (tests/daemon/test_pieces.py::test_start_up_drops_pieces_whose_parent_is_gone);
    * RAM flags follow the RAM tier's files, whole <key>.kvc copies only
      (tests/unit/test_store.py::test_a_ram_copy_cut_short_by_a_crash_is_not_taken_for_the_copy);
      a dropped copy is unlinked before its flag is cleared, so a copy found is never one
      a prune or an eviction dropped (tests/faults/test_durable_removals.py::
      test_a_ram_copy_dropped_by_a_prune_stays_dropped_after_a_kill);
    * an entry without passes rows gets them, its row otherwise kept (tests/unit/test_store.py::
      test_an_entry_without_passes_rows_gets_them_at_start_up_and_keeps_its_row);
    * a new block size re-keys the entries
      (tests/unit/test_store.py::test_a_new_block_size_rekeys_the_entries);
    * after a clean shutdown with nothing changed since, no entry row and no blob file is
      read, only the RAM tier's files (tests/unit/test_store.py::
      test_a_clean_restart_reads_no_entry_and_trusts_the_recorded_tally); any write to the
      index or any file added, renamed or removed in the blob folders since means the
      full reconcile (test_a_change_after_a_clean_shutdown_means_the_full_reconcile); a
      blob damaged in place since is found by the checksum of its first read
      (test_a_blob_damaged_in_place_after_a_clean_shutdown_is_found_on_read);
    * the ordering tables (kvcache.ordering) of an older index, or of one whose rows were
      dropped undecoded, are rebuilt from the rows (tests/unit/test_store.py::
      test_the_eviction_order_of_an_older_index_is_built_at_start_up)."""

    def __init__(self, core: StoreCore, entries: Entries, integrity: Integrity) -> None:
        super().__init__(core)
        self._entries = entries
        self._integrity = integrity

    def run(self) -> str:
        """Reconcile, or find that nothing needs it: CLEAN (a clean shutdown, nothing
        changed since: no entry read), RECOVER (a crash: the check is left to
        kvcache.store.recovery, in the background) or FULL (done here)."""
        self._sweep_tmp()
        if self._clean_start():
            mode = CLEAN
        elif self._after_a_crash():
            mode = RECOVER
        else:
            mode = FULL
            self._check_settings()
            on_disk = self._blob_files()
            in_ram = self._ram_copies()
            bad, without_passes = self._audit(on_disk, in_ram)
            self._reindex(on_disk, bad)
            self._add_passes(without_passes)
            if not self._index.order.in_sync:
                self._rebuild_order()
            self._drop_broken_chains()
            self._index.set_setting(DAMAGED, "")
        self._index.mark_open()
        return mode

    def _after_a_crash(self) -> bool:
        """Whether the last daemon was killed and nothing else changed about the index
        (block size, schema, eviction tables in step, no damaged rows found): then the
        tally is the index's sums and the rest can be checked while serving."""
        index, cfg = self._index, self._config
        if index.has_shutdown_record() or index.get_setting(DAMAGED) \
                or index.get_setting("block_size") != str(cfg.block_size) \
                or index.get_setting("schema") != str(SCHEMA_VERSION) \
                or not index.order.in_sync:
            return False
        self._tally.recount(index.order.tenant_usage())
        return True

    def _clean_start(self) -> bool:
        """Start from what the last clean shutdown recorded, when nothing has changed
        since: no write to the index, no file added, renamed or removed in the blob
        folders, the same block size and schema. Only the RAM tier is checked (a reboot
        empties it)."""
        state = self._index.clean_shutdown()
        if state is None or not self._index.order.in_sync or self._index.get_setting(DAMAGED):
            return False
        if (state.get("block_size") != self._config.block_size
                or state.get("schema") != SCHEMA_VERSION
                or self._index.get_setting("block_size") != str(self._config.block_size)
                or state.get("blobs") != blob_folders_signature(self._layout)):
            return False
        try:
            self._tally.restore(state)
        except ValueError:
            return False
        self._check_ram_copies()
        return True

    def _check_ram_copies(self) -> None:
        """Make the RAM flags follow the RAM tier's files: whole <key>.kvc copies only,
        one per entry. Compares the RAM tier's names with the index's list of copies and
        reads the rows of the differences only (a copy is renamed into place whole, so a
        name there is a whole copy: after a clean shutdown only a reboot changes them)."""
        in_ram = self._ram_copies()
        fixes: list[Record] = []
        for key in self._index.order.ram_keys():
            path = in_ram.pop(key, None)
            if path is not None:
                continue
            record = self._index.get(key)
            if record is None:
                continue
            self._tally.ram_copy_dropped(record)
            fixes.append(replace(record, in_ram=False))
        for key, path in in_ram.items():
            record = self._index.get(key)
            if record is not None and not record.in_ram \
                    and path.stat().st_size == record.size:
                self._tally.ram_copy_found(record)
                fixes.append(replace(record, in_ram=True))
            else:
                path.unlink(missing_ok=True)
        if fixes:
            self._index.put_many(fixes)

    def _rebuild_order(self) -> None:
        t0 = time.monotonic()
        total = self._index.count()
        log.info("building the eviction order of %d entries", total)
        self._index.rebuild_order(lambda n: log.info(
            "eviction order: %d of %d entries read (%.0f s)", n, total,
            time.monotonic() - t0))
        log.info("eviction order built in %.1f s", time.monotonic() - t0)

    def _sweep_tmp(self) -> None:
        tmp_dir = self._layout.tmp_dir
        for orphan in tmp_dir.iterdir():
            if not is_own_file_name(orphan.name) or orphan.is_dir():
                log.warning("left alone in %s: %s (not a file kvcache made)", tmp_dir,
                            orphan.name)
                continue
            orphan.unlink(missing_ok=True)
            self.counters["orphans_swept"] += 1

    def _check_settings(self) -> None:
        block_size = str(self._config.block_size)
        if self._index.get_setting("block_size") not in (None, block_size):
            # Anchors depend on the block size: rebuild the index from the blobs.
            self._index.clear()
        self._index.set_setting("block_size", block_size)
        self._index.set_setting("schema", str(SCHEMA_VERSION))

    def _blob_files(self) -> dict[bytes, Path]:
        """The disk tier's blobs by key (a misnamed one quarantined, stray temp files
        swept)."""
        on_disk: dict[bytes, Path] = {}
        for sub in self._layout.blob_dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.suffix == BLOB_SUFFIX:
                    try:
                        on_disk[keys.parse_key(path.stem)] = path
                    except ValueError:
                        self._integrity.quarantine_file(path)
                elif path.suffix == TMP_SUFFIX and is_own_file_name(path.name):
                    path.unlink(missing_ok=True)
                    self.counters["orphans_swept"] += 1
        return on_disk

    def _ram_copies(self) -> dict[bytes, Path]:
        """The RAM tier's copies by key. Only <key>.kvc is a copy: a <key>.part is one cut
        short by a crash and is removed, never taken for the copy (the entry would be
        marked in RAM with no file there)."""
        in_ram: dict[bytes, Path] = {}
        for path in self._ram_tier_files():
            if path.suffix == BLOB_SUFFIX:
                in_ram[keys.parse_key(path.stem)] = path
            else:
                path.unlink(missing_ok=True)
        return in_ram

    def _ram_tier_files(self) -> list[Path]:
        """The RAM tier's blob and temp files. Anything else there is not ours to delete
        (nor a reason to refuse to start): it is left alone, with a warning."""
        ram_dir = self._layout.ram_dir
        own = list(ramtier.own_files(ram_dir))
        names = {p.name for p in own} | {ramtier.RAM_MARKER}
        for name in sorted(set(os.listdir(ram_dir)) - names):
            log.warning("left alone in the RAM tier %s: %s (not a file kvcache made)",
                        ram_dir, name)
        return own

    def _audit(self, on_disk: dict[bytes, Path], in_ram: dict[bytes, Path]
               ) -> tuple[dict[bytes, dict[str, Any]], list[tuple[bytes, Path]]]:
        """Keep the index rows their blobs bear out and count them; drop the rest. Takes
        the kept entries' blobs out of ``on_disk`` and their copies out of ``in_ram``
        (removing the copies left over). Returns the damaged rows' usage and pin (see
        Index.audit) and the kept entries that lack passes rows."""
        # A damaged row (undecodable, or with a size, n_tokens, tail, namespace, reason...
        # its seal no longer matches) is dropped, and its blob file, left in on_disk, is
        # re-indexed from its checksummed header (_reindex): a good entry is not lost to its
        # index row, and no row is served that its blob denies
        # (tests/faults/test_corruption.py::test_campaign_damaged_index_rows_and_files_at_rest).
        good, bad = self._index.audit()
        stale: list[bytes] = list(bad)
        ram_fixes: list[Record] = []
        # Entries long enough for passes rows that have none (an index of schema 1, or a
        # start-up killed while adding them): added from their blob headers (_add_passes).
        lacking = self._index.lacking_passes(
            [r.key for r in good if r.n_tokens >= self._config.block_size])
        without_passes: list[tuple[bytes, Path]] = []
        progress = Progress("index rows checked against their blob files", len(good))
        for record in good:
            progress.step()
            path = on_disk.pop(record.key, None)
            if path is None or path.stat().st_size != record.size:
                stale.append(record.key)
                if path is not None:
                    self._integrity.quarantine_file(path)
                continue
            if record.key in lacking:
                without_passes.append((record.key, path))
            self._tally.entry_added(record)
            ram_path = in_ram.pop(record.key, None)
            has_ram = ram_path is not None and ram_path.stat().st_size == record.size
            if has_ram:
                self._tally.ram_copy_found(record)
            elif ram_path is not None:
                ram_path.unlink(missing_ok=True)
            if has_ram != record.in_ram:
                ram_fixes.append(replace(record, in_ram=has_ram))
        # One transaction each, not one per row (an fsync each): after a reboot empties
        # /dev/shm every entry needs a RAM fix.
        if stale:
            self._index.drop_rows(stale)
            self.counters["reconcile_removed"] += len(stale)
        if ram_fixes:
            self._index.put_many(ram_fixes)
        for path in in_ram.values():
            path.unlink(missing_ok=True)
        return bad, without_passes

    def _reindex(self, on_disk: dict[bytes, Path], bad: dict[bytes, dict[str, Any]]
                 ) -> None:
        """Index the blob files the index does not know (a crash between rename and index
        commit, or a lost index) from their headers."""
        block_size = self._config.block_size
        added: list[_Indexed] = []
        progress = Progress("blob files re-indexed from their headers", len(on_disk))
        for key, path in on_disk.items():
            progress.step()
            try:
                with open(path, "rb") as f:
                    header, meta = blobfmt.read_header_and_meta(f)
                    size = os.fstat(f.fileno()).st_size
                entry = keys.entry_key(meta.namespace, meta.tokens, block_size)
                if header.total_size != size:
                    raise blobfmt.BlobError("file size does not match its header")
                if entry.key != key:
                    # Keyed under another block size (the index was cleared for it): the
                    # checksummed metadata gives the key, so the file moves there rather
                    # than every entry longer than a block being quarantined.
                    target = self._layout.blob_path(entry.key)
                    if target.exists():
                        raise blobfmt.BlobError("file name does not match its header")
                    target.parent.mkdir(mode=0o700, exist_ok=True)
                    os.rename(path, target)
                    dir_fsync(target.parent)
                    path = target
            except (OSError, blobfmt.BlobError):
                self._integrity.quarantine_file(path)
                continue
            record = record_from(entry, header, meta, size)
            if entry.key in bad:  # a damaged row's hits and pin
                record = replace(record, **bad[entry.key])
            added.append((record, keys.passes(meta.namespace, meta.tokens, block_size)))
        added = self._parents_first(added)
        for record, _ in added:
            self._tally.entry_added(record)
        # A transaction per batch, parents before their pieces (an earlier batch or the
        # same one): a lost index of a million entries is not one transaction's worth of
        # dirty pages in memory.
        for start in range(0, len(added), REINDEX_BATCH):
            self._index.publish_many(added[start : start + REINDEX_BATCH])
        self.counters["reconcile_added"] += len(added)

    def _parents_first(self, items: list[_Indexed]) -> list[_Indexed]:
        """Blobs to re-index, each after its parent (one transaction publishes them, and
        a piece may be published only after its parent). A piece whose parent is neither
        indexed nor among them can never be restored: its file is removed."""
        pending = {record.key: (record, passes) for record, passes in items}
        batch = set(pending)
        waiting: dict[bytes, list[bytes]] = {}  # parent among them -> its pieces
        ready = []
        for key, (record, _) in pending.items():
            if record.parent in pending:
                waiting.setdefault(record.parent, []).append(key)
            else:
                ready.append(key)
        placed: list[_Indexed] = []
        while ready:
            key = ready.pop()
            record, passes = pending.pop(key)
            # Ready with a parent: one placed just before, or one already indexed.
            if record.parent and record.parent not in batch \
                    and self._index.get(record.parent) is None:
                self._drop_orphan_file(key)
                continue
            placed.append((record, passes))
            ready += waiting.get(key, [])
        for key in pending:  # built on a dropped one, or a cycle (only forged headers)
            self._drop_orphan_file(key)
        return placed

    def _drop_orphan_file(self, key: bytes) -> None:
        self._layout.blob_path(key).unlink(missing_ok=True)
        self.counters["reconcile_removed"] += 1

    def _add_passes(self, entries: list[tuple[bytes, Path]]) -> None:
        """Give entries without passes rows those rows (only those: their entry rows,
        RAM flags fixed by _audit included, stay as they are), from their blob headers."""
        block_size = self._config.block_size
        items = []
        for key, path in entries:
            try:
                with open(path, "rb") as f:
                    _, meta = blobfmt.read_header_and_meta(f)
            except (OSError, blobfmt.BlobError):
                continue  # left to verify and reads, which quarantine a bad blob
            if keys.entry_key(meta.namespace, meta.tokens, block_size).key == key:
                items.append((key, keys.passes(meta.namespace, meta.tokens, block_size)))
        self._index.add_passes(items)

    def _drop_broken_chains(self) -> None:
        """Remove entries whose chain is broken (a parent missing, or not holding the
        tokens the piece takes from it), with everything built on them."""
        broken = []
        for record in self._index.records():  # pieces only are looked up further
            if not record.parent:
                continue
            parent = self._index.get(record.parent)
            if parent is None or not parent.base < record.base <= parent.n_tokens:
                broken.append(record)
        for record in broken:  # (one built on another goes with it; then it is gone)
            if self._index.get(record.key) is not None:
                self._entries.remove_entry(record, "reconcile_removed")


def blob_folders_signature(layout: Layout) -> str:
    """A digest of the blob folders' names and modification times: a file added, renamed
    or removed in any of them changes it (a blob changed in place does not: its checksum
    finds that on read). One stat per folder (at most 257), no file read."""
    digest = xxhash.xxh3_64()
    with os.scandir(layout.blob_dir) as entries:
        folders = sorted((e.name, e.stat(follow_symlinks=False).st_mtime_ns)
                         for e in entries if e.is_dir(follow_symlinks=False))
    for name, mtime in [("", layout.blob_dir.stat().st_mtime_ns), *folders]:
        digest.update(f"{name}:{mtime};".encode())
    return digest.hexdigest()


def seal_clean_shutdown(index: Index, layout: Layout, config: StoreConfig,
                        tally: Tally) -> None:
    """Record a clean shutdown (the last write to the index): the tally and what the next
    start-up checks before trusting it (Reconcile._clean_start)."""
    index.mark_clean({**tally.state(), "block_size": config.block_size,
                      "schema": SCHEMA_VERSION, "blobs": blob_folders_signature(layout)})
