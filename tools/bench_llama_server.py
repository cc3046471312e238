"""Side-by-side TTFT benchmark: kvcache against llama.cpp's own ``llama-server``.

    python tools/bench_llama_server.py [--workloads shared,agent,chat,restart]
        [--arms kvcache,llama-server[,cold]] [--llama-server PATH] [--system-tokens N]
        [--settle-ms MS] [--quick] [--threads 2] [--repeats N] [--out-dir docs] [--replot]

(``python tools/bench_compare.py --workloads ...`` or ``--arms ...`` runs this.)

The arms: kvcache (daemon and runtime), ``llama-server`` (``tools/llama_server_arm.py``;
build it with ``tools/build_llama_server.sh``, the arm is skipped with a message when the
binary is absent) and, optionally, a runtime with neither cache nor live-KV reuse
(``cold``), over one ~1,400-token system prompt (built as in tools/bench_prompt_caches.py).
Workloads (all by default; arms by default kvcache and llama-server):

* ``shared``: distinct user messages after the system prompt (1 + ``--repeats``
  requests, default 15 repeats); the ``cold`` arm serves the first two, and no other workload;
* ``agent``: a raw-prompt agent loop of 8 steps; each step appends the reply and an
  observation whose first characters re-tokenize the reply's last token (checked with the
  tokenizer and reported per step);
* ``chat``: 4 chats x 3 turns through the chat template, interleaved turn by turn;
* ``restart``: after ``shared``, stop and start each arm (kvcache: runtime and daemon, RAM tier
  deleted, blobs dropped from the page cache), then one new message.

Each arm and workload reports per request TTFT, prompt tokens prefilled and reused, and the
bytes its cache stores; requests of the arms are interleaved one by one, each after
``--settle-ms`` (250) of idle time. Outputs
``OUT_DIR/bench_llama_server.json`` (also on stdout) and ``OUT_DIR/bench_llama_server.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from bench_llama_server_arms import (
    TIMELINE_STEPS,
    Served,
    ServerArm,
    SideArm,
    in_turn,
    log,
    new_side_arm,
    settled,
    started,
)
from benchlib import fmt_ms, loadavg, ratio_of, summary_ms
from harness.procs import short_workdir
from llama_server_arm import DEFAULT_BINARY, LlamaServer
from ttft_harness import (
    Settings,
    Workload,
    add_common_options,
    add_replot_option,
    machine_info,
    size_workload,
    user_message,
)

from model_runtime.llama_backend import LlamaModel
from model_runtime.request import common_prefix
from model_runtime.runtime import default_model_path

SIDE_WORKLOADS = ("shared", "agent", "chat", "restart")
SIDE_ARMS = ("kvcache", "llama-server", "cold")
SIDE_DEFAULT_ARMS = "kvcache,llama-server"
SIDE_SYSTEM_TOKENS = 1400
SIDE_COLORS = {"kvcache": "#1f77b4", "llama-server": "#d62728", "cold": "#7f7f7f"}
AGENT_STEPS = 8
REPLY_TOKENS = 16  # generated per agent step and per chat turn
CHATS = 4
CHAT_TURNS = 3
FOLLOW_UPS = ["Thanks. What should I check first?", "And if that does not help, what then?"]
AGENT_TASK = ("\n\nYou now work as an agent: think one step at a time; after every thought a "
              "tool runs and its observation follows.\nTask: find out why order 44721 is late "
              "and tell the customer what happens next.\nThought:")
# An observation starts with text that merges with a common reply ending when the prompt is
# tokenized again ("." + ".." -> "...", a word + "s" -> one token, a cut-off word + its next
# letter). The first lead that changes the reply's last token is taken, so every step
# provokes a re-tokenization.
OBSERVATION_LEADS = ("..", "\n", "s", "'s", "ing", "ed", "o", "e", "a", "i", "!", ".", ":",
                     ")", ",")


def record(step: int, served: Served, **extra: Any) -> dict[str, Any]:
    return {"step": step, **asdict(served), **extra}


def log_served(workload: str, arm: str, step: int, s: Served) -> None:
    hit = f" {s.info['hit']}/{s.info['tier'] or '-'}" if "hit" in s.info else ""
    log(f"  {workload} {arm} #{step}: ttft {s.ttft_ms:.0f} ms, prompt {s.prompt_tokens}, "
        f"prefilled {s.prefilled}, reused {s.reused}{hit}")


def run_shared_side(arms: list[SideArm], wl: Workload, st: Settings, want_shared: bool,
                    want_restart: bool) -> dict[str, dict[str, Any]]:
    """Workload (a), distinct user messages after the shared system prompt, and (d): restart
    every caching arm and send one more message (the restart follows (a) on the same arms;
    without (a), message 0 only fills the caches first)."""
    turns: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    n = st.repeats + 1 if want_shared else 1
    for i in range(n):
        for arm in in_turn(arms, i):
            if arm.name == "cold" and i >= st.cold_repeats:
                continue
            served = settled(arm, st, max_tokens=st.max_tokens, messages=wl.messages(i))
            log_served("shared", arm.name, i, served)
            turns[arm.name].append(record(i, served))
        if i == st.cold_repeats - 1:
            # Done with the cold arm: its idle runtime would slow the kvcache arm's. Two
            # llama.cpp contexts driven from two threads of one process make libgomp
            # count more threads than cores and stop spinning at its barriers, so every
            # graph node waits on a futex: prefill here was ~30% slower after an idle
            # pause with the cold runtime alive, back to normal once it was closed.
            for arm in arms:
                if arm.name == "cold":
                    arm.close()
    out: dict[str, dict[str, Any]] = {}
    if want_shared:
        out["shared"] = {a.name: {"turns": turns[a.name], "stored": a.stored()} for a in arms}
    if want_restart:
        restarted = {}
        for arm in arms:
            if arm.name == "cold":
                continue
            facts = arm.restart()
            served = settled(arm, st, max_tokens=st.max_tokens, messages=wl.messages(n))
            log_served("restart", arm.name, n, served)
            restarted[arm.name] = {"turns": [record(n, served, restart=facts)],
                                   "stored": arm.stored()}
        out["restart"] = restarted
    return out


def retokenization(model: LlamaModel, prompt_tokens: list[int], generated: list[int],
                   next_text: str) -> dict[str, Any]:
    """Where the next prompt's tokens leave (this prompt + the generated tokens)."""
    before = prompt_tokens + generated
    after = model.tokenize(next_text)
    at = common_prefix(before, after)

    def piece(tokens: list[int], i: int) -> str | None:
        return (model.token_to_piece(tokens[i], render_special=True).decode(errors="replace")
                if i < len(tokens) else None)

    return {"last_generated_at": len(before) - 1, "first_difference_at": at,
            "diverges_at_last_generated_token": at == len(before) - 1,
            "generated_piece": piece(before, at), "retokenized_piece": piece(after, at),
            "retokenized_next_piece": piece(after, at + 1)}


