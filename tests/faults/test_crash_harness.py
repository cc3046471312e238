"""Crash anywhere: the kill -9 harness (``tools/crash_harness.py``) and runtimes killed in
the middle of a save.

A runtime is just a CacheClient user: here a separate Python process that reserves a
save, writes half of the blob and is SIGKILLed. Once its lease expires (or, for a stream,
once the daemon sees the writer gone) nothing of it may remain: no temp file, no
reservation, no reserved bytes, and the same tokens can be saved again. The streamed
writer alone is covered by test_daemon.py (test_writer_process_killed_mid_stream_...).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from crash_harness import CAMPAIGN_KILLS, CAMPAIGN_SECONDS, Settings, run
from harness.procs import pythonpath_env

from kvcache import keys
from kvcache.client import CacheClient, CacheError
from kvcache.v1 import kvcache_pb2 as pb
from tests.faults.test_daemon_crash import payload_for
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, IDENT, DaemonFactory, counters, leftovers, toks

# -- the harness ----------------------------------------------------------------------------


def run_and_remove(settings: Settings) -> dict[str, object]:
    """The harness's run. One that was not ok keeps its folders for inspection (in /tmp
    and /dev/shm); a test run removes them, leaving nothing behind. For a look, run the
    harness with the failure's seed and ``--keep``."""
    result = run(settings)
    if "kept" in result:
        subprocess.run(str(result["remove_with"]), shell=True, check=False)
    return result


def assert_nothing_lost(result: dict[str, object], seed: int, kills: int) -> None:
    summary = json.dumps({k: v for k, v in result.items() if k != "problems"})
    problems = "\n".join(result["problems"])  # type: ignore[arg-type]
    where = f"seed {seed} (folders removed: see run_and_remove)\n{summary}\n{problems}"
    assert result["kills"] >= kills and result["kills_under_load"] >= kills, where
    # Some restarted daemons were killed again while they checked index and files.
    assert result["kills_during_recovery"] > 0, where
    assert result["restart_failures"] == 0, where
    assert result["entries_lost"] == 0, where
    assert result["wrong_bytes_served"] == 0, where
    assert result["orphans_found"] == 0, where
    assert result["index_file_mismatches"] == 0 and result["unverified"] == 0, where
    assert result["entries_checked"] > 0 and result["saves_acknowledged"] > 0, where
    # Pieces were saved on acknowledged entries, and their chains checked after restarts.
    assert result["pieces_acknowledged"] > 0 and result["chains_checked"] > 0, where
    assert result["broken_chains"] == 0, where
    # Deletes and prunes were answered, and none of what they took came back.
    assert result["removals_acknowledged"] > 0 and result["resurrected"] == 0, where
    assert result["ok"], where
    assert "kept" not in result, where


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_hundred_kills_lose_nothing() -> None:
    """At least 100 SIGKILLs under saves (both paths), lookups, loads, pins, prunes,
    deletes; after every restart all that was acknowledged is there and whole, nothing
    whose removal was answered is back, and nothing else is off. ``seconds`` is only a
    safety net for a very slow machine (the run takes ~2 minutes on 2 shared cores): the
    assertions are about what survived, not how fast."""
    seed = random.randrange(1 << 31)
    assert_nothing_lost(run_and_remove(Settings(kills=100, seconds=900.0, seed=seed)), seed,
                        100)


@pytest.mark.slow
@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_SECONDS + 10 * 60)
def test_a_thousand_kills_lose_nothing_and_bring_nothing_back() -> None:
    """The campaign: 1,000 SIGKILLs, the kill phase bounded so that the run fits CI's
    90-minute budget. Only when asked (``pytest --campaign``): it takes tens of minutes."""
    seed = random.randrange(1 << 31)
    result = run_and_remove(Settings(kills=CAMPAIGN_KILLS, seconds=CAMPAIGN_SECONDS,
                                     seed=seed))
    assert_nothing_lost(result, seed, CAMPAIGN_KILLS)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kills_in_the_checks_and_the_reclaimers_passes_of_a_full_large_index() -> None:
    """The large-index mode (``--prefill``): 5,000 entries prefilled into a disk budget
    the run keeps full; every restart is killed again while it checks after the kill and
    pushed over its high watermark to be killed in the reclaimer's pass. Unpinned entries
    are evicted; no pinned one goes, no read returns other bytes, nothing pruned or
    deleted comes back."""
    seed = random.randrange(1 << 31)
    result = run_and_remove(Settings(kills=6, seconds=600.0, seed=seed, prefill=5_000,
                                     recovery_kill_p=1.0, reclaim_kill_p=1.0))
    where = f"seed {seed} (folders removed: see run_and_remove): {json.dumps(result)}"
    assert result["kills_during_recovery"] > 0 and result["kills_during_reclaim"] > 0, where
    prefill = result["prefill"]
    assert isinstance(prefill, dict) and prefill["pinned"] == 50, where
    assert 0 < prefill["left_at_end"] < 5_000 and prefill["checked"] > 0, where  # evicted
    assert result["entries_lost"] == 0 and result["pin_state_lost"] == 0, where
    assert result["wrong_bytes_served"] == 0 and result["resurrected"] == 0, where
    assert result["removals_acknowledged"] > 0, where
    assert result["index_file_mismatches"] == 0 and result["unverified"] == 0, where
    assert result["ok"] and "kept" not in result, where


