"""Can a tenant's token tell another tenant's key from a key nobody saved? Answers and
timing of every call by key, measured as an attacker would measure them.

Run::

    .venv/bin/python tools/bench_tenant_probes.py [--keys 80] [--probes 80] [--out F.json]

A real daemon listens on TCP with a token file of two runtime tokens (``tenants=alice``,
``tenants=bob``). Bob saves ``--keys`` entries; alice probes, over TCP with her token, bob's
keys (foreign) and as many random keys (absent) with every call of the data path that
takes a key: OpenRead, Read, Delete, Reserve naming the key as a piece's parent (valid
arguments, and an invalid ``reason``), and the data path's EntryTokens and PinTenantEntry
where the daemon has them. Each key is probed ``--probes`` times, the probes of all keys
interleaved in a new random order each round (slow drifts of the machine hit both kinds
alike).

Per call, ``answers``: the status codes and words each kind got (the key's hex replaced),
and whether they are the same. ``timing``: the median latency of each kind, and a
classifier's score: half of the keys of each kind train it (per key one figure of its
probes: median, p10, min or mean; a threshold halfway between the kinds' means of that
figure; the figure that sorts the training keys best), the other half are held out and
classified. Chance is 50%; ``p_value`` is the chance of doing at least as well by coin
flips (one-sided binomial). The target: no call's held-out score is better than chance at
the 5% level (``p_value`` >= 0.05 for every call).

ONE JSON document on stdout (progress on stderr). The daemon and its temporary folders
are removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import math
import random
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import benchlib as bl
import grpc

from kvcache.auth import ClientAuth
from kvcache.client import CacheClient, Identity
from kvcache.v1 import kvcache_pb2 as pb

LAYOUT = {"type_k": "f16"}
ALICE = Identity("fp-probes", LAYOUT, tenant="alice", model_name="probe.gguf")
BOB = Identity("fp-probes", LAYOUT, tenant="bob", model_name="probe.gguf")
BLOCK = 16
PROMPT_TOKENS = 48  # three blocks: a piece may be built on any of bob's entries at 32
FIGURES: dict[str, Callable[[Sequence[float]], float]] = {
    "median": statistics.median,
    "p10": lambda xs: bl.percentile(xs, 10),
    "min": min,
    "mean": statistics.fmean,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def token_file(path: Path, tokens: dict[str, str]) -> Path:
    path.write_text("".join(f"{token} tenants={who}\n" for who, token in tokens.items()))
    path.chmod(0o600)
    return path


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(PROMPT_TOKENS)]


def probe_calls(stub: Any) -> dict[str, Callable[[bytes], Any]]:
    """The calls by key alice can make, each probing one key."""
    reserve = pb.ReserveRequest(identity=ALICE.message(), tokens=prompt(10**6), size=4096,
                                reason="cold", base=32)
    bad_reason = pb.ReserveRequest(identity=ALICE.message(), tokens=prompt(10**6), size=4096,
                                   reason="no-such-reason", base=32)

    def with_parent(request: pb.ReserveRequest) -> Callable[[bytes], Any]:
        def call(key: bytes) -> Any:
            request.parent = key
            return stub.Reserve(request, timeout=10)
        return call

    calls: dict[str, Callable[[bytes], Any]] = {
        "OpenRead": lambda k: stub.OpenRead(pb.OpenReadRequest(key=k, wait_ms=1000),
                                            timeout=10),
        "Read": lambda k: list(stub.Read(pb.ReadRequest(key=k, wait_ms=1000), timeout=10)),
        "Delete": lambda k: stub.Delete(pb.KeyRequest(key=k), timeout=10),
        "Reserve(parent)": with_parent(reserve),
        "Reserve(parent, bad reason)": with_parent(bad_reason),
    }
    if hasattr(pb, "EntryTokensRequest"):
        calls["EntryTokens"] = lambda k: stub.EntryTokens(
            pb.EntryTokensRequest(key=k, tenant="alice"), timeout=10)
    if hasattr(pb, "PinTenantEntryRequest"):
        calls["PinTenantEntry"] = lambda k: stub.PinTenantEntry(
            pb.PinTenantEntryRequest(key=k, tenant="alice", ttl_seconds=60), timeout=10)
    return calls


def answer_of(call: Callable[[bytes], Any], key: bytes) -> tuple[float, str]:
    """(seconds, "CODE: words") of one probe, the key's hex replaced by KEY."""
    t0 = time.perf_counter()
    try:
        call(key)
        outcome = "OK"
    except grpc.RpcError as exc:
        outcome = f"{exc.code().name}: {(exc.details() or '').replace(key.hex(), 'KEY')}"
    return time.perf_counter() - t0, outcome


