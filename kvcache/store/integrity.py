"""Integrity: checking an entry's copies against their checksums and its index row,
quarantining bad ones, the check of an entry read before the recovery after a crash has
reached it, and Inspect (which shows a blob's header only once it is known to be the
entry's own)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from .. import blob as blobfmt
from .. import keys
from ..errors import Corrupt, NotFound, StoreError
from ..record import Record
from .core import Part, Seen, StoreCore
from .entries import Entries, RamCopies

# Verify's answer for a key with no entry (nothing was checked, nothing moved).
NO_SUCH_ENTRY = "no such entry"


def file_size(path: Path) -> int | None:
    """The size of the file at ``path``; None when there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


class Integrity(Part):
    """Checks and quarantine. A bad disk copy takes its entry and everything built on it;
    a bad RAM copy (the disk copy good) only the copy.

    Thread-safe: an entry is held like a read while its copies are checked, so no
    eviction, delete or RAM drop takes a file from under the check (tests/faults/test_load.py::
    test_verify_holds_the_entry_it_checks). Store._cond is taken around the hold and the
    quarantine bookkeeping, never while a file is read."""

    def __init__(self, core: StoreCore, entries: Entries, ram: RamCopies) -> None:
        super().__init__(core)
        self._entries = entries
        self._ram = ram

    def check_entry(self, key: bytes, *, quarantine: bool = True) -> str | None:
        """Verify every copy of an entry; quarantine it if any is bad (unless not
        ``quarantine``: an operator's check-only run moves nothing). Returns the error."""
        with self._cond:
            if self._core.visible(key) is None:  # gone, or being removed
                return None
            self._pins.hold(key)
        try:
            return self._check_held(key, quarantine)
        finally:
            with self._cond:
                self._pins.release(key)

    def _check_held(self, key: bytes, quarantine: bool = True) -> str | None:
        record = self._index.get(key)
        if record is None:
            return None
        paths = [self._layout.blob_path(key)] + (
            [self._layout.ram_path(key)] if record.in_ram else [])
        for path in paths:
            try:
                with open(path, "rb") as f:
                    header, meta = blobfmt.verify_file(f)
                if header.total_size != record.size or \
                        keys.entry_key(meta.namespace, meta.tokens,
                                       self._config.block_size).key != key:
                    raise blobfmt.BlobError("blob does not match its index entry")
            except (OSError, blobfmt.BlobError) as exc:
                if quarantine and path == paths[0]:
                    self.quarantine(key)
                elif quarantine:
                    # Only the RAM copy is bad and the disk copy just verified: keep the entry
                    # (served from disk, promoted again by a later hit), drop the copy.
                    self._quarantine_ram_copy(key)
                return f"{path.name}: {exc}"
        return None

    def check_if_unchecked(self, key: bytes) -> bool:
        """After a crash, an entry the background recovery (kvcache.store.recovery) has not
        reached is checked before a read or a save relies on it, as the recovery would
        check it: its row against its seal, its files against its row. A row whose blob is
        gone or of another size goes with what is built on it (reconcile_removed: the
        entry is a miss, and a save of its tokens is a new save, not "already present");
        a RAM flag whose copy is gone is cleared. Its checksums are left to the read,
        which verifies every byte it serves (the stream here, the client on the same-host
        path). False for a damaged row: not served until the next start-up rebuilds it
        from its blob (tests/unit/test_recovery.py)."""
        with self._cond:
            if key in self._unchecked.damaged:
                return False
            if not self._unchecked.holds(key):
                return True
        good, bad = self._index.audit(key, key + b"\0")  # this one row
        if bad:
            with self._cond:
                self._unchecked.damaged.add(key)
            return False
        if not good:
            return True  # no entry: the read says so
        record = good[0]
        path = self._layout.blob_path(key)
        with self._cond:
            if self._core.visible(key) is None or not self._unchecked.holds(key):
                return True  # gone or checked meanwhile: nothing to do
            if file_size(path) != record.size:
                if not self._pins.is_held(key):  # held: its reader's check decides
                    self.quarantine_file(path)  # kept for post-mortems (if it is there)
                    self._entries.remove_entry(record, "reconcile_removed")
                return True
            if record.in_ram and file_size(self._layout.ram_path(key)) != record.size:
                self._layout.ram_path(key).unlink(missing_ok=True)
                for dropped in self._index.update_many([key], in_ram=False):
                    self._tally.ram_copy_dropped(dropped)
            self._unchecked.checked(key, on_read=True)
        return True

    def _quarantine_ram_copy(self, key: bytes) -> None:
        with self._cond:  # evictions drop copies under it too: ram_used is reduced once
            record = self._index.get(key)
            if record is None or not record.in_ram:
                return
            # /dev/shm is another file system, where the move fails: the drop then unlinks
            # it (left there, a restart would take it for a good copy again).
            self.quarantine_file(self._layout.ram_path(key))
            self._ram.drop_ram_copy(record, "corrupt_blobs")

    def quarantine(self, key: bytes) -> None:
        record = self._index.get(key)
        if record is None:
            return
        self.quarantine_file(self._layout.blob_path(key))  # kept for post-mortems
        self._entries.remove_entry(record, "corrupt_blobs")

    def quarantine_file(self, path: Path) -> None:
        """Move a bad file aside (counted only when there was one to move)."""
        target = self._layout.quarantine_dir / f"{path.name}.{int(time.time() * 1000)}"
        try:
            os.replace(path, target)
        except OSError:
            return
        with self._cond:
            self.counters["quarantined_files"] += 1

    def verify(self, keys_: list[bytes] | None = None, *, check_only: bool = False
               ) -> Iterator[tuple[bytes, str | None, int, int]]:
        """Check the given entries (every entry when none is given): ``(key, error or None,
        done, total)`` per entry. Bad ones are quarantined unless ``check_only``."""
        total = len(keys_) if keys_ else self._index.count()
        todo = keys_ if keys_ else self._index.iter_keys()
        for i, key in enumerate(todo, 1):
            if self._index.get(key) is None:
                if not keys_:
                    # Listed, then evicted or deleted: gone, not bad, and not reported
                    # (tests/faults/test_load.py::test_verify_skips_entries_removed_while_it_runs).
                    continue
                yield key, NO_SUCH_ENTRY, i, total
                continue
            yield key, self.check_entry(key, quarantine=not check_only), i, max(i, total)

    def inspect(self, key: bytes, tenants: Seen = None
                ) -> tuple[Record, blobfmt.BlobHeader, blobfmt.BlobMeta, Path]:
        """Metadata of an entry (its tokens among them); an entry of a tenant the caller
        may not see (``tenants``) is reported missing before its file is touched (so not
        even its corruption shows)."""
        record = self._entries.get(key, tenants)
        path = self._layout.blob_path(key)
        try:
            with open(path, "rb") as f:
                header, meta = blobfmt.read_header_and_meta(f)
            # A valid blob of another entry (a swapped file) would show its tokens, perhaps
            # another tenant's: it must be this entry's before any of it is shown.
            if header.total_size != record.size or keys.entry_key(
                    meta.namespace, meta.tokens, self._config.block_size).key != key:
                raise blobfmt.BlobError("the blob holds another entry")
        except (OSError, blobfmt.BlobError) as exc:
            # Judged by the full check, which holds the entry: one evicted meanwhile is
            # missing, not corrupt, and a passing error never quarantines a good blob.
            error = self.check_entry(key)
            if error is not None:
                raise Corrupt(f"entry {key.hex()} is unreadable ({error}); quarantined") \
                    from None
            if self._index.get(key) is None:
                raise NotFound(f"no entry {key.hex()}") from None
            raise StoreError(f"entry {key.hex()} could not be read: {exc}") from None
        return record, header, meta, path
