"""Crash anywhere: SIGKILL the kvcache daemon at random moments under a mixed load.

    python tools/crash_harness.py --kills 100 --seconds 240 --json
    python tools/crash_harness.py --campaign --json     # 1,000 kills, within 90 minutes

A real daemon runs as a subprocess on a temp data directory (block size 16, a short
lease, budgets far above what the run writes, so nothing is ever evicted). Each cycle
starts client threads that save (same-host fast path and streamed), look up, load (both
paths), pin, unpin, verify, prune and delete, then kills the daemon with SIGKILL a
random 20-400 ms later and restarts it. Prunes and deletes only target a separate
"disposable" model, so an acknowledged entry is never legitimately removed. Some saves
are pieces built on an acknowledged entry (its first tokens, then new ones), so kills
land in saves of shared prefixes too; some are pieces built on a disposable entry, so
kills land in deletes and prunes that take pieces with their parent.

Now and then the kill lands while the daemon is still starting, while a restarted daemon
still checks its index against its files in the background (it serves meanwhile; a tenth
of the restarts), or in the middle of a graceful shutdown (SIGTERM, then SIGKILL up to
50 ms later).

After every restart, once the daemon's background check after the kill has finished
(it serves meanwhile; kvcache.store.recovery) and before any client touches the daemon:

* no ``*.part`` file anywhere under the data or RAM directory;
* index and files agree: every listed entry has its blob file of the right size (and
  its RAM copy when it says it has one), and every blob or RAM file is listed; no new
  file in quarantine;
* no listed piece misses its parent (an entry is never visible without what it is built
  on), and every acknowledged piece's chain loads and fits;
* every acknowledged entry (its Commit answered OK, status ``saved``) is listed with its
  size, and pinned as its last answered Pin/Unpin said; no entry whose prune or delete
  was answered (nor a piece such a delete took with it) is back (``resurrected``);
* the Verify RPC passes for every entry that is new or changed tier since the last
  check, and for a rotating tenth of the rest (all of them every tenth restart);
* the entries acknowledged since the last restart, a random sample of older ones, and
  every listed entry never checked before are found by lookup and loaded (alternating
  both load paths), and their bytes are exactly the ones saved.

At the end the daemon is stopped cleanly (no temp file may remain), started again, and
the same check runs over every acknowledged entry with Verify over everything. During
the run every load that returned data is compared with the saved bytes, and lookups
(whole-prefix and common-prefix: a prompt that parts from an acknowledged entry inside
it), loads, pins and duplicate saves of acknowledged entries must find them. Payloads follow
from the tokens, so any entry found can be checked on its own.

Prints one JSON object (``--json``) or a short summary. Exit status 1 if anything was
lost, wrong, orphaned, resurrected, unverified or unexpected; the work folder and the
RAM tier are then kept for inspection, and the output says where (``kept``) and the
exact command that removes them (``remove_with``, also on stderr). ``--seconds`` bounds
the kill phase (the final check and shutdown come after it); when it runs out the
harness stops killing and reports the kills done.

``--prefill N``: the large index (tools/harness/crash_large.py). N small entries are
written into the data directory as blob files and indexed by the first start; the disk
budget is what they take up to the high watermark (85%/95%), so the tier is full from the
start and the run's saves keep it so, and the reclaimer's passes run while the harness
kills. Besides the kills under load, three restarts in ten get a burst of saves that takes
the tier over its high watermark and are killed once the pass is under way, and two in
five are killed again while their background check runs. A kill counts in
``kills_during_reclaim`` when the reclaimer began a pass or evicted within 0.5 s before it
and the tier was still above its low watermark (where a pass ends). The oldest prefilled
entries (1%, at most 200) are pinned. The ledger then takes evictions: an unpinned entry
may go (``evicted``, decided after a restart, once no reclaimer pass runs), a pinned one
never (``lost``); a read still never returns other bytes, and a pruned or deleted entry
never comes back. A sample of the prefilled entries is loaded after each restart; Verify
covers all of them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness import crash_large as large
from harness.payloads import payload_for
from harness.procs import Daemon

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import (
    CacheClient,
    CacheError,
    CacheUnavailable,
    CorruptBlob,
    Identity,
    SaveResult,
)
from kvcache.config import CHUNK_BYTES
from kvcache.store.ramtier import RAM_MARKER
from kvcache.v1 import kvcache_pb2 as pb

BLOCK = 16
KEPT = Identity("fp-crash-kept", {"type_k": "f16"}, model_name="kept.gguf")
# Another fingerprint, so a disposable entry never shares a key with a kept one: prunes
# by this model name are the only removals in the run.
DISPOSABLE = Identity("fp-crash-disposable", {"type_k": "f16"}, model_name="disposable.gguf")
FAMILY_TOKENS = 120
# The campaign (--campaign, and tests/faults/test_crash_harness.py with --campaign): 1,000 kills;
# CI gives it 90 minutes, so the kill phase stops at 80 and leaves the rest to the final
# check and the shutdown (a run that stops short of the kills fails).
CAMPAIGN_KILLS = 1000
CAMPAIGN_SECONDS = 80 * 60.0
MAX_PROBLEMS = 40
# How long a restarted daemon's background check may take before it counts as a problem.
RECOVERY_SECONDS = 120.0

# Operation mix of a client thread (weights).
OPS: dict[str, int] = {
    "save_kept": 30, "save_piece": 12, "save_disposable": 10, "save_duplicate": 5,
    "read_kept": 20,
    "read_kept_common_prefix": 5,
    "save_disposable_piece": 5,
    "read_disposable": 6, "pin": 6, "unpin": 5, "verify_one": 3, "prune": 4, "delete": 3,
    "miss": 4,
}


def payload_size(tokens: list[int]) -> int:
    """Mostly small blobs (the checks stay cheap); some of a few hundred kB, and a few
    over the 1 MiB chunk size, so that streamed saves and reads span several messages and
    a kill can land between them."""
    rng = random.Random(b"size" + keys.tokens_to_bytes(tokens))
    draw = rng.random()
    if draw < 0.02:
        return rng.randrange(CHUNK_BYTES + 50_000, 2 * CHUNK_BYTES + 500_000)
    if draw < 0.07:
        return rng.randrange(100_000, 400_000)
    return rng.randrange(200, 16_000)


def entry_payload(tokens: list[int], base: int = 0) -> bytes:
    """Size and bytes follow from the tokens (and, for a piece, its base) alone: any
    entry found can be checked."""
    return payload_for(tokens, payload_size(tokens), salt=f"/{base}".encode() if base else b"")


def saved_payload(meta: blobfmt.BlobMeta) -> bytes:
    """What was saved (or prefilled) as the blob of this metadata."""
    if meta.namespace == large.PREFILL.namespace:
        return large.prefill_payload(list(meta.tokens))
    return entry_payload(list(meta.tokens), meta.base)


def entry_key(identity: Identity, tokens: list[int]) -> bytes:
    return keys.entry_key(identity.namespace, tokens, BLOCK).key


def holds_what_was_saved(key: bytes, meta: blobfmt.BlobMeta, payload: bytes) -> bool:
    """Whether a loaded entry is the one its key names, with the bytes saved under it."""
    return (keys.entry_key(meta.namespace, list(meta.tokens), BLOCK).key == key
            and payload == saved_payload(meta))


@dataclass
class Settings:
    kills: int = 100
    seconds: float = 240.0
    seed: int = 0
    workers: int = 4
    min_delay_ms: float = 20.0
    max_delay_ms: float = 400.0
    lease_seconds: float = 2.0
    startup_kill_p: float = 0.05
    # A restarted daemon killed again while its background check after the kill runs.
    recovery_kill_p: float = 0.1
    shutdown_kill_p: float = 0.08
    sample: int = 20
    workdir: Path | None = None
    keep: bool = False
    prefill: int = 0  # the large index: entries written before the first start
    # With it: a restarted daemon's tier pushed over its high watermark and the daemon
    # killed in the reclaimer's pass.
    reclaim_kill_p: float = 0.3


@dataclass
class Ledger:
    """What the clients were told, shared by the client threads and the checker."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[bytes, tuple[int, ...]] = field(default_factory=dict)  # key -> tokens
    acked_size: dict[bytes, int] = field(default_factory=dict)  # key -> committed bytes
    acked_base: dict[bytes, int] = field(default_factory=dict)  # key -> a piece's base
    acked_keys: list[bytes] = field(default_factory=list)
    since_check: list[bytes] = field(default_factory=list)
    disposable: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    # Disposable pieces: key -> (parent, base). A delete of an entry takes what is built on it.
    disposable_piece: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)
    # Disposable entries whose prune or delete was answered: gone for good. Disposable
    # tokens are never saved twice, so none of these may be listed again.
    removed: set[bytes] = field(default_factory=set)
    # Acknowledged key -> pinned as last answered (None: the answer was cut off). Each key
    # is pinned and unpinned by one client thread only, so answers arrive in order.
    pin_state: dict[bytes, bool | None] = field(default_factory=dict)
    byte_checked: set[bytes] = field(default_factory=set)
    lost: set[bytes] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    # The large index (--prefill): the disk tier is full, so an unpinned entry may be
    # evicted; only a pinned one missing is lost.
    evictable: bool = False

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] += 1

    def problem(self, counter: str, message: str) -> None:
        with self.lock:
            self.counts[counter] += 1
            if len(self.problems) < MAX_PROBLEMS:
                self.problems.append(f"{counter}: {message}")

    def lose(self, key: bytes, message: str) -> None:
        """An acknowledged entry is gone (counted once per entry, however often seen)."""
        with self.lock:
            first = key not in self.lost
            self.lost.add(key)
        if first:
            self.problem("lost_reports", f"{key.hex()}: {message}")
        else:
            self.count("lost_reports")

    def missing(self, key: bytes, message: str) -> None:
        """An acknowledged entry not found while the clients run: lost, unless entries
        may be evicted; then the check after the next restart (no client running, no
        reclaimer pass) decides by its pin."""
        if self.evictable:
            self.count("evicted_entries_missed_in_run")
        else:
            self.lose(key, message)

    def evicted(self, key: bytes) -> None:
        """An unpinned acknowledged entry the tier gave up: no longer expected (saved
        again, it is acknowledged again)."""
        with self.lock:
            self.acked.pop(key, None)
            self.acked_size.pop(key, None)
            self.acked_base.pop(key, None)
            self.acked_keys.remove(key)
            self.pin_state.pop(key, None)
            self.counts["evicted_acknowledged"] += 1

    def ack(self, key: bytes, tokens: list[int], size: int, base: int = 0) -> None:
        with self.lock:
            if key not in self.acked:
                self.acked[key] = tuple(tokens)
                self.acked_size[key] = size
                self.acked_base[key] = base
                self.acked_keys.append(key)
                self.since_check.append(key)
            self.counts["saves_acknowledged"] += 1

    def random_acked(self, rng: random.Random) -> tuple[bytes, list[int]] | None:
        with self.lock:
            if not self.acked_keys:
                return None
            key = rng.choice(self.acked_keys)
            return key, list(self.acked[key])

    def forget(self, removed: list[bytes]) -> None:
        with self.lock:
            for key in removed:
                self.disposable.pop(key, None)
                self.disposable_piece.pop(key, None)
                if key not in self.removed:
                    self.removed.add(key)
                    self.counts["removals_acknowledged"] += 1

    def built_on(self, key: bytes) -> list[bytes]:
        """The disposable pieces saved (answered) on ``key``, theirs, and so on: a delete of
        ``key`` answered OK took every one of them (each was published on it before)."""
        with self.lock:
            out, todo = [], [key]
            while todo:
                parent = todo.pop()
                kids = [k for k, (p, _) in self.disposable_piece.items() if p == parent]
                out += kids
                todo += kids
            return out

    def random_disposable(self, rng: random.Random) -> tuple[bytes, list[int]] | None:
        with self.lock:
            if not self.disposable:
                return None
            key = rng.choice(list(self.disposable))
            return key, list(self.disposable[key])


