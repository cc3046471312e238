"""The slot ledger: which requests hold which workers' slots, the fleet's one account of
them. A request in flight (:class:`Flight`) holds its slots from admission until it is
released, whatever way it ends; a worker that fails fails every flight on it at once
(their handlers answer with the reason), and their gRPC calls are cancelled."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import WorkerFailure

__all__ = ["Flight", "SlotLedger"]

_flight_ids = itertools.count(1)


@dataclass(eq=False)
class Flight:
    """A request in flight on a worker: it holds its slots until released."""

    worker: str  # the worker's name
    tenant: str  # whose request: a tenant's share of slots is bounded
    slots: int = 1  # a request with n choices runs on n sequences
    id: int = field(default_factory=lambda: next(_flight_ids))
    started: float = field(default_factory=time.monotonic)
    wait_since: float | None = None  # set while waiting for the worker's next event
    call: Any = None  # the gRPC call, cancelled when the worker fails
    failure: WorkerFailure | None = None


class SlotLedger:
    """Every flight, by worker. Slots a worker has are its runtime's (``capacity``,
    asked by whoever counts free ones); the ledger knows only who holds them."""

    def __init__(self) -> None:
        self._flights: dict[str, dict[int, Flight]] = {}

    def acquire(self, worker: str, tenant: str, slots: int = 1) -> Flight:
        """``slots`` slots of ``worker`` for a request of ``tenant`` (admission checked
        that they are free)."""
        flight = Flight(worker, tenant, slots)
        self._flights.setdefault(worker, {})[flight.id] = flight
        return flight

    def release(self, flight: Flight) -> None:
        self._flights.get(flight.worker, {}).pop(flight.id, None)

    def flights(self, worker: str) -> list[Flight]:
        return list(self._flights.get(worker, {}).values())

    def in_flight(self, worker: str) -> int:
        return len(self._flights.get(worker, ()))

    def busy(self, worker: str) -> int:
        return sum(f.slots for f in self._flights.get(worker, {}).values())

    def free(self, worker: str, capacity: int) -> int:
        return max(0, capacity - self.busy(worker))

    def busy_by_tenant(self, worker: str) -> dict[str, int]:
        busy: dict[str, int] = {}
        for flight in self._flights.get(worker, {}).values():
            busy[flight.tenant] = busy.get(flight.tenant, 0) + flight.slots
        return busy

    def tenant_busy(self, workers: Iterable[str], tenant: str) -> int:
        """Slots of ``workers`` that ``tenant``'s requests hold now."""
        return sum(f.slots for w in workers for f in self._flights.get(w, {}).values()
                   if f.tenant == tenant)

    def fail(self, worker: str, failure: WorkerFailure) -> None:
        """Fail every request in flight on ``worker`` now; their handlers answer at once."""
        for flight in self.flights(worker):
            if flight.failure is None:
                flight.failure = failure
                if flight.call is not None:
                    flight.call.cancel()
