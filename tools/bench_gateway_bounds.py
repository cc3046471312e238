"""Gateway requests whose cost is bounded before it is paid: grammars held to a budget, and
connections held to timeouts and caps. Small requests' latency alone and under each load,
side by side in one run.

    python tools/bench_gateway_bounds.py [--model PATH] [--seconds 15] [--small 30]
                                         [--slow 1100] [--files 1024] [--out FILE.json]

Prints ONE JSON document on stdout (progress on stderr). Real ``model-runtime gateway``
processes (children, one worker of 4 slots, 1 thread, no cache daemon) over the model
(default: SmolLM2). A small request is a one-token completion.

Grammars (a gateway with its defaults):

- ``huge_bound``: the 211-byte chat whose ``response_format`` schema says
  ``"minLength": 100000000`` (it used to take 8 s and 2.7 GB of the gateway's memory):
  its answers' latency, and the gateway's RSS peak over its RSS before (target: < 100 ms,
  < 50 MB);
- ``edge``: schemas at the budget's edge, sent back to back by one client for
  ``--seconds``: eleven strings of maxLength 2000 (``repetitions``) and an enum of 1,000
  long values (``literals``), each ~90,000 symbols, each request's a little different
  (no grammar is compiled once for all); small requests alone, then under each (target:
  the median within 50 ms of alone; the p99 is reported against the same bar);
- ``converter``: the schema converter in this process, llama-cpp-python's port against
  ours, on objects of optional properties (the port's time grows with their cube).

Connections (a gateway started under ``prlimit --nofile=FILES:FILES``, default timeouts):
``--slow`` connections that send half a request and then a byte every 5 s, from one
address (``one_address``) and spread over 11 (``eleven_addresses``), reopened when
closed; small requests from another address meanwhile: their statuses and latency
(target: all answered 200, from one attacking address or eleven).
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import selectors
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchlib import emit_json, log, machine_info, summarize, target
from harness.procs import Gateway, short_workdir

HUGE_BOUND = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "n", "schema": {"type": "string", "minLength": 100_000_000}}}}


def edge_schema(kind: str, n: int) -> dict[str, Any]:
    """A schema at the budget's edge of ``kind``, the ``n``-th variant."""
    if kind == "repetitions":
        return {"type": "object", "properties": {
            f"s{i}": {"type": "string", "maxLength": 2000 - n % 1000} for i in range(11)},
            "required": [f"s{i}" for i in range(11)], "additionalProperties": False}
    return {"type": "object", "properties": {"v": {"enum": [
        f"value number {i:04d} of a long list of accepted values, each one a bit verbose"
        for i in range(999)] + [f"variant {n}"]}}, "required": ["v"]}


EDGE = ("repetitions", "literals")
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def post(url: str, path: str, payload: dict[str, Any], source: str = "127.0.0.1",
         timeout: float = 120) -> tuple[int, float]:
    """(status, seconds); status 0 when the connection failed."""
    parts = urlsplit(url)
    start = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout,
                                      source_address=(source, 0))
    try:
        conn.request("POST", path, json.dumps(payload).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - start
    except OSError:
        return 0, time.perf_counter() - start
    finally:
        conn.close()


def small_requests(url: str, model: str, n: int, pause: float = 0.0) -> dict[str, Any]:
    times, statuses = [], []
    for _ in range(n):
        status, seconds = post(url, "/v1/completions",
                               {"model": model, "prompt": "Hello", "max_tokens": 1})
        statuses.append(status)
        if status == 200:
            times.append(seconds)
        time.sleep(pause)
    return {"latency": summarize(times) if times else None,
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))}}


def chat(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "u"}],
            **extra}


def edge_request(model: str, kind: str, n: int) -> dict[str, Any]:
    return chat(model, {"response_format": {"type": "json_schema", "json_schema": {
        "name": kind, "schema": edge_schema(kind, n)}}})


