"""A full disk tier, for real: saves are refused with RESOURCE_EXHAUSTED before anything is
written, a disk that fills up *during* a save aborts it cleanly (same-host writes by the
client and streamed writes into the daemon, at write and at commit), reads go on, and the
daemon takes saves again once space frees, without a restart.

Part (a) mounts a tmpfs of a few MB as the daemon's data directory (we run as root in CI;
elsewhere it skips and says why). Part (b) covers the same behaviour without a mount: an
enforced ``--disk-bytes`` budget full of pinned entries, and a ``--min-free-bytes``
watermark set against the real free space of the test's filesystem, eaten by a real
filler file.

"Another process eats the space after the reservation" is staged with a gRPC client
interceptor on a real client: right after Reserve answers (or right before Commit), a
filler file takes the filesystem's free space. Daemon, files and ENOSPC are all real.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness.payloads import payload_for

from kvcache import keys
from kvcache.client import CacheClient, CacheError, Identity
from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, PATHS

IDENT = Identity("fp-full-disk", {"type_k": "f16"}, model_name="tiny.gguf")
MiB = 1 << 20
FS_BYTES = 8 * MiB  # the tmpfs
WATERMARK = 256 << 10  # --min-free-bytes on the tmpfs: headroom for the index to grow


# -- helpers --------------------------------------------------------------------------------


def toks(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 60_000) for _ in range(n)]


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0) -> Path:
    """A filler file eating the free space of ``path``'s filesystem down to ``leave``
    bytes (page granular). Unbuffered, so a failing write never resurfaces at close."""
    filler = path / f"filler-{random.randrange(1 << 30)}"
    with open(filler, "wb", buffering=0) as f:
        while (room := free_bytes(path) - leave) >= 4096:
            try:
                f.write(b"\0" * min(room, 1 << 20))
            except OSError:  # ENOSPC: full
                break
    return filler


class RunAround(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Runs ``action`` once, right before or right after the named RPC: another process
    changing the world between two steps of a real save."""

    def __init__(self, method: str, action: Callable[[], Any], *, before: bool) -> None:
        self.method = f"/{pb.DESCRIPTOR.services_by_name['KVCache'].full_name}/{method}"
        self.action = action
        self.before = before
        self.fired = False

    def _around(self, details: Any, call: Callable[[], Any]) -> Any:
        mine = details.method == self.method and not self.fired
        if mine and self.before:
            self.fired = True
            self.action()
        outcome = call()
        if mine and not self.before:
            outcome.result()  # only once it has answered
            self.fired = True
            self.action()
        return outcome

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._around(details, lambda: continuation(details, request))

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self._around(details, lambda: continuation(details, requests))


def intercepted(client: CacheClient, interceptor: RunAround) -> CacheClient:
    """The same client (same channel, same fast-path choice) with ``interceptor`` on."""
    client.stub = pb_grpc.KVCacheStub(grpc.intercept_channel(client.channel, interceptor))
    return client


def disk_tier(c: CacheClient) -> pb.TierStats:
    return [t for t in c.stats().tiers if t.tier == pb.TIER_DISK][0]


def snapshot(d: DaemonProcess) -> tuple[list[str], list[str]]:
    """(temp files anywhere in the data dir, published blob files)."""
    parts = sorted(p.name for p in d.data_dir.rglob("*.part"))
    blobs = sorted(p.name for p in (d.data_dir / "blobs").rglob("*.kvc"))
    return parts, blobs


def assert_nothing_left(d: DaemonProcess, c: CacheClient, blobs_before: list[str],
                        tokens: list[int]) -> None:
    """A refused or aborted save left no trace: no temp file, no blob file, no entry, no
    reservation."""
    parts, blobs = snapshot(d)
    assert parts == [], f"temp files left behind: {parts}"
    assert blobs == blobs_before, "a blob file of the failed save was left behind"
    stats = c.stats()
    assert stats.in_flight == 0, "the failed save's key is still in flight"
    assert disk_tier(c).reserved_bytes == 0
    assert c.lookup(IDENT, tokens) is None, "the failed save became visible"


def assert_refused(d: DaemonProcess, c: CacheClient, tokens: list[int], size: int,
                   *why: str) -> CacheError:
    """A save is refused up front with RESOURCE_EXHAUSTED, its message naming ``why``."""
    _, blobs = snapshot(d)
    err = pytest.raises(CacheError, c.save, IDENT, tokens, payload_for(tokens, size),
                        "cold").value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    for words in why:
        assert words in str(err), f"refusal does not mention {words!r}: {err}"
    assert_nothing_left(d, c, blobs, tokens)
    return err


