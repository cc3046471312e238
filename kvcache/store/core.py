"""The store's core: the state every part of the store shares, and nothing that acts on
it. It imports nothing else of the store; every other module of the store is built on it
(tests/unit/test_layering.py holds the order, see the package docstring).

* StoreConfig: the settings, fixed.
* Layout: the name of every folder and file, fixed.
* Tally: the byte accounting, kept as entries come and go.
* ReadPins: what holds an entry (reads, the daemon's own work) and the reads not yet
  written to the index.
* LeaseTable: the saves in flight (their Reservation rows).
* Unchecked: after a crash, the entries the background recovery has not yet checked
  against their files.
* StoreCore: those, the entries being removed without the store lock (``leaving``), the
  index, the counters, the store lock and the closed flag, made once by Store and handed
  to each part; Part gives a part the names it reaches them by.

Locking: the tables (Tally, ReadPins, LeaseTable, ``leaving``) and the counters are not
thread-safe on their own; every change to them is made with ``StoreCore.cond``
(Store._cond, the store lock) held. The index is thread-safe by itself (LMDB).
"""

from __future__ import annotations

import io
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

from .. import blob as blobfmt
from .. import keys
from ..index import Index
from ..index_sums import Usage
from ..record import Record

GiB = 1 << 30
# The default bound of a tenant's reserved bytes, in largest entries: a few saves of the
# largest entry in flight at once.
RESERVED_ENTRIES = 4
# The default bound of the bytes one tenant's expiring pins hold: this share of the disk.
PINNED_SHARE = 4


@dataclass(frozen=True)
class StoreConfig:
    """The store's settings (``kvcache serve`` sets them from its flags)."""

    root: Path
    # The folder the RAM tier's own subfolder is made in (see kvcache.store.ramtier);
    # None: a memory file system (/dev/shm) when there is one.
    ram_dir: Path | None = None
    ram_bytes: int = 2 * GiB
    disk_bytes: int = 50 * GiB
    min_free_bytes: int = 1 * GiB
    block_size: int = 256
    lease_seconds: float = 30.0
    pin_seconds: float = 60.0
    # How long a delete waits for the daemon's own work on an entry (its RAM copy being
    # made, a check of its copies, a piece being saved on it) before refusing: an
    # operator's delete right after a save should not fail on a copy it cannot see.
    delete_wait_seconds: float = 5.0
    max_tokens: int = 1 << 20
    max_blob_bytes: int = 16 * GiB  # the largest entry a save may reserve
    # Saves one tenant (entries without a tenant count as one) may have open at once:
    # each holds a temp file and a lease, and a client opening leases without end must
    # run out of its own, not of everyone's.
    max_saves_per_tenant: int = 64
    # Bytes one tenant's open saves may have reserved at once (0: RESERVED_ENTRIES times
    # max_blob_bytes): what its writers may yet write, and push others' entries out for.
    max_reserved_bytes_per_tenant: int = 0
    # The data path's expiring pins (PinTenantEntry): the longest one, and the bytes one
    # tenant's may hold (0: a quarter of disk_bytes; never more than its disk quota).
    max_tenant_pin_seconds: float = 3600.0
    max_pinned_bytes_per_tenant: int = 0
    usage_flush_seconds: float = 1.0
    # The reclaimer (kvcache.store.reclaim) keeps each tier between these shares of its
    # budget: once a tier holds more than ``reclaim_high`` it gives up entries (copies, in
    # RAM) in the background until it holds ``reclaim_low``, so a save finds room made.
    # Both 1.0: no reclaimer, saves make their own room.
    reclaim_low: float = 0.90
    reclaim_high: float = 0.95

    @property
    def reserved_bytes_bound(self) -> int:
        """The most bytes one tenant's open saves may have reserved at once."""
        return self.max_reserved_bytes_per_tenant or RESERVED_ENTRIES * self.max_blob_bytes

    def pinned_bytes_bound(self, disk_quota: int | None) -> int:
        """The most bytes one tenant's expiring pins may hold, given its disk quota: what
        they pin counts against its quota, and a tenant without one must not pin the
        shared budget."""
        bound = self.max_pinned_bytes_per_tenant or self.disk_bytes // PINNED_SHARE
        return bound if disk_quota is None else min(bound, disk_quota)


BLOB_SUFFIX = ".kvc"
TMP_SUFFIX = ".part"


