"""The gateway's Prometheus metrics: requests by outcome and status, worker restarts by
reason, slots and workers by state, time to first token and token counts as clients saw
them. Every tenant's own numbers carry its label, so that a tenant's key reads its own
numbers only (:class:`TenantView`); the shared workers' (slots of the whole pool, worker
states, restarts) carry none: they are the operator's, since a pool's busy slots move
with every tenant's requests."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvcache.metrics import LATENCY_BUCKETS

from .connections import ConnectionGate

PREFIX = "kvcache_gateway"

# A token's way is a fraction of a decode step (~10 ms here): finer than LATENCY_BUCKETS.
TOKEN_PATH_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064,
                      0.128)
NO_TENANT = "(none)"  # a request refused before its key named a tenant (no tenant has it)


# Each worker's model, state, slots (0 unless ready) and busy slots by tenant.
SlotRow = tuple[str, str, int, dict[str, int]]


class WorkerCollector(Collector):
    """Slots and worker states, read from the fleet at each scrape."""

    def __init__(self, rows: Callable[[], Iterable[SlotRow]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        slots = GaugeMetricFamily(f"{PREFIX}_slots", "Request slots of ready workers "
                                  "(the runtime's n_seq_max), every tenant's",
                                  labels=["model", "state"])
        mine = GaugeMetricFamily(f"{PREFIX}_tenant_slots", "Slots a tenant's requests "
                                 "hold now", labels=["model", "tenant"])
        states = GaugeMetricFamily(f"{PREFIX}_workers", "Workers by state",
                                   labels=["model", "state"])
        busy: dict[str, int] = {}
        total: dict[str, int] = {}
        by_tenant: dict[tuple[str, str], int] = {}
        by_state: dict[tuple[str, str], int] = {}
        for model, state, ready_slots, busy_by_tenant in self.rows():
            for tenant, n in busy_by_tenant.items():
                busy[model] = busy.get(model, 0) + n
                by_tenant[(model, tenant)] = by_tenant.get((model, tenant), 0) + n
            total[model] = total.get(model, 0) + ready_slots
            by_state[(model, state)] = by_state.get((model, state), 0) + 1
        for model in total:
            slots.add_metric([model, "busy"], busy.get(model, 0))
            slots.add_metric([model, "free"], max(0, total[model] - busy.get(model, 0)))
        for labels, n in sorted(by_tenant.items()):
            mine.add_metric(list(labels), n)
        for state_labels, n in sorted(by_state.items()):
            states.add_metric(list(state_labels), n)
        yield slots
        yield mine
        yield states


class GatewayMetrics:
    def __init__(self, slot_rows: Callable[[], Iterable[SlotRow]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests, refused ones included, by "
                                "model (of a completion), endpoint (the route: chat, text, "
                                "models, ...), outcome (ok, bad_request, unauthorized, "
                                "forbidden, not_found, too_large, timeout, no_slot, not_ready, "
                                "worker_failure, disconnected, error) and the HTTP status answered (499: none, the client "
                                "went away first)",
                                ["model", "tenant", "endpoint", "outcome", "status"],
                                registry=r)
        self.failures = Counter(f"{PREFIX}_request_failures", "Requests failed by their "
                                "worker, by reason", ["tenant", "reason"], registry=r)
        self.restarts = Counter(f"{PREFIX}_worker_restarts", "Worker restarts by reason",
                                ["model", "reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_ttft_seconds", "From the request's arrival to its "
                              "first token", ["model", "tenant"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.token_path = Histogram(
            f"{PREFIX}_token_path_seconds", "A streamed token's way from llama.cpp "
            "returning its scores to its bytes handed to the client's connection "
            "(sampling, the worker's message, formatting, the write)", ["model"],
            buckets=TOKEN_PATH_BUCKETS, registry=r)
        self.tokens = Counter(f"{PREFIX}_tokens", "Tokens by kind (prompt, cached: prompt "
                              "tokens not recomputed, completion; drafted and accepted: "
                              "speculative decoding's)", ["model", "tenant", "kind"],
                              registry=r)
        self.connections = Gauge(f"{PREFIX}_connections", "Client connections open now",
                                 registry=r)
        self.connections_refused = Counter(
            f"{PREFIX}_connections_refused", "Connections answered 503 at once, over the "
            "cap of open connections from one address (per_client) or in total, every "
            "one with a request in progress (total)", ["cap"], registry=r)
        self.connections_idle_closed = Counter(
            f"{PREFIX}_connections_idle_closed", "Connections closed while idle (no "
            "request in progress) to make room for a new one, at the total cap",
            registry=r)
        r.register(WorkerCollector(slot_rows))

    def watch_connections(self, gate: ConnectionGate) -> None:
        self.connections.set_function(lambda: gate.open)

    def connection_closed(self, why: str) -> None:
        """A connection refused over a cap ("per_client", "total"), or closed while
        idle to make room ("idle")."""
        if why == "idle":
            self.connections_idle_closed.inc()
        else:
            self.connections_refused.labels(why).inc()

    def on_restart(self, model: str, reason: str) -> None:
        self.restarts.labels(model, reason).inc()


class TenantView:
    """A registry's samples of one tenant only (what ``generate_latest`` reads): a
    family's samples of other tenants, and families without a tenant label, are left out.
    (tests/gateway/test_gateway_limits.py::test_a_tenant_sees_only_its_own_numbers)"""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry = registry
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            mine = Metric(family.name, family.documentation, family.type, family.unit)
            mine.samples = [s for s in family.samples if s.labels.get("tenant") == self.tenant]
            yield mine
