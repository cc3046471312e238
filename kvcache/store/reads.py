"""Reads: what keeps an entry (and what it is built on) from going while it is used, and
opening, streaming and releasing reads of published entries."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .. import blob as blobfmt
from .. import keys
from ..common import TIER_DISK, TIER_RAM
from ..errors import Corrupt, LeaseLost, NotFound, WaitTimeout
from ..index import Index, Record

if TYPE_CHECKING:
    from .integrity import Integrity
    from .reservations import LeaseTable
    from .settings import StoreConfig
    from .tiers import Layout, RamPlacer


@dataclass(frozen=True)
class ReadPin:
    pin_id: str
    key: bytes
    path: Path
    size: int
    tier: str


class ReadPins:
    """Holds on entries, and the reads not yet written to the index.

    An entry is *held* while its in-use count is above zero: by each read pin on it (until
    released or expired), by a piece being saved on it (until commit or abort), by its RAM
    placement and by a check of its copies. A held entry is not evicted, pruned, deleted
    or dropped from RAM, and neither is anything it is built on (policy.leaf_first_order
    leaves out their ancestors): tests/test_store.py::
    test_eviction_never_takes_pinned_or_in_use_entries and tests/test_pieces.py::
    test_pins_and_reads_protect_what_an_entry_is_built_on.

    Reads are counted here as they happen (hits and last use per key) and written to the
    index about once a second; eviction order and prune filters take them into account.

    Not thread-safe: every method is called with Store._cond held; ``on_free`` (its
    notify_all) is called whenever an entry stops being held, for deletes waiting on it."""

    def __init__(self, on_free: Callable[[], None]) -> None:
        self.pins: dict[str, tuple[bytes, float]] = {}  # pin_id -> (key, expires)
        self.in_use: Counter[bytes] = Counter()
        self._pending_use: dict[bytes, list[float]] = {}  # key -> [hits, last_used]
        self._on_free = on_free

    def hold(self, key: bytes) -> None:
        self.in_use[key] += 1

    def release(self, key: bytes) -> None:
        self.in_use[key] -= 1
        if self.in_use[key] <= 0:
            del self.in_use[key]
            self._on_free()

    def is_held(self, key: bytes) -> bool:
        return bool(self.in_use.get(key))

    def is_read(self, key: bytes) -> bool:
        """Whether a client holds a read pin on ``key`` (not only the daemon's own work)."""
        return any(k == key for k, _expires in self.pins.values())

    def busy(self) -> set[bytes]:
        """The keys held now."""
        return set(self.in_use)

    def pin(self, key: bytes, seconds: float) -> str:
        """A read pin on ``key`` (it holds the entry) for ``seconds``; returns its id."""
        pin_id = secrets.token_hex(16)
        self.pins[pin_id] = (key, time.monotonic() + seconds)
        self.in_use[key] += 1
        return pin_id

    def unpin(self, pin_id: str) -> bytes | None:
        """Release a read pin; the key it held, None for an unknown or expired pin."""
        pinned = self.pins.pop(pin_id, None)
        if pinned is None:
            return None
        self.release(pinned[0])
        return pinned[0]

    def expire(self, now: float) -> int:
        """Release the pins whose time is up (monotonic ``now``); how many there were."""
        expired = 0
        for pin_id, (key, expires) in list(self.pins.items()):
            if expires < now:
                del self.pins[pin_id]
                self.release(key)
                expired += 1
        return expired

    def note_read(self, key: bytes) -> None:
        usage = self._pending_use.setdefault(key, [0, 0.0])
        usage[0] += 1
        usage[1] = time.time()

    def usage(self, key: bytes) -> list[float] | None:
        """``[hits, last_used]`` not yet written to the index, if any."""
        return self._pending_use.get(key)

    def all_usage(self) -> dict[bytes, list[float]]:
        """Every ``[hits, last_used]`` not yet written to the index (a copy)."""
        return {k: list(v) for k, v in self._pending_use.items()}

    def last_used(self) -> dict[bytes, float]:
        """The last read per key, for reads not yet written to the index."""
        return {k: v[1] for k, v in self._pending_use.items()}

    def forget_usage(self, key: bytes) -> None:
        self._pending_use.pop(key, None)

    def take_usage(self) -> dict[bytes, list[float]]:
        """Everything not yet written to the index, which starts afresh."""
        pending, self._pending_use = self._pending_use, {}
        return pending


def with_usage(record: Record, usage: list[float] | None) -> Record:
    """``record`` with the reads not yet written to the index counted in."""
    if not usage:
        return record
    return replace(record, hits=record.hits + int(usage[0]),
                   last_used=max(record.last_used, usage[1]))


class Reads:
    """Opens, streams and releases reads. Thread-safe: takes Store._cond around the pins
    (and waits on it for an entry being written); streams files without it."""

    def __init__(self, config: StoreConfig, layout: Layout, index: Index, pins: ReadPins,
                 leases: LeaseTable, placer: RamPlacer, integrity: Integrity,
                 counters: Counter[str], cond: threading.Condition) -> None:
        self._config = config
        self._layout = layout
        self._index = index
        self._pins = pins
        self._leases = leases
        self._placer = placer
        self._integrity = integrity
        self.counters = counters
        self._cond = cond

    def open_read(self, key: bytes, wait_ms: int = 0) -> ReadPin:
        """Pin a published entry for reading and say where its bytes are. A key being
        written is waited for, up to ``wait_ms``, on Store._cond (a commit or an abort
        wakes the waiters)."""
        deadline = time.monotonic() + wait_ms / 1000.0
        waited = False
        with self._cond:
            while True:
                record = self._index.get(key)
                if record is not None:
                    break
                if not self._leases.writing(key):
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

    def iter_read(self, key: bytes, wait_ms: int = 0,
                  chunk_bytes: int = 1 << 20) -> tuple[ReadPin, Iterator[memoryview]]:
        """Stream an entry's bytes, verifying them as they go; a bad blob is quarantined
        and the iterator raises Corrupt at its end."""
        pin = self.open_read(key, wait_ms)

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
                # never UNKNOWN (tests/test_corruption.py::test_campaign_damaged_blob_files).
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
