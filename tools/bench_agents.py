"""Agents' workloads, kvcache's gateway side by side with llama.cpp's ``llama-server
--jinja`` (same model, threads and context per sequence), both through OpenAI's client:

    python tools/bench_agents.py [--model PATH] [--threads 2] [--steps 8] [--rounds 2]
                                 [--requests 4] [--workloads agent,concurrent,json]
                                 [--llama-server PATH | --without-llama-server]
                                 [--gateway-arg ARG ...] [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr).

* ``agent``: a tool-calling agent loop of ``--steps`` steps on each arm: the request (tools,
  ``tool_choice`` ``required`` on kvcache; llama-server cannot force a call on a template
  without tools, so it gets ``auto``, unless ``--template hermes`` gives both arms a copy
  of the model with a template that has tools), the reply appended as returned, a tool result for
  each call (a reply without calls is followed by "Go on with the next lookup."). Then
  kvcache's loop is replayed on llama-server (``llama-server_replay``: the same requests,
  step by step, whatever it answers), so the tokens each prefills compare on the same
  prompts. Per step:
  prompt tokens, prompt tokens prefilled (prompt minus ``cached_tokens``; llama-server also
  reports ``timings.prompt_n``), TTFT (request sent to the first chunk with a delta).
* ``concurrent``: 4 concurrent streaming clients over a shared ~1,000-token system prompt,
  ``--requests`` requests each (a distinct user message, 32 tokens, greedy); one worker
  with 4 slots against ``llama-server -np 4``; ``--rounds`` rounds, the arms' order
  alternating. Aggregate completion tokens per second, TTFT median, inter-token median
  (gaps between content chunks) and per token ((last - first chunk) / (completion tokens
  - 1): blind to how a server groups tokens in chunks), with ratios kvcache /
  llama-server; on kvcache's arm, each token's way from llama.cpp to the socket as its
  gateway measured it (``token_path_ms``).
* ``json``: decoding speed under a JSON schema (``response_format`` json_schema, strict:
  nested object, array, enum, integer) against the same requests unconstrained, on each
  arm, one client, ``--requests`` x ``--rounds`` requests each, alternating. Tokens per
  second of decoding (completion tokens after the first / time from first to last chunk);
  ratios constrained / unconstrained per arm, and kvcache / llama-server constrained;
  also each request's whole time (median), blind to how a server groups tokens in chunks,
  and the constrained request not streamed (``whole``: as instructor and most SDK calls
  send it), its time to the whole answer.

llama-server comes from ``tools/build_llama_server.sh`` (the llama.cpp vendored in the
llama-cpp-python sdist); without it the benchmark says so and stops, unless
``--without-llama-server`` asks for the gateway's figures alone (no ratios: nothing to
compare them with).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import Daemon, at_least_one, emit_json, log, machine_info, summarize
from harness.make_tiny_gguf import HERMES_TEMPLATE
from harness.procs import Gateway, short_workdir
from harness.system_prompt import build_system_prompt
from llama_server_arm import DEFAULT_BINARY, LlamaServer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Today's weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "track_parcel", "description": "Where a parcel is and when it arrives.",
        "parameters": {"type": "object", "properties": {"parcel_id": {"type": "string"}},
                       "required": ["parcel_id"]}}},
]
AGENT_SYSTEM = ("You are the dispatcher of a delivery company. For every question, call the "
                "tools to look things up; never guess. ") * 4
TASK = ("Parcels 101 to 108 go to Paris, Lyon, Rome, Oslo, Madrid, Vienna, Prague and Berlin. "
        "For each one, track it, then check the weather where it goes.")
N_CONCURRENT = 4
CONCURRENT_TOKENS = 32
JSON_TOKENS = 96
ORDER_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["customer", "priority", "items"],
    "properties": {
        "customer": {"type": "object", "additionalProperties": False,
                     "required": ["name", "city"],
                     "properties": {"name": {"type": "string"}, "city": {"type": "string"}}},
        "priority": {"enum": ["low", "normal", "urgent"]},
        "items": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "quantity"],
            "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}}}}}}


class Arm:
    """One server behind OpenAI's API."""

    def __init__(self, name: str, base_url: str, model: str) -> None:
        import openai

        self.name = name
        self.model = model
        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0,
                                    timeout=600)

    def stream(self, messages: list[dict[str, Any]], max_tokens: int,
               **extra: Any) -> dict[str, Any]:
        """One streamed request: TTFT, the gaps between content chunks, usage, and the
        reply as a message to append."""
        start = time.perf_counter()
        first = 0.0
        stamps: list[float] = []
        content, reasoning = "", ""
        calls: dict[int, dict[str, Any]] = {}
        usage: Any = None
        timings: dict[str, Any] = {}
        details: dict[str, Any] = {}  # kvcache's own field (the gateway's arm)
        for chunk in self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, **extra):
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            timings = (chunk.model_extra or {}).get("timings") or timings
            details = (chunk.model_extra or {}).get("kvcache") or details
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text = delta.content or ""
            extra_reasoning = (delta.model_extra or {}).get("reasoning_content") or ""
            if text or delta.tool_calls or extra_reasoning:
                first = first or now
                stamps.append(now)
            content += text
            reasoning += extra_reasoning
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] = call.function.name or slot["name"]
                    slot["arguments"] += call.function.arguments or ""
        cached = usage.prompt_tokens_details.cached_tokens if usage and \
            usage.prompt_tokens_details else 0
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]
        tokens = usage.completion_tokens if usage else 0
        return {"ttft_s": (first or time.perf_counter()) - start,
                "total_s": time.perf_counter() - start,
                "gaps_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                # Per token, blind to how a server groups tokens in chunks: (last - first
                # chunk) / (completion tokens - 1).
                "per_token_s": (stamps[-1] - stamps[0]) / (tokens - 1)
                if tokens > 1 and len(stamps) > 1 else None,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": tokens,
                "cached_tokens": cached, "server_prompt_n": timings.get("prompt_n"),
                "timeline_ms": details.get("timeline"),
                "gateway_ms": details.get("gateway"),
                "message": message}


    def whole(self, messages: list[dict[str, Any]], max_tokens: int,
              **extra: Any) -> dict[str, Any]:
        """One request not streamed: its time to the whole answer, and its tokens."""
        start = time.perf_counter()
        reply = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0, **extra)
        return {"total_s": time.perf_counter() - start,
                "completion_tokens": reply.usage.completion_tokens if reply.usage else 0}


