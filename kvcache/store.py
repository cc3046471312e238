"""The store: blob files in a disk tier and a RAM tier, the index, and the
reservation-then-publish protocol. Thread-safe; the gRPC service is a thin layer on it.

Layout under the data directory (its subfolders owner-only)::

    index/            LMDB index
    blobs/ab/<key>.kvc  published blobs (disk tier); every entry is here (write-through)
    tmp/<lease>.part  blobs being written; swept at start-up
    quarantine/       blobs that failed a checksum, kept for post-mortems

The directory carries a ``.kvcache`` marker; kvcache refuses a directory it did not make
(see kvcache.ownership). The RAM tier is a folder of its own on a memory filesystem
(``/dev/shm/kvcache-<uid>-<tag>`` by default; see kvcache.ramtier) holding copies of hot
blobs. Being a file system, it lets a same-host reader open the blob
directly (the fast path) while the entry is pinned by its read.

Publish protocol: reserve (lease) -> write chunks to tmp (verified as they arrive) ->
commit: verify size and checksums, fsync, rename into blobs/, fsync the directory, one
LMDB transaction makes it visible, waiters wake. A crash before the LMDB commit leaves at
worst a tmp file (swept) or an unindexed blob (re-indexed from its header at start-up).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import lmdb

from . import blob as blobfmt
from . import keys, ramtier
from .counters import COUNTERS
from .errors import (
    Busy,
    Corrupt,
    DirectoryInUse,
    InvalidArgument,
    LeaseLost,
    NotFound,
    OutOfRange,
    StoreError,
    StoreFull,
    WaitTimeout,
)
from .index import SCHEMA_VERSION, Index, ParentGone, Record, dir_fsync
from .ownership import claim_data_dir, is_own_file_name
from .policy import eviction_order, leaf_first_order

log = logging.getLogger("kvcache")
GiB = 1 << 30
BLOB_SUFFIX = ".kvc"
TMP_SUFFIX = ".part"
TIER_RAM = "ram"
# Verify's answer for a key with no entry (nothing was checked, nothing moved).
NO_SUCH_ENTRY = "no such entry"
TIER_DISK = "disk"


@dataclass(frozen=True)
class StoreConfig:
    root: Path
    # The folder the RAM tier's own subfolder is made in (see kvcache.ramtier); None: a
    # memory file system (/dev/shm) when there is one.
    ram_dir: Path | None = None
    ram_bytes: int = 2 * GiB
    disk_bytes: int = 50 * GiB
    min_free_bytes: int = 1 * GiB
    block_size: int = 256
    lease_seconds: float = 30.0
    pin_seconds: float = 60.0
    max_tokens: int = 1 << 20
    max_blob_bytes: int = 16 * GiB
    usage_flush_seconds: float = 1.0


@dataclass
class Reservation:
    lease_id: str
    key: keys.EntryKey
    namespace: bytes
    model_fingerprint: str
    reason: str
    size: int
    tmp_path: Path
    expires: float
    verifier: blobfmt.StreamVerifier
    file: object | None = None  # raw file object while streaming
    written: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    tenant_id: str | None = None  # the reserving identity's; None: not checked
    parent: bytes = b""  # a piece's parent, held (like a read) until commit or abort
    base: int = 0


@dataclass(frozen=True)
class ReadPin:
    pin_id: str
    key: bytes
    path: Path
    size: int
    tier: str


@dataclass(frozen=True)
class ReserveResult:
    status: str  # granted | already_present | in_flight
    key: bytes
    lease_id: str = ""
    local_path: str = ""


@dataclass(frozen=True)
class PruneResult:
    removed: list[Record]
    bytes_freed: int
    skipped_pinned: int
    skipped_in_use: int
    skipped_shared: int = 0  # kept because entries outside the filters are built on them
    ram_dropped: int = 0  # RAM copies dropped (or, in a dry run, that would be)
    ram_bytes_freed: int = 0
    ram_dropped_entries: list[Record] = field(default_factory=list)


@dataclass
class _PrunePlan:
    """What one prune removes, drops and leaves alone (each entry counted once)."""

    busy: set[bytes]
    removed: list[Record] = field(default_factory=list)
    ram_dropped: list[Record] = field(default_factory=list)
    pinned: set[bytes] = field(default_factory=set)
    in_use: set[bytes] = field(default_factory=set)
    shared: int = 0  # candidates kept because other entries are built on them

    def may_touch(self, record: Record) -> bool:
        """False for pinned entries and entries being read (noted as skipped)."""
        if record.pinned:
            self.pinned.add(record.key)
            return False
        if record.key in self.busy:
            self.in_use.add(record.key)
            return False
        return True


class Store:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.root = config.root
        self.ram_dir = ramtier.tier_dir(config.root, config.ram_dir)
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        claim_data_dir(self.root)
        # Owner-only from creation: these hold the cached prompts. The data directory
        # itself keeps whatever mode it was given.
        for d in (self.blob_dir, self.tmp_dir, self.quarantine_dir):
            d.mkdir(mode=0o700, exist_ok=True)
        self._lock_file = self._lock_data_dir()
        ram_lock, index = -1, None
        try:
            ram_lock = ramtier.claim_tier(self.ram_dir, self.root)
            index = Index(self.root / "index")
            self._ram_lock, self.index = ram_lock, index
            self._start()
        except BaseException:
            # Nothing stays held by a store that did not start: a later attempt in this
            # process must not be told the directory or its RAM tier is in use.
            if index is not None:
                index.close()
            if ram_lock >= 0:
                os.close(ram_lock)
            self._lock_file.close()
            raise

    def _start(self) -> None:
        self.counters: Counter[str] = Counter()
        self.started = time.time()
        self._cond = threading.Condition(threading.RLock())
        self._reservations: dict[str, Reservation] = {}
        self._in_flight: dict[bytes, str] = {}  # key -> lease_id
        self._pins: dict[str, tuple[bytes, float]] = {}  # pin_id -> (key, expires)
        self._in_use: Counter[bytes] = Counter()
        self._pending_use: dict[bytes, list[float]] = {}  # key -> [hits, last_used]
        # Bytes per tier and RAM entries, kept as they change (Stats and every metrics scrape
        # read them; counting index rows each time cost ~20 ms at 10,000 entries).
        self.disk_used = 0
        self.ram_used = 0
        self.ram_entries = 0  # the index counts disk entries itself (every entry is on disk)
        self.reserved_bytes = 0
        self.logical_bytes = 0  # sum of Record.logical_size: what whole states would take
        # parent -> the pieces built on it (published ones), kept as they change: eviction
        # takes only leaves, and removing an entry removes what is built on it.
        self._children: dict[bytes, set[bytes]] = {}
        self._closed = threading.Event()
        self._ram_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-ram")
        self._ram_scheduled: set[bytes] = set()
        self._reconcile()
        self._reaper = threading.Thread(target=self._reap_loop, name="kvcache-reaper", daemon=True)
        self._reaper.start()

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._reaper.join(timeout=5)
        self._ram_worker.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            for lease_id in list(self._reservations):
                self._drop_reservation(lease_id, "saves_aborted")
        self._flush_usage()
        self.index.close()
        os.close(self._ram_lock)  # releases the RAM tier
        self._lock_file.close()  # releases the data directory lock

    def _lock_data_dir(self) -> BinaryIO:
        """One daemon per data directory: a second one would sweep the first one's
        in-flight temp files and take over its socket."""
        f = open(self.root / "daemon.lock", "a+b")  # noqa: SIM115 - held for our lifetime
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise DirectoryInUse(f"another kvcache daemon is using {self.root}") from None
        return f

    def _reconcile(self) -> None:
        """Make index and files agree, reading blob headers only (never whole payloads)."""
        for orphan in self.tmp_dir.iterdir():
            if not is_own_file_name(orphan.name) or orphan.is_dir():
                log.warning("left alone in %s: %s (not a file kvcache made)", self.tmp_dir,
                            orphan.name)
                continue
            orphan.unlink(missing_ok=True)
            self.counters["orphans_swept"] += 1
        if self.index.get_setting("block_size") not in (None, str(self.config.block_size)):
            # Anchors depend on the block size: rebuild the index from the blobs.
            self.index.clear()
        self.index.set_setting("block_size", str(self.config.block_size))
        self.index.set_setting("schema", str(SCHEMA_VERSION))

        on_disk: dict[bytes, Path] = {}
        for sub in self.blob_dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.suffix == BLOB_SUFFIX:
                    try:
                        on_disk[keys.parse_key(path.stem)] = path
                    except ValueError:
                        self._quarantine_path(path)
                elif path.suffix == TMP_SUFFIX and is_own_file_name(path.name):
                    path.unlink(missing_ok=True)
                    self.counters["orphans_swept"] += 1

        in_ram: dict[bytes, Path] = {}
        for path in self._ram_tier_files():
            # Only <key>.kvc is a RAM copy. A <key>.part is a copy cut short by a crash;
            # taken for the copy, it marked the entry in_ram with no file at ram_path,
            # and the first fast-path read then quarantined the (good) entry.
            if path.suffix == BLOB_SUFFIX:
                in_ram[keys.parse_key(path.stem)] = path
            else:
                path.unlink(missing_ok=True)

        # A damaged row (undecodable: iterating it crashed start-up; or a changed size,
        # n_tokens, tail, namespace, reason... that nothing else checks) is dropped, and its
        # blob file, left in on_disk, is re-indexed from its checksummed header below: a
        # good entry is not lost to its index row, and no row is served that its blob denies.
        good, bad = self.index.audit()
        stale: list[bytes] = list(bad)
        ram_fixes: list[Record] = []
        # Entries long enough for passes rows that have none (an index of schema 1, or a
        # start-up killed while adding them): added from their blob headers below.
        lacking = self.index.lacking_passes(
            [r.key for r in good if r.n_tokens >= self.config.block_size])
        without_passes: list[tuple[bytes, Path]] = []
        for record in good:
            path = on_disk.pop(record.key, None)
            if path is None or path.stat().st_size != record.size:
                stale.append(record.key)
                if path is not None:
                    self._quarantine_path(path)
                continue
            if record.key in lacking:
                without_passes.append((record.key, path))
            self.disk_used += record.size
            self.logical_bytes += record.logical_size
            self._add_child(record)
            ram_path = in_ram.pop(record.key, None)
            has_ram = ram_path is not None and ram_path.stat().st_size == record.size
            if has_ram:
                self.ram_used += record.size
                self.ram_entries += 1
            elif ram_path is not None:
                ram_path.unlink(missing_ok=True)
            if has_ram != record.in_ram:
                ram_fixes.append(replace(record, in_ram=has_ram))
        # One transaction each: after a reboot empties /dev/shm every entry needs a RAM fix,
        # and a transaction per row (an fsync each) made start-up take seconds.
        if stale:
            self.index.drop_rows(stale)
            self.counters["reconcile_removed"] += len(stale)
        if ram_fixes:
            self.index.put_many(ram_fixes)
        for path in in_ram.values():
            path.unlink(missing_ok=True)

        # Blob files the index does not know (a crash between rename and index commit, or
        # a lost index): re-index them from their headers.
        added: list[tuple[Record, list[tuple[bytes, bytes]]]] = []
        for key, path in on_disk.items():
            try:
                with open(path, "rb") as f:
                    header, meta = blobfmt.read_header_and_meta(f)
                entry = keys.entry_key(meta.namespace, meta.tokens, self.config.block_size)
                if header.total_size != path.stat().st_size:
                    raise blobfmt.BlobError("file size does not match its header")
                if entry.key != key:
                    # Keyed under another block size (the index was cleared above for it):
                    # the checksummed metadata gives the key, so move the file there rather
                    # than quarantine every entry longer than a block.
                    target = self.blob_path(entry.key)
                    if target.exists():
                        raise blobfmt.BlobError("file name does not match its header")
                    target.parent.mkdir(mode=0o700, exist_ok=True)
                    os.rename(path, target)
                    dir_fsync(target.parent)
                    path = target
            except (OSError, blobfmt.BlobError):
                self._quarantine_path(path)
                continue
            record = replace(self._record_from(entry, header, meta, path.stat().st_size),
                             **bad.get(entry.key, {}))  # a damaged row's hits and pin
            added.append((record, keys.passes(meta.namespace, meta.tokens,
                                              self.config.block_size)))
        added = self._parents_first(added)
        for record, _ in added:
            self.disk_used += record.size
            self.logical_bytes += record.logical_size
            self._add_child(record)
        if added:
            self.index.publish_many(added)
            self.counters["reconcile_added"] += len(added)
        self._add_passes(without_passes)
        self._drop_broken_chains()

    def _parents_first(self, items: list[tuple[Record, list[tuple[bytes, bytes]]]]
                       ) -> list[tuple[Record, list[tuple[bytes, bytes]]]]:
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
        placed: list[tuple[Record, list[tuple[bytes, bytes]]]] = []
        while ready:
            key = ready.pop()
            record, passes = pending.pop(key)
            # Ready with a parent: one placed just before, or one already indexed.
            if record.parent and record.parent not in batch \
                    and self.index.get(record.parent) is None:
                self._drop_orphan_file(key)
                continue
            placed.append((record, passes))
            ready += waiting.get(key, [])
        for key in pending:  # built on a dropped one, or a cycle (only forged headers)
            self._drop_orphan_file(key)
        return placed

    def _drop_orphan_file(self, key: bytes) -> None:
        self.blob_path(key).unlink(missing_ok=True)
        self.counters["reconcile_removed"] += 1

    def _drop_broken_chains(self) -> None:
        """Remove entries whose chain is broken (a parent missing, or not holding the
        tokens the piece takes from it), with everything built on them."""
        records = {r.key: r for r in self.index.records()}
        for record in records.values():
            parent = records.get(record.parent)
            if record.parent and (parent is None
                                  or not parent.base < record.base <= parent.n_tokens):
                self._remove_entry(record, "reconcile_removed")

    def _add_passes(self, entries: list[tuple[bytes, Path]]) -> None:
        """Give entries without passes rows those rows (only those: their entry rows,
        RAM flags fixed above included, stay as they are), from their blob headers."""
        items = []
        for key, path in entries:
            try:
                with open(path, "rb") as f:
                    _, meta = blobfmt.read_header_and_meta(f)
            except (OSError, blobfmt.BlobError):
                continue  # left to verify and reads, which quarantine a bad blob
            if keys.entry_key(meta.namespace, meta.tokens, self.config.block_size).key == key:
                items.append((key, keys.passes(meta.namespace, meta.tokens,
                                               self.config.block_size)))
        self.index.add_passes(items)

    def _ram_tier_files(self) -> list[Path]:
        """The RAM tier's blob and temp files. Anything else there is not ours to delete
        (nor a reason to refuse to start): it is left alone, with a warning."""
        own = list(ramtier.own_files(self.ram_dir))
        names = {p.name for p in own} | {ramtier.RAM_MARKER}
        for name in sorted(set(os.listdir(self.ram_dir)) - names):
            log.warning("left alone in the RAM tier %s: %s (not a file kvcache made)",
                        self.ram_dir, name)
        return own

    # -- paths ------------------------------------------------------------------------------

    def blob_path(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.blob_dir / hexkey[:2] / f"{hexkey}{BLOB_SUFFIX}"

    def ram_path(self, key: bytes) -> Path:
        return self.ram_dir / f"{key.hex()}{BLOB_SUFFIX}"

    # -- lookup -----------------------------------------------------------------------------

    def lookup(self, ns: bytes, raw_tokens: bytes, max_tokens: int = 0) -> tuple[Record | None, int]:
        """The longest entry whose tokens are a whole prefix of the query, and the probes."""
        self._check_tokens(raw_tokens)
        hashes = keys.block_hashes(ns, raw_tokens, self.config.block_size)
        record, probes = self.index.longest_prefix(hashes, raw_tokens, self.config.block_size,
                                                   max_tokens)
        self._count_lookup(record, record.n_tokens if record else 0, raw_tokens, max_tokens)
        return record, probes

    def lookup_common_prefix(self, ns: bytes, raw_tokens: bytes, max_tokens: int = 0
                             ) -> tuple[Record | None, int, int]:
        """The entry sharing the most leading tokens with the query (it may be longer or
        diverge), how many it shares, and the probes."""
        self._check_tokens(raw_tokens)
        hashes = keys.block_hashes(ns, raw_tokens, self.config.block_size)
        record, shared, probes = self.index.longest_common_prefix(
            hashes, raw_tokens, self.config.block_size, max_tokens)
        self._count_lookup(record, shared, raw_tokens, max_tokens)
        return record, shared, probes

    def _count_lookup(self, record: Record | None, shared: int, raw_tokens: bytes,
                      max_tokens: int) -> None:
        n = len(raw_tokens) // 4
        wanted = min(n, max_tokens) if max_tokens else n
        with self._cond:
            self.counters["lookups"] += 1
            self.counters["lookup_hits" if record else "lookup_misses"] += 1
            if record:
                exact = shared == wanted
                self.counters["lookup_hits_exact" if exact else "lookup_hits_partial"] += 1

    def _check_tokens(self, raw_tokens: bytes) -> None:
        n = len(raw_tokens) // 4
        if n == 0:
            raise InvalidArgument("empty token list")
        if n > self.config.max_tokens:
            raise InvalidArgument(f"{n} tokens exceed the limit of {self.config.max_tokens}")

    # -- publish protocol -------------------------------------------------------------------

    def reserve(self, ns: bytes, raw_tokens: bytes, size: int, reason: str,
                model_fingerprint: str, *, tenant_id: str | None = None,
                parent: bytes = b"", base: int = 0) -> ReserveResult:
        """Reserve the save of an entry. With ``parent``, the entry is a piece: its blob
        holds only the cells after its first ``base`` tokens, which the parent's chain
        holds (checked here against the index); the parent is held until commit or abort."""
        self._check_tokens(raw_tokens)
        if reason not in blobfmt.SAVE_REASONS:
            raise InvalidArgument(f"unknown save reason {reason!r} "
                                  f"(one of {', '.join(blobfmt.SAVE_REASONS)})")
        if size <= blobfmt.HEADER_SIZE:
            raise InvalidArgument(f"size {size} is too small for a blob")
        if size > self.config.max_blob_bytes:
            raise InvalidArgument(f"size {size} exceeds the limit of {self.config.max_blob_bytes}")
        entry = keys.entry_key(ns, raw_tokens, self.config.block_size)
        if parent or base:
            self._check_parent(ns, raw_tokens, parent, base)
        with self._cond:
            self.counters["reserves"] += 1
            if entry.key in self._in_flight:
                self.counters["saves_duplicate"] += 1
                self.counters["saves_duplicate_in_flight"] += 1
                return ReserveResult("in_flight", entry.key)
            if self.index.get(entry.key) is not None:
                self.counters["saves_duplicate"] += 1
                self.counters["saves_duplicate_present"] += 1
                return ReserveResult("already_present", entry.key)
            if parent and self.index.get(parent) is None:  # evicted since the check
                self.counters["saves_parent_gone"] += 1
                raise NotFound(f"parent entry {parent.hex()} is gone (evicted or deleted); "
                               "save the whole state or look again")
            self._make_room_on_disk(size)
            lease_id = secrets.token_hex(16)
            tmp_path = self.tmp_dir / f"{lease_id}{TMP_SUFFIX}"
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            res = Reservation(
                lease_id=lease_id, key=entry, namespace=ns, model_fingerprint=model_fingerprint,
                reason=reason, size=size, tmp_path=tmp_path,
                expires=time.monotonic() + self.config.lease_seconds,
                verifier=blobfmt.StreamVerifier(size), file=os.fdopen(fd, "wb", buffering=0),
                tenant_id=tenant_id, parent=parent, base=base,
            )
            if parent:
                self._in_use[parent] += 1  # not evicted or deleted under the piece
            self._reservations[lease_id] = res
            self._in_flight[entry.key] = lease_id
            self.reserved_bytes += size
            self.counters["saves_granted"] += 1
            return ReserveResult("granted", entry.key, lease_id, str(tmp_path))

    def _check_parent(self, ns: bytes, raw_tokens: bytes, parent: bytes, base: int) -> None:
        n = len(raw_tokens) // 4
        if len(parent) != keys.KEY_BYTES or not 0 < base < n:
            raise InvalidArgument(f"a piece needs a parent key and 0 < base < {n} tokens "
                                  f"(got a {len(parent)}-byte parent, base {base})")
        record = self.index.get(parent)
        if record is None:
            with self._cond:
                self.counters["saves_parent_gone"] += 1
            raise NotFound(f"parent entry {parent.hex()} is gone (evicted or deleted); "
                           "save the whole state or look again")
        if record.namespace != ns:
            raise InvalidArgument(f"parent entry {parent.hex()} belongs to another model, "
                                  "KV layout or tenant")
        # The parent's own blob must hold the last shared token: a parent that shares no
        # more than its own parent would make every restore read a blob for nothing.
        if not record.base < base <= record.n_tokens or not self.index.shares_prefix(
                parent, keys.block_hashes(ns, raw_tokens, self.config.block_size),
                raw_tokens, base, self.config.block_size):
            raise InvalidArgument(f"parent entry {parent.hex()} does not end a chain holding "
                                  f"the first {base} tokens (its own cells are "
                                  f"[{record.base}, {record.n_tokens}))")

    def _reservation(self, lease_id: str) -> Reservation:
        with self._cond:
            res = self._reservations.get(lease_id)
        if res is None or res.done:
            raise LeaseLost(f"unknown or expired lease {lease_id!r}")
        return res

    def lease_progress(self, lease_id: str) -> tuple[int, int]:
        """``(bytes written, bytes reserved)`` of an open lease (LeaseLost if it is gone)."""
        res = self._reservation(lease_id)
        return res.written, res.size

    def write(self, lease_id: str, offset: int, data: bytes | memoryview) -> int:
        res = self._reservation(lease_id)
        with res.lock:
            if res.done:
                raise LeaseLost(f"lease {lease_id!r} ended while writing")
            if offset != res.written:
                raise OutOfRange(f"chunk offset {offset} but {res.written} bytes written so far")
            if res.written + len(data) > res.size:
                self.abort(lease_id, _locked=res)
                raise OutOfRange(f"chunk ends at {res.written + len(data)}, "
                                 f"beyond the {res.size} bytes reserved (save aborted)")
            try:
                res.verifier.feed(data)
            except blobfmt.BlobError as exc:
                self.abort(lease_id, _locked=res)
                raise InvalidArgument(f"malformed blob: {exc} (save aborted)") from None
            try:
                view = memoryview(data)
                while view:
                    # A raw write is short when the disk fills: counted as whole, the
                    # last chunk's missing bytes went unnoticed and a truncated blob
                    # could be published (the stream verifier had seen every byte).
                    n = res.file.write(view)  # type: ignore[union-attr]
                    if not n:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    view = view[n:]
            except OSError as exc:
                error = self._save_io_error(exc, res, "writing")  # free space before cleanup
                self.abort(lease_id, _locked=res)
                raise error from None
            res.written += len(data)
            res.expires = time.monotonic() + self.config.lease_seconds
            return res.written

    def commit(self, lease_id: str, local_write: bool = False) -> Record:
        res = self._reservation(lease_id)
        with res.lock:
            if res.done:
                raise LeaseLost(f"lease {lease_id!r} ended before commit")
            try:
                header, meta = self._verify_reserved(res, local_write)
            except blobfmt.BlobError as exc:
                self.abort(lease_id, _locked=res)
                with self._cond:
                    self.counters["saves_invalid"] += 1
                raise InvalidArgument(f"blob rejected at commit: {exc} (save aborted)") from None
            f = res.file
            final = self.blob_path(res.key.key)
            renamed = False
            try:
                os.fsync(f.fileno())  # type: ignore[union-attr]
                f.close()  # type: ignore[union-attr]
                res.file = None
                if not final.parent.is_dir():
                    final.parent.mkdir(mode=0o700, exist_ok=True)
                    dir_fsync(self.blob_dir)
                os.rename(res.tmp_path, final)
                renamed = True
                dir_fsync(final.parent)
                record = self._record_from(res.key, header, meta, res.size)
                with self._cond:  # known before it is visible: see _remove_entry
                    self._add_child(record)
                self.index.put(record, keys.passes(res.namespace, meta.tokens,
                                                   self.config.block_size))
            except ParentGone as exc:  # quarantined meanwhile (a hold stops everything else)
                final.unlink(missing_ok=True)
                with self._cond:
                    self._drop_child(res.parent, record.key)
                    self.counters["saves_parent_gone"] += 1
                self.abort(lease_id, _locked=res)
                raise NotFound(f"{exc} (save aborted)") from None
            except (OSError, lmdb.Error) as exc:
                # A full disk fails the index commit (LMDB grows its file): unhandled, it
                # answered UNKNOWN and left an unindexed blob file and the key in flight.
                error = self._save_io_error(exc, res, "committing")  # free space before cleanup
                if renamed:
                    final.unlink(missing_ok=True)
                if res.parent:
                    with self._cond:
                        self._drop_child(res.parent, res.key.key)
                self.abort(lease_id, _locked=res)
                raise error from None
            with self._cond:
                res.done = True
                self._reservations.pop(lease_id, None)
                self._in_flight.pop(res.key.key, None)
                self.reserved_bytes -= res.size
                if res.parent:
                    self._release_use(res.parent)
                    self.counters["pieces_committed"] += 1
                self.disk_used += res.size
                self.logical_bytes += record.logical_size
                self.counters["saves_committed"] += 1
                self.counters[f"saves_committed_{meta.reason}"] += 1
                self.counters["bytes_committed"] += res.size
                self._cond.notify_all()
        self._schedule_ram(record.key)
        return record

    def _verify_reserved(self, res: Reservation,
                         local_write: bool) -> tuple[blobfmt.BlobHeader, blobfmt.BlobMeta]:
        if local_write:
            if res.written:
                raise blobfmt.BlobError("local commit of a lease that was also streamed")
            with open(res.tmp_path, "rb") as f:
                header, meta = blobfmt.verify_file(f)
        else:
            header, meta = res.verifier.finish()
        if header.total_size != res.size:
            raise blobfmt.BlobError(f"blob is {header.total_size} bytes, {res.size} reserved")
        if meta.namespace != res.namespace:
            raise blobfmt.BlobError("blob namespace differs from the reserved identity")
        if meta.model_fingerprint != res.model_fingerprint:
            raise blobfmt.BlobError("blob model fingerprint differs from the reserved identity")
        # The tenant label is what List, Inspect and Prune filter on: a writer must not file
        # its entry under another tenant (or hide a tenant's entry under none).
        if res.tenant_id is not None and meta.tenant_id != res.tenant_id:
            raise blobfmt.BlobError("blob tenant differs from the reserved identity")
        if keys.entry_key(meta.namespace, meta.tokens, self.config.block_size) != res.key:
            raise blobfmt.BlobError("blob tokens differ from the reserved tokens")
        if (meta.parent, meta.base) != (res.parent, res.base):
            raise blobfmt.BlobError("blob parent and base differ from the reserved ones")
        return header, meta

    def _save_io_error(self, exc: BaseException, res: Reservation, doing: str) -> StoreError:
        """The error for a save that failed on I/O (already aborted): no space left is
        RESOURCE_EXHAUSTED and says what is free; anything else is INTERNAL."""
        if isinstance(exc, lmdb.DiskError) or getattr(exc, "errno", None) in (errno.ENOSPC,
                                                                               errno.EDQUOT):
            return StoreFull(f"no space left on the disk tier ({self.root}) while {doing} a "
                             f"blob of {res.size} bytes: {self._disk_free()} bytes free "
                             "(save aborted)")
        return StoreError(f"I/O error while {doing} a blob of {res.size} bytes: {exc} "
                          "(save aborted)")

    def abort(self, lease_id: str, *, _locked: Reservation | None = None,
              counter: str = "saves_aborted") -> None:
        res = _locked
        if res is None:
            res = self._reservation(lease_id)
            with res.lock:
                self._finish_abort(res, counter)
        else:
            self._finish_abort(res, counter)

    def _finish_abort(self, res: Reservation, counter: str) -> None:
        with self._cond:
            if res.done:
                return
            self._drop_reservation(res.lease_id, counter)

    def _drop_reservation(self, lease_id: str, counter: str) -> None:
        """Remove a reservation and its temp file. Caller holds ``self._cond``."""
        res = self._reservations.pop(lease_id, None)
        if res is None:
            return
        res.done = True
        self._in_flight.pop(res.key.key, None)
        self.reserved_bytes -= res.size
        if res.parent:
            self._release_use(res.parent)
        if res.file is not None:
            with contextlib.suppress(OSError):
                res.file.close()  # type: ignore[union-attr]
        res.tmp_path.unlink(missing_ok=True)
        self.counters[counter] += 1
        self._cond.notify_all()

    @staticmethod
    def _record_from(entry: keys.EntryKey, header: blobfmt.BlobHeader, meta: blobfmt.BlobMeta,
                     size: int) -> Record:
        return Record(
            key=entry.key, namespace=meta.namespace, anchor=entry.anchor, tail=entry.tail,
            n_tokens=entry.n_tokens, size=size, codec=header.codec, reason=meta.reason,
            created=meta.created, model_name=meta.model_name,
            model_fingerprint=meta.model_fingerprint, tenant_id=meta.tenant_id,
            parent=meta.parent, base=meta.base,
        )

    # -- space ------------------------------------------------------------------------------

    def _disk_free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _make_room_on_disk(self, size: int) -> None:
        """Evict until a blob of ``size`` fits the disk budget and the free-space watermark.
        Caller holds ``self._cond``. Raises StoreFull (before anything is written)."""
        cfg = self.config

        def fits(freed: int = 0) -> bool:
            within_budget = self.disk_used - freed + self.reserved_bytes + size <= cfg.disk_bytes
            above_watermark = (self._disk_free() + freed - self.reserved_bytes - size
                               >= cfg.min_free_bytes)
            return within_budget and above_watermark

        if fits():
            return
        if size > cfg.disk_bytes:
            self.counters["saves_refused_full"] += 1
            raise StoreFull(f"blob of {size} bytes exceeds the disk budget of {cfg.disk_bytes}")
        candidates = self._eviction_candidates()
        evictable = sum(r.size for r in candidates)
        # When evicting every candidate would still not make room (the rest is pinned or
        # being read), refuse now: evicting first emptied the cache for a refused save.
        if fits(evictable):
            for record in candidates:
                if fits():
                    return
                self._remove_entry(record, "evictions_disk")
        if not fits():
            self.counters["saves_refused_full"] += 1
            raise StoreFull(
                f"no room for {size} bytes: disk tier holds {self.disk_used} of "
                f"{cfg.disk_bytes} budget bytes ({self.reserved_bytes} reserved), "
                f"{self._disk_free()} bytes free against a watermark of {cfg.min_free_bytes}; "
                # Not "the rest is pinned": a disk filled by other files has nothing pinned.
                f"entries not pinned or being read hold only {evictable} bytes"
            )

    def _eviction_candidates(self, ram_only: bool = False) -> list[Record]:
        """What may go, in order: entries one at a time, each a leaf when its turn comes
        (see policy.leaf_first_order). For RAM copies, which nothing depends on, the
        copies of entries others build on follow once the leaves' are gone."""
        with self._cond:
            pending = {k: v[1] for k, v in self._pending_use.items()}
            busy = set(self._in_use)
        records = list(self.index.records())
        keep = busy | {r.key for r in records if r.pinned}
        order = leaf_first_order(records, pending, keep)
        if ram_only:
            listed = {r.key for r in order}
            order += [r for r in eviction_order(records, pending)
                      if r.key not in listed and r.key not in keep]
            order = [r for r in order if r.in_ram]
        return order

    def _add_child(self, record: Record) -> None:
        if record.parent:
            self._children.setdefault(record.parent, set()).add(record.key)

    def _drop_child(self, parent: bytes, key: bytes) -> None:
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[parent]

    def children(self, key: bytes) -> int:
        """How many entries are built directly on ``key``."""
        with self._cond:
            return len(self._children.get(key, ()))

    def dependents(self, key: bytes) -> list[bytes]:
        """Every entry built on ``key`` (its pieces, theirs, ...), nearest first."""
        with self._cond:
            out: list[bytes] = []
            todo = [key]
            while todo:
                kids = sorted(self._children.get(todo.pop(), ()))
                out += kids
                todo += kids
            return out

    def _remove_entry(self, record: Record, counter: str) -> list[Record]:
        """Unpublish an entry and everything built on it, in one index transaction (no
        piece stays visible without its parent), then their files. A piece whose commit
        is under way is in ``_children`` before it is visible, so it is either removed
        here or its publish finds the parent gone. Returns what was removed."""
        removed = self.index.delete_many([record.key, *self.dependents(record.key)])
        with self._cond:
            for r in removed:  # their tiers as they are now, not as when chosen
                self.disk_used -= r.size
                self.logical_bytes -= r.logical_size
                if r.in_ram:
                    self.ram_used -= r.size
                    self.ram_entries -= 1
                self._pending_use.pop(r.key, None)
                self._drop_child(r.parent, r.key)
                self._children.pop(r.key, None)
                self.counters[counter if r.key == record.key else "dependents_removed"] += 1
        dirs = set()
        for r in removed:
            self.ram_path(r.key).unlink(missing_ok=True)
            path = self.blob_path(r.key)
            path.unlink(missing_ok=True)
            dirs.add(path.parent)
        for d in dirs:
            with contextlib.suppress(OSError):
                dir_fsync(d)
        return removed

    # -- RAM tier ---------------------------------------------------------------------------

    def _schedule_ram(self, key: bytes) -> None:
        with self._cond:
            if key in self._ram_scheduled or self._closed.is_set():
                return
            self._ram_scheduled.add(key)
        with contextlib.suppress(RuntimeError):  # the worker is shutting down
            self._ram_worker.submit(self._place_in_ram, key)

    def _place_in_ram(self, key: bytes) -> None:
        # Release only a use we took: the early return below used to release one anyway,
        # taking away a reader's pin (a disk read of a blob too big for RAM left the entry
        # evictable and deletable while it was being read).
        held = False
        try:
            record = self.index.get(key)
            if record is None or record.in_ram or record.size > self.config.ram_bytes:
                return
            with self._cond:
                self._in_use[key] += 1  # keep it from being evicted from disk while copying
                held = True
                if not self._make_room_in_ram(record.size, exclude=key):
                    return
                self.ram_used += record.size
            ok = False
            try:
                tmp = self.ram_dir / f"{key.hex()}{TMP_SUFFIX}"
                shutil.copyfile(self.blob_path(key), tmp)
                os.rename(tmp, self.ram_path(key))
                ok = self.index.update(key, in_ram=True) is not None
            except OSError:
                pass
            finally:
                with self._cond:
                    if ok:
                        self.ram_entries += 1
                        self.counters["ram_placements"] += 1
                    else:
                        self.ram_used -= record.size
                if not ok:
                    self.ram_path(key).unlink(missing_ok=True)
        finally:
            with self._cond:
                self._ram_scheduled.discard(key)
                if held:
                    self._release_use(key)

    def _make_room_in_ram(self, size: int, exclude: bytes = b"") -> bool:
        """Drop RAM copies (LRU) until ``size`` more bytes fit. Caller holds ``self._cond``."""
        if self.ram_used + size <= self.config.ram_bytes:
            return True
        candidates = [r for r in self._eviction_candidates(ram_only=True) if r.key != exclude]
        # As on disk: when dropping every copy that may go would still not make room, drop
        # none (dropping first emptied the RAM tier for a copy that was then not placed).
        if self.ram_used - sum(r.size for r in candidates) + size > self.config.ram_bytes:
            return False
        for record in candidates:
            self._drop_ram_copy(record, "evictions_ram")
            if self.ram_used + size <= self.config.ram_bytes:
                return True
        return False

    def _drop_ram_copy(self, record: Record, counter: str) -> bool:
        if self.index.update(record.key, in_ram=False) is None:
            return False
        self.ram_path(record.key).unlink(missing_ok=True)
        with self._cond:
            self.ram_used -= record.size
            self.ram_entries -= 1
            self.counters[counter] += 1
        return True

    # -- reads ------------------------------------------------------------------------------

    def open_read(self, key: bytes, wait_ms: int = 0) -> ReadPin:
        """Pin a published entry for reading and say where its bytes are."""
        deadline = time.monotonic() + wait_ms / 1000.0
        waited = False
        with self._cond:
            while True:
                record = self.index.get(key)
                if record is not None:
                    break
                if key not in self._in_flight:
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
            ram_path = self.ram_path(key)
            if record.in_ram:
                path, tier = ram_path, TIER_RAM
            else:
                path, tier = self.blob_path(key), TIER_DISK
            pin_id = secrets.token_hex(16)
            self._pins[pin_id] = (key, time.monotonic() + self.config.pin_seconds)
            self._in_use[key] += 1
            usage = self._pending_use.setdefault(key, [0, 0.0])
            usage[0] += 1
            usage[1] = time.time()
            self.counters["reads"] += 1
            self.counters[f"reads_{tier}"] += 1
        if tier == TIER_DISK:
            self._schedule_ram(key)  # promote on a disk hit
        return ReadPin(pin_id, key, path, record.size, tier)

    def release_read(self, pin_id: str, corrupt: bool = False) -> bool:
        """Unpin a read. With ``corrupt``, re-verify the entry and quarantine it if bad."""
        with self._cond:
            pinned = self._pins.pop(pin_id, None)
            if pinned is None:
                raise LeaseLost(f"unknown or expired read pin {pin_id!r}")
            self._release_use(pinned[0])
        if corrupt:
            return self.check_entry(pinned[0]) is not None
        return False

    def _release_use(self, key: bytes) -> None:
        self._in_use[key] -= 1
        if self._in_use[key] <= 0:
            del self._in_use[key]

    def _open_pinned(self, pin: ReadPin) -> BinaryIO:
        try:
            return open(pin.path, "rb", buffering=0)  # noqa: SIM115 - returned to the caller
        except FileNotFoundError:  # its RAM copy was dropped since: the disk copy remains
            return open(self.blob_path(pin.key), "rb", buffering=0)  # noqa: SIM115

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
                if keys.entry_key(meta.namespace, meta.tokens, self.config.block_size).key != key:
                    raise blobfmt.BlobError("the blob holds another entry (its key differs)")
            except (blobfmt.BlobError, OSError) as exc:
                # OSError (the file is gone or unreadable) escaped as UNKNOWN and left the
                # entry published for every later reader to hit: check and quarantine it too.
                corrupt = True
                raise Corrupt(f"entry {key.hex()} failed verification ({exc}); quarantined") \
                    from None
            finally:
                with contextlib.suppress(LeaseLost):
                    self.release_read(pin.pin_id, corrupt=corrupt)

        return pin, chunks()

    # -- verification and quarantine --------------------------------------------------------

    def check_entry(self, key: bytes, *, quarantine: bool = True) -> str | None:
        """Verify every copy of an entry; quarantine it if any is bad (unless not
        ``quarantine``: an operator's check-only run moves nothing). Returns the error."""
        # Held like a read: an eviction, delete or RAM drop in the middle of the check took
        # a file from under it, and the good entry was reported bad (and quarantined).
        with self._cond:
            if self.index.get(key) is None:
                return None
            self._in_use[key] += 1
        try:
            return self._check_entry_held(key, quarantine)
        finally:
            with self._cond:
                self._release_use(key)

    def _check_entry_held(self, key: bytes, quarantine: bool = True) -> str | None:
        record = self.index.get(key)
        if record is None:
            return None
        paths = [self.blob_path(key)] + ([self.ram_path(key)] if record.in_ram else [])
        for path in paths:
            try:
                with open(path, "rb") as f:
                    header, meta = blobfmt.verify_file(f)
                if header.total_size != record.size or \
                        keys.entry_key(meta.namespace, meta.tokens,
                                       self.config.block_size).key != key:
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

    def _quarantine_ram_copy(self, key: bytes) -> None:
        with self._cond:  # evictions drop copies under it too: ram_used is reduced once
            record = self.index.get(key)
            if record is None or not record.in_ram:
                return
            # /dev/shm is another file system, where the move fails: the drop then unlinks
            # it (left there, a restart would take it for a good copy again).
            self._quarantine_path(self.ram_path(key))
            self._drop_ram_copy(record, "corrupt_blobs")

    def quarantine(self, key: bytes) -> None:
        record = self.index.get(key)
        if record is None:
            return
        self._quarantine_path(self.blob_path(key))  # kept for post-mortems
        self._remove_entry(record, "corrupt_blobs")

    def _quarantine_path(self, path: Path) -> None:
        """Move a bad file aside (counted only when there was one to move)."""
        target = self.quarantine_dir / f"{path.name}.{int(time.time() * 1000)}"
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
        todo = keys_ if keys_ else [r.key for r in self.index.records()]
        for i, key in enumerate(todo, 1):
            if self.index.get(key) is None:
                if not keys_:
                    # Evicted or deleted since the listing: gone, not bad. Reported, it
                    # failed `kvcache verify` on any cache busy enough to evict.
                    continue
                yield key, NO_SUCH_ENTRY, i, len(todo)
                continue
            yield key, self.check_entry(key, quarantine=not check_only), i, len(todo)

    # -- admin ------------------------------------------------------------------------------

    def chain(self, record: Record) -> list[Record]:
        """The entries whose blobs make up ``record``'s state, root first (``record``
        last). Raises NotFound when a link is missing (removed meanwhile)."""
        links = [record]
        while links[-1].parent:
            parent = self.index.get(links[-1].parent)
            if parent is None or len(links) > self.config.max_tokens:
                raise NotFound(f"entry {record.key.hex()} lost a part of its chain")
            links.append(parent)
        return links[::-1]

    def get(self, key: bytes) -> Record:
        record = self.index.get(key)
        if record is None:
            raise NotFound(f"no entry {key.hex()}")
        return record

    def set_pinned(self, key: bytes, pinned: bool) -> Record:
        # Under the lock evictions, prunes and deletes decide under: a pin landing between
        # their look at an entry and its removal was answered OK and the entry removed anyway.
        with self._cond:
            record = self.index.update(key, pinned=pinned)
            if record is None:
                raise NotFound(f"no entry {key.hex()}")
            self.counters["pins" if pinned else "unpins"] += 1
            return record

    def delete(self, key: bytes) -> list[Record]:
        """Remove an entry and the entries built on it (they cannot be restored without
        it); refused while any of them is pinned or being read. Returns what went,
        the entry first."""
        with self._cond:
            record = self.get(key)
            dependents = self.dependents(key)
            for k in (key, *dependents):
                r = record if k == key else self.index.get(k)
                whose = "" if k == key else f" (built on {key.hex()})"
                if r is not None and r.pinned:
                    raise Busy(f"entry {k.hex()}{whose} is pinned; unpin it first")
                if self._in_use.get(k):
                    raise Busy(f"entry {k.hex()}{whose} is being read")
            removed = self._remove_entry(record, "deletes")
            return sorted(removed, key=lambda r: r.key != key)

    def inspect(self, key: bytes, tenant_id: str | None = None
                ) -> tuple[Record, blobfmt.BlobHeader, blobfmt.BlobMeta, Path]:
        """Metadata of an entry; with ``tenant_id``, another tenant's entry is reported
        missing before its file is touched (so not even its corruption shows)."""
        record = self.get(key)
        if tenant_id is not None and record.tenant_id != tenant_id:
            raise NotFound(f"no entry {key.hex()}")
        path = self.blob_path(key)
        try:
            with open(path, "rb") as f:
                header, meta = blobfmt.read_header_and_meta(f)
            # A valid blob of another entry (a swapped file) would show its tokens, perhaps
            # another tenant's: it must be this entry's before any of it is shown.
            if header.total_size != record.size or keys.entry_key(
                    meta.namespace, meta.tokens, self.config.block_size).key != key:
                raise blobfmt.BlobError("the blob holds another entry")
        except (OSError, blobfmt.BlobError) as exc:
            # Judged by the full check, which holds the entry: one evicted meanwhile is
            # missing, not corrupt, and a passing error never quarantines a good blob.
            error = self.check_entry(key)
            if error is not None:
                raise Corrupt(f"entry {key.hex()} is unreadable ({error}); quarantined") \
                    from None
            if self.index.get(key) is None:
                raise NotFound(f"no entry {key.hex()}") from None
            raise StoreError(f"entry {key.hex()} could not be read: {exc}") from None
        return self._with_pending(record), header, meta, path

    def list(self, predicate: Callable[[Record], bool] | None = None) -> list[Record]:
        return [self._with_pending(r) for r in self.index.records() if not predicate or predicate(r)]

    def _with_pending(self, record: Record) -> Record:
        with self._cond:
            usage = self._pending_use.get(record.key)
        if not usage:
            return record
        return replace(record, hits=record.hits + int(usage[0]),
                       last_used=max(record.last_used, usage[1]))

    def prune(self, predicate: Callable[[Record], bool] | None = None, *,
              max_disk_bytes: int = 0, max_ram_bytes: int = 0, dry_run: bool = False,
              ram_predicate: Callable[[Record], bool] | None = None) -> PruneResult:
        """Remove entries, or only their RAM copies, as an operator asked.

        ``predicate`` (the operator's filters) chooses the candidates, and every target
        works within them: with no byte target every candidate is removed;
        ``max_disk_bytes`` removes candidates, least recently used first, until the disk
        tier holds at most that; ``max_ram_bytes`` only drops candidates' RAM copies (the
        entries stay on disk) until the RAM tier holds at most that. Pinned entries and
        entries being read are never touched, and are counted as skipped. An entry goes
        only after (or with) every entry built on it, so one that entries outside the
        filters build on stays (counted in ``skipped_shared``), as does everything a
        pinned entry or one being read is built on. ``ram_predicate``, when given,
        chooses the RAM-copy candidates instead.
        """
        with self._cond:
            busy = set(self._in_use)
            pending = {k: v[1] for k, v in self._pending_use.items()}
            records = list(self.index.records())
            ordered = eviction_order(records, pending)
            # Judged with the reads not yet flushed to the index (once a second), so
            # `--unused-for` spares an entry that was just read.
            candidates = [r for r in ordered
                          if predicate is None or predicate(self._with_pending(r))]
            plan = _PrunePlan(busy)
            if max_disk_bytes or not max_ram_bytes:
                self._prune_entries(records, candidates, pending, plan, max_disk_bytes,
                                    predicate is not None, dry_run)
            if max_ram_bytes:
                if ram_predicate is not None:
                    candidates = [r for r in ordered if ram_predicate(self._with_pending(r))]
                self._prune_ram_copies(candidates, plan, max_ram_bytes, dry_run)
        return PruneResult(plan.removed, sum(r.size for r in plan.removed),
                           len(plan.pinned), len(plan.in_use), plan.shared,
                           len(plan.ram_dropped), sum(r.size for r in plan.ram_dropped),
                           plan.ram_dropped)

    def _prune_entries(self, records: list[Record], candidates: list[Record],
                       pending: dict[bytes, float], plan: _PrunePlan, max_disk_bytes: int,
                       filtered: bool, dry_run: bool) -> None:
        """Remove candidates (all of them, or down to ``max_disk_bytes``), leaves first.
        Without a filter or a target nothing is a candidate. Caller holds the lock."""
        if not (filtered or max_disk_bytes):
            return
        touchable = {r.key for r in candidates if plan.may_touch(r)}
        keep = {r.key for r in records} - touchable
        order = leaf_first_order(records, pending, keep)
        plan.shared = len(touchable) - len(order)
        disk_after = self.disk_used
        for record in order:
            if max_disk_bytes and disk_after <= max_disk_bytes:
                return
            plan.removed.append(record)
            disk_after -= record.size
            if not dry_run:
                self._remove_entry(record, "prune_removed")

    def _prune_ram_copies(self, candidates: list[Record], plan: _PrunePlan,
                          max_ram_bytes: int, dry_run: bool) -> None:
        """Drop candidates' RAM copies down to ``max_ram_bytes``. Caller holds the lock."""
        gone = {r.key for r in plan.removed}
        # A removed entry's copy went with it (in a dry run it is still counted in ram_used).
        ram_after = self.ram_used - (sum(r.size for r in plan.removed if r.in_ram)
                                     if dry_run else 0)
        for candidate in candidates:
            if ram_after <= max_ram_bytes:
                return
            # As it is now: the snapshot's tier may be stale after the removals above.
            record = candidate if dry_run else self.index.get(candidate.key)
            if record is None or record.key in gone or not record.in_ram:
                continue
            if not plan.may_touch(record):
                continue
            if dry_run or self._drop_ram_copy(record, "prune_ram_dropped"):
                plan.ram_dropped.append(record)
                ram_after -= record.size

    def stats(self) -> dict[str, object]:
        with self._cond:
            return {
                # Every declared counter, zeros included (rate() works from the start).
                "counters": {**dict.fromkeys(COUNTERS, 0), **self.counters},
                "disk_used": self.disk_used,
                "ram_used": self.ram_used,
                "disk_entries": self.index.count(),
                "ram_entries": self.ram_entries,
                "reserved_bytes": self.reserved_bytes,
                "logical_bytes": self.logical_bytes,
                "in_flight": len(self._in_flight),
                "read_pins": len(self._pins),
                "uptime": time.time() - self.started,
            }

    # -- background -------------------------------------------------------------------------

    def _reap_loop(self) -> None:
        last_flush = time.monotonic()
        while not self._closed.wait(0.2):
            self.reap_expired()
            if time.monotonic() - last_flush >= self.config.usage_flush_seconds:
                self._flush_usage()
                last_flush = time.monotonic()

    def reap_expired(self) -> None:
        now = time.monotonic()
        with self._cond:
            expired = [r for r in self._reservations.values() if r.expires < now]
            for key_pin, (key, expires) in list(self._pins.items()):
                if expires < now:
                    del self._pins[key_pin]
                    self._release_use(key)
                    self.counters["read_pins_expired"] += 1
        for res in expired:
            # A writer busy with a chunk holds the lock and renews the lease: skip it.
            if res.lock.acquire(blocking=False):
                try:
                    if res.expires < time.monotonic():
                        self._finish_abort(res, "leases_expired")
                finally:
                    res.lock.release()

    def _flush_usage(self) -> None:
        with self._cond:
            pending, self._pending_use = self._pending_use, {}
        # Usage counts are best-effort: losing one second of them on a crash is harmless.
        with contextlib.suppress(Exception):
            self.index.record_usage({k: (int(v[0]), v[1]) for k, v in pending.items()})
