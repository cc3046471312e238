"""What streaming a completion costs each server, side by side in one run:

    python tools/bench_stream_cost.py [--model PATH] [--threads 2] [--tokens 200]
                                      [--requests 3] [--rounds 3]
                                      [--llama-server PATH | --without-llama-server]
                                      [--gateway-arg ARG ...] [--out FILE.json]

The same greedy chat completions (``ignore_eos``, ``--tokens`` each), read whole and
streamed to OpenAI's client, from ``model-runtime gateway`` (one worker) and from
llama-server (tools/build_llama_server.sh), the arms and the two ways alternating by
round. For each server and way, per completion token (medians over the rounds):

- ``wall_ms``: the request's time from the client's call to its last byte;
- ``server_cpu_ms``: CPU time of the server's processes (the gateway and its worker, or
  llama-server), and for kvcache ``gateway_cpu_ms`` alone;
- ``client_cpu_ms``: this process's CPU time (OpenAI's client parsing what came);
- kvcache's ``decode_ms``: llama.cpp's own time in the worker's steps, as each answer
  reports it (``kvcache.decode_ms``).

And per server, what streaming adds: ``stream_cost_ms`` (streamed − whole wall time a
token), and kvcache's over llama-server's. Why it is worth a tool: on two cores that
llama.cpp's two threads keep busy, every other thread's work — the gateway's, the
client's — runs while a token is decoded, and lengthens it (``decode_ms`` streamed
against whole). JSON on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import at_least, at_least_one, emit_json, log, machine_info
from harness.procs import Gateway, short_workdir
from llama_server_arm import DEFAULT_BINARY, LlamaServer

from model_runtime.runtime import default_model_path

WAYS = ("whole", "stream")
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process and the children it waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICKS  # utime stime cutime cstime


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its live children (a gateway's workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return process_cpu_s(pid) + sum(process_cpu_s(int(c)) for c in children)


class Arm:
    """One server behind OpenAI's API; ``pid``: its process (a gateway's workers are its
    children, and ``gateway`` has its own figures reported too)."""

    def __init__(self, name: str, base_url: str, pid: int, *, gateway: bool = False) -> None:
        import openai

        self.name = name
        self.pid = pid
        self.gateway = gateway
        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0,
                                    timeout=900)

    def request(self, i: int, tokens: int, stream: bool) -> tuple[int, float]:
        """One completion; its completion tokens and kvcache's decode ms (0 elsewhere)."""
        messages = [{"role": "user", "content": f"Tell story number {i} about a lighthouse."}]
        common: dict[str, Any] = {"model": "bench", "messages": messages, "temperature": 0,
                                  "max_tokens": tokens, "extra_body": {"ignore_eos": True}}
        if not stream:
            reply = self.client.chat.completions.create(**common)
            assert reply.usage is not None
            return reply.usage.completion_tokens, _decode_ms(reply.model_extra)
        n, decode_ms = 0, 0.0
        for chunk in self.client.chat.completions.create(
                **common, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                n, decode_ms = chunk.usage.completion_tokens, _decode_ms(chunk.model_extra)
        return n, decode_ms

    def run(self, way: str, requests: int, tokens: int, first: int) -> dict[str, float]:
        """``requests`` completions one after another; their figures per token."""
        cpu0 = tree_cpu_s(self.pid)
        gw0 = process_cpu_s(self.pid)
        own0 = time.process_time()
        t0 = time.perf_counter()
        n, decode_ms = 0, 0.0
        for i in range(first, first + requests):
            got, ms = self.request(i, tokens, way == "stream")
            n += got
            decode_ms += ms
        wall = time.perf_counter() - t0
        out = {"tokens": n, "wall_ms": wall * 1e3 / n,
               "server_cpu_ms": (tree_cpu_s(self.pid) - cpu0) * 1e3 / n,
               "client_cpu_ms": (time.process_time() - own0) * 1e3 / n}
        if self.gateway:
            out["gateway_cpu_ms"] = (process_cpu_s(self.pid) - gw0) * 1e3 / n
            out["decode_ms"] = decode_ms / n
        return out


def _decode_ms(extra: dict[str, Any] | None) -> float:
    details = (extra or {}).get("kvcache") or {}
    return float(details.get("decode_ms", 0.0))


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    p.add_argument("--threads", type=at_least_one, default=2)
    p.add_argument("--tokens", type=at_least(2), default=200)
    p.add_argument("--requests", type=at_least_one, default=3, help="per arm, way and round")
    p.add_argument("--rounds", type=at_least_one, default=3)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY)
    p.add_argument("--without-llama-server", action="store_true",
                   help="the gateway alone: no side-by-side ratio")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="one more argument of the gateway's command line (repeatable), "
                        "e.g. --gateway-arg=--worker-args=--kernels fast")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = args.model = args.model or default_model_path()
    if not args.without_llama_server and not args.llama_server.is_file():
        sys.exit(f"llama-server not found at {args.llama_server}: build it with "
                 "tools/build_llama_server.sh, or pass --without-llama-server")
    workdir = short_workdir("bsc")
    gateway = Gateway(workdir / "gateway.log", "--model", f"bench={model}", "--workers", "1",
                      "--n-seq-max", "1", "--n-ctx", "2048", *args.gateway_arg,
                      threads=args.threads)
    server = None if args.without_llama_server else LlamaServer(
        args.llama_server, model, threads=args.threads, n_ctx=2048,
        log_path=workdir / "llama-server.log", extra_args=["--jinja"])
    doc: dict[str, Any] = {"benchmark": "stream_cost", "machine": machine_info(),
                           "settings": {k: str(v) for k, v in vars(args).items()}}
    try:
        gateway.start(timeout=300)
        assert gateway.proc is not None
        arms = [Arm("kvcache", f"{gateway.url}/v1", gateway.proc.pid, gateway=True)]
        if server is not None:
            server.start()
            assert server.proc is not None
            arms.append(Arm("llama-server", f"http://127.0.0.1:{server.port}/v1",
                            server.proc.pid))
        for arm in arms:  # (warm: the template, the first allocations)
            arm.request(0, 8, stream=True)
        runs: dict[str, dict[str, list[dict[str, float]]]] = {
            arm.name: {way: [] for way in WAYS} for arm in arms}
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                for arm in order:
                    log(f"round {r + 1}/{args.rounds}: {arm.name}, {way}")
                    runs[arm.name][way].append(arm.run(way, args.requests, args.tokens,
                                                       1 + r * args.requests))
        results: dict[str, Any] = {}
        for name, by_way in runs.items():
            results[name] = {way: medians(by_way[way]) for way in WAYS}
            results[name]["stream_cost_ms"] = round(
                results[name]["stream"]["wall_ms"] - results[name]["whole"]["wall_ms"], 3)
        doc["results"] = results
        if "llama-server" in results:
            ours, theirs = results["kvcache"], results["llama-server"]
            doc["ratios"] = {way: round(ours[way]["wall_ms"] / theirs[way]["wall_ms"], 3)
                             for way in WAYS}
            doc["ratios"]["stream_cost"] = round(
                ours["stream_cost_ms"] / theirs["stream_cost_ms"], 3) \
                if theirs["stream_cost_ms"] > 0 else None
    finally:
        if server is not None:
            server.stop()
        gateway.close()
        shutil.rmtree(workdir, ignore_errors=True)
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
