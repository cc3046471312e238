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
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..chat.formats import ChatFormat, detect_format
from ..chat.templates import ChatTemplate, TemplateError
from ..v1 import runtime_pb2 as pb
from ..v1 import runtime_pb2_grpc as pb_grpc
from .offload import TemplateSpec
from .ring import LogRing
from .router import PrefixTracker, tenant_text
from .settings import ModelSpec, Supervision

log = logging.getLogger("model_runtime.gateway")

STARTING, READY, RESTARTING, FAILED, STOPPED = (
    "starting", "ready", "restarting", "failed", "stopped")
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


class StartError(Exception):
    pass


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


class Worker:
    def __init__(self, name: str, spec: ModelSpec, socket_path: Path,
                 cache_address: str | None, supervision: Supervision,
                 on_restart: Callable[[Worker, str], None] | None = None) -> None:
        self.name = name
        self.spec = spec
        self.socket_path = socket_path
        self.cache_address = cache_address
        self.sup = supervision
        self.on_restart = on_restart
        self.state = STARTING
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: grpc.aio.Channel | None = None
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
        self.restarts = 0
        self.logs = LogRing(supervision.log_lines)
        self.restart_history = LogRing(supervision.log_lines)
        self.tracker = PrefixTracker()
        self.started_at = 0.0  # monotonic time of the last spawn
        self.ready_at = 0.0
        self.last_start_s: float | None = None  # spawn to serving, last time
        self.cpu_progress_at = 0.0
        self._restart_times: deque[float] = deque()
        self._exited: asyncio.Future[int] | None = None
        self._health_failures = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None

    # -- what routing sees ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == READY

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

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None \
            else None

    def command(self) -> list[str]:
        """No ``--tenant``: every request names its tenant (the runtime's default tenant,
        "", is never used by the gateway's requests)."""
        py = sys.executable
        return [py, "-m", "model_runtime.gateway.spawn", str(os.getpid()), "--",
                py, "-m", "model_runtime.cli", "serve", "--model", str(self.spec.path),
                "--socket", str(self.socket_path), "--cache", self.cache_address or "none",
                *self.spec.args]

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

    def _fail_flights(self, reason: str, detail: str) -> None:
        """Fail every request in flight now; their handlers answer at once."""
        failure = WorkerFailure(reason, detail)
        for flight in list(self.flights.values()):
            if flight.failure is None:
                flight.failure = failure
                if flight.call is not None:
                    flight.call.cancel()

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.name}")

    async def stop(self) -> None:
        """Fail what is in flight, then SIGTERM (the runtime saves its live sequences),
        SIGKILL after the grace period."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_flights("gateway_stopping", "the gateway is stopping")
        await self._kill()
        self.state = STOPPED

    async def _supervise(self) -> None:
        while not self._stopping:
            reason, detail = await self._incarnation()
            if self._stopping:
                return
            log.warning("worker %s: %s (%s); restarting", self.name, reason, detail)
            self.state = RESTARTING
            self._fail_flights(reason, detail)
            await self._kill()
            self.restarts += 1
            self.restart_history.add(f"{reason}: {detail}")
            self.logs.add(f"[gateway] {reason}: {detail}")
            if self.on_restart is not None:
                self.on_restart(self, reason)
            now = time.monotonic()
            self._restart_times.append(now)
            while self._restart_times and \
                    now - self._restart_times[0] > self.sup.crash_loop_window_s:
                self._restart_times.popleft()
            recent = len(self._restart_times)
            if recent > self.sup.crash_loop_restarts:
                self.state = FAILED
                message = (f"{recent} restarts within {self.sup.crash_loop_window_s:g} s: "
                           "crash loop, not restarting")
                self.restart_history.add(message)
                log.error("worker %s: %s", self.name, message)
                return
            await asyncio.sleep(min(self.sup.backoff_max_s,
                                    self.sup.backoff_s * 2 ** (recent - 1)))

    async def _incarnation(self) -> tuple[str, str]:
        """Start the process and watch it until something is wrong: (reason, detail)."""
        try:
            await self._spawn()
            await self._wait_serving()
        except StartError as exc:
            return "start_failed", str(exc)
        self.state = READY
        self.ready_at = time.monotonic()
        self.last_start_s = round(self.ready_at - self.started_at, 3)
        log.info("worker %s ready (pid %s, %d slots) in %.2f s", self.name, self.pid,
                 self.slots, self.last_start_s)
        return await self._watch()

    async def _spawn(self) -> None:
        self.tracker.clear()  # the new process has no live sequences
        self.started_at = time.monotonic()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, limit=1 << 20)  # its own session: its own group
        except OSError as exc:
            raise StartError(f"cannot start {sys.executable}: {exc}") from None
        proc = self.proc
        self._exited = asyncio.ensure_future(proc.wait())
        assert proc.stdout is not None
        self._log_task = asyncio.create_task(self._read_log(proc.stdout))
        self.channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}")
        self.stub = pb_grpc.ModelRuntimeStub(self.channel)

    async def _wait_serving(self) -> None:
        assert self.channel is not None and self._exited is not None
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = self.started_at + self.sup.start_timeout_s
        while True:
            if self._exited.done():
                tail = " | ".join(self.logs.tail(3))
                raise StartError(f"exited with status {self._exited.result()} while "
                                 f"starting: {tail}")
            if time.monotonic() > deadline:
                raise StartError(f"not serving {self.sup.start_timeout_s:g} s after start")
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
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

    async def _watch(self) -> tuple[str, str]:
        assert self.proc is not None and self._exited is not None
        pid = self.proc.pid
        tick = min(0.25, self.sup.stall_window_s / 4)
        self._health_failures = 0
        health = asyncio.create_task(self._health_loop())
        previous = (time.monotonic(), process_cpu_seconds(pid))
        self.cpu_progress_at = previous[0]
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    status = await asyncio.wait_for(asyncio.shield(self._exited), tick)
                    return "worker_died", f"exited with status {status}"
                now, cpu = time.monotonic(), process_cpu_seconds(pid)
                if cpu is not None and previous[1] is not None and \
                        cpu - previous[1] >= BUSY_FRACTION * (now - previous[0]):
                    self.cpu_progress_at = now
                previous = (now, cpu)
                stalled = self._stalled_for(now)
                if stalled is not None:
                    return "stall_timeout", (f"no progress for {stalled:.1f} s on a request "
                                             f"in flight (window {self.sup.stall_window_s:g} "
                                             "s)")
                if self._health_failures >= self.sup.health_failures:
                    return "worker_restarted", (f"health check failed "
                                                f"{self._health_failures} times in a row")
        finally:
            health.cancel()

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

    async def _health_loop(self) -> None:
        assert self.channel is not None
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            await asyncio.sleep(self.sup.health_interval_s)
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(),
                                            timeout=self.sup.health_timeout_s)
                ok = answer.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                ok = False
            self._health_failures = 0 if ok else self._health_failures + 1

    async def _read_log(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line beyond the limit: keep its start
                line = await stream.read(LogRing.MAX_LINE)
            if not line:
                return
            text = line.decode("utf-8", errors="replace").rstrip()
            self.logs.add(text)
            log.info("worker %s: %s", self.name, text)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)  # the worker leads its own group

    async def _kill(self) -> None:
        """SIGTERM the process group (and SIGCONT, so a stopped process can act on it);
        SIGKILL after the grace period. The runtime starts no processes of its own, so
        the group ends with it."""
        proc, exited = self.proc, self._exited
        if proc is not None and exited is not None and not exited.done():
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)
            try:
                await asyncio.wait_for(asyncio.shield(exited), self.sup.kill_grace_s)
            except asyncio.TimeoutError:
                self._signal_group(signal.SIGKILL)
                await exited
        if self._log_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._log_task, 1.0)
        if self.channel is not None:
            await self.channel.close()
        self.channel = self.stub = None

    def busy_by_tenant(self) -> dict[str, int]:
        busy: dict[str, int] = {}
        for flight in self.flights.values():
            busy[flight.tenant] = busy.get(flight.tenant, 0) + flight.slots
        return busy

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "model": self.spec.name,
            "state": self.state, "pid": self.pid, "socket": str(self.socket_path),
            "slots_total": self.slots,
            "slots_busy": sum(f.slots for f in self.flights.values()),
            "slots_busy_by_tenant": self.busy_by_tenant(),
            "served": self.served, "restarts": self.restarts, "n_ctx": self.n_ctx,
            "last_start_s": self.last_start_s,
            "uptime_s": round(time.monotonic() - self.ready_at, 3) if self.ready else None,
            "restart_history": self.restart_history.as_json(),
            "recent_logs": self.logs.as_json(),
        }
