"""The per-token cost of a request's sampler (llama.cpp's sampler chain) against the
decode step it follows, on the real model, in one process:

    python tools/bench_sampler.py [--model PATH] [--threads 2] [--tokens 96] [--rounds 3]
                                  [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr).

A ~300-token prompt is decoded once; then, for each sampler configuration, ``--tokens``
tokens are generated one decode at a time from a copy of that prompt's state (so every
configuration decodes the same positions), timing the decode and the sampler's ``take``
separately. Configurations: ``argmax`` (numpy's argmax over the raw scores: the floor any
sampler is compared with), ``greedy`` (the chain with llama.cpp's greedy sampler, what an
unconstrained temperature-0 request uses), ``penalties`` (greedy with repeat, presence and
frequency penalties over 64 tokens), ``full`` (top-k 40, top-p 0.95, min-p 0.05,
temperature 0.8, penalties, a seeded draw), ``json_schema`` (greedy under a strict
schema's grammar). Reported per configuration: median microseconds per token of sampling
and of decoding, and the sampler's share of a token (sample / (sample + decode)); rounds
alternate the configurations' order.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import emit_json, log, machine_info
from harness.system_prompt import build_system_prompt

from model_runtime.grammar import json_schema_grammar
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
from model_runtime.sampler import RequestSampler
from model_runtime.sampling import Sampling, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "tags", "priority"],
          "properties": {"name": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "priority": {"enum": ["low", "normal", "urgent"]}}}
N_CTX = 2048
BATCH = 512  # ContextParams' default n_batch


def configurations(grammar: str) -> dict[str, SamplingParams | None]:
    penalties = {"repeat_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": 0.3,
                 "penalty_last_n": 64}
    return {"argmax": None,
            "greedy": SamplingParams(),
            "penalties": SamplingParams(Sampling(**penalties)),
            "full": SamplingParams(Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                            seed=7, **penalties)),
            "json_schema": SamplingParams(grammar=grammar)}


def generate(ctx: LlamaContext, prompt: list[int], prompt_logits: np.ndarray,
             params: SamplingParams | None, tokens: int) -> tuple[list[float], list[float]]:
    """From the prompt's state in sequence 0 (copied to sequence 1): ``tokens`` steps of
    decode-then-sample on sequence 1; the seconds of each decode and of each sample."""
    ctx.seq_clear(1)
    ctx.seq_copy(0, 1)
    sampler = None if params is None else RequestSampler(
        ctx.model, params, prompt=prompt, choice=0, n_ctx=N_CTX)
    decode_s: list[float] = []
    sample_s: list[float] = []
    try:
        logits = prompt_logits
        position = len(prompt)
        for _ in range(tokens):
            start = time.perf_counter()
            token = int(np.argmax(logits)) if sampler is None else sampler.take(logits)
            sample_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            ctx.decode([token], [position], [1], [True])
            logits = ctx.logits(0)
            decode_s.append(time.perf_counter() - start)
            position += 1
    finally:
        if sampler is not None:
            sampler.close()
    return decode_s, sample_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        from model_runtime.runtime import default_model_path

        args.model = default_model_path()
    model = LlamaModel(args.model)
    ctx = LlamaContext(model, ContextParams(n_ctx=N_CTX, n_seq_max=2, n_threads=args.threads))
    try:
        prompt = model.tokenize(build_system_prompt(300))
        log(f"prefilling {len(prompt)} tokens")
        for start in range(0, len(prompt), BATCH):
            chunk = prompt[start:start + BATCH]
            last = start + len(chunk) == len(prompt)
            ctx.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk),
                       [last and i == len(chunk) - 1 for i in range(len(chunk))])
        prompt_logits = ctx.logits(len(chunk) - 1)
        configs = configurations(json_schema_grammar(SCHEMA))
        runs: dict[str, dict[str, list[float]]] = {
            name: {"decode": [], "sample": []} for name in configs}
        names = list(configs)
        for round_no in range(args.rounds):
            for name in names if round_no % 2 == 0 else names[::-1]:
                log(f"round {round_no + 1}: {name}")
                decode_s, sample_s = generate(ctx, prompt, prompt_logits, configs[name],
                                             args.tokens)
                runs[name]["decode"] += decode_s
                runs[name]["sample"] += sample_s
    finally:
        ctx.close()
        model.close()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        decode_us = statistics.median(run["decode"]) * 1e6
        sample_us = statistics.median(run["sample"]) * 1e6
        results[name] = {"sample_us_median": round(sample_us, 1),
                         "sample_us_p90": round(float(np.percentile(run["sample"], 90)) * 1e6,
                                                1),
                         "decode_us_median": round(decode_us, 1),
                         "sampler_share": round(sample_us / (sample_us + decode_us), 4)}
    floor = results["argmax"]["sample_us_median"] + results["argmax"]["decode_us_median"]
    for result in results.values():
        result["token_time_over_argmax"] = round(
            (result["sample_us_median"] + result["decode_us_median"]) / floor, 3)
    emit_json({"benchmark": "sampler", "machine": machine_info(),
               "settings": {k: str(v) for k, v in vars(args).items()},
               "prompt_tokens": len(prompt), "n_vocab": model.n_vocab,
               "configurations": results}, args.out)


if __name__ == "__main__":
    main()
