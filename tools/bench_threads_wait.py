"""How llama.cpp's threads wait (model_runtime/kernels.py, ``--threads-wait``), side by
side in one run, on a quiet machine and with other work on the cores:

    python tools/bench_threads_wait.py [--model PATH] [--threads 2] [--tokens 64]
                                       [--rounds 3] [--loads 0,2]
                                       [--llama-server PATH | --without-llama-server]
                                       [--gateway] [--out FILE.json]

Arms: the runtime with its threads spinning briefly at llama.cpp's barriers (``brief``,
the default: 1,000 times, then sleeping), as long as OpenMP's default (``spin``: 300,000
times) and not at all (``sleep``: ``OMP_WAIT_POLICY=passive``), each in a fresh process
(libgomp reads its settings when it loads), streaming ``--tokens`` greedy tokens after a ~100-token prompt
through ``Runtime.complete``; and llama-server (tools/build_llama_server.sh) with its
default polling and with ``--poll 0``, the same tokens through ``/completion``. With
``--gateway``, also the whole stack: ``model-runtime gateway`` (one worker, each way of
waiting) and llama-server, each streaming the same tokens to OpenAI's client through
``/v1/completions``, timed by the client alike ((last - first chunk) / (completion tokens
- 1)): what a user of each server sees, with the gateway's and the client's work on the
same cores. Each
``--loads`` value N runs every arm with N busy processes (pure Python loops) beside it,
the arms' order alternating by round. Reported per load and arm: the median time per
token after the first ((last - first token) / (tokens - 1), ms), and each arm's ratio to
``brief`` (and, with ``--gateway``, the gateway's over llama-server streamed). JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import at_least, at_least_one, emit_json, log, machine_info
from harness.procs import Gateway
from llama_server_arm import DEFAULT_BINARY, LlamaServer

from model_runtime import kernels
from model_runtime.runtime import default_model_path

PROMPT = ("A short history of the lighthouse keepers of the northern coast, told by the "
          "last of them, who kept the light at the end of the long breakwater for forty "
          "years and wrote down everything the sea brought in: ") * 2

ARM = """
import json, sys, time
from model_runtime import kernels
from model_runtime.config import RuntimeConfig
from model_runtime.request import TokenEvent
from model_runtime.runtime import Runtime
path, threads, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with Runtime(path, cache_address=None, config=RuntimeConfig(n_threads=threads, n_ctx=1024,
                                                            n_seq_max=1)) as rt:
    rt.complete(prompt=prompt, max_tokens=4, temperature=0.0)  # (warm)
    stamps = []
    for event in rt.complete(prompt=prompt + " ", max_tokens=tokens, temperature=0.0,
                             ignore_eos=True, stream=True):
        if isinstance(event, TokenEvent) and event.token >= 0:
            stamps.append(time.perf_counter())
    print(json.dumps({"waiting": kernels.waiting(),
                      "per_token_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3}))
"""


def burn() -> None:
    while True:
        pass


# The runtime's arms: the environment each starts with.
RUNTIME_ARMS = {"brief": {kernels.WAIT_ENV: "brief"}, "spin": {kernels.WAIT_ENV: "spin"},
                "sleep": {kernels.OMP_WAIT_ENV: "passive"}}


def runtime_arm(arm: str, args: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items()
           if k not in (kernels.WAIT_ENV, kernels.OMP_WAIT_ENV, kernels.SPIN_COUNT_ENV)}
    env.update(RUNTIME_ARMS[arm])
    done = subprocess.run([sys.executable, "-c", ARM, str(args.model), str(args.threads),
                           str(args.tokens), PROMPT], capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"runtime arm {arm} failed:\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return float(got["per_token_ms"])


def server_arm(poll: str | None, args: argparse.Namespace, workdir: Path) -> float:
    extra = ["--poll", poll] if poll is not None else []
    with LlamaServer(args.llama_server, args.model, threads=args.threads, n_ctx=1024,
                     log_path=workdir / f"llama-server-{poll}.log", extra_args=extra) as server:
        server.start()
        server.complete(PROMPT, 4)
        reply = server.complete(PROMPT + " ", args.tokens)
    return float(reply.timings["predicted_per_token_ms"])


# The whole stack's arms: a gateway whose worker waits so, and llama-server, both streamed.
GATEWAY_ARMS = {"gateway brief": kernels.BRIEF, "gateway spin": kernels.SPIN}
SERVER_STREAMED = "llama-server streamed"


def streamed_per_token(base_url: str, tokens: int) -> float:
    """ms a token as OpenAI's client sees it, after a warm-up request."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    client.completions.create(model="bench", prompt=PROMPT, max_tokens=4, temperature=0)
    stamps: list[float] = []
    completion_tokens = 0
    for chunk in client.completions.create(
            model="bench", prompt=PROMPT + " ", max_tokens=tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (completion_tokens - 1) * 1e3


def gateway_arm(wait: str, args: argparse.Namespace, workdir: Path) -> float:
    with Gateway(workdir / f"gateway-{wait}.log", "--model", f"bench={args.model}",
                 "--workers", "1", "--n-seq-max", "1", "--n-ctx", "1024",
                 f"--worker-args=--threads-wait {wait}", threads=args.threads) as gateway:
        gateway.start(timeout=300)
        return streamed_per_token(f"{gateway.url}/v1", args.tokens)


def server_streamed_arm(args: argparse.Namespace, workdir: Path) -> float:
    with LlamaServer(args.llama_server, args.model, threads=args.threads, n_ctx=1024,
                     log_path=workdir / "llama-server-streamed.log") as server:
        server.start()
        return streamed_per_token(f"http://127.0.0.1:{server.port}/v1", args.tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=at_least(2), default=64,
                    help="tokens a request generates (a time a token needs two)")
    ap.add_argument("--rounds", type=at_least_one, default=3)
    ap.add_argument("--loads", default="0,2")
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--without-llama-server", action="store_true")
    ap.add_argument("--gateway", action="store_true",
                    help="also the whole stack: the gateway's ways of waiting, streamed")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with_server = not args.without_llama_server
    if with_server and not args.llama_server.is_file():
        log(f"no llama-server at {args.llama_server}: build it with "
            "tools/build_llama_server.sh, or pass --without-llama-server")
        return 2
    arms = ["brief", "spin", "sleep"] + (["llama-server", "llama-server --poll 0"]
                                         if with_server else [])
    if args.gateway:
        arms += list(GATEWAY_ARMS) + ([SERVER_STREAMED] if with_server else [])
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvwait") as tmp:
        for load in (int(x) for x in args.loads.split(",")):
            burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(load)]
            for b in burners:
                b.start()
            try:
                samples: dict[str, list[float]] = {arm: [] for arm in arms}
                for round_no in range(args.rounds):
                    for arm in (arms if round_no % 2 == 0 else arms[::-1]):
                        log(f"load {load}, round {round_no + 1}: {arm}")
                        if arm in RUNTIME_ARMS:
                            samples[arm].append(runtime_arm(arm, args))
                        elif arm in GATEWAY_ARMS:
                            samples[arm].append(gateway_arm(GATEWAY_ARMS[arm], args, Path(tmp)))
                        elif arm == SERVER_STREAMED:
                            samples[arm].append(server_streamed_arm(args, Path(tmp)))
                        else:
                            samples[arm].append(server_arm(
                                "0" if arm.endswith("0") else None, args, Path(tmp)))
                results[f"load_{load}"] = samples
            finally:
                for b in burners:
                    b.terminate()
                    b.join()
    doc: dict[str, Any] = {"machine": machine_info(), "threads": args.threads,
                           "tokens": args.tokens, "rounds": args.rounds, "loads": {}}
    for name, samples in results.items():
        medians = {arm: round(statistics.median(v), 2) for arm, v in samples.items()}
        doc["loads"][name] = {
            "per_token_ms_median": medians,
            "per_token_ms": {arm: [round(x, 2) for x in v] for arm, v in samples.items()},
            "ratio_to_brief": {arm: round(m / medians["brief"], 3) for arm, m in medians.items()},
        }
        if SERVER_STREAMED in medians:  # the stacks side by side, as their users see them
            doc["loads"][name]["gateway_over_llama_server_streamed"] = {
                arm: round(medians[arm] / medians[SERVER_STREAMED], 3) for arm in GATEWAY_ARMS}
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
