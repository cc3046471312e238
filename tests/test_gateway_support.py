"""Helpers for the gateway tests (no tests here): ``model-runtime gateway`` as a real
process on a free loopback port, its workers real ``model-runtime serve`` processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai

LISTENING = re.compile(r"gateway listening on (https?://[^\s;]+)")


class GatewayProcess:
    """``python -m model_runtime.cli gateway`` with its worker sockets in a short private
    folder (``rtg*`` in /tmp, which tests/leftovers.py watches)."""

    def __init__(self, log_path: Path, *args: str, cache: str = "none",
                 env: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rtg", dir="/tmp"))
        self.log_path = log_path
        self.args = [sys.executable, "-m", "model_runtime.cli", "gateway",
                     "--listen", "127.0.0.1:0", "--run-dir", str(self.dir / "run"),
                     "--cache", cache, "--threads", "1", *args]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 60.0, workers_ready: bool = True) -> GatewayProcess:
        try:
            return self._start(timeout, workers_ready)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout: float, workers_ready: bool) -> GatewayProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        deadline = time.monotonic() + timeout
        while not self.url:
            found = LISTENING.search(self.log())
            if found:
                self.url = found.group(1)
                break
            self.check_alive(deadline)
        while workers_ready:
            self.check_alive(deadline)
            try:
                workers = self.status()["workers"]
                if all(w["state"] == "ready" for w in workers):
                    break
            except (OSError, ValueError):
                pass
        return self

    def check_alive(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway did not come up:\n{self.log()}")
        time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, api_key: str = "none", **kwargs: Any) -> openai.OpenAI:
        # No retries: the gateway never replays a request, and the tests see each answer.
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
        code, _, body = self.http("GET", "/status", headers=headers)
        if code != 200:
            raise ValueError(f"status answered {code}: {body[:200]!r}")
        return json.loads(body)

    def worker(self, name: str) -> dict[str, Any]:
        (found,) = [w for w in self.status()["workers"] if w["name"] == name]
        return found

    def wait_worker(self, name: str, predicate: Any, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            w = self.worker(name)
            if predicate(w):
                return w
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {name} did not reach the state: {w}\n"
                                     f"{self.log()[-3000:]}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; the exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                code = None
        self.proc = None
        return code

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def process_gone(pid: int) -> bool:
    """Gone or a zombie (dead, waiting to be reaped by whoever adopted it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2:].split()[0] in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(process_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_leftovers(pids: list[int]) -> None:
    """Last resort in a failing test: no worker may outlive it."""
    for pid in pids:
        if not process_gone(pid):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


SYSTEM = ("You are the terse assistant of a hardware shop. Answer in one sentence, name the "
          "aisle, and never invent a product. ") * 6
