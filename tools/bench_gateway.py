"""Gateway benchmark: what the OpenAI-compatible gateway costs, and how fast it recovers.

    python tools/bench_gateway.py [--model PATH] [--workers 2] [--threads 1] [--n 20]
                                  [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr). A real kvcache daemon and a real
``model-runtime gateway`` (child processes) over the model (default: SmolLM2):

1. ``ttft``: time to the first streamed token of warm requests (a shared system prompt,
   a distinct user message each) through the gateway with OpenAI's client, against the
   same requests sent straight to the worker's gRPC socket and to a runtime in this
   process (same model, threads and daemon), interleaved in one run. The overheads are
   the medians of the paired differences.
2. ``throughput``: requests per second with 4 concurrent clients through the gateway.
3. ``restart``: a worker SIGKILLed; seconds until the gateway reports it ready again, and
   the first request after it (warm from the daemon or not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from benchlib import Daemon, emit_json, log, machine_info, paired_ratio, summarize
from harness.procs import Gateway, short_workdir
from harness.system_prompt import build_system_prompt

from model_runtime.v1 import runtime_pb2 as pb
from model_runtime.v1 import runtime_pb2_grpc as pb_grpc


def messages(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def gateway_ttft(client: Any, model: str, msgs: list[dict[str, str]]) -> tuple[float, Any]:
    """Seconds to the first chunk carrying text, and the final chunk's kvcache details."""
    start = time.perf_counter()
    first = None
    details = None
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                                temperature=0, stream=True):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.model_extra and chunk.model_extra.get("kvcache"):
            details = chunk.model_extra["kvcache"]
    return (first if first is not None else time.perf_counter() - start), details


def direct_ttft(stub: pb_grpc.ModelRuntimeStub, msgs: list[dict[str, str]]) -> tuple[float, Any]:
    request = pb.CompleteRequest(max_tokens=8, temperature=0)
    request.chat.messages.extend(pb.ChatMessage(**m) for m in msgs)
    start = time.perf_counter()
    first = None
    done = None
    for event in stub.Complete(request, timeout=120):
        if first is None and event.text:
            first = time.perf_counter() - start
        if event.HasField("done"):
            done = event.done
    return (first if first is not None else time.perf_counter() - start), done


