"""The main job: a long shared system prompt is prefilled once, ever.

Starts a kvcache daemon and a model runtime (SmolLM2-135M-Instruct by default) as real
processes, sends requests that share a ~2,000-token system prompt with different user
messages, restarts both processes, sends one more, and prints per request the hit kind,
tokens restored, TTFT and the cold/warm TTFT ratio.

    python tools/demo.py [--model PATH] [--threads 2] [--n-ctx 4096] [--json]

Everything it makes stays in its temporary folder, which it removes (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from harness.procs import Stack, short_workdir
from harness.system_prompt import USER_MESSAGES, build_system_prompt


def run(model: str | None, threads: int, n_ctx: int, n_requests: int, max_tokens: int,
        keep: bool) -> list[dict[str, Any]]:
    workdir = short_workdir("kvdemo")
    stack = Stack(workdir, model, threads=threads, runtime_args=("--n-ctx", str(n_ctx)))
    system = build_system_prompt()
    rows: list[dict[str, Any]] = []

    def ask(client: Any, phase: str, user: str) -> None:
        done = client.complete(messages=[{"role": "system", "content": system},
                                         {"role": "user", "content": user}],
                               max_tokens=max_tokens)
        rows.append({"phase": phase, "user": user, **done})
        print(f"  {phase:<14} {done['cache_hit_kind']:<8} "
              f"ttft {done['timings']['ttft_ms']:8.1f} ms  {done['text'][:60]!r}",
              file=sys.stderr)

    try:
        print(f"starting daemon and runtime in {workdir}", file=sys.stderr)
        client = stack.start()
        for user in USER_MESSAGES[: n_requests]:
            ask(client, "first start", user)
        client.close()
        print("restarting daemon and runtime", file=sys.stderr)
        stack.stop()
        client = stack.start()
        ask(client, "after restart", USER_MESSAGES[n_requests % len(USER_MESSAGES)])
        client.close()
    finally:
        stack.close()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cold = [r["timings"]["ttft_ms"] for r in rows if r["cache_hit_kind"] == "cold"]
    cold_ttft = cold[0] if cold else None
    head = (f"{'#':>2}  {'phase':<14} {'hit':<8} {'tier':<5} {'restored':>8} {'prompt':>7} "
            f"{'TTFT ms':>9} {'cold/warm':>9}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        ttft = r["timings"]["ttft_ms"]
        ratio = "" if cold_ttft is None or r["cache_hit_kind"] == "cold" else \
            f"{cold_ttft / ttft:8.1f}x"
        lines.append(f"{i:>2}  {r['phase']:<14} {r['cache_hit_kind']:<8} "
                     f"{r.get('cache_tier') or '-':<5} {r['cache_delta']['tokens_read']:>8} "
                     f"{r['prompt_tokens']:>7} {ttft:>9.1f} {ratio:>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096, help="the runtime's context")
    parser.add_argument("--requests", type=int, default=4, help="requests before the restart")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    rows = run(args.model, args.threads, args.n_ctx, args.requests, args.max_tokens,
               args.keep)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows))


if __name__ == "__main__":
    main()
