"""Saving an entry: reserve (a lease) -> write chunks to a temp file, verified as they
arrive -> commit (verify, fsync, rename into blobs/, fsync the directory, publish in one
LMDB transaction, wake waiting readers) or abort."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from dataclasses import dataclass

import lmdb

from .. import blob as blobfmt
from .. import keys
from ..errors import (
    InvalidArgument,
    LeaseLost,
    NotFound,
    OutOfRange,
    StoreError,
    StoreFull,
    TooManySaves,
)
from ..index import ParentGone, dir_fsync
from ..record import Record
from .core import Part, Reservation, Seen, StoreCore
from .entries import Entries, check_tokens, record_from
from .eviction import Evictor
from .integrity import Integrity
from .placement import RamPlacer

# Room for a streamed save is taken this much ahead of its bytes (or all of it, when
# smaller): a chunk at a time would make each chunk a removal batch.
ROOM_STEP = 4 << 20
# How long a save waits for the reclaimer to finish removing its key's entry (a batch of
# files unlinked and fsynced takes milliseconds); past it the save is told "in flight".
LEAVING_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class ReserveResult:
    status: str  # granted | already_present | in_flight
    key: bytes
    lease_id: str = ""
    local_path: str = ""


class Publisher(Part):
    """Reserve, write, commit and abort.

    Thread-safe. Each Reservation.lock serialises its lease's writes, commit and abort (and
    the reaper's expiry of it); Store._cond is taken inside it, around the shared tables,
    never the other way round. Blob files are written, fsynced and renamed with only the
    lease's lock held.

    Crash safety: a crash before the LMDB commit leaves at worst a temp file (swept at
    start-up) or an unindexed blob (re-indexed from its header at start-up)
    (tests/faults/test_daemon_crash.py, tests/faults/test_crash_harness.py)."""

    def __init__(self, core: StoreCore, entries: Entries, evictor: Evictor,
                 placer: RamPlacer, integrity: Integrity) -> None:
        super().__init__(core)
        self._entries = entries
        self._evictor = evictor
        self._placer = placer
        self._integrity = integrity

    # -- reserve ----------------------------------------------------------------------------

    def reserve(self, ns: bytes, raw_tokens: bytes, size: int, reason: str,
                model_fingerprint: str, *, tenant_id: str | None = None,
                parent: bytes = b"", base: int = 0, tenants: Seen = None) -> ReserveResult:
        """Reserve the save of an entry. With ``parent``, the entry is a piece: its blob
        holds only the cells after its first ``base`` tokens, which the parent's chain
        holds (checked here against the index); the parent is held until commit or abort.
        Every argument is checked before the parent is looked for, and a parent of a
        tenant the caller may not see (``tenants``) is a parent that is gone: the answer
        says nothing about another tenant's keys."""
        cfg = self._config
        check_tokens(raw_tokens, cfg.max_tokens)
        if reason not in blobfmt.SAVE_REASONS:
            raise InvalidArgument(f"unknown save reason {reason!r} "
                                  f"(one of {', '.join(blobfmt.SAVE_REASONS)})")
        if size <= blobfmt.HEADER_SIZE:
            raise InvalidArgument(f"size {size} is too small for a blob")
        if size > cfg.max_blob_bytes:
            raise InvalidArgument(f"size {size} exceeds the limit of {cfg.max_blob_bytes}")
        entry = keys.entry_key(ns, raw_tokens, cfg.block_size)
        # After a crash, a row the recovery has not checked may have lost its blob (a
        # removal cut short): it must not answer "already present", nor be a piece's
        # parent, or the save would go with it (tests/unit/test_recovery.py).
        for key in (entry.key, parent) if parent else (entry.key,):
            self._integrity.check_if_unchecked(key)
        if parent or base:
            self._check_parent(ns, raw_tokens, parent, base, tenants)
        return self._reserve(ns, raw_tokens, size, reason, model_fingerprint, entry,
                             tenant_id, parent, base, tenants)

    def _reserve(self, ns: bytes, raw_tokens: bytes, size: int, reason: str,
                 model_fingerprint: str, entry: keys.EntryKey, tenant_id: str | None,
                 parent: bytes, base: int, tenants: Seen) -> ReserveResult:
        cfg = self._config
        with self._cond:
            self.counters["reserves"] += 1
            self._wait_until_gone(entry.key)
            if self._leases.writing(entry.key) or entry.key in self._leaving:
                self.counters["saves_duplicate"] += 1
                self.counters["saves_duplicate_in_flight"] += 1
                return ReserveResult("in_flight", entry.key)
            if self._index.get(entry.key) is not None:
                self.counters["saves_duplicate"] += 1
                self.counters["saves_duplicate_present"] += 1
                return ReserveResult("already_present", entry.key)
            if parent and self._core.visible(parent, tenants) is None:  # gone since
                self.counters["saves_parent_gone"] += 1
                raise NotFound(f"parent entry {parent.hex()} is gone (evicted or deleted); "
                               "save the whole state or look again")
            tenant = tenant_id or ""
            open_saves = self._leases.of_tenant(tenant)
            if len(open_saves) >= cfg.max_saves_per_tenant:
                self.counters["saves_refused_tenant_limit"] += 1
                raise TooManySaves(f"this tenant has {cfg.max_saves_per_tenant} saves in "
                                   "flight already (--max-saves-per-tenant): commit or abort "
                                   "one first")
            # What a tenant's open saves may yet write is bounded as their number is: a
            # few large reservations are the most its writers can push out at once.
            reserved = sum(r.size for r in open_saves)
            bound = cfg.reserved_bytes_bound
            if reserved + size > bound:
                self.counters["saves_refused_reserved_bytes"] += 1
                raise TooManySaves(f"this tenant's saves in flight have reserved {reserved} "
                                   f"bytes; {size} more would pass its limit of {bound} "
                                   "(--max-reserved-bytes-per-tenant): commit or abort one "
                                   "first")
            self._evictor.refuse_over_quota(tenant, size)
            # No room is made here (a save that could never fit is refused): a client
            # could reserve the whole budget, evict every tenant's entries and abort. Room
            # is made as the bytes arrive (_claim_room;
            # tests/daemon/test_reservations.py::test_a_reservation_nobody_writes_evicts_nothing).
            self._evictor.make_room_on_disk(size, evict=False)
            lease_id = secrets.token_hex(16)
            tmp_path = self._layout.tmp_path(lease_id)
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            res = Reservation(
                lease_id=lease_id, key=entry, namespace=ns, model_fingerprint=model_fingerprint,
                reason=reason, size=size, tmp_path=tmp_path,
                expires=time.monotonic() + cfg.lease_seconds,
                verifier=blobfmt.StreamVerifier(size), file=os.fdopen(fd, "wb", buffering=0),
                tenant_id=tenant_id, parent=parent, base=base, raw_tokens=raw_tokens,
            )
            if parent:
                self._pins.hold(parent)  # not evicted or deleted under the piece
            self._leases.open(res)
            self.counters["saves_granted"] += 1
            return ReserveResult("granted", entry.key, lease_id, str(tmp_path))

    def _wait_until_gone(self, key: bytes) -> None:
        """Wait (bounded) while the reclaimer removes ``key``'s entry: a save of its tokens
        then finds it gone and saves it again, never a file about to be unlinked under
        the new one's name. Store._cond held (the wait lets it go)."""
        deadline = time.monotonic() + LEAVING_WAIT_SECONDS
        while key in self._leaving and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)

    def _check_parent(self, ns: bytes, raw_tokens: bytes, parent: bytes, base: int,
                      tenants: Seen) -> None:
        n = len(raw_tokens) // 4
        if len(parent) != keys.KEY_BYTES or not 0 < base < n:
            raise InvalidArgument(f"a piece needs a parent key and 0 < base < {n} tokens "
                                  f"(got a {len(parent)}-byte parent, base {base})")
        record = self._core.visible(parent, tenants)
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
        block_size = self._config.block_size
        if not record.base < base <= record.n_tokens or not self._index.shares_prefix(
                parent, keys.block_hashes(ns, raw_tokens, block_size),
                raw_tokens, base, block_size):
            raise InvalidArgument(f"parent entry {parent.hex()} does not end a chain holding "
                                  f"the first {base} tokens (its own cells are "
                                  f"[{record.base}, {record.n_tokens}))")

    # -- write ------------------------------------------------------------------------------

    def reservation(self, lease_id: str) -> Reservation:
        """The open lease ``lease_id``; LeaseLost when it is unknown or has ended."""
        with self._cond:
            res = self._leases.get(lease_id)
        if res is None or res.done:
            raise LeaseLost(f"unknown or expired lease {lease_id!r}")
        return res

    def write(self, lease_id: str, offset: int, data: bytes | memoryview) -> int:
        res = self.reservation(lease_id)
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
                self._claim_room(res, res.written + len(data))
            except StoreFull:
                self.abort(lease_id, _locked=res)
                raise
            try:
                res.verifier.feed(data)
            except blobfmt.BlobError as exc:
                self.abort(lease_id, _locked=res)
                raise InvalidArgument(f"malformed blob: {exc} (save aborted)") from None
            assert res.file is not None  # open until the lease ends, and it has not
            try:
                view = memoryview(data)
                while view:
                    # A raw write is short when the disk fills: every byte of the chunk is
                    # written or the save fails (a write of nothing is ENOSPC), so no blob
                    # is published shorter than what the stream verifier saw
                    # (tests/faults/test_full_disk.py::
                    # test_disk_filling_after_the_reservation_aborts_the_write_cleanly).
                    n = res.file.write(view)
                    if not n:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    view = view[n:]
            except OSError as exc:
                error = self._save_io_error(exc, res, "writing")  # free space before cleanup
                self.abort(lease_id, _locked=res)
                raise error from None
            res.written += len(data)
            res.expires = time.monotonic() + self._config.lease_seconds
            return res.written

    def _claim_room(self, res: Reservation, upto: int, written_locally: bool = False) -> None:
        """Hold room for the first ``upto`` bytes of ``res`` (and up to ROOM_STEP more, so
        a stream of small chunks does not evict chunk by chunk), evicting what must go.
        StoreFull when it cannot be had. ``written_locally``: the bytes are on the disk
        already (a local writer's, claimed at commit). ``res.lock`` held."""
        if upto <= res.room:
            return
        target = min(res.size, max(upto, res.room + ROOM_STEP))
        need = target - res.room
        on_disk = need if written_locally else 0
        tenant = res.tenant_id or ""
        with self._cond:
            # The tenant's quota first, from its own entries; nothing goes unless the
            # shared budget has room too once they have gone (they are among what it may
            # evict), so a refused save evicts nothing.
            plan = self._evictor.plan_tenant_room_on_disk(tenant, need)
            if plan:
                self._evictor.make_room_on_disk(need, evict=False, on_disk=on_disk)
                self._evictor.remove_for_tenant(plan)
            self._evictor.make_room_on_disk(need, on_disk=on_disk)
            self._tally.reserve(need, tenant)
            res.room = target

    # -- commit -----------------------------------------------------------------------------

    def commit(self, lease_id: str, local_write: bool = False) -> Record:
        res = self.reservation(lease_id)
        with res.lock:
            if res.done:
                raise LeaseLost(f"lease {lease_id!r} ended before commit")
            try:
                # A local writer's bytes arrived unseen; a streamed save's are held already.
                self._claim_room(res, res.size, written_locally=local_write)
            except StoreFull:
                self.abort(lease_id, _locked=res)
                raise
            try:
                header, meta = self._verify_reserved(res, local_write)
            except blobfmt.BlobError as exc:
                self.abort(lease_id, _locked=res)
                with self._cond:
                    self.counters["saves_invalid"] += 1
                raise InvalidArgument(f"blob rejected at commit: {exc} (save aborted)") from None
            f = res.file
            assert f is not None  # open until the lease ends, and it has not
            final = self._layout.blob_path(res.key.key)
            renamed = False
            try:
                os.fsync(f.fileno())
                f.close()
                res.file = None
                if not final.parent.is_dir():
                    final.parent.mkdir(mode=0o700, exist_ok=True)
                    dir_fsync(self._layout.blob_dir)
                os.rename(res.tmp_path, final)
                renamed = True
                dir_fsync(final.parent)
                record = record_from(res.key, header, meta, res.size)
                with self._cond:  # known before it is visible: see Entries.remove_entry
                    self._entries.add_child(record)
                self._index.put(record, keys.passes(res.namespace, meta.tokens,
                                                    self._config.block_size))
                with self._cond:  # the index has it now
                    self._entries.drop_child(record.parent, record.key)
            except ParentGone as exc:  # quarantined meanwhile (a hold stops everything else)
                final.unlink(missing_ok=True)
                with self._cond:
                    self._entries.drop_child(res.parent, record.key)
                    self.counters["saves_parent_gone"] += 1
                self.abort(lease_id, _locked=res)
                raise NotFound(f"{exc} (save aborted)") from None
            except (OSError, lmdb.Error) as exc:
                # Any I/O failure here (a full disk also fails the index commit: LMDB grows
                # its file) aborts the save: the renamed blob file is removed, the key is no
                # longer in flight, and the writer gets RESOURCE_EXHAUSTED or INTERNAL
                # (tests/faults/test_full_disk.py::test_disk_full_at_commit_aborts_and_removes_the_blob).
                error = self._save_io_error(exc, res, "committing")  # free space before cleanup
                if renamed:
                    final.unlink(missing_ok=True)
                if res.parent:
                    with self._cond:
                        self._entries.drop_child(res.parent, res.key.key)
                self.abort(lease_id, _locked=res)
                raise error from None
            with self._cond:
                res.done = True
                self._leases.close(res)
                self._tally.unreserve(res.room, res.tenant_id or "")
                if res.parent:
                    self._pins.release(res.parent)
                    self.counters["pieces_committed"] += 1
                self._tally.entry_added(record)
                self._unchecked.checked(record.key)  # just written: nothing to check
                self.counters["saves_committed"] += 1
                self.counters[f"saves_committed_{meta.reason}"] += 1
                self.counters["bytes_committed"] += res.size
                self._cond.notify_all()
        self._placer.schedule(record.key)
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
        if keys.entry_key(meta.namespace, meta.tokens, self._config.block_size) != res.key:
            raise blobfmt.BlobError("blob tokens differ from the reserved tokens")
        if (meta.parent, meta.base) != (res.parent, res.base):
            raise blobfmt.BlobError("blob parent and base differ from the reserved ones")
        return header, meta

    def _save_io_error(self, exc: BaseException, res: Reservation, doing: str) -> StoreError:
        """The error for a save that failed on I/O (already aborted): no space left is
        RESOURCE_EXHAUSTED and says what is free; anything else is INTERNAL."""
        if isinstance(exc, lmdb.DiskError) or getattr(exc, "errno", None) in (errno.ENOSPC,
                                                                               errno.EDQUOT):
            return StoreFull(f"no space left on the disk tier ({self._layout.root}) while "
                             f"{doing} a blob of {res.size} bytes: "
                             f"{self._layout.disk_free()} bytes free (save aborted)")
        return StoreError(f"I/O error while {doing} a blob of {res.size} bytes: {exc} "
                          "(save aborted)")

    # -- abort and expiry -------------------------------------------------------------------

    def abort(self, lease_id: str, *, _locked: Reservation | None = None,
              counter: str = "saves_aborted") -> None:
        """End a lease and remove its temp file. ``_locked``: the lease, its lock already
        held by the caller."""
        res = _locked
        if res is None:
            res = self.reservation(lease_id)
            with res.lock:
                self.finish_abort(res, counter)
        else:
            self.finish_abort(res, counter)

    def finish_abort(self, res: Reservation, counter: str) -> None:
        """Abort ``res``, its lock held, unless it has ended already."""
        with self._cond:
            if res.done:
                return
            self.drop_reservation(res.lease_id, counter)

    def drop_reservation(self, lease_id: str, counter: str) -> None:
        """Remove a reservation and its temp file. Store._cond held."""
        res = self._leases.get(lease_id)
        if res is None:
            return
        res.done = True
        self._leases.close(res)
        self._tally.unreserve(res.room, res.tenant_id or "")
        if res.parent:
            self._pins.release(res.parent)
        if res.file is not None:
            with contextlib.suppress(OSError):
                res.file.close()
        res.tmp_path.unlink(missing_ok=True)
        self.counters[counter] += 1
        self._cond.notify_all()

    def expire(self, expired: list[Reservation]) -> None:
        """Abort the leases whose time was up when listed and still is."""
        for res in expired:
            # A writer busy with a chunk holds the lock and renews the lease: skip it.
            if res.lock.acquire(blocking=False):
                try:
                    if res.expires < time.monotonic():
                        self.finish_abort(res, "leases_expired")
                finally:
                    res.lock.release()
