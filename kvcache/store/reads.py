"""Reads: opening, streaming and releasing reads of published entries. What keeps an
entry (and what it is built on) from going while it is read is ReadPins, in the core."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import BinaryIO

from .. import blob as blobfmt
from .. import keys
from ..common import TIER_DISK, TIER_RAM
from ..errors import Corrupt, LeaseLost, NotFound, WaitTimeout
from ..record import Record
from .core import Part, ReadPin, Seen, StoreCore, with_usage
from .integrity import Integrity
from .placement import RamPlacer


class Reads(Part):
    """Opens, streams and releases reads. Thread-safe: takes Store._cond around the pins
    (and waits on it for an entry being written); streams files without it."""

    def __init__(self, core: StoreCore, placer: RamPlacer, integrity: Integrity) -> None:
        super().__init__(core)
        self._placer = placer
        self._integrity = integrity

    def open_read(self, key: bytes, wait_ms: int = 0, tenants: Seen = None) -> ReadPin:
        """Pin a published entry for reading and say where its bytes are. A key being
        written is waited for, up to ``wait_ms``, on Store._cond (a commit or an abort
        wakes the waiters). Another tenant's entry (``tenants``) is a key nobody saved.
        After a crash, an entry the recovery has not reached is checked first
        (Integrity.check_if_unchecked)."""
        deadline = time.monotonic() + wait_ms / 1000.0
        waited = False
        if not self._integrity.check_if_unchecked(key):
            with self._cond:
                self.counters["read_misses"] += 1
            raise NotFound(f"entry {key.hex()} is damaged in the index; the next start-up "
                           "rebuilds it from its blob")
        with self._cond:
            while True:
                record = self._core.visible(key, tenants)
                if record is not None:
                    break
                if not self._leases.writing(key, tenants):
                    if waited:
                        self.counters["read_wait_aborted"] += 1
                        raise NotFound(f"the in-flight save of {key.hex()} was aborted")
                    self.counters["read_misses"] += 1
                    raise NotFound(f"no entry {key.hex()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.counters["read_wait_timeouts" if waited else "read_misses"] += 1
                    raise WaitTimeout(f"entry {key.hex()} is still being written")
                if not waited:
                    self.counters["read_waits"] += 1
                waited = True
                self._cond.wait(remaining)
            ram_path = self._layout.ram_path(key)
            if record.in_ram:
                path, tier = ram_path, TIER_RAM
            else:
                path, tier = self._layout.blob_path(key), TIER_DISK
            pin_id = self._pins.pin(key, self._config.pin_seconds)
            self._pins.note_read(key)
            self.counters["reads"] += 1
            self.counters[f"reads_{tier}"] += 1
        if tier == TIER_DISK:
            self._placer.schedule(key)  # promote on a disk hit
        return ReadPin(pin_id, key, path, record.size, tier)

    def release_read(self, pin_id: str, corrupt: bool = False) -> bool:
        """Unpin a read. With ``corrupt``, re-verify the entry and quarantine it if bad."""
        with self._cond:
            key = self._pins.unpin(pin_id)
            if key is None:
                raise LeaseLost(f"unknown or expired read pin {pin_id!r}")
        if corrupt:
            return self._integrity.check_entry(key) is not None
        return False

    def _open_pinned(self, pin: ReadPin) -> BinaryIO:
        try:
            return open(pin.path, "rb", buffering=0)  # noqa: SIM115 - returned to the caller
        except FileNotFoundError:  # its RAM copy was dropped since: the disk copy remains
            return open(self._layout.blob_path(pin.key), "rb", buffering=0)  # noqa: SIM115

    def iter_read(self, key: bytes, wait_ms: int = 0, chunk_bytes: int = 1 << 20,
                  tenants: Seen = None) -> tuple[ReadPin, Iterator[memoryview]]:
        """Stream an entry's bytes, verifying them as they go; a bad blob is quarantined
        and the iterator raises Corrupt at its end."""
        pin = self.open_read(key, wait_ms, tenants)

        def chunks() -> Iterator[memoryview]:
            corrupt = False
            try:
                verifier = blobfmt.StreamVerifier(pin.size)
                with self._open_pinned(pin) as f:
                    while True:
                        buf = f.read(chunk_bytes)
                        if not buf:
                            break
                        verifier.feed(buf)
                        yield memoryview(buf)
                _, meta = verifier.finish()
                # Checksums also pass a valid blob of another entry (a swapped or misplaced
                # file): its own namespace and tokens must give the key asked for.
                if keys.entry_key(meta.namespace, meta.tokens,
                                  self._config.block_size).key != key:
                    raise blobfmt.BlobError("the blob holds another entry (its key differs)")
            except (blobfmt.BlobError, OSError) as exc:
                # A file that is gone or unreadable (OSError) is as bad as a failed checksum:
                # the entry is checked and quarantined, and the reader gets Corrupt (DATA_LOSS),
                # never UNKNOWN (tests/faults/test_corruption.py::test_campaign_damaged_blob_files).
                corrupt = True
                raise Corrupt(f"entry {key.hex()} failed verification ({exc}); quarantined") \
                    from None
            finally:
                with contextlib.suppress(LeaseLost):
                    self.release_read(pin.pin_id, corrupt=corrupt)

        return pin, chunks()

    def with_pending(self, record: Record) -> Record:
        """``record`` with the reads not yet written to the index counted in."""
        with self._cond:
            usage = self._pins.usage(record.key)
        return with_usage(record, usage)
