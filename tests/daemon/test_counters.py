"""Every declared counter: declared where it is counted, and moved by real traffic.

The declarations (kvcache/counters.py, model_runtime/counters.py) are checked against the
source in both directions, so the lists cannot rot. Then each counter is provoked
against real daemon processes (real LMDB, real files) and a real runtime on the tiny
model, and read back through a Prometheus scrape: every declared counter must be above
zero, except the few listed in ``*_EXCLUDED`` with the reason they cannot move.
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness.payloads import blob_bytes, payload_for
from harness.procs import REPO
from prometheus_client.parser import text_string_to_metric_families

from kvcache import blob as blobfmt
from kvcache import common, keys
from kvcache import counters as daemon_counters
from kvcache.client import CacheClient, CacheError, CacheUnavailable, CorruptBlob, Identity
from kvcache.metrics import LatencyWindows, percentile
from kvcache.v1 import kvcache_pb2 as pb
from model_runtime import counters as runtime_counters
from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion, RequestError, TokenEvent
from model_runtime.runtime import Runtime
from model_runtime.service import RuntimeService
from model_runtime.v1 import runtime_pb2 as runtime_pb
from tests.support.counter_uses import counter_uses
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, blob_file, flip_payload, ram_file, reserve, toks
from tests.support.entries import IDENT as RESERVE_IDENT  # the identity reserve() saves under
from tests.support.entries import write as write_chunk
from tests.support.metrics import scrape
from tests.support.runtime_calls import flush
from tests.support.runtime_proc import RuntimeProcess
from tests.support.tiny_llama import saves_held

# Declared counters the tests below cannot move, each with why. Anything not listed
# here must be above zero after the traffic.
DAEMON_EXCLUDED: dict[str, str] = {}  # none: every daemon counter is provoked
RUNTIME_EXCLUDED: dict[str, str] = {
    # The engine's fallback label for a loaded blob whose tier the daemon did not name.
    # The daemon names the tier of every read (OpenRead's tier, the first Read chunk's
    # tier), so this moves only if the daemon breaks its own contract.
    "restored_from_cache": "the daemon always names the tier of a read",
    # Counts exceptions escaping a model-thread step. Every expected failure (decode
    # errors, cache errors and outages, rejected or corrupt states, bad requests) is
    # handled where it happens, so only a bug reaches it; provoking it would take a fault
    # injected into the engine, which these tests do not do.
    "internal_errors": "only a bug in the engine reaches it",
    # Needs a daemon with a shared tier (a redis-server): provoked and asserted in
    # tests/remote/test_remote_daemon.py.
    "restored_from_remote": "provoked in tests/remote/test_remote_daemon.py",
    # This traffic holds every batch for its cache answer (resolve_wait_ms below); one
    # that comes after the batch is provoked (resolve_wait_ms 0) and asserted in
    # tests/runtime/test_runtime.py::test_a_new_request_s_cache_answer_is_waited_for_before_the_next_batch.
    "lookups_after_batch": "provoked in tests/runtime/test_runtime.py",
}


# --------------------------------------------------------------------------- declarations


@pytest.mark.parametrize("package, declared", [
    ("kvcache", daemon_counters.COUNTERS), ("model_runtime", runtime_counters.COUNTERS)])
def test_counters_used_are_declared_and_declared_are_used(package: str,
                                                          declared: dict[str, str]) -> None:
    files = sorted([*(REPO / package).glob("*.py"), *(REPO / package).glob("store/*.py"),
                    *(REPO / package).glob("service/*.py")])
    literals, patterns = counter_uses(files)
    assert len(literals) + len(patterns) >= 15, "the scan found almost nothing: is it broken?"
    undeclared = {name: where for name, where in literals.items() if name not in declared}
    assert not undeclared, f"counted but not declared in {package}/counters.py: {undeclared}"
    unmatched = {p: where for p, where in patterns.items()
                 if not any(re.fullmatch(p, name) for name in declared)}
    assert not unmatched, f"f-string counters matching no declared name: {unmatched}"
    unused = [name for name in declared if name not in literals
              and not any(re.fullmatch(p, name) for p in patterns)]
    assert not unused, f"declared in {package}/counters.py but never counted: {unused}"
    assert all(text.strip() for text in declared.values()), "every counter needs a help text"


def test_the_runtime_saves_with_blob_reasons_and_no_daemon_counter_is_in_two_sections() -> None:
    # Tier and hit-kind names have one definition (kvcache.common); the save reasons the
    # runtime counts must be ones the blob format accepts, or every such save is refused.
    assert set(common.RUNTIME_SAVE_REASONS) <= set(blobfmt.SAVE_REASONS)
    assert len(daemon_counters.COUNTERS) == sum(map(len, daemon_counters.SECTIONS.values()))


def test_percentiles_over_a_bounded_window() -> None:
    assert percentile([], 50) == 0.0
    ordered = [float(i) for i in range(1, 101)]
    assert (percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99)) == \
        (50.0, 90.0, 99.0)
    assert percentile([7.0], 99) == 7.0 and percentile([1.0, 2.0], 0) == 1.0
    windows = LatencyWindows(size=10)
    for ms in range(1, 31):  # only the last 10 samples (21..30 ms) count
        windows.observe("lookup", ms / 1000)
    s = windows.summaries()["lookup"]
    assert (s.count, s.window) == (30, 10)
    assert (s.p50_ms, s.p90_ms, s.p99_ms) == (25.0, 29.0, 30.0)


# --------------------------------------------------------------------------- scraping


def scrape_counters(port: int, prefix: str) -> tuple[dict[str, float], dict[str, str]]:
    """Counter values (from the shared scrape helper) and HELP texts, by counter name."""
    samples = scrape(port)
    values = {name[len(prefix) + 1 : -len("_total")]: value for name, value in samples.items()
              if name.startswith(prefix + "_") and name.endswith("_total")}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    docs = {f.name[len(prefix) + 1 :]: f.documentation
            for f in text_string_to_metric_families(text.decode()) if f.type == "counter"}
    return values, docs


def latest_metrics_port(d: DaemonProcess, starts: int) -> int:
    """The metrics port the ``starts``-th start of ``d`` logged (its log is appended to)."""
    pattern = r"metrics http://127\.0\.0\.1:(\d+)/metrics"
    wait_for(lambda: len(re.findall(pattern, d.log())) >= starts,
             "the daemon to log its metrics address")
    return int(re.findall(pattern, d.log())[starts - 1])


def assert_all_moved(values: dict[str, float], declared: dict[str, str],
                     excluded: dict[str, str]) -> None:
    assert not set(excluded) - set(declared), "an excluded counter is not declared"
    missing = sorted(set(declared) - set(values))
    assert not missing, f"declared counters absent from the scrape: {missing}"
    still = sorted(n for n in declared if n not in excluded and values[n] <= 0)
    assert not still, f"counters that did not move: {still}"


# --------------------------------------------------------------------------- daemon

IDENT = Identity("fp-counters", {"type_k": "f16"}, model_name="counters.gguf")
# A tenant with quotas (see the daemon's arguments): room for two small entries on disk,
# for one in RAM.
QUOTA_IDENT = replace(IDENT, tenant="quota")


def in_ram(c: CacheClient, key: bytes) -> bool:
    return key in {e.key for e in c.list_entries(tier="ram")}


def counter(c: CacheClient, name: str) -> int:
    return int(c.stats().counters[name])


def test_every_daemon_counter_moves(tmp_path: Path) -> None:
    # A 2 KB RAM tier holds a few small blobs (placing more evicts) and never the
    # 4 KB-payload one; leases and read pins expire within the test.
    d = DaemonProcess(tmp_path / "data", "--block-size", str(BLOCK), "--lease-seconds", "3",
                      "--pin-seconds", "1", "--ram-bytes", "2000", "--disk-bytes", "30000",
                      "--metrics-port", "0", "--max-saves-per-tenant", "8",
                      "--max-reserved-bytes-per-tenant", "200000",
                      "--max-pinned-bytes-per-tenant", "1000",
                      "--tenant-disk-quota", "quota=1500", "--tenant-ram-quota", "quota=1000")
    try:
        _daemon_traffic(d)
    finally:
        d.close()


def _daemon_traffic(d: DaemonProcess) -> None:
    # First life: an entry whose file goes missing while the daemon is down.
    d.start()
    with d.client() as c:
        lost = c.save(IDENT, toks(1, 20), payload_for(toks(1, 20), 300), "cold")
    d.stop()
    # Start-up work for the second life.
    blob_file(d, lost.key).unlink()  # index row without its file: reconcile_removed
    (d.data_dir / "tmp" / ("ab" * 16 + ".part")).write_bytes(b"half a blob")  # orphans_swept
    junk = d.data_dir / "blobs" / "zz"
    junk.mkdir()
    (junk / "not-a-key.kvc").write_bytes(b"junk")  # quarantined_files
    # A valid blob the index does not know (a lost index row, or a blob copied in from
    # another daemon's directory): reconcile_added.
    stray = toks(2, 20)
    stray_path = blob_file(d, keys.entry_key(IDENT.namespace, stray, BLOCK).key)
    stray_path.parent.mkdir(exist_ok=True)
    stray_path.write_bytes(blob_bytes(IDENT, stray, payload_for(stray, 300), "manual"))
    d.start()
    port = latest_metrics_port(d, 2)
    c = d.client()
    s = d.client(fast_path=False)  # the streaming path, as a remote client uses
    try:
        # Expiries run in the background while the rest happens.
        expiring = reserve(c, toks(3, 20), 900)  # never written: leases_expired
        assert expiring.status == pb.ReserveResponse.GRANTED

        # Lookups: exact (also when max_tokens cuts the request), partial, miss.
        a = toks(10, 40)
        saved_a = c.save(IDENT, a, payload_for(a, 300), "cold")
        # The data path's expiring pins: one taken (tenant_pins), and one more than the
        # tenant's pins may hold (690 bytes each, 1000 at most: tenant_pins_refused). Both
        # entries go again (their pinned RAM copy would keep later ones out of RAM).
        held_by_pins = [c.save(IDENT, t, payload_for(t, 300), "cold").key
                        for t in (toks(13, 40), toks(14, 40))]
        c.pin_tenant_entry(held_by_pins[0], 60)
        with pytest.raises(CacheError) as over:
            c.pin_tenant_entry(held_by_pins[1], 60)
        assert over.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.unpin(held_by_pins[0])
        for key in held_by_pins:
            c.delete(key)
        brief = toks(12, 40)  # pinned for half a second, released by time: pins_expired
        c.pin(c.save(IDENT, brief, payload_for(brief, 300), "cold").key, ttl_seconds=0.5)
        assert c.lookup(IDENT, a).matched_tokens == 40  # type: ignore[union-attr]
        assert c.lookup(IDENT, a + [5, 6], max_tokens=40).matched_tokens == 40  # type: ignore[union-attr]
        assert c.lookup(IDENT, a + [5, 6]).matched_tokens == 40  # type: ignore[union-attr]
        assert c.lookup(IDENT, toks(11, 40)) is None
        got = c.stats().counters
        assert (got["lookup_hits_exact"], got["lookup_hits_partial"], got["lookup_misses"]) \
            == (2, 1, 1)

        # Saves of every reason; a duplicate of a published key.
        for i, reason in enumerate(blobfmt.SAVE_REASONS):
            t = toks(20 + i, 20)
            assert c.save(IDENT, t, payload_for(t, 300), reason).status == "saved"
        assert c.save(IDENT, a, payload_for(a, 300), "cold").status == "already_present"
        c.prune(reason="evict")  # prune_removed
        aborted = reserve(c, toks(4, 20), 900)
        c.stub.Abort(pb.AbortRequest(lease_id=aborted.lease_id), timeout=10)  # saves_aborted

        # A key in flight: a duplicate reservation, waiting reads that time out and
        # that see the save aborted, a read of a missing key.
        b = toks(30, 20)
        b_size = len(blob_bytes(IDENT, b, payload_for(b, 300)))
        lease_b = reserve(c, b, b_size)
        assert reserve(c, b, b_size).status == pb.ReserveResponse.IN_FLIGHT
        with pytest.raises(CacheUnavailable):  # DEADLINE_EXCEEDED: still being written
            s.load(lease_b.key, wait_ms=100)
        waited: list[BaseException] = []

        def wait_for_b() -> None:
            try:
                s.load(lease_b.key, wait_ms=20_000)
            except CacheError as exc:
                waited.append(exc)

        # A save's lookup waits for another writer's save of a longer shared prefix:
        # it gives up after its wait (lookups_in_flight_timeout), or sees it dropped.
        assert c.lookup_before_save(RESERVE_IDENT, b + [9], wait_in_flight_ms=50) == (None, 20)
        before_save: list[tuple[object, int]] = []
        looker = threading.Thread(target=lambda: before_save.append(
            c.lookup_before_save(RESERVE_IDENT, b + [9], wait_in_flight_ms=20_000)))
        looker.start()
        reader = threading.Thread(target=wait_for_b)
        reader.start()
        wait_for(lambda: counter(c, "read_waits") >= 2, "the second read to wait")
        wait_for(lambda: c.stats().waiting_lookups >= 1, "the save's lookup to wait")
        # If a stalled machine let the lease expire first, the reader sees the same abort.
        with contextlib.suppress(grpc.RpcError):
            c.stub.Abort(pb.AbortRequest(lease_id=lease_b.lease_id), timeout=10)
        reader.join(30)
        looker.join(30)
        assert waited and "aborted" in str(waited[0]), waited
        assert before_save == [(None, 0)]  # lookups_waited_in_flight
        with pytest.raises(CacheError):
            c.load(bytes(16))  # read_misses

        # A local write of garbage is refused at commit; a stream that stops short.
        e = toks(40, 20)
        e_size = len(blob_bytes(IDENT, e, payload_for(e, 300)))
        lease_e = reserve(c, e, e_size)
        Path(lease_e.local_path).write_bytes(b"\0" * e_size)
        with pytest.raises(grpc.RpcError) as refused:
            c.stub.Commit(pb.CommitRequest(lease_id=lease_e.lease_id, local_write=True),
                          timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # saves_invalid
        f = toks(41, 20)
        f_blob = blob_bytes(IDENT, f, payload_for(f, 300))
        lease_f = reserve(c, f, len(f_blob))
        with pytest.raises(grpc.RpcError) as short:
            write_chunk(c, lease_f.lease_id, f_blob[: len(f_blob) // 2])
        assert "ended after" in str(short.value.details())  # saves_disconnected
        with pytest.raises(grpc.RpcError) as full:
            reserve(c, toks(42, 20), 100_000)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # saves_refused_full
        held = []
        with pytest.raises(grpc.RpcError) as capped:  # saves_refused_tenant_limit
            for i in range(9):
                held.append(reserve(c, toks(43 + i, 20), 500))
        assert "--max-saves-per-tenant" in str(capped.value.details())
        for lease in held:
            c.stub.Abort(pb.AbortRequest(lease_id=lease.lease_id), timeout=10)

        # Reads from both tiers over both paths. A fresh small entry is placed in RAM
        # (placements of the entries above have already evicted each other there).
        r = toks(50, 20)
        saved_r = c.save(IDENT, r, payload_for(r, 300), "cold")
        wait_for(lambda: in_ram(c, saved_r.key), "the new entry to be placed in RAM")
        assert c.load(saved_r.key).tier == "ram" and s.load(saved_r.key).tier == "ram"
        c.prune(max_ram_bytes=1)  # prune_ram_dropped (before r is pinned below)
        # Two copies of 1,950 bytes in all: past the RAM tier's high watermark (95% of
        # 2,000), within its budget. The reclaimer drops the older one (reclaims_ram).
        # (Once the brief pin is gone: its copy would leave no room for them.)
        wait_for(lambda: counter(c, "pins_expired") >= 1, "the brief pin to end")
        x, y = toks(52, 20), toks(53, 20)
        small = len(blob_bytes(IDENT, y, payload_for(y, 300)))
        saved_x = c.save(IDENT, x, payload_for(x, 300 + 1950 - 2 * small), "cold")
        wait_for(lambda: in_ram(c, saved_x.key), "the first copy to be placed")
        saved_y = c.save(IDENT, y, payload_for(y, 300), "cold")
        wait_for(lambda: counter(c, "reclaims_ram") >= 1, "the reclaimer's RAM pass")
        wait_for(lambda: not in_ram(c, saved_x.key), "the older copy to be dropped")
        assert in_ram(c, saved_y.key)
        g = toks(51, 20)
        saved_g = c.save(IDENT, g, payload_for(g, 4000), "cold")  # too big for RAM
        assert c.load(saved_g.key).tier == "disk" and s.load(saved_g.key).tier == "disk"
        # A pin nobody releases (pin-seconds 1): read_pins_expired.
        c.stub.OpenRead(pb.OpenReadRequest(key=saved_r.key), timeout=10)
        # A corrupt blob is quarantined when read.
        flip_payload(blob_file(d, saved_g.key))
        with pytest.raises(CorruptBlob):
            c.load(saved_g.key)

        # Operator actions.
        c.pin(saved_a.key)
        c.unpin(saved_a.key)
        c.delete(saved_a.key)

        # A piece built on an entry (pieces_committed), one on a parent that is gone
        # (saves_parent_gone); deleting the parent takes its piece (dependents_removed).
        root = toks(60, 20)
        saved_root = c.save(IDENT, root, payload_for(root, 300), "cold")
        child = root + toks(61, 10)
        c.save(IDENT, child, payload_for(child, 100), "finish", parent=saved_root.key,
               base=20)
        with pytest.raises(CacheError) as gone:
            c.save(IDENT, child + [7], payload_for(child, 100), "finish", parent=bytes(16),
                   base=20)
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        # Refused while the daemon copies the new piece into RAM (a read): retried.
        removed: list[int] = []
        wait_for(lambda: delete_unless_read(c, saved_root.key, removed), "the root's delete")
        assert removed == [1]

        # The tenant with quotas: a third entry evicts its first from disk and its second
        # copy from RAM (evictions_quota_disk, evictions_quota_ram); an entry larger than
        # its disk quota is refused (saves_refused_quota). Reserving past the bound of
        # bytes in flight: saves_refused_reserved_bytes.
        quota_keys: list[bytes] = []
        for i in range(3):
            t = toks(70 + i, 20)
            quota_keys.append(c.save(QUOTA_IDENT, t, payload_for(t, 300), "cold").key)
            wait_for(lambda: in_ram(c, quota_keys[-1]), "the tenant's entry to be in RAM")
        with pytest.raises(CacheError) as over_quota:
            big = toks(73, 20)
            c.save(QUOTA_IDENT, big, payload_for(big, 4000), "cold")
        assert over_quota.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as bound:
            reserve(c, toks(74, 20), 300_000)
        assert "--max-reserved-bytes-per-tenant" in str(bound.value.details())

        # Fill the disk budget until older entries are evicted: past its high watermark
        # (95% of 30,000 bytes) the reclaimer gives them up (reclaims_disk).
        for i in range(60):
            t = toks(100 + i, 20)
            c.save(IDENT, t, payload_for(t, 1000), "cold")
            if counter(c, "evictions_disk"):
                break
        wait_for(lambda: counter(c, "reclaims_disk") >= 1, "the reclaimer's disk pass")
        # An entry larger than the room kept free (5%): the save evicts for itself
        # (evictions_disk_inline).
        big = toks(99, 20)
        c.save(IDENT, big, payload_for(big, 4000), "cold")

        declared = daemon_counters.COUNTERS

        # Expiries and RAM placements happen in the background: give them time, then let
        # the assertion name whatever did not move.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                scrape_counters(port, "kvcache")[0].get(n, 0) > 0
                for n in declared if n not in DAEMON_EXCLUDED):
            time.sleep(0.1)
        values, docs = scrape_counters(port, "kvcache")
        assert_all_moved(values, declared, DAEMON_EXCLUDED)
        assert {n: docs[n] for n in declared} == declared, "HELP is the declared help text"
    finally:
        c.close()
        s.close()


# --------------------------------------------------------------------------- runtime

CONFIG = RuntimeConfig(n_ctx=8192, n_batch=512, n_seq_max=2, n_threads=1, prefill_chunk=512,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       shutdown_deadline_s=10.0, in_flight_wait_ms=100,
                       reuse_live=False,  # these tests follow the daemon path
                       # A new request's cache answer is waited for (lookups_awaited)
                       # even when a loaded machine makes its lookup slower than 4 ms.
                       resolve_wait_ms=2_000)


def tokens(seed: int, n: int) -> list[int]:
    """A prompt of its own: ordinary vocabulary ids (the tiny model has ~400)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(n)]


