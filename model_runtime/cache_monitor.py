"""Whether the cache daemon a runtime uses answers: probed in the background, with a
warning when it goes and a line when it is back."""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache.client import CacheClient

__all__ = ["CacheMonitor"]

log = logging.getLogger("model_runtime")


class CacheMonitor:
    """Says when the cache daemon cannot be reached, and when it answers again.

    Without it a runtime whose daemon is gone serves every request cold and drops every
    save with nothing said. The daemon's health service is probed every ``interval_s``:
    a warning once per outage (also at start-up), an info line when it is back.
    """

    def __init__(self, cache: CacheClient, interval_s: float, timeout_s: float) -> None:
        self.address = cache.address
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._health = health_pb2_grpc.HealthStub(cache.channel)
        self.reachable: bool | None = None  # None until the first probe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def probe(self) -> bool:
        try:
            answer = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        # A daemon shutting down answers NOT_SERVING: it is going away.
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def check(self) -> bool:
        """Probe once and report a change."""
        reachable = self.probe()
        if reachable != self.reachable:
            if not reachable:
                log.warning("kvcache: no cache daemon at %s; running without a cache "
                            "(requests run cold, saves are dropped)", self.address)
            elif self.reachable is not None:
                log.info("kvcache: the cache daemon at %s is back; requests use the cache "
                         "again", self.address)
            self.reachable = reachable
        return reachable

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvcache-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