class Layout:
    """The data directory's folders and the name of every file in them and in the RAM
    tier's folder (the layout is drawn in the package docstring). Fixed once made: safe
    from any thread, no lock."""

    def __init__(self, root: Path, ram_dir: Path) -> None:
        self.root = root
        self.ram_dir = ram_dir  # the RAM tier's own folder (Store finds it: ramtier.tier_dir)
        self.blob_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"

    def make_dirs(self) -> None:
        # Owner-only from creation: these hold the cached prompts. The data directory
        # itself keeps whatever mode it was given.
        for d in (self.blob_dir, self.tmp_dir, self.quarantine_dir):
            d.mkdir(mode=0o700, exist_ok=True)

    def blob_path(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.blob_dir / hexkey[:2] / f"{hexkey}{BLOB_SUFFIX}"

    def ram_path(self, key: bytes) -> Path:
        return self.ram_dir / f"{key.hex()}{BLOB_SUFFIX}"

    def ram_tmp_path(self, key: bytes) -> Path:
        return self.ram_dir / f"{key.hex()}{TMP_SUFFIX}"

    def tmp_path(self, lease_id: str) -> Path:
        return self.tmp_dir / f"{lease_id}{TMP_SUFFIX}"

    def disk_free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


class StoreStats(TypedDict):
    """What ``Store.stats()`` reports: the figures of the Stats RPC and the metrics."""

    counters: dict[str, int]  # every declared counter, zeros included
    disk_used: int
    ram_used: int
    disk_entries: int
    ram_entries: int
    reserved_bytes: int
    logical_bytes: int
    in_flight: int
    waiting_lookups: int
    read_pins: int
    uptime: float  # seconds
    recovery: RecoveryProgress  # the check after a crash (kvcache.store.recovery)


@dataclass
class RecoveryProgress:
    """How far the check after a crash got (kvcache.store.recovery), for Stats."""

    state: str = "none"  # none (a clean start, or the full reconcile), running, done, failed
    entries: int = 0  # entries in the index when it started
    entries_checked: int = 0
    folders_checked: int = 0  # of 256
    checked_on_read: int = 0  # entries read before their folder's turn: checked first
    started: float = 0.0  # monotonic
    seconds: float = 0.0  # so far, or until it finished


@dataclass
class TenantUsage:
    """What one tenant's entries hold (entries without a tenant count as one, "")."""

    disk_bytes: int = 0
    disk_entries: int = 0
    ram_bytes: int = 0  # RAM copies made, and room claimed for one being made
    ram_entries: int = 0
    room_bytes: int = 0  # disk room its open saves hold (part of Tally.reserved_bytes)

    def idle(self) -> bool:
        return not (self.disk_bytes or self.disk_entries or self.ram_bytes
                    or self.ram_entries or self.room_bytes)

    def state(self) -> list[int]:
        return [self.disk_bytes, self.disk_entries, self.ram_bytes, self.ram_entries]


class Tally:
    """The byte accounting, and the only code that changes it: bytes each tier holds, RAM
    copies, bytes reserved by open leases, and logical bytes (the sum of
    Record.logical_size: what the entries' whole states would take), in all and per
    tenant (what tenant quotas are held to: kvcache.store.quotas).

    Kept as entries come and go rather than counted from the index: Stats and every
    metrics scrape read them, and counting index rows costs ~20 ms at 10,000 entries. The
    numbers equal what the index and the files hold after every change
    (tests/unit/test_store.py::test_tier_counts_follow_every_change).

    Not thread-safe: every method is called with Store._cond held (or at start-up, before
    any other thread runs). Reading an attribute without it sees a recent value."""

    def __init__(self) -> None:
        self.disk_used = 0
        self.ram_used = 0
        self.ram_entries = 0  # the index counts disk entries itself (every entry is on disk)
        self.ram_claimed = 0  # room taken for copies being made (part of ram_used)
        self.reserved_bytes = 0
        self.logical_bytes = 0
        # Tenant label -> its usage; a tenant holding nothing has no row.
        self.tenants: dict[str, TenantUsage] = {}
        # Told of every entry published or removed and every RAM copy made or dropped, in
        # the order they happen, under the store lock (KV events: Store.watch).
        self.watcher: Callable[[str, Record], None] | None = None

    def _tell(self, change: str, record: Record) -> None:
        if self.watcher is not None:
            self.watcher(change, record)

    @property
    def ram_copies_bytes(self) -> int:
        """Bytes of the RAM copies made (ram_used without the room claimed for copies)."""
        return self.ram_used - self.ram_claimed

    def tenant(self, tenant_id: str) -> TenantUsage:
        """``tenant_id``'s usage (a zero one, not kept, for a tenant holding nothing)."""
        return self.tenants.get(tenant_id) or TenantUsage()

    def _change(self, tenant_id: str, **deltas: int) -> None:
        usage = self.tenants.setdefault(tenant_id, TenantUsage())
        for name, delta in deltas.items():
            setattr(usage, name, getattr(usage, name) + delta)
        if usage.idle():
            del self.tenants[tenant_id]

    def state(self) -> dict[str, object]:
        """What a clean shutdown records (see restore)."""
        return {"disk_used": self.disk_used, "logical_bytes": self.logical_bytes,
                "ram_used": self.ram_used, "ram_entries": self.ram_entries,
                "tenants": {t: u.state() for t, u in self.tenants.items()}}

    def recount(self, usage: dict[str, Usage]) -> None:
        """Take what the entries hold from the index's sums (kvcache.index_sums, kept in
        the rows' transactions: right after a crash too), keeping the room claimed for
        saves and copies in flight."""
        rooms = {t: u.room_bytes for t, u in self.tenants.items() if u.room_bytes}
        claimed = self.ram_claimed
        self.disk_used = sum(u.disk_bytes for u in usage.values())
        self.logical_bytes = sum(u.logical_bytes for u in usage.values())
        self.ram_used = sum(u.ram_bytes for u in usage.values()) + claimed
        self.ram_entries = sum(u.ram_entries for u in usage.values())
        self.tenants = {t: TenantUsage(u.disk_bytes, u.disk_entries, u.ram_bytes,
                                       u.ram_entries) for t, u in usage.items()}
        for tenant_id, room in rooms.items():
            self._change(tenant_id, room_bytes=room)

    def restore(self, state: dict[str, object]) -> None:
        """Counts recorded by the last clean shutdown, instead of counting every entry."""
        for name in ("disk_used", "logical_bytes", "ram_used", "ram_entries"):
            value = state.get(name)
            if type(value) is not int:
                raise ValueError(f"clean-shutdown record without {name}")
            setattr(self, name, value)
        tenants = state.get("tenants")
        # A record written before per-tenant usage was kept: ValueError means the full
        # reconcile, which counts every entry.
        if not isinstance(tenants, dict) or not all(
                isinstance(t, str) and isinstance(u, list) and len(u) == 4
                and all(type(v) is int for v in u) for t, u in tenants.items()):
            raise ValueError("clean-shutdown record without per-tenant usage")
        self.tenants = {t: TenantUsage(*u) for t, u in tenants.items()}

    def entry_added(self, record: Record) -> None:
        """A published entry (its blob is on disk)."""
        self._tell("added", record)
        self.disk_used += record.size
        self.logical_bytes += record.logical_size
        self._change(record.tenant_id, disk_bytes=record.size, disk_entries=1)

    def entry_removed(self, record: Record) -> None:
        """An unpublished entry, with its RAM copy if ``record`` (as removed) had one."""
        self._tell("removed", record)
        self.disk_used -= record.size
        self.logical_bytes -= record.logical_size
        self._change(record.tenant_id, disk_bytes=-record.size, disk_entries=-1)
        if record.in_ram:
            self.ram_used -= record.size
            self.ram_entries -= 1
            self._change(record.tenant_id, ram_bytes=-record.size, ram_entries=-1)

    def ram_copy_found(self, record: Record) -> None:
        """A RAM copy found whole at start-up."""
        self._tell("ram_placed", record)
        self.ram_used += record.size
        self.ram_entries += 1
        self._change(record.tenant_id, ram_bytes=record.size, ram_entries=1)

    def claim_ram(self, record: Record) -> None:
        """Room taken for a copy about to be made: counted before the copy exists, so no
        other placement takes the same room."""
        self.ram_used += record.size
        self.ram_claimed += record.size
        self._change(record.tenant_id, ram_bytes=record.size)

    def unclaim_ram(self, record: Record) -> None:
        """The copy claimed with claim_ram was not made."""
        self.ram_used -= record.size
        self.ram_claimed -= record.size
        self._change(record.tenant_id, ram_bytes=-record.size)

    def ram_copy_placed(self, record: Record) -> None:
        """The copy claimed with claim_ram is made and indexed."""
        self._tell("ram_placed", record)
        self.ram_entries += 1
        self.ram_claimed -= record.size
        self._change(record.tenant_id, ram_entries=1)

    def ram_copy_dropped(self, record: Record) -> None:
        self._tell("ram_dropped", record)
        self.ram_used -= record.size
        self.ram_entries -= 1
        self._change(record.tenant_id, ram_bytes=-record.size, ram_entries=-1)

    def reserve(self, size: int, tenant_id: str) -> None:
        self.reserved_bytes += size
        self._change(tenant_id, room_bytes=size)

    def unreserve(self, size: int, tenant_id: str) -> None:
        self.reserved_bytes -= size
        self._change(tenant_id, room_bytes=-size)


class Unchecked:
    """After a crash, the entries the background recovery (kvcache.store.recovery) has not
    yet checked against their files: those in blob folders it has not reached (folders
    are named by a key's first byte and checked in order) that no read has checked first
    and no save has published since. Not thread-safe: Store._cond held."""

    def __init__(self) -> None:
        self.running = False
        self.position = 256  # the first folder (key byte) not yet checked
        self._done: set[bytes] = set()  # checked ahead of their folder
        self.checked_on_read = 0  # entries a read checked ahead of their folder
        # Rows found damaged (only something else than kvcache damages one): never
        # served, rebuilt from their blobs by the next start-up's full reconcile.
        self.damaged: set[bytes] = set()

    def start(self) -> None:
        self.running, self.position = True, 0
        self._done.clear()

    def holds(self, key: bytes) -> bool:
        return self.running and key[0] >= self.position and key not in self._done

    def checked(self, key: bytes, on_read: bool = False) -> None:
        """``key`` is known good ahead of its folder (checked on read, or just saved)."""
        if self.holds(key):
            self._done.add(key)
            self.checked_on_read += on_read

    def folder_checked(self, folder: int) -> None:
        self.position = folder + 1
        self._done = {k for k in self._done if k[0] > folder}

    def finish(self) -> None:
        self.running, self.position = False, 256
        self._done.clear()


# The tenants whose entries a caller may see, by label (Record.tenant_id; "" for entries
# without a tenant); None: every tenant's (an operator). Every call by key takes it, and
# answers an entry of another tenant, published or being written, on the very path of a
# key nobody saved: same error, same words, same counters, no wait, same time
# (tests/daemon/test_scoped_tokens.py, tools/bench_tenant_probes.py).
Seen = frozenset[str] | None
# What a missing key's row is decoded as for a caller bound to tenants (seen_record).
_STAND_IN_ROW = Record(
    key=bytes(16), namespace=bytes(16), anchor=bytes(16), tail=bytes(4 * 16), n_tokens=1024,
    size=1 << 20, codec="none", reason="finish", created=1.7e9, model_name="model.gguf",
    model_fingerprint="0" * 32, tenant_id="0" * 32).pack()


def seen_record(index: Index, key: bytes, tenants: Seen) -> Record | None:
    """The entry ``key`` when a caller seeing ``tenants`` may see it, else None, as for a
    key nobody saved. Only a row's tenant says whose it is, and decoding a row takes
    microseconds that a missing key does not: for a caller bound to tenants a missing
    key's stand-in row is decoded too, so that another tenant's key and a key nobody
    saved take the same time (a timing difference of ~10 us, repeated, told them apart)."""
    if tenants is None:
        return index.get(key)
    row = index.row(key)
    record = Record.unpack(_STAND_IN_ROW if row is None else row)
    return record if row is not None and record.tenant_id in tenants else None


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
    leaves out their ancestors): tests/unit/test_store.py::
    test_eviction_never_takes_pinned_or_in_use_entries and tests/daemon/test_pieces.py::
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
    file: io.FileIO | None = None  # the temp file, open until the lease ends
    written: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    tenant_id: str | None = None  # the reserving identity's; None: not checked
    parent: bytes = b""  # a piece's parent, held (like a read) until commit or abort
    base: int = 0
    raw_tokens: bytes = b""  # what a lookup compares a save in flight with
    # Bytes of the disk budget this save holds (Tally.reserved_bytes): taken as its bytes
    # arrive, never at Reserve, so a reservation nobody writes evicts nothing.
    room: int = 0


