"""The gateway's Prometheus metrics: requests by outcome and status, worker restarts by
reason, slots and workers by state, time to first token and token counts as clients saw
them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcache.metrics import LATENCY_BUCKETS

from .worker import Worker

PREFIX = "kvcache_gateway"


class WorkerCollector(Collector):
    """Slots and worker states, read from the workers at each scrape."""

    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        slots = GaugeMetricFamily(f"{PREFIX}_slots", "Request slots of ready workers "
                                  "(the runtime's n_seq_max)", labels=["model", "state"])
        states = GaugeMetricFamily(f"{PREFIX}_workers", "Workers by state",
                                   labels=["model", "state"])
        busy: dict[str, int] = {}
        total: dict[str, int] = {}
        by_state: dict[tuple[str, str], int] = {}
        for w in self.workers():
            model = w.spec.name
            busy[model] = busy.get(model, 0) + len(w.flights)
            total[model] = total.get(model, 0) + (w.slots if w.ready else 0)
            by_state[(model, w.state)] = by_state.get((model, w.state), 0) + 1
        for model in total:
            slots.add_metric([model, "busy"], busy[model])
            slots.add_metric([model, "free"], max(0, total[model] - busy[model]))
        for (model, state), n in sorted(by_state.items()):
            states.add_metric([model, state], n)
        yield slots
        yield states


class GatewayMetrics:
    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests, refused ones included, by "
                                "model (of a completion), endpoint (the route: chat, text, "
                                "models, ...), outcome (ok, bad_request, unauthorized, "
                                "not_found, no_slot, not_ready, worker_failure, disconnected, "
                                "error) and the HTTP status answered (499: none, the client "
                                "went away first)",
                                ["model", "endpoint", "outcome", "status"], registry=r)
        self.failures = Counter(f"{PREFIX}_request_failures", "Requests failed by their "
                                "worker, by reason", ["reason"], registry=r)
        self.restarts = Counter(f"{PREFIX}_worker_restarts", "Worker restarts by reason",
                                ["model", "reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_ttft_seconds", "From the request's arrival to its "
                              "first token", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter(f"{PREFIX}_tokens", "Tokens by kind (prompt, cached: prompt "
                              "tokens not recomputed, completion)", ["model", "kind"],
                              registry=r)
        r.register(WorkerCollector(workers))

    def on_restart(self, worker: Worker, reason: str) -> None:
        self.restarts.labels(worker.spec.name, reason).inc()
