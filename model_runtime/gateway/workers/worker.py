"""One worker as the fleet routes to it: its process (process.py: spawn, watch, stop,
logs), its client (client.py: events, token counts, errors) and its routing memory (the
texts it served, router.py). The slots it lends are counted in the fleet's ledger
(slots.py), which its process fails at once when it is killed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..settings import ModelSpec, Supervision
from .client import WorkerClient
from .errors import WorkerFailure
from .process import ProcessHooks, RuntimeProcess
from .router import PrefixTracker
from .slots import SlotLedger

__all__ = ["Worker"]


class Worker:
    def __init__(self, name: str, spec: ModelSpec, socket_path: Path,
                 cache_address: str | None, supervision: Supervision, ledger: SlotLedger,
                 on_restart: Callable[[str, str], None] | None = None,
                 kv_events: str | None = None) -> None:
        self.name = name
        self.spec = spec
        self.ledger = ledger
        self.tracker = PrefixTracker()  # the texts it served: where conversations live
        self.served = 0
        self.process = RuntimeProcess(name, spec, socket_path, cache_address, supervision,
                                      ProcessHooks(spawned=self.tracker.clear,  # none live
                                                   failing=self._fail_flights,
                                                   waits=self._waits, restarted=on_restart),
                                      kv_events)
        self.client = WorkerClient(self.process)

    def _fail_flights(self, reason: str, detail: str) -> None:
        self.ledger.fail(self.name, WorkerFailure(reason, detail))

    def _waits(self) -> list[float | None]:
        return [flight.wait_since for flight in self.ledger.flights(self.name)]

    # -- what routing sees (router.Routable) ------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.process.ready

    @property
    def slots(self) -> int:
        """Its runtime's sequences (n_seq_max), once it serves."""
        return self.process.info.slots

    @property
    def free_slots(self) -> int:
        return self.ledger.free(self.name, self.slots) if self.ready else 0

    @property
    def in_flight(self) -> int:
        return self.ledger.in_flight(self.name)

    def remember(self, text: str) -> None:
        """A request's text (prompt and reply, under its tenant) whose KV it now holds."""
        self.served += 1
        self.tracker.add(text)
