"""Stored bytes of many conversations over one long system prompt: each prefix stored once.

N conversations of T turns each share one system prompt (about 2,000 tokens with the
defaults). Every turn is a chat request to a real runtime (SmolLM2 by default) backed by a
real daemon; each turn's prompt is the previous turn's plus the reply and a new user
message. When every save has reached the daemon, this reports:

* ``stored_bytes``: what the daemon's disk tier holds (pieces, each shared prefix once);
* ``distinct_kv_bytes``: the KV bytes of the distinct token prefixes among the saved
  entries (a trie of their token lists: every distinct prefix once), the floor;
* ``whole_state_bytes``: what storing every entry whole would take (the daemon's logical
  bytes; how the previous version stored them).

Target: ``stored_bytes`` at most 1.2x ``distinct_kv_bytes``. JSON on stdout.

    python tools/bench_storage.py [--conversations 100 --turns 3 --threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchlib import Daemon, emit_json, log, machine_info, summarize, target
from harness.system_prompt import USER_MESSAGES, build_system_prompt

from kvcache.client import CacheClient
from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime, default_model_path
from model_runtime.state.pieces import decode_layout


def distinct_prefixes(token_lists: Sequence[Sequence[int]]) -> int:
    """How many distinct prefixes (trie nodes below the root) the token lists have."""
    root: dict[int, Any] = {}
    nodes = 0
    for tokens in token_lists:
        node = root
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                nodes += 1
            node = child
    return nodes


def conversation(rt: Runtime, system: str, turns: int, rng: random.Random,
                 max_tokens: int) -> list[float]:
    """One conversation; returns each turn's time to first token (ms)."""
    messages = [{"role": "system", "content": system}]
    ttfts = []
    for _ in range(turns):
        question = f"{rng.choice(USER_MESSAGES)} (ticket {rng.randrange(10_000, 99_999)})"
        messages.append({"role": "user", "content": question})
        done = rt.complete(messages=messages, max_tokens=max_tokens)
        ttfts.append(done.timings["ttft_ms"])
        messages.append({"role": "assistant", "content": done.text})
    return ttfts


def cell_width(client: CacheClient) -> int:
    """KV bytes per token, from the cell layout a stored piece carries."""
    for entry in client.list_entries():
        detail = client.load(entry.key)
        if detail.meta.cell_layout:
            return decode_layout(detail.meta.cell_layout)[0].cell_width
    raise RuntimeError("no entry stored as cells (is the model plain attention?)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvbench-storage-"))
    daemon = Daemon(work / "data", work, "--disk-bytes", "64G", "--ram-bytes", "2G",
                    log_dir=work)
    try:
        daemon.start()
        config = replace(RuntimeConfig(), n_threads=args.threads, n_ctx=args.n_ctx,
                         n_seq_max=args.n_seq_max)
        system = build_system_prompt(args.system_words)
        rng = random.Random(args.seed)
        ttfts: list[float] = []
        with Runtime(args.model, cache_address=daemon.address, config=config) as rt:
            n_system = len(rt.render_chat([{"role": "system", "content": system},
                                           {"role": "user", "content": "x"}])[0])
            log(f"system prompt ~{n_system} tokens; {args.conversations} conversations x "
                f"{args.turns} turns")
            t0 = time.perf_counter()
            for i in range(args.conversations):
                ttfts += conversation(rt, system, args.turns, rng, args.max_tokens)
                if (i + 1) % 10 == 0:
                    log(f"{i + 1} conversations, {time.perf_counter() - t0:.0f} s")
            assert rt.engine.saver.flush(120), "saves did not reach the daemon"
            runtime_stats = rt.stats()
        with CacheClient(daemon.address, timeout=60) as client:
            stats = client.stats()
            entries = client.list_entries()
            token_lists = [list(client.inspect(e.key).tokens) for e in entries]
            width = cell_width(client)
        stored = next(t.bytes for t in stats.tiers if t.tier == 2)
        distinct = distinct_prefixes(token_lists) * width
        ratio = round(stored / distinct, 3)
        return {
            "benchmark": "storage",
            "machine": machine_info(),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "system_prompt_tokens": n_system,
            "entries": len(entries),
            "pieces": sum(1 for e in entries if e.parent),
            "kv_bytes_per_token": width,
            "stored_bytes": stored,
            "distinct_kv_bytes": distinct,
            "whole_state_bytes": stats.logical_bytes,
            "stored_over_distinct": ratio,
            "whole_over_stored": round(stats.logical_bytes / stored, 2),
            "tokens_saved": runtime_stats["tokens_saved"],
            "tokens_stored": runtime_stats["tokens_stored"],
            "ttft": summarize([t / 1000 for t in ttfts]),
            "targets": [target("stored bytes / distinct KV bytes", ratio, 1.2)],
        }
    finally:
        daemon.close()
        shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=1150,
                        help="system prompt size (SmolLM2: ~1.75 tokens per word here)")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-seq-max", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="10 conversations of 2 turns")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 10, 2
    args.model = args.model or default_model_path()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    emit_json(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