def first_event(stream: object) -> None:
    assert isinstance(next(stream), TokenEvent)  # type: ignore[call-overload]


def test_every_runtime_counter_moves(tmp_path: Path, tiny_model_no_eog: Path) -> None:
    # Generation never ends early on this model, so every request's length is known.
    # The disk budget is far above every state here but the one 7,000-token prompt's.
    d = DaemonProcess(tmp_path / "data", "--disk-bytes", "1500K")
    d.start()
    try:
        values_main = _runtime_traffic(d, tiny_model_no_eog)
        values_wrong = _misdirected_runtime_traffic(d, tiny_model_no_eog, tmp_path)
        values_down = _runtime_outage_traffic(d, tiny_model_no_eog)
    finally:
        d.close()
    declared = runtime_counters.COUNTERS
    values = {n: max(v[0].get(n, 0) for v in (values_main, values_wrong, values_down))
              for n in declared}
    assert_all_moved(values, declared, RUNTIME_EXCLUDED)
    assert {n: values_main[1][n] for n in declared} == declared, "HELP is the declared text"


def _runtime_traffic(d: DaemonProcess, model: Path) -> tuple[dict[str, float], dict[str, str]]:
    rt = Runtime(model, cache_address=d.address, config=CONFIG)
    c = d.client()
    try:
        port = rt.metrics.serve(0)
        before, _ = scrape_counters(port, "model_runtime")
        assert set(before) == set(runtime_counters.COUNTERS), "zeros are reported too"

        def key(t: list[int]) -> bytes:
            return rt.engine.key_of(t)

        # cold (saves cold@64 and finish), then exact from the RAM tier, then partial
        # from the disk tier (RAM copies pruned first).
        p1 = tokens(1, 100)
        first = rt.complete(tokens=p1, max_tokens=4)
        assert first.cache_hit_kind == "cold"
        flush(rt)
        wait_for(lambda: in_ram(c, key(p1[:64])), "the cold save to be placed in RAM")
        exact = rt.complete(tokens=p1[:64], max_tokens=4)
        assert (exact.cache_hit_kind, exact.cache_tier) == ("exact", "ram")
        c.prune(max_ram_bytes=1)
        longer = p1 + tokens(2, 20)
        partial = rt.complete(tokens=longer, max_tokens=4)
        assert (partial.cache_hit_kind, partial.cache_tier) == ("partial", "disk")
        flush(rt)
        # The same request again generates the same tokens: its finish state is present.
        again = rt.complete(tokens=longer, max_tokens=4)
        assert again.tokens == partial.tokens
        flush(rt)
        assert rt.stats()["saves_skipped_already_present"] >= 1
        # A cache_control breakpoint with a ttl: its entry saved, then pinned (pins_sent);
        # a pin of an entry the daemon does not have is refused (pins_failed).
        marked = rt.complete(prompt="A breakpoint with a ttl. " * 12, boundary_chars=[200],
                             boundary_ttl_seconds=[60], max_tokens=2)
        assert marked.cache_hit_kind == "cold"
        flush(rt)  # the saves; the pin queued behind them is sent just after
        wait_for(lambda: rt.stats()["pins_sent"] >= 1, "the daemon to take the pin")
        rt.engine.saver.pin(bytes(16), 60, "")
        wait_for(lambda: rt.stats()["pins_failed"] >= 1, "the daemon to refuse the pin")
        # sticky, then parent keys: one that resumes, one that is unknown.
        p2 = tokens(4, 50)
        s1 = rt.complete(tokens=p2, max_tokens=4, session_id="s1")
        s1_next = p2 + s1.tokens + tokens(5, 10)
        s1_done = rt.complete(tokens=s1_next, max_tokens=4, session_id="s1")
        assert s1_done.cache_hit_kind == "sticky"
        flush(rt)
        # A prediction of the reply drafts its tokens and has them taken.
        predicted = rt.complete(tokens=tokens(17, 30), max_tokens=6,
                                prediction=rt.complete(tokens=tokens(17, 30),
                                                       max_tokens=6).tokens)
        assert predicted.accepted_tokens >= 1
        resumed = rt.complete(tokens=p1 + first.tokens + tokens(6, 10), max_tokens=4,
                              parent_key=first.finish_key)
        assert resumed.cache_delta["tokens_read"] == 103
        rt.complete(tokens=tokens(7, 40), max_tokens=4, parent_key="ab" * 16)

        # Sessions outnumber sequences. Session a's request is cancelled mid-decode, so
        # its live state is newer than anything saved (no continued saves here): evicting
        # it saves it (evict).
        stream = rt.complete(tokens=tokens(8, 60), max_tokens=5000, session_id="a",
                             stream=True)
        first_event(stream)
        stream.close()  # type: ignore[union-attr]
        rt.complete(tokens=tokens(9, 40), max_tokens=4, session_id="b")  # evicts s1
        rt.complete(tokens=tokens(10, 40), max_tokens=4, session_id="c")  # evicts a
        flush(rt)
        (evicted,) = c.list_entries(reason="evict")
        a_tokens = list(c.inspect(evicted.key).tokens)
        back = rt.complete(tokens=a_tokens + tokens(11, 10), max_tokens=4, session_id="a")
        assert back.cache_delta["tokens_read"] == len(a_tokens)  # resolved_by_session
        # Session s1's last state is gone from the cache: its key is unusable.
        s1_tokens = list(c.inspect(bytes.fromhex(s1_done.finish_key)).tokens)
        c.delete(bytes.fromhex(s1_done.finish_key))
        rt.complete(tokens=s1_tokens + tokens(12, 10), max_tokens=4, session_id="s1")

        # Both sequences busy: the session's next request fails (sticky_busy), another
        # request waits for a sequence.
        x = rt.complete(tokens=tokens(13, 40), max_tokens=5000, session_id="x", stream=True)
        y = rt.complete(tokens=tokens(14, 40), max_tokens=5000, stream=True)
        first_event(x)
        first_event(y)
        with pytest.raises(RequestError) as busy:
            rt.complete(tokens=tokens(15, 40), max_tokens=4, session_id="x")
        assert busy.value.code == "sticky_busy"
        waiting = rt.complete(tokens=tokens(16, 40), max_tokens=4, stream=True)
        wait_for(lambda: rt.stats()["admission_waits"] >= 1, "a request to wait")
        x.close()  # type: ignore[union-attr]
        y.close()  # type: ignore[union-attr]
        assert isinstance(list(waiting)[-1], Completion)  # type: ignore[call-overload]

        # Two choices that end at their first token: their prompt, copied to the second
        # sequence only by the next decode, can be neither saved from nor restored into
        # either sequence before it (the next request computes its prompt instead).
        p9 = tokens(41, 45)
        assert len(rt.complete(tokens=p9, max_tokens=1, n=2)) == 2  # type: ignore[arg-type]
        assert rt.stats()["saves_skipped_copy_pending"] == 2
        flush(rt)
        assert rt.complete(tokens=p9, max_tokens=1).cache_hit_kind == "cold"
        assert rt.stats()["restores_skipped_copy_pending"] == 1

        # A state llama.cpp rejects, filed under a valid key: restore_failed, and the
        # runtime deletes it.
        # Another reader holds it meanwhile: the daemon refuses the delete until it is
        # released, and the runtime must not give up (it did, and the state stayed).
        p3 = tokens(17, 100)
        rejected = c.save(rt.identity, p3[:64], b"\0" * 4096, "cold")
        pin = c.stub.OpenRead(pb.OpenReadRequest(key=rejected.key), timeout=10)
        assert rt.complete(tokens=p3, max_tokens=4).cache_hit_kind == "cold"
        time.sleep(0.1)
        c.stub.ReleaseRead(pb.ReleaseReadRequest(pin_id=pin.pin_id), timeout=10)
        wait_for(lambda: rt.stats()["rejected_states_deleted"] >= 1, "the rejected state's delete")
        assert rejected.key not in {e.key for e in c.list_entries()}

        # A corrupt blob (both copies flipped): quarantined, the request goes cold. (The
        # finish state, which holds the whole prompt too, is deleted first.)
        p4 = tokens(18, 100)
        done4 = rt.complete(tokens=p4, max_tokens=4)
        flush(rt)
        wait_for(lambda: in_ram(c, key(p4[:64])), "the cold save to be placed in RAM")
        finish4 = bytes.fromhex(done4.finish_key)
        wait_for(lambda: in_ram(c, finish4), "the finish save to be placed in RAM")
        c.delete(finish4)
        flip_payload(blob_file(d, key(p4[:64])))
        flip_payload(ram_file(d, key(p4[:64])))
        assert rt.complete(tokens=p4, max_tokens=4).cache_hit_kind == "cold"

        # The key of the coming cold save is being written by someone else: skipped.
        p7 = tokens(21, 100)
        with another_writer_saving(c, rt.identity, p7[:64]):
            rt.complete(tokens=p7, max_tokens=4)
            flush(rt)
        assert rt.stats()["saves_skipped_in_flight"] >= 1

        # A longer state sharing the coming saves' tokens is being written by someone
        # else for longer than the saver waits: its saves are dropped.
        p8 = tokens(23, 100)
        with another_writer_saving(c, rt.identity, p8 + [7]):
            rt.complete(tokens=p8, max_tokens=4)
            flush(rt)
        assert rt.stats()["saves_dropped_in_flight_prefix"] >= 1

        # The parent a save builds on is deleted between its lookup and its reserve
        # (as an eviction could): stored whole instead (saves_parent_gone).
        p9 = tokens(26, 100)
        rt.engine.saver.client = ParentVanishes(d.address)
        try:
            rt.complete(tokens=p9, max_tokens=4)  # cold@64, then finish built on it
            flush(rt)
        finally:
            rt.engine.saver.client.close()
            rt.engine.saver.client = rt.engine.cache
        assert rt.stats()["saves_parent_gone"] == 1

        # The previous turn's finish save is still queued in the runtime when the next
        # turn comes, and no live sequence serves it (reuse_live is off here): the
        # lookup waits for that save (lookups_waited_own_save) and restores from it.
        p10 = tokens(27, 80)
        config = rt.engine.config
        rt.engine.config = replace(config, session_resume_wait_ms=10_000)  # a loaded machine
        with saves_held(rt.engine.saver) as gate:
            turn = rt.complete(tokens=p10, max_tokens=4)
            threading.Timer(0.3, gate.set).start()
            next_turn = rt.complete(tokens=p10 + turn.tokens + tokens(28, 10), max_tokens=4)
        assert next_turn.cache_delta["tokens_read"] == len(p10) + len(turn.tokens) - 1
        rt.engine.config = config

        # A state bigger than the daemon's whole disk budget is refused.
        rt.complete(tokens=tokens(22, 7000), max_tokens=2)
        flush(rt)
        assert rt.stats()["saves_failed"] >= 1

        # From here on finished sequences keep their KV: a prompt that extends the last
        # one is served by that sequence in place (live_reuses).
        rt.engine.config = replace(rt.engine.config, reuse_live=True)
        p8 = tokens(24, 50)
        done = rt.complete(tokens=p8, max_tokens=4)
        live = rt.complete(tokens=p8 + done.tokens + tokens(25, 5), max_tokens=4)
        assert (live.cache_hit_kind, live.cache_tier) == ("partial", "live")

        # Latencies: Prometheus histograms per hit kind, tier and save reason, and recent
        # percentiles in the runtime's stats (as its Stats RPC answers them).
        m = scrape(port)
        assert m['model_runtime_ttft_seconds_count{hit_kind="sticky"}'] >= 1
        assert m['model_runtime_restore_tier_seconds_count{tier="ram"}'] >= 1
        assert m['model_runtime_restore_tier_seconds_count{tier="disk"}'] >= 1
        assert m['model_runtime_save_seconds_count{reason="evict"}'] >= 1
        answer = RuntimeService(rt).Stats(runtime_pb.RuntimeStatsRequest(), None)
        assert answer.counters["hits_exact"] >= 1 and answer.counters["internal_errors"] == 0
        lat = answer.latencies
        assert {"ttft_cold", "ttft_exact", "ttft_partial", "ttft_sticky", "restore_ram",
                "restore_disk", "save_cold", "save_finish", "save_evict"} <= set(lat), lat
        assert lat["ttft_cold"].count == rt.stats()["hits_cold"]
        assert 0 < lat["save_cold"].p50_ms <= lat["save_cold"].p99_ms

        # Closing with a request mid-decode saves its state (shutdown).
        z = rt.complete(tokens=tokens(23, 40), max_tokens=5000, stream=True)
        first_event(z)
        rt.close()
        assert list(z)[-1].finish_reason == "shutdown"  # type: ignore[call-overload]
        return scrape_counters(port, "model_runtime")
    finally:
        rt.close()
        c.close()