def observation(step: int) -> str:
    return (f"\nObservation {step}: the order tool returned status {200 + step} for order "
            f"44721, carrier scan {step} of {AGENT_STEPS}.\nThought:")


def next_agent_prompt(model: LlamaModel, text: str, prompt_tokens: list[int], served: Served,
                      step: int) -> tuple[str, dict[str, Any]]:
    """The prompt of the next step: this prompt, the reply and an observation whose first
    characters merge with the reply's last token (the first lead that does so)."""
    first_try: tuple[str, dict[str, Any]] | None = None
    for lead in OBSERVATION_LEADS:
        candidate = text + served.text + lead + observation(step)
        check_ = retokenization(model, prompt_tokens, served.tokens, candidate)
        if check_["diverges_at_last_generated_token"]:
            return candidate, {"lead": lead, **check_}
        first_try = first_try or (candidate, {"lead": lead, **check_})
    assert first_try is not None
    return first_try


def run_agent_side(arms: list[SideArm], model: LlamaModel, wl: Workload, st: Settings
                   ) -> dict[str, dict[str, Any]]:
    """Workload (b): a raw-prompt agent loop. Each arm continues its own transcript (greedy:
    the same one when the arms agree); each step appends the reply's text and an observation
    that re-tokenizes the reply's last token."""
    texts = {a.name: wl.system + AGENT_TASK for a in arms}
    turns: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    for step in range(AGENT_STEPS):
        for arm in in_turn(arms, step):
            text = texts[arm.name]
            prompt_tokens = model.tokenize(text)
            served = settled(arm, st, max_tokens=REPLY_TOKENS, prompt=text)
            log_served("agent", arm.name, step, served)
            texts[arm.name], check_ = next_agent_prompt(model, text, prompt_tokens, served,
                                                        step + 1)
            extra = {"retokenization": check_}
            if isinstance(arm, ServerArm):
                extra["server_tokenizer_agrees"] = (
                    arm.server.tokenize(texts[arm.name]) == model.tokenize(texts[arm.name]))
            log(f"    next prompt: lead {check_['lead']!r}: token {check_['generated_piece']!r}"
                f" at {check_['first_difference_at']} becomes {check_['retokenized_piece']!r}"
                f" (last generated token: {check_['diverges_at_last_generated_token']})")
            turns[arm.name].append(record(step, served, **extra))
    return {a.name: {"turns": turns[a.name], "stored": a.stored()} for a in arms}


