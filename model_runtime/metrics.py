"""A runtime's Prometheus metrics: the engine's counters and gauges, and histograms of
its requests' phases, restores and saves, fed as they finish."""

from __future__ import annotations

from kvcache.common import TIER_LIVE
from kvcache.metrics import LatencyWindows, Metrics

from .counters import COUNTERS
from .engine import Engine
from .request import Completion

__all__ = ["runtime_metrics"]


def runtime_metrics(engine: Engine, windows: LatencyWindows | None = None) -> Metrics:
    """Engine counters (every declared one, zeros included) and gauges, latency
    histograms per hit kind, restores per tier, and save latencies per reason."""
    metrics = Metrics("model_runtime")
    metrics.describe_counters(COUNTERS)
    metrics.add_snapshot(engine.stats, engine.gauges)
    phases = {name: metrics.histogram(f"{name}_seconds", f"{name} per request", ("hit_kind",))
              for name in ("ttft", "restore", "prefill", "decode")}
    restore_tier = metrics.histogram("restore_tier_seconds",
                                     "Restore of a state, by the daemon tier it came from",
                                     ("tier",))
    windows = windows if windows is not None else LatencyWindows()

    def observe(c: Completion) -> None:
        for name, hist in phases.items():
            hist.labels(c.cache_hit_kind).observe(c.timings[f"{name}_ms"] / 1000)
        windows.observe(f"ttft_{c.cache_hit_kind}", c.timings["ttft_ms"] / 1000)
        if c.cache_tier and c.cache_tier != TIER_LIVE:  # a state restored from a tier
            restore_tier.labels(c.cache_tier).observe(c.timings["restore_ms"] / 1000)
            windows.observe(f"restore_{c.cache_tier}", c.timings["restore_ms"] / 1000)

    engine.observers.append(observe)
    state_get = metrics.histogram("state_get_seconds",
                                  "llama_state_seq_get_data on the model thread")
    engine.on_latency = lambda name, seconds: state_get.observe(seconds)
    save = metrics.histogram("save_seconds", "Reserve, write and commit of a published save",
                             ("reason",))

    def saved(reason: str, seconds: float) -> None:
        save.labels(reason).observe(seconds)
        windows.observe(f"save_{reason}", seconds)

    engine.saver.on_saved = saved
    return metrics