def test_a_run_that_is_not_ok_keeps_its_folders_and_says_how_to_remove_them(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A real failure (a stray file planted among the blobs, which the daemon leaves
    alone and the harness reports): the work folder and the RAM tier stay for
    inspection, the output names them, and its command removes exactly them."""
    workdir = tmp_path / "w"
    blobs = workdir / "data" / "blobs"

    def plant() -> None:
        deadline = time.monotonic() + 60
        while not blobs.is_dir() and time.monotonic() < deadline:
            time.sleep(0.02)
        (blobs / "zz").mkdir(exist_ok=True)
        (blobs / "zz" / "stray.txt").write_text("not a blob")

    planter = threading.Thread(target=plant)
    planter.start()
    result = run(Settings(kills=1, seconds=120.0, seed=1, workdir=workdir))
    planter.join()
    assert not result["ok"]
    assert any("stray file" in p for p in result["problems"]), result["problems"]  # type: ignore[union-attr]
    kept = [Path(p) for p in result["kept"]]  # type: ignore[union-attr]
    assert workdir / "data" in kept and any(p.name.startswith("kvcrash-") for p in kept)
    assert all(p.exists() for p in kept)
    assert f"remove them with: {result['remove_with']}" in capfd.readouterr().err
    subprocess.run(str(result["remove_with"]), shell=True, check=True)
    assert not any(p.exists() for p in kept)
    assert not (workdir / "data").exists()


# -- a runtime killed mid-save --------------------------------------------------------------

# A stand-in runtime: reserve like CacheClient.save does, write half of the blob, report
# what it holds, then hang until it is killed. The streamed save then trickles a few bytes
# now and then: each chunk renews its lease, so it is still in flight however long the test
# takes to kill the writer, and never complete.
WRITER_SCRIPT = """
import json, os, threading, time
from kvcache import keys
from kvcache.client import CacheClient
from kvcache.v1 import kvcache_pb2 as pb
from harness.payloads import blob_bytes
from tests.faults.test_daemon_crash import payload_for
from tests.support.entries import IDENT

def reserve(c, tokens, data):
    lease = c.stub.Reserve(pb.ReserveRequest(
        identity=IDENT.message(), packed_tokens=keys.tokens_to_bytes(tokens), size=len(data),
        reason="cold"), timeout=10)
    assert lease.status == pb.ReserveResponse.GRANTED, lease
    return lease

held = {{}}
fast_tokens, stream_tokens = {fast!r}, {stream!r}
if fast_tokens:
    # Same-host fast path: the runtime writes the daemon's reserved temp file itself.
    data = blob_bytes(IDENT, fast_tokens, payload_for(fast_tokens))
    lease = reserve(CacheClient({address!r}, fast_path=True), fast_tokens, data)
    with open(lease.local_path, "r+b", buffering=0) as f:
        f.write(data[: len(data) // 2])
        held["fast"] = [lease.local_path, os.fstat(f.fileno()).st_size, len(data)]
if stream_tokens:
    c = CacheClient({address!r}, fast_path=False)
    data = blob_bytes(IDENT, stream_tokens, payload_for(stream_tokens))
    lease = reserve(c, stream_tokens, data)
    def chunks():
        offset = len(data) // 2
        yield pb.WriteChunk(lease_id=lease.lease_id, offset=0, data=data[:offset])
        while offset + 64 < len(data):
            time.sleep(0.1)
            yield pb.WriteChunk(lease_id=lease.lease_id, offset=offset,
                                data=data[offset : offset + 64])
            offset += 64
        time.sleep(600)
    threading.Thread(target=lambda: c.stub.Write(chunks(), timeout=600), daemon=True).start()
    held["stream"] = [lease.local_path, len(data) // 2, len(data)]
print(json.dumps(held), flush=True)
time.sleep(600)
"""


def start_writer(d: DaemonProcess, fast: list[int] | None = None,
                 stream: list[int] | None = None) -> tuple[subprocess.Popen[str],
                                                           dict[str, list]]:
    """The writer process and what it holds: per path [temp file, bytes written, size]."""
    script = WRITER_SCRIPT.format(address=d.address, fast=fast or [], stream=stream or [])
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=pythonpath_env())
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail("the writer process died before reserving")
    return proc, json.loads(line)


def disk_tier(c: CacheClient) -> pb.TierStats:
    return next(t for t in c.stats().tiers if t.tier == pb.TIER_DISK)


def assert_saves_again(c: CacheClient, tokens: list[int]) -> None:
    """The dead runtime's key is free: a new save is granted, commits and reads back."""
    saved = c.save(IDENT, tokens, payload_for(tokens), "cold")
    assert saved.status == "saved", f"a save of the dead writer's tokens got {saved.status}"
    hit = c.lookup(IDENT, tokens)
    assert hit is not None and (hit.key, hit.matched_tokens) == (saved.key, len(tokens))
    assert bytes(c.load(saved.key, prefix_of=tokens).payload) == payload_for(tokens)


def test_runtime_killed_mid_fast_path_save_leaves_nothing_after_its_lease(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--lease-seconds", "3")
    tokens = toks(7001, 40)
    key = keys.entry_key(IDENT.namespace, tokens, BLOCK).key
    waited: dict[str, object] = {}

    def wait_for_entry() -> None:
        # Another runtime waiting for the dead one's entry is answered when the lease
        # ends (or at once, if it already has), not after its own 30 s wait.
        with d.client(fast_path=True) as reader:
            try:
                waited["blob"] = reader.load(key, wait_ms=30_000)
            except CacheError as exc:
                waited["error"] = exc

    writer, held = start_writer(d, fast=tokens)
    path, written, size = held["fast"]
    tmp = Path(path)
    reader = threading.Thread(target=wait_for_entry)
    try:
        assert tmp.parent == d.data_dir / "tmp", f"the writer was given {tmp}"
        assert 0 < written < size, held
        reader.start()
    finally:
        writer.kill()  # SIGKILL mid-save: no Abort, no Commit, nothing closes cleanly
        writer.wait()

    with d.client(fast_path=True) as c:
        wait_for(lambda: not tmp.exists(), "the dead writer's temp file to go")
        wait_for(lambda: c.stats().in_flight == 0, "the reservation to go")
        reader.join(timeout=60)
        assert not reader.is_alive(), "a reader waiting on the dead writer's save hung"
        err = waited.get("error")
        assert isinstance(err, CacheError) and err.code == grpc.StatusCode.NOT_FOUND, waited
        assert disk_tier(c).reserved_bytes == 0
        n = counters(c)
        assert n.get("leases_expired") == 1, n
        assert n.get("saves_disconnected", 0) == 0, n  # a file writer has no stream to lose
        assert c.lookup(IDENT, tokens) is None, "half a blob became visible"
        assert leftovers(d) == []
        assert_saves_again(c, tokens)
        assert leftovers(d) == []


def test_runtime_killed_with_saves_in_flight_on_both_paths(
        daemon_factory: DaemonFactory) -> None:
    """One runtime, two saves half-written at once (its file and its stream): the stream
    is aborted as soon as the daemon sees the writer gone, the file when its lease ends."""
    # The trickled stream renews its lease every 0.1 s; 3 s leaves room for a stalled
    # writer, whose stream lease would otherwise expire and flip the counters below.
    d = daemon_factory("--block-size", str(BLOCK), "--lease-seconds", "3")
    fast_tokens, stream_tokens = toks(7002, 50), toks(7003, 33)
    writer, held = start_writer(d, fast=fast_tokens, stream=stream_tokens)
    tmps = [Path(held[p][0]) for p in ("fast", "stream")]
    try:
        assert 0 < held["fast"][1] < held["fast"][2], held
        wait_for(lambda: tmps[1].exists() and tmps[1].stat().st_size >= held["stream"][1],
                 "the streamed half to arrive")
    finally:
        writer.kill()
        writer.wait()
    with d.client() as c:
        wait_for(lambda: not any(t.exists() for t in tmps), "both temp files to go")
        wait_for(lambda: c.stats().in_flight == 0, "both reservations to go")
        assert disk_tier(c).reserved_bytes == 0
        n = counters(c)
        assert (n.get("saves_disconnected"), n.get("leases_expired")) == (1, 1), n
        assert c.lookup(IDENT, fast_tokens) is None and c.lookup(IDENT, stream_tokens) is None
        assert leftovers(d) == []
    # Both keys are free again, on either path.
    with d.client(fast_path=True) as fast, d.client(fast_path=False) as stream:
        assert_saves_again(fast, fast_tokens)
        assert_saves_again(stream, stream_tokens)
    assert leftovers(d) == []
