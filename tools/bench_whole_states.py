"""Prompt tokens prefilled per step of a raw agent loop on models whose states cannot be
cut (sliding-window, hybrid, recurrent), in one process and after restarting everything;
and the bytes each stored checkpoint takes.

    python tools/bench_whole_states.py [--arch hybrid|recurrent|swa|plain ...]
                                       [--model PATH ...] [--steps 8] [--threads 1]

Workload: a raw prompt of about ``--system-tokens`` tokens, then ``--steps`` steps; each
step's prompt is the previous prompt's text, the reply's text and an observation, tokenized
again as a whole (so the reply's tokens may come out otherwise, as in real agent loops).
Each step is one request (greedy, ``--max-tokens``). Then the daemon and the runtime are
stopped, the RAM tier deleted, both started again and the same steps replayed: with the
daemon's checkpoints every step should prefill about what it prefilled in the first run.

Per model: prompt tokens, tokens read and prefilled per step (in process, after the
restart), their sums and the ratio restart / in process; the stored entries by reason, their
bytes, and the mean bytes per checkpoint against the state of the longest prompt (for these
models every checkpoint is a whole state). JSON on stdout, progress on stderr. Tiny models
are generated (``tools/make_tiny_gguf.py``); ``--model`` adds a GGUF file (e.g.
Gemma-3-270M). Not yet side by side with llama-server (``tools/bench_compare.py`` is).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.make_tiny_gguf import ARCHS
from harness.procs import Daemon, short_workdir

from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime

SYSTEM = ("You are a careful agent. Tools: search(query), open(url), write(path, text). "
          "Think step by step, call one tool per step, and report what you found. ")
OBSERVATION = "\nObservation: the tool returned {n} results about the cat and the dog.\nAction:"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def system_text(rt: Runtime, n_tokens: int) -> str:
    text = SYSTEM
    while len(rt.tokenize(text)) < n_tokens:
        text += SYSTEM
    return text


def run_loop(rt: Runtime, system: str, steps: int, max_tokens: int) -> list[dict[str, Any]]:
    text, rows = system, []
    for step in range(steps):
        tokens = rt.tokenize(text)
        done = rt.complete(tokens=tokens, max_tokens=max_tokens, timeout=600)
        rows.append({"prompt": len(tokens), "read": done.cache_delta["tokens_read"],
                     "prefilled": len(tokens) - done.cache_delta["tokens_read"],
                     "hit": done.cache_hit_kind})
        text += done.text + OBSERVATION.format(n=step + 1)
    assert rt.engine.saver.flush(60.0), "saves did not reach the daemon"
    return rows


def bench_model(name: str, model: Path, args: argparse.Namespace, work: Path
                ) -> dict[str, Any]:
    config = RuntimeConfig(n_ctx=4096, n_seq_max=1, n_threads=args.threads,
                           save_block=256, trim=32, min_save_tokens=32,
                           continued_interval=0, checkpoint_interval=args.checkpoint_interval)
    data = work / f"data-{name}"
    daemon = Daemon(data).start()
    try:
        with Runtime(model, cache_address=daemon.address, config=config) as rt:
            system = system_text(rt, args.system_tokens)
            log(f"{name}: in process")
            first = run_loop(rt, system, args.steps, args.max_tokens)
            state_bytes = rt.engine.call(lambda: rt.ctx.state_seq_size(0))
            cuttable = rt.ctx.can_truncate_restored()
        daemon.stop()
        shutil.rmtree(daemon.ram_dir, ignore_errors=True)
        daemon.start()
        with Runtime(model, cache_address=daemon.address, config=config) as rt:
            log(f"{name}: after restarting daemon and runtime")
            again = run_loop(rt, system, args.steps, args.max_tokens)
        with daemon.client() as client:
            entries = [e for page in client.iter_entries() for e in page]
    finally:
        daemon.close()
    by_reason: dict[str, dict[str, int]] = {}
    for e in entries:
        row = by_reason.setdefault(e.reason, {"entries": 0, "bytes": 0})
        row["entries"] += 1
        row["bytes"] += e.size
    total = sum(e.size for e in entries)
    in_process = sum(r["prefilled"] for r in first[1:])
    restarted = sum(r["prefilled"] for r in again)
    return {
        "model": name, "cuttable": cuttable,
        "steps_in_process": first, "steps_after_restart": again,
        "prefilled_after_first_step": in_process,
        "prefilled_after_restart_all_steps": restarted,
        "restart_over_in_process": round(restarted / in_process, 3) if in_process else None,
        "stored": {"entries": len(entries), "bytes": total, "by_reason": by_reason,
                   "mean_bytes_per_entry": total // max(len(entries), 1),
                   "state_bytes_of_the_last_prompt": state_bytes},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHS),
                    help="a generated tiny model (repeatable; default hybrid and recurrent)")
    ap.add_argument("--model", action="append", type=Path, default=[],
                    help="a GGUF file (repeatable)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--checkpoint-interval", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    archs = args.arch or ([] if args.model else ["hybrid", "recurrent"])
    work = short_workdir("kvbws")
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvbws-models-") as models:
            runs = [(arch, ARCHS[arch](Path(models) / f"{arch}.gguf")) for arch in archs]
            runs += [(path.name, path) for path in args.model]
            for name, path in runs:
                results.append(bench_model(name, path, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"results": results, "settings": vars(args) | {
        "model": [str(m) for m in args.model]}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
