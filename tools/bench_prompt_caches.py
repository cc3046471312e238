"""TTFT benchmark: kvcache vs llama-cpp-python's own prompt caches, side by side.

    python tools/bench_prompt_caches.py [--quick] [--threads 2] [--repeats N]
                                        [--out-dir docs] [--no-wait] [--replot]

(``python tools/bench_compare.py`` without ``--workloads`` or ``--arms`` runs this.)

Workload: a shared system prompt of about 1,000, 2,000 and 4,000 tokens (built with
``tools/system_prompt.build_system_prompt`` and measured with SmolLM2's own chat template),
each followed by different user messages, on SmolLM2-135M-Instruct, greedy, ``max_tokens``
8 (time to first token is the subject). Every user message starts with a different word, so
a saved state can only ever share the system prompt (plus the ``<|im_start|>user`` line)
with a later request, in every arm alike.

Arms (all in this process except the kvcache daemon, all with the same thread count):

1.  no cache, our ``Runtime(cache_address=None)``: a cold prefill every time;
1b. no cache, llama-cpp-python's ``Llama.create_chat_completion`` (the base of arms 2, 3);
2.  ``Llama`` + ``LlamaRAMCache``: the first request fills it, later ones restore from it;
3.  ``Llama`` + ``LlamaDiskCache`` (a ``diskcache`` directory), the same;
4.  kvcache, RAM tier: a daemon child process and an in-process ``Runtime``; the first
    request is cold (it saves the system prompt), later ones are partial hits;
5.  kvcache, disk tier: stop runtime and daemon, delete the RAM tier directory, drop the
    blob files from the page cache, restart both, send one request (a partial hit that must
    come from disk); one restart per repeat;
6.  the floor: a ``LlamaContext`` with the runtime's settings holds the system-prompt state
    (``state_seq_get``) in memory; per repeat ``state_seq_set`` + prefill the user suffix +
    argmax. A warm kvcache request does the same work plus the cache.

Before arms 1b-3 a request runs, ``Llama.reset()`` forgets what the context holds, so
its in-context prefix reuse (a different mechanism, like kvcache's sticky sessions) does not
hide the caches: a restore is the only way to skip the system prompt, as it would be after
other conversations used the context.

TTFT is wall time from the call to the first token: the first ``TokenEvent`` of a streamed
``Runtime.complete``, the first chunk with content of a streamed ``create_chat_completion``.
End-to-end is the call until the stream is exhausted (arms 2 and 3 save their state there).
Reported per arm and prompt length: TTFT median/p10/p90/min/max, end-to-end latency, bytes
the cache stores, ratios to arms 1, 1b and 6, and each warm request's TTFT split into the
cache's own restore cost and the rest (for arms 2 and 3 ``cache[tokens]`` and
``Llama.load_state`` are timed inside the request by thin wrappers); then the targets
(kvcache warm TTFT >= 10x better than arms 2 and 3 at 2,000 tokens, and <= 1.5x arm 6),
machine, versions and load averages.

Outputs ``OUT_DIR/bench_compare.json`` (also printed on stdout; progress goes to stderr) and
the chart ``OUT_DIR/bench_compare.png``. A full run waits (up to 15 min) for the machine's
1-minute load average to stay below 0.7 for 30 s, then takes ~8 min on 2 cores;
``--quick`` (1,000 tokens, 1 repeat, no waiting) is a smoke run of under 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_prompt_caches_arms import (
    LlamaRig,
    arm_runtime_cold,
    log,
    new_llama,
    run_kvcache_arms,
    run_llama_arms,
)
from benchlib import fmt_ms, loadavg, ratio_of, summary_ms, target
from harness.procs import short_workdir
from ttft_harness import (
    Settings,
    add_common_options,
    add_replot_option,
    chat_tokens,
    machine_info,
    size_workload,
)

from model_runtime.llama_backend import LlamaModel
from model_runtime.runtime import default_model_path

TARGET_SPEEDUP_OVER_LLAMA_CACHES = 10.0
TARGET_OVER_FLOOR = 1.5
TARGET_AT_TOKENS = 2000


@dataclass(frozen=True)
class Arm:
    id: str
    label: str  # short, for the chart
    color: str


ARMS = [
    Arm("1", "1 no cache (Runtime)", "#7f7f7f"),
    Arm("1b", "1b no cache (Llama)", "#b0b0b0"),
    Arm("2", "2 LlamaRAMCache", "#d62728"),
    Arm("3", "3 LlamaDiskCache", "#ff7f0e"),
    Arm("4", "4 kvcache RAM tier", "#1f77b4"),
    Arm("5", "5 kvcache disk tier (restart)", "#17becf"),
    Arm("6", "6 floor: in-process state_seq_set", "#2ca02c"),
]


# -- one prompt length -------------------------------------------------------------------------


def check_hits(result: dict[str, Any], kind: str, tier: str) -> dict[str, Any]:
    infos = [s["info"] for s in result["samples"]]
    return {"expected": f"{kind}/{tier}",
            "matched": sum(x["hit"] == kind and x["tier"] == tier for x in infos),
            "of": len(infos)}


def add_ratios(arms: dict[str, dict[str, Any]]) -> None:
    med = {k: v["ttft_ms"].get("median") for k, v in arms.items()}
    for k, arm in arms.items():
        arm["ratios"] = {"ttft_over_arm1": ratio_of(med[k], med.get("1")),
                         "ttft_over_arm1b": ratio_of(med[k], med.get("1b")),
                         "ttft_over_arm6": ratio_of(med[k], med.get("6")),
                         "speedup_vs_arm1": ratio_of(med.get("1"), med[k])}


def split_ttft(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each warm arm's TTFT split, per request, into the cache's own cost (``restore``) and
    the rest (mostly the prefill of the user suffix, which every warm arm does):

    * arms 2, 3: ``cache[tokens]`` (prefix scan; unpickling for the disk cache) +
      ``Llama.load_state``;
    * arms 4, 5: the runtime's TTFT minus its prefill: lookup RPC + blob load + checksums +
      ``state_seq_set``;
    * arm 6: ``state_seq_set``.
    """
    def restore(k: str, info: dict[str, Any]) -> float:
        if k in ("2", "3"):
            return info.get("cache_get_ms", 0.0) + info.get("load_state_ms", 0.0)
        if k in ("4", "5"):
            return info["engine_ttft_ms"] - info["prefill_ms"]
        return info["set_ms"]

    out = {}
    for k in ("2", "3", "4", "5", "6"):
        samples = arms[k]["samples"]
        cost = [restore(k, s["info"]) for s in samples]
        out[k] = {"restore_ms": summary_ms(cost),
                  "rest_ms": summary_ms([s["ttft_ms"] - c for s, c in zip(samples, cost,
                                                                            strict=True)])}
    return out


