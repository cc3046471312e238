"""Side-by-side benchmark of speculative decoding: decode tokens/s with and without it,
and against llama.cpp's ``llama-server`` with its n-gram speculation types.

    python tools/bench_speculation.py [--max-tokens 160] [--threads 2] [--rounds 2]
        [--llama-server PATH] [--spec-types ngram-simple,ngram-map-k,ngram-mod]
        [--llama-server-args "--poll 0"]
        [--per-workload N] [--no-draft-model] [--out FILE]

The prompts are tools/speculation_workloads.py's: copy-heavy (a code edit, a JSON echo,
a tool loop whose call quotes the tool's output) and free prose, each a chat rendered
with SmolLM2-135M's own template plus the answer's given start, sent as the same tokens
to every arm. Greedy, ``--max-tokens`` tokens at most. Arms, run in turn prompt by
prompt (so a change in the machine's load hits them alike), ``--rounds`` times:

* ``kvcache_off`` / ``kvcache_ngram``: one model_runtime in this process, each request
  asking for speculation off, or on by prompt lookup; ``kvcache_draft``: the model
  drafting for itself in a runtime of its own (a smoke test of the draft-model path: its
  guesses cost what the tokens they save do, so the draft-length rule drafts little or
  nothing; and a second runtime in the process slows both, so its rates are not figures);
* ``llama_server`` plain and ``llama_server_<type>`` for each ``--spec-types`` (built by
  tools/build_llama_server.sh; skipped with a message when absent).

Decode tokens/s of a request: its tokens after the first over the time from the first
token to the last (the prompt's prefill left out). Per workload: the median over its
requests, the ratios with/without and against llama-server's best type, and whether the
texts are the same with and without speculation. Then ``clients`` concurrent prose
requests (model_runtime with that many sequences), speculation off and on alternated:
total tokens/s. Prints one JSON document (also to ``--out``).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from benchlib import emit_json, log, machine_info, percentile
from harness.procs import short_workdir
from llama_server_arm import DEFAULT_BINARY, LlamaServer
from speculation_workloads import COPY_HEAVY, WORKLOADS

from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion
from model_runtime.runtime import Runtime, default_model_path

Reply = tuple[list[int], float]  # generated tokens, decode tokens/s


def decode_rate(n_tokens: int, first_to_last_ms: float) -> float:
    return (n_tokens - 1) / (first_to_last_ms / 1000) if n_tokens > 1 and \
        first_to_last_ms > 0 else 0.0


def kvcache_arm(rt: Runtime, max_tokens: int,
                speculative: bool | None = None) -> Callable[[list[int]], Reply]:
    def run(tokens: list[int]) -> Reply:
        done = rt.complete(tokens=tokens, max_tokens=max_tokens, temperature=0.0,
                           speculative=speculative)
        assert isinstance(done, Completion)
        t = done.timings
        run.drafted += done.drafted_tokens  # type: ignore[attr-defined]
        run.accepted += done.accepted_tokens  # type: ignore[attr-defined]
        return done.tokens, decode_rate(len(done.tokens), t["total_ms"] - t["ttft_ms"])
    run.drafted = run.accepted = 0  # type: ignore[attr-defined]
    return run


def server_arm(server: LlamaServer, max_tokens: int) -> Callable[[list[int]], Reply]:
    def run(tokens: list[int]) -> Reply:
        reply = server.complete(tokens, max_tokens)
        return reply.tokens, decode_rate(len(reply.tokens), reply.e2e_ms - reply.ttft_ms)
    return run


def prompts_of(rt: Runtime) -> dict[str, list[list[int]]]:
    """Each workload's prompts as tokens: the chat by the model's template, then the
    answer's given start."""
    out = {}
    for name, make in WORKLOADS.items():
        out[name] = [rt.render_chat(chat)[0] + (rt.tokenize(start)[1:] if start else [])
                     for chat, start in make()]
    return out


def concurrent_tps(rt: Runtime, prompts: list[list[int]], max_tokens: int,
                   speculative: bool) -> float:
    """Every prompt at once, one client each: generated tokens per second of wall time."""
    results: list[int] = []
    lock = threading.Lock()

    def client(tokens: list[int]) -> None:
        done = rt.complete(tokens=tokens, max_tokens=max_tokens, temperature=0.0,
                           speculative=speculative)
        assert isinstance(done, Completion)
        with lock:
            results.append(len(done.tokens))

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(results) / (time.perf_counter() - t0)