@contextlib.contextmanager
def another_writer_saving(c: CacheClient, identity: Identity, tokens: list[int]
                          ) -> Iterator[None]:
    """A save of ``tokens`` reserved (and never written) by another writer meanwhile."""
    held = c.stub.Reserve(pb.ReserveRequest(identity=identity.message(), tokens=tokens,
                                            size=1000, reason="cold"), timeout=10)
    try:
        yield
    finally:
        c.stub.Abort(pb.AbortRequest(lease_id=held.lease_id), timeout=10)


def delete_unless_read(c: CacheClient, key: bytes, removed: list[int]) -> bool:
    """Delete ``key``; False while it (or what is built on it) is being read."""
    try:
        removed.append(c.delete(key))
    except CacheError as exc:
        if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return False
    return True


class ParentVanishes(CacheClient):
    """A real client whose first lookup that finds a stored prefix deletes it before
    answering: the save about to build on it finds its parent gone."""

    deleted = False

    def lookup_before_save(self, *args: Any, **kwargs: Any) -> Any:
        hit, in_flight = super().lookup_before_save(*args, **kwargs)
        if hit is not None and hit.matched_tokens >= CONFIG.min_save_tokens \
                and not self.deleted:
            self.deleted = True
            # Refused while the daemon copies the new entry into RAM (a read): retried.
            wait_for(lambda: self._deleted(hit.key), "the parent's delete", timeout=10)
        return hit, in_flight

    def _deleted(self, key: bytes) -> bool:
        try:
            self.delete(key)
        except CacheError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return False
        return True