def run_chat_side(arms: list[SideArm], wl: Workload, st: Settings) -> dict[str, dict[str, Any]]:
    """Workload (c): CHATS chats of CHAT_TURNS turns over the system prompt, through the chat
    template, the chats interleaved turn by turn (every turn follows another chat's)."""
    chats = {a.name: [[{"role": "system", "content": wl.system}] for _ in range(CHATS)]
             for a in arms}
    turns: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    step = 0
    for turn in range(CHAT_TURNS):
        for c in range(CHATS):
            user = user_message(c) if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
            for arm in in_turn(arms, step):
                history = chats[arm.name][c]
                history.append({"role": "user", "content": user})
                served = settled(arm, st, max_tokens=REPLY_TOKENS, messages=list(history))
                history.append({"role": "assistant", "content": served.text})
                log_served("chat", arm.name, step, served)
                turns[arm.name].append(record(step, served, chat=c, turn=turn))
            step += 1
    return {a.name: {"turns": turns[a.name], "stored": a.stored()} for a in arms}


def side_summary(result: dict[str, Any]) -> dict[str, Any]:
    turns = result["turns"]
    ttft = [t["ttft_ms"] for t in turns]
    summary = {"requests": len(turns), "ttft_ms": summary_ms(ttft),
               "ttft_ms_after_first": summary_ms(ttft[1:]),
               "prompt_tokens_total": sum(t["prompt_tokens"] for t in turns),
               "prefilled_total": sum(t["prefilled"] for t in turns),
               "reused_total": sum(t["reused"] for t in turns),
               "stored_bytes": result["stored"].get("bytes")}
    timelines = [t["info"]["timeline_ms"] for t in turns[1:] if "timeline_ms" in t["info"]]
    if timelines:  # the runtime's arms: where the TTFT after the first request went
        summary["timeline_ms_after_first_median"] = {
            step: round(float(np.median([tl[step] for tl in timelines])), 3)
            for step in TIMELINE_STEPS}
        # The rest of the TTFT the client saw: between the steps (the model thread busy
        # with a batch already running) and around them (the caller's thread, the queue).
        summary["timeline_ms_after_first_median"]["other"] = round(float(np.median(
            [t["ttft_ms"] - sum(t["info"]["timeline_ms"].values()) for t in turns[1:]
             if "timeline_ms" in t["info"]])), 3)
    return summary


