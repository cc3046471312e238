"""Load: 36 concurrent clients against one real daemon with small RAM and disk budgets, for
a bounded time, mixing every kind of call. Nothing may hang, no call may fail with a status
outside the expected ones, every blob read must hold exactly the bytes saved for its
tokens, and afterwards the daemon's counters must agree with what the clients saw, with
the budgets, the files and the index.

Each client thread has its own CacheClient; even threads use the same-host fast path
(they write the reserved temp file and map published files), odd ones stream over gRPC.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from harness import payloads

from kvcache import keys
from kvcache.client import CacheClient, CacheError, Identity, LoadedBlob
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, blob_file

IDENT = Identity("fp-load", {"type_k": "f16"}, model_name="tiny.gguf")
N_CLIENTS = 36
RUN_S = 15.0  # the mixed phase; a thread still running JOIN_S after that is hung
JOIN_S = 60.0
RAM_BUDGET = 2 << 20
DISK_BUDGET = 6 << 20  # ~80 entries of ~75 kB on average: eviction is constant
RSS_LIMIT = 500 << 20
# The long prompt whose prefixes every client saves and looks up.
BASE = [random.Random(7).randrange(1, 60_000) for _ in range(256)]
SHARED = [BASE[:n] for n in (16, 20, 32, 40, 48, 64, 80, 96, 128, 160, 200, 256)]

# Every status a call may end with under this load, and why; anything else fails the test.
EXPECTED: dict[str, set[grpc.StatusCode]] = {
    "lookup": set(),
    # Everything left is pinned or being read.
    "save": {grpc.StatusCode.RESOURCE_EXHAUSTED},
    # Evicted or deleted (or never saved); DEADLINE_EXCEEDED only for "still being written".
    "load": {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED},
    "pin": {grpc.StatusCode.NOT_FOUND},
    "unpin": {grpc.StatusCode.NOT_FOUND},
    # Gone already; or pinned, or being read, right now.
    "delete": {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION},
    "inspect": {grpc.StatusCode.NOT_FOUND},
    "prune": set(),
    "verify": set(),
    "list": set(),
}


FAILED = object()  # what Client.call returns for a call that ended with an error status


# payload_for(tokens): 2 kB to 150 kB, size and bytes following from the tokens, so any
# blob read can be checked on its own.
payload_for = functools.partial(payloads.payload_for, size=(2_000, 150_000))


def key_of(tokens: list[int]) -> bytes:
    return keys.entry_key(IDENT.namespace, tokens, BLOCK).key


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def ram_settled(c: CacheClient, d: DaemonProcess) -> bool:
    """No RAM placement ran for half a second (a placement counts ram_used before it
    copies and indexes, so a busy worker would make the RAM figures disagree)."""
    def state() -> tuple[object, ...]:
        s = c.stats()
        n = s.counters
        return (n["ram_placements"], n["evictions_ram"], [t.bytes for t in s.tiers],
                sorted(p.name for p in d.ram_dir.iterdir()))

    before = state()
    time.sleep(0.5)
    return state() == before and not list(d.ram_dir.glob("*.part"))


@dataclass
class Tally:
    """What one client saw. Merged after the run and compared with the daemon's counters."""

    ops: Counter[str] = field(default_factory=Counter)
    saves: Counter[str] = field(default_factory=Counter)  # saved | already_present | ...
    statuses: Counter[str] = field(default_factory=Counter)  # "op:STATUS" of expected errors
    unexpected: list[str] = field(default_factory=list)
    bad_bytes: list[str] = field(default_factory=list)
    pruned: int = 0
    lookup_hits: int = 0
    loads_ok: int = 0
    loads_failed: int = 0


