"""Warm against cold under each kernel set: how often a reused state continues exactly as
a cold prefill of the same prompt does, with the deterministic kernels (the default) and
with llama.cpp's own (``--kernels fast``):

    python tools/bench_warm_cold.py [--model PATH] [--prompts 12] [--threads 2]
                                    [--sets deterministic,fast] [--out FILE.json]

For each prompt (chat-like text of 60 to 400 tokens), a cold run with no cache is the
reference; then, from a runtime that saved the prompt to a daemon, the reuse paths of the
determinism suite (tests/runtime/test_determinism.py): an exact hit that samples from the
stored scores, an exact hit whose last token is computed again, partial hits whose
suffix is 1, 7 and 40 tokens, and an idle sequence's live KV extended. Greedy, 16 tokens,
log probabilities kept. Per set: paths compared, those whose tokens equal cold's, those
equal bit for bit (tokens and log probabilities), the largest log-probability difference,
and whether llama.cpp's start-up check found a token computed alike alone and in a batch.
Each set runs in a process of its own (llama.cpp's kernels load once per process).
Prints ONE JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import emit_json, log, machine_info

ARM = r"""
import json, random, sys
from pathlib import Path
from harness.procs import Daemon
from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime

model, n_prompts, threads, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
WORDS = ("the order of the customer arrived late because the parcel went to the wrong city "
         "and the driver called twice before noon so we refund the fee and send a new one "
         "tomorrow with tracking number 44721 to Paris Lyon Rome and Oslo").split()
config = RuntimeConfig(n_ctx=2048, n_seq_max=2, n_threads=threads, continued_interval=0,
                       reuse_live=False)
daemon = Daemon(work / "data", "--log-level", "WARNING").start(timeout=60)
out = {"paths": {}, "max_logprob_diff": 0.0}
try:
    with Runtime(model, cache_address=None, config=config) as cold, \
         Runtime(model, cache_address=daemon.address, config=config) as writer, \
         Runtime(model, cache_address=daemon.address, config=config) as reader, \
         Runtime(model, cache_address=None, config=RuntimeConfig(
             n_ctx=2048, n_seq_max=2, n_threads=threads, reuse_live=True)) as live:
        out["kernels"], out["batch_invariant"] = cold.kernels, cold.batch_invariant
        rng = random.Random(7)

        def ask(rt, tokens):
            return rt.complete(tokens=tokens, max_tokens=16, logprobs=True)

        def compare(path, warm, tokens):
            ref = ask(cold, tokens)
            row = out["paths"].setdefault(path, {"compared": 0, "same_tokens": 0,
                                                 "bitwise": 0})
            row["compared"] += 1
            row["same_tokens"] += warm.tokens == ref.tokens
            row["bitwise"] += (warm.tokens == ref.tokens and
                               [lp.logprob for lp in warm.logprobs] ==
                               [lp.logprob for lp in ref.logprobs])
            diffs = [abs(a.logprob - b.logprob) for a, b in zip(warm.logprobs, ref.logprobs)
                     if a.token == b.token]
            out["max_logprob_diff"] = max([out["max_logprob_diff"], *diffs])

        def more(n):
            toks = []
            while len(toks) < n:
                toks += cold.tokenize(" " + " ".join(rng.choices(WORDS, k=8)))[1:]
            return toks[:n]

        for i in range(n_prompts):
            p = cold.tokenize(" ".join(rng.choices(WORDS, k=rng.randint(50, 300))))
            ask(writer, p)
            writer.engine.saver.flush(60)
            compare("exact, stored scores", ask(reader, p), p)
            compare("exact, last token computed again", ask(reader, p[:-2]), p[:-2])
            for n in (1, 7, 40):
                longer = p + more(n)
                compare(f"partial, {n}-token suffix", ask(reader, longer), longer)
            reader.engine.saver.flush(60)
            ask(live, p)
            extended = p + more(9)
            compare("live, extended", ask(live, extended), extended)
            print(f"prompt {i + 1}/{n_prompts}", file=sys.stderr, flush=True)
finally:
    daemon.close()
print(json.dumps(out))
"""


def run_set(name: str, model: Path, n_prompts: int, threads: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvwc-"))
    env = {**os.environ, "MODEL_RUNTIME_KERNELS": name}
    tools = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(tools), str(tools.parent),
                                         env.get("PYTHONPATH", "")])
    try:
        done = subprocess.run([sys.executable, "-c", ARM, str(model), str(n_prompts),
                               str(threads), str(work)], env=env, capture_output=True,
                              text=True, timeout=7200)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    paths = result["paths"].values()
    result["compared"] = sum(p["compared"] for p in paths)
    result["same_tokens"] = sum(p["same_tokens"] for p in paths)
    result["bitwise"] = sum(p["bitwise"] for p in paths)
    return result


def main() -> None:
    from model_runtime.runtime import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sets", default="deterministic,fast")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or default_model_path()
    random.seed(0)
    results = {}
    for name in args.sets.split(","):
        log(f"{name}: {args.prompts} prompts on {model.name}")
        results[name] = run_set(name, model, args.prompts, args.threads)
        r = results[name]
        log(f"{name}: {r['same_tokens']}/{r['compared']} same tokens, {r['bitwise']} bit for "
            f"bit, largest logprob difference {r['max_logprob_diff']:.3g}")
    emit_json({"benchmark": "warm_cold", "command": "python tools/bench_warm_cold.py " +
               " ".join(sys.argv[1:]), "model": model.name, "prompts": args.prompts,
               "machine": machine_info(), "sets": results}, args.out)


if __name__ == "__main__":
    main()
