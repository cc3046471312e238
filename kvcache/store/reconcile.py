"""Start-up reconcile: make the index and the files agree, reading blob headers only
(never whole payloads), and count what is there into the tally and the children map."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .. import blob as blobfmt
from .. import keys, ramtier
from ..index import SCHEMA_VERSION, Index, Record, dir_fsync
from ..ownership import is_own_file_name
from .entries import record_from
from .tiers import BLOB_SUFFIX, TMP_SUFFIX

if TYPE_CHECKING:
    from .entries import Entries
    from .integrity import Integrity
    from .settings import StoreConfig
    from .tiers import Layout, Tally

log = logging.getLogger("kvcache")

# A blob to publish at start-up, with its passes rows (see keys.passes).
_Indexed = tuple[Record, list[tuple[bytes, bytes]]]


class Reconcile:
    """Runs once, from Store's constructor, before the reaper starts and before anything
    is scheduled on the RAM worker: nothing else touches the store meanwhile, so it takes
    no lock of its own (the Entries and Integrity methods it calls take Store._cond as
    they always do).

    What it holds, and the tests that hold it:

    * temp files kvcache made are swept, anything else is left alone with a warning
      (tests/test_store.py::test_start_up_sweeps_orphan_temp_files);
    * an index row whose blob is missing or of another size is dropped, the blob
      quarantined (tests/test_store.py::test_index_rows_and_files_are_reconciled,
      tests/test_daemon_crash.py::test_index_row_whose_file_is_gone_is_removed);
    * a blob the index does not know is re-indexed from its checksummed header, each
      piece after its parent (tests/test_daemon_crash.py::
      test_blob_renamed_but_not_indexed_is_reindexed, tests/test_pieces.py::
      test_a_lost_index_is_rebuilt_parents_first). That never undoes a removal: removals
      take the files, durably, before the rows (Entries.remove_entry), so such a blob is
      a publish that a crash cut short between its rename and its index commit
      (tests/test_durable_removals.py);
    * a piece whose chain is broken goes, with what is built on it
      (tests/test_pieces.py::test_start_up_drops_pieces_whose_parent_is_gone);
    * RAM flags follow the RAM tier's files, whole <key>.kvc copies only
      (tests/test_store.py::test_a_ram_copy_cut_short_by_a_crash_is_not_taken_for_the_copy);
      a dropped copy is unlinked before its flag is cleared, so a copy found is never one
      a prune or an eviction dropped (tests/test_durable_removals.py::
      test_a_ram_copy_dropped_by_a_prune_stays_dropped_after_a_kill);
    * an entry without passes rows gets them, its row otherwise kept (tests/test_store.py::
      test_an_entry_without_passes_rows_gets_them_at_start_up_and_keeps_its_row);
    * a new block size re-keys the entries
      (tests/test_store.py::test_a_new_block_size_rekeys_the_entries)."""

    def __init__(self, config: StoreConfig, layout: Layout, index: Index, entries: Entries,
                 tally: Tally, integrity: Integrity, counters: Counter[str]) -> None:
        self._config = config
        self._layout = layout
        self._index = index
        self._entries = entries
        self._tally = tally
        self._integrity = integrity
        self.counters = counters

    def run(self) -> None:
        self._sweep_tmp()
        self._check_settings()
        on_disk = self._blob_files()
        in_ram = self._ram_copies()
        bad, without_passes = self._audit(on_disk, in_ram)
        self._reindex(on_disk, bad)
        self._add_passes(without_passes)
        self._drop_broken_chains()

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
               ) -> tuple[dict[bytes, dict[str, object]], list[tuple[bytes, Path]]]:
        """Keep the index rows their blobs bear out and count them; drop the rest. Takes
        the kept entries' blobs out of ``on_disk`` and their copies out of ``in_ram``
        (removing the copies left over). Returns the damaged rows' usage and pin (see
        Index.audit) and the kept entries that lack passes rows."""
        # A damaged row (undecodable, or with a size, n_tokens, tail, namespace, reason...
        # its seal no longer matches) is dropped, and its blob file, left in on_disk, is
        # re-indexed from its checksummed header (_reindex): a good entry is not lost to its
        # index row, and no row is served that its blob denies
        # (tests/test_corruption.py::test_campaign_damaged_index_rows_and_files_at_rest).
        good, bad = self._index.audit()
        stale: list[bytes] = list(bad)
        ram_fixes: list[Record] = []
        # Entries long enough for passes rows that have none (an index of schema 1, or a
        # start-up killed while adding them): added from their blob headers (_add_passes).
        lacking = self._index.lacking_passes(
            [r.key for r in good if r.n_tokens >= self._config.block_size])
        without_passes: list[tuple[bytes, Path]] = []
        for record in good:
            path = on_disk.pop(record.key, None)
            if path is None or path.stat().st_size != record.size:
                stale.append(record.key)
                if path is not None:
                    self._integrity.quarantine_file(path)
                continue
            if record.key in lacking:
                without_passes.append((record.key, path))
            self._tally.entry_added(record)
            self._entries.add_child(record)
            ram_path = in_ram.pop(record.key, None)
            has_ram = ram_path is not None and ram_path.stat().st_size == record.size
            if has_ram:
                self._tally.ram_copy_found(record.size)
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

    def _reindex(self, on_disk: dict[bytes, Path], bad: dict[bytes, dict[str, object]]
                 ) -> None:
        """Index the blob files the index does not know (a crash between rename and index
        commit, or a lost index) from their headers."""
        block_size = self._config.block_size
        added: list[_Indexed] = []
        for key, path in on_disk.items():
            try:
                with open(path, "rb") as f:
                    header, meta = blobfmt.read_header_and_meta(f)
                entry = keys.entry_key(meta.namespace, meta.tokens, block_size)
                if header.total_size != path.stat().st_size:
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
            record = replace(record_from(entry, header, meta, path.stat().st_size),
                             **bad.get(entry.key, {}))  # a damaged row's hits and pin
            added.append((record, keys.passes(meta.namespace, meta.tokens, block_size)))
        added = self._parents_first(added)
        for record, _ in added:
            self._tally.entry_added(record)
            self._entries.add_child(record)
        if added:
            self._index.publish_many(added)
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
        records = {r.key: r for r in self._index.records()}
        for record in records.values():
            parent = records.get(record.parent)
            if record.parent and (parent is None
                                  or not parent.base < record.base <= parent.n_tokens):
                self._entries.remove_entry(record, "reconcile_removed")
