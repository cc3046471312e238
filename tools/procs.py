"""Start the daemon and the runtime as real processes (used by the demo and benchmarks)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvcache.client import CacheClient
from model_runtime.client import RuntimeClient


class Proc:
    def __init__(self, name: str, args: list[str], log_path: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited:\n{tail}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL and reap: a crash at an arbitrary instant (no shutdown code runs)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def start_daemon(daemon: Proc, address: str, deadline: float) -> None:
    """Start a daemon process and wait until it answers a Stats call."""
    daemon.start()
    with CacheClient(address, timeout=2.0) as cache:
        while True:
            daemon.check_alive()
            try:
                cache.stats()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


class Stack:
    """A kvcache daemon and a model runtime serving on unix sockets under ``workdir``."""

    def __init__(self, workdir: Path, model: str | None, threads: int = 2,
                 runtime_args: tuple[str, ...] = (), daemon_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.cache_socket = workdir / "kv.sock"
        self.runtime_socket = workdir / "rt.sock"
        self.data_dir = workdir / "cache"
        self.ram_parent = workdir / "ram"  # --ram-dir: the tier is the daemon's subfolder
        py = sys.executable
        self.daemon = Proc("kvcache daemon", [
            py, "-m", "kvcache.cli", "serve", "--dir", str(self.data_dir),
            "--socket", str(self.cache_socket), "--ram-dir", str(self.ram_parent),
            "--min-free-bytes", "0", *daemon_args], workdir / "daemon.log")
        model_args = ["--model", model] if model else []
        self.runtime = Proc("model runtime", [
            py, "-m", "model_runtime.cli", "serve", *model_args,
            "--cache", f"unix:{self.cache_socket}", "--socket", str(self.runtime_socket),
            "--threads", str(threads), *runtime_args], workdir / "runtime.log")

    def start(self, timeout: float = 120.0) -> RuntimeClient:
        deadline = time.monotonic() + timeout
        start_daemon(self.daemon, f"unix:{self.cache_socket}", deadline)
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
        self.daemon.stop()

    def close(self) -> None:
        """Stop both and remove the RAM tier (it outlives its daemon on purpose, so nothing
        else would)."""
        self.stop()
        shutil.rmtree(self.ram_parent, ignore_errors=True)

    def cache_client(self) -> CacheClient:
        return CacheClient(f"unix:{self.cache_socket}")


def short_workdir(prefix: str) -> Path:
    """A short private directory (unix socket paths are limited to 107 bytes)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o700)
    return path


def dies_with_parent(argv: list[str], signal_name: str = "TERM") -> list[str]:
    """``argv`` run through ``setpriv --pdeathsig SIGNAL`` (util-linux) when there is one:
    the child gets that signal if the process that started it dies without stopping it.

    Not a ``preexec_fn``: that makes subprocess fork() instead of vfork(), and in a process
    whose gRPC channels are active, gRPC's fork handler restarts its poller in the child,
    which then aborts on the epoll descriptor closed before exec (grpc/grpc#43055)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", signal_name, "--", *argv] if setpriv else argv


class RedisServer:
    """One ``redis-server`` on a 127.0.0.1 port (a free one unless given), persisting
    nothing, in a temp dir that ``stop`` removes. Benchmarks use it as is; the test suite's
    harness (tests/redis_proc.py) adds clusters, passwords and faults on top."""

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
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--logfile",
                str(self.dir / "redis.log"), "--daemonize", "no", *self.extra_args]

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it and wait until it answers (on the same port again after terminate)."""
        # KILL, not TERM: a server paused with SIGSTOP would keep a TERM pending forever.
        self.proc = subprocess.Popen(
            dies_with_parent(self.args(), "KILL"),
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:  # PING in the protocol's inline form: no client library needed
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    # A server asking for a password answers too (-NOAUTH): it is up.
                    if conn.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING "
                                   f"within {timeout} s:\n{self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def terminate(self, timeout: float = 5.0) -> None:
        """SIGTERM (SIGKILL if it lingers); its directory stays for a restart."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused server must run to see SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """Terminate it and remove its directory."""
        self.terminate()
        shutil.rmtree(self.dir, ignore_errors=True)
