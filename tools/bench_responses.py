"""A conversation continued by ``previous_response_id`` (the Responses API) against the
same conversation sent whole each turn through chat completions, both through kvcache's
gateway, and optionally against llama.cpp's ``llama-server --jinja`` sending it whole:

    python tools/bench_responses.py [--model PATH] [--quick] [--turns 6]
                                    [--restart-after 3] [--max-tokens 32]
                                    [--llama-server PATH] [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr).

Each arm has its own conversation (its own system prompt's first line, so that no arm is
warmed by another's saved states) on its own worker of two (``prompt_cache_key``: a
runtime reuses an idle sequence that shares a few tokens with a new prompt, so two
conversations on one worker would take each other's live KV): the same user turns,
greedy replies, streamed. Per
turn: prompt tokens, prompt tokens prefilled (prompt minus ``cached_tokens``;
llama-server's ``timings.prompt_n``) and TTFT (request sent to the first delta). After
``--restart-after`` turns the gateway and its workers are stopped and started again (the
daemon and the stored responses stay): the next turn is restored from the daemon.
Targets: the Responses arm prefills only each turn's new input, and its TTFT is at most
the chat arm's (and llama-server's). ``--quick``: SmolLM2 (the default model), 6 turns,
32 tokens a reply.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchlib import Daemon, emit_json, log, machine_info
from harness.procs import Gateway, short_workdir
from harness.system_prompt import build_system_prompt
from llama_server_arm import DEFAULT_BINARY, LlamaServer

TURNS = ["Parcel 101 goes to Paris. Where is it now?", "And parcel 102, going to Lyon?",
         "Which of the two arrives first?", "Can parcel 101 be sent to Rome instead?",
         "What does the change cost?", "Summarize both parcels in one sentence."]


def chat_turn(client: Any, model: str, messages: list[dict[str, Any]], max_tokens: int,
              **extra: Any) -> dict[str, Any]:
    start = time.perf_counter()
    first = 0.0
    text = ""
    usage: Any = None
    timings: dict[str, Any] = {}
    tier = None
    for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, **extra):
        if chunk.usage is not None:
            usage = chunk.usage
        timings = (chunk.model_extra or {}).get("timings") or timings
        tier = ((chunk.model_extra or {}).get("kvcache") or {}).get("tier", tier)
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    prefilled = timings.get("prompt_n", usage.prompt_tokens - cached)
    return {"ttft_ms": round(((first or time.perf_counter()) - start) * 1e3, 2),
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
            "prefilled": prefilled, "tier": tier, "reply": text}


def responses_turn(client: Any, model: str, instructions: str, text: str,
                   previous: str | None, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    first = 0.0
    final: Any = None
    for event in client.responses.create(model=model, instructions=instructions, input=text,
                                         previous_response_id=previous, temperature=0,
                                         max_output_tokens=max_tokens, stream=True,
                                         prompt_cache_key="responses"):
        if event.type.endswith(".delta"):
            first = first or time.perf_counter()
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    usage = final.usage
    cached = usage.input_tokens_details.cached_tokens
    kv = final.model_extra.get("kvcache", {})
    return {"ttft_ms": round(((first or time.perf_counter()) - start) * 1e3, 2),
            "prompt_tokens": usage.input_tokens, "cached_tokens": cached,
            "prefilled": usage.input_tokens - cached, "tier": kv.get("tier"),
            "reply": final.output_text, "id": final.id}


def summary(rows: list[dict[str, Any]], restart_after: int) -> dict[str, Any]:
    later = [r["ttft_ms"] for r in rows[1:]]
    return {"turns": rows, "prefilled_total": sum(r["prefilled"] for r in rows),
            "prefilled_after_first": sum(r["prefilled"] for r in rows[1:]),
            "ttft_after_first_median_ms": round(statistics.median(later), 2) if later
            else None,
            "ttft_after_restart_ms": rows[restart_after]["ttft_ms"]
            if 0 < restart_after < len(rows) else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="6 turns, 32 tokens a reply")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--restart-after", type=int, default=3,
                        help="restart the gateway and its workers after this many turns "
                             "(0: never)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=600,
                        help="the system prompt's size (roughly, in SmolLM2 tokens)")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY,
                        help="its arm runs when this binary exists "
                             "(tools/build_llama_server.sh)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.turns, args.max_tokens = 6, 32
    turns = [TURNS[i % len(TURNS)] for i in range(args.turns)]
    if args.model is None:
        from model_runtime.runtime import default_model_path

        args.model = default_model_path()
    import openai

    workdir = short_workdir("kvbr")
    daemon = Daemon(workdir / "data", workdir / "ram", log_dir=workdir)

    def gateway() -> Gateway:
        return Gateway(workdir / "gateway.log", "--model", f"bench={args.model}",
                       "--workers", "2", "--n-seq-max", "2", "--n-ctx", "4096", "--responses-dir",
                       str(workdir / "responses"), cache=daemon.address,
                       threads=args.threads)

    server = LlamaServer(args.llama_server, args.model, threads=args.threads, n_ctx=4096,
                         log_path=workdir / "llama-server.log", extra_args=["--jinja"]) \
        if args.llama_server.is_file() else None
    system = build_system_prompt(args.system_tokens)
    doc: dict[str, Any] = {"benchmark": "responses", "machine": machine_info(),
                           "settings": {k: str(v) for k, v in vars(args).items()},
                           "llama_server": None if server is None else "run"}
    gw = gateway()
    rows: dict[str, list[dict[str, Any]]] = {"responses": [], "chat": []}
    if server is not None:
        rows["llama-server"] = []
    try:
        daemon.start()
        gw.start(timeout=300)
        if server is not None:
            server.start()
            theirs = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                   api_key="none", max_retries=0, timeout=600)
        chats = {name: [{"role": "system", "content": f"Conversation {name}.\n{system}"}]
                 for name in rows if name != "responses"}
        previous: str | None = None
        for i, text in enumerate(turns):
            if args.restart_after and i == args.restart_after:
                log("restarting the gateway and its workers")
                gw.close()
                gw = gateway()
                gw.start(timeout=300)
            ours = gw.client(timeout=600)
            log(f"turn {i + 1}: responses")
            row = responses_turn(ours, "bench", f"Conversation responses.\n{system}", text,
                                 previous, args.max_tokens)
            previous = row.pop("id")
            rows["responses"].append({"turn": i + 1, **row})
            for name, messages in chats.items():
                log(f"turn {i + 1}: {name}")
                messages.append({"role": "user", "content": text})
                client = ours if name == "chat" else theirs
                key = {"prompt_cache_key": "chat"} if name == "chat" else {}
                row = chat_turn(client, "bench", messages, args.max_tokens, **key)
                messages.append({"role": "assistant", "content": row["reply"]})
                rows[name].append({"turn": i + 1, **row})
        result = {name: summary(r, args.restart_after) for name, r in rows.items()}
        ours_, chat = result["responses"], result["chat"]
        ratios: dict[str, Any] = {
            "prefilled_after_first_vs_chat": round(ours_["prefilled_after_first"] /
                                                   max(1, chat["prefilled_after_first"]), 3),
            "ttft_after_first_median_vs_chat": round(ours_["ttft_after_first_median_ms"] /
                                                     chat["ttft_after_first_median_ms"], 3)}
        if "llama-server" in result:
            ls = result["llama-server"]
            ratios["prefilled_after_first_vs_llama_server"] = round(
                ours_["prefilled_after_first"] / max(1, ls["prefilled_after_first"]), 3)
            ratios["ttft_after_first_median_vs_llama_server"] = round(
                ours_["ttft_after_first_median_ms"] / ls["ttft_after_first_median_ms"], 3)
        doc.update(result, ratios=ratios)
    finally:
        if server is not None:
            server.stop()
        gw.close()
        daemon.close()
        shutil.rmtree(workdir, ignore_errors=True)
    for arm in rows.values():
        for row in arm:
            row.pop("reply", None)
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
