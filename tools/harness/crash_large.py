"""The crash harness's large index (tools/crash_harness.py --prefill N).

N small entries of a model of their own are written straight into the data directory as
blob files before the first start (as tools/bench_full_cache.py makes its million) and
indexed by that start from their headers. The disk budget is what they take up to the
reclaimer's high watermark, so the tier starts full and the run's saves keep it so: the reclaimer runs its passes while the
harness kills, and a restarted daemon's background check has a large index to get
through. The oldest of them, first in the eviction order, are pinned: no pass may take
one. ``ReclaimWatch`` tells whether a kill landed while the reclaimer was evicting.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from harness.payloads import blob_bytes, payload_for, write_blob_files
from kvcache import keys
from kvcache.client import CacheClient, CacheError, Identity
from kvcache.v1 import kvcache_pb2 as pb

PREFILL = Identity("fp-crash-prefill", {"type_k": "f16"}, model_name="prefill.gguf")
PREFILL_PAYLOAD = 1800
# Shares of the disk budget: a pass takes the tier from above the high watermark down to
# the low one (a tenth of it: passes long enough for kills to land in).
RECLAIM_LOW = 0.85
RECLAIM_HIGH = 0.95
PINNED_SHARE = 0.01  # of the prefilled entries, the oldest: pinned after the first start
MAX_PINNED = 200
# A kill counts as landing in a reclaimer pass when the reclaimer began a pass or evicted
# this recently and the tier was still above its low watermark (where a pass ends) at the
# last look.
EVICTING_WITHIN_SECONDS = 0.5
WATCH_INTERVAL_SECONDS = 0.02


def prefill_tokens(i: int) -> list[int]:
    """Tokens of prefilled entry ``i``: one block, distinct for every ``i``."""
    rng = random.Random(i)
    return [1 + (i >> 15), 1 + (i & 0x7FFF), *(rng.randrange(1, 60_000) for _ in range(14))]


def prefill_payload(tokens: list[int]) -> bytes:
    return payload_for(tokens, PREFILL_PAYLOAD)


def prefill_key(i: int, block: int) -> bytes:
    return keys.entry_key(PREFILL.namespace, prefill_tokens(i), block).key


def entry_bytes() -> int:
    """The size of one prefilled entry's blob (all are alike in size)."""
    tokens = prefill_tokens(0)
    return len(blob_bytes(PREFILL, tokens, prefill_payload(tokens)))


def disk_budget(n: int) -> int:
    """A budget the n prefilled entries fill up to the high watermark: the tier starts
    full, the first saves take it over (no pass before the harness has pinned)."""
    return int(n * entry_bytes() / (RECLAIM_HIGH - 0.001))


def write_prefill(data_dir: Path, n: int, block: int) -> float:
    """N entries' blob files where the daemon keeps them, without index rows (its start-up
    indexes them from their headers), entry i created i seconds after the first (so the
    eviction order is theirs). Returns the seconds taken."""
    t0 = time.monotonic()
    write_blob_files(data_dir, PREFILL, block,
                     ((t, prefill_payload(t)) for t in map(prefill_tokens, range(n))))
    return time.monotonic() - t0


def pinned_prefill(n: int, block: int) -> dict[bytes, list[int]]:
    """The prefilled entries the harness pins: the oldest ones (key -> tokens)."""
    count = min(MAX_PINNED, max(1, int(n * PINNED_SHARE)))
    return {prefill_key(i, block): prefill_tokens(i) for i in range(count)}


def reclaimer_evictions(stats: pb.StatsResponse) -> int:
    """Entries the reclaimer evicted (saves' own evictions are counted apart)."""
    return stats.counters.get("evictions_disk", 0) - stats.counters.get("evictions_disk_inline",
                                                                         0)


def disk_tier(stats: pb.StatsResponse) -> pb.TierStats:
    return next(t for t in stats.tiers if t.tier == pb.TIER_DISK)


def reclaimer_moves(stats: pb.StatsResponse) -> tuple[int, int]:
    """The reclaimer's disk passes begun and entries evicted so far."""
    return stats.counters.get("reclaims_disk", 0), reclaimer_evictions(stats)


def reclaimer_quiet(client: CacheClient, timeout: float = 120.0) -> bool:
    """Wait until no reclaimer pass is seen: the disk tier at or below its high watermark,
    no pass begun and no entry evicted for a second (a batch's files go before its rows
    and its counts, so a look comparing index and files may still race a pass: the
    harness looks again when they disagree)."""
    deadline = time.monotonic() + timeout
    last: tuple[int, int] | None = None
    still = 0
    while time.monotonic() < deadline:
        stats = client.stats()
        disk = disk_tier(stats)
        moves = reclaimer_moves(stats)
        over = disk.bytes + disk.reserved_bytes > RECLAIM_HIGH * disk.budget_bytes
        still = still + 1 if moves == last and not over else 0
        if still >= 10:
            return True
        last = moves
        time.sleep(0.1)
    return False


class ReclaimWatch:
    """Looks at the daemon's Stats every few ms during a cycle (a thread of its own) to
    say, just before a kill, whether the reclaimer was evicting."""

    def __init__(self, address: str) -> None:
        self._client = CacheClient(address, timeout=2.0)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._moved_at = 0.0  # when the reclaimer last began a pass or evicted
        # When, (passes begun, entries evicted), above the low watermark.
        self._last: tuple[float, tuple[int, int], bool] | None = None
        self._thread = threading.Thread(target=self._run, name="reclaim-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stats = self._client.stats()
            except CacheError:
                self._stop.wait(WATCH_INTERVAL_SECONDS)
                continue
            disk = disk_tier(stats)
            above_low = disk.bytes + disk.reserved_bytes > RECLAIM_LOW * disk.budget_bytes
            now = time.monotonic()
            moves = reclaimer_moves(stats)
            with self._lock:
                if self._last is not None and moves != self._last[1]:
                    self._moved_at = now
                self._last = (now, moves, above_low)
            self._stop.wait(WATCH_INTERVAL_SECONDS)

    def evicting(self) -> bool:
        """Whether the reclaimer was in a pass at the last look (taken within 0.1 s)."""
        with self._lock:
            if self._last is None:
                return False
            now = time.monotonic()
            seen, _, above_low = self._last
            return (now - seen < 0.1 and above_low
                    and now - self._moved_at < EVICTING_WITHIN_SECONDS)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()
