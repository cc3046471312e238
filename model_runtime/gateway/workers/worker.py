"""One supervised worker: a ``model-runtime serve`` process, its slots and its liveness.

Nuke and repave: a worker that exits, stops answering its health check, or makes no
progress on a request in flight for the stall window is killed (SIGTERM, then SIGKILL, of
its process group) and started again after a backoff; too many restarts within the
crash-loop window and it is given up. Requests in flight on it fail at once with the
reason (``worker_died``, ``worker_restarted``, ``stall_timeout``) and are never replayed:
the caller decides. The restarted worker is warm from the shared cache daemon.

Progress, not a deadline: a prefill of tens of minutes sends no event but uses CPU, so a
request waiting on its worker counts as progressing while the worker receives events or
burns at least :data:`BUSY_FRACTION` of a core. A stopped (SIGSTOP) or deadlocked process
does neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from ...chat.formats import ChatFormat, detect_format
from ...chat.templates import ChatTemplate, TemplateError
from ...v1 import runtime_pb2 as pb
from ...v1 import runtime_pb2_grpc as pb_grpc
from ..pipeline.offload import TemplateSpec
from ..settings import ModelSpec, Supervision
from .router import PrefixTracker, tenant_text
from .supervisor import (
    FAILED,
    READY,
    RESTARTING,
    STARTING,
    STOPPED,
    StartError,
    Supervised,
    spawned_command,
)

__all__ = ["FAILED", "READY", "RESTARTING", "STARTING", "STOPPED", "Flight", "RuntimeRefused",
           "StartError", "Worker", "WorkerFailure", "process_cpu_seconds"]

log = logging.getLogger("model_runtime.gateway")

# CPU use (share of one core) that counts as a worker computing on its requests. An idle
# runtime's housekeeping (gRPC polling, the cache probe) stays far below it.
BUSY_FRACTION = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_flight_ids = itertools.count(1)


class WorkerFailure(Exception):
    """A request ended by its worker's failure; ``reason`` is the short code clients see."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RuntimeRefused(Exception):
    """The runtime answered the request with an error of its own (a bad request, a busy
    session): the worker is fine."""

    def __init__(self, status: grpc.StatusCode, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(eq=False)
class Flight:
    """A request in flight on a worker: it holds its slots until released."""

    id: int
    started: float
    tenant: str  # whose request: a tenant's share of slots is bounded
    slots: int = 1  # a request with n choices runs on n sequences
    wait_since: float | None = None  # set while waiting for the worker's next event
    call: Any = None  # the gRPC call, cancelled when the worker fails
    failure: WorkerFailure | None = None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` (all its threads), from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Worker(Supervised):
    died_reason = "worker_died"
    unhealthy_reason = "worker_restarted"

    def __init__(self, name: str, spec: ModelSpec, socket_path: Path,
                 cache_address: str | None, supervision: Supervision,
                 on_restart: Callable[[Worker, str], None] | None = None) -> None:
        super().__init__(name, f"worker {name}", supervision, on_restart)
        self.spec = spec
        self.socket_path = socket_path
        self.cache_address = cache_address
        self.stub: pb_grpc.ModelRuntimeStub | None = None
        self.slots = 0  # the runtime's n_seq_max, known once it serves
        self.n_ctx = 0
        self.fingerprint = ""
        # The model's chat template, from the runtime (the gateway renders chats itself).
        self.template: ChatTemplate | None = None
        self.chat_format: ChatFormat | None = None
        self.template_spec: TemplateSpec | None = None  # to rebuild it elsewhere
        self.flights: dict[int, Flight] = {}
        self.served = 0
        self.tracker = PrefixTracker()
        self.cpu_progress_at = 0.0
        self._cpu_seen: tuple[float, float | None] = (0.0, None)  # (when, CPU seconds)

    # -- what routing sees ------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    @property
    def free_slots(self) -> int:
        busy = sum(f.slots for f in self.flights.values())
        return max(0, self.slots - busy) if self.ready else 0

    def tenant_slots(self, tenant: str) -> int:
        """Slots ``tenant``'s requests hold here."""
        return sum(f.slots for f in self.flights.values() if f.tenant == tenant)

    def command(self) -> list[str]:
        """No ``--tenant``: every request names its tenant (the runtime's default tenant,
        "", is never used by the gateway's requests)."""
        return spawned_command([
            sys.executable, "-m", "model_runtime.cli", "serve", "--model", str(self.spec.path),
            "--socket", str(self.socket_path), "--cache", self.cache_address or "none",
            *self.spec.args])

    def target(self) -> str:
        return f"unix:{self.socket_path}"

    # -- requests ---------------------------------------------------------------------------

    def acquire(self, tenant: str, slots: int = 1) -> Flight:
        """Take ``slots`` slots for a request of ``tenant`` (the router checked that they
        are free)."""
        flight = Flight(next(_flight_ids), time.monotonic(), tenant, slots)
        self.flights[flight.id] = flight
        return flight

    def release(self, flight: Flight, served_text: str | None = None) -> None:
        self.flights.pop(flight.id, None)
        if served_text is not None and flight.failure is None:
            self.served += 1
            self.tracker.add(tenant_text(flight.tenant, served_text))

    async def events(self, flight: Flight,
                     request: pb.CompleteRequest) -> AsyncGenerator[pb.CompleteEvent, None]:
        """The runtime's events for ``request``. Raises :class:`WorkerFailure` when the
        worker fails meanwhile, :class:`RuntimeRefused` when the runtime refuses it.
        Closing the iterator early (a client gone) cancels the call, which frees the
        runtime's sequence."""
        if self.stub is None or not self.ready:
            raise WorkerFailure("worker_restarted", f"worker {self.name} is not serving")
        # Every call carries the tenant of the flight's API key, set here, on the one way
        # to a worker, so no route can forget it: workers serve every tenant, and a
        # caller cannot name one (a "tenant" field of a body is refused as unknown).
        request.tenant = flight.tenant
        call = self.stub.Complete(request)
        flight.call = call
        try:
            while True:
                flight.wait_since = time.monotonic()
                try:
                    event = await call.read()
                except asyncio.CancelledError:
                    if flight.failure is not None:  # cancelled by supervision, not by us
                        raise flight.failure from None
                    raise
                except grpc.aio.AioRpcError as exc:
                    raise await self._classify(flight, exc) from None
                finally:
                    flight.wait_since = None
                if event is grpc.aio.EOF:
                    return
                yield event
        finally:
            call.cancel()

    async def count_tokens(self, flight: Flight, request: pb.CompleteRequest) -> int:
        """The request's prompt length in tokens, as the runtime tokenizes it."""
        if self.stub is None or not self.ready:
            raise WorkerFailure("worker_restarted", f"worker {self.name} is not serving")
        request.tenant = flight.tenant  # as in events()
        try:
            answer = await self.stub.CountTokens(request, timeout=self.sup.stall_window_s)
        except grpc.aio.AioRpcError as exc:
            raise await self._classify(flight, exc) from None
        return int(answer.tokens)

    async def _classify(self, flight: Flight, exc: grpc.aio.AioRpcError) -> Exception:
        if flight.failure is not None:
            return flight.failure
        code, details = exc.code(), exc.details() or ""
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            runtime_code, _, message = details.partition(": ")
            return RuntimeRefused(code, runtime_code, message or details)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            # gRPC's own limit on a message's size: the request's fault, not the worker's
            return RuntimeRefused(code, "request_too_large", f"The request is larger than "
                                                             f"a worker accepts ({details}).")
        # The connection broke or the runtime is going away: did the process die? The
        # supervisor learns it within a tick; wait that long for the verdict.
        if self._exited is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                status = await asyncio.wait_for(asyncio.shield(self._exited), 1.0)
                return WorkerFailure("worker_died", f"worker {self.name} exited with status "
                                                    f"{status}")
        if flight.failure is not None:
            return flight.failure
        return WorkerFailure("worker_error", f"worker {self.name}: {code.name}: {details}")

    # -- lifetime (supervisor.py; what is a worker's own) ------------------------------------

    def _on_failure(self, reason: str, detail: str) -> None:
        """Fail every request in flight now; their handlers answer at once."""
        failure = WorkerFailure(reason, detail)
        for flight in list(self.flights.values()):
            if flight.failure is None:
                flight.failure = failure
                if flight.call is not None:
                    flight.call.cancel()

    def _spawned(self) -> None:
        self.tracker.clear()  # the new process has no live sequences
        assert self.channel is not None
        self.stub = pb_grpc.ModelRuntimeStub(self.channel)

    async def _serving(self) -> None:
        assert self.stub is not None
        try:
            stats = await self.stub.Stats(pb.RuntimeStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise StartError(f"Stats failed: {exc.code().name}") from None
        self.slots, self.n_ctx = stats.n_seq_max, stats.n_ctx
        self.fingerprint = stats.model_fingerprint
        self.template = self.chat_format = self.template_spec = None
        if stats.chat_template:
            try:
                self.template = ChatTemplate(stats.chat_template, bos_token=stats.bos_text,
                                             eos_token=stats.eos_text, add_bos=stats.add_bos)
                self.chat_format = detect_format(stats.chat_template)
                self.template_spec = TemplateSpec(stats.chat_template, stats.bos_text,
                                                  stats.eos_text, stats.add_bos)
            except TemplateError as exc:
                log.warning("worker %s: %s; chats are refused", self.name, exc)

    def _watching(self) -> None:
        now = time.monotonic()
        self._cpu_seen = (now, process_cpu_seconds(self.pid) if self.pid else None)
        self.cpu_progress_at = now

    def _trouble(self, now: float) -> tuple[str, str] | None:
        """A request in flight with no progress (no event, no CPU) for the stall window."""
        cpu = process_cpu_seconds(self.pid) if self.pid else None
        then, seen = self._cpu_seen
        if cpu is not None and seen is not None and \
                cpu - seen >= BUSY_FRACTION * (now - then):
            self.cpu_progress_at = now
        self._cpu_seen = (now, cpu)
        stalled = self._stalled_for(now)
        if stalled is None:
            return None
        return "stall_timeout", (f"no progress for {stalled:.1f} s on a request in flight "
                                 f"(window {self.sup.stall_window_s:g} s)")

    def _stalled_for(self, now: float) -> float | None:
        """How long a request has waited on this worker with no progress, if longer than
        the window."""
        for flight in self.flights.values():
            if flight.wait_since is None:
                continue  # the gateway is busy with it (writing to its client)
            idle = now - max(flight.wait_since, self.cpu_progress_at)
            if idle > self.sup.stall_window_s:
                return idle
        return None

    async def _kill(self) -> None:
        await super()._kill()
        self.stub = None

    def busy_by_tenant(self) -> dict[str, int]:
        busy: dict[str, int] = {}
        for flight in self.flights.values():
            busy[flight.tenant] = busy.get(flight.tenant, 0) + flight.slots
        return busy

    def status(self) -> dict[str, Any]:
        return {
            **super().status(), "model": self.spec.name, "socket": str(self.socket_path),
            "slots_total": self.slots,
            "slots_busy": sum(f.slots for f in self.flights.values()),
            "slots_busy_by_tenant": self.busy_by_tenant(), "served": self.served,
            "n_ctx": self.n_ctx,
        }