class Client:
    """One load thread: its own CacheClient, its own distinct prompts, a shared registry."""

    def __init__(self, i: int, address: str, registry: list[list[int]],
                 lock: threading.Lock) -> None:
        self.i = i
        self.rng = random.Random(1000 + i)
        self.cache = CacheClient(address, fast_path=i % 2 == 0, timeout=30.0)
        self.registry = registry  # every token list any client has saved (append only)
        self.lock = lock
        self.mine: list[list[int]] = []  # this client's distinct prompts
        self.pinned: list[int] | None = None  # only the owner pins its distinct entries
        self.t = Tally()

    # -- calls ----------------------------------------------------------------------------

    def call(self, op: str, fn: Callable[[], object]) -> object:
        """Run one call; an error status is tallied (as expected or not): FAILED."""
        self.t.ops[op] += 1
        try:
            return fn()
        except CacheError as exc:
            code = exc.code
            expected = code in EXPECTED[op]
            if op == "load" and code == grpc.StatusCode.DEADLINE_EXCEEDED:
                expected = "still being written" in str(exc)
            if not expected:
                self.t.unexpected.append(f"{op}: {exc!r}")
            else:
                self.t.statuses[f"{op}:{code.name}"] += 1  # type: ignore[union-attr]
            if op == "load":
                self.t.loads_failed += 1
            return FAILED

    def check(self, blob: LoadedBlob, tokens: list[int] | None) -> None:
        got = list(blob.meta.tokens)
        if tokens is not None and got != tokens:
            self.t.bad_bytes.append(f"blob of {len(tokens)} tokens holds {len(got)} others")
        elif bytes(blob.payload) != payload_for(got):
            self.t.bad_bytes.append(f"blob of {len(got)} tokens holds other bytes")

    def load(self, key: bytes, tokens: list[int] | None, prefix_of: list[int] | None = None,
             wait_ms: int = 0) -> LoadedBlob | None:
        blob = self.call("load", lambda: self.cache.load(key, prefix_of=prefix_of,
                                                         wait_ms=wait_ms))
        if blob is FAILED:
            return None
        self.t.loads_ok += 1
        self.check(blob, tokens)  # type: ignore[arg-type]
        return blob  # type: ignore[return-value]

    def save(self, tokens: list[int]) -> str | None:
        result = self.call("save", lambda: self.cache.save(IDENT, tokens, payload_for(tokens),
                                                           "cold"))
        if result is FAILED:
            return None
        status = result.status  # type: ignore[attr-defined]
        self.t.saves[status] += 1
        if status == "saved":
            with self.lock:
                self.registry.append(tokens)
        return status

    # -- the mix --------------------------------------------------------------------------

    def lookup(self) -> None:
        base = self.rng.choice(SHARED) if self.rng.random() < 0.7 or not self.mine \
            else self.rng.choice(self.mine)
        prompt = base + [self.rng.randrange(1, 60_000) for _ in range(self.rng.randrange(8))]
        hit = self.call("lookup", lambda: self.cache.lookup(IDENT, prompt))
        if hit is not None and hit is not FAILED:
            self.t.lookup_hits += 1
            if self.rng.random() < 0.5:  # then read what was found (it may be gone by now)
                self.load(hit.key, prompt[: hit.matched_tokens],  # type: ignore[attr-defined]
                          prefix_of=prompt)

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.25:
            self.lookup()
        elif r < 0.40:
            self.save(self.rng.choice(SHARED))
        elif r < 0.55:
            tokens = [self.rng.randrange(1, 60_000) for _ in range(self.rng.randrange(4, 90))]
            if self.save(tokens) == "saved":
                self.mine.append(tokens)
        elif r < 0.75:
            with self.lock:
                tokens = self.rng.choice(self.registry) if self.registry else SHARED[0]
            self.load(key_of(tokens), tokens, wait_ms=self.rng.choice((0, 0, 200)))
        elif r < 0.85:
            self.pin_or_unpin()
        elif r < 0.92:
            with self.lock:
                tokens = self.rng.choice(self.registry) if self.registry else SHARED[0]
            if tokens is not self.pinned:
                self.call("delete", lambda: self.cache.delete(key_of(tokens)))
        elif r < 0.925:
            self.prune()
        elif r < 0.97:
            with self.lock:
                tokens = self.rng.choice(self.registry) if self.registry else SHARED[0]
            self.call("inspect", lambda: self.cache.inspect(key_of(tokens)))
        else:
            self.call("list", lambda: self.cache.list_entries(limit=20))

    def pin_or_unpin(self) -> None:
        if self.pinned is not None:
            tokens, self.pinned = self.pinned, None
            # Pinned by us alone since: eviction, prune and delete must have left it.
            if self.load(key_of(tokens), tokens) is None:
                self.t.unexpected.append("a pinned entry was gone before it was unpinned")
            if self.call("unpin", lambda: self.cache.unpin(key_of(tokens))) is FAILED:
                self.t.unexpected.append("unpin of an entry we had pinned failed")
            else:
                self.t.ops["unpin_done"] += 1
        elif self.mine:
            tokens = self.mine[-1]  # the most recent: older ones are mostly evicted by now
            if self.call("pin", lambda: self.cache.pin(key_of(tokens))) is not FAILED:
                self.t.ops["pin_done"] += 1
                self.pinned = tokens

    def prune(self) -> None:
        kind = self.rng.randrange(3)
        if kind == 0:
            criteria: dict[str, object] = {"max_disk_bytes": DISK_BUDGET // 2}
        elif kind == 1:
            criteria = {"unused_for_seconds": 2.0, "max_ram_bytes": RAM_BUDGET // 2}
        else:
            criteria = {"max_disk_bytes": 1, "dry_run": True}
        resp = self.call("prune", lambda: self.cache.prune(**criteria))
        if resp is not FAILED and not criteria.get("dry_run"):
            self.t.pruned += len(resp.removed)  # type: ignore[attr-defined]

    def finish(self) -> None:
        if self.pinned is not None:
            self.pin_or_unpin()
        self.cache.close()


@pytest.mark.slow
def test_many_clients_mixed_load(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", str(RAM_BUDGET),
                       "--disk-bytes", str(DISK_BUDGET))
    assert d.proc is not None
    pid = d.proc.pid
    registry: list[list[int]] = []
    lock = threading.Lock()
    clients = [Client(i, d.address, registry, lock) for i in range(N_CLIENTS)]
    barrier = threading.Barrier(N_CLIENTS)
    stop = threading.Event()
    burst: list[str | None] = [None] * N_CLIENTS
    crashed: list[str] = []
    verified: list[str] = []

    def run(c: Client) -> None:
        try:
            # All at once, the same tokens: exactly one client writes them.
            barrier.wait(timeout=30)
            burst[c.i] = c.save(SHARED[-1])
            barrier.wait(timeout=30)  # nobody evicts or deletes it while others still save
            while not stop.is_set():
                c.step()
                if c.i == 0 and c.t.ops["verify"] < int(time.monotonic() - t0) // 4:
                    # Now and then, a full Verify while everything else goes on.
                    results = c.call("verify", lambda: list(c.cache.verify()))
                    if results is not FAILED:
                        verified.extend(f"{r.key.hex()}: {r.error}"
                                        for r in results if not r.ok)  # type: ignore[attr-defined]
            c.finish()
        except Exception as exc:  # reported below: a client must never crash
            crashed.append(f"client {c.i}: {exc!r}")

    peak_rss = rss_bytes(pid)
    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(c,), name=f"load-{c.i}") for c in clients]
    for t in threads:
        t.start()
    while time.monotonic() - t0 < RUN_S:
        time.sleep(0.25)
        peak_rss = max(peak_rss, rss_bytes(pid))
    stop.set()
    for t in threads:
        t.join(timeout=max(0.1, t0 + RUN_S + JOIN_S - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running {JOIN_S} s after the end: {hung}"
    elapsed = time.monotonic() - t0
    assert not crashed, crashed

    total = Tally()
    for c in clients:
        total.ops.update(c.t.ops)
        total.saves.update(c.t.saves)
        total.statuses.update(c.t.statuses)
        total.unexpected += c.t.unexpected
        total.bad_bytes += c.t.bad_bytes
        total.pruned += c.t.pruned
        total.lookup_hits += c.t.lookup_hits
        total.loads_ok += c.t.loads_ok
        total.loads_failed += c.t.loads_failed
    assert total.unexpected == [], total.unexpected[:20]
    assert total.bad_bytes == [], total.bad_bytes[:20]
    assert verified == [], f"Verify under load reported good entries as bad: {verified[:10]}"
    assert burst.count("saved") == 1, burst
    assert set(burst) <= {"saved", "already_present", "in_flight"}, burst

    with d.client() as c:
        # Settle: streamed reads release their pin as their stream ends, and RAM placements
        # (one background worker, a backlog of promotions from disk hits) drain.
        wait_for(lambda: c.stats().read_pins == 0, "every read pin to be released")
        wait_for(lambda: ram_settled(c, d), "the RAM tier to settle", timeout=30)
        stats = c.stats()
        n = Counter(dict(stats.counters))
        entries = c.list_entries()
        tiers = {t.tier: t for t in stats.tiers}
        bad = [r.key.hex() for r in c.verify() if not r.ok]
    peak_rss = max(peak_rss, rss_bytes(pid))
    saves = total.saves
    calls = sum(n for op, n in total.ops.items() if not op.endswith("_done"))
    print(f"\n[load] {N_CLIENTS} clients, {elapsed:.1f} s: {calls} calls "
          f"({total.ops['lookup']} lookups, {total.lookup_hits} hits; "
          f"{total.ops['save']} saves: {saves['saved']} saved, "
          f"{saves['already_present']} already present, {saves['in_flight']} in flight, "
          f"{total.statuses['save:RESOURCE_EXHAUSTED']} refused; "
          f"{total.ops['load']} loads, {total.loads_ok} ok; {total.ops['pin_done']} pins; "
          f"{total.ops['unpin_done']} unpins; {total.ops['delete']} deletes; "
          f"{total.ops['prune']} prunes removing {total.pruned}; "
          f"{total.ops['inspect']} inspects; {total.ops['verify']} verifies); "
          f"evictions disk {n['evictions_disk']}, ram {n['evictions_ram']}; expected "
          f"statuses {dict(total.statuses)}; daemon peak RSS {peak_rss / 2**20:.0f} MiB")

    # The counters agree with what the clients saw.
    assert n["lookups"] == total.ops["lookup"]
    assert n["lookup_hits"] == total.lookup_hits
    assert n["reserves"] == total.ops["save"]
    assert n["saves_committed"] == saves["saved"]
    assert n["saves_duplicate_present"] == saves["already_present"]
    assert n["saves_duplicate_in_flight"] == saves["in_flight"]
    assert n["saves_refused_full"] == total.statuses["save:RESOURCE_EXHAUSTED"]
    assert n["pins"] == total.ops["pin_done"]
    assert n["unpins"] == total.ops["unpin_done"]
    assert n["deletes"] == total.ops["delete"] - total.statuses["delete:NOT_FOUND"] \
        - total.statuses["delete:FAILED_PRECONDITION"]
    assert n["prune_removed"] == total.pruned
    assert n["reads"] == total.loads_ok
    assert n["read_misses"] + n["read_wait_timeouts"] + n["read_wait_aborted"] \
        == total.loads_failed
    assert n["saves_aborted"] == n["leases_expired"] == n["saves_invalid"] == 0, n
    assert n["corrupt_blobs"] == n["read_pins_expired"] == 0, n
    # Every committed entry is still there or was removed by exactly one counted path.
    assert len(entries) == saves["saved"] - n["evictions_disk"] - n["deletes"] \
        - n["prune_removed"]
    # Budgets, and the accounting against the index and the files.
    disk, ram = tiers[pb.TIER_DISK], tiers[pb.TIER_RAM]
    assert disk.bytes <= DISK_BUDGET and ram.bytes <= RAM_BUDGET
    assert disk.bytes == sum(e.size for e in entries) == sum(
        p.stat().st_size for p in (d.data_dir / "blobs").rglob("*.kvc"))
    in_ram = [e for e in entries if pb.TIER_RAM in e.tiers]
    assert ram.bytes == sum(e.size for e in in_ram) == sum(
        p.stat().st_size for p in d.ram_dir.glob("*.kvc"))
    assert disk.entries == len(entries) and ram.entries == len(in_ram)
    assert stats.in_flight == 0 and stats.read_pins == 0 and disk.reserved_bytes == 0
    assert not any(e.pinned for e in entries), "a pin outlived its owner's unpin"
    assert bad == []
    assert sorted(str(p) for p in d.data_dir.rglob("*.part")) == []
    assert not list(Path(d.ram_dir).glob("*.part"))
    # The mix really happened.
    assert n["evictions_disk"] > 0 and n["evictions_ram"] > 0, n
    assert saves["saved"] > 50 and total.loads_ok > 100 and total.ops["pin_done"] > 10
    assert peak_rss < RSS_LIMIT, f"daemon RSS reached {peak_rss / 2**20:.0f} MiB"


# -- focused races found by the load above ---------------------------------------------------


def big_payload(tokens: list[int], size: int) -> bytes:
    return random.Random(keys.tokens_to_bytes(tokens)).randbytes(size)


def wait_until_open(pid: int, path: Path, timeout: float = 20.0) -> None:
    """Until the daemon has ``path`` open (it is reading it right now)."""
    target = str(path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return
    pytest.fail(f"the daemon never opened {path}")


def drop_from_page_cache(path: Path) -> None:
    """Make reading ``path`` slow (from the device): the window in which the daemon is
    reading it becomes long enough to land another call in, every time."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_verify_skips_entries_removed_while_it_runs(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """An entry evicted or deleted after Verify listed the entries is gone, not bad: it
    was reported "no such entry" and `kvcache verify` failed on any busy cache."""
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    assert d.proc is not None
    big = [[i + 1] * 20 for i in range(3)]  # 3 x 48 MiB to verify before the last entry
    with d.client() as c:
        for tokens in big:
            c.save(IDENT, tokens, big_payload(tokens, 48 << 20), "cold")
        first = min(key_of(t) for t in big)
        seed = 0
        while key_of(last := [9, seed]) < max(key_of(t) for t in big):
            seed += 1  # Verify goes in key order: this one comes after the big ones
        c.save(IDENT, last, payload_for(last), "cold")
        for tokens in big:
            drop_from_page_cache(blob_file(d, key_of(tokens)))
        results: list[pb.VerifyResult] = []
        verifying = threading.Thread(target=lambda: results.extend(c.verify()))
        verifying.start()
        wait_until_open(d.proc.pid, blob_file(d, first))  # Verify is at the first entry
        c.delete(key_of(last))
        verifying.join(timeout=60)
        assert not verifying.is_alive()
        assert [r.key.hex() for r in results if not r.ok] == [], \
            [(r.key.hex(), r.error) for r in results if not r.ok]
        assert {r.key for r in results} == {key_of(t) for t in big}
        assert Counter(dict(c.stats().counters))["corrupt_blobs"] == 0


def test_verify_holds_the_entry_it_checks(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """While Verify reads an entry's disk copy, a prune drops RAM copies: it used to drop
    this entry's too, and Verify, opening the RAM copy next, reported a good entry bad
    (and quarantined it). Now the entry is in use while checked, and prune leaves it."""
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "200M")
    assert d.proc is not None
    tokens = [5] * 20
    payload = big_payload(tokens, 96 << 20)  # its disk copy takes a while to read
    with d.client() as c:
        saved = c.save(IDENT, tokens, payload, "cold")
        wait_for(lambda: pb.TIER_RAM in c.list_entries()[0].tiers, "the RAM copy")
        drop_from_page_cache(blob_file(d, saved.key))
        results: list[pb.VerifyResult] = []
        verifying = threading.Thread(target=lambda: results.extend(c.verify()))
        verifying.start()
        wait_until_open(d.proc.pid, blob_file(d, saved.key))  # checking the disk copy
        c.prune(max_ram_bytes=1)
        verifying.join(timeout=60)
        assert not verifying.is_alive()
        assert [(r.ok, r.error) for r in results] == [(True, "")]
        n = Counter(dict(c.stats().counters))
        assert n["corrupt_blobs"] == n["quarantined_files"] == 0, n
        loaded = c.load(saved.key)
        assert loaded.tier == "ram" and bytes(loaded.payload[-4096:]) == payload[-4096:]


@pytest.mark.slow
def test_a_pin_is_never_lost_to_a_concurrent_eviction_prune_or_delete(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Pins race removals: savers evicting from a small budget, a pruner trimming the tier
    (its loop removes many entries, an fsync each) and deletes. An entry pinned OK must stay
    until unpinned. Pin did not take the lock removals decide under, so a pin landing
    between a removal's choice of entries and the removal was answered OK, then lost."""
    d = daemon_factory("--block-size", str(BLOCK), "--disk-bytes", "1M", "--ram-bytes", "0")
    stop = threading.Event()
    lost: list[str] = []
    errors: list[str] = []
    pins = Counter[str]()
    saved: list[list[bytes]] = [[] for _ in range(4)]  # per saver; pinned by its pinner only

    def expect(exc: CacheError, *codes: grpc.StatusCode) -> None:
        if exc.code not in codes:
            errors.append(repr(exc))

    def saver(i: int) -> None:
        with d.client(fast_path=i % 2 == 0) as c:
            j = 0
            while not stop.is_set():
                tokens = [100 + i, j, 7]
                j += 1
                try:
                    saved[i].append(c.save(IDENT, tokens, big_payload(tokens, 40_000),
                                           "cold").key)
                except CacheError as exc:  # everything left is pinned
                    expect(exc, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def pinner(i: int) -> None:
        with d.client() as c:
            while not stop.is_set():
                if len(saved[i]) < 3:
                    time.sleep(0.01)
                    continue
                key = saved[i][-3]  # an older entry: among the next to be removed
                try:
                    c.pin(key)
                except CacheError as exc:  # already removed
                    expect(exc, grpc.StatusCode.NOT_FOUND)
                    continue
                pins["done"] += 1
                time.sleep(0.02)  # removals decided before the pin finish meanwhile
                try:
                    c.inspect(key)
                except CacheError as exc:
                    lost.append(f"{key.hex()}: {exc}")
                c.unpin(key)

    def remover(i: int) -> None:
        rng = random.Random(i)
        with d.client() as c:
            while not stop.is_set():
                if i == 0:
                    c.prune(max_disk_bytes=500_000)
                    time.sleep(0.05)
                elif saved[rng.randrange(4)]:
                    try:
                        c.delete(rng.choice(saved[rng.randrange(4)][-10:] or [b"x" * 16]))
                    except CacheError as exc:
                        expect(exc, grpc.StatusCode.NOT_FOUND,
                               grpc.StatusCode.FAILED_PRECONDITION)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=pinner, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=remover, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(6.0)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert lost == [], f"{len(lost)} of {pins['done']} pinned entries were removed: {lost[:3]}"
    with d.client() as c:
        n = Counter(dict(c.stats().counters))
    assert n["pins"] == n["unpins"] == pins["done"] > 50, (n["pins"], pins)
