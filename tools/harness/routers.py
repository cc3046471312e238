"""The routers a fleet runs behind, as child processes for tests and benchmarks: NVIDIA
Dynamo's standalone KV indexer, vllm-router and sglang-router. All are the real programs
from PyPI (``ai-dynamo-runtime``, ``vllm-router``, ``sglang-router``, in the dev
extra)."""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.procs import Proc


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0
              ) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            try:
                return resp.status, json.loads(raw) if raw.strip() else None
            except ValueError:  # vllm-router's /health answers plain text
                return resp.status, raw.decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


class DynamoIndexer(Proc):
    """``python -m dynamo.indexer``: subscribes to workers' KV events and answers
    ``POST /query`` with each worker's longest match. ``workers``: worker id -> its event
    endpoints, one per data-parallel rank."""

    start_timeout = 60.0
    stop_timeout = 10.0

    def __init__(self, log_path: Path, block_size: int,
                 workers: Mapping[int, Sequence[str]] | None = None) -> None:
        self.port = free_port()
        spec = ",".join(f"{wid}{f':{rank}' if rank else ''}={endpoint}"
                        for wid, endpoints in (workers or {}).items()
                        for rank, endpoint in enumerate(endpoints))
        super().__init__("dynamo-indexer", [
            sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size),
            "--port", str(self.port), "--threads", "1",
            *(["--workers", spec] if spec else [])], log_path)
        self.url = f"http://127.0.0.1:{self.port}"
        self.block_size = block_size

    def wait_ready(self, deadline: float) -> None:
        self.poll_until(lambda: self._get("/workers") is not None, deadline,
                        "the indexer did not answer")

    def _get(self, path: str) -> Any:
        try:
            status, body = http_json("GET", self.url + path, timeout=2)
        except OSError:
            return None
        return body if status == 200 else None

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str | None = None,
                 model_name: str = "default") -> None:
        """Add a worker while it runs (``POST /register``), with its replay endpoint."""
        body = {"instance_id": worker_id, "endpoint": endpoint, "model_name": model_name,
                "block_size": self.block_size}
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        status, answer = http_json("POST", self.url + "/register", body)
        if status not in (200, 201):
            raise RuntimeError(f"register answered {status}: {answer}")

    def query(self, token_ids: Sequence[int], model_name: str = "default"
              ) -> dict[str, dict[str, Any]]:
        """Worker id -> {longest_matched, gpu, cpu, disk, dp}: matched tokens per tier
        (gpu: device; cpu: device or host; disk: any)."""
        status, body = http_json("POST", self.url + "/query",
                                 {"token_ids": list(token_ids), "model_name": model_name})
        if status != 200:
            raise RuntimeError(f"query answered {status}: {body}")
        return dict(body["instances"])

    def dump(self) -> dict[str, Any]:
        return dict(self._get("/dump") or {})


class VllmRouter(Proc):
    """``vllm-router`` over worker URLs with a policy; ``kv_sources``: worker URL -> its KV
    event endpoints (one per rank), for ``kv_aware``."""

    start_timeout = 60.0
    stop_timeout = 10.0

    def __init__(self, log_path: Path, worker_urls: Sequence[str], policy: str, *,
                 kv_sources: Mapping[str, Sequence[str]] | None = None,
                 kv_replay: Mapping[str, Sequence[str]] | None = None,
                 block_size: int = 256, model: str = "", extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        args = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-port", str(free_port()),
                "--policy", policy, "--worker-urls", *worker_urls,
                "--health-check-interval-secs", "5", *extra]
        for url, endpoints in (kv_sources or {}).items():
            args += ["--kv-event-source", f"{url}={','.join(endpoints)}"]
        for url, endpoints in (kv_replay or {}).items():
            args += ["--kv-event-replay-source", f"{url}={','.join(endpoints)}"]
        if kv_sources:
            args += ["--kv-event-block-size", str(block_size), "--kv-event-model",
                     model or "default"]
        super().__init__("vllm-router", args, log_path)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        def ready() -> bool:
            try:
                status, _ = http_json("GET", self.url + "/health", timeout=2)
            except OSError:
                return False
            return status == 200

        self.poll_until(ready, deadline, "the router did not answer /health")

    def client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             **kwargs)


class SglangRouter(Proc):
    """``sglang-router launch`` over worker URLs with a policy. Ready once it has
    registered the workers (its /health answers before it has any), which it does by
    asking each for ``/health``, ``/server_info`` and ``/model_info``."""

    start_timeout = 60.0
    stop_timeout = 10.0

    def __init__(self, log_path: Path, worker_urls: Sequence[str], policy: str,
                 extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.workers = len(worker_urls)
        args = [str(Path(sys.executable).parent / "sglang-router"), "launch",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--policy", policy,
                "--worker-urls", *worker_urls, "--health-check-interval-secs", "5", *extra]
        super().__init__("sglang-router", args, log_path)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        def ready() -> bool:
            try:
                status, body = http_json("GET", self.url + "/workers", timeout=2)
            except OSError:
                return False
            return status == 200 and isinstance(body, dict) and \
                len(body.get("workers") or []) == self.workers

        self.poll_until(ready, deadline, "the router did not register its workers")

    def client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             **kwargs)