def agent_loop(arm: Arm, steps: int, force: bool,
               transcript: list[list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """The loop; each step's messages are appended to ``transcript`` when given."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": AGENT_SYSTEM},
                                      {"role": "user", "content": TASK}]
    rows = []
    for step in range(steps):
        if transcript is not None:
            transcript.append(list(messages))
        got = arm.stream(messages, 48, tools=TOOLS,
                         tool_choice="required" if force else "auto")
        reply = got.pop("message")
        got.pop("gaps_s")
        calls = reply.get("tool_calls") or []
        got.update(step=step + 1, tool_calls=len(calls),
                   prefilled=(got["prompt_tokens"] or 0) - got["cached_tokens"])
        rows.append(got)
        messages.append(reply)
        for call in calls:
            result = {"get_weather": "18 C, light rain", "track_parcel":
                      f"In transit, arrives tomorrow (step {step + 1})."}.get(
                call["function"]["name"], "unknown tool")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if not calls:
            messages.append({"role": "user", "content": "Go on with the next lookup."})
    return rows


def agent_replay(arm: Arm, transcript: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Another loop's requests sent as they were (its tool calls and results, whatever
    this arm answers): the same prompts step by step, so what each arm prefills compares
    directly."""
    rows = []
    for step, messages in enumerate(transcript):
        got = arm.stream(messages, 48, tools=TOOLS, tool_choice="auto")
        got.pop("message")
        got.pop("gaps_s")
        got.update(step=step + 1, tool_calls=0,
                   prefilled=(got["prompt_tokens"] or 0) - got["cached_tokens"])
        rows.append(got)
    return rows


def loop_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"steps": rows,
            "prompt_tokens_total": sum(r["prompt_tokens"] or 0 for r in rows),
            "prefilled_total": sum(r["prefilled"] for r in rows),
            "ttft_median_ms": round(statistics.median(r["ttft_s"] for r in rows) * 1e3, 1),
            "ttft_after_first_median_ms": round(statistics.median(
                r["ttft_s"] for r in rows[1:]) * 1e3, 1) if len(rows) > 1 else None,
            "steps_with_tool_calls": sum(1 for r in rows if r["tool_calls"])}


def loop_ratios(ours: dict[str, Any], theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if theirs is None else {
        "prefilled_total": round(ours["prefilled_total"] / max(1, theirs["prefilled_total"]),
                                 3),
        "ttft_median": round(ours["ttft_median_ms"] / theirs["ttft_median_ms"], 3),
        "ttft_after_first_median": round(
            ours["ttft_after_first_median_ms"] / theirs["ttft_after_first_median_ms"], 3)
        if ours["ttft_after_first_median_ms"] else None}


def concurrent_round(arm: Arm, system: str, requests: int, round_no: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for j in range(requests):
            user = f"Client {index}, request {j} of round {round_no}: which aisle for item {j}?"
            try:
                got = arm.stream([{"role": "system", "content": system},
                                  {"role": "user", "content": user}], CONCURRENT_TOKENS)
            except Exception as exc:  # reported, not hidden
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            with lock:
                results.append(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CONCURRENT)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in results)
    return {"seconds": elapsed, "completion_tokens": tokens, "errors": errors,
            "ttft_s": [r["ttft_s"] for r in results],
            "gaps_s": [g for r in results for g in r["gaps_s"]],
            "per_token_s": [r["per_token_s"] for r in results if r["per_token_s"]],
            "token_path_p50_ms": [r["gateway_ms"]["token_path_ms"]["p50"] for r in results
                                  if (r["gateway_ms"] or {}).get("token_path_ms")],
            "token_path_p99_ms": [r["gateway_ms"]["token_path_ms"]["p99"] for r in results
                                  if (r["gateway_ms"] or {}).get("token_path_ms")],
            "prompt_tokens": [r["prompt_tokens"] for r in results],
            "prefilled": [(r["prompt_tokens"] or 0) - r["cached_tokens"] for r in results],
            "timelines": [{**r["timeline_ms"], "gateway_before_worker":
                           (r["gateway_ms"] or {}).get("before_worker_ms", 0.0),
                           "ttft": r["ttft_s"] * 1e3}
                          for r in results if r["timeline_ms"]]}


def decode_rate(got: dict[str, Any]) -> float | None:
    """Tokens per second after the first: completion tokens after the first over the
    time from the first to the last chunk (None when too short to tell)."""
    seconds = sum(got["gaps_s"])
    return (got["completion_tokens"] - 1) / seconds if seconds > 0 and \
        got["completion_tokens"] > 1 else None


def json_runs(arms: list[Arm], requests: int, rounds: int) -> dict[str, Any]:
    """Each arm, constrained and not, alternating: decoding rates and their ratios."""
    schema = {"type": "json_schema", "json_schema": {"name": "order", "strict": True,
                                                     "schema": ORDER_SCHEMA}}
    rates: dict[str, dict[str, list[float]]] = {
        arm.name: {"free": [], "schema": []} for arm in arms}
    tokens: dict[str, dict[str, list[int]]] = {
        arm.name: {"free": [], "schema": [], "whole": []} for arm in arms}
    totals: dict[str, dict[str, list[float]]] = {
        arm.name: {"free": [], "schema": [], "whole": []} for arm in arms}
    for round_no in range(rounds):
        for arm in (arms if round_no % 2 == 0 else arms[::-1]):
            log(f"json: round {round_no + 1}, {arm.name}")
            for j in range(requests):
                messages = [{"role": "system", "content": "You turn requests into orders."},
                            {"role": "user", "content": f"Order {j + 1} of round "
                             f"{round_no + 1}: three boxes of tea and two mugs for Ana in "
                             "Porto, urgent. Describe it as JSON."}]
                for kind, extra in (("free", {}), ("schema", {"response_format": schema})):
                    got = arm.stream(messages, JSON_TOKENS, **extra)
                    rate = decode_rate(got)
                    if rate is not None:
                        rates[arm.name][kind].append(rate)
                    tokens[arm.name][kind].append(got["completion_tokens"])
                    totals[arm.name][kind].append(got["total_s"])
                got = arm.whole(messages, JSON_TOKENS, response_format=schema)
                tokens[arm.name]["whole"].append(got["completion_tokens"])
                totals[arm.name]["whole"].append(got["total_s"])
    doc: dict[str, Any] = {}
    for name, by_kind in rates.items():
        free = statistics.median(by_kind["free"]) if by_kind["free"] else None
        constrained = statistics.median(by_kind["schema"]) if by_kind["schema"] else None
        doc[name] = {"tokens_per_s_free": round(free, 2) if free else None,
                     "tokens_per_s_schema": round(constrained, 2) if constrained else None,
                     "completion_tokens_free": tokens[name]["free"],
                     "completion_tokens_schema": tokens[name]["schema"],
                     "schema_over_free": round(constrained / free, 3)
                     if free and constrained else None,
                     "request_ms_median_free": round(statistics.median(
                         totals[name]["free"]) * 1e3, 1),
                     "request_ms_median_schema": round(statistics.median(
                         totals[name]["schema"]) * 1e3, 1),
                     "completion_tokens_whole": tokens[name]["whole"],
                     "request_ms_median_whole": round(statistics.median(
                         totals[name]["whole"]) * 1e3, 1)}
    ours, theirs = doc.get("kvcache"), doc.get("llama-server")
    doc["ratios"] = None if not theirs or not ours or not theirs["tokens_per_s_schema"] \
        or not ours["tokens_per_s_schema"] else {
        "schema_tokens_per_s": round(ours["tokens_per_s_schema"] /
                                     theirs["tokens_per_s_schema"], 3),
        # The whole request (prompt, 96 tokens, answer): blind to how a server groups
        # tokens into chunks, which a rate between first and last chunk is not.
        "schema_request_time": round(ours["request_ms_median_schema"] /
                                     theirs["request_ms_median_schema"], 3),
        # Not streamed: the time to the whole answer.
        "whole_request_time": round(ours["request_ms_median_whole"] /
                                    theirs["request_ms_median_whole"], 3)}
    return doc


def concurrent_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [t for r in rounds for t in r["ttft_s"]]
    gaps = [g for r in rounds for g in r["gaps_s"]]
    per_token = [g for r in rounds for g in r["per_token_s"]]
    path_p50 = [p for r in rounds for p in r["token_path_p50_ms"]]
    path_p99 = [p for r in rounds for p in r["token_path_p99_ms"]]
    timelines = [t for r in rounds for t in r["timelines"]]
    seconds = sum(r["seconds"] for r in rounds)
    tokens = sum(r["completion_tokens"] for r in rounds)
    return {"requests": len(ttft), "errors": [e for r in rounds for e in r["errors"]][:5],
            "aggregate_tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "ttft": summarize(ttft) if ttft else None,
            "inter_token": summarize(gaps) if gaps else None,
            "per_token": summarize(per_token) if per_token else None,
            # The gateway's arm: each request's median and p99 token way (llama.cpp's
            # scores to the socket), their medians and largest over the requests.
            "token_path_ms": {"p50_median": round(statistics.median(path_p50), 3),
                              "p99_median": round(statistics.median(path_p99), 3),
                              "p99_max": round(max(path_p99), 3)} if path_p50 else None,
            # The gateway's arm: where a request's TTFT went (each step's median over the
            # requests, ms; the runtime's timeline and the gateway's part before it).
            "timelines_ms": timelines,
            "timeline_ms_median": {step: round(statistics.median(t.get(step, 0.0)
                                                                 for t in timelines), 2)
                                   for step in timelines[0]} if timelines else None,
            # and their means: the wait for the running batch (``queue_ms``) has two
            # humps, the rest of a decode step or of a longer prompt step, and its median
            # jumps from one to the other when a few requests move between them.
            "timeline_ms_mean": {step: round(statistics.mean(t.get(step, 0.0)
                                                             for t in timelines), 2)
                                 for step in timelines[0]} if timelines else None,
            "prompt_tokens_median": statistics.median(
                [p for r in rounds for p in r["prompt_tokens"] if p] or [0]),
            "prefilled_median": statistics.median(
                [p for r in rounds for p in r["prefilled"]] or [0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096, help="per sequence")
    parser.add_argument("--steps", type=at_least_one, default=8)
    parser.add_argument("--rounds", type=at_least_one, default=2)
    parser.add_argument("--requests", type=at_least_one, default=4, help="per client and round")
    parser.add_argument("--workloads", default="agent,concurrent,json")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY)
    parser.add_argument("--without-llama-server", action="store_true",
                        help="the gateway alone: its figures, no side-by-side ratios")
    parser.add_argument("--template", choices=["model", "hermes"], default="model",
                        help="the chat template of both arms: the model's own, or a "
                             "Hermes-style one with tools (Qwen 2.5's shape) written into a "
                             "copy of the model, so that llama-server can make tool calls "
                             "too and both loops force them")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="one more argument of the gateway's command line (repeatable), "
                             "e.g. --gateway-arg=--worker-args=--flash-attn")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    workloads = set(args.workloads.split(","))
    if not args.without_llama_server and not args.llama_server.is_file():
        raise SystemExit(f"llama-server not found at {args.llama_server}: run "
                         "`bash tools/build_llama_server.sh` first (or pass "
                         "--without-llama-server for the gateway's figures alone)")
    if args.model is None:
        from model_runtime.runtime import default_model_path

        args.model = default_model_path()

    workdir = short_workdir("kvba")
    if args.template == "hermes":
        copy = workdir / "model-hermes.gguf"
        log(f"writing {copy.name}: the model with a Hermes-style tool template")
        try:
            subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata",
                            str(args.model), str(copy), "--chat-template", HERMES_TEMPLATE],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(workdir, ignore_errors=True)
            raise SystemExit(f"could not write the model's copy: "
                             f"{exc.stderr.decode()[-500:]}") from None
        args.model = copy
    daemon = Daemon(workdir / "data", workdir / "ram", log_dir=workdir)
    gateway = Gateway(workdir / "gateway.log", "--model", f"bench={args.model}",
                      "--workers", "1", "--n-seq-max", str(N_CONCURRENT), "--n-ctx",
                      str(args.n_ctx), *args.gateway_arg, cache=daemon.address, threads=args.threads)
    server = None if args.without_llama_server else LlamaServer(
        args.llama_server, args.model, threads=args.threads, n_ctx=args.n_ctx * N_CONCURRENT,
        parallel=N_CONCURRENT, log_path=workdir / "llama-server.log", extra_args=["--jinja"])
    doc: dict[str, Any] = {"benchmark": "agents", "machine": machine_info(),
                           "settings": {k: str(v) for k, v in vars(args).items()},
                           "llama_server_argv": None}
    try:
        daemon.start()
        log("starting the gateway (1 worker, 4 slots)" +
            ("" if server is None else " and llama-server -np 4 --jinja"))
        gateway.start(timeout=300)
        arms = [Arm("kvcache", f"{gateway.url}/v1", "bench")]
        if server is not None:
            server.start()
            doc["llama_server_argv"] = server.argv()[1:]
            arms.append(Arm("llama-server", f"http://127.0.0.1:{server.port}/v1", "bench"))
        if "agent" in workloads:
            doc["agent"] = {}
            transcript: list[list[dict[str, Any]]] = []
            for arm in arms:
                log(f"agent loop: {arm.name}, {args.steps} steps")
                force = arm.name == "kvcache" or args.template == "hermes"
                rows = agent_loop(arm, args.steps, force=force,
                                  transcript=transcript if arm.name == "kvcache" else None)
                doc["agent"][arm.name] = loop_summary(rows)
            doc["agent"]["ratios"] = loop_ratios(doc["agent"]["kvcache"],
                                                 doc["agent"].get("llama-server"))
            if server is not None:  # the same prompts on both: kvcache's loop, replayed
                log("agent loop replayed on llama-server")
                replay = loop_summary(agent_replay(arms[1], transcript))
                doc["agent"]["llama-server_replay"] = replay
                doc["agent"]["ratios_replay"] = loop_ratios(doc["agent"]["kvcache"], replay)
        if "concurrent" in workloads:
            system = build_system_prompt(720)
            for arm in arms:  # both start with the system prompt computed once
                arm.stream([{"role": "system", "content": system},
                            {"role": "user", "content": "Warm-up."}], 4)
            runs: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
            for round_no in range(args.rounds):
                order = arms if round_no % 2 == 0 else arms[::-1]
                for arm in order:
                    log(f"concurrent: round {round_no + 1}, {arm.name}")
                    runs[arm.name].append(concurrent_round(arm, system, args.requests,
                                                           round_no))
            summary = {name: concurrent_summary(rounds) for name, rounds in runs.items()}
            ours, theirs = summary["kvcache"], summary.get("llama-server")
            summary["ratios"] = None if theirs is None else {
                "aggregate_tokens_per_s": round(ours["aggregate_tokens_per_s"] /
                                                theirs["aggregate_tokens_per_s"], 3),
                "ttft_median": round(ours["ttft"]["median"] / theirs["ttft"]["median"], 3),
                "inter_token_median": round(ours["inter_token"]["median"] /
                                            theirs["inter_token"]["median"], 3),
                "per_token_median": round(ours["per_token"]["median"] /
                                          theirs["per_token"]["median"], 3)}
            doc["concurrent"] = summary
        if "json" in workloads:
            doc["json"] = json_runs(arms, args.requests, args.rounds)
    finally:
        if server is not None:
            server.stop()
        gateway.close()
        daemon.close()
        shutil.rmtree(workdir, ignore_errors=True)
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
