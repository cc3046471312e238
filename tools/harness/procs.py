"""Real processes for tests, tools and benchmarks, started one way.

Every process here is a child of its caller that dies with it (``dies_with_parent``),
writes its output to a log file, is waited for until it serves, and is stopped with
SIGTERM, then SIGKILL if it lingers:

* ``Proc``: any command; the base of the others.
* ``Daemon``: ``kvcache serve`` with its data directory, RAM tier and unix socket.
* ``Gateway``: ``model-runtime gateway`` on a free loopback port.
* ``RedisServer``: one ``redis-server`` on a loopback port, persisting nothing.
* ``Stack``: a daemon and a ``model-runtime serve`` on unix sockets (the demo).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvcache.client import CacheClient
from kvcache.config import ENV_DIR
from kvcache.store.ramtier import tier_in_use
from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from model_runtime.client import RuntimeClient

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL = 3000  # characters of a log quoted in an error
GATEWAY_LISTENING = re.compile(r"gateway listening on (https?://[^\s;]+)")
P = TypeVar("P", bound="Proc")


def short_workdir(prefix: str) -> Path:
    """A new private directory in /tmp: a unix socket path must fit in 107 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def use_own_kvcache_dir() -> None:
    """For the rest of this process and every process it starts, a kvcache directory of
    its own (KVCACHE_DIR, unless one is set), removed at exit: a runtime memoizes model
    fingerprints there, by default in ~/.cache/kvcache, which a benchmark would then
    leave behind. (The test session sets its own: tests/conftest.py.)"""
    if os.environ.get(ENV_DIR):
        return
    path = tempfile.mkdtemp(prefix="kvtool-")
    os.environ[ENV_DIR] = path
    atexit.register(shutil.rmtree, path, True)


