"""Real ``redis-server`` processes for the remote-tier tests: standalone servers and a
three-node cluster on free loopback ports, each in a temp dir removed when it stops.

Nothing is persisted (``--save '' --appendonly no``). Servers run in the foreground as
children of the test process (through harness.procs.RedisServer, which also has them die
with it), so the leftovers check sees any that a test failed to stop.
When ``redis-server`` is missing the fixtures fail (not skip), naming the set-up script.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
import trustme
from harness import procs

SETUP_HINT = "redis-server is not installed: run `bash tools/setup.sh` (it installs " \
             "Debian's redis-server and redis-tools)"
# A cluster node also listens on its port + 10000 (the cluster bus).
CLUSTER_BUS_OFFSET = 10000


def require_redis() -> None:
    """Fails the calling test when redis-server or redis-cli is missing."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail(SETUP_HINT, pytrace=False)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A loopback port nothing listens on (and, for a cluster node, its bus port too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if cluster and (port + CLUSTER_BUS_OFFSET > 65535
                        or not _port_free(port + CLUSTER_BUS_OFFSET)):
            continue
        return port
    raise RuntimeError("no free loopback port found")


class RedisServer(procs.RedisServer):
    """harness.procs.RedisServer with what the tests provoke: a password, cluster mode, a
    client for their own checks, pause/resume (SIGSTOP/SIGCONT), a restart on the same
    port, CONFIG SET."""

    def __init__(self, *extra_args: str, port: int | None = None, password: str | None = None,
                 cluster: bool = False) -> None:
        require_redis()
        super().__init__(*extra_args, port=port if port is not None else free_port(cluster))
        self.cluster = cluster
        self.password = password

    def argv(self) -> list[str]:
        args = super().argv()
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.dir / "nodes.conf"), "--cluster-node-timeout", "2000"]
        return args

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain client of this server (for the tests' own checks and set-up)."""
        settings: dict[str, object] = {"socket_timeout": 5, "socket_connect_timeout": 5,
                                       "password": self.password, **kwargs}
        return redis.Redis(host="127.0.0.1", port=self.port, **settings)  # type: ignore[arg-type]

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Start again on the same port (after ``kill``, a crash, or ``stop``: both keep
        the directory)."""
        self.stop()
        return self.start()

    def set_config(self, **settings: str | int) -> None:
        """CONFIG SET, e.g. ``set_config(maxmemory="2mb", maxmemory_policy="noeviction")``."""
        with contextlib.closing(self.client()) as c:
            for name, value in settings.items():
                c.config_set(name.replace("_", "-"), value)


class TlsRedisServer(RedisServer):
    """A server that speaks only TLS, on its port, with a certificate for 127.0.0.1 issued
    by a CA of its own (``ca_file``: what a client must trust). Clients need not present
    certificates."""

    def __init__(self) -> None:
        super().__init__()
        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = self.dir / "ca.pem"
        self.cert_file = self.dir / "server.pem"
        self.key_file = self.dir / "server.key"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self.cert_file.write_bytes(b"".join(b.bytes() for b in issued.cert_chain_pems))
        issued.private_key_pem.write_to_path(str(self.key_file))

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        args = super().argv()
        args[args.index("--port") + 1] = "0"  # no plain-text port
        return args + ["--tls-port", str(self.port), "--tls-cert-file", str(self.cert_file),
                       "--tls-key-file", str(self.key_file), "--tls-auth-clients", "no"]

    def _pong(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def client(self, **kwargs: object) -> redis.Redis:
        return super().client(ssl=True, ssl_ca_certs=str(self.ca_file), **kwargs)


class RedisCluster:
    """Three ``redis-server`` nodes joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, n_nodes: int = 3) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(n_nodes)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{hosts}"

    def start(self, timeout: float = 20.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        done = subprocess.run(["redis-cli", "--cluster", "create", *addresses,
                               "--cluster-replicas", "0", "--cluster-yes"],
                              capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: "
                               f"{done.stdout.decode()}{done.stderr.decode()}")
        deadline = time.monotonic() + timeout
        while not all(self._state_ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    @staticmethod
    def _state_ok(node: RedisServer) -> bool:
        with contextlib.closing(node.client()) as c:
            info = c.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@contextlib.contextmanager
def redis_server(*extra_args: str, password: str | None = None) -> Iterator[RedisServer]:
    server = RedisServer(*extra_args, password=password)
    try:
        yield server.start()
    finally:
        server.close()


@contextlib.contextmanager
def tls_redis_server() -> Iterator[TlsRedisServer]:
    server = TlsRedisServer()
    try:
        yield server.start()
    finally:
        server.close()


@contextlib.contextmanager
def redis_cluster(n_nodes: int = 3) -> Iterator[RedisCluster]:
    cluster = RedisCluster(n_nodes)
    try:
        yield cluster.start()
    finally:
        cluster.close()
