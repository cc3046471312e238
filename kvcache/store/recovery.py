"""Recovery after a crash, in the background: the daemon serves at once, and the index
and the blob files are brought to agree a folder at a time while it does.

After a kill nothing in the index can be trusted to match the files without a look:
a removal cut short leaves rows whose blob is gone, a publish cut short a blob without
its row, a RAM copy may be gone (a reboot empties the RAM tier). The full reconcile
(kvcache.store.reconcile) looks at every row and file before the daemon answers; at a
million entries that is most of a minute of darkness. Instead, when the last daemon was
killed (no clean-shutdown record) and nothing else changed about the index (block size,
schema, its eviction tables in step), start-up takes the byte tally from the sums the
index keeps in the rows' own transactions (kvcache.index_sums) and serves, and this
thread checks the 256 blob folders in order, each against the index rows of its keys
(a folder holds the keys of one first byte: one range of the index):

* a row whose blob is gone or of another size goes, with what is built on it (the blob
  quarantined) (reconcile_removed);
* a RAM flag whose copy is gone is cleared; a RAM copy nobody claims is removed;
* a blob without a row is indexed from its checksummed header (reconcile_added), a
  piece once its parent is; one whose parent never comes is removed; an entry without
  its passes rows gets them;
* a damaged row (undecodable, not matching its seal: only something else than this
  daemon makes one) is not served, and the index is marked so that the next start-up
  runs the full reconcile, which rebuilds it from its blob (rebuilding it here would
  mean rebuilding the eviction tables while saves change them);
* each folder's temp and misnamed files are swept or quarantined, as at any start-up.

Meanwhile an entry is served only once checked (StoreCore.unchecked): a read or a save of
one not yet reached checks it first (Integrity.check_if_unchecked), and the read verifies
every checksum of what it serves, as every read does. Every fix is made under the store
lock after looking again, so a save, an eviction, a read or a delete running beside it is
never undone: a key in flight is left to its save, a key held or leaving to its holder.
``kvcache stats`` shows the progress. tests/unit/test_recovery.py holds it;
tests/faults/test_durable_removals.py kills it at every step, and
tests/faults/test_daemon_crash.py kills a daemon in the middle of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from .. import blob as blobfmt
from .. import keys
from ..index import ParentGone, Record
from .core import BLOB_SUFFIX, TMP_SUFFIX, Part, StoreCore
from .core import RecoveryProgress as Progress
from .entries import Entries, record_from
from .integrity import Integrity, file_size
from .ownership import is_own_file_name
from .reconcile import DAMAGED

log = logging.getLogger("kvcache")
FOLDERS = 256
# A pause between folders: the thread gives way to requests (it competes with them for
# the interpreter) without stretching the pass much (256 pauses).
FOLDER_PAUSE_SECONDS = 0.005


class Recovery(Part):
    """The background check after a crash (see the module docstring). Its thread takes
    Store._cond for each fix and for the bookkeeping, never while it lists a folder, reads
    index rows or a blob header."""

    def __init__(self, core: StoreCore, entries: Entries, integrity: Integrity) -> None:
        super().__init__(core)
        self._entries = entries
        self._integrity = integrity
        self._closed = core.closed
        self.progress = Progress()
        self._thread: threading.Thread | None = None
        self._waiting_pieces: list[tuple[Record, list[tuple[bytes, bytes]]]] = []
        self._damaged: set[bytes] = set()  # rows that failed their audit: left alone
        # Pieces whose parent was not there when seen: their chains are checked at the end
        # (only those: no list of every piece of the index is kept).
        self._pieces: list[bytes] = []

    def start(self) -> None:
        """Start the check (the store serves meanwhile)."""
        with self._cond:
            self._unchecked.start()
            self.progress = Progress("running", self._index.count(), started=time.monotonic())
        self._thread = threading.Thread(target=self._run, name="kvcache-recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let the thread end (Store.closed is set): a later start-up checks again."""
        if self._thread is not None:
            self._thread.join(timeout=60)

    def snapshot(self) -> Progress:
        with self._cond:
            p = self.progress
            seconds = p.seconds if p.state != "running" else time.monotonic() - p.started
            return Progress(p.state, p.entries, p.entries_checked, p.folders_checked,
                            self._unchecked.checked_on_read, p.started, seconds)

    def _run(self) -> None:
        try:
            for folder in range(FOLDERS):
                if self._closed.is_set():
                    return
                self._check_folder(folder)
                with self._cond:
                    self._unchecked.folder_checked(folder)
                    self.progress.folders_checked = folder + 1
                self._closed.wait(FOLDER_PAUSE_SECONDS)
            self._finish()
        except Exception:
            # The entries not reached stay checked on read; the next start-up (killed or
            # not, the clean-shutdown record is not written while unfinished) checks again.
            log.exception("the start-up recovery failed; unchecked entries are checked as "
                          "they are read")
            with self._cond:
                self.progress.state = "failed"
            return
        with self._cond:
            self._unchecked.finish()
            self.progress.state = "done"
            self.progress.seconds = time.monotonic() - self.progress.started
        log.info("start-up recovery: %d entries checked in %.1f s",
                 self.progress.entries_checked, self.progress.seconds)

    @property
    def finished(self) -> bool:
        return self.progress.state in ("none", "done")

    # -- one folder -------------------------------------------------------------------------

    def _check_folder(self, folder: int) -> None:
        files = self._folder_files(folder)
        start = bytes([folder])
        good, damaged = self._index.audit(start, bytes([folder + 1]) if folder < 255 else None)
        self._damaged.update(damaged)
        with self._cond:
            self._unchecked.damaged.update(damaged)
        stale: list[Record] = []
        ram_gone: list[Record] = []
        for record in good:
            size = files.pop(record.key, None)
            if size != record.size:
                stale.append(record)
            elif record.in_ram and file_size(self._layout.ram_path(record.key)) != record.size:
                ram_gone.append(record)
            if record.parent and not self._chain_holds(record):
                self._pieces.append(record.key)  # looked at again at the end
        for key in damaged:
            files.pop(key, None)  # rebuilt from its blob by the next full reconcile
        self._drop_stale(stale)
        self._drop_ram_flags(ram_gone)
        self._add_passes(good)
        self._index_orphans(files)
        with self._cond:
            self.progress.entries_checked += len(good) + len(damaged)

    def _chain_holds(self, piece: Record) -> bool:
        """Whether a piece's parent is there and holds the tokens the piece takes from it
        (a parent in a folder not yet checked may still go: removing it takes the piece)."""
        parent = self._index.get(piece.parent)
        return parent is not None and parent.base < piece.base <= parent.n_tokens

    def _folder_files(self, folder: int) -> dict[bytes, int]:
        """The blob files of one folder by key, with their sizes; a misnamed one is
        quarantined, a temp file of kvcache's swept."""
        path = self._layout.blob_dir / f"{folder:02x}"
        files: dict[bytes, int] = {}
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return files
        for entry in entries:
            name = Path(entry.name)
            if name.suffix == BLOB_SUFFIX:
                try:
                    key = keys.parse_key(name.stem)
                except ValueError:
                    self._integrity.quarantine_file(Path(entry.path))
                    continue
                if key[0] != folder:  # filed in another folder than its key's
                    self._integrity.quarantine_file(Path(entry.path))
                    continue
                try:
                    files[key] = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:  # removed meanwhile
                    continue
            elif name.suffix == TMP_SUFFIX and is_own_file_name(entry.name):
                Path(entry.path).unlink(missing_ok=True)
                with self._cond:
                    self.counters["orphans_swept"] += 1
        return files

    def _settled(self, key: bytes) -> bool:
        """Whether nobody is working on ``key`` now (not held, leaving or being saved), so
        what was seen of it a moment ago may be acted on. Store._cond held."""
        return not (self._pins.is_held(key) or key in self._leaving
                    or key in self._leases.in_flight)

    def _drop_stale(self, stale: list[Record]) -> None:
        """Rows whose blob is gone or of another size: looked at again under the lock,
        then removed with what is built on them (one index transaction)."""
        if not stale:
            return
        with self._cond:
            gone = []
            for record in stale:
                now = self._index.get(record.key)
                path = self._layout.blob_path(record.key)
                if now is None or not self._settled(record.key) \
                        or file_size(path) == now.size:
                    continue
                self._integrity.quarantine_file(path)  # a blob of another size: kept
                gone.append(now)
            self._entries.remove_entries(gone, "reconcile_removed")

    def _drop_ram_flags(self, records: list[Record]) -> None:
        """RAM flags whose copy is gone (one index transaction)."""
        if not records:
            return
        with self._cond:
            wrong = [r.key for r in records if self._settled(r.key)
                     and (now := self._index.get(r.key)) is not None and now.in_ram
                     and file_size(self._layout.ram_path(r.key)) != now.size]
            for key in wrong:
                self._layout.ram_path(key).unlink(missing_ok=True)
            for dropped in self._index.update_many(wrong, in_ram=False):
                self._tally.ram_copy_dropped(dropped)

    def _add_passes(self, good: list[Record]) -> None:
        """Entries long enough for passes rows that have none (a start-up killed while
        adding them) get them from their blob headers, their rows otherwise kept."""
        block_size = self._config.block_size
        lacking = self._index.lacking_passes(
            [r.key for r in good if r.n_tokens >= block_size])
        items = []
        for key in lacking:
            try:
                with open(self._layout.blob_path(key), "rb") as f:
                    _, meta = blobfmt.read_header_and_meta(f)
            except (OSError, blobfmt.BlobError):
                continue  # left to reads and verify, which quarantine a bad blob
            if keys.entry_key(meta.namespace, meta.tokens, block_size).key == key:
                items.append((key, keys.passes(meta.namespace, meta.tokens, block_size)))
        if items:
            self._index.add_passes(items)

    def _index_orphans(self, files: dict[bytes, int]) -> None:
        """Blob files without a row: indexed from their headers (a piece whose parent is
        not published yet waits for the end)."""
        for key in files:
            indexed = self._read_header(key)
            if indexed is not None:
                self._publish(*indexed)

    def _read_header(self, key: bytes) -> tuple[Record, list[tuple[bytes, bytes]]] | None:
        path = self._layout.blob_path(key)
        try:
            with open(path, "rb") as f:
                header, meta = blobfmt.read_header_and_meta(f)
                size = os.fstat(f.fileno()).st_size
            entry = keys.entry_key(meta.namespace, meta.tokens, self._config.block_size)
            if header.total_size != size or entry.key != key:
                raise blobfmt.BlobError("the file does not match its header")
        except FileNotFoundError:
            return None  # removed meanwhile
        except (OSError, blobfmt.BlobError):
            with self._cond:
                if self._settled(key) and self._index.get(key) is None:
                    self._integrity.quarantine_file(path)
            return None
        return (record_from(entry, header, meta, size),
                keys.passes(meta.namespace, meta.tokens, self._config.block_size))

    def _publish(self, record: Record, passes: list[tuple[bytes, bytes]]) -> bool:
        """Index a blob found without its row, unless a save of its key is in flight (its
        commit indexes it) or it has a row by now. False when its parent is not there."""
        with self._cond:
            if not self._settled(record.key) or self._index.get(record.key) is not None \
                    or not self._layout.blob_path(record.key).exists():
                return True
            try:
                self._index.publish_many([(record, passes)])
            except ParentGone:
                self._waiting_pieces.append((record, passes))
                return False
            self._tally.entry_added(record)
            self.counters["reconcile_added"] += 1
        return True

    # -- the end ------------------------------------------------------------------------------

    def _finish(self) -> None:
        self._place_waiting_pieces()
        self._drop_broken_chains()
        self._sweep_ram_tier()
        if self._damaged:
            log.warning("start-up recovery: %d damaged index rows (changed by something "
                        "else than kvcache); they are not served, and the next start-up "
                        "rebuilds them from their blobs", len(self._damaged))
            self._index.set_setting(DAMAGED, str(len(self._damaged)))

    def _place_waiting_pieces(self) -> None:
        """Pieces found before their parent: placed parents first; one whose parent never
        came can never be restored, and its file goes."""
        waiting, self._waiting_pieces = self._waiting_pieces, []
        while waiting:
            left = [item for item in waiting if not self._publish(*item)]
            self._waiting_pieces = []
            if len(left) == len(waiting):
                break
            waiting = left
        for record, _ in waiting:
            with self._cond:
                if self._settled(record.key) and self._index.get(record.key) is None:
                    self._layout.blob_path(record.key).unlink(missing_ok=True)
                    self.counters["reconcile_removed"] += 1

    def _drop_broken_chains(self) -> None:
        """Pieces whose parent is gone or does not hold the tokens they take from it go,
        with what is built on them (only a damaged index has any)."""
        pieces, self._pieces = self._pieces, []
        for key in pieces:
            with self._cond:
                record = self._index.get(key)
                if record is None or not record.parent or not self._settled(key):
                    continue
                parent = self._index.get(record.parent)
                if parent is None or not parent.base < record.base <= parent.n_tokens:
                    self._entries.remove_entry(record, "reconcile_removed")

    def _sweep_ram_tier(self) -> None:
        """RAM copies no row claims (a copy cut short, or one whose flag went) go, one at a
        time under the lock, read from the folder a name at a time."""
        with os.scandir(self._layout.ram_dir) as names:
            for entry in names:
                name = Path(entry.name)
                if name.suffix not in (BLOB_SUFFIX, TMP_SUFFIX):
                    continue
                try:
                    key = keys.parse_key(name.stem)
                except ValueError:
                    continue  # not ours: left alone (start-up warns about those)
                with self._cond:
                    if not self._settled(key) or key in self._damaged:
                        continue  # a copy being made, or one the full reconcile judges
                    record = self._index.get(key)
                    if name.suffix == TMP_SUFFIX or record is None or not record.in_ram:
                        Path(entry.path).unlink(missing_ok=True)
