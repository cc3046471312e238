"""Run the real kvcache daemon as a subprocess for integration tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvcache.client import CacheClient
from kvcache.ramtier import tier_dir


class DaemonProcess:
    """``kvcache serve`` in a child process, with its data dir, RAM tier and socket.

    ``ram_parent`` is what ``--ram-dir`` gets (by default a folder beside the data dir);
    the tier itself is the daemon's own subfolder of it, ``ram_dir``."""

    def __init__(self, data_dir: Path, *extra_args: str, ram_parent: Path | None = None) -> None:
        self.data_dir = data_dir
        # Unix socket paths are limited to 107 bytes: keep the socket in a short dir.
        self._sock_dir = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
        self.socket = self._sock_dir / "kv.sock"
        self._own_ram_parent = ram_parent is None
        self.ram_parent = ram_parent or (data_dir.parent / f"{data_dir.name}-ram")
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}-daemon.log"

    @property
    def ram_dir(self) -> Path:
        """The RAM tier folder (what Stats reports as the RAM tier's directory)."""
        return tier_dir(self.data_dir, self.ram_parent)

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    def args(self) -> list[str]:
        return [sys.executable, "-m", "kvcache.cli", "serve", "--dir", str(self.data_dir),
                "--socket", str(self.socket), "--ram-dir", str(self.ram_parent),
                "--min-free-bytes", "0", *self.extra_args]

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child's lifetime
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                with CacheClient(self.address, timeout=2.0) as c:
                    try:
                        c.wait_ready(timeout=1.0)
                        c.stats()
                        return self
                    except Exception:
                        pass
            time.sleep(0.05)
        self.kill()  # not left running behind the failed test
        raise RuntimeError(f"daemon did not come up in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kwargs: object) -> CacheClient:
        return CacheClient(self.address, **kwargs)  # type: ignore[arg-type]

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait: a clean shutdown."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError("daemon ignored SIGTERM") from None
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL: a crash at an arbitrary instant."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self) -> DaemonProcess:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        shutil.rmtree(self.ram_dir, ignore_errors=True)
        if self._own_ram_parent:
            shutil.rmtree(self.ram_parent, ignore_errors=True)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``predicate`` until it holds; fail the test saying what did not happen."""
    import pytest

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(0.02)