def binomial_tail(n: int, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def sorted_right(foreign: list[float], absent: list[float], threshold: float,
                 foreign_above: bool) -> int:
    """How many keys a threshold puts on their own kind's side."""
    return sum((v > threshold) == foreign_above for v in foreign) + \
        sum((v > threshold) != foreign_above for v in absent)


def classify(foreign: list[list[float]], absent: list[list[float]]) -> dict[str, Any]:
    """Train on the first half of each kind's keys, score on the other half."""
    half_f, half_a = len(foreign) // 2, len(absent) // 2
    scores = {}
    for name, figure in FIGURES.items():
        f = [figure(xs) for xs in foreign]
        a = [figure(xs) for xs in absent]
        mean_f, mean_a = statistics.fmean(f[:half_f]), statistics.fmean(a[:half_a])
        rule = ((mean_f + mean_a) / 2, mean_f > mean_a)
        trained = sorted_right(f[:half_f], a[:half_a], *rule)
        held = sorted_right(f[half_f:], a[half_a:], *rule)
        scores[name] = {"train_correct": trained, "held_out_correct": held}
    best = max(scores, key=lambda n: scores[n]["train_correct"])
    n_held = len(foreign) - half_f + len(absent) - half_a
    held = scores[best]["held_out_correct"]
    return {"figure_chosen_on_training_keys": best, "held_out_keys": n_held,
            "held_out_correct": held, "held_out_accuracy": round(held / n_held, 3),
            "p_value": round(binomial_tail(n_held, held), 4), "by_figure": scores}


def probe(stub: Any, foreign_keys: list[bytes], absent_keys: list[bytes], probes: int,
          seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    keyed = [(k, True) for k in foreign_keys] + [(k, False) for k in absent_keys]
    results: dict[str, Any] = {}
    for name, call in probe_calls(stub).items():
        bl.log(f"{name}: {len(keyed)} keys x {probes} probes", "probes")
        times: dict[bytes, list[float]] = {k: [] for k, _ in keyed}
        said: dict[bool, set[str]] = {True: set(), False: set()}
        for _ in range(5):  # warm the path (connections, caches) before anything counts
            answer_of(call, absent_keys[0])
        for _ in range(probes):
            rng.shuffle(keyed)
            for key, is_foreign in keyed:
                seconds, outcome = answer_of(call, key)
                times[key].append(seconds)
                said[is_foreign].add(outcome)
        f = [times[k] for k in foreign_keys]
        a = [times[k] for k in absent_keys]
        all_f = [x for xs in f for x in xs]
        all_a = [x for xs in a for x in xs]
        results[name] = {
            "answers": {"foreign": sorted(said[True]), "absent": sorted(said[False]),
                        "identical": said[True] == said[False]},
            "timing": {"foreign": bl.summarize(all_f, "us", tails=False),
                       "absent": bl.summarize(all_a, "us", tails=False),
                       "median_difference_us": round(
                           (statistics.median(all_f) - statistics.median(all_a)) * 1e6, 2),
                       **classify(f, a)},
        }
    return results


def run(root: Path, n_keys: int, probes: int, seed: int) -> dict[str, Any]:
    tokens = {"alice": secrets.token_hex(16), "bob": secrets.token_hex(16)}
    port = free_port()
    daemon = bl.Daemon(root / "data", root / "ram", "--listen", f"127.0.0.1:{port}",
                       "--token-file", str(token_file(root / "tokens", tokens)),
                       "--block-size", str(BLOCK), log_dir=root)
    daemon.start()
    try:
        address = f"127.0.0.1:{port}"
        with CacheClient(address, auth=ClientAuth(token=tokens["bob"])) as bob:
            foreign = [bob.save(BOB, prompt(i), b"s" * 512, "cold").key for i in range(n_keys)]
        absent = [secrets.token_bytes(16) for _ in range(n_keys)]
        with CacheClient(address, auth=ClientAuth(token=tokens["alice"])) as alice:
            alice.wait_ready(10)
            return probe(alice.stub, foreign, absent, probes, seed)
    finally:
        daemon.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=80,
                        help="foreign keys, and as many absent ones (half of each held out)")
    parser.add_argument("--probes", type=int, default=80, help="probes of each key per call")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    machine = bl.machine_info()
    root = Path(tempfile.mkdtemp(prefix="kvbench-probes-", dir="/tmp"))
    try:
        calls = run(root, args.keys, args.probes, args.seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_at_end"] = bl.loadavg()
    targets = [bl.target(f"{name}: answers to foreign and absent keys identical",
                         float(c["answers"]["identical"]), 1.0, ">=") for name, c in calls.items()]
    targets += [bl.target(f"{name}: held-out classification no better than chance "
                          "(one-sided binomial p)", c["timing"]["p_value"], 0.05, ">=")
                for name, c in calls.items()]
    bl.emit_json({"benchmark": "bench_tenant_probes",
                  "settings": {"keys_per_kind": args.keys, "probes_per_key": args.probes,
                               "seed": args.seed},
                  "machine": machine, "targets": targets, "calls": calls,
                  "elapsed_s": round(time.perf_counter() - started, 1)}, args.out)


if __name__ == "__main__":
    sys.exit(main())
