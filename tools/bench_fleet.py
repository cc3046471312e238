"""A fleet of three hosts behind vllm-router, per routing policy: prompt tokens prefilled
and time to first token.

    python tools/bench_fleet.py [--systems 6] [--users 6] [--system-words 750]
                                [--policies round_robin,cache_aware,kv_aware]
                                [--tiers local,shared] [--model PATH] [--threads 1]

Three hosts on this machine, each a kvcache daemon and a gateway over it (one worker, one
thread), behind one vllm-router. ``kv_aware`` is fed by the hosts' KV events: each
daemon's (disk and host memory, rank 0) and each worker's live sequences (device, rank 1).
The workload: ``--systems`` system prompts of about 1,000 tokens, each asked ``--users``
user messages, interleaved (the first message of every system prompt, then the second of
every one, ..., each round starting one prompt further), one request at a time, streamed.
``--policies llama-server`` adds the anchor: three llama-servers behind ``cache_aware``. Per policy and tier (``local``: each
host's own cache; ``shared``: one Redis for the fleet as well), every host starts empty.

Printed as JSON: per run the prompt tokens, the tokens prefilled (prompt minus
``cached_tokens``: what no cache served), TTFT median and mean, and per policy the ratios
to ``round_robin`` of the same tier. Prefilled tokens do not depend on the machine's load;
TTFTs do (2 shared cores): read them as ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from harness.procs import Daemon, Gateway, RedisServer, use_own_kvcache_dir
from harness.routers import VllmRouter, free_port
from harness.system_prompt import build_system_prompt
from llama_server_arm import DEFAULT_BINARY, LlamaServer

from model_runtime.runtime import default_model_path

BLOCK = 256
USERS = ["Where is my order?", "Can I return a watch?", "My router overheats.",
         "How long is the warranty?", "Do you ship abroad?", "Summarise what we agreed."]


@contextmanager
def fleet(workdir: Path, model: Path, threads: int, remote: str | None
          ) -> Iterator[list[dict[str, Any]]]:
    """Three hosts: each a daemon (KV events) and a gateway (one worker, its events)."""
    hosts: list[dict[str, Any]] = []
    with ExitStack() as stack:
        key = workdir / "fleet-key"
        key.write_text("k" * 64)
        key.chmod(0o600)
        for i in range(3):
            events, worker_events = f"tcp://127.0.0.1:{free_port()}", \
                f"tcp://127.0.0.1:{free_port()}"
            remote_args = ["--remote", remote, "--remote-signing-key-file", str(key)] \
                if remote else []
            daemon = Daemon(workdir / f"host{i}", "--block-size", str(BLOCK), "--kv-events",
                            events, *remote_args)
            stack.callback(daemon.close)
            daemon.start()
            gateway = Gateway(workdir / f"host{i}-gateway.log", "--model", f"smol={model}",
                              "--n-ctx", "4096", "--kv-events", worker_events,
                              cache=daemon.address, threads=threads)
            stack.callback(gateway.close)
            gateway.start(timeout=300)
            hosts.append({"daemon": daemon, "gateway": gateway,
                          "events": [events, worker_events]})
        yield hosts


@contextmanager
def llama_servers(workdir: Path, binary: Path, model: Path, threads: int
                  ) -> Iterator[list[str]]:
    """The anchor: three llama-servers (one slot each, chat templates on)."""
    with ExitStack() as stack:
        urls = []
        for i in range(3):
            server = LlamaServer(binary, model, threads=threads, n_ctx=4096,
                                 log_path=workdir / f"llama-server{i}.log",
                                 extra_args=["--jinja"])
            stack.enter_context(server)
            server.start()
            urls.append(f"http://127.0.0.1:{server.port}")
        yield urls


def run_policy(urls: list[str], sources: dict[str, list[str]] | None, policy: str,
               workdir: Path, prompts: list[tuple[str, str]]) -> dict[str, Any]:
    router = VllmRouter(workdir / f"router-{policy}.log", urls, policy, kv_sources=sources,
                        block_size=BLOCK, model="smol")
    ttfts, prompt_tokens, prefilled = [], 0, 0
    with router:
        router.start()
        client = router.client()
        for system, user in prompts:
            t0 = time.perf_counter()
            first = None
            usage = None
            for chunk in client.chat.completions.create(
                    model="smol", messages=[{"role": "system", "content": system},
                                            {"role": "user", "content": user}],
                    max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True}):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
                usage = chunk.usage or usage
            assert usage is not None
            ttfts.append((first if first is not None else time.perf_counter() - t0) * 1000)
            cached = usage.prompt_tokens_details.cached_tokens \
                if usage.prompt_tokens_details else 0
            prompt_tokens += usage.prompt_tokens
            prefilled += usage.prompt_tokens - (cached or 0)
            time.sleep(0.3)  # the saves and their events land before the next request
    return {"policy": policy, "requests": len(prompts), "prompt_tokens": prompt_tokens,
            "prefilled_tokens": prefilled, "ttft_ms_median": round(statistics.median(ttfts), 1),
            "ttft_ms_mean": round(statistics.mean(ttfts), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", type=int, default=6)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=750,
                        help="about 1,000 SmolLM2 tokens")
    parser.add_argument("--policies", default="round_robin,cache_aware,kv_aware",
                        help="also: llama-server (three llama-servers behind cache_aware, "
                             "the anchor; local tier only)")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY,
                        help="its binary (tools/build_llama_server.sh)")
    parser.add_argument("--tiers", default="local,shared")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    use_own_kvcache_dir()  # a benchmark leaves no ~/.cache/kvcache behind
    model = args.model or default_model_path()
    base = build_system_prompt(args.system_words)
    systems = [f"[Desk {i}] " + base for i in range(args.systems)]
    # Interleaved: every system prompt's first message, then every one's second, ...; each
    # round starts one system prompt further, so round robin's turn never lines up with a
    # system prompt (with 6 prompts and 3 hosts it would send each to one host for ever).
    prompts = [(systems[(i + u) % len(systems)], USERS[u % len(USERS)] + f" (#{u})")
               for u in range(args.users) for i in range(len(systems))]
    results: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvbench-fleet-"))
    try:
        for tier_mode in args.tiers.split(","):
            for policy in args.policies.split(","):
                run_dir = workdir / f"{tier_mode}-{policy}"
                run_dir.mkdir()
                if policy == "llama-server":
                    if tier_mode != "local":
                        continue
                    with llama_servers(run_dir, args.llama_server, model, args.threads) as urls:
                        result = run_policy(urls, None, "cache_aware", run_dir, prompts)
                    result["policy"] = "llama-server/cache_aware"
                    result["tier"] = tier_mode
                    results.append(result)
                    print(json.dumps(result), file=sys.stderr, flush=True)
                    continue
                with ExitStack() as stack:
                    remote = None
                    if tier_mode == "shared":
                        redis = RedisServer()
                        stack.callback(redis.close)
                        remote = redis.start().url
                    with fleet(run_dir, model, args.threads, remote) as hosts:
                        urls = [h["gateway"].url for h in hosts]
                        sources = {h["gateway"].url: h["events"] for h in hosts} \
                            if policy == "kv_aware" else None
                        result = run_policy(urls, sources, policy, run_dir, prompts)
                result["tier"] = tier_mode
                results.append(result)
                print(json.dumps(result), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for r in results:
        anchor = next((a for a in results
                       if a["tier"] == r["tier"] and a["policy"] == "round_robin"), None)
        if anchor:
            r["prefilled_vs_round_robin"] = round(r["prefilled_tokens"] /
                                                  max(1, anchor["prefilled_tokens"]), 3)
            r["ttft_median_vs_round_robin"] = round(r["ttft_ms_median"] /
                                                    anchor["ttft_ms_median"], 3)
    print(json.dumps({"systems": args.systems, "users": args.users, "hosts": 3,
                      "threads": args.threads, "block_size": BLOCK, "model": model.name,
                      "runs": results}, indent=1))


if __name__ == "__main__":
    main()