def check_reads(clients: list[CacheClient], saved: dict[bytes, list[int]], size: int) -> None:
    """Every entry still loads, byte for byte, on both paths."""
    for c in clients:
        for key, tokens in saved.items():
            assert bytes(c.load(key).payload) == payload_for(tokens, size), \
                f"entry {key.hex()} changed ({'fast' if c.fast_path else 'stream'} path)"


def counters(c: CacheClient) -> Counter[str]:
    return Counter(dict(c.stats().counters))  # a counter never incremented reads 0


# -- (a) a real small filesystem ------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 8 MB tmpfs: the daemon's data directory (index, blobs, temp files)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; test_full_disk's part (b) covers the "
                    "refusals with an enforced budget and watermark instead")
    mnt = tmp_path / "data"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700",
                           "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); part (b) covers "
                    "the refusals with an enforced budget and watermark instead")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_daemon(small_fs: Path) -> Iterator[DaemonProcess]:
    """A daemon on the tmpfs whose budget (64 MB) the filesystem (8 MB) cannot hold, so
    the filesystem is what runs out. Its RAM tier, log and socket live elsewhere."""
    d = DaemonProcess(small_fs, "--block-size", str(BLOCK), "--disk-bytes", "64M",
                      "--min-free-bytes", str(WATERMARK))
    try:
        yield d.start()
    finally:
        d.close()  # SIGKILL: it must be gone before the filesystem is unmounted


@pytest.mark.parametrize("path", PATHS)
def test_disk_filling_after_the_reservation_aborts_the_write_cleanly(
        small_daemon: DaemonProcess, path: str) -> None:
    """Space granted at Reserve is gone when the bytes are written: the same-host client
    (writing the temp file itself) or the daemon (writing a stream) hits ENOSPC half-way.
    Either way the caller gets RESOURCE_EXHAUSTED naming the lack of space, the lease is
    aborted and nothing is left; deleting the filler makes the same save succeed."""
    d = small_daemon
    tokens = toks(1)
    size = 700_000  # under one 1 MiB stream chunk: a short write would be its last one
    fillers: list[Path] = []
    # 64 KiB stay free: the first write succeeds in part (a short write), the next fails.
    interceptor = RunAround("Reserve", lambda: fillers.append(fill(d.data_dir, 64 << 10)),
                            before=False)
    with d.client(fast_path=path == "fast") as c:
        # A cache that has been running a while: the index has free pages, so publishing
        # needs no new space and only the write itself can notice the full disk. (Here a
        # short last chunk used to be published as a truncated blob, answered "saved".)
        churn = [c.save(IDENT, toks(10 + i), payload_for(toks(10 + i), 1000), "cold").key
                 for i in range(5)]
        # The daemon's background RAM copy holds an entry, and a held one is not deleted.
        wait_for(lambda: set(churn) <= {e.key for e in c.list_entries(tier="ram")},
                 "the RAM copies")
        for key in churn:
            c.delete(key)
        old = toks(3)
        existing = {c.save(IDENT, old, payload_for(old, size), "cold").key: old}
        # Pinned: below its free-space watermark the daemon would otherwise evict it in
        # the background to free the disk, as it should; here it is what reads go on from.
        c.pin(next(iter(existing)))
        _, blobs_before = snapshot(d)
        intercepted(c, interceptor)
        err = pytest.raises(CacheError, c.save, IDENT, tokens, payload_for(tokens, size),
                            "cold").value
        assert interceptor.fired
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "space" in str(err).lower(), f"the error does not say what ran out: {err}"
        print(f"\n[ENOSPC during the {path} write] {err}")
        assert_nothing_left(d, c, blobs_before, tokens)
        assert counters(c)["saves_aborted"] == 1
        assert counters(c)["saves_committed"] == 6
        with CacheClient(d.address, fast_path=path != "fast") as other:
            check_reads([c, other], existing, size)  # the disk is still full: reads go on

        os.unlink(fillers[0])  # the space comes back: the very same save now succeeds
        saved = c.save(IDENT, tokens, payload_for(tokens, size), "cold")
        assert saved.status == "saved"
        assert bytes(c.load(saved.key).payload) == payload_for(tokens, size)
    with CacheClient(d.address) as other:
        assert all(r.ok for r in other.verify())


