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
may go (``evicted``, decided after a restart, once no reclaimer pass runs, or
``evicted_after_listing`` when a pass began during the checks), a pinned one never
(``lost``); a read still never returns other bytes, and a pruned or deleted entry
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from harness import crash_large as large
from harness.crash_files import index_against_files, orphans
from harness.crash_workload import (
    BLOCK,
    DISPOSABLE,
    KEPT,
    Ledger,
    Worker,
    entry_payload,
    holds_what_was_saved,
    saved_payload,
)
from harness.procs import Daemon

from kvcache.client import CacheClient, CacheError
from kvcache.store import NO_SUCH_ENTRY
from kvcache.v1 import kvcache_pb2 as pb

# The campaign (--campaign, and tests/faults/test_crash_harness.py with --campaign): 1,000 kills;
# CI gives it 90 minutes, so the kill phase stops at 80 and leaves the rest to the final
# check and the shutdown (a run that stops short of the kills fails).
CAMPAIGN_KILLS = 1000
CAMPAIGN_SECONDS = 80 * 60.0
# How long a restarted daemon's background check may take before it counts as a problem.
RECOVERY_SECONDS = 120.0
# A reclaimer pass counts a batch it removed once its rows are gone (see
# CrashHarness.reclaimer_moved_since_listing): how long a check waits for the count.
COUNT_CATCH_UP_S = 2.0

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
        self.moves_at_listing = (0, 0)  # the reclaimer's passes and evictions then
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
        return orphans(self.data_dir, self.ram_dir)

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
        listed = self.listed_against_files()
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
            elif entry is not None and entry.size != sizes[key] and ledger.evictable and \
                    ledger.pin_state.get(key) is not True:
                # Evicted unseen (a full tier), then saved again by a save whose answer a
                # kill cut off: the entry is that save's blob, whose bytes the full check
                # below holds to its tokens and base like any other's.
                ledger.resaved(key, entry.size, entry.base)
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

    def listed_against_files(self) -> dict[bytes, pb.Entry]:
        """The entries listed, compared with the files. With evictions (--prefill) a
        reclaimer pass may still be removing a batch (its files go before its rows) when
        the look begins: a disagreement is looked at again, up to three times, once no
        pass has been seen for a while; what still disagrees is reported."""
        for attempt in range(3):
            self.moves_at_listing = large.reclaimer_moves(self.fast.stats())
            listed = {e.key: e for e in self.fast.list_entries()}
            found = index_against_files(self.data_dir, self.ram_dir, listed)
            if not found or not self.ledger.evictable or attempt == 2:
                break
            self.ledger.count("file_looks_repeated")
            time.sleep(1.0)
            large.reclaimer_quiet(self.fast)
        for counter, message in found:
            self.ledger.problem(counter, message)
        return listed

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
            if not r.ok and not (r.error == NO_SUCH_ENTRY
                                 and self.evicted_since_listing(r.key, listed[r.key].pinned)):
                ledger.problem("unverified", f"{r.key.hex()}: {r.error}")
        if {r.key for r in results} != set(wanted):
            ledger.problem("index_file_mismatches", "Verify and List saw other entries")
        self.verified_state = state

    def evicted_since_listing(self, key: bytes, pinned: bool) -> bool:
        """An unpinned entry that was listed and is no longer indexed, in a full tier whose
        reclaimer has begun a pass or evicted since the listing (a pass may start whenever
        the tier is over its watermark): evicted, not lost, and no longer expected."""
        if not self.ledger.evictable or pinned:
            return False
        if [r.error for r in self.fast.verify([key])] != [NO_SUCH_ENTRY]:
            return False  # still indexed: whatever failed, it was not an eviction
        if not self.reclaimer_moved_since_listing():
            return False
        self.ledger.count("evicted_after_listing")
        with self.ledger.lock:
            acknowledged = key in self.ledger.acked
        if acknowledged:
            self.ledger.evicted(key)
        return True

    def reclaimer_moved_since_listing(self) -> bool:
        """Whether the reclaimer began a pass or evicted since the listing. A pass deletes
        a batch's rows before it counts them (kvcache.store.reclaim): a row seen gone just
        before its count is waited for, up to COUNT_CATCH_UP_S."""
        deadline = time.monotonic() + COUNT_CATCH_UP_S
        while large.reclaimer_moves(self.fast.stats()) == self.moves_at_listing:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

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

    def full_check(self, client: CacheClient, key: bytes, tokens: list[int]) -> bool:
        hit = client.lookup(KEPT, tokens)
        if hit is None or hit.key != key or hit.matched_tokens != len(tokens):
            if self.evicted_since_listing(key, self.ledger.pin_state.get(key) is True):
                return False
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
        n = self.settings.workers
        workers = [Worker(self.ledger, self.settings.seed, n, w, index, fast=w % 2 == 0)
                   for w in range(n)]
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
            "resaved_unacknowledged": n["resaved_unacknowledged"],
            # Listed after a restart, then gone in a pass begun during the checks.
            "evicted_after_listing": n["evicted_after_listing"],
            # Looks at index and files taken again: a reclaimer pass was still under way.
            "file_looks_repeated": n["file_looks_repeated"],
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