class LeaseTable:
    """Open leases by id, and the key each is writing (one writer per key).

    Not thread-safe: every method is called with Store._cond held."""

    def __init__(self) -> None:
        self.reservations: dict[str, Reservation] = {}
        self.in_flight: dict[bytes, str] = {}  # key -> lease_id

    def open(self, res: Reservation) -> None:
        self.reservations[res.lease_id] = res
        self.in_flight[res.key.key] = res.lease_id

    def get(self, lease_id: str) -> Reservation | None:
        return self.reservations.get(lease_id)

    def close(self, res: Reservation) -> None:
        self.reservations.pop(res.lease_id, None)
        self.in_flight.pop(res.key.key, None)

    def writing(self, key: bytes, tenants: Seen = None) -> bool:
        """Whether a save of ``key`` is in flight that a caller seeing ``tenants`` may
        see (a save without a tenant is the "" tenant's)."""
        lease_id = self.in_flight.get(key)
        if lease_id is None or tenants is None:
            return lease_id is not None
        res = self.reservations.get(lease_id)
        return res is not None and (res.tenant_id or "") in tenants

    def shared_in_flight(self, ns: bytes, raw_tokens: bytes) -> int:
        """The most leading tokens of ``raw_tokens`` that a save being written in
        namespace ``ns`` holds (a scan of the open leases: as many as writers at once)."""
        return max((keys.common_prefix_tokens(res.raw_tokens, raw_tokens)
                    for res in self.reservations.values() if res.namespace == ns),
                   default=0)

    def of_tenant(self, tenant_id: str) -> list[Reservation]:
        """The open leases of ``tenant_id`` (those reserved without one: "")."""
        return [r for r in self.reservations.values() if (r.tenant_id or "") == tenant_id]

    def lease_ids(self) -> list[str]:
        return list(self.reservations)

    def expired(self, now: float) -> list[Reservation]:
        """Leases whose time is up (monotonic ``now``)."""
        return [r for r in self.reservations.values() if r.expires < now]


