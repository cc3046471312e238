"""The Prometheus endpoints of a real daemon and a real runtime, scraped and parsed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvcache.client import Identity
from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess
from tests.support.metrics import metrics_port, scrape

IDENT = Identity("fp-metrics", {"type_k": "f16"}, model_name="m")


def test_daemon_metrics_move_with_traffic(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory("--metrics-port", "0")
    port = metrics_port(d)
    before = scrape(port)
    assert before["kvcache_tier_entries{tier=\"disk\"}"] == 0
    with d.client() as c:
        tokens = list(range(300))
        assert c.lookup(IDENT, tokens) is None
        saved = c.save(IDENT, tokens, b"s" * 4000, "cold")
        assert c.save(IDENT, tokens, b"s" * 4000, "cold").status == "already_present"
        assert c.lookup(IDENT, tokens + [1]) is not None
        c.load(saved.key)
    after = scrape(port)
    assert after["kvcache_lookups_total"] == 2
    assert after["kvcache_lookup_hits_total"] == 1
    assert after["kvcache_lookup_misses_total"] == 1
    assert after["kvcache_saves_committed_cold_total"] == 1
    assert after["kvcache_saves_duplicate_total"] == 1
    assert after["kvcache_reads_total"] == 1
    assert after["kvcache_tier_entries{tier=\"disk\"}"] == 1
    assert after["kvcache_tier_bytes{tier=\"disk\"}"] == saved.size
    assert after["kvcache_lookup_seconds_count{result=\"hit\"}"] == 1
    assert after["kvcache_lookup_seconds_count{result=\"miss\"}"] == 1
    assert after["kvcache_commit_seconds_count{reason=\"cold\"}"] == 1
    assert sum(v for k, v in after.items() if k.startswith("kvcache_read_seconds_count")) == 1


def test_runtime_metrics_count_hit_kinds(daemon: DaemonProcess, tiny_model: Path) -> None:
    config = RuntimeConfig(n_ctx=1024, n_seq_max=2, n_threads=1, save_block=32,
                           min_save_tokens=8, trim=4, reuse_live=False)
    with Runtime(tiny_model, cache_address=daemon.address, config=config) as rt:
        port = rt.metrics.serve(0)
        prompt = "The metrics test prompt. " * 12
        first = rt.complete(prompt=prompt, max_tokens=4)
        assert rt.engine.saver.flush(30)
        second = rt.complete(prompt=prompt + "More.", max_tokens=4)
        assert (first.cache_hit_kind, second.cache_hit_kind) == ("cold", "partial")
        m = scrape(port)
    assert m["model_runtime_hits_cold_total"] == 1
    assert m["model_runtime_hits_partial_total"] == 1
    assert m["model_runtime_requests_completed_total"] == 2
    assert m["model_runtime_ttft_seconds_count{hit_kind=\"cold\"}"] == 1
    assert m["model_runtime_ttft_seconds_count{hit_kind=\"partial\"}"] == 1
    assert m["model_runtime_state_get_seconds_count"] >= 1
    assert m["model_runtime_sequences{state=\"free\"}"] == 2
