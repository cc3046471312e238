"""What the remote tier's lookups and uploads share: the connection, deadlines, counters,
and reading values back (envelope and record checks, each refusal counted)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar, cast

from redis.cluster import RedisCluster as ClusterClient
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..counters import REMOTE_SECTION
from .config import RemoteConfig
from .conn import TIMEOUT, Client, Connection, Pipeline
from .layout import Names, RemoteRecord, ValueInvalid, ValueRefused, open_value

log = logging.getLogger("kvcache.remote")
T = TypeVar("T")
DISCONNECTED = "disconnected"
# Foreground calls run on these threads so that the caller waits no longer than its
# deadline whatever the client library does meanwhile (a cluster client, for one,
# retries a failed pipeline command by command, each with its own socket timeout).
IO_THREADS = 8


class Failed(Exception):
    """A remote call failed (already counted); ``kind`` says how, or ``disconnected``:
    not tried, the remote being down."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _Job:
    """A foreground call; ``abandoned`` once its caller stopped waiting for it."""

    abandoned = False


class Core:
    def __init__(self, config: RemoteConfig, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.config = config
        self.block_size = block_size
        self.names = Names(config.key_prefix, config.signing_key)
        self.signing_key = config.signing_key
        self.encrypt = config.encrypt
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.conn = Connection(config, on_error=lambda kind: self.count(f"remote_errors_{kind}"),
                               on_reconnect=lambda: self.count("remote_reconnects"))
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvcache-remote-io")
        self._local = threading.local()

    def close(self, timeout: float) -> None:
        self.conn.close(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def counter_values(self) -> dict[str, int]:
        """Every remote counter, zeros included."""
        with self._lock:
            return {**dict.fromkeys(REMOTE_SECTION, 0), **self.counters}

    # -- calls ------------------------------------------------------------------------------

    def call(self, fn: Callable[[Client], T]) -> T:
        """Run ``fn`` with the client on this thread; a failure is counted (unless its
        caller gave up on it already) and raised as Failed."""
        got = self.conn.acquire()
        if got is None:
            raise Failed(DISCONNECTED)
        client, generation = got
        try:
            return fn(client)
        except (RedisError, RedisClusterException, OSError) as exc:
            job = getattr(self._local, "job", None)
            if job is not None and job.abandoned:
                raise Failed(TIMEOUT) from None  # counted when its caller gave up
            raise Failed(self.conn.failed(generation, exc)) from None

    def foreground(self, fn: Callable[[_Job], T], timeout: float, *,
                   mark_down: bool = True) -> T:
        """Run ``fn`` (which makes its calls with :meth:`call`) on an I/O thread and wait
        for it at most ``timeout``. Past it: Failed(timeout), counted, and the remote
        marked down when ``mark_down``; ``fn`` may check ``job.abandoned`` to stop early."""
        got = self.conn.acquire()
        if got is None:
            raise Failed(DISCONNECTED)
        job = _Job()

        def run() -> T:
            self._local.job = job
            try:
                return fn(job)
            finally:
                self._local.job = None

        try:
            future = self._pool.submit(run)
        except RuntimeError:  # shut down: closing
            raise Failed(DISCONNECTED) from None
        try:
            return future.result(timeout)
        except FutureTimeout:
            job.abandoned = True
            if mark_down:
                self.conn.failed(got[1], RedisTimeoutError(
                    f"no answer within {timeout * 1000:.0f} ms"))
            raise Failed(TIMEOUT) from None

    def best_effort(self, fn: Callable[[Client], object]) -> None:
        """A clean-up call: its failure is neither counted nor marks the remote down."""
        got = self.conn.acquire()
        if got is None:
            return
        try:
            fn(got[0])
        except (RedisError, RedisClusterException, OSError) as exc:
            log.debug("remote clean-up failed: %s", exc)

    @staticmethod
    def mget(client: Client, names: list[bytes]) -> list[bytes | None]:
        """Values of many keys in one round trip: MGET on one server; on a cluster the
        client groups the keys by slot and pipelines one MGET per slot to every node,
        writing to all nodes before reading any."""
        if not names:
            return []
        # (bytes, not str: the connection does not decode responses)
        if isinstance(client, ClusterClient):
            return cast(list[bytes | None], client.mget_nonatomic(names))
        return cast(list[bytes | None], client.mget(names))

    @staticmethod
    def pipeline(client: Client, build: Callable[[Pipeline], None]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        build(pipe)
        return pipe.execute()

    # -- values -----------------------------------------------------------------------------

    def open(self, name: bytes, value: bytes) -> memoryview:
        """A value's body; a refused one is counted and raises ValueInvalid."""
        try:
            return open_value(name, value, self.signing_key, require_encrypted=self.encrypt)
        except ValueRefused:
            self.count("remote_signature_failures")
            raise
        except ValueInvalid:
            self.count("remote_verify_failures")
            raise

    def record(self, key: bytes, value: bytes | None) -> RemoteRecord | None:
        """The checked record of ``key`` from its value (None: absent or refused)."""
        if value is None:
            return None
        return self._checked_record(self.names.record(key), value, key)

    def record_named(self, name: bytes, value: bytes | None) -> RemoteRecord | None:
        """The checked record stored under ``name`` (a listing's: which entry a keyed name
        is for, only its record says), None when absent, refused, or not the record that
        name is for."""
        if value is None:
            return None
        record = self._checked_record(name, value, None)
        if record is not None and self.names.record(record.key) != name:
            self.count("remote_verify_failures")
            log.warning("remote record %s names another entry", name.decode(errors="replace"))
            return None
        return record

    def _checked_record(self, name: bytes, value: bytes, key: bytes | None
                        ) -> RemoteRecord | None:
        try:
            body = self.open(name, value)
        except ValueInvalid:
            return None
        try:
            return RemoteRecord.unpack(body, key, self.block_size)
        except ValueInvalid as exc:
            self.count("remote_verify_failures")
            log.warning("remote record %s refused: %s", name.decode(errors="replace"), exc)
            return None
