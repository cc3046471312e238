"""What turning llama.cpp's tiled K-quant kernels off costs (the runtime's default, for warm
equals cold: see README, "Warm equals cold"), side by side in one run.

    python tools/bench_kernels.py [--model PATH] [--threads 2] [--prompt 512]
                                  [--decode 64] [--rounds 3]

Each round runs, in a fresh process per arm (llama.cpp reads the switch once), a prefill
of ``--prompt`` tokens in one batch and ``--decode`` single-token decodes, with
``GGML_CPU_TILED_MM=0`` (the runtime's default) and ``=1`` (llama.cpp's); the arms
alternate so that a noisy machine weighs on both. Reports per arm the median prefill
seconds, milliseconds per decoded token and whether a token's scores are the same in any
batch (``computes_batches_alike``), and the ratios off / on. JSON on stdout. Models
without K-quant weights (SmolLM2's Q4_1, the default) show no difference: pass a K-quant
GGUF, e.g. Gemma-3-270M's Q4_K_M (``tools/bench_whole_states.py`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from model_runtime.runtime import default_model_path

ARM = """
import json, sys, time
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
path, threads, n_prompt, n_decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with LlamaModel(path) as model, LlamaContext(model, ContextParams(
        n_ctx=n_prompt + n_decode + 16, n_batch=n_prompt, n_ubatch=n_prompt, n_seq_max=1,
        n_threads=threads)) as ctx:
    alike = ctx.computes_batches_alike()
    tokens = [(7 * i + 11) % (model.n_vocab - 20) + 10 for i in range(n_prompt + n_decode)]
    t = time.perf_counter()
    ctx.decode(tokens[:n_prompt], list(range(n_prompt)), [0] * n_prompt,
               [False] * (n_prompt - 1) + [True])
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(n_prompt, n_prompt + n_decode):
        ctx.decode([tokens[i]], [i], [0], [True])
    decode = (time.perf_counter() - t) / n_decode
print(json.dumps({"alike": alike, "prefill_s": prefill, "decode_ms": decode * 1000}))
"""


def run_arm(tiled: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED")}
    env["GGML_CPU_TILED_MM"] = tiled
    done = subprocess.run([sys.executable, "-c", ARM, str(args.model), str(args.threads),
                           str(args.prompt), str(args.decode)], env=env, capture_output=True,
                          text=True, timeout=1200, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for arm, tiled in (("off", "0"), ("on", "1")):
            runs[arm].append(run_arm(tiled, args))
    arms = {arm: {"batch_invariant": all(r["alike"] for r in rows),
                  "prefill_s": round(statistics.median(r["prefill_s"] for r in rows), 3),
                  "decode_ms": round(statistics.median(r["decode_ms"] for r in rows), 2)}
            for arm, rows in runs.items()}
    print(json.dumps({
        "model": os.path.basename(args.model), "threads": args.threads,
        "prompt_tokens": args.prompt, "decoded_tokens": args.decode, "rounds": args.rounds,
        "tiled_off": arms["off"], "tiled_on": arms["on"],
        "prefill_off_over_on": round(arms["off"]["prefill_s"] / arms["on"]["prefill_s"], 3),
        "decode_off_over_on": round(arms["off"]["decode_ms"] / arms["on"]["decode_ms"], 3),
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
