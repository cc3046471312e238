"""A child process the gateway keeps running: its workers (worker.py) and the cache daemon
it starts (cache_daemon.py) are two kinds of it.

Each is started through spawn.py in a session of its own (a process group the gateway
signals as a whole; it dies with the gateway, even a SIGKILLed one), watched by its exit
and its gRPC health service, and on trouble killed (SIGTERM, then SIGKILL after the grace
period) and started again after a backoff doubled per recent restart; too many restarts
within the crash-loop window and it is given up. Its own session rather than the
gateway's process group: a Ctrl-C on the terminal reaches the gateway alone, which then
stops its children in order (workers save their live sequences to the daemon first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..settings import Supervision
from .ring import LogRing

log = logging.getLogger("model_runtime.gateway")

STARTING, READY, RESTARTING, FAILED, STOPPED = (
    "starting", "ready", "restarting", "failed", "stopped")


class StartError(Exception):
    pass


def spawned_command(argv: list[str]) -> list[str]:
    """``argv`` run through spawn.py, so that it dies with this process."""
    return [sys.executable, "-m", "model_runtime.gateway.workers.spawn", str(os.getpid()), "--",
            *argv]


class Supervised:
    """One supervised child. A kind says what it runs (:meth:`command`), where its gRPC
    health service answers (:meth:`target`), and may add to the five hooks below."""

    died_reason = "died"  # the reason of a restart after the process exited
    unhealthy_reason = "unhealthy"  # ... after it failed its health checks

    def __init__(self, name: str, label: str, supervision: Supervision,
                 on_restart: Callable[[Any, str], None] | None = None) -> None:
        self.name = name
        self.label = label  # how log lines name it: "worker w0", "cache daemon"
        self.sup = supervision
        self.on_restart = on_restart
        self.state = STARTING
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: grpc.aio.Channel | None = None
        self.restarts = 0
        self.logs = LogRing(supervision.log_lines)
        self.restart_history = LogRing(supervision.log_lines)
        self.started_at = 0.0  # monotonic time of the last spawn
        self.ready_at = 0.0
        self.last_start_s: float | None = None  # spawn to serving, last time
        self._restart_times: deque[float] = deque()
        self._exited: asyncio.Future[int] | None = None
        self._health_failures = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None

    # -- what a kind says -------------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def target(self) -> str:
        """The gRPC address its health service answers on."""
        raise NotImplementedError

    def _spawn_options(self) -> dict[str, Any]:
        """More of create_subprocess_exec's options for the next spawn (``pass_fds``,
        ``env``)."""
        return {}

    def _spawned(self) -> None:
        """After each spawn (the channel is open)."""

    async def _serving(self) -> None:
        """Once its health service says SERVING, before it is ready; a StartError fails
        the start."""

    def _watching(self) -> None:
        """When it is ready and watched."""

    def _trouble(self, now: float) -> tuple[str, str] | None:
        """Checked every tick while it is watched: (reason, detail) restarts it."""
        return None

    def _on_failure(self, reason: str, detail: str) -> None:
        """When it is about to be killed: a failure, or the gateway stopping."""

    # -- what everyone sees -----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None \
            else None

    async def exited_within(self, seconds: float) -> int | None:
        """The process's exit status if it exits within ``seconds`` (the supervisor learns
        of an exit within a tick); None while it runs, or when none was started."""
        exited = self._exited
        if exited is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(exited), seconds)
        except asyncio.TimeoutError:
            return None

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "state": self.state, "pid": self.pid,
            "restarts": self.restarts, "last_start_s": self.last_start_s,
            "uptime_s": round(time.monotonic() - self.ready_at, 3) if self.ready else None,
            "restart_history": self.restart_history.as_json(),
            "recent_logs": self.logs.as_json(),
        }

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.name}")

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after the grace period; no restart after it."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._on_failure("gateway_stopping", "the gateway is stopping")
        await self._kill()
        self.state = STOPPED

    async def _supervise(self) -> None:
        while not self._stopping:
            reason, detail = await self._incarnation()
            if self._stopping:
                return
            log.warning("%s: %s (%s); restarting", self.label, reason, detail)
            self.state = RESTARTING
            self._on_failure(reason, detail)
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
                log.error("%s: %s", self.label, message)
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
        log.info("%s ready (pid %s) in %.2f s", self.label, self.pid, self.last_start_s)
        return await self._watch()

    async def _spawn(self) -> None:
        self.started_at = time.monotonic()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, limit=1 << 20,  # its own session: its own group
                **self._spawn_options())
        except OSError as exc:
            raise StartError(f"cannot start {sys.executable}: {exc}") from None
        proc = self.proc
        self._exited = asyncio.ensure_future(proc.wait())
        assert proc.stdout is not None
        self._log_task = asyncio.create_task(self._read_log(proc.stdout))
        self.channel = grpc.aio.insecure_channel(self.target())
        self._spawned()

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
        await self._serving()

    async def _watch(self) -> tuple[str, str]:
        assert self._exited is not None
        tick = min(0.25, self.sup.stall_window_s / 4)
        self._health_failures = 0
        health = asyncio.create_task(self._health_loop())
        self._watching()
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    status = await asyncio.wait_for(asyncio.shield(self._exited), tick)
                    return self.died_reason, f"exited with status {status}"
                trouble = self._trouble(time.monotonic())
                if trouble is not None:
                    return trouble
                if self._health_failures >= self.sup.health_failures:
                    return self.unhealthy_reason, (f"health check failed "
                                                   f"{self._health_failures} times in a row")
        finally:
            health.cancel()

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
            log.info("%s: %s", self.label, text)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)  # it leads its own group

    async def _kill(self) -> None:
        """SIGTERM the process group (and SIGCONT, so a stopped process can act on it);
        SIGKILL after the grace period. Neither kind starts processes of its own, so the
        group ends with it."""
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
        self.channel = None
