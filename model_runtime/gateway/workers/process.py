"""One worker's process: ``model-runtime serve`` as a supervised child (supervisor.py),
what it says of itself once it serves (:class:`RuntimeInfo`), and its liveness.

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

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from ...chat.formats import ChatFormat, detect_format
from ...chat.templates import ChatTemplate, TemplateError
from ...v1 import runtime_pb2 as pb
from ...v1 import runtime_pb2_grpc as pb_grpc
from ..settings import ModelSpec, Supervision
from .events import EVENT_FD_ENV, ChannelReader, open_channel
from .supervisor import StartError, Supervised, spawned_command

__all__ = ["BUSY_FRACTION", "ProcessHooks", "RuntimeInfo", "RuntimeProcess", "TemplateSpec",
           "process_cpu_seconds"]

log = logging.getLogger("model_runtime.gateway")

# CPU use (share of one core) that counts as a worker computing on its requests. An idle
# runtime's housekeeping (gRPC polling, the cache probe) stays far below it.
BUSY_FRACTION = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` (all its threads), from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(frozen=True)
class TemplateSpec:
    """What a worker's runtime says of its chat template: enough to rebuild it."""

    source: str
    bos: str
    eos: str
    add_bos: bool


@dataclass(frozen=True)
class RuntimeInfo:
    """What a serving runtime says of itself (its Stats), read at each start. The gateway
    renders chats itself, with the model's template."""

    slots: int = 0  # the runtime's n_seq_max
    n_ctx: int = 0
    fingerprint: str = ""
    template: ChatTemplate | None = None
    chat_format: ChatFormat | None = None
    template_spec: TemplateSpec | None = None  # to rebuild the template elsewhere


@dataclass(frozen=True)
class ProcessHooks:
    """What the rest of a worker learns from its process, and what the stall rule asks of
    it: ``spawned``, a new process (with no live sequences) was started; ``failing``, the
    process is about to be killed: fail its requests in flight with (reason, detail);
    ``waits``, when each request in flight began waiting for its next event (None: the
    gateway is busy with it); ``restarted``, (model, reason) of each restart."""

    spawned: Callable[[], None]
    failing: Callable[[str, str], None]
    waits: Callable[[], Iterable[float | None]]
    restarted: Callable[[str, str], None] | None = None


class RuntimeProcess(Supervised):
    died_reason = "worker_died"
    unhealthy_reason = "worker_restarted"

    def __init__(self, name: str, spec: ModelSpec, socket_path: Path,
                 cache_address: str | None, supervision: Supervision,
                 hooks: ProcessHooks, kv_events: str | None = None) -> None:
        restarted = hooks.restarted
        super().__init__(name, f"worker {name}", supervision,
                         None if restarted is None else
                         lambda _, reason: restarted(spec.name, reason))
        self.spec = spec
        self.socket_path = socket_path
        self.cache_address = cache_address
        self.kv_events = kv_events  # where it publishes its live sequences, if anywhere
        self.hooks = hooks
        self.info = RuntimeInfo()
        # The event channel of the process serving now (events.py), and the worker's end
        # of the next one while it is being spawned.
        self.event_channel: ChannelReader | None = None
        self._worker_end: socket.socket | None = None
        self.cpu_progress_at = 0.0
        self._cpu_seen: tuple[float, float | None] = (0.0, None)  # (when, CPU seconds)

    def status(self) -> dict[str, Any]:
        channel = self.event_channel
        return {**super().status(),
                "event_channel": channel.status() if channel is not None else None}

    def command(self) -> list[str]:
        """No ``--tenant``: every request names its tenant (the runtime's default tenant,
        "", is never used by the gateway's requests)."""
        return spawned_command([
            sys.executable, "-m", "model_runtime.cli", "serve", "--model", str(self.spec.path),
            "--socket", str(self.socket_path), "--cache", self.cache_address or "none",
            *(["--kv-events", self.kv_events] if self.kv_events else []), *self.spec.args])

    def target(self) -> str:
        return f"unix:{self.socket_path}"

    # -- lifetime (supervisor.py; what is a worker's own) ------------------------------------

    def _on_failure(self, reason: str, detail: str) -> None:
        self.hooks.failing(reason, detail)

    async def _spawn(self) -> None:
        """Each process gets an event channel of its own: a socket pair, one end
        inherited (EVENT_FD_ENV names it), the other read here."""
        self._close_event_channel()
        ours, self._worker_end = socket.socketpair()
        try:
            await super()._spawn()
        except BaseException:
            ours.close()
            raise
        finally:
            self._worker_end.close()
            self._worker_end = None
        self.event_channel = await open_channel(ours)

    def _spawn_options(self) -> dict[str, Any]:
        assert self._worker_end is not None
        fd = self._worker_end.fileno()
        return {"pass_fds": (fd,), "env": {**os.environ, EVENT_FD_ENV: str(fd)}}

    async def _kill(self) -> None:
        await super()._kill()
        self._close_event_channel()

    def _close_event_channel(self) -> None:
        if self.event_channel is not None:
            self.event_channel.close()
        self.event_channel = None

    def _spawned(self) -> None:
        self.hooks.spawned()

    async def _serving(self) -> None:
        assert self.channel is not None
        try:
            stats = await pb_grpc.ModelRuntimeStub(self.channel).Stats(
                pb.RuntimeStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise StartError(f"Stats failed: {exc.code().name}") from None
        self.info = RuntimeInfo(stats.n_seq_max, stats.n_ctx, stats.model_fingerprint)
        if stats.chat_template:
            try:
                self.info = RuntimeInfo(
                    stats.n_seq_max, stats.n_ctx, stats.model_fingerprint,
                    ChatTemplate(stats.chat_template, bos_token=stats.bos_text,
                                 eos_token=stats.eos_text, add_bos=stats.add_bos),
                    detect_format(stats.chat_template),
                    TemplateSpec(stats.chat_template, stats.bos_text, stats.eos_text,
                                 stats.add_bos))
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
        for since in self.hooks.waits():
            if since is None:
                continue  # the gateway is busy with it (writing to its client)
            idle = now - max(since, self.cpu_progress_at)
            if idle > self.sup.stall_window_s:
                return idle
        return None
