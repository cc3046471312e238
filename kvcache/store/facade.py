"""Store: the thread-safe facade the gRPC service calls. It owns the store lock and the
background threads, and composes the parts (see the package docstring for the map)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import lmdb

from .. import blob as blobfmt
from .. import keys
from ..common import PRIVATE_FILE_MODE, TIER_DISK, TIER_RAM
from ..counters import COUNTERS
from ..errors import DirectoryInUse
from ..index import Index
from ..record import Record
from . import listing, ramtier
from .core import Layout, ReadPin, Seen, StoreConfig, StoreCore, StoreStats
from .entries import Entries, RamCopies, TenantPin, check_tokens
from .eviction import Evictor
from .integrity import Integrity
from .ownership import claim_data_dir
from .placement import RamPlacer
from .prune import Pruner, PruneResult
from .publish import Publisher, ReserveResult
from .quotas import TenantQuotas
from .reads import Reads
from .reclaim import Reclaimer, check_watermarks
from .reconcile import CLEAN, RECOVER, Reconcile, seal_clean_shutdown
from .recovery import Progress, Recovery

log = logging.getLogger("kvcache")
LOOKUP_COUNTERS = ("lookups", "lookup_hits", "lookup_misses", "lookup_hits_exact",
                   "lookup_hits_partial")


@dataclass(frozen=True)
class Found:
    """What a lookup found: the entry, how many leading tokens of the query it holds."""

    record: Record | None
    shared: int
    probes: int
    from_remote: bool = False  # its pieces were fetched from the shared tier for it


class Store:
    """The store's one entry point. Thread-safe.

    Locks, in the order they may be taken:

    1. ``Reservation.lock``, one per lease: serialises that lease's writes, commit and
       abort, and the reaper's expiry of it (which only tries it).
    2. ``Store._cond``, the store lock: a Condition over an RLock (re-entrant: a part
       holding it may call another part that takes it). It guards every table and tally:
       the lease table, read pins and in-use counts, the children map, the byte tally, the
       RAM worker's schedule and the counters. Readers waiting for an entry being written
       sleep on it; a commit or an abort wakes them. No blob's bytes are read, written
       or copied with it held (files may be created, moved and removed under it).
    3. ``Store._lookup_lock``: the lookup counters only (a leaf: nothing is taken under
       it). A lookup takes no other lock: it reads the index (LMDB readers never wait
       for its writer) and counts, so it never waits behind a save, an eviction's fsyncs
       or an operator's prune.

    Background: a reaper thread (expired leases and read pins; reads not yet written to
    the index, flushed every ``usage_flush_seconds``), the RAM worker (RamPlacer) and the
    reclaimer (Reclaimer: each tier kept between its watermarks)."""

    def __init__(self, config: StoreConfig) -> None:
        check_watermarks(config)
        self.config = config
        self.root = config.root
        claim_data_dir(self.root)
        self._lock_file = self._lock_data_dir()
        ram_lock, index = -1, None
        try:
            ram_dir, ram_lock = ramtier.claim_tier(self.root, config.ram_dir)
            self._layout = layout = Layout(self.root, ram_dir)
            self.ram_dir = layout.ram_dir
            self.blob_dir = layout.blob_dir
            self.tmp_dir = layout.tmp_dir
            self.quarantine_dir = layout.quarantine_dir
            layout.make_dirs()
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
        self.counters: Counter[str] = Counter(dict.fromkeys(LOOKUP_COUNTERS, 0))
        self._lookup_lock = threading.Lock()  # count_lookup's; never held with another
        self.started = time.time()
        self.waiting_lookups = 0  # lookups waiting for a save in flight (under _cond)
        # The shared core, then each part on it and on the parts below it (the layers in
        # the package docstring).
        self._core = core = StoreCore.create(self.config, self._layout, self.index,
                                             self.counters)
        self._cond, self._closed = core.cond, core.closed
        self._tally, self._pins, self._leases = core.tally, core.pins, core.leases
        self._entries = entries = Entries(core)
        self._ram = ram = RamCopies(core)
        self._evictor = evictor = Evictor(core, entries, ram)
        self._placer = placer = RamPlacer(core, evictor)
        self._integrity = integrity = Integrity(core, entries, ram)
        self._publisher = Publisher(core, entries, evictor, placer, integrity)
        self._reads = Reads(core, placer, integrity)
        self._pruner = Pruner(core, entries, ram)
        self._reclaimer = Reclaimer(core, entries, ram)
        self._recovery = Recovery(core, entries, integrity)
        self._reconcile()
        self._reaper = threading.Thread(target=self._reap_loop, name="kvcache-reaper",
                                        daemon=True)
        self._reaper.start()
        self._reclaimer.start()

    def _reconcile(self) -> None:
        t0 = time.monotonic()
        mode = Reconcile(self._core, self._entries, self._integrity).run()
        self.clean_start = mode == CLEAN
        if mode == RECOVER:
            self._recovery.start()
        log.info("%s %d entries in %.2f s", {
            CLEAN: "started from a clean shutdown with",
            RECOVER: "started after a crash (checking index and files in the background) "
                     "with"}.get(mode, "reconciled"), self.index.count(), time.monotonic() - t0)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._reaper.join(timeout=5)
        self._reclaimer.stop()
        self._recovery.stop()
        self._placer.shutdown()
        with self._cond:
            for lease_id in self._leases.lease_ids():
                self._publisher.drop_reservation(lease_id, "saves_aborted")
        self._flush_usage()
        # Unsealed (a full disk), the next start-up reconciles everything: nothing is lost.
        # Nor while the recovery after a crash is unfinished: the next one checks again.
        with self._cond, contextlib.suppress(lmdb.Error, OSError):
            if self._recovery.finished:
                seal_clean_shutdown(self.index, self._layout, self.config, self._tally)
        self.index.close()
        os.close(self._ram_lock)  # releases the RAM tier
        self._lock_file.close()  # releases the data directory lock

    def _lock_data_dir(self) -> BinaryIO:
        """One daemon per data directory: a second one would sweep the first one's
        in-flight temp files and take over its socket."""
        fd = os.open(self.root / "daemon.lock", os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:  # made by an earlier version
            os.fchmod(fd, PRIVATE_FILE_MODE)
        f = os.fdopen(fd, "a+b")  # held for our lifetime
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise DirectoryInUse(f"another kvcache daemon is using {self.root}") from None
        return f

    # -- the byte tally (read-only here; see Tally) -----------------------------------------

    @property
    def disk_used(self) -> int:
        return self._tally.disk_used

    @property
    def ram_used(self) -> int:
        return self._tally.ram_used

    @property
    def ram_entries(self) -> int:
        return self._tally.ram_entries

    @property
    def reserved_bytes(self) -> int:
        return self._tally.reserved_bytes

    @property
    def logical_bytes(self) -> int:
        return self._tally.logical_bytes

    @property
    def _ram_worker(self) -> ThreadPoolExecutor:
        """The RAM tier's single placement worker (tests wait on it)."""
        return self._placer.worker

    # -- paths ------------------------------------------------------------------------------

    def blob_path(self, key: bytes) -> Path:
        return self._layout.blob_path(key)

    def ram_path(self, key: bytes) -> Path:
        return self._layout.ram_path(key)

    # -- lookup -----------------------------------------------------------------------------

    def lookup(self, ns: bytes, raw_tokens: bytes, max_tokens: int = 0, *, count: bool = True
               ) -> tuple[Record | None, int]:
        """The longest entry whose tokens are a whole prefix of the query, and the probes.
        ``count=False``: a second look for the same request (not counted again)."""
        check_tokens(raw_tokens, self.config.max_tokens)
        hashes = keys.block_hashes(ns, raw_tokens, self.config.block_size)
        record, probes = self.index.longest_prefix(hashes, raw_tokens, self.config.block_size,
                                                   max_tokens)
        if count:
            self.count_lookup(record, record.n_tokens if record else 0, raw_tokens,
                               max_tokens)
        return record, probes

    def lookup_common_prefix(self, ns: bytes, raw_tokens: bytes, max_tokens: int = 0, *,
                             count: bool = True) -> tuple[Record | None, int, int]:
        """The entry sharing the most leading tokens with the query (it may be longer or
        diverge), how many it shares, and the probes."""
        check_tokens(raw_tokens, self.config.max_tokens)
        hashes = keys.block_hashes(ns, raw_tokens, self.config.block_size)
        record, shared, probes = self.index.longest_common_prefix(
            hashes, raw_tokens, self.config.block_size, max_tokens)
        if count:
            self.count_lookup(record, shared, raw_tokens, max_tokens)
        return record, shared, probes

    def find(self, ns: bytes, raw_tokens: bytes, max_tokens: int = 0, *,
             common_prefix: bool = False, count: bool = True) -> Found:
        """:meth:`lookup_common_prefix` or, without ``common_prefix``, :meth:`lookup`."""
        if common_prefix:
            return Found(*self.lookup_common_prefix(ns, raw_tokens, max_tokens, count=count))
        record, probes = self.lookup(ns, raw_tokens, max_tokens, count=count)
        return Found(record, record.n_tokens if record else 0, probes)

    def wait_in_flight(self, ns: bytes, raw_tokens: bytes, more_than: int,
                       timeout: float) -> int:
        """Wait up to ``timeout`` seconds until no save being written in ``ns`` shares
        more than ``more_than`` leading tokens with the query (published or dropped by
        then). Returns how many such a save still shares (0: none left, look again)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            waited = False  # counted only when it made the lookup look again
            while True:
                shared = self._leases.shared_in_flight(ns, raw_tokens)
                if shared <= more_than:
                    if waited:
                        self.counters["lookups_waited_in_flight"] += 1
                    return 0
                left = deadline - time.monotonic()
                if left <= 0:
                    self.counters["lookups_in_flight_timeout"] += 1
                    return shared
                waited = True
                self.waiting_lookups += 1  # a gauge: Stats shows who waits right now
                try:
                    self._cond.wait(left)
                finally:
                    self.waiting_lookups -= 1

    def count_lookup(self, record: Record | None, shared: int, raw_tokens: bytes,
                     max_tokens: int) -> None:
        """Count a lookup's answer (hit exact or partial, or miss)."""
        n = len(raw_tokens) // 4
        wanted = min(n, max_tokens) if max_tokens else n
        # Not under the store lock: a lookup never waits behind a save's or an eviction's
        # work. Only lookups count these (their keys exist from the start: see _start).
        with self._lookup_lock:
            self.counters["lookups"] += 1
            self.counters["lookup_hits" if record else "lookup_misses"] += 1
            if record:
                exact = shared == wanted
                self.counters["lookup_hits_exact" if exact else "lookup_hits_partial"] += 1

    # -- publish protocol (publish.Publisher) -----------------------------------------------

    def reserve(self, ns: bytes, raw_tokens: bytes, size: int, reason: str,
                model_fingerprint: str, *, tenant_id: str | None = None,
                parent: bytes = b"", base: int = 0, tenants: Seen = None) -> ReserveResult:
        """Reserve the save of an entry. With ``parent``, the entry is a piece: its blob
        holds only the cells after its first ``base`` tokens, which the parent's chain
        holds (checked here against the index, after every argument; a parent another
        tenant's, to a caller seeing ``tenants``, is gone); the parent is held until
        commit or abort."""
        return self._publisher.reserve(ns, raw_tokens, size, reason, model_fingerprint,
                                       tenant_id=tenant_id, parent=parent, base=base,
                                       tenants=tenants)

    def lease_progress(self, lease_id: str) -> tuple[int, int]:
        """``(bytes written, bytes reserved)`` of an open lease (LeaseLost if it is gone)."""
        res = self._publisher.reservation(lease_id)
        return res.written, res.size

    def write(self, lease_id: str, offset: int, data: bytes | memoryview) -> int:
        return self._publisher.write(lease_id, offset, data)

    def commit(self, lease_id: str, local_write: bool = False) -> Record:
        return self._publisher.commit(lease_id, local_write)

    def abort(self, lease_id: str, *, counter: str = "saves_aborted") -> None:
        self._publisher.abort(lease_id, counter=counter)

    # -- reads (reads.Reads) ----------------------------------------------------------------

    def open_read(self, key: bytes, wait_ms: int = 0, *, tenants: Seen = None) -> ReadPin:
        """Pin a published entry for reading and say where its bytes are."""
        return self._reads.open_read(key, wait_ms, tenants)

    def release_read(self, pin_id: str, corrupt: bool = False) -> bool:
        """Unpin a read. With ``corrupt``, re-verify the entry and quarantine it if bad."""
        return self._reads.release_read(pin_id, corrupt)

    def iter_read(self, key: bytes, wait_ms: int = 0, chunk_bytes: int = 1 << 20, *,
                  tenants: Seen = None) -> tuple[ReadPin, Iterator[memoryview]]:
        """Stream an entry's bytes, verifying them as they go; a bad blob is quarantined
        and the iterator raises Corrupt at its end."""
        return self._reads.iter_read(key, wait_ms, chunk_bytes, tenants)

    # -- verification and quarantine (integrity.Integrity) ----------------------------------

    def check_entry(self, key: bytes, *, quarantine: bool = True) -> str | None:
        """Verify every copy of an entry; quarantine it if any is bad (unless not
        ``quarantine``: an operator's check-only run moves nothing). Returns the error."""
        return self._integrity.check_entry(key, quarantine=quarantine)

    def quarantine(self, key: bytes) -> None:
        self._integrity.quarantine(key)

    def verify(self, keys_: list[bytes] | None = None, *, check_only: bool = False
               ) -> Iterator[tuple[bytes, str | None, int, int]]:
        """Check the given entries (every entry when none is given): ``(key, error or None,
        done, total)`` per entry. Bad ones are quarantined unless ``check_only``."""
        return self._integrity.verify(keys_, check_only=check_only)

    # -- admin ------------------------------------------------------------------------------

    def chain(self, record: Record) -> list[Record]:
        """The entries whose blobs make up ``record``'s state, root first (``record``
        last). Raises NotFound when a link is missing (removed meanwhile)."""
        return self._entries.chain(record)

    def get(self, key: bytes, *, tenants: Seen = None) -> Record:
        return self._entries.get(key, tenants)

    def children(self, key: bytes) -> int:
        """How many entries are built directly on ``key``."""
        return self._entries.children(key)

    def dependents(self, key: bytes) -> list[bytes]:
        """Every entry built on ``key`` (its pieces, theirs, ...), nearest first."""
        return self._entries.dependents(key)

    def set_pinned(self, key: bytes, pinned: bool, ttl_seconds: float = 0.0, *,
                   tenants: Seen = None) -> Record:
        return self._entries.set_pinned(key, pinned, ttl_seconds, tenants)

    def pin_for_tenant(self, key: bytes, ttl_seconds: float,
                       tenants: frozenset[str]) -> TenantPin:
        """The data path's expiring pin on an entry of ``tenants``, refused (QuotaExceeded)
        when its tenant's expiring pins would hold more than their bound
        (StoreConfig.pinned_bytes_bound)."""
        return self._entries.pin_for_tenant(
            key, ttl_seconds, tenants,
            lambda t: self.config.pinned_bytes_bound(self._evictor.quotas.of(TIER_DISK, t)))

    def delete(self, key: bytes, *, tenants: Seen = None) -> list[Record]:
        """Remove an entry and the entries built on it (they cannot be restored without
        it); refused while any of them is pinned or being read (the daemon's own work on
        them is waited for, bounded). Returns what went, the entry first."""
        return self._entries.delete(key, tenants)

    def inspect(self, key: bytes, tenants: Seen = None
                ) -> tuple[Record, blobfmt.BlobHeader, blobfmt.BlobMeta, Path]:
        """Metadata of an entry; another tenant's (``tenants``) is reported missing
        before its file is touched (so not even its corruption shows)."""
        record, header, meta, path = self._integrity.inspect(key, tenants)
        return self._reads.with_pending(record), header, meta, path

    def list(self, predicate: Callable[[Record], bool] | None = None, *, sort: str = "used",
             token: bytes = b"", limit: int = 0, key_prefix: str = "") -> listing.Page:
        """A page of entries (see kvcache.store.listing): up to ``limit`` (0: all) that
        ``predicate`` accepts, in ``sort``'s order, after ``token`` (the last page's
        ``next_token``), reads not yet written to the index counted in."""
        with self._cond:
            usage = self._pins.all_usage()
        return listing.page(self.index, usage, predicate, sort=sort, token=token, limit=limit,
                            key_prefix=key_prefix)

    def prune(self, predicate: Callable[[Record], bool] | None = None, *,
              max_disk_bytes: int = 0, max_ram_bytes: int = 0, dry_run: bool = False,
              ram_predicate: Callable[[Record], bool] | None = None) -> PruneResult:
        """Remove entries, or only their RAM copies, as an operator asked (see
        Pruner.prune)."""
        return self._pruner.prune(predicate, max_disk_bytes=max_disk_bytes,
                                  max_ram_bytes=max_ram_bytes, dry_run=dry_run,
                                  ram_predicate=ram_predicate)

    def stats(self) -> StoreStats:
        with self._cond:
            tally = self._tally
            return {
                # Every declared counter, zeros included (rate() works from the start).
                "counters": {**dict.fromkeys(COUNTERS, 0), **self.counters},
                "disk_used": tally.disk_used,
                "ram_used": tally.ram_used,
                "disk_entries": self.index.count(),
                "ram_entries": tally.ram_entries,
                "reserved_bytes": tally.reserved_bytes,
                "logical_bytes": tally.logical_bytes,
                "in_flight": len(self._leases.in_flight),
                "waiting_lookups": self.waiting_lookups,
                "read_pins": len(self._pins.pins),
                "uptime": time.time() - self.started,
                "recovery": self.recovery(),
            }

    def watch(self, watcher: Callable[[str, Record], None] | None) -> None:
        """Tell ``watcher`` (None: nobody) of every entry published ("added") or removed
        ("removed") and every RAM copy made ("ram_placed") or dropped ("ram_dropped"),
        in order, under the store lock: it must only queue the change (KV events)."""
        with self._cond:
            self._tally.watcher = watcher

    # -- tenants (quotas.TenantQuotas; usage in the Tally) -----------------------------------

    def set_tenant_quotas(self, quotas: TenantQuotas) -> None:
        """Hold each tenant to ``quotas`` from now on (entries over a new quota stay until
        the tenant's next save makes room)."""
        with self._cond:
            self._evictor.quotas = quotas

    @property
    def tenant_quotas(self) -> TenantQuotas:
        return self._evictor.quotas

    def tenant_usage(self, tenant_ids: Iterable[str] | None = None
                     ) -> dict[str, dict[str, int | None]]:
        """Per tenant label: what its entries hold in each tier, its saves in flight and
        the bytes they reserved, and its quotas (None: none). ``tenant_ids``: these
        tenants (holding nothing or not); else every tenant holding or saving anything."""
        quotas = self._evictor.quotas
        with self._cond:
            if tenant_ids is None:
                tenant_ids = {*self._tally.tenants,
                              *((r.tenant_id or "") for r in self._leases.reservations.values())}
            out: dict[str, dict[str, int | None]] = {}
            for tenant_id in sorted(set(tenant_ids)):
                usage = self._tally.tenant(tenant_id)
                saves = self._leases.of_tenant(tenant_id)
                out[tenant_id] = {
                    "disk_bytes": usage.disk_bytes, "disk_entries": usage.disk_entries,
                    "ram_bytes": usage.ram_bytes, "ram_entries": usage.ram_entries,
                    "open_saves": len(saves), "reserved_bytes": sum(r.size for r in saves),
                    "disk_quota_bytes": quotas.of(TIER_DISK, tenant_id),
                    "ram_quota_bytes": quotas.of(TIER_RAM, tenant_id),
                }
            return out

    # -- background -------------------------------------------------------------------------

    def recovery(self) -> Progress:
        """The check after a crash (kvcache.store.recovery): how far it got."""
        return self._recovery.snapshot()

    def reclaim(self, *, force: bool = False) -> tuple[int, int]:
        """Run the reclaimer's pass now (kvcache.store.reclaim): each tier above its high
        watermark (above its low one, with ``force``) gives up entries, or RAM copies,
        down to the low one. Returns the entries evicted and the copies dropped."""
        return self._reclaimer.run_now(force=force)

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
            expired = self._leases.expired(now)
            pins_expired = self._pins.expire(now)
            if pins_expired:
                self.counters["read_pins_expired"] += pins_expired
        self._publisher.expire(expired)
        self._entries.release_expired_pins(time.time())

    def _flush_usage(self) -> None:
        with self._cond:
            pending = self._pins.take_usage()
        # Usage counts are best-effort: losing one second of them on a crash is harmless.
        with contextlib.suppress(Exception):
            self.index.record_usage({k: (int(v[0]), v[1]) for k, v in pending.items()})