class Worker:
    """One client thread's stream of operations against the live daemon of one cycle."""

    def __init__(self, harness: CrashHarness, wid: int, cycle: int, fast: bool) -> None:
        self.h = harness
        self.wid = wid
        self.ledger = harness.ledger
        self.fast = fast
        self.rng = random.Random(f"{harness.settings.seed}/{cycle}/{wid}")
        self.families: list[list[int]] = []

    def run(self, address: str, stop: threading.Event) -> None:
        ops, weights = list(OPS), list(OPS.values())
        with CacheClient(address, timeout=5.0, fast_path=self.fast) as client:
            while not stop.is_set():
                op = self.rng.choices(ops, weights)[0]
                try:
                    getattr(self, f"op_{op}")(client)
                except CacheUnavailable:
                    # The daemon was just killed (or is being killed): the cycle ends.
                    self.ledger.error("UNAVAILABLE")
                    stop.wait(0.005)
                except CorruptBlob as exc:
                    # Nothing in this run corrupts a blob: a published entry that fails its
                    # checksums is a product bug even though it was not served.
                    self.ledger.problem("corrupt_reported", f"{op}: {exc}")
                except CacheError as exc:
                    code = exc.code.name if exc.code else "ERROR"
                    self.ledger.error(code)
                    if code in ("UNKNOWN", "INTERNAL"):  # the daemon raised: a product bug
                        self.ledger.problem("server_errors", f"{op}: {exc}")
                except Exception as exc:  # a client call that broke its contract
                    self.ledger.problem("unexpected_errors", f"{op} ({'fast' if self.fast else 'stream'}):"
                                        f" {exc!r}\n{traceback.format_exc(limit=6)}")

    # -- token families: entries that are prefixes of one another ---------------------------

    def new_tokens(self) -> list[int]:
        if not self.families or self.rng.random() < 0.4:
            self.families.append([self.rng.randrange(1, 60_000) for _ in range(FAMILY_TOKENS)])
        base = self.rng.choice(self.families)
        return base[: self.rng.randrange(1, FAMILY_TOKENS + 1)]

    # -- operations ---------------------------------------------------------------------------

    def _save(self, client: CacheClient, identity: Identity, tokens: list[int]) -> SaveResult:
        reason = self.rng.choice(blobfmt.SAVE_REASONS)
        codec = "zstd" if self.rng.random() < 0.1 else "none"  # both codecs' blobs verify
        result = client.save(identity, tokens, entry_payload(tokens), reason, codec=codec)
        self.ledger.count(f"saves_{result.status}")
        if result.status == "saved" and result.key != entry_key(identity, tokens):
            self.ledger.problem("wrong_keys", f"commit answered key {result.key.hex()}")
        return result

    def op_save_kept(self, client: CacheClient) -> None:
        tokens = self.new_tokens()
        result = self._save(client, KEPT, tokens)
        if result.status == "saved":  # Commit answered OK: this entry must survive anything
            self.ledger.ack(result.key, tokens, result.size)

    def op_save_piece(self, client: CacheClient) -> None:
        """A piece built on an acknowledged entry: its first ``base`` tokens are the
        parent's (where the parent's own cells hold the last of them), then new ones."""
        picked = self.ledger.random_acked(self.rng)
        if picked is None:
            return
        parent, parent_tokens = picked
        with self.ledger.lock:
            parent_base = self.ledger.acked_base[parent]
        if len(parent_tokens) <= parent_base:
            return
        base = self.rng.randrange(parent_base + 1, len(parent_tokens) + 1)
        tokens = parent_tokens[:base] + [self.rng.randrange(1, 60_000)
                                         for _ in range(self.rng.randrange(1, 40))]
        reason = self.rng.choice(blobfmt.SAVE_REASONS)
        try:
            result = client.save(KEPT, tokens, entry_payload(tokens, base), reason,
                                 parent=parent, base=base)
        except CacheError as exc:
            if exc.code is not None and exc.code.name == "NOT_FOUND":
                self.ledger.missing(parent, "a piece's reserve found its parent gone")
                return
            if exc.code is not None and exc.code.name == "INVALID_ARGUMENT":
                self.ledger.problem("server_errors", f"save_piece refused: {exc}")
                return
            raise
        self.ledger.count(f"saves_{result.status}")
        self.ledger.count("pieces_saved")
        if result.status == "saved":
            self.ledger.ack(result.key, tokens, result.size, base)

    def op_save_disposable_piece(self, client: CacheClient) -> None:
        """A piece built on a disposable entry: deletes and prunes then take pieces with
        their parents, and a crash must not bring any of them back either."""
        picked = self.ledger.random_disposable(self.rng)
        if picked is None:
            return
        parent, parent_tokens = picked
        with self.ledger.lock:
            parent_base = self.ledger.disposable_piece.get(parent, (b"", 0))[1]
        if len(parent_tokens) <= parent_base:
            return
        base = self.rng.randrange(parent_base + 1, len(parent_tokens) + 1)
        tokens = parent_tokens[:base] + [self.rng.randrange(1, 60_000)
                                         for _ in range(self.rng.randrange(1, 40))]
        try:
            result = client.save(DISPOSABLE, tokens, entry_payload(tokens, base),
                                 self.rng.choice(blobfmt.SAVE_REASONS), parent=parent,
                                 base=base)
        except CacheError as exc:
            if exc.code is not None and exc.code.name == "NOT_FOUND":
                return  # its parent was pruned or deleted meanwhile: fine
            if exc.code is not None and exc.code.name == "INVALID_ARGUMENT":
                self.ledger.problem("server_errors", f"save_disposable_piece refused: {exc}")
                return
            raise
        self.ledger.count(f"saves_{result.status}")
        if result.status == "saved":
            with self.ledger.lock:
                self.ledger.disposable[result.key] = tuple(tokens)
                self.ledger.disposable_piece[result.key] = (parent, base)

    def op_save_disposable(self, client: CacheClient) -> None:
        # Tokens of their own every time, so a removed entry can never come back legitimately.
        tokens = [self.rng.randrange(1, 60_000) for _ in range(self.rng.randrange(1, 80))]
        if self._save(client, DISPOSABLE, tokens).status == "saved":
            with self.ledger.lock:
                self.ledger.disposable[entry_key(DISPOSABLE, tokens)] = tuple(tokens)

    def op_save_duplicate(self, client: CacheClient) -> None:
        """Saving an acknowledged entry again must be answered ``already_present``: a grant
        would mean the daemon no longer has it."""
        picked = self.ledger.random_acked(self.rng)
        if picked is None:
            return
        key, tokens = picked
        if self._save(client, KEPT, tokens).status == "saved":
            self.ledger.missing(key, "a second save of it was granted and committed")

    def _check_loaded(self, client: CacheClient, key: bytes, query: list[int],
                      shares: int = 0) -> bool:
        """Load ``key`` and compare with the saved bytes. False when it is missing."""
        try:
            loaded = client.load(key, prefix_of=query, shares=shares)
        except CacheError as exc:
            if exc.code is not None and exc.code.name == "NOT_FOUND":
                return False
            raise
        self.ledger.count("loads_fast" if self.fast else "loads_stream")
        if not holds_what_was_saved(key, loaded.meta, bytes(loaded.payload)):
            self.ledger.problem("wrong_bytes_served",
                                f"load of {key.hex()} ({'fast' if self.fast else 'stream'}) "
                                f"returned other bytes than were saved")
        return True

    def op_read_kept(self, client: CacheClient) -> None:
        picked = self.ledger.random_acked(self.rng)
        if picked is None:
            return
        key, tokens = picked
        query = tokens + [self.rng.randrange(1, 60_000) for _ in range(self.rng.randrange(0, 20))]
        hit = client.lookup(KEPT, query)
        if hit is None or hit.matched_tokens < len(tokens):
            self.ledger.missing(key, f"lookup during the run answered {hit}")
            return
        # The hit may be a longer member of the family; load it, and now and then the
        # acknowledged key itself.
        target = key if self.rng.random() < 0.3 else hit.key
        if not self._check_loaded(client, target, query):
            if target == key:
                self.ledger.missing(key, "load during the run answered NOT_FOUND")
            elif self.ledger.evictable:  # evicted between its lookup and its load
                self.ledger.count("evicted_entries_missed_in_run")
            else:  # a kept entry, acknowledged or not: nothing removes those either
                self.ledger.problem("vanished_entries", f"{target.hex()}: found by lookup, "
                                    "then NOT_FOUND by its load")

    def op_read_kept_common_prefix(self, client: CacheClient) -> None:
        """A prompt that parts from an acknowledged entry inside it: the entry, or another
        sharing as much, serves the shared tokens. Every block hash here has more rows
        than the index scans (many entries per namespace), where the answer may fall
        short of the best by less than a block: whole blocks are what must be found."""
        picked = self.ledger.random_acked(self.rng)
        if picked is None:
            return
        key, tokens = picked
        cut = self.rng.randrange(1, len(tokens) + 1)
        query = tokens[:cut] + [60_001 + self.rng.randrange(0, 100)]  # no saved token id
        hit = client.lookup(KEPT, query, common_prefix=True)
        if (hit.matched_tokens if hit else 0) < cut // BLOCK * BLOCK:
            self.ledger.missing(key, f"common-prefix lookup during the run answered {hit}")
            return
        if hit is None:
            return
        if not self._check_loaded(client, hit.key, query, shares=hit.matched_tokens):
            if self.ledger.evictable:
                self.ledger.count("evicted_entries_missed_in_run")
                return
            self.ledger.problem("vanished_entries", f"{hit.key.hex()}: found by lookup, "
                                "then NOT_FOUND by its load")

    def op_read_disposable(self, client: CacheClient) -> None:
        picked = self.ledger.random_disposable(self.rng)
        if picked is None:
            return
        _, tokens = picked
        hit = client.lookup(DISPOSABLE, tokens)
        if hit is not None:  # it may have been pruned meanwhile: NOT_FOUND is fine
            self._check_loaded(client, hit.key, tokens)

    def op_miss(self, client: CacheClient) -> None:
        # Token ids no entry holds (saved ones are below 60,000): a random prompt of saved
        # ids can legitimately match one of the many entries of a single token.
        tokens = [self.rng.randrange(60_001, 120_000) for _ in range(self.rng.randrange(1, 60))]
        if client.lookup(KEPT, tokens) is not None:
            self.ledger.problem("wrong_bytes_served", "a random prompt matched an entry")

    def _pick_any(self) -> tuple[bytes, bool] | None:
        if self.rng.random() < 0.7:
            for _ in range(8):  # an acknowledged key this thread owns for pinning
                picked = self.ledger.random_acked(self.rng)
                if picked is None:
                    return None
                if picked[0][0] % self.h.settings.workers == self.wid:
                    return picked[0], True
            return None
        picked = self.ledger.random_disposable(self.rng)
        return None if picked is None else (picked[0], False)

    def _pin(self, client: CacheClient, pin: bool) -> None:
        picked = self._pick_any()
        if picked is None:
            return
        key, acked = picked
        if acked:
            with self.ledger.lock:
                self.ledger.pin_state[key] = None  # unknown until answered
        try:
            client.pin(key) if pin else client.unpin(key)
            self.ledger.count("pins" if pin else "unpins")
            if acked:
                with self.ledger.lock:
                    self.ledger.pin_state[key] = pin
        except CacheError as exc:
            if acked and exc.code is not None and exc.code.name == "NOT_FOUND":
                self.ledger.missing(key, f"{'pin' if pin else 'unpin'} answered NOT_FOUND")
            else:
                raise

    def op_pin(self, client: CacheClient) -> None:
        self._pin(client, True)

    def op_unpin(self, client: CacheClient) -> None:
        self._pin(client, False)

    def op_verify_one(self, client: CacheClient) -> None:
        picked = self.ledger.random_acked(self.rng)
        if picked is None:
            return
        for result in client.verify([picked[0]], timeout=10.0):
            if not result.ok:
                self.ledger.problem("unverified", f"{result.key.hex()}: {result.error}")

    def op_prune(self, client: CacheClient) -> None:
        # Now and then also trim the RAM tier: it only drops copies, never entries. Mostly
        # one save reason's entries (those others build on stay), so that disposable
        # entries, and pieces on them, live long enough for deletes to take them.
        ram = 1 if self.rng.random() < 0.3 else 0
        reason = self.rng.choice(["", *blobfmt.SAVE_REASONS])
        resp = client.prune(model=DISPOSABLE.model_name, reason=reason, max_ram_bytes=ram)
        self.ledger.count("prunes")
        self.ledger.count("pruned_entries", len(resp.removed))
        for entry in resp.removed:
            if entry.model_name != DISPOSABLE.model_name:
                self.ledger.lose(entry.key, "a prune by another model removed it")
        self.ledger.forget([e.key for e in resp.removed])

    def op_delete(self, client: CacheClient) -> None:
        picked = self.ledger.random_disposable(self.rng)
        if picked is None:
            return
        with contextlib.suppress(CacheError):  # gone, pinned or being read: all fine
            dependents = client.delete(picked[0])
            self.ledger.count("deletes")
            self.ledger.count("dependents_deleted", dependents)
            self.ledger.forget([picked[0], *self.ledger.built_on(picked[0])])