@dataclass(frozen=True)
class StoreCore:
    """What the parts of the store share: made once by Store, handed to each part (the
    one argument every part takes first). The bindings never change; what they hold
    does, under ``cond``."""

    config: StoreConfig
    layout: Layout
    index: Index
    # The store lock (Store._cond): a Condition over an RLock, so a part holding it may
    # call another part that takes it. Readers waiting for an entry being written sleep
    # on it; a commit, an abort or an entry no longer held wakes them.
    cond: threading.Condition
    counters: Counter[str]
    tally: Tally
    pins: ReadPins
    leases: LeaseTable
    closed: threading.Event  # set once the store closes: nothing new is scheduled
    # Entries the reclaimer is removing with the store lock let go (kvcache.store.reclaim):
    # chosen under it, their files removed and directories fsynced without it, their rows
    # dropped after. Until then each is as good as gone: no read, pin, copy, check or new
    # save of its key starts on it (every such call decides under the store lock).
    leaving: set[bytes]
    unchecked: Unchecked

    @classmethod
    def create(cls, config: StoreConfig, layout: Layout, index: Index,
               counters: Counter[str]) -> StoreCore:
        """A core with empty tables, a new store lock, and the store not closed."""
        cond = threading.Condition(threading.RLock())
        return cls(config=config, layout=layout, index=index, cond=cond, counters=counters,
                   tally=Tally(), pins=ReadPins(on_free=cond.notify_all),
                   leases=LeaseTable(), closed=threading.Event(), leaving=set(),
                   unchecked=Unchecked())

    def visible(self, key: bytes, tenants: Seen = None) -> Record | None:
        """``key``'s entry when a caller seeing ``tenants`` may use it: published and not
        being removed (see ``leaving``). Store lock held, for an answer that holds."""
        if key in self.unchecked.damaged:
            return None
        # The row is read (and a missing one's stand-in decoded) either way: an entry
        # being removed answers in the time of a missing key (see seen_record).
        record = seen_record(self.index, key, tenants)
        return None if key in self.leaving else record


class Part:
    """A part of the store (Entries, Evictor, Publisher, ...): built on the core, which it
    reaches by these names. What a part needs beyond the core (another part) it is given
    by name in its own constructor."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._config = core.config
        self._layout = core.layout
        self._index = core.index
        self._cond = core.cond
        self.counters = core.counters
        self._tally = core.tally
        self._pins = core.pins
        self._leases = core.leases
        self._leaving = core.leaving
        self._unchecked = core.unchecked
