"""The daemon: a Store served over gRPC (kvcache.service) on its unix socket and on TCP
when asked, with health checks, Prometheus metrics and the shared tier; started by
``kvcache serve``, stopped cleanly on SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from . import __version__
from .auth import OperatorGate, ServerAuth, add_tcp_port, refuse_unprotected_tcp, tcp_security
from .common import TIER_DISK, TIER_RAM, grpc_server
from .config import MAX_MESSAGE_BYTES, SOCKET_NAME, parse_listen
from .kv_events import EventPublisher, PublisherConfig, is_loopback
from .kv_events.store_source import StoreSource
from .metrics import Metrics
from .remote import RemoteConfig, RemoteSync, RemoteTier
from .service import OPERATOR_METHODS, SERVICE_NAME, KVCacheService
from .service.stats import remote_gauges, remote_state, store_gauges, store_stats
from .store import Store, StoreConfig
from .store.ownership import check_data_dir
from .store.quotas import TenantQuotas
from .tenancy import TenantSalts, data_dir_secret, secret_from_signing_key
from .unix_socket import OwnedSocket
from .v1 import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger("kvcache")

__all__ = ["OPERATOR_METHODS", "SERVICE_NAME", "Daemon", "KVCacheService", "server_options"]


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


class Daemon:
    """A Store served over gRPC on a unix socket, and on TCP when asked.

    The two listeners are separate gRPC servers over one service: the unix socket is
    private to its owner by file permissions, while the TCP one checks ``auth`` on every
    call (a token interceptor, TLS credentials) and refuses operator calls unless
    ``tcp_admin``.
    """

    def __init__(self, config: StoreConfig, socket_path: Path | None = None,
                 listen: str | None = None, workers: int = 32,
                 metrics_port: int | None = None, auth: ServerAuth | None = None,
                 insecure_tcp: bool = False, tcp_admin: bool = False,
                 remote: RemoteConfig | None = None,
                 tenant_secret: bytes | None = None,
                 tenant_quotas: Mapping[str, Mapping[str, int]] | None = None,
                 kv_events: PublisherConfig | None = None) -> None:
        """``tenant_quotas``: tier -> tenant name (``*``: every tenant) -> bytes;
        ``kv_events``: publish what the tiers hold (see kvcache.kv_events)."""
        self.auth = auth or ServerAuth()
        if listen:
            parse_listen(listen)  # ValueError for a bad HOST:PORT
        refuse_unprotected_tcp(listen, self.auth, insecure_tcp)
        self.socket = OwnedSocket(socket_path or (config.root / SOCKET_NAME))
        self.socket_path = self.socket.path
        # Checked before the data directory is touched (a refusal changes nothing), and
        # claimed once the directory's lock is held. The directory first: a foreign one
        # (where the default socket would go) is refused as such.
        check_data_dir(config.root)
        self.socket.check()
        self.store = Store(config)
        self.remote_tier: RemoteTier | None = None
        self.kv_events: EventPublisher | None = None
        try:
            if kv_events is not None:
                self._publish_events(kv_events)
            if tenant_secret is None and remote is not None and remote.signing_key:
                tenant_secret = secret_from_signing_key(remote.signing_key)
            self.salts = TenantSalts(tenant_secret or data_dir_secret(config.root))
            quotas = tenant_quotas or {}
            self.store.set_tenant_quotas(TenantQuotas.by_name(
                quotas.get(TIER_DISK, {}), quotas.get(TIER_RAM, {}), self.salts.tenant_id))
            self._quota_names = {n for q in quotas.values() for n in q if n != "*"}
            if remote is not None:
                # Connecting is tried once here and then in the background: a remote that
                # is down does not keep the daemon from serving its local tiers.
                self.remote_tier = RemoteTier(remote, config.block_size).start()
                if remote.signing_key is None:
                    log.warning("SHARED TIER UNSIGNED (--remote-unsigned): anyone who can "
                                "write to %s can hand this host altered states, and anyone "
                                "who can read it reads the prompts", remote.url)
            self._listen(listen, workers, metrics_port, tcp_admin)
        except BaseException:
            if self.remote_tier is not None:
                self.remote_tier.close()
            self._stop_events()
            self.store.close()  # releases the data directory for the next attempt
            self.socket.remove()
            raise
        self._stopped = threading.Event()

    def _publish_events(self, config: PublisherConfig) -> None:
        source = StoreSource(self.store.index, self.store.config.block_size)
        self.store.watch(source.notify)  # before the publisher walks the index
        self.kv_events = EventPublisher(config, source, self.store.config.block_size)
        for endpoint in (config.endpoint, config.replay_endpoint):
            if endpoint is not None and not is_loopback(endpoint):
                log.warning("KV events on %s: anyone who can connect there reads the token "
                            "ids of every cached block (README: Running a fleet behind a "
                            "router)", endpoint)

    def _stop_events(self) -> None:
        self.store.watch(None)
        if self.kv_events is not None:
            self.kv_events.close()

    def _listen(self, listen: str | None, workers: int, metrics_port: int | None,
                tcp_admin: bool) -> None:
        self.metrics = Metrics("kvcache")
        sync = RemoteSync(self.store, self.remote_tier) if self.remote_tier else None
        self.metrics.add_snapshot(
            lambda: {**store_stats(self.store)["counters"],
                     **remote_state(self.remote_tier)["counters"]},
            lambda: {**store_gauges(self.store),
                     **remote_gauges(remote_state(self.remote_tier))})
        self.metrics_port = metrics_port
        self.service = KVCacheService(self.store, self.metrics, sync, self.salts,
                                      self.auth.tokens)
        for name in self._quota_names:
            self.service.tenant_names.learn(name)
        self.health = health.HealthServicer()
        self.servers = [self._server(workers, [])]
        self.socket.bind(self.servers[0])
        self.addresses = [self.socket.address]
        if listen:
            gate = OperatorGate(OPERATOR_METHODS, self.auth.tokens, admins_allowed=tcp_admin)
            tcp = self._server(workers, [*self.auth.interceptors(), gate])
            self.addresses.append(add_tcp_port(tcp, listen, self.auth))
            self.servers.append(tcp)

    def _server(self, workers: int, interceptors: list[grpc.ServerInterceptor]) -> grpc.Server:
        return grpc_server(
            lambda server: pb_grpc.add_KVCacheServicer_to_server(self.service, server),
            SERVICE_NAME, self.health, workers, server_options(), interceptors,
            thread_name_prefix="kvcache-rpc")

    def start(self) -> None:
        for server in self.servers:
            server.start()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.metrics_port)
            self.addresses.append(f"metrics http://127.0.0.1:{self.metrics_port}/metrics")
        if self.kv_events is not None:
            self.addresses.append(f"KV events {self.kv_events.endpoint}" + (
                f" (replay {self.kv_events.replay_endpoint})"
                if self.kv_events.replay_endpoint else ""))
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        stopping = [server.stop(grace) for server in self.servers]
        for event in stopping:
            event.wait()
        if self.remote_tier is not None:
            self.remote_tier.close()  # uploads still queued are dropped
        self._stop_events()
        self.store.close()
        self.socket.remove()

    def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down cleanly."""
        done = threading.Event()

        def on_signal(signum: int, frame: object) -> None:
            log.info("signal %d: shutting down", signum)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        log.info("kvcache %s listening on %s (data %s, ram tier %s)", __version__,
                 " and ".join(self.addresses), self.store.root, self.store.ram_dir)
        if len(self.servers) > 1:
            safe, how = tcp_security(self.auth)
            log.log(logging.INFO if safe else logging.WARNING, "TCP %s: %s",
                    self.addresses[1], how)
        # Wake up regularly: a signal delivered to another thread (llama.cpp's, gRPC's)
        # only runs its Python handler once the main thread executes bytecode again.
        while not done.wait(0.2):
            pass
        self.stop()
        log.info("kvcache stopped")