class CrashHarness:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.ledger = Ledger(evictable=settings.prefill > 0)
        self.own_workdir = settings.workdir is None
        # A short path: unix socket paths are limited to 107 bytes.
        self.workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="kvcrash", dir="/tmp"))
        # Owner-only: the daemon's socket lives here, and it refuses a folder others can
        # enter (a given --workdir is made so; mkdtemp's already is).
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir = self.workdir / "data"
        shm = Path("/dev/shm")
        # The RAM tier on a memory filesystem, as in production (it survives the kills):
        # the daemon's own subfolder of a folder made for this run.
        self.ram_parent = (Path(tempfile.mkdtemp(prefix="kvcrash-", dir=shm)) if shm.is_dir()
                           else self.workdir / "ram")
        self.socket = self.workdir / "kv.sock"
        # The large index: a disk budget its prefilled entries fill (see crash_large).
        disk = ("--disk-bytes", str(large.disk_budget(settings.prefill)), "--reclaim-low",
                str(large.RECLAIM_LOW), "--reclaim-high", str(large.RECLAIM_HIGH)
                ) if settings.prefill else ("--disk-bytes", "100G")
        self.daemon = Daemon(
            self.data_dir, "--block-size", str(BLOCK), "--lease-seconds",
            str(settings.lease_seconds), "--ram-bytes", "1G", *disk,
            "--log-level", "WARNING", ram_parent=self.ram_parent, socket=self.socket,
            log_path=self.workdir / "daemon.log", name="kvcache daemon")
        self.ram_dir = self.daemon.ram_dir
        self.address = self.daemon.address
        self.kills = self.kills_under_load = self.startup_kills = self.restarts = 0
        self.recovery_kills = self.reclaim_kills = 0
        self.prefill_pinned: dict[bytes, list[int]] = {}
        self.prefill_left = settings.prefill
        self.prefill_seconds: dict[str, float] = {}
        self.shutdown_kills = self.clean_stops = 0
        self.restart_seconds: list[float] = []
        self.daemon_counters: Counter[str] = Counter()
        self.quarantined_seen = 0
        self.verified_state: dict[bytes, tuple[int, bool]] = {}
        self.check_seconds = 0.0
        # The checker's clients live across restarts: closing a connected gRPC channel
        # takes ~200 ms, and a channel whose daemon died just reconnects on its next call.
        self.fast = CacheClient(self.address, timeout=30.0, fast_path=True)
        self.stream = CacheClient(self.address, timeout=30.0, fast_path=False)

    # -- the daemon ---------------------------------------------------------------------------

    def start_daemon(self, timeout: float = 60.0) -> None:
        """Start the daemon and wait until it answers, to the checker's own channel too.
        The stale socket of a killed daemon is removed first, so the socket appearing
        means the new one has bound it."""
        t0 = time.monotonic()
        self.socket.unlink(missing_ok=True)
        self.daemon.start(timeout)
        try:
            self.fast.wait_ready(timeout=max(0.1, t0 + timeout - time.monotonic()))
        except CacheError as exc:
            raise RuntimeError(f"the daemon did not answer in {timeout} s: {exc}") from None
        self.restart_seconds.append(time.monotonic() - t0)

    def kill_during_startup(self) -> None:
        """Kill a daemon that is still importing, sweeping or reconciling."""
        self.socket.unlink(missing_ok=True)
        self.daemon.spawn()
        time.sleep(self.rng.uniform(0.1, 0.5))
        self.daemon.kill()
        self.kills += 1
        self.startup_kills += 1

    def kill_during_recovery(self) -> None:
        """Kill a restarted daemon while it still checks its index against its files in
        the background (kvcache.store.recovery), the clients' saves of the next cycle not
        started yet: the next start-up must check again and undo nothing."""
        time.sleep(self.rng.uniform(0.0, 0.4))
        if self.fast.stats().recovery.state != "running":
            return  # it finished first: no kill this time
        self.daemon.kill()
        self.kills += 1
        self.recovery_kills += 1
        self.start_daemon()

    def prefill(self) -> None:
        """The large index: its blob files written, indexed by the first start (a lost
        index rebuilt from headers), its oldest entries pinned."""
        n = self.settings.prefill
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        self.prefill_seconds["write_files"] = round(large.write_prefill(self.data_dir, n,
                                                                          BLOCK), 1)
        t0 = time.monotonic()
        self.start_daemon(timeout=120 + n / 250)  # up to 4 ms an entry on a busy machine
        self.prefill_seconds["first_start"] = round(time.monotonic() - t0, 1)
        self.prefill_pinned = large.pinned_prefill(n, BLOCK)
        for key in self.prefill_pinned:
            self.fast.pin(key)

    def check_prefill(self, listed: dict[bytes, pb.Entry]) -> None:
        """Every pinned prefilled entry is there and pinned; a sample of the others still
        there is loaded and compared (the pinned ones too, in rotation)."""
        ledger = self.ledger
        for key in self.prefill_pinned:
            entry = listed.get(key)
            if entry is None:
                ledger.lose(key, f"a pinned prefilled entry, not listed after restart "
                            f"{self.restarts}")
            elif not entry.pinned:
                ledger.problem("pin_state_lost", f"{key.hex()}: a pinned prefilled entry, "
                               f"listed unpinned after restart {self.restarts}")
        left = [k for k, e in listed.items() if e.model_name == large.PREFILL.model_name]
        self.prefill_left = len(left)
        for i, key in enumerate(self.rng.sample(left, min(self.settings.sample, len(left)))):
            if self.check_unacknowledged(self.fast if i % 2 == 0 else self.stream, key,
                                         listed[key]):
                ledger.count("prefilled_entries_checked")

    def kill_during_reclaim(self) -> None:
        """The large index: take the full disk tier over its high watermark with saves of
        disposable entries, and kill the daemon once the reclaimer's pass is under way
        (given up after 20 s without one)."""
        watch = large.ReclaimWatch(self.address)
        stop = threading.Event()
        rng = random.Random(self.rng.random())

        def burst() -> None:
            with CacheClient(self.address, timeout=5.0) as client:
                while not stop.is_set():
                    tokens = [rng.randrange(1, 60_000) for _ in range(rng.randrange(1, 80))]
                    try:
                        saved = client.save(DISPOSABLE, tokens, entry_payload(tokens), "cold")
                    except CacheError:
                        return  # killed
                    if saved.status == "saved":
                        with self.ledger.lock:
                            self.ledger.disposable[saved.key] = tuple(tokens)

        saver = threading.Thread(target=burst, daemon=True)
        saver.start()
        try:
            deadline = time.monotonic() + 20.0
            while not watch.evicting() and time.monotonic() < deadline:
                time.sleep(0.005)
            if watch.evicting():
                self.daemon.kill()
                self.kills += 1
                self.reclaim_kills += 1
        finally:
            stop.set()
            saver.join(timeout=30)
            watch.close()
        if not self.daemon.running:
            self.start_daemon()

    # -- checks after a restart -------------------------------------------------------------

    def orphans(self) -> list[Path]:
        found = [p for root in (self.data_dir, self.ram_dir) for p in root.rglob("*.part")]
        found += [p for p in (self.data_dir / "tmp").iterdir() if p not in found]
        return found

    def check(self, final: bool = False) -> None:
        t0 = time.monotonic()
        ledger = self.ledger
        fast, stream = self.fast, self.stream
        stats = self.recovered(fast)
        if ledger.evictable and not large.reclaimer_quiet(fast):
            ledger.problem("index_file_mismatches", "the reclaimer still evicted 120 s "
                           f"after restart {self.restarts}")
        for path in self.orphans():
            ledger.problem("orphans_found", str(path))
        quarantine = self.data_dir / "quarantine"
        n_quarantined = len(list(quarantine.iterdir())) if quarantine.is_dir() else 0
        if n_quarantined > self.quarantined_seen:
            ledger.problem("quarantined_files", f"{n_quarantined - self.quarantined_seen} new "
                           f"file(s) in {quarantine} after restart {self.restarts}")
            self.quarantined_seen = n_quarantined

        # What start-up found: temp files swept, blobs re-indexed, rows dropped.
        for name in ("orphans_swept", "reconcile_added", "reconcile_removed"):
            self.daemon_counters[name] += stats.counters.get(name, 0)
        disk = next(t for t in stats.tiers if t.tier == pb.TIER_DISK)
        if stats.in_flight or disk.reserved_bytes:
            ledger.problem("index_file_mismatches", f"a fresh daemon has {stats.in_flight} "
                           f"saves in flight, {disk.reserved_bytes} bytes reserved")
        # Index against files, before any load can schedule a RAM copy.
        listed = {e.key: e for e in fast.list_entries()}
        self.check_index_against_files(listed)
        with ledger.lock:
            back = [k for k in ledger.removed if k in listed]
        for key in back:  # removed for good: it is gone again, and counted once
            ledger.problem("resurrected", f"{key.hex()}: pruned or deleted (answered OK), "
                           f"listed again after restart {self.restarts}")
            with contextlib.suppress(CacheError):
                fast.delete(key)
            with ledger.lock:
                ledger.removed.discard(key)

        with ledger.lock:
            acked = dict(ledger.acked)
            sizes = dict(ledger.acked_size)
            fresh, ledger.since_check = ledger.since_check, []
            lost_already = set(ledger.lost)
        for key in list(acked):
            entry = listed.get(key)
            if entry is None and ledger.evictable and ledger.pin_state.get(key) is not True:
                ledger.evicted(key)  # unpinned, in a full tier: evicted, not lost
                del acked[key]
            elif (entry is None or entry.size != sizes[key]) and key not in lost_already:
                ledger.lose(key, f"not listed after restart {self.restarts}"
                            if entry is None else f"listed with size {entry.size}")
        fresh = [k for k in fresh if k in acked]
        ledger.count("presence_checks", len(acked))
        if self.prefill_pinned:
            self.check_prefill(listed)

        with ledger.lock:
            pins = {k: v for k, v in ledger.pin_state.items() if v is not None}
        for key, pinned in pins.items():
            entry = listed.get(key)
            if entry is not None and entry.pinned != pinned:
                ledger.problem("pin_state_lost", f"{key.hex()}: {'pin' if pinned else 'unpin'} "
                               f"was answered, listed with pinned={entry.pinned} after restart "
                               f"{self.restarts}")
        # Verify over a large index every tenth restart would be most of the run.
        self.verify_entries(listed, everything=final or (
            self.restarts % 10 == 0 and not self.settings.prefill))

        # Full checks: lookup + load + bytes, on both paths.
        if final:
            todo = list(acked)
        else:
            fresh_keys = set(fresh)
            older = [k for k in acked if k not in fresh_keys]
            todo = fresh + self.rng.sample(older, min(self.settings.sample, len(older)))
        for i, key in enumerate(todo):
            if key in lost_already or key in ledger.lost:
                continue
            client = fast if i % 2 == 0 else stream
            if self.full_check(client, key, list(acked[key])):
                ledger.count("entries_checked")
                ledger.byte_checked.add(key)
        # Entries nobody was told about (a Commit whose answer the kill cut off, the
        # disposable ones) must be whole too: check each once.
        for i, (key, entry) in enumerate(listed.items()):
            if key in ledger.byte_checked or key in acked or (
                    entry.model_name == large.PREFILL.model_name):  # sampled above
                continue
            client = fast if i % 2 == 0 else stream
            if self.check_unacknowledged(client, key, entry):
                ledger.byte_checked.add(key)
        self.check_seconds += time.monotonic() - t0

    def verify_entries(self, listed: dict[bytes, pb.Entry], everything: bool) -> None:
        """Verify RPC over the entries that are new or changed tier since the last check
        and a tenth of the others (each at least every ten restarts), or over everything:
        a published blob is never rewritten, so an entry that verified and has not changed
        since is re-read only in rotation (re-reading all ~1,000 every restart was a third of
        the run)."""
        ledger = self.ledger
        state = {k: (e.size, pb.TIER_RAM in e.tiers) for k, e in listed.items()}
        if everything:
            wanted = list(listed)
        else:
            turn = self.restarts % 10
            wanted = [k for k in listed
                      if self.verified_state.get(k) != state[k] or k[1] % 10 == turn]
        results = list(self.fast.verify(wanted, timeout=600.0)) if wanted else []
        ledger.count("verified_entries", len(results))
        for r in results:
            if not r.ok:
                ledger.problem("unverified", f"{r.key.hex()}: {r.error}")
        if {r.key for r in results} != set(wanted):
            ledger.problem("index_file_mismatches", "Verify and List saw other entries")
        self.verified_state = state

    def recovered(self, client: CacheClient) -> pb.StatsResponse:
        """Stats once the daemon's check after a kill (kvcache.store.recovery: it serves
        meanwhile, fixing the index in the background) has finished: until then rows
        whose blob a removal had taken may still be listed."""
        deadline = time.monotonic() + RECOVERY_SECONDS
        while (stats := client.stats()).recovery.state == "running":
            if time.monotonic() > deadline:
                self.ledger.problem("index_file_mismatches", "the check after restart "
                                    f"{self.restarts} did not finish in {RECOVERY_SECONDS} s")
                break
            time.sleep(0.05)
        if stats.recovery.state == "failed":
            self.ledger.problem("index_file_mismatches", "the check after restart "
                                f"{self.restarts} failed (see the daemon's log)")
        return stats

    def check_index_against_files(self, listed: dict[bytes, pb.Entry]) -> None:
        ledger = self.ledger
        on_disk: dict[bytes, int] = {}
        for path in (self.data_dir / "blobs").glob("*/*"):
            if path.suffix != ".kvc":
                if path.suffix != ".part":  # .part files are counted as orphans
                    ledger.problem("index_file_mismatches", f"stray file {path}")
                continue
            on_disk[bytes.fromhex(path.stem)] = path.stat().st_size
        in_ram: dict[bytes, int] = {}
        for path in self.ram_dir.iterdir():
            if path.suffix == ".kvc":
                in_ram[bytes.fromhex(path.stem)] = path.stat().st_size
            elif path.suffix != ".part" and path.name != RAM_MARKER:
                ledger.problem("index_file_mismatches", f"stray file {path}")
        for key, entry in listed.items():
            size = on_disk.pop(key, None)
            if size != entry.size:
                ledger.problem("index_file_mismatches", f"{key.hex()}: indexed with "
                               f"{entry.size} bytes, blob file has {size}")
            ram_size = in_ram.pop(key, None)
            if pb.TIER_RAM in entry.tiers and ram_size != entry.size:
                ledger.problem("index_file_mismatches", f"{key.hex()}: indexed in RAM, "
                               f"RAM copy has {ram_size} bytes")
            elif pb.TIER_RAM not in entry.tiers and ram_size is not None:
                ledger.problem("index_file_mismatches", f"{key.hex()}: a RAM copy the "
                               "index does not know")
        for key, entry in listed.items():  # no piece is visible without its parent
            if entry.parent and entry.parent not in listed:
                ledger.problem("broken_chains", f"{key.hex()}: listed, its parent "
                               f"{entry.parent.hex()} is not")
        for key in on_disk:
            ledger.problem("index_file_mismatches", f"{key.hex()}: blob file not indexed")
        for key in in_ram:
            ledger.problem("index_file_mismatches", f"{key.hex()}: RAM file not indexed")

    def full_check(self, client: CacheClient, key: bytes, tokens: list[int]) -> bool:
        hit = client.lookup(KEPT, tokens)
        if hit is None or hit.key != key or hit.matched_tokens != len(tokens):
            self.ledger.lose(key, f"lookup after restart {self.restarts} answered {hit}")
            return False
        try:
            loaded = client.load(key, prefix_of=tokens)
        except CacheError as exc:
            self.ledger.lose(key, f"load after restart {self.restarts}: {exc}")
            return False
        if list(loaded.meta.tokens) != tokens or bytes(loaded.payload) != saved_payload(
                loaded.meta):
            self.ledger.problem("wrong_bytes_served", f"{key.hex()} after restart "
                                f"{self.restarts} holds other bytes than were saved")
            return False
        if loaded.meta.parent:  # every piece it is built on is there and fits
            try:
                chain = client.load_chain(key, prefix_of=tokens)
            except CacheError as exc:
                self.ledger.lose(key, f"its chain after restart {self.restarts}: {exc}")
                return False
            self.ledger.count("chains_checked")
            self.ledger.count("chain_links_checked", len(chain))
        return True

    def check_unacknowledged(self, client: CacheClient, key: bytes, entry: pb.Entry) -> bool:
        try:
            loaded = client.load(key)
        except CacheError as exc:
            self.ledger.problem("unverified", f"listed entry {key.hex()} does not load: {exc}")
            return False
        if not holds_what_was_saved(key, loaded.meta, bytes(loaded.payload)):
            self.ledger.problem("wrong_bytes_served", f"unacknowledged entry {key.hex()} "
                                "holds other bytes than were saved")
            return False
        self.ledger.count("unacknowledged_entries_checked")
        return True

    # -- the run ------------------------------------------------------------------------------

    def cycle(self, index: int) -> None:
        """Load the live daemon from fresh client threads, then kill it mid-flight."""
        stop = threading.Event()
        workers = [Worker(self, w, index, fast=w % 2 == 0) for w in range(self.settings.workers)]
        threads = [threading.Thread(target=w.run, args=(self.address, stop), daemon=True)
                   for w in workers]
        for t in threads:
            t.start()
        watch = large.ReclaimWatch(self.address) if self.settings.prefill else None
        delay = self.rng.uniform(self.settings.min_delay_ms, self.settings.max_delay_ms)
        time.sleep(delay / 1000.0)
        proc = self.daemon.proc
        assert proc is not None
        if self.rng.random() < self.settings.shutdown_kill_p:
            # A crash in the middle of a graceful shutdown (reservations being aborted,
            # usage flushed, the index closed) is a crash too.
            proc.send_signal(signal.SIGTERM)
            time.sleep(self.rng.uniform(0.0, 0.05))
            shutdown = True
        else:
            shutdown = False
        if proc.poll() is None:
            evicting = watch is not None and watch.evicting()
            self.daemon.kill()
            self.kills += 1
            self.kills_under_load += 1
            self.shutdown_kills += shutdown
            self.reclaim_kills += evicting
        else:  # it finished shutting down first: no kill this time
            self.daemon.kill()
            self.clean_stops += 1
        stop.set()
        if watch is not None:
            watch.close()
        for t in threads:
            t.join(timeout=60)
            if t.is_alive():
                self.ledger.problem("hangs", "a client thread did not return after the kill")

    def run(self) -> dict[str, object]:
        s = self.settings
        t0 = time.monotonic()
        kill_phase = 0.0
        budget_hit = False
        try:
            if s.prefill:
                self.prefill()
            else:
                self.start_daemon()
            index = 0
            while self.kills_under_load < s.kills:
                if time.monotonic() - t0 >= s.seconds:
                    budget_hit = True
                    break
                self.cycle(index)
                index += 1
                if self.rng.random() < s.startup_kill_p:
                    self.kill_during_startup()
                self.start_daemon()
                if self.rng.random() < s.recovery_kill_p:
                    self.kill_during_recovery()
                if s.prefill and self.rng.random() < s.reclaim_kill_p:
                    self.kill_during_reclaim()
                self.restarts += 1
                self.check()
            kill_phase = time.monotonic() - t0
            # A clean stop after all that leaves nothing behind either. The final check
            # then runs on a fresh start: on the same daemon, RAM copies scheduled by the
            # last check's loads were still being made while it compared index and files.
            self.daemon.stop(timeout=60)
            for path in self.orphans():
                self.ledger.problem("orphans_found", f"after a clean stop: {path}")
            self.start_daemon()
            self.check(final=True)
            self.daemon.stop(timeout=60)
        except RuntimeError as exc:  # the daemon did not come back: the worst outcome
            kill_phase = kill_phase or time.monotonic() - t0
            self.ledger.problem("restart_failures", str(exc)[-2000:])
        finally:
            self.daemon.kill()
        return self.report(time.monotonic() - t0, kill_phase, budget_hit)

    def report(self, seconds: float, kill_phase: float, budget_hit: bool) -> dict[str, object]:
        n = self.ledger.counts
        failures = ("lost_reports", "wrong_bytes_served", "orphans_found",
                    "index_file_mismatches", "unverified", "quarantined_files",
                    "corrupt_reported", "unexpected_errors", "wrong_keys", "hangs",
                    "resurrected", "pin_state_lost", "server_errors", "vanished_entries",
                    "restart_failures", "broken_chains")
        ok = not self.ledger.lost and not any(n[f] for f in failures)
        restarts = sorted(self.restart_seconds)
        return {
            "ok": ok,
            "kills": self.kills,
            "kills_under_load": self.kills_under_load,
            "kills_during_startup": self.startup_kills,
            "kills_during_recovery": self.recovery_kills,
            "kills_during_shutdown": self.shutdown_kills,
            "kills_during_reclaim": self.reclaim_kills,
            "clean_stops_before_kill": self.clean_stops,
            "restarts": self.restarts,
            "saves_acknowledged": n["saves_acknowledged"],
            "entries_acknowledged": len(self.ledger.acked),
            "pieces_acknowledged": sum(1 for b in self.ledger.acked_base.values() if b),
            "chains_checked": n["chains_checked"],
            "chain_links_checked": n["chain_links_checked"],
            "broken_chains": n["broken_chains"],
            "entries_checked": n["entries_checked"],
            "presence_checks": n["presence_checks"],
            "verified_entries": n["verified_entries"],
            "unacknowledged_entries_checked": n["unacknowledged_entries_checked"],
            "entries_lost": len(self.ledger.lost),
            # Unpinned acknowledged entries the full tier gave up (--prefill only).
            "evicted_acknowledged": n["evicted_acknowledged"],
            "evicted_entries_missed_in_run": n["evicted_entries_missed_in_run"],
            "prefill": {"entries": self.settings.prefill, "pinned": len(self.prefill_pinned),
                        "left_at_end": self.prefill_left,
                        "checked": n["prefilled_entries_checked"],
                        "disk_budget": large.disk_budget(self.settings.prefill),
                        **self.prefill_seconds} if self.settings.prefill else None,
            "wrong_bytes_served": n["wrong_bytes_served"],
            "orphans_found": n["orphans_found"],
            "index_file_mismatches": n["index_file_mismatches"],
            "unverified": n["unverified"],
            "quarantined_files": n["quarantined_files"],
            "corrupt_reported": n["corrupt_reported"],
            "unexpected_errors": n["unexpected_errors"],
            "resurrected": n["resurrected"],
            "pin_state_lost": n["pin_state_lost"],
            "server_errors": n["server_errors"],
            "vanished_entries": n["vanished_entries"],
            "restart_failures": n["restart_failures"],
            "loads_during_run": {"fast": n["loads_fast"], "stream": n["loads_stream"]},
            "saves": {k[6:]: v for k, v in sorted(n.items()) if k.startswith("saves_")
                      and k != "saves_acknowledged"},
            "pins": n["pins"], "unpins": n["unpins"], "prunes": n["prunes"],
            "pruned_entries": n["pruned_entries"], "deletes": n["deletes"],
            "dependents_deleted": n["dependents_deleted"],
            # Entries whose prune or delete was answered (each checked for resurrection
            # after every later restart).
            "removals_acknowledged": n["removals_acknowledged"],
            "client_errors": dict(self.ledger.errors),
            "daemon_recovery": dict(self.daemon_counters),
            "restart_seconds": {"median": round(restarts[len(restarts) // 2], 3),
                                "max": round(restarts[-1], 3)} if restarts else {},
            "check_seconds": round(self.check_seconds, 1),
            "budget_hit": budget_hit,
            "kill_phase_seconds": round(kill_phase, 1),
            "seconds": round(seconds, 1),
            "seed": self.settings.seed,
            "workdir": str(self.workdir),
            "ram_dir": str(self.ram_dir),
            "problems": self.ledger.problems,
        }

    def made(self) -> list[Path]:
        """What the run made on disk and in memory: the work folder (or, in a folder it was
        given, what it made there) and the RAM tier's folder."""
        made = [self.workdir] if self.own_workdir else [
            p for p in (self.data_dir, self.workdir / "daemon.log", self.socket) if p.exists()]
        if not (self.own_workdir and self.ram_parent.is_relative_to(self.workdir)):
            made.append(self.ram_parent)
        return made

    def cleanup(self, keep: bool) -> None:
        self.daemon.kill()
        self.fast.close()
        self.stream.close()
        if not keep:
            shutil.rmtree(self.ram_parent, ignore_errors=True)  # the RAM tier with it
            if self.own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)


def removal_command(paths: list[Path]) -> str:
    return "rm -rf -- " + " ".join(shlex.quote(str(p)) for p in paths)


def run(settings: Settings) -> dict[str, object]:
    """Run the harness. When the run is not ok (or ``keep``), its work folder and RAM tier
    are kept for inspection, and the result says where and the command that removes them
    (``kept``, ``remove_with``)."""
    harness = CrashHarness(settings)
    result: dict[str, object] = {}
    try:
        result = harness.run()
    finally:
        keep = settings.keep or not result.get("ok", False)
        harness.cleanup(keep=keep)
        if keep:
            made = harness.made()
            result["kept"] = [str(p) for p in made]
            result["remove_with"] = removal_command(made)
            print(f"crash_harness: kept for inspection: {', '.join(map(str, made))}\n"
                  f"crash_harness: remove them with: {result['remove_with']}",
                  file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--campaign", action="store_true",
                    help=f"the long run: {CAMPAIGN_KILLS:,} kills, the kill phase bounded at "
                         f"{CAMPAIGN_SECONDS / 60:.0f} minutes so that the run fits CI's "
                         "90-minute budget (--kills and --seconds still apply)")
    ap.add_argument("--kills", type=int, default=None,
                    help="SIGKILLs under load to deliver (default: 100)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="stop killing after this long (the final check comes after; "
                         "default: 240)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--workers", type=int, default=4, help="client threads per cycle")
    ap.add_argument("--min-delay-ms", type=float, default=20.0)
    ap.add_argument("--max-delay-ms", type=float, default=400.0)
    ap.add_argument("--lease-seconds", type=float, default=2.0)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new /tmp dir")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="the large index: N entries written before the first start, a "
                         "disk budget they fill, evictions allowed to unpinned entries")
    ap.add_argument("--recovery-kill-p", type=float, default=None,
                    help="share of restarts killed again during their background check "
                         "(default: 0.1; 0.4 with --prefill)")
    ap.add_argument("--json", dest="as_json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    kills, seconds = (CAMPAIGN_KILLS, CAMPAIGN_SECONDS) if args.campaign else (100, 240.0)
    settings = Settings(
        kills=args.kills if args.kills is not None else kills,
        seconds=args.seconds if args.seconds is not None else seconds,
        seed=args.seed if args.seed is not None else random.randrange(1 << 31),
        workers=args.workers, min_delay_ms=args.min_delay_ms, max_delay_ms=args.max_delay_ms,
        lease_seconds=args.lease_seconds, workdir=args.workdir, keep=args.keep,
        prefill=args.prefill, recovery_kill_p=args.recovery_kill_p if args.recovery_kill_p
        is not None else 0.4 if args.prefill else 0.1)
    # Stopped early (Ctrl-C, or SIGTERM; a background job starts with SIGINT ignored):
    # the daemon is stopped and the run's folders are kept and named, as for a failed run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run(settings)
    if args.as_json:
        print(json.dumps(result, indent=2))
    else:
        for name, value in result.items():
            if name != "problems":
                print(f"{name:32} {value}")
        for line in result["problems"]:  # type: ignore[union-attr]
            print(f"PROBLEM {line}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