def dies_with_parent(argv: list[str], signal_name: str = "TERM") -> list[str]:
    """``argv`` run through ``setpriv --pdeathsig SIGNAL`` (util-linux) when there is one:
    the child gets that signal if the thread that started it ends without stopping it.

    Not a ``preexec_fn``: that makes subprocess fork() instead of vfork(), and in a process
    whose gRPC channels are active, gRPC's fork handler restarts its poller in the child,
    which then aborts on the epoll descriptor closed before exec (grpc/grpc#43055)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", signal_name, "--", *argv] if setpriv else argv


def pythonpath_env() -> dict[str, str]:
    """This environment with the repository and tools/ on PYTHONPATH, for a ``python -c``
    child that imports what pytest's ``pythonpath`` gives the test process (``tests.support``,
    ``harness``)."""
    paths = [str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


class Proc:
    """One command in a child process, its output appended to ``log_path``.

    ``start`` spawns it and returns once ``wait_ready`` says it serves (each subclass says
    how); ``stop`` is SIGTERM, and SIGKILL past ``stop_timeout``; ``kill`` is a crash at an
    arbitrary instant (no shutdown code runs)."""

    start_timeout = 60.0
    stop_timeout = 60.0
    death_signal = "TERM"

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *,
                 env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = ()) -> None:
        self.name = name
        self.command = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.pass_fds = tuple(pass_fds)  # descriptors it inherits
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0  # where the current run's output starts in the log
        self.start_seconds = 0.0  # spawn to serving, of the last start

    def argv(self) -> list[str]:
        return self.command

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start it without waiting for anything."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running")
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(dies_with_parent(self.argv(), self.death_signal),
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         pass_fds=self.pass_fds)
        return self.proc

    def start(self: P, timeout: float | None = None) -> P:
        """Spawn it and wait until it serves; on failure it is killed, not left running."""
        t0 = time.monotonic()
        self.spawn()
        try:
            self.wait_ready(t0 + (self.start_timeout if timeout is None else timeout))
        except BaseException:
            self.kill()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def wait_ready(self, deadline: float) -> None:
        """Return once it serves (``time.monotonic()`` deadline); here at once."""

    def poll_until(self, ready: Callable[[], bool], deadline: float, what: str,
                   interval: float = 0.05) -> None:
        """Call ``ready`` until it holds, failing when the process exits or time is up."""
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {what} in time:\n{self.log()[-LOG_TAIL:]}")
            time.sleep(interval)

    def check_alive(self) -> None:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                               f"{self.log()[-LOG_TAIL:]}")

    def log(self, this_run: bool = False) -> str:
        """The log, or only what the current run wrote to it (it is appended to)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset if this_run else 0)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM and wait, SIGKILL past ``timeout``: the exit status, None if it was not
        running or had to be killed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused process must run to see SIGTERM
            proc.terminate()
            try:
                proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return None
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL and reap."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop it and remove what it was given to work in (subclasses)."""
        self.stop()

    def __enter__(self: P) -> P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Daemon(Proc):
    """``kvcache serve`` in a child process, with its data dir, RAM tier and socket.

    ``ram_parent`` is what ``--ram-dir`` gets (by default a folder beside the data dir,
    which ``close`` removes); the tier is the daemon's own subfolder of it, ``ram_dir``.
    The socket is ``socket``, or one in a short private folder of its own. ``stop`` raises
    if the daemon ignores SIGTERM: its clean shutdown is part of what is tested."""

    start_timeout = 20.0
    stop_timeout = 15.0

    def __init__(self, data_dir: Path, *extra_args: str, ram_parent: Path | None = None,
                 socket: Path | None = None, log_path: Path | None = None,
                 name: str = "daemon") -> None:
        super().__init__(name, [], log_path or data_dir.parent / f"{data_dir.name}-daemon.log")
        self.data_dir = data_dir
        self.extra_args = list(extra_args)
        self._own_ram_parent = ram_parent is None
        self.ram_parent = ram_parent or data_dir.parent / f"{data_dir.name}-ram"
        self._sock_dir: Path | None = None
        if socket is None:
            self._sock_dir = short_workdir("kvt")
            socket = self._sock_dir / "kv.sock"
        self.socket = socket

    @property
    def ram_dir(self) -> Path:
        """The RAM tier folder (what Stats reports as the RAM tier's directory)."""
        return tier_in_use(self.data_dir, self.ram_parent)

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    def argv(self) -> list[str]:
        # No free-space floor: test and benchmark file systems are small or shared.
        return [sys.executable, "-m", "kvcache.cli", "serve", "--dir", str(self.data_dir),
                "--socket", str(self.socket), "--ram-dir", str(self.ram_parent),
                "--min-free-bytes", "0", *self.extra_args]

    def wait_ready(self, deadline: float) -> None:
        """The socket, polled every 2 ms, then one Stats answer on a channel that retries
        within milliseconds: ``start_seconds`` is within a few ms of what a client sees.
        (A killed daemon's socket passes the first wait; the Stats call still waits.)"""
        self.poll_until(self.socket.exists, deadline, f"no socket at {self.socket}", 0.002)
        # Not grpc.min_reconnect_backoff_ms: gRPC core takes it as the minimum connect
        # timeout, and a daemon busy starting up needs longer than a few ms to accept.
        options = [("grpc.initial_reconnect_backoff_ms", 5),
                   ("grpc.max_reconnect_backoff_ms", 20)]
        with grpc.insecure_channel(self.address, options=options) as channel:
            stub = pb_grpc.KVCacheStub(channel)
            while True:
                self.check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name} did not answer Stats in time:\n"
                                       f"{self.log()[-LOG_TAIL:]}")
                try:
                    stub.Stats(pb.StatsRequest(), timeout=min(left, 1.0), wait_for_ready=True)
                    return
                except grpc.RpcError:
                    continue

    def client(self, **kwargs: Any) -> CacheClient:
        return CacheClient(self.address, **kwargs)

    def stop(self, timeout: float | None = None) -> int | None:
        was_running = self.running
        code = super().stop(timeout)
        if was_running and code is None:
            raise RuntimeError(f"{self.name} ignored SIGTERM")
        return code

    def restart(self) -> Daemon:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Kill it (it may be in any state by now; ``stop`` is where a clean shutdown is
        checked) and remove its socket folder and RAM tier: a tier outlives its daemon on
        purpose, so nothing else would."""
        self.kill()
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
        shutil.rmtree(self.ram_dir, ignore_errors=True)
        if self._own_ram_parent:
            shutil.rmtree(self.ram_parent, ignore_errors=True)


class Gateway(Proc):
    """``model-runtime gateway`` on a free loopback port, its worker sockets in a short
    private folder (``rtg*`` in /tmp, which tests/support/leftovers.py watches); ``cache``
    None gives no ``--cache`` (the gateway keeps the default daemon). ``start`` waits
    until it has logged its URL and, with ``workers_ready``, all its workers are ready.
    ``admin_key``: an operator's key of its key file, for /status."""

    stop_timeout = 30.0

    def __init__(self, log_path: Path, *args: str, cache: str | None = "none",
                 threads: int = 1, env: Mapping[str, str] | None = None,
                 admin_key: str | None = None) -> None:
        self.dir = short_workdir("rtg")
        self.admin_key = admin_key
        cache_args = ["--cache", cache] if cache is not None else []
        super().__init__("gateway", [
            sys.executable, "-m", "model_runtime.cli", "gateway", "--listen", "127.0.0.1:0",
            "--run-dir", str(self.dir / "run"), *cache_args, "--threads", str(threads),
            *args], log_path, env=env)
        self.url = ""
        self.workers_ready = True

    def start(self, timeout: float | None = None, workers_ready: bool = True) -> Gateway:
        self.workers_ready = workers_ready
        try:
            return super().start(timeout)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, deadline: float) -> None:
        def url_logged() -> bool:
            found = GATEWAY_LISTENING.search(self.log(this_run=True))
            self.url = found.group(1) if found else ""
            return found is not None

        self.url = ""
        self.poll_until(url_logged, deadline, "no URL logged")
        if self.workers_ready:
            self.poll_until(self._workers_ready, deadline, "workers not ready")

    def _workers_ready(self) -> bool:
        try:
            return all(w["state"] == "ready" for w in self.status()["workers"])
        except (OSError, ValueError):
            return False

    def client(self, api_key: str = "none", **kwargs: Any) -> Any:
        """An OpenAI client of the gateway. No retries: the gateway never replays a
        request, and each answer is seen."""
        import openai

        kwargs.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             **kwargs)

    def http(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """A raw HTTP call: (status, headers, body), error statuses included."""
        req = urllib.request.Request(f"{self.url}{path}", data=body, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def status(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        if headers is None and self.admin_key:
            headers = {"Authorization": f"Bearer {self.admin_key}"}
        code, _, body = self.http("GET", "/status", headers=headers)
        if code != 200:
            raise ValueError(f"status answered {code}: {body[:200]!r}")
        return json.loads(body)

    def worker(self, name: str) -> dict[str, Any]:
        (found,) = [w for w in self.status()["workers"] if w["name"] == name]
        return found

    def wait_worker(self, name: str, predicate: Callable[[dict[str, Any]], bool],
                    timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            w = self.worker(name)
            if predicate(w):
                return w
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {name} did not reach the state: {w}\n"
                                     f"{self.log()[-LOG_TAIL:]}")
            time.sleep(0.05)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(Proc):
    """One ``redis-server`` on a 127.0.0.1 port (a free one unless given), persisting
    nothing, in a temp dir that ``close`` removes (``stop`` keeps it for a restart on the
    same port). Benchmarks use it as is; tests/support/redis_proc.py adds clusters, passwords and
    faults on top."""

    start_timeout = 10.0
    stop_timeout = 5.0
    death_signal = "KILL"  # not TERM: a server paused with SIGSTOP would keep it pending

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `bash tools/setup.sh`")
        self.binary = binary
        if port is None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.extra_args = list(extra_args)
        self.dir = Path(tempfile.mkdtemp(prefix="kvredis-"))
        super().__init__("redis-server", [], self.dir / "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no",
                *self.extra_args]

    def wait_ready(self, deadline: float) -> None:
        self.poll_until(self._pong, deadline, f"no answer to PING on port {self.port}", 0.02)

    def _pong(self) -> bool:
        try:  # PING in the protocol's inline form: no client library needed
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                # A server asking for a password answers too (-NOAUTH): it is up.
                return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Stack:
    """A kvcache daemon and a model runtime serving on unix sockets under ``workdir``.
    Everything they write stays there: the runtime's KVCACHE_DIR (its fingerprint memo)
    is the daemon's data directory, not ~/.cache/kvcache."""

    def __init__(self, workdir: Path, model: str | None, threads: int = 2,
                 runtime_args: tuple[str, ...] = (), daemon_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.runtime_socket = workdir / "rt.sock"
        self.daemon = Daemon(workdir / "cache", *daemon_args, socket=workdir / "kv.sock",
                             log_path=workdir / "daemon.log", name="kvcache daemon")
        model_args = ["--model", model] if model else []
        self.runtime = Proc("model runtime", [
            sys.executable, "-m", "model_runtime.cli", "serve", *model_args,
            "--cache", self.daemon.address, "--socket", str(self.runtime_socket),
            "--threads", str(threads), *runtime_args], workdir / "runtime.log",
            env={**os.environ, ENV_DIR: str(self.daemon.data_dir)})

    def start(self, timeout: float = 120.0) -> RuntimeClient:
        deadline = time.monotonic() + timeout
        self.daemon.start(timeout)
        self.runtime.start()
        client = RuntimeClient(f"unix:{self.runtime_socket}")
        while True:
            self.runtime.check_alive()
            try:
                client.wait_ready(timeout=0.5)
                client.stats()
                return client
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM both: the runtime saves its live sequences, then the daemon stops."""
        self.runtime.stop()
        self.daemon.stop(timeout=60.0)

    def close(self) -> None:
        """Stop both and remove the RAM tier."""
        try:
            self.stop()
        finally:
            self.daemon.close()
