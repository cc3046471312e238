"""Start the daemon and the runtime as real processes (used by the demo and benchmarks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
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