@pytest.mark.parametrize("path", PATHS)
def test_disk_full_at_commit_aborts_and_removes_the_blob(small_daemon: DaemonProcess,
                                                         path: str) -> None:
    """The blob is written, then the filesystem fills before Commit: publishing needs
    room in the index (a fresh LMDB file grows), so the commit fails with ENOSPC. The
    daemon answers RESOURCE_EXHAUSTED (not UNKNOWN), takes the renamed blob file back
    out and frees the key; once space frees, the save succeeds."""
    d = small_daemon
    tokens = toks(2)
    size = 300_000
    fillers: list[Path] = []
    interceptor = RunAround("Commit", lambda: fillers.append(fill(d.data_dir)), before=True)
    with d.client(fast_path=path == "fast") as c:
        _, blobs_before = snapshot(d)
        intercepted(c, interceptor)
        err = pytest.raises(CacheError, c.save, IDENT, tokens, payload_for(tokens, size),
                            "cold").value
        assert interceptor.fired
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "no space" in str(err) and "bytes free" in str(err), err
        print(f"\n[ENOSPC at the {path} commit] {err}")
        assert_nothing_left(d, c, blobs_before, tokens)
        assert counters(c)["saves_aborted"] == 1
        assert disk_tier(c).bytes == 0 and disk_tier(c).entries == 0

        os.unlink(fillers[0])
        saved = c.save(IDENT, tokens, payload_for(tokens, size), "cold")
        assert saved.status == "saved"
        assert bytes(c.load(saved.key).payload) == payload_for(tokens, size)
        assert disk_tier(c).bytes == saved.size


def test_filesystem_full_of_pinned_entries_refuses_reads_on_and_recovers(
        small_daemon: DaemonProcess) -> None:
    """Pinned 1 MiB saves fill the 8 MB filesystem (the 64 MB budget never binds): the
    next save on either path is refused up front, naming the free space and watermark;
    every entry still reads; unpinning and deleting three entries lets two saves in again
    (with two, the tier would sit within the reclaimer's 5% of what the watermark leaves
    it, and the reclaimer may rightly evict a new, unpinned entry before it is read)."""
    d = small_daemon
    size = MiB
    fast, stream = d.client(fast_path=True), d.client(fast_path=False)
    saved: dict[bytes, list[int]] = {}
    refusal: CacheError | None = None
    for i in range(20):
        tokens = toks(100 + i)
        c = (fast, stream)[i % 2]
        try:
            result = c.save(IDENT, tokens, payload_for(tokens, size), "cold")
        except CacheError as exc:
            refusal = exc
            break
        assert result.status == "saved"
        c.pin(result.key)  # not evictable: the space cannot be made by eviction
        saved[result.key] = tokens
    assert refusal is not None, "20 MiB of saves fit on an 8 MiB filesystem"
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
    assert 4 <= len(saved) <= 7, f"{len(saved)} MiB entries fit on the {FS_BYTES} B tmpfs"
    print(f"\n[full disk] {len(saved)} pinned 1 MiB entries filled the tmpfs; refused with "
          f"{refusal.code.name}: {refusal}")

    for i, c in enumerate((fast, stream)):
        assert_refused(d, c, toks(200 + i), size, "bytes free", "watermark", "hold only 0 bytes")
    # The watermark is kept: the daemon's own saves never took the last free bytes.
    assert free_bytes(d.data_dir) >= WATERMARK
    check_reads([fast, stream], saved, size)
    n = counters(fast)
    assert n["saves_refused_full"] == 3 and n["evictions_disk"] == 0, n
    assert disk_tier(fast).entries == len(saved)

    for key in list(saved)[:3]:  # space frees: no restart needed
        fast.unpin(key)
        fast.delete(key)
        del saved[key]
    for i, c in enumerate((fast, stream)):
        tokens = toks(300 + i)
        assert c.save(IDENT, tokens, payload_for(tokens, size), "cold").status == "saved"
        saved[keys.entry_key(IDENT.namespace, tokens, BLOCK).key] = tokens
    try:
        check_reads([fast, stream], saved, size)
    except CacheError as exc:  # (what the daemon did meanwhile: evictions, reclaims)
        raise AssertionError(f"{exc}; free {free_bytes(d.data_dir)} B; "
                             f"counters {counters(fast)}") from exc
    assert all(r.ok for r in fast.verify())
    assert snapshot(d)[0] == []
    fast.close()
    stream.close()