def _misdirected_runtime_traffic(d: DaemonProcess, model: Path,
                                 tmp_path: Path) -> tuple[dict[str, float], dict[str, str]]:
    """A cache address that names a gRPC server but no kvcache daemon (here: another
    model runtime's socket). It answers every cache call with UNIMPLEMENTED: an error
    from a reachable server (cache_errors), not an outage; requests complete cold."""
    other = RuntimeProcess(model, d.address, tmp_path / "other-runtime.log").start()
    try:
        config = replace(CONFIG, n_seq_max=1)
        with Runtime(model, cache_address=other.address, config=config) as rt:
            port = rt.metrics.serve(0)
            assert rt.complete(tokens=tokens(40, 40), max_tokens=2).cache_hit_kind == "cold"
            assert rt.stats()["cache_errors"] >= 1
            return scrape_counters(port, "model_runtime")
    finally:
        other.close()


def _runtime_outage_traffic(d: DaemonProcess,
                            model: Path) -> tuple[dict[str, float], dict[str, str]]:
    """A slow daemon (stopped with SIGSTOP), then a gone one, then a shutdown past its
    deadline: one pending save at most, and no time to save at shutdown."""
    config = replace(CONFIG, n_seq_max=1, max_pending_saves=1, continued_interval=1,
                     shutdown_deadline_s=0.0, cache_timeout_s=0.5)
    rt = Runtime(model, cache_address=d.address, config=config)
    try:
        port = rt.metrics.serve(0)
        # Too short for a cold save: the only save is the continued one after the first
        # token, which the sender takes at once (the queue holds one). It also has the
        # runtime learn the daemon's block size, which keys need while it is stopped.
        rt.complete(tokens=tokens(30, 10), max_tokens=1)
        flush(rt)
        assert rt.stats()["saves_continued"] == 1
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        try:
            # The lookup times out (cache_unavailable); the first save blocks the sender,
            # the next one waits in its queue, the rest are dropped (backlog).
            rt.complete(tokens=tokens(31, 60), max_tokens=8)
            assert rt.stats()["saves_dropped_backlog"] >= 1
            # The queue is full, unless the sender's save timed out (cache_timeout_s) and it
            # took the queued one meanwhile: pins fill it again (each refused once sent).
            for _ in range(5):
                rt.engine.saver.pin(bytes(16), 60, "")
                if rt.stats()["pins_dropped"]:
                    break
            assert rt.stats()["pins_dropped"] == 1
        finally:
            d.proc.send_signal(signal.SIGCONT)
        flush(rt)
        d.stop()
        # Gone: the request completes cold, its saves are dropped.
        done = rt.complete(tokens=tokens(32, 40), max_tokens=2, session_id="z")
        assert done.cache_hit_kind == "cold"
        flush(rt)
        assert rt.stats()["saves_dropped_unavailable"] >= 1
        rt.close()  # deadline 0: session z's sequence is not saved
        assert rt.stats()["shutdown_saves_skipped"] >= 1
        return scrape_counters(port, "model_runtime")
    finally:
        rt.close()