def stall(alone: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    a, b = alone["latency"], loaded["latency"]
    return {"median_ms": round(b["median"] - a["median"], 2),
            "p99_ms": round(b["p99"] - a["p99"], 2)}


# --------------------------------------------------------------------------- grammars


def grammars(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model_args = ["--model", f"bench={args.model}"] if args.model else []
    gateway = Gateway(workdir / "grammars.log", "--n-seq-max", "4", "--n-ctx", "4096",
                      *model_args, threads=1)
    doc: dict[str, Any] = {}
    try:
        gateway.start(timeout=300)
        assert gateway.proc is not None
        pid = gateway.proc.pid
        model = gateway.status()["models"][0]["id"]
        small_requests(gateway.url, model, 5)  # warm
        for name in EDGE:  # warm: the helper, the worker's first grammar
            post(gateway.url, "/v1/chat/completions", edge_request(model, name, 0))
        before = memory_kib(pid)
        body = chat(model, HUGE_BOUND)
        log(f"the {len(json.dumps(body))}-byte body, 20 times")
        answers = [post(gateway.url, "/v1/chat/completions", body) for _ in range(20)]
        after = memory_kib(pid)
        doc["huge_bound"] = {
            "body_bytes": len(json.dumps(body)),
            "statuses": sorted({s for s, _ in answers}),
            "latency": summarize([t for _, t in answers]),
            "rss_kib_before": before, "rss_kib_after": after,
            "rss_peak_growth_mib": round((after["VmHWM"] - before["VmRSS"]) / 1024, 1)}
        log(f"{args.small} small requests alone")
        alone = small_requests(gateway.url, model, args.small, args.seconds / args.small)
        doc["edge"] = {"small_alone": alone}
        for name in EDGE:
            log(f"edge schemas ({name}) for {args.seconds:g} s, small requests meanwhile")
            stop = threading.Event()
            edge: list[tuple[int, float]] = []

            def loop(name: str = name, edge: list[Any] = edge,
                     stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    edge.append(post(gateway.url, "/v1/chat/completions",
                                     edge_request(model, name, len(edge) + 1)))

            thread = threading.Thread(target=loop)
            thread.start()
            loaded = small_requests(gateway.url, model, args.small, args.seconds / args.small)
            stop.set()
            thread.join()
            doc["edge"][name] = {
                "schema_bytes": len(json.dumps(edge_schema(name, 0))),
                "small_under_load": loaded,
                "stall": stall(alone, loaded), "edge_requests": {
                    "statuses": sorted({s for s, _ in edge}),
                    "latency": summarize([t for _, t in edge])}}
    finally:
        gateway.close()
    return doc


def converter() -> dict[str, Any]:
    """Our converter against the port, on the same objects of optional properties."""
    from llama_cpp.llama_grammar import SchemaConverter

    from model_runtime.schema_converter import converter_class

    def convert(cls: type, schema: dict[str, Any]) -> float:
        start = time.perf_counter()
        conv = cls(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        conv.visit(conv.resolve_refs(schema, "x"), "")
        conv.format_grammar()
        return time.perf_counter() - start

    doc = {}
    for n in (100, 300, 600):  # (the port recurses once per property: 1,000 is too deep)
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                   for i in range(n)}}
        port, ours = convert(SchemaConverter, schema), convert(converter_class(), schema)
        doc[f"optional_properties_{n}"] = {"port_ms": round(port * 1e3, 2),
                                           "ours_ms": round(ours * 1e3, 2),
                                           "ratio": round(port / ours, 1)}
    return doc


# --------------------------------------------------------------------------- connections


class SlowClients:
    """``n`` connections spread over ``sources``, each sending half a request and then a
    header byte every 5 s, reopened (at most once a second each) when the gateway closes
    them."""

    def __init__(self, url: str, n: int, sources: list[str]) -> None:
        parts = urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.slots = [sources[i % len(sources)] for i in range(n)]
        self.selector = selectors.DefaultSelector()
        self.open: dict[int, tuple[socket.socket, float]] = {}  # slot -> (socket, last byte)
        self.retry_at = [0.0] * n
        self.opened = self.refused = self.closed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def connect(self, slot: int) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=2,
                                            source_address=(self.slots[slot], 0))
            sock.sendall(SLOW_HEAD)
        except OSError:
            self.retry_at[slot] = time.monotonic() + 1
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, slot)
        self.open[slot] = (sock, time.monotonic())
        self.opened += 1

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            for slot in range(len(self.slots)):
                if slot not in self.open and now >= self.retry_at[slot]:
                    self.connect(slot)
            for key, _ in self.selector.select(timeout=0.2):
                slot = key.data
                sock = self.open.pop(slot)[0]
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if data.startswith(b"HTTP/1.1 503"):
                    self.refused += 1
                else:
                    self.closed += 1
                self.selector.unregister(sock)
                sock.close()
                self.retry_at[slot] = time.monotonic() + 1
            for slot, (sock, last) in list(self.open.items()):
                if now - last > 5:
                    try:
                        sock.send(b"X")
                        self.open[slot] = (sock, now)
                    except OSError:
                        pass
        for sock, _ in self.open.values():
            sock.close()

    def __enter__(self) -> SlowClients:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.selector.close()

    def counts(self) -> dict[str, int]:
        return {"held_open_at_end": len(self.open), "opened": self.opened,
                "refused_503": self.refused, "closed_by_gateway": self.closed}