# -- (b) an enforced budget, and a watermark against real free space -------------------------


def test_disk_budget_full_of_pinned_entries_refuses_reads_on_and_recovers(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    size = 512 << 10
    d = daemon_factory("--block-size", str(BLOCK), "--disk-bytes", str(3 * size + size // 2))
    fast, stream = d.client(fast_path=True), d.client(fast_path=False)
    saved: dict[bytes, list[int]] = {}
    for i in range(3):
        tokens = toks(400 + i)
        result = (fast, stream)[i % 2].save(IDENT, tokens, payload_for(tokens, size), "cold")
        fast.pin(result.key)
        saved[result.key] = tokens
    for i, c in enumerate((fast, stream)):
        err = assert_refused(d, c, toks(500 + i), size, "budget", "bytes free")
    print(f"\n[disk budget] refused with {err.code.name}: {err}")
    check_reads([fast, stream], saved, size)
    n = counters(fast)
    assert n["saves_refused_full"] == 2 and n["evictions_disk"] == 0, n

    first = next(iter(saved))
    fast.unpin(first)
    fast.delete(first)
    del saved[first]
    tokens = toks(600)
    assert stream.save(IDENT, tokens, payload_for(tokens, size), "cold").status == "saved"
    # Full again, and now one entry is unpinned: it is evicted rather than refused.
    fast.unpin(next(iter(saved)))
    tokens = toks(601)
    assert fast.save(IDENT, tokens, payload_for(tokens, size), "cold").status == "saved"
    assert counters(fast)["evictions_disk"] == 1
    assert disk_tier(fast).bytes <= 3 * size + size // 2
    fast.close()
    stream.close()


def allocate(path: Path, size: int) -> None:
    """A real file taking ``size`` bytes of the filesystem now (not a sparse one)."""
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError:  # no fallocate here: write it
            block = b"\0" * MiB
            for _ in range(size // MiB):
                f.write(block)
        f.flush()
        os.fsync(f.fileno())


def test_watermark_against_real_free_space_refuses_then_recovers(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """``--min-free-bytes`` set so the daemon may use HEADROOM of the real filesystem; a
    filler file then takes far more than that: saves are refused (nothing evicted, since
    evicting everything would not reach the watermark), reads go on; deleting the filler
    lets saves in again. The margins are wide because the filesystem is shared with other
    work whose writes move its free space while we run."""
    headroom = 512 * MiB
    filler_bytes = headroom + 1536 * MiB
    if free_bytes(tmp_path) < filler_bytes + 2 * headroom:
        pytest.skip(f"needs {(filler_bytes + 2 * headroom) >> 20} MiB free in {tmp_path}")
    size = 256 << 10
    watermark = free_bytes(tmp_path) - headroom
    d = daemon_factory("--block-size", str(BLOCK), "--min-free-bytes", str(watermark),
                       "--ram-bytes", "0")
    fast, stream = d.client(fast_path=True), d.client(fast_path=False)
    saved: dict[bytes, list[int]] = {}
    for i in range(4):
        tokens = toks(700 + i)
        result = (fast, stream)[i % 2].save(IDENT, tokens, payload_for(tokens, size), "cold")
        assert result.status == "saved"
        saved[result.key] = tokens
    evictable = disk_tier(fast).bytes

    filler = tmp_path / "filler"
    allocate(filler, filler_bytes)
    try:
        for i, c in enumerate((fast, stream)):
            # Nothing is pinned, and the message says so: evicting would not be enough.
            err = assert_refused(d, c, toks(800 + i), size, "bytes free", "watermark",
                                 f"hold only {evictable} bytes")
        print(f"\n[watermark] refused with {err.code.name}: {err}")
        check_reads([fast, stream], saved, size)
        n = counters(fast)
        assert n["saves_refused_full"] == 2, n
        assert n["evictions_disk"] == 0, "entries were evicted for a save that was refused"
    finally:
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
    for i, c in enumerate((fast, stream)):
        tokens = toks(900 + i)
        assert c.save(IDENT, tokens, payload_for(tokens, size), "cold").status == "saved"
    check_reads([fast, stream], saved, size)
    fast.close()
    stream.close()