def side_agreement(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy replies per request compared across arms."""
    names = list(results)
    if len(names) < 2:
        return {"compared": 0}
    firsts = results[names[0]]["turns"]
    same = sum(all(results[n]["turns"][i]["text"] == t["text"] for n in names[1:]
                   if i < len(results[n]["turns"]))
               for i, t in enumerate(firsts))
    return {"compared": len(firsts), "identical_replies": same}


SIDE_DESCRIPTIONS = {
    "shared": "distinct user messages after a shared system prompt (chat template); request "
              "0 fills the caches",
    "agent": f"raw-prompt agent loop, {AGENT_STEPS} steps of {REPLY_TOKENS} tokens; each step "
             "appends the reply and an observation that re-tokenizes the reply's last token",
    "chat": f"{CHATS} chats x {CHAT_TURNS} turns over the system prompt (chat template), "
            "interleaved turn by turn",
    "restart": "after 'shared': stop and start every arm (kvcache: runtime and daemon, RAM "
               "tier deleted, blobs dropped from the page cache), then one new message",
}


def run_side(args: argparse.Namespace, st: Settings, workloads: list[str], arm_names: list[str],
             command: str) -> dict[str, Any]:
    started_at = time.perf_counter()
    load_start = loadavg()
    model_path = default_model_path()
    workdir = short_workdir("kvbs")
    model = LlamaModel(model_path)
    binary: Path = args.llama_server
    if "llama-server" in arm_names and not binary.is_file():
        log(f"llama-server arm skipped: no binary at {binary} "
            "(build it with: bash tools/build_llama_server.sh)")
        arm_names = [a for a in arm_names if a != "llama-server"]
    results: dict[str, dict[str, Any]] = {}
    retok: dict[str, Any] = {}
    try:
        wl = size_workload(model, args.system_tokens)
        log(f"side by side: system prompt {wl.system_tokens} tokens, arms {arm_names}, "
            f"workloads {workloads}")

        def arms_for(workload: str, cold: bool = False) -> list[SideArm]:
            return [new_side_arm(n, model_path, model, st, workdir, binary, workload)
                    for n in arm_names if cold or n != "cold"]

        if "shared" in workloads or "restart" in workloads:
            with started(arms_for("shared", cold="shared" in workloads)) as arms:
                results.update(run_shared_side(arms, wl, st, "shared" in workloads,
                                               "restart" in workloads))
        if "agent" in workloads:
            with started(arms_for("agent")) as arms:
                results["agent"] = run_agent_side(arms, model, wl, st)
            retok = agent_retokenization(results["agent"])
        if "chat" in workloads:
            with started(arms_for("chat")) as arms:
                results["chat"] = run_chat_side(arms, wl, st)
    finally:
        model.close()
        shutil.rmtree(workdir, ignore_errors=True)
    ordered = {w: results[w] for w in SIDE_WORKLOADS if w in results}
    return {
        "benchmark": "bench_compare side by side",
        "command": command,
        "settings": {**asdict(st), "system_prompt_tokens": wl.system_tokens,
                     "system_prompt_words": wl.words, "reply_tokens": REPLY_TOKENS,
                     "agent_steps": AGENT_STEPS, "chats": CHATS, "chat_turns": CHAT_TURNS},
        "arms": arm_names,
        "model": {"file": model_path.name, "bytes": model_path.stat().st_size},
        "llama_server": {"binary": str(binary), "argv_example": LlamaServer(
            binary, model_path, threads=st.threads, n_ctx=st.n_ctx,
            log_path=Path("server.log")).argv()[1:]} if "llama-server" in arm_names else None,
        "machine": machine_info(st.threads),
        "load": {"loadavg_at_start": load_start,
                 "loadavg_at_end": loadavg()},
        "definitions": {
            "ttft_ms": "client wall time from sending the request to the first generated token "
                       "(Runtime: first TokenEvent; llama-server: first streamed chunk with a "
                       "token)",
            "prefilled": "prompt tokens computed by the request: kvcache/cold: prompt_tokens - "
                         "cache_delta.tokens_read (at least 1); llama-server: timings.prompt_n",
            "reused": "kvcache/cold: cache_delta.tokens_read (daemon restore or live KV); "
                      "llama-server: timings.cache_n",
            "stored_bytes": "kvcache: daemon disk-tier bytes after the workload; llama-server: "
                            "its RAM prompt cache as logged; cold: 0"},
        "workloads": {w: {"description": SIDE_DESCRIPTIONS[w],
                          "summary": {a: side_summary(r) for a, r in res.items()},
                          "ratios": side_ratios(res),
                          "agreement": side_agreement(res), "arms": res}
                      for w, res in ordered.items()},
        "agent_retokenization": retok,
        "elapsed_s": round(time.perf_counter() - started_at, 1),
    }


def side_ratios(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if "kvcache" not in res or "llama-server" not in res:
        return {}
    kv, srv = side_summary(res["kvcache"]), side_summary(res["llama-server"])
    key = "ttft_ms_after_first" if kv["requests"] > 1 else "ttft_ms"
    # Requests were interleaved: the ratio of each pair is immune to slow drifts in load.
    pairs = [a["ttft_ms"] / b["ttft_ms"] for a, b in
             zip(res["kvcache"]["turns"], res["llama-server"]["turns"], strict=True)
             if a["step"] == b["step"] and b["ttft_ms"] > 0]
    skip = 1 if len(pairs) > 1 else 0
    return {f"kvcache_over_llama_server_{key}_median":
            ratio_of(kv[key].get("median"), srv[key].get("median")),
            "kvcache_over_llama_server_paired_ttft_median":
            round(float(np.median(pairs[skip:])), 3) if pairs else None,
            "kvcache_over_llama_server_prefilled_total":
            ratio_of(kv["prefilled_total"], srv["prefilled_total"])}


def agent_retokenization(result: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the steps whose next prompt re-tokenized the reply's last token."""
    out = {}
    for arm, res in result.items():
        checks = [t["retokenization"] for t in res["turns"][:-1]]
        out[arm] = {"steps_checked": len(checks),
                    "diverged_at_last_generated_token":
                    sum(c["diverges_at_last_generated_token"] for c in checks),
                    "examples": [{"lead": c["lead"], "generated": c["generated_piece"],
                                  "retokenized": c["retokenized_piece"],
                                  "retokenized_next": c["retokenized_next_piece"],
                                  "position": c["first_difference_at"]} for c in checks]}
    return out


def plot_side(doc: dict[str, Any], path: Path) -> None:
    """Agent loop per step (TTFT, prompt tokens prefilled) and each workload's medians and
    totals, one color per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = doc["workloads"]
    arms = doc["arms"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    if "agent" in workloads:
        agent = workloads["agent"]["arms"]
        width = 0.8 / len(arms)
        for j, arm in enumerate(a for a in arms if a in agent):
            turns = agent[arm]["turns"]
            steps = [t["step"] + 1 for t in turns]
            axes[0][0].plot(steps, [t["ttft_ms"] for t in turns], marker="o", label=arm,
                            color=SIDE_COLORS[arm])
            axes[0][1].bar([s + (j - (len(arms) - 1) / 2) * width for s in steps],
                           [t["prefilled"] for t in turns], width * 0.92, label=arm,
                           color=SIDE_COLORS[arm])
        axes[0][0].set_yscale("log")
        axes[0][0].set_title("agent loop: TTFT per step (log)", fontsize=10)
        axes[0][0].set_xlabel("step")
        axes[0][0].set_ylabel("ms")
        axes[0][1].set_yscale("log")
        axes[0][1].set_title("agent loop: prompt tokens prefilled per step (log)", fontsize=10)
        axes[0][1].set_xlabel("step")
    names = list(workloads)
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        xs = [g + (j - (len(arms) - 1) / 2) * width for g in range(len(names))]
        med, pre = [], []
        for w in names:
            s = workloads[w]["summary"].get(arm)
            key = "ttft_ms_after_first" if s and s["requests"] > 1 else "ttft_ms"
            med.append(s[key]["median"] if s else 0)
            pre.append(s["prefilled_total"] if s else 0)
        axes[1][0].bar(xs, med, width * 0.92, label=arm, color=SIDE_COLORS[arm])
        axes[1][1].bar(xs, pre, width * 0.92, label=arm, color=SIDE_COLORS[arm])
        for x, m in zip(xs, med, strict=True):
            if m:
                axes[1][0].text(x, m * 1.1, fmt_ms(m), ha="center", fontsize=7, rotation=90)
    for ax, title in ((axes[1][0], "median TTFT per workload (after the first request; log)"),
                      (axes[1][1], "prompt tokens prefilled, workload total (log)")):
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_title(title, fontsize=10)
    for ax in axes[1]:
        ax.set_ylim(top=ax.get_ylim()[1] * 6)  # room for the labels and the legend
    for ax in axes.flat:
        ax.grid(axis="y", which="both", alpha=0.25)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left" if ax in axes[1] else "upper right")
    m = doc["machine"]
    fig.suptitle(f"kvcache vs llama-server: SmolLM2-135M, {doc['settings']['system_prompt_tokens']}"
                 f"-token system prompt, {m['threads']} threads, {m['cpu_count']} CPUs",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def side_table(doc: dict[str, Any]) -> str:
    rows = [f"{'workload':9} {'arm':13} {'median TTFT':>12} {'prefilled':>10} "
            f"{'of prompt':>10} {'stored bytes':>14}"]
    for w, res in doc["workloads"].items():
        for arm, s in res["summary"].items():
            key = "ttft_ms_after_first" if s["requests"] > 1 else "ttft_ms"
            stored = "-" if s["stored_bytes"] is None else f"{s['stored_bytes']:,}"
            rows.append(f"{w:9} {arm:13} {fmt_ms(s[key]['median']):>12} "
                        f"{s['prefilled_total']:>10,} {s['prompt_tokens_total']:>10,} "
                        f"{stored:>14}")
    rows.append("where a runtime's TTFT went (after each workload's first request), median ms:")
    for w, res in doc["workloads"].items():
        for arm, s in res["summary"].items():
            steps = s.get("timeline_ms_after_first_median")
            if steps:
                rows.append(f"  {w:9} {arm:13} " + ", ".join(f"{k} {v:g}"
                                                         for k, v in steps.items()))
    return "\n".join(rows)




QUICK_HELP = "1 repeat: a smoke run"


def add_options(parser: argparse.ArgumentParser) -> None:
    """This benchmark's own flags (after the common ones of ttft_harness). ``--workloads``
    and ``--arms`` default to None: ``selections`` fills in the defaults (and
    tools/bench_compare.py tells this benchmark by them)."""
    parser.add_argument("--workloads", default=None,
                        help=f"side-by-side mode: comma-separated of {','.join(SIDE_WORKLOADS)}")
    parser.add_argument("--arms", default=None,
                        help=f"side-by-side arms, comma-separated of {','.join(SIDE_ARMS)} "
                             f"(default {SIDE_DEFAULT_ARMS})")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY,
                        help="llama-server binary (tools/build_llama_server.sh builds it)")
    parser.add_argument("--system-tokens", type=int, default=SIDE_SYSTEM_TOKENS,
                        help="side-by-side system prompt size, tokens")
    parser.add_argument("--settle-ms", type=float, default=250.0,
                        help="side by side: idle time before every request, so that one "
                             "arm's work after its reply does not overlap the next arm's "
                             "request (default 250)")


def selections(parser: argparse.ArgumentParser, args: argparse.Namespace
               ) -> tuple[list[str], list[str]]:
    """The workloads and arms asked for (every workload; kvcache and llama-server)."""
    return (choices(parser, "--workloads", args.workloads or ",".join(SIDE_WORKLOADS),
                    SIDE_WORKLOADS),
            choices(parser, "--arms", args.arms or SIDE_DEFAULT_ARMS, SIDE_ARMS))


def choices(parser: argparse.ArgumentParser, flag: str, value: str, allowed: Sequence[str]
            ) -> list[str]:
    """A comma-separated list of known names, in the order given (exit 2 otherwise)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        parser.error(f"{flag}: unknown or empty {unknown or value!r}; choose from "
                     f"{', '.join(allowed)}")
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace, workloads: list[str], arm_names: list[str],
        command: str) -> None:
    """OUT_DIR/bench_llama_server.json and .png (``command``: how this run was asked for)."""
    out = args.out_dir / "bench_llama_server.json"
    chart = args.out_dir / "bench_llama_server.png"
    if args.replot:
        plot_side(json.loads(out.read_text()), chart)
        return
    repeats = args.repeats or (1 if args.quick else 15)
    st = Settings(lengths=(args.system_tokens,), repeats=repeats,
                  cold_repeats=min(2, repeats), threads=args.threads, quick=args.quick,
                  settle_s=args.settle_ms / 1000)
    doc = run_side(args, st, workloads, arm_names, command)
    text = json.dumps(doc, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    plot_side(doc, chart)
    print(text, flush=True)
    log("median TTFT (after each workload's first request), prompt tokens prefilled, "
        "stored bytes:\n" + side_table(doc))
    log(f"wrote {out} and {chart} in {doc['elapsed_s']} s")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_options(parser, quick_help=QUICK_HELP,
                       repeats_help="requests after the first of the shared workload "
                                    "(default 15; --quick: 1)")
    add_replot_option(parser)
    add_options(parser)
    args = parser.parse_args(argv)
    workloads, arms = selections(parser, args)
    run(args, workloads, arms, "python tools/bench_llama_server.py "
        + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