def agreement(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy outputs per user message across arms (the floor: its first token only)."""
    by_message: dict[int, dict[str, str]] = {}
    for k, arm in arms.items():
        for s in arm["samples"] + [arm[x] for x in ("fill_request",) if x in arm]:
            by_message.setdefault(s["message"], {})[k] = s["text"]
    compared = same = 0
    for texts in by_message.values():
        full = {k: t.strip() for k, t in texts.items() if k != "6"}
        if len(full) > 1:
            compared += 1
            same += len(set(full.values())) == 1
    floor_ok = [texts["6"].strip() == texts["4"].strip()[: len(texts["6"].strip())]
                for texts in by_message.values() if "6" in texts and "4" in texts]
    return {"messages_compared": compared, "identical_completions": same,
            "floor_first_token_matches_arm4": f"{sum(floor_ok)}/{len(floor_ok)}",
            "texts": {str(m): t for m, t in sorted(by_message.items())}}


def run_length(target: int, st: Settings, model_path: Path, model: LlamaModel,
               rig: LlamaRig, workdir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    wl = size_workload(model, target)
    prompt_lengths = [len(chat_tokens(model, wl.messages(i))[0])
                      for i in range(2 * st.repeats + 1)]
    log(f"{target}: system prompt {wl.system_tokens} tokens ({wl.words} words), "
        f"prompts {min(prompt_lengths)}-{max(prompt_lengths)} tokens")
    arms: dict[str, dict[str, Any]] = {}
    arms.update(run_llama_arms(rig, wl, st, workdir))
    log(f"{target}: arm 1, Runtime without a cache")
    arms["1"] = arm_runtime_cold(model_path, wl, st)
    arms.update(run_kvcache_arms(model_path, model, wl, st, workdir))
    arms["4"]["hits"] = check_hits(arms["4"], "partial", "ram")
    arms["5"]["hits"] = check_hits(arms["5"], "partial", "disk")
    add_ratios(arms)
    ordered = {a.id: {"label": a.label, **arms[a.id]} for a in ARMS}
    return {
        "system_prompt": {"target_tokens": target, "tokens": wl.system_tokens,
                          "words": wl.words, "within_10pct":
                          abs(wl.system_tokens - target) <= 0.1 * target},
        "prompt_tokens": {"min": min(prompt_lengths), "max": max(prompt_lengths)},
        "arms": ordered, "ttft_split": split_ttft(arms),
        "output_agreement": agreement(arms),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


# -- targets, load ------------------------------------------------------------------------


def targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    at = str(TARGET_AT_TOKENS) if str(TARGET_AT_TOKENS) in results else max(results, key=int)
    arms = results[at]["arms"]
    med = {k: arms[k]["ttft_ms"]["median"] for k in arms}
    out = []
    for other in ("2", "3"):
        value = ratio_of(med[other], med["4"])
        out.append(target(f"arm {other} TTFT / kvcache warm (arm 4) TTFT at {at} tokens",
                          value, TARGET_SPEEDUP_OVER_LLAMA_CACHES, ">="))
    out.append(target(f"kvcache warm (arm 4) TTFT / floor (arm 6) TTFT at {at} tokens",
                      ratio_of(med["4"], med["6"]), TARGET_OVER_FLOOR, "<="))
    # Not targets: the same bars applied to the disk tier, and to the caches' own cost.
    restore = {k: v["restore_ms"]["median"] for k, v in results[at]["ttft_split"].items()}
    for other in ("2", "3"):
        out.append(target(f"arm {other} TTFT / kvcache disk tier (arm 5) TTFT at {at} tokens",
                          ratio_of(med[other], med["5"]), TARGET_SPEEDUP_OVER_LLAMA_CACHES,
                          ">=", primary=False))
        out.append(target(f"arm {other} restore cost (cache get + load_state) / kvcache warm "
                          f"restore cost (arm 4 TTFT - prefill) at {at} tokens",
                          ratio_of(restore[other], restore["4"]),
                          TARGET_SPEEDUP_OVER_LLAMA_CACHES, ">=", primary=False))
    out.append(target(f"kvcache disk tier (arm 5) TTFT / floor (arm 6) TTFT at {at} tokens",
                      ratio_of(med["5"], med["6"]), TARGET_OVER_FLOOR, "<=", primary=False))
    return out


def fresh_memory_probe(mb: int = 96, rounds: int = 5, idle_s: float = 3.0) -> dict[str, Any]:
    """Time to fill a freshly allocated ``mb`` MB buffer right after freeing memory and after
    ``idle_s`` of idleness. On a VM that hands freed guest pages back to the host (virtio
    free page reporting, e.g. Firecracker) the second is much slower: every restore path that
    allocates its buffers per request (``load_state``'s copies, a blob read, a state copy)
    pays it, depending on what the machine freed just before."""
    size = mb << 20

    def fill_fresh() -> float:
        t0 = time.perf_counter()
        buf = np.empty(size, dtype=np.uint8)
        buf.fill(1)
        return (time.perf_counter() - t0) * 1e3

    hot, idle = [], []
    for _ in range(rounds):
        np.ones(3 * size, dtype=np.uint8)  # allocated, touched and freed at once
        hot.append(fill_fresh())
        time.sleep(idle_s)
        idle.append(fill_fresh())
    return {"mb": mb, "right_after_free_ms": summary_ms(hot),
            f"after_{idle_s:g}s_idle_ms": summary_ms(idle)}


def load1() -> float:
    return loadavg()[0]


def wait_for_quiet(below: float = 0.7, quiet_s: float = 30.0, give_up_s: float = 900.0
                   ) -> dict[str, Any]:
    """Wait until the 1-minute load average stays below ``below`` for ``quiet_s``."""
    start = time.monotonic()
    quiet_since: float | None = None
    log(f"waiting for a quiet machine (load {load1()}, need < {below} for {quiet_s:.0f} s)")
    while True:
        now = time.monotonic()
        if os.getloadavg()[0] < below:
            quiet_since = quiet_since or now
            if now - quiet_since >= quiet_s:
                return {"quiet": True, "waited_s": round(now - start, 1), "load1": load1()}
        else:
            quiet_since = None
        if now - start >= give_up_s:
            log(f"gave up waiting after {give_up_s:.0f} s (load {load1()}); running anyway")
            return {"quiet": False, "waited_s": round(now - start, 1), "load1": load1()}
        time.sleep(2.0)


# -- the chart ---------------------------------------------------------------------------------------


def plot(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars: TTFT median per arm per prompt length, min-max whiskers, log y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    lengths = sorted(results, key=int)
    width = 0.8 / len(ARMS)
    fig, ax = plt.subplots(figsize=(12, 6.2))
    for j, arm in enumerate(ARMS):
        xs, meds, lo, hi, tops = [], [], [], [], []
        for g, length in enumerate(lengths):
            t = results[length]["arms"][arm.id]["ttft_ms"]
            xs.append(g + (j - (len(ARMS) - 1) / 2) * width)
            meds.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
            tops.append(t["max"])
        ax.bar(xs, meds, width * 0.92, label=arm.label, color=arm.color,
               yerr=[lo, hi], capsize=2, error_kw={"elinewidth": 0.8})
        for x, m, top in zip(xs, meds, tops, strict=True):
            ax.text(x, top * 1.1, fmt_ms(m), ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_yscale("log")
    low = min(results[n]["arms"][a.id]["ttft_ms"]["min"] for n in lengths for a in ARMS)
    ax.set_ylim(low / 3, ax.get_ylim()[1] * 4)
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([f"~{int(n):,}-token system prompt\n"
                        f"({results[n]['system_prompt']['tokens']:,} tokens)" for n in lengths])
    ax.set_ylabel("time to first token, ms (median; whiskers min-max; log scale)")
    m = doc["machine"]
    ax.set_title(f"TTFT with a shared system prompt: SmolLM2-135M, {m['threads']} threads, "
                 f"{m['cpu_count']} CPUs, llama-cpp-python {m['versions']['llama_cpp_python']}",
                 fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.25)
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def table(doc: dict[str, Any]) -> str:
    """TTFT medians per arm (rows) and prompt length (columns), with the ratio to arm 1."""
    results = doc["results"]
    lengths = sorted(results, key=int)
    head = f"{'arm':36}" + "".join(f"{int(n):>22,}" for n in lengths)
    rows = [head, "-" * len(head)]
    for arm in ARMS:
        cells = []
        for n in lengths:
            a = results[n]["arms"][arm.id]
            cells.append(f"{fmt_ms(a['ttft_ms']['median']):>10} "
                         f"({a['ratios']['ttft_over_arm1']:.3f}x)".rjust(22))
        rows.append(f"{arm.label:36}" + "".join(cells))
    return "\n".join(rows)


# -- driver ------------------------------------------------------------------------------------------

QUICK_HELP = "1,000 tokens only, 1 repeat, no waiting: a smoke run"


def add_options(parser: argparse.ArgumentParser) -> None:
    """This benchmark's own flags (after the common ones of ttft_harness)."""
    parser.add_argument("--no-wait", action="store_true",
                        help="do not wait for a quiet machine before a full run")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(parser, quick_help=QUICK_HELP,
                       repeats_help="warm requests per arm (default 7; --quick: 1)")
    add_options(parser)
    add_replot_option(parser)
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> Settings:
    repeats = args.repeats or (1 if args.quick else 7)
    lengths = (1000,) if args.quick else (1000, 2000, 4000)
    return Settings(lengths=lengths, repeats=repeats, cold_repeats=min(2, repeats),
                    threads=args.threads, quick=args.quick)


def run(args: argparse.Namespace, command: str) -> None:
    """OUT_DIR/bench_compare.json and .png (``command``: how this run was asked for)."""
    if args.replot:
        plot(json.loads((args.out_dir / "bench_compare.json").read_text()),
             args.out_dir / "bench_compare.png")
        return
    st = settings_of(args)
    wait = None if (st.quick or args.no_wait) else wait_for_quiet()
    started = time.perf_counter()
    load_start = loadavg()
    memory_probe = fresh_memory_probe()
    model_path = default_model_path()
    workdir = short_workdir("kvbc")
    model = LlamaModel(model_path)
    rig = new_llama(model_path, st)
    results: dict[str, dict[str, Any]] = {}
    try:
        for length in st.lengths:
            results[str(length)] = run_length(length, st, model_path, model, rig, workdir)
    finally:
        rig.llm.close()
        model.close()
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "benchmark": "bench_compare",
        "command": command,
        "mode": "quick" if st.quick else "full",
        "settings": asdict(st), "model": {"file": model_path.name,
                                          "bytes": model_path.stat().st_size},
        "machine": {**machine_info(st.threads), "fresh_memory_probe": memory_probe},
        "load": {"wait": wait, "loadavg_at_start": load_start, "loadavg_at_end": loadavg()},
        "ttft_definition": "call to first token: first TokenEvent (Runtime), first chunk with "
                           "content (Llama streaming), argmax after the suffix (floor)",
        "targets": targets(results),
        "results": results,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    out = args.out_dir / "bench_compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2)
    out.write_text(text + "\n")
    plot(doc, args.out_dir / "bench_compare.png")
    print(text, flush=True)
    log("TTFT median (ratio to arm 1):\n" + table(doc))
    log(f"wrote {out} and {args.out_dir / 'bench_compare.png'} in {doc['elapsed_s']} s")


def main(argv: Sequence[str] | None = None) -> None:
    run(parse_args(argv), "python tools/bench_prompt_caches.py "
        + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