def connections(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # our own side: n + some
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    model_args = ["--model", f"bench={args.model}"] if args.model else []
    gateway = Gateway(workdir / "connections.log", "--n-seq-max", "4", "--n-ctx", "4096",
                      *model_args, threads=1)
    gateway.command = ["prlimit", f"--nofile={args.files}:{args.files}", "--",
                       *gateway.command]
    doc: dict[str, Any] = {"files": args.files, "slow_connections": args.slow}
    try:
        gateway.start(timeout=300)
        doc["gateway_says"] = [line.split("gateway: ", 1)[1] for line in
                               gateway.log().splitlines() if "connections: at most" in line]
        model = gateway.status()["models"][0]["id"]
        small_requests(gateway.url, model, 5)
        log(f"{args.small} small requests alone")
        alone = small_requests(gateway.url, model, args.small, args.seconds / args.small)
        doc["small_alone"] = alone
        for name, sources in (("one_address", ["127.0.0.2"]),
                              ("eleven_addresses", [f"127.0.0.{i}" for i in range(2, 13)])):
            log(f"{args.slow} slow connections from {len(sources)} address(es), "
                f"{args.seconds:g} s")
            with SlowClients(gateway.url, args.slow, sources) as slow:
                time.sleep(2)  # (connected)
                loaded = small_requests(gateway.url, model, args.small,
                                        args.seconds / args.small)
                counts = slow.counts()
            doc[name] = {"small_under_attack": loaded, "attackers": counts}
            if loaded["latency"]:
                doc[name]["stall"] = stall(alone, loaded)
            time.sleep(1)
    finally:
        gateway.close()
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2)")
    parser.add_argument("--seconds", type=float, default=15.0, help="each load's duration")
    parser.add_argument("--small", type=int, default=30, help="small requests per phase")
    parser.add_argument("--slow", type=int, default=1100, help="slow connections")
    parser.add_argument("--files", type=int, default=1024, help="the gateway's ulimit -n")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    workdir = short_workdir("kvbb")
    doc: dict[str, Any] = {"benchmark": "gateway_bounds", "machine": machine_info(),
                           "settings": vars(args) | {"out": str(args.out)}}
    try:
        doc["grammars"] = grammars(args, workdir)
        doc["converter"] = converter()
        doc["connections"] = connections(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    g, c = doc["grammars"], doc["connections"]
    edge = [g["edge"][name]["stall"] for name in EDGE]
    doc["targets"] = [
        target("huge_bound median latency (ms)", g["huge_bound"]["latency"]["median"], 100,
               "<", "ms"),
        target("huge_bound RSS peak growth (MiB)", g["huge_bound"]["rss_peak_growth_mib"],
               50, "<", "MiB"),
        target("edge schemas: small requests' median stall (ms)",
               max(s["median_ms"] for s in edge), 50, "<=", "ms"),
        target("edge schemas: small requests' p99 stall (ms)",
               max(s["p99_ms"] for s in edge), 50, "<=", "ms", primary=False),
        target("one attacking address: small requests answered 200 (share)",
               c["one_address"]["small_under_attack"]["statuses"].get("200", 0) / args.small,
               1.0, ">="),
        target("eleven attacking addresses: small requests answered 200 (share)",
               c["eleven_addresses"]["small_under_attack"]["statuses"].get("200", 0) /
               args.small, 1.0, ">=")]
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
