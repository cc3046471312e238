"""The entry table: published entries by key (the index's records), which entries are
built on each one, and removing an entry together with everything built on it."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from .. import blob as blobfmt
from .. import keys
from ..errors import Busy, InvalidArgument, NotFound, StoreError
from ..index import Index, Record, dir_fsync

if TYPE_CHECKING:
    from .reads import ReadPins
    from .settings import StoreConfig
    from .tiers import Layout, Tally

log = logging.getLogger("kvcache")


def check_tokens(raw_tokens: bytes, max_tokens: int) -> None:
    """Refuse an empty token list or one longer than ``max_tokens``."""
    n = len(raw_tokens) // 4
    if n == 0:
        raise InvalidArgument("empty token list")
    if n > max_tokens:
        raise InvalidArgument(f"{n} tokens exceed the limit of {max_tokens}")


def record_from(entry: keys.EntryKey, header: blobfmt.BlobHeader, meta: blobfmt.BlobMeta,
                size: int) -> Record:
    """The index record of a blob, from its checksummed header and metadata."""
    return Record(
        key=entry.key, namespace=meta.namespace, anchor=entry.anchor, tail=entry.tail,
        n_tokens=entry.n_tokens, size=size, codec=header.codec, reason=meta.reason,
        created=meta.created, model_name=meta.model_name,
        model_fingerprint=meta.model_fingerprint, tenant_id=meta.tenant_id,
        parent=meta.parent, base=meta.base,
    )


class Entries:
    """Published entries and, kept beside the index as they change, the pieces built on
    each (parent -> children): eviction takes only leaves, and removing an entry removes
    what is built on it, in one index transaction, so no piece is ever visible without its
    parent (tests/test_pieces.py::test_a_corrupt_piece_takes_what_is_built_on_it,
    test_prune_removes_an_entry_only_with_what_is_built_on_it).

    A piece is added to the children map before its publish makes it visible (see
    Publisher.commit), so a removal of its parent either takes it or makes its publish find
    the parent gone.

    Locking: the children map changes with Store._cond held (add_child, drop_child);
    children, dependents, set_pinned, delete and remove_entry take it themselves (it is
    re-entrant); remove_entry holds it over its file removals too (see there)."""

    def __init__(self, config: StoreConfig, layout: Layout, index: Index, tally: Tally,
                 pins: ReadPins, counters: Counter[str], cond: threading.Condition) -> None:
        self._config = config
        self._layout = layout
        self._index = index
        self._tally = tally
        self._pins = pins
        self.counters = counters
        self._cond = cond
        self._children: dict[bytes, set[bytes]] = {}

    # -- the children map (Store._cond held) -------------------------------------------------

    def add_child(self, record: Record) -> None:
        if record.parent:
            self._children.setdefault(record.parent, set()).add(record.key)

    def drop_child(self, parent: bytes, key: bytes) -> None:
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[parent]

    # -- queries ----------------------------------------------------------------------------

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

    def get(self, key: bytes) -> Record:
        record = self._index.get(key)
        if record is None:
            raise NotFound(f"no entry {key.hex()}")
        return record

    def chain(self, record: Record) -> list[Record]:
        """The entries whose blobs make up ``record``'s state, root first (``record``
        last). Raises NotFound when a link is missing (removed meanwhile)."""
        links = [record]
        while links[-1].parent:
            parent = self._index.get(links[-1].parent)
            if parent is None or len(links) > self._config.max_tokens:
                raise NotFound(f"entry {record.key.hex()} lost a part of its chain")
            links.append(parent)
        return links[::-1]

    # -- changes ----------------------------------------------------------------------------

    def set_pinned(self, key: bytes, pinned: bool) -> Record:
        # Under the lock evictions, prunes and deletes decide under: a pin answered OK is
        # never undone by a removal that chose the entry before it (tests/test_load.py::
        # test_a_pin_is_never_lost_to_a_concurrent_eviction_prune_or_delete).
        with self._cond:
            record = self._index.update(key, pinned=pinned)
            if record is None:
                raise NotFound(f"no entry {key.hex()}")
            self.counters["pins" if pinned else "unpins"] += 1
            return record

    def delete(self, key: bytes) -> list[Record]:
        """Remove an entry and the entries built on it (they cannot be restored without
        it); refused while any of them is pinned or read by a client. Held only by the
        daemon's own work (its RAM copy being made, a check, a piece being saved on it),
        it is waited for, up to ``delete_wait_seconds``: an operator's delete right after
        a save must not fail on a copy it cannot see (tests/test_pieces.py::
        test_a_delete_waits_for_the_daemon_s_own_work_on_an_entry). Returns what went,
        the entry first. Takes the store lock (and gives it up while waiting)."""
        deadline = time.monotonic() + self._config.delete_wait_seconds
        with self._cond:
            while True:
                record = self.get(key)
                dependents = self.dependents(key)
                busy = ""
                for k in (key, *dependents):
                    r = record if k == key else self._index.get(k)
                    whose = "" if k == key else f" (built on {key.hex()})"
                    if r is not None and r.pinned:
                        raise Busy(f"entry {k.hex()}{whose} is pinned; unpin it first")
                    if self._pins.is_read(k):
                        raise Busy(f"entry {k.hex()}{whose} is being read")
                    if not busy and self._pins.is_held(k):
                        busy = f"entry {k.hex()}{whose} is being read (by the daemon: a " \
                               "copy, a check or a piece saved on it); try again"
                if not busy:
                    return self.remove_entry(record, "deletes")  # the entry first
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(busy)
                self._cond.wait(left)  # woken whenever an entry stops being held

    def remove_entry(self, record: Record, counter: str) -> list[Record]:
        """Remove an entry and everything built on it: their files first, durably, then
        their rows, in one index transaction (no piece stays visible without its parent).
        Returns what was removed (nothing when the entry is gone already).

        Files before rows, so that no crash undoes a removal anyone could have seen
        (the invariant in the package docstring): until the rows go, a lookup still finds
        the entry, and a crash leaves rows whose blob is gone, which start-up drops
        (Reconcile); once the rows are gone, no blob is left to re-index. In between, the
        store lock is held throughout, so no read opens a file that is going: a reader
        waits, then finds the entry gone. Each blob goes before its RAM copy (a crash
        between leaves a copy without a blob, removed at start-up) and each piece before
        what it is built on (a crash between leaves a shorter chain, never a broken one).
        The blob directories are fsynced before the rows go: a power cut cannot bring back
        a blob whose row is gone.

        A piece whose commit is under way is in the children map before it is visible, so
        its file is removed here and its row either goes with the others or is never
        written (its publish finds the parent gone). A file that cannot be removed (an
        I/O error, not a missing file) stops the removal there: the entries whose files
        went leave the index too (only pieces of those that stay: no chain breaks), the
        others stay published, and StoreError says why."""
        with self._cond:
            if self._index.get(record.key) is None:
                return []
            doomed = [record.key, *self.dependents(record.key)]
            gone: list[bytes] = []  # files removed, pieces before their parents
            failure = ""
            for key in reversed(doomed):  # nearest first reversed: each piece before its parent
                try:
                    self._layout.blob_path(key).unlink(missing_ok=True)
                except OSError as exc:
                    failure = f"could not remove the blob of entry {key.hex()}: {exc}"
                    break
                gone.append(key)
                with contextlib.suppress(OSError):  # a copy left over goes at start-up
                    self._layout.ram_path(key).unlink(missing_ok=True)
            for d in sorted({self._layout.blob_path(k).parent for k in gone}):
                try:
                    dir_fsync(d)
                except OSError as exc:  # the file is gone; only its durability is unknown
                    log.warning("could not fsync %s after removing blobs: %s", d, exc)
            removed = self._index.delete_many(gone[::-1])  # the entry first, as listed
            for r in removed:  # their tiers as they are now, not as when chosen
                self._tally.entry_removed(r)
                self._pins.forget_usage(r.key)
                self.drop_child(r.parent, r.key)
                self._children.pop(r.key, None)
                self.counters[counter if r.key == record.key else "dependents_removed"] += 1
        if failure:
            raise StoreError(f"{failure}; the removal stopped there, the entries not yet "
                             "removed stay")
        return removed