def in_process_ttft(rt: Any, msgs: list[dict[str, str]]) -> tuple[float, str]:
    """Seconds to the first token of an in-process Runtime, and its hit kind."""
    from model_runtime.request import Completion, TokenEvent

    start = time.perf_counter()
    first = None
    kind = ""
    for event in rt.complete(messages=msgs, max_tokens=8, temperature=0, stream=True):
        if first is None and isinstance(event, TokenEvent) and event.text:
            first = time.perf_counter() - start
        if isinstance(event, Completion):
            kind = event.cache_hit_kind
    return (first if first is not None else time.perf_counter() - start), kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=20, help="TTFT pairs")
    parser.add_argument("--requests", type=int, default=10,
                        help="requests per client in the throughput run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import openai

    workdir = short_workdir("kvbg")
    daemon = Daemon(workdir / "data", workdir / "ram", log_dir=workdir)
    model_args = ["--model", f"bench={args.model}"] if args.model else []
    gateway = Gateway(workdir / "gateway.log", "--workers", str(args.workers), "--n-seq-max",
                      "2", "--n-ctx", "4096", *model_args, cache=daemon.address,
                      threads=args.threads)
    doc: dict[str, Any] = {"benchmark": "gateway", "machine": machine_info(),
                           "settings": vars(args) | {"out": str(args.out)}}
    try:
        daemon.start()
        log("starting the gateway and its workers")
        t0 = time.perf_counter()
        gateway.start(timeout=300)
        doc["gateway_start_s"] = round(time.perf_counter() - t0, 3)
        model = gateway.status()["models"][0]["id"]
        client = gateway.client(timeout=300)
        system = build_system_prompt(400)

        # 1. TTFT, gateway vs the worker's own gRPC socket, interleaved.
        first = client.chat.completions.create(model=model, messages=messages(system, "Hi"),
                                               max_tokens=4, temperature=0)
        worker = first.model_extra["kvcache"]["worker"]
        socket = next(w["socket"] for w in gateway.status()["workers"]
                      if w["name"] == worker)
        log(f"TTFT: {args.n} triples on worker {worker} and in process")
        from model_runtime.config import RuntimeConfig
        from model_runtime.runtime import Runtime

        via, direct, local, kinds = [], [], [], set()
        config = RuntimeConfig(n_threads=args.threads)
        with grpc.insecure_channel(f"unix:{socket}") as channel, \
                Runtime(args.model, cache_address=daemon.address, config=config) as rt:
            stub = pb_grpc.ModelRuntimeStub(channel)
            in_process_ttft(rt, messages(system, "Hi"))  # its first request restores
            for i in range(args.n):
                arms = [("gateway", f"Question number {i}, please?"),
                        ("direct", f"Question number {i}, thanks?"),
                        ("in_process", f"Question number {i}, right?")]
                arms = arms[i % 3:] + arms[: i % 3]
                for arm, user in arms:
                    if arm == "gateway":
                        seconds, details = gateway_ttft(client, model, messages(system, user))
                        via.append(seconds)
                        kinds.add(("gateway", details["hit_kind"], details["worker"]))
                    elif arm == "direct":
                        seconds, done = direct_ttft(stub, messages(system, user))
                        direct.append(seconds)
                        kinds.add(("direct", done.cache_hit_kind, worker))
                    else:
                        seconds, kind = in_process_ttft(rt, messages(system, user))
                        local.append(seconds)
                        kinds.add(("in_process", kind, "-"))

        def overhead_ms(a: list[float], b: list[float]) -> float:
            diffs = sorted(x - y for x, y in zip(a, b, strict=True))
            return round(diffs[len(diffs) // 2] * 1e3, 2)

        doc["ttft"] = {"gateway": summarize(via), "direct_grpc": summarize(direct),
                       "in_process": summarize(local),
                       "overhead_ms_median": overhead_ms(via, direct),
                       "ratio_paired": paired_ratio(via, direct),
                       "overhead_vs_in_process_ms_median": overhead_ms(via, local),
                       "ratio_vs_in_process_paired": paired_ratio(via, local),
                       "hit_kinds": sorted(list(k) for k in kinds)}

        # 2. Requests per second, 4 concurrent clients.
        log(f"throughput: 4 clients x {args.requests} requests")
        errors: list[str] = []
        latencies: list[float] = []

        def client_loop(index: int) -> None:
            own = gateway.client(timeout=300)
            for j in range(args.requests):
                start = time.perf_counter()
                try:
                    own.chat.completions.create(
                        model=model, max_tokens=16, temperature=0,
                        messages=messages(system, f"Client {index} asks question {j}."))
                    latencies.append(time.perf_counter() - start)
                except openai.APIError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(4)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        doc["throughput"] = {"clients": 4, "requests": len(latencies),
                             "errors": len(errors), "error_samples": errors[:3],
                             "seconds": round(elapsed, 3),
                             "requests_per_s": round(len(latencies) / elapsed, 3),
                             "latency": summarize(latencies) if latencies else None}

        # 3. Restart after SIGKILL.
        before = next(w for w in gateway.status()["workers"] if w["name"] == worker)
        log(f"restart: SIGKILL worker {worker} (pid {before['pid']})")
        killed = time.perf_counter()
        os.kill(before["pid"], signal.SIGKILL)
        while True:
            w = next(w for w in gateway.status()["workers"] if w["name"] == worker)
            if w["state"] == "ready" and w["pid"] != before["pid"]:
                break
            time.sleep(0.01)
        ready_s = time.perf_counter() - killed
        # The restarted worker's first request (sent to it directly: the gateway would
        # route this prompt to a worker that still holds it live).
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            seconds, done = direct_ttft(pb_grpc.ModelRuntimeStub(channel),
                                        messages(system, "After the restart?"))
        doc["restart"] = {"kill_to_ready_s": round(ready_s, 3),
                          "spawn_to_ready_s": w["last_start_s"],
                          "first_request_ttft_ms": round(seconds * 1e3, 2),
                          "first_request_hit_kind": done.cache_hit_kind,
                          "first_request_tier": done.cache_tier,
                          "first_request_tokens_restored": done.cache_delta.tokens_read,
                          "restart_history": w["restart_history"]}
    finally:
        gateway.close()
        daemon.close()
        shutil.rmtree(workdir, ignore_errors=True)
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
