"""The cache daemon behind the gateway's workers.

The gateway's ``--cache`` says which one, in three ways:

* ``none``: no daemon; the workers run without a cache.
* an address (``--cache ADDR``, or ``KVCACHE_ADDRESS``): a daemon someone else runs, which
  must answer when the gateway starts (:func:`require_daemon`); if it goes away later the
  workers run cold and use it again when it is back.
* nothing: the default address, the unix socket in the default data directory. The
  gateway keeps a daemon there while it runs (:class:`CacheDaemon`): one that answers is
  used (another gateway's, or one started by hand); when none does, it runs ``kvcache
  serve`` on the default data directory as a supervised child (supervisor.py), started
  before the workers, stopped after them, started again if it dies.

Two gateways started at once in one home: both find no daemon and start one; the data
directory's lock lets one of them serve, the other exits at once, and its gateway then
uses the first one's daemon when it answers, and starts its own when that one goes away.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache.client import CacheClient
from kvcache.common import lock_is_held

from ..settings import SettingsError, Supervision
from .supervisor import READY, StartError, Supervised, spawned_command

log = logging.getLogger("model_runtime.gateway")

DATA_DIR_LOCK = "daemon.lock"  # held by the daemon serving a data directory
PROBE_TIMEOUT_S = 5.0  # a daemon answers its health check in milliseconds


def daemon_answers(address: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a kvcache daemon serves at ``address`` (its health check, with the
    credentials of ``KVCACHE_TOKEN_FILE`` and ``KVCACHE_TLS_*`` as the workers use)."""
    with CacheClient(address, timeout=timeout) as client:
        health = health_pb2_grpc.HealthStub(client.channel)
        try:
            answer = health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def socket_server_pid(path: Path) -> int | None:
    """The pid of the process listening on the unix socket ``path`` (the peer credentials
    of a connection to it), or None when nothing does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                     struct.calcsize("3i"))
        except OSError:
            return None
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def require_daemon(address: str, named_by: str) -> None:
    """Refuse to start on a cache address that was asked for and does not answer: the
    workers would serve every request cold with nothing said to the caller."""
    if not daemon_answers(address):
        raise SettingsError(f"no cache daemon answers at {address} ({named_by}): start one "
                            "there (kvcache serve), or pass --cache none to run without a "
                            "cache")


class CacheDaemon(Supervised):
    """The daemon at the default address while the gateway runs: another process's that
    answers, else ``kvcache serve`` as this gateway's child."""

    died_reason = "daemon_died"
    unhealthy_reason = "daemon_unhealthy"

    def __init__(self, address: str, data_dir: Path, supervision: Supervision) -> None:
        super().__init__("cache", "cache daemon", supervision)
        self.address = address
        self.socket_path = Path(address.removeprefix("unix:"))
        self.data_dir = data_dir
        self.child = False  # whether the daemon serving now is this gateway's child
        self._first: asyncio.Future[str | None] | None = None

    def command(self) -> list[str]:
        return spawned_command([sys.executable, "-m", "kvcache.cli", "serve", "--dir",
                                str(self.data_dir), "--socket", str(self.socket_path)])

    def target(self) -> str:
        return self.address

    def status(self) -> dict[str, Any]:
        return {**super().status(), "address": self.address, "data_dir": str(self.data_dir),
                "managed": True, "child": self.child}

    def start(self) -> None:
        self._first = asyncio.get_running_loop().create_future()
        super().start()
        assert self._task is not None  # supervision that ends unsettled leaves no waiter
        self._task.add_done_callback(lambda _: self._settle_first("supervision ended"))

    async def started(self) -> str | None:
        """Once a daemon serves for the first time: None; or why none could be started."""
        assert self._first is not None, "start() first"
        return await asyncio.shield(self._first)

    def _settle_first(self, problem: str | None) -> None:
        if self._first is not None and not self._first.done():
            self._first.set_result(problem)

    async def _serving(self) -> None:
        """The health check answered at the shared address, but perhaps another daemon
        did (one that took the data directory first): serving means ours listens there."""
        listener = socket_server_pid(self.socket_path)
        if listener != self.pid:
            raise StartError(f"another process (pid {listener}) serves at {self.address}")

    def _watching(self) -> None:
        self.child = True
        self._settle_first(None)

    async def _incarnation(self) -> tuple[str, str]:
        self.child = False
        self.channel = grpc.aio.insecure_channel(self.address)
        if await self._answers():
            outcome = await self._use_another(time.monotonic())
        else:
            await self.channel.close()
            outcome = await super()._incarnation()
            if outcome[0] == "start_failed" and \
                    lock_is_held(self.data_dir / DATA_DIR_LOCK):
                # Another daemon took the data directory first (a gateway started at the
                # same time): use it once it answers.
                await self._kill()
                self.channel = grpc.aio.insecure_channel(self.address)
                outcome = await self._use_another(self.started_at)
        if outcome[0] == "start_failed":
            self._settle_first(outcome[1])
        return outcome

    async def _answers(self) -> bool:
        assert self.channel is not None
        try:
            answer = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.sup.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    async def _use_another(self, since: float) -> tuple[str, str]:
        """Use the daemon another process runs at the address (waiting for it to answer
        while it starts), until it stops answering its health checks. ``since``: when
        this start began (its own daemon's spawn, when that one lost to the other)."""
        self.started_at = since
        deadline = since + self.sup.start_timeout_s
        while not await self._answers():
            if time.monotonic() > deadline:
                return "start_failed", (f"another kvcache daemon holds {self.data_dir} but "
                                        f"does not answer at {self.address}")
            await asyncio.sleep(0.1)
        self.state = READY
        self.ready_at = time.monotonic()
        self.last_start_s = round(self.ready_at - self.started_at, 3)
        log.info("cache daemon: another process's daemon serves at %s; using it (one is "
                 "started here when it stops)", self.address)
        self._settle_first(None)
        failures = 0
        while failures < self.sup.health_failures:
            await asyncio.sleep(self.sup.health_interval_s)
            failures = 0 if await self._answers() else failures + 1
        return "daemon_gone", (f"the daemon another process ran at {self.address} stopped "
                               f"answering ({failures} health checks)")
