"""What every RPC of the service shares: the store, the shared tier, the caller's access
checks, latency metrics, and the turning of store errors into gRPC statuses."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

import grpc

from ..auth import Scope
from ..common import details
from ..counters import COUNTERS, REMOTE_SECTION
from ..errors import StoreError
from ..metrics import Histogram, LatencyWindows, Metrics
from ..remote import RemoteSync
from ..store import Found, Store
from ..tenancy import TenantSalts, data_dir_secret
from ..tenant_usage import TenantNames
from .access import CallerAccess

T = TypeVar("T")


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with ``code`` (``context.abort`` raises; said here for the reader and
    the type checker)."""
    context.abort(code, message)
    raise AssertionError("unreachable")


def wait_budget_ms(wait_ms: int, context: Any) -> int:
    """``wait_ms`` cut to the call's deadline. A reader waiting for an in-flight key holds
    one of the server's threads: past its caller's deadline it waited on for nobody (until
    the key was published or aborted, which a trickling writer can put off indefinitely),
    and enough such readers stalled every other RPC."""
    remaining = context.time_remaining()  # without a deadline: None, or a huge number
    if remaining is None:
        return wait_ms
    return max(0, int(min(wait_ms, remaining * 1000)))


class ServiceBase:
    """The state of the service (kvcache.service.KVCacheService) and the helpers its
    RPCs share. A caller's scope is its token's (see CallerAccess)."""

    def __init__(self, store: Store, metrics: Metrics | None = None,
                 remote: RemoteSync | None = None, salts: TenantSalts | None = None,
                 tokens: Mapping[str, Scope] | None = None) -> None:
        self.store = store
        self.remote = remote
        self.salts = salts or TenantSalts(data_dir_secret(store.root))
        self.tokens = tokens or {}
        self.access = CallerAccess(store, self.salts, self.tokens)
        self.tenant_names = TenantNames(self.salts, (
            name for scope in self.tokens.values() for name in scope.tenants or ()))
        self.metrics = metrics or Metrics("kvcache")
        self.metrics.describe_counters({**COUNTERS, **REMOTE_SECTION})
        # Recent samples per series, for the percentiles of `kvcache stats`.
        self.latencies = LatencyWindows()
        self.lookup_seconds = self.metrics.histogram(
            "lookup_seconds", "Longest-prefix lookup latency", ("result",))
        self.read_seconds = self.metrics.histogram(
            "read_seconds", "Time to open (same host) or stream a blob", ("tier", "path"))
        self.commit_seconds = self.metrics.histogram(
            "commit_seconds", "Commit latency: verify, fsync, rename, publish", ("reason",))
        self.write_seconds = self.metrics.histogram(
            "write_stream_seconds", "Duration of a streamed write")

    def _observe(self, histogram: Histogram, series: str, t0: float) -> None:
        """Record the time since ``t0`` in a histogram (Prometheus) and a window (stats)."""
        elapsed = time.perf_counter() - t0
        histogram.observe(elapsed)
        self.latencies.observe(series, elapsed)

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StoreError as exc:
            abort(context, exc.code, details(exc))
        except (ValueError, OverflowError) as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, details(exc))

    def lookup(self, ns: bytes, raw: bytes, max_tokens: int, common_prefix: bool, *,
               count: bool = True) -> Found:
        """The local tiers' answer, or the shared tier's when it holds more."""
        if self.remote is not None:
            return self.remote.lookup(ns, raw, max_tokens, common_prefix=common_prefix,
                                      count=count)
        return self.store.find(ns, raw, max_tokens, common_prefix=common_prefix, count=count)
