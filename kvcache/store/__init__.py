"""The store: blob files in a disk tier and a RAM tier, the index, and the
reservation-then-publish protocol. Thread-safe; the gRPC service is a thin layer on it.

Layout under the data directory (its subfolders owner-only)::

    index/              LMDB index (six named databases, see kvcache.index)
    blobs/ab/<key>.kvc  published blobs (disk tier); every entry is here (write-through)
    tmp/<lease>.part    blobs being written; swept at start-up
    quarantine/         blobs that failed a checksum, kept for post-mortems

The directory carries a ``.kvcache`` marker; kvcache refuses a directory it did not make
(see kvcache.store.ownership). The RAM tier is a folder of its own on a memory
filesystem (``/dev/shm/kvcache-<uid>-<tag>`` by default; see kvcache.store.ramtier)
holding copies of hot blobs (``<key>.kvc``; ``<key>.part`` while one is copied). Being a
file system, it lets a same-host reader open the blob directly (the fast path) while the
entry is pinned by its read.

Publish protocol: reserve (lease) -> write chunks to tmp (verified as they arrive) ->
commit: verify size and checksums, fsync, rename into blobs/, fsync the directory, one
LMDB transaction makes it visible, waiters wake. A crash before the LMDB commit leaves at
worst a tmp file (swept) or an unindexed blob (re-indexed from its header at start-up).
A removal runs the other way round: files, then a directory fsync, then rows (see
Entries.remove_entry), so a blob without a row is always a publish cut short, never a
removal.

Modules, one concern each, in layers: each imports only modules of the layers below it
(tests/unit/test_layering.py::test_each_store_module_imports_only_the_layers_below_it). Read
``core`` first (what every part shares), then ``facade`` (how the parts are put
together), then the part you need.

1. Leaves, importing nothing of the store:

   * ``core``       StoreConfig, Layout (file names), Tally (the one owner of the byte
                    accounting), ReadPins (holds on entries, usage not yet in the
                    index), LeaseTable (saves in flight), and StoreCore, which bundles
                    them with the entries being removed without the store lock
                    (``leaving``), the index, the counters and the store lock; every part
                    takes it as its first argument (Part).
   * ``policy``     The orders what goes first, as full sorts (kvcache.ordering keeps
                    them in the index; tests/unit/test_ordering.py holds them equal).
   * ``quotas``     TenantQuotas: the optional per-tenant byte quotas of each tier.
   * ``ownership``  The data directory's ``.kvcache`` marker: kvcache uses only
                    directories it made.
2. ``ramtier``      The RAM tier's own folder: claiming it, finding orphaned ones.
   ``entries``      Entries: published entries by key, what is built on each (the
                    index's children table, and pieces being committed), chain and
                    dependents, removal with everything built on an entry; RamCopies:
                    dropping RAM copies.
3. ``eviction``     Evictor: what goes when a tier is full (kvcache.store.policy's
                    orders, kept in the index by kvcache.ordering), a batch at a time,
                    and what a tenant at its quota gives up of its own.
4. ``placement``    RamPlacer: copying hot entries into the RAM tier (the RAM worker).
   ``reclaim``      Reclaimer: each tier kept between its watermarks in the background,
                    so saves find room made.
5. ``integrity``    Integrity: checks, quarantine, Inspect.
6. ``reads``        Reads: open, stream, release.
   ``publish``      Publisher: reserve, write, commit, abort, expiry.
   ``listing``      Operators' listings, page by page.
7. ``prune``        Pruner: the operator's removals.
   ``reconcile``    Reconcile: start-up agreement of index and files.
8. ``facade``       Store: the entry point; owns the store lock, the reaper and
                    reclaimer threads and the parts, and delegates to them.

Locking (see Store): one store lock, ``Store._cond``, guards every table and tally;
each part's docstring says whether it takes it or expects it held. A lease's own lock is
taken before it, never after.

Invariants, and the tests that hold them:

* An entry is visible only once its blob is durable and whole; a kill at any point loses
  no committed entry and leaves none half-visible (tests/faults/test_crash_harness.py::
  test_a_hundred_kills_lose_nothing, tests/faults/test_daemon_crash.py).
* A removal (delete, prune, eviction, quarantine, the pieces built on an entry with it)
  that anyone could have seen is never undone by a crash, a kill or a power cut, at any
  instant: its files go, and their directories are fsynced, before one transaction drops
  its rows; start-up drops rows whose blob is gone and re-indexes only blobs, so once a row
  is gone nothing is left to bring it back, not even a rebuilt index. A RAM copy goes
  before the row stops saying "in RAM". No tombstones: a new save of a removed key is an
  ordinary save (tests/faults/test_durable_removals.py, one test per window of a removal, and
  test_a_delete_with_pieces_and_ram_copies_killed_at_every_step_is_never_undone;
  tests/faults/test_crash_harness.py counts an answered delete or prune listed again as loss).
* A piece is never visible without its parent: it is published only in a transaction
  that finds the parent, and removed with it (tests/daemon/test_pieces.py::
  test_a_corrupt_piece_takes_what_is_built_on_it, test_start_up_drops_pieces_whose_parent_is_gone).
* Eviction takes leaves, least recently used first, and never a pinned or held entry or
  anything it is built on (tests/unit/test_store.py::test_disk_eviction_is_least_recently_used_first,
  test_eviction_never_takes_pinned_or_in_use_entries; tests/daemon/test_pieces.py::
  test_eviction_takes_leaves_first_and_keeps_the_shared_prefix), in exactly the order
  kvcache.store.policy's full sorts give (tests/unit/test_ordering.py::
  test_the_kept_order_is_the_full_sort_after_any_changes), reading only what it evicts
  (tests/unit/test_store.py::test_making_room_reads_only_what_it_evicts); the reclaimer
  too (tests/unit/test_reclaim.py::
  test_the_reclaimer_takes_the_eviction_order_never_a_pinned_or_read_entry), and a tenant
  at its quota reads only its own entries (test_a_tenant_at_its_quota_reads_none_of_the_
  other_tenants_entries).
* Room is made ahead of need: each tier is kept between its watermarks, and a save
  evicts for itself only when the reclaimer has not kept up, counted
  (tests/unit/test_reclaim.py::
  test_saves_find_room_made_and_the_tier_stays_between_its_watermarks,
  test_a_save_the_reclaimer_left_no_room_for_evicts_inline_and_is_counted). An entry
  being reclaimed (files removed with the store lock let go) is gone to every read, pin,
  check and copy, and a save of its key waits for it to be gone
  (test_an_entry_being_reclaimed_is_gone_to_reads_pins_and_saves_until_its_rows_go).
* A start-up after a clean shutdown, nothing changed since, reads no entry and no blob
  file (tests/unit/test_store.py::
  test_a_clean_restart_reads_no_entry_and_trusts_the_recorded_tally); any change since
  means the full reconcile (test_a_change_after_a_clean_shutdown_means_the_full_reconcile).
* A tenant's saves evict its own entries while it is at its disk quota, never another
  tenant's for it; an entry larger than its quota is refused (tests/daemon/test_quotas.py).
* Room that cannot be made is refused before anything is evicted or dropped
  (tests/unit/test_store.py::test_a_save_that_cannot_fit_evicts_nothing,
  test_a_copy_that_cannot_fit_in_ram_drops_no_other_copy).
* The byte tally equals what the index and files hold after every change
  (tests/unit/test_store.py::test_tier_counts_follow_every_change).
* A pin answered OK is never undone by a concurrent removal (tests/faults/test_load.py::
  test_a_pin_is_never_lost_to_a_concurrent_eviction_prune_or_delete).
* A delete never removes a pinned entry or one a client reads; it waits (bounded) for
  the daemon's own work on an entry (tests/unit/test_store.py::
  test_a_delete_waits_for_the_daemon_s_own_work_bounded).
* A bad blob is found before any of its bytes is used, and quarantined
  (tests/faults/test_corruption.py).
* A call by key from a caller bound to tenants answers another tenant's entry, published
  or being written, on the path of a key nobody saved (core.seen; tests/daemon/
  test_scoped_tokens.py::test_every_call_by_key_answers_a_foreign_key_as_an_absent_one).
"""

from __future__ import annotations

from ..common import TIER_DISK, TIER_RAM
from .core import (
    BLOB_SUFFIX,
    TMP_SUFFIX,
    GiB,
    ReadPin,
    Reservation,
    Seen,
    StoreConfig,
    StoreStats,
)
from .facade import Found, Store
from .integrity import NO_SUCH_ENTRY
from .prune import PruneResult
from .publish import ReserveResult
from .quotas import TenantQuotas

__all__ = [
    "BLOB_SUFFIX",
    "Found",
    "GiB",
    "NO_SUCH_ENTRY",
    "TIER_DISK",
    "TIER_RAM",
    "TMP_SUFFIX",
    "PruneResult",
    "ReadPin",
    "Reservation",
    "ReserveResult",
    "Seen",
    "Store",
    "StoreConfig",
    "StoreStats",
    "TenantQuotas",
]
