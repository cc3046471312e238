"""The connection to the remote: a redis-py client (one server or a cluster) whose every
call has the op deadline and no retry, a connected flag, and a thread that reconnects.

A call that fails on the connection or runs past its deadline marks the remote down.
While it is down :meth:`Connection.acquire` answers None at once, so lookups cost
nothing; the reconnect thread meanwhile builds a fresh client and PINGs, backing off
from ``reconnect_min_s`` doubling to ``reconnect_max_s``, and marks it up again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline
from redis.cluster import RedisCluster as ClusterClient
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .config import RemoteConfig, RemoteConfigError

log = logging.getLogger("kvcache.remote")

Client = redis.Redis | ClusterClient
#: What Client.pipeline() gives (a cluster's pipeline splits its commands by slot).
Pipeline = redis.client.Pipeline | ClusterPipeline
# The outcome kinds of a failed call (counted as remote_errors_<kind>), and "full".
CONNECTION, TIMEOUT, RESPONSE, AUTH, FULL = "connection", "timeout", "response", "auth", "full"


def classify(exc: BaseException) -> str:
    """What kind of failure an exception from redis-py is."""
    if isinstance(exc, OutOfMemoryError):
        return FULL
    if isinstance(exc, NoPermissionError):  # an ACL user lacking a command: a reply
        return RESPONSE
    if isinstance(exc, (AuthenticationError, AuthorizationError, RemoteConfigError)):
        return AUTH
    if isinstance(exc, RedisTimeoutError):
        return TIMEOUT
    if isinstance(exc, (RedisConnectionError, RedisClusterException, OSError)):
        return CONNECTION
    # Error replies (and the cluster's CLUSTERDOWN, MOVED loops...): the server answered.
    return RESPONSE


def marks_down(kind: str) -> bool:
    """A failure after which the next calls should not wait on the remote."""
    return kind in (CONNECTION, TIMEOUT, AUTH)


class Connection:
    def __init__(self, config: RemoteConfig, on_error: Callable[[str], None],
                 on_reconnect: Callable[[], None]) -> None:
        self.config = config
        self.endpoint = config.endpoint()
        self._on_error = on_error
        self._on_reconnect = on_reconnect
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._generation = 0
        self._down = threading.Event()  # set while disconnected: the reconnect thread acts
        self._down.set()
        self._closed = threading.Event()
        self._ever_connected = False
        self.last_error = ""
        self._thread: threading.Thread | None = None

    @property
    def cluster(self) -> bool:
        return self.endpoint.cluster

    @property
    def connected(self) -> bool:
        return not self._down.is_set() and not self._closed.is_set()

    def start(self) -> None:
        """Try once now (bounded by the op deadline), then keep reconnecting in the
        background whenever the remote is lost."""
        self._attempt()
        self._thread = threading.Thread(target=self._reconnect_loop, name="kvcache-remote-conn",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._closed.set()
        self._down.set()  # wakes the reconnect thread, which sees _closed
        with self._lock:
            client, self._client = self._client, None
            self._generation += 1
        if client is not None:
            _close_client(client)
        if self._thread is not None:
            self._thread.join(timeout)

    def acquire(self) -> tuple[Client, int] | None:
        """The client and its generation, or None (at once) while disconnected."""
        with self._lock:
            if self._client is None or self._down.is_set():
                return None
            return self._client, self._generation

    def failed(self, generation: int, exc: BaseException) -> str:
        """Account for a failed call made with the client of ``generation``: counts its
        kind and, for a lost or slow remote, marks it down (a failure of a client already
        replaced does not take down its successor). Returns the kind."""
        kind = classify(exc)
        if kind != FULL:
            self._on_error(kind)
        self.last_error = f"{kind}: {exc}"
        if marks_down(kind):
            with self._lock:
                if generation != self._generation or self._down.is_set():
                    return kind
                self._down.set()
                client, self._client = self._client, None
                self._generation += 1
            log.warning("remote %s lost (%s); reconnecting in the background",
                        self.config.url, self.last_error)
            if client is not None:
                # Sockets of calls still in flight are shut, so they end now.
                _close_client(client)
        return kind

    # -- reconnecting -----------------------------------------------------------------------

    def _reconnect_loop(self) -> None:
        delay = self.config.reconnect_min_s
        while not self._closed.is_set():
            self._down.wait()
            if self._closed.is_set():
                return
            if self._closed.wait(delay):
                return
            if self._attempt():
                delay = self.config.reconnect_min_s
            else:
                delay = min(delay * 2, self.config.reconnect_max_s)

    def _attempt(self) -> bool:
        client: Client | None = None
        try:
            client = self._build()
            client.ping()
        except Exception as exc:  # anything: this thread must live on to try again
            kind = classify(exc)
            self._on_error(kind)
            self.last_error = f"{kind}: {exc}"
            if client is not None:
                _close_client(client)
            return False
        with self._lock:
            if self._closed.is_set():
                _close_client(client)
                return False
            self._client = client
            self._generation += 1
            self._down.clear()
            again = self._ever_connected
            self._ever_connected = True
        self.last_error = ""
        if again:
            self._on_reconnect()
            log.info("remote %s reconnected", self.config.url)
        return True

    def _build(self) -> Client:
        c, e = self.config, self.endpoint
        common: dict[str, Any] = {
            "username": e.username or c.username,
            "password": c.password(),
            "socket_timeout": c.op_timeout_s,
            "socket_connect_timeout": c.op_timeout_s,
            "client_name": "kvcache",
            # Parts are megabytes: reading them 64 KiB at a time (the default) halves
            # the fetch rate.
            "socket_read_size": 1 << 20,
        }
        if e.tls:
            common["ssl"] = True
            if c.tls_ca_file is not None:
                common["ssl_ca_certs"] = str(c.tls_ca_file)
        # No retries: a failed call is answered as a miss now, not after a back-off.
        if e.cluster:
            return ClusterClient(
                startup_nodes=[ClusterNode(host, port) for host, port in e.nodes],
                retry=Retry(NoBackoff(), 0), require_full_coverage=False, **common)
        host, port = e.nodes[0]
        return redis.Redis(host=host, port=port, db=e.db, retry=Retry(NoBackoff(), 0),
                           health_check_interval=0, **common)


def _close_client(client: Client) -> None:
    with contextlib.suppress(Exception):  # closing a broken client may raise anything
        if isinstance(client, ClusterClient):
            client.close()
        else:
            client.connection_pool.disconnect(inuse_connections=True)
            client.close()
