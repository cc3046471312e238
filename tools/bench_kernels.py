"""What each kernel set costs (model_runtime/kernels.py), side by side in one run:

    python tools/bench_kernels.py [--model PATH] [--threads 2] [--prompt 512]
                                  [--context 1800] [--suffix 32] [--decode 48] [--rounds 3]
                                  [--streams 4]
                                  [--sets deterministic,deterministic+fa,fast,fast+fa,builtin]
                                  [--out FILE.json]

The sets: ``deterministic`` (the default: llamafile's tinyBLAS for every float product,
single tokens included; no repacking; tiled K-quant kernels off), ``fast`` (llama.cpp's
defaults: what llama-server runs) and ``builtin`` (the library llama-cpp-python was built
with by tools/setup.sh: no llamafile, no repacking; the deterministic choice before the
sets existed); a set's name with ``+fa`` runs it with flash attention (llama-server's
default on CPU; the deterministic set computes it by its vec-only path alone,
batch-invariant too: tools/patches/ggml-flash-attn-batch-invariant.patch). Each round
runs every set in a fresh process (the kernels load once per process), in alternating
order so a noisy machine weighs on all: a prefill of
``--prompt`` tokens in one batch; a context of ``--context`` tokens, then a suffix of
``--suffix`` tokens on it (a new user message after a long shared system prompt: what a
live or restored prefix hit prefills) and ``--decode`` single-token decodes (median ms),
then as many steps of ``--streams`` sequences on that context, a token each (what
concurrent clients decode; median ms a step).
Also whether llama.cpp's start-up check finds a token computed alike alone and in a
batch. Reports the medians per set and each set's ratios to the deterministic one. JSON
on stdout. SmolLM2 (Q4_1) shows llamafile's effect on attention; a K-quant model (e.g.
Gemma-3-270M's Q4_K_M, which tools/bench_whole_states.py installs) shows repacking and
the tiled kernels too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchlib import at_least_one, emit_json, log, machine_info

from model_runtime import kernels
from model_runtime.runtime import default_model_path

ARM = """
import json, statistics, sys, time
import model_runtime
from model_runtime import kernels
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
path = sys.argv[1]
threads, n_prompt, n_context, n_suffix, n_decode, flash_attn, streams = map(int, sys.argv[2:9])
n_ctx = max(n_prompt, n_context + n_suffix + 2 * n_decode) + 16
with LlamaModel(path) as model, LlamaContext(model, ContextParams(
        n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=streams, n_threads=threads,
        flash_attn=bool(flash_attn))) as ctx:
    alike = ctx.computes_batches_alike()
    toks = [(7 * i + 11) % (model.n_vocab - 20) + 10 for i in range(n_ctx)]

    def prefill(start, end):
        for s in range(start, end, 512):
            e = min(s + 512, end)
            ctx.decode(toks[s:e], list(range(s, e)), [0] * (e - s),
                       [False] * (e - s - 1) + [True])

    t = time.perf_counter(); prefill(0, n_prompt); prompt_s = time.perf_counter() - t
    ctx.seq_clear(0)
    prefill(0, n_context)
    t = time.perf_counter(); prefill(n_context, n_context + n_suffix)
    suffix_ms = (time.perf_counter() - t) * 1e3
    steps = []
    for i in range(n_context + n_suffix, n_context + n_suffix + n_decode):
        t = time.perf_counter()
        ctx.decode([toks[i]], [i], [0], [True])
        steps.append((time.perf_counter() - t) * 1e3)
    for seq in range(1, streams):  # the same context in every stream, a token each a step
        ctx.seq_copy(0, seq)
    together = []
    start = n_context + n_suffix + n_decode
    for i in range(start, start + n_decode if streams > 1 else start):
        t = time.perf_counter()
        ctx.decode([toks[i]] * streams, [i] * streams, list(range(streams)), [True] * streams)
        together.append((time.perf_counter() - t) * 1e3)
print(json.dumps({"kernels": kernels.active(), "alike": alike, "prefill_s": prompt_s,
                  "suffix_ms": suffix_ms, "decode_ms": statistics.median(steps),
                  "streams_decode_ms": statistics.median(together) if together else 0.0}))
"""


FLASH_ATTN_SUFFIX = "+fa"


def arm_env(name: str) -> dict[str, str]:
    name = name.removesuffix(FLASH_ATTN_SUFFIX)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GGML_CPU_TILED") and k not in (kernels.ENV,
                                                              kernels.LIB_PATH_ENV)}
    if name == kernels.BUILTIN:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
        assert spec is not None and spec.origin is not None
        env[kernels.LIB_PATH_ENV] = str(Path(spec.origin).parent / "lib")
    else:
        env[kernels.ENV] = name
    return env


def run_arm(name: str, args: argparse.Namespace) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", ARM, str(args.model), str(args.threads),
                           str(args.prompt), str(args.context), str(args.suffix),
                           str(args.decode), str(int(name.endswith(FLASH_ATTN_SUFFIX))),
                           str(args.streams)],
                          env=arm_env(name), capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=1800)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--rounds", type=at_least_one, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--sets", default="deterministic,deterministic+fa,fast,fast+fa,builtin")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    names = args.sets.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_no in range(args.rounds):
        for name in names if round_no % 2 == 0 else names[::-1]:
            log(f"round {round_no + 1}: {name}")
            runs[name].append(run_arm(name, args))
    sets = {name: {"loaded": rows[0]["kernels"],
                   "batch_invariant_check": all(r["alike"] for r in rows),
                   **{k: round(statistics.median(r[k] for r in rows), 3)
                      for k in ("prefill_s", "suffix_ms", "decode_ms", "streams_decode_ms")}}
            for name, rows in runs.items()}
    base = sets.get(kernels.DETERMINISTIC)
    ratios = {name: {f"{k}_over_deterministic": round(s[k] / base[k], 3)
                     for k in ("prefill_s", "suffix_ms", "decode_ms", "streams_decode_ms")
                     if base[k]}  # (no step of several streams with --streams 1)
              for name, s in sets.items() if base is not None and name != kernels.DETERMINISTIC}
    emit_json({"benchmark": "kernels", "command": "python tools/bench_kernels.py " +
               " ".join(sys.argv[1:]), "model": os.path.basename(args.model),
               "threads": args.threads, "prompt_tokens": args.prompt,
               "context_tokens": args.context, "suffix_tokens": args.suffix,
               "decoded_tokens": args.decode, "streams": args.streams, "rounds": args.rounds,
               "machine": machine_info(), "sets": sets, "ratios": ratios}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
