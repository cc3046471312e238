"""``model-runtime serve`` as a real process in front of a real daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.procs import Proc

from model_runtime.event_channel import EVENT_FD_ENV

SERVICE = "model_runtime.v1.ModelRuntime"


class RuntimeProcess:
    """``python -m model_runtime.cli serve`` on a unix socket in a short private dir."""

    def __init__(self, model: Path, cache_address: str, log_path: Path, *extra: str,
                 event_fd: int | None = None) -> None:
        """``event_fd``: a socket it inherits as its event channel."""
        self.dir = Path(tempfile.mkdtemp(prefix="rtt", dir="/tmp"))
        self.socket = self.dir / "rt.sock"
        self.proc = Proc("model runtime", [
            sys.executable, "-m", "model_runtime.cli", "serve", "--model", str(model),
            "--cache", cache_address, "--socket", str(self.socket), "--threads", "1",
            "--n-ctx", "1024", "--n-seq-max", "2", *extra], log_path,
            **({} if event_fd is None else {
                "env": {**os.environ, EVENT_FD_ENV: str(event_fd)}, "pass_fds": (event_fd,)}))

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    def start(self, timeout: float = 60.0) -> RuntimeProcess:
        """Start and wait until it serves; on failure nothing of it is left running."""
        try:
            return self._start(timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout: float) -> RuntimeProcess:
        self.proc.start()
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                self.proc.check_alive()
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                        timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("runtime did not come up:\n" + self.log())
                time.sleep(0.05)

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")[-4000:]

    def popen(self) -> subprocess.Popen[bytes]:
        assert self.proc.proc is not None
        return self.proc.proc

    def close(self) -> None:
        self.proc.stop(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
