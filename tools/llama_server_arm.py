"""llama.cpp's own ``llama-server`` as an arm of the side-by-side benchmark.

One server process on a free loopback port, the same GGUF, thread count and context size
as the other arms. Requests go to the raw ``/completion`` endpoint, streamed, greedy,
``cache_prompt: true``; TTFT is client-side wall time from sending the request to the
first chunk that carries a generated token. Every reply records ``timings.prompt_n`` (prompt
tokens the server actually prefilled) and ``timings.cache_n`` (tokens it reused).

The server's own caching stays at its defaults (``--cache-reuse 0``, ``--cache-ram`` 8 GiB,
idle slots saved into that RAM cache on a new task), so the comparison is with what a
user gets out of the box. Its RAM prompt cache is not exposed over HTTP; at log verbosity 4
(trace) the server logs the cache's size after every update, which is what
:meth:`LlamaServer.prompt_cache_state` reads.

Standard library only (``http.client``): the benchmark must not depend on an HTTP stack.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.procs import Proc

SDIST_VERSION = "0.3.36"
# The build script's output (tools/build_llama_server.sh, LLAMA_SERVER_DIR overrides the root).
BUILD_ROOT = Path(os.environ.get("LLAMA_SERVER_DIR",
                                 Path.home() / ".cache" / "kvcache-bench" / "llama-server"))
DEFAULT_BINARY = (BUILD_ROOT / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
                  / "build" / "bin" / "llama-server")
# Trace-level log line written after every update of the RAM prompt cache.
_CACHE_STATE = re.compile(r"cache state: (\d+) prompts, ([0-9.]+) MiB")


class LlamaServerError(RuntimeError):
    """The server did not start, answered with an error, or broke a stream."""


@dataclass
class ServerReply:
    """One streamed ``/completion``: what the client saw and what the server reported."""

    text: str
    tokens: list[int]  # generated token ids, in order
    ttft_ms: float
    e2e_ms: float
    prompt_n: int  # prompt tokens prefilled by this request
    cache_n: int  # prompt tokens reused from the slot or the RAM prompt cache
    stop_type: str
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_n + self.cache_n


def free_port() -> int:
    """A TCP port free on loopback right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer(Proc):
    """A ``llama-server`` child process (tools/harness/procs.py); ``start()`` waits for ``/health``,
    ``stop()`` terminates it (SIGKILL after a grace period). Use as a context manager so it
    is never left running."""

    start_timeout = 120.0
    stop_timeout = 20.0

    def __init__(self, binary: Path, model: Path, *, threads: int, n_ctx: int,
                 log_path: Path, parallel: int = 1, n_batch: int = 512,
                 extra_args: Sequence[str] = ()) -> None:
        # As users run it: OpenMP's own spinning, not what model_runtime sets for its
        # process when imported (kernels.py), which children would inherit.
        super().__init__("llama-server", [], log_path, env={
            k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")})
        self.binary = binary
        self.model = model
        self.threads = threads
        self.n_ctx = n_ctx
        self.parallel = parallel
        self.n_batch = n_batch
        self.extra_args = list(extra_args)
        self.port = 0

    def argv(self) -> list[str]:
        # Batch sizes and flash attention match model_runtime's context (n_batch = n_ubatch
        # = 512, flash attention off): the arms then run the same kernels on the same shapes.
        return [str(self.binary), "--model", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "--threads", str(self.threads),
                "--threads-batch", str(self.threads), "--ctx-size", str(self.n_ctx),
                "--parallel", str(self.parallel), "--batch-size", str(self.n_batch),
                "--ubatch-size", str(self.n_batch), "--flash-attn", "off",
                "--log-verbosity", "4", *self.extra_args]

    def start(self, timeout: float | None = None) -> LlamaServer:
        """Spawn it on a free port and wait until ``/health`` answers 200."""
        if self.running:
            raise LlamaServerError("llama-server is already running")
        if not self.binary.is_file():
            raise LlamaServerError(f"llama-server binary not found: {self.binary}")
        self.port = free_port()
        return super().start(timeout)

    def wait_ready(self, deadline: float) -> None:
        def healthy() -> bool:
            with contextlib.suppress(OSError, http.client.HTTPException):
                return self._get("/health", timeout=2.0)[0] == 200
            return False

        self.poll_until(healthy, deadline, "not healthy", interval=0.1)

    # -- HTTP ------------------------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def _get(self, path: str, timeout: float = 30.0) -> tuple[int, Any]:
        conn = self._connection(timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            return resp.status, json.loads(body) if body else None
        finally:
            conn.close()

    def _post(self, path: str, payload: dict[str, Any], timeout: float = 60.0) -> Any:
        conn = self._connection(timeout)
        try:
            conn.request("POST", path, body=json.dumps(payload),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise LlamaServerError(f"POST {path}: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def tokenize(self, text: str) -> list[int]:
        """The server's own tokenization of ``text`` (special tokens parsed, as for a
        ``/completion`` prompt)."""
        reply = self._post("/tokenize", {"content": text, "add_special": True,
                                         "parse_special": True})
        return [int(t) for t in reply["tokens"]]

    def slots(self) -> list[dict[str, Any]]:
        status, body = self._get("/slots")
        if status != 200:
            raise LlamaServerError(f"GET /slots: HTTP {status}")
        return list(body)

    def complete(self, prompt: str | Sequence[int], n_predict: int,
                 timeout: float = 900.0) -> ServerReply:
        """One streamed, greedy ``/completion`` with prompt caching on."""
        self.check_alive()
        payload = {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                   "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True,
                   "stream": True, "return_tokens": True}
        body = json.dumps(payload)
        conn = self._connection(timeout)
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/completion", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise LlamaServerError(f"/completion: HTTP {resp.status}: {resp.read()[:300]!r}")
            return self._read_stream(resp, t0)
        finally:
            conn.close()

    @staticmethod
    def _read_stream(resp: http.client.HTTPResponse, t0: float) -> ServerReply:
        """Server-sent events: ``data: {json}`` lines; the last one has ``stop: true``."""
        first = 0.0
        text: list[str] = []
        tokens: list[int] = []
        final: dict[str, Any] | None = None
        while final is None:
            line = resp.readline()
            if not line:
                raise LlamaServerError("/completion stream ended without a final chunk")
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                raise LlamaServerError(f"/completion: {chunk['error']}")
            new_tokens = [int(t) for t in chunk.get("tokens") or []]
            if (new_tokens or chunk.get("content")) and not first:
                first = time.perf_counter()
            if not chunk.get("stop"):
                tokens.extend(new_tokens)
                text.append(chunk.get("content") or "")
            else:
                final = chunk
        end = time.perf_counter()
        timings = final.get("timings") or {}
        return ServerReply(text="".join(text), tokens=tokens,
                           ttft_ms=((first or end) - t0) * 1e3, e2e_ms=(end - t0) * 1e3,
                           prompt_n=int(timings.get("prompt_n", 0)),
                           cache_n=int(timings.get("cache_n", 0)),
                           stop_type=str(final.get("stop_type", "")), timings=timings)

    # -- observations ----------------------------------------------------------------------

    def log_text(self) -> str:
        """This run's part of the log (the file is appended to across restarts)."""
        return self.log(this_run=True)

    def prompt_cache_state(self) -> dict[str, Any]:
        """The RAM prompt cache (``--cache-ram``) as last logged: states held and MiB."""
        found = _CACHE_STATE.findall(self.log_text())
        if not found:
            return {"prompts": 0, "bytes": 0, "source": "no cache update logged yet"}
        prompts, mib = found[-1]
        return {"prompts": int(prompts), "bytes": int(float(mib) * (1 << 20)),
                "source": "server log, 'cache state' trace line (MiB, 3 decimals)"}
