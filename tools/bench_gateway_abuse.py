"""Gateway under abusive clients: its memory, small requests' latency, and the CPU spent
for clients that went away.

    python tools/bench_gateway_abuse.py [--model PATH] [--threads 1] [--seconds 20]
                                        [--small 60] [--abusers a,b] [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr). A real ``model-runtime gateway``
(child process, one worker of 4 slots, no cache daemon) over the model (default:
SmolLM2), with its default limits. Small requests (a short completion, one token) are
timed alone, then while 4 abusive clients loop, each sending and dropping:

- ``over_limit``: a body one byte over the body limit (refused by its Content-Length);
- ``max_body``: a body exactly at the limit, one long prompt (parsed, then refused for
  its characters);
- ``chat_100k``: a chat of 100,000 tiny messages (refused: too many messages);
- ``chat_at_limit``: a chat of as many messages as allowed, dropped after 0.5 s
  (rendered, tokenized and prefilled until the drop).

Reported: the gateway's RSS (peak, VmHWM) before and after; small requests' p50/p99
alone and under abuse and their ratio; the worker's CPU seconds in the 2 s after the
last abusive client left (a worker idle after its callers left spends ~0).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchlib import emit_json, log, machine_info, summarize
from harness.procs import Gateway, short_workdir

from model_runtime.gateway.limits import Limits


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def send(url: str, path: str, body: bytes, timeout: float) -> int:
    """POST ``body``; the status, or 0 when the client gave up (timeout) first."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (TimeoutError, OSError):
        return 0
    finally:
        conn.close()


def small_requests(url: str, model: str, n: int) -> list[float]:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        status = send(url, "/v1/completions", body, 120)
        if status != 200:
            raise RuntimeError(f"a small request answered {status}")
        times.append(time.perf_counter() - start)
    return times


def abusive_bodies(model: str, limits: Limits) -> dict[str, tuple[str, bytes, float]]:
    """name -> (path, body, seconds before the client drops it)."""
    def prompt_body(size: int) -> bytes:
        head = json.dumps({"model": model, "prompt": ""}).encode()[:-2]  # ..."prompt": "
        return head + b"a" * (size - len(head) - 2) + b'"}'

    def chat(n: int) -> bytes:
        return json.dumps({"model": model, "max_tokens": 1, "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
            for i in range(n)]}).encode()

    return {"over_limit": ("/v1/completions", prompt_body(limits.body_bytes + 1), 30),
            "max_body": ("/v1/completions", prompt_body(limits.body_bytes), 30),
            "chat_100k": ("/v1/chat/completions", chat(100_000), 30),
            "chat_at_limit": ("/v1/chat/completions", chat(limits.messages - 1), 0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20.0, help="abuse duration")
    parser.add_argument("--small", type=int, default=60, help="small requests per phase")
    parser.add_argument("--abusers", default="over_limit,max_body,chat_100k,chat_at_limit",
                        help="which abusive clients run (comma-separated)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    limits = Limits()
    workdir = short_workdir("kvba")
    model_args = ["--model", f"bench={args.model}"] if args.model else []
    gateway = Gateway(workdir / "gateway.log", "--n-seq-max", "4", "--n-ctx", "8192",
                      *model_args, threads=args.threads)
    doc: dict[str, Any] = {"benchmark": "gateway_abuse", "machine": machine_info(),
                           "settings": vars(args) | {"out": str(args.out)},
                           "limits": vars(limits)}
    try:
        gateway.start(timeout=300)
        assert gateway.proc is not None
        gw_pid = gateway.proc.pid
        status = gateway.status()
        model = status["models"][0]["id"]
        worker_pid = status["workers"][0]["pid"]
        small_requests(gateway.url, model, 5)  # warm
        doc["rss_kib_before"] = memory_kib(gw_pid)
        log(f"{args.small} small requests alone")
        alone = small_requests(gateway.url, model, args.small)

        bodies = {name: body for name, body in abusive_bodies(model, limits).items()
                  if name in args.abusers.split(",")}
        answers: dict[str, list[int]] = {name: [] for name in bodies}
        stop = threading.Event()

        def abuse(name: str) -> None:
            path, body, patience = bodies[name]
            while not stop.is_set():
                answers[name].append(send(gateway.url, path, body, patience))

        log(f"abuse for {args.seconds:g} s, small requests meanwhile")
        threads = [threading.Thread(target=abuse, args=(name,)) for name in bodies]
        for t in threads:
            t.start()
        loaded: list[float] = []
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            loaded += small_requests(gateway.url, model, 1)
            time.sleep(max(0.0, args.seconds / args.small - loaded[-1]))
        stop.set()
        for t in threads:
            t.join()
        left = time.monotonic()
        doc["rss_kib_after"] = memory_kib(gw_pid)
        time.sleep(0.5)  # the last dropped request's cancellation, the chunk in progress
        before = cpu_seconds(worker_pid)
        time.sleep(2.0)
        doc["worker_cpu_s_in_2s_after_clients_left"] = round(cpu_seconds(worker_pid) - before,
                                                              3)
        doc["measured_from_s_after_last_client"] = round(time.monotonic() - left - 2.0, 3)
        doc["abusive_requests"] = {name: {"sent": len(codes),
                                          "answers": {str(c): codes.count(c)
                                                      for c in sorted(set(codes))}}
                                   for name, codes in answers.items()}
        doc["small_alone"] = summarize(alone)
        doc["small_under_abuse"] = summarize(loaded)
        doc["p99_ratio_under_abuse"] = round(doc["small_under_abuse"]["p99"] /
                                             doc["small_alone"]["p99"], 3)
        # The peak's growth over 4 clients' bodies at the limit (target: a small multiple).
        doc["rss_peak_growth_over_4_bodies"] = round(
            (doc["rss_kib_after"]["VmHWM"] - doc["rss_kib_before"]["VmRSS"]) /
            (4 * limits.body_bytes / 1024), 3)
    finally:
        gateway.close()
        shutil.rmtree(workdir, ignore_errors=True)
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
