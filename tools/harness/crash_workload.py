"""The crash harness's workload (tools/crash_harness.py): the client threads' operations
against the live daemon, and the ledger of what they were told (acknowledged saves,
answered pins, removals), which the checks after each restart hold the daemon to.

Payloads follow from the tokens (and a piece's base), so any entry found can be checked on
its own."""

from __future__ import annotations

import contextlib
import random
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field

from harness import crash_large as large
from harness.payloads import payload_for
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
from kvcache.store import NO_SUCH_ENTRY

BLOCK = 16
KEPT = Identity("fp-crash-kept", {"type_k": "f16"}, model_name="kept.gguf")
# Another fingerprint, so a disposable entry never shares a key with a kept one: prunes
# by this model name are the only removals in the run.
DISPOSABLE = Identity("fp-crash-disposable", {"type_k": "f16"}, model_name="disposable.gguf")
FAMILY_TOKENS = 120
MAX_PROBLEMS = 40

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

    def resaved(self, key: bytes, size: int, base: int) -> None:
        """An unpinned acknowledged entry listed with other bytes where entries may be
        evicted: evicted unseen and saved again (see ack). Expected as it is now."""
        with self.lock:
            self._take_blob(key, size, base)
            self.counts["resaved_unacknowledged"] += 1

    def _take_blob(self, key: bytes, size: int, base: int) -> None:
        """(Under the lock) the acknowledged key's entry is now this blob."""
        self.acked_size[key] = size
        self.acked_base[key] = base

    def ack(self, key: bytes, tokens: list[int], size: int, base: int = 0) -> None:
        with self.lock:
            if key not in self.acked:
                self.acked[key] = tuple(tokens)
                self.acked_size[key] = size
                self.acked_base[key] = base
                self.acked_keys.append(key)
                self.since_check.append(key)
            elif self.evictable and self.acked_size[key] != size:
                # Evicted unseen (a full tier), then saved anew with another codec or on
                # another parent: the entry is now this save's blob. (Where nothing is
                # evicted, a new blob for an acknowledged key is a loss the check reports.)
                self._take_blob(key, size, base)
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

    def __init__(self, ledger: Ledger, seed: int, workers: int, wid: int, cycle: int,
                 fast: bool) -> None:
        """Worker ``wid`` of ``workers`` in cycle ``cycle`` of the run of ``seed``."""
        self.wid = wid
        self.workers = workers
        self.ledger = ledger
        self.fast = fast
        self.rng = random.Random(f"{seed}/{cycle}/{wid}")
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
                if picked[0][0] % self.workers == self.wid:
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
            if result.ok:
                continue
            if result.error == NO_SUCH_ENTRY:
                # Gone, as a lookup or load finding nothing: lost, unless entries may be
                # evicted (a full tier evicts while the clients run); then the check after
                # the next restart decides by its pin.
                self.ledger.missing(result.key, "verify during the run answered "
                                                f"{NO_SUCH_ENTRY}")
            else:
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
