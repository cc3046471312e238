"""Prometheus metrics over HTTP (``--metrics-port``), for the daemon and the runtime.

Counters and sizes are read from their owners at scrape time (so there is one source of
truth, the same one ``stats`` shows); latencies are histograms observed as they happen.
Each process uses its own registry, so several servers in one process never collide.
"""

from __future__ import annotations

import math
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latencies from a fraction of a millisecond (index lookups) to tens of seconds (prefill).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(prefix: str, name: str) -> str:
    return f"{prefix}_{_UNSAFE.sub('_', name)}"


class SnapshotCollector(Collector):
    """Exposes a counters dict as counters and a gauges dict as gauges, read per scrape.

    Gauge keys may carry labels: ``("tier_bytes", (("tier", "ram"),))``.
    """

    def __init__(self, prefix: str, counters: Callable[[], Mapping[str, int]],
                 gauges: Callable[[], Mapping[tuple[str, tuple[tuple[str, str], ...]], float]],
                 counter_help: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self.counters = counters
        self.gauges = gauges
        self.counter_help = counter_help if counter_help is not None else {}

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.counters().items()):
            family = CounterMetricFamily(metric_name(self.prefix, name),
                                         self.counter_help.get(name, f"{name} (count)"))
            family.add_metric([], float(value))
            yield family
        grouped: dict[str, GaugeMetricFamily] = {}
        for (name, labels), level in sorted(self.gauges().items()):
            full = metric_name(self.prefix, name)
            if full not in grouped:
                grouped[full] = GaugeMetricFamily(full, name, labels=[k for k, _ in labels])
            grouped[full].add_metric([v for _, v in labels], float(level))
        yield from grouped.values()


class Metrics:
    """A registry with a snapshot collector and named latency histograms."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self._histograms: dict[str, Histogram] = {}
        # Filled by the counters' owner (describe_counters), read at every scrape.
        self.counter_help: dict[str, str] = {}

    def describe_counters(self, help_texts: Mapping[str, str]) -> None:
        """HELP texts of the snapshot's counters (kvcache.counters, model_runtime.counters)."""
        self.counter_help.update(help_texts)

    def add_snapshot(self, counters: Callable[[], Mapping[str, int]],
                     gauges: Callable[[], Mapping[tuple[str, tuple[tuple[str, str], ...]],
                                                  float]]) -> None:
        self.registry.register(SnapshotCollector(self.prefix, counters, gauges,
                                                 self.counter_help))

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
        if name not in self._histograms:
            self._histograms[name] = Histogram(metric_name(self.prefix, name), doc,
                                               labelnames=labels, buckets=LATENCY_BUCKETS,
                                               registry=self.registry)
        return self._histograms[name]

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` (port 0: any free port); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of samples sorted ascending; 0 if none."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class LatencySummary:
    count: int  # observations since start
    window: int  # recent observations the percentiles are computed from
    p50_ms: float
    p90_ms: float
    p99_ms: float


class LatencyWindows:
    """The last ``size`` latencies of each named series, for percentiles in ``stats``.

    Prometheus histograms are cumulative and bucketed; an operator reading ``stats``
    wants recent percentiles, so a bounded window of raw samples is kept beside them.
    """

    def __init__(self, size: int = 2048) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._samples: dict[str, deque[float]] = {}
        self._counts: dict[str, int] = {}

    def observe(self, series: str, seconds: float) -> None:
        with self._lock:
            window = self._samples.get(series)
            if window is None:
                window = self._samples[series] = deque(maxlen=self.size)
            window.append(seconds)
            self._counts[series] = self._counts.get(series, 0) + 1

    def summaries(self) -> dict[str, LatencySummary]:
        with self._lock:
            snapshot = {name: (sorted(w), self._counts[name]) for name, w in self._samples.items()}
        return {name: LatencySummary(count, len(ordered),
                                     *(round(percentile(ordered, q) * 1000, 3)
                                       for q in (50, 90, 99)))
                for name, (ordered, count) in sorted(snapshot.items())}