def median(values: list[float]) -> float | None:
    return round(percentile(values, 50), 2) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-workload", type=int, default=0,
                    help="Prompts of each workload at most (0: all).")
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--spec-types", default="ngram-simple,ngram-map-k,ngram-mod")
    ap.add_argument("--llama-server-args", default="--poll 0",
                    help="More llama-server options for each of its arms (default: no "
                         "spin-waiting between computations, without which its 2 threads "
                         "ran at 9-12 tokens/s instead of 70-80 on a shared machine).")
    ap.add_argument("--no-draft-model", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    # SIGTERM ends the run through its clean-up (servers stopped, folder removed).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = default_model_path()
    config = RuntimeConfig(n_ctx=4096, n_threads=args.threads, n_seq_max=args.clients,
                           reuse_live=False)
    # One runtime for off and on (each request says which): two runtimes in one process
    # slow each other's llama.cpp (README, "One runtime per process"). The draft arm's
    # runtime is a second one, so its figures are only a smoke test's.
    runtimes = {"kvcache_ngram": Runtime(model, config=replace(config, speculative="ngram"))}
    arms = {"kvcache_off": kvcache_arm(runtimes["kvcache_ngram"], args.max_tokens, False),
            "kvcache_ngram": kvcache_arm(runtimes["kvcache_ngram"], args.max_tokens, True)}
    if not args.no_draft_model:
        runtimes["kvcache_draft"] = Runtime(model, config=replace(config, speculative="draft"),
                                            draft_model_path=model)
        arms["kvcache_draft"] = kvcache_arm(runtimes["kvcache_draft"], args.max_tokens)
    servers: list[LlamaServer] = []
    workdir = short_workdir("bench-spec-")
    try:
        if args.llama_server.is_file():
            for kind in ["none", *args.spec_types.split(",")]:
                extra = args.llama_server_args.split() + \
                    ([] if kind == "none" else ["--spec-type", kind])
                server = LlamaServer(args.llama_server, model, threads=args.threads,
                                     n_ctx=4096, log_path=workdir / f"{kind}.log",
                                     extra_args=extra).start()
                servers.append(server)
                name = "llama_server" if kind == "none" else f"llama_server_{kind}"
                arms[name] = server_arm(server, args.max_tokens)
        else:
            log(f"no llama-server at {args.llama_server}: its arms are skipped "
                "(bash tools/build_llama_server.sh)")
        prompts = {w: p[:args.per_workload or None]
                   for w, p in prompts_of(runtimes["kvcache_ngram"]).items()}
        rates: dict[str, dict[str, list[float]]] = {w: {a: [] for a in arms} for w in prompts}
        texts: dict[str, dict[str, list[list[int]]]] = {w: {a: [] for a in arms}
                                                        for w in prompts}
        for r in range(args.rounds):
            for workload, batch in prompts.items():
                for i, tokens in enumerate(batch):
                    for arm, run in arms.items():
                        out, rate = run(tokens)
                        rates[workload][arm].append(rate)
                        if r == 0:
                            texts[workload][arm].append(out)
                    log(f"round {r + 1} {workload} #{i}: " + ", ".join(
                        f"{a} {rates[workload][a][-1]:.1f}" for a in arms))
        workloads = {}
        for workload in prompts:
            med = {a: median(v) for a, v in rates[workload].items()}
            best = max((a for a in arms if a.startswith("llama_server_")),
                       key=lambda a: med[a] or 0.0, default=None)
            off = texts[workload]["kvcache_off"]
            workloads[workload] = {
                "copy_heavy": workload in COPY_HEAVY,
                "requests": len(prompts[workload]) * args.rounds,
                "decode_tokens_per_s_median": med,
                "speculation_vs_off": _ratio(med["kvcache_ngram"], med["kvcache_off"]),
                "llama_server_best_type": best,
                "vs_llama_server_best": _ratio(med["kvcache_ngram"], med.get(best or "")),
                "llama_server_spec_vs_plain": _ratio(med.get(best or ""),
                                                     med.get("llama_server")),
                "same_tokens_with_and_without": {
                    a: texts[workload][a] == off for a in arms if a.startswith("kvcache_")},
                "llama_server_same_text_as_plain": {
                    a: texts[workload][a] == texts[workload]["llama_server"]
                    for a in arms if a.startswith("llama_server_")},
            }
        many = {"off": [], "ngram": []}  # type: dict[str, list[float]]
        prose = (prompts["prose"] * args.clients)[:args.clients]
        rt = runtimes["kvcache_ngram"]
        for _ in range(args.rounds + 1):
            for speculative, key in ((False, "off"), (True, "ngram")):
                many[key].append(concurrent_tps(rt, prose, args.max_tokens, speculative))
        doc = {
            "benchmark": "speculation", "model": model.name, "threads": args.threads,
            "max_tokens": args.max_tokens, "rounds": args.rounds,
            "workloads": workloads,
            "clients": {"n": args.clients, "workload": "prose",
                        "tokens_per_s_median": {k: median(v) for k, v in many.items()},
                        "ngram_vs_off": _ratio(median(many["ngram"]), median(many["off"]))},
            "drafts": {name: {"drafted": run.drafted,  # type: ignore[attr-defined]
                              "accepted": run.accepted}  # type: ignore[attr-defined]
                       for name, run in arms.items() if name.startswith("kvcache_")},
            "llama_server_args": args.llama_server_args,
            "machine": machine_info(),
            "note": "shared 2-core machine: other work ran meanwhile; arms interleaved "
                    "prompt by prompt, so the ratios are the figures to read",
        }
        emit_json(doc, args.out)
    finally:
        for server in servers:
            server.stop()
        for rt in runtimes.values():
            rt.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    raise SystemExit(main())
