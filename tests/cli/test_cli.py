"""The ``kvcache`` operator commands, run as real processes against a real daemon, and the
cache commands that need a model (``model-runtime warm``, ``model-runtime inspect``).

Every command is run against a live daemon (and once against none), including ``prune``
while writers on both client paths keep saving. Commands that only read are started
together: each is a Python process start, and they spend it waiting on imports. The old
spellings ``kvcache warm`` and ``kvcache inspect --model`` run the model-runtime commands.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from harness.payloads import payload_for

from kvcache import blob as blobfmt
from kvcache.cli import main as kvcache_main
from kvcache.cli import moved as moved_commands
from kvcache.client import CacheError, Identity
from kvcache.counters import COUNTERS
from kvcache.v1 import kvcache_pb2 as pb
from model_runtime.identity import hash_file
from model_runtime.llama_backend import LlamaModel
from tests.support.commands import OTHER, RUNTIME, cli, cli_json, cli_many, ok
from tests.support.daemon_proc import tcp_address, wait_for, write_token
from tests.support.entries import (
    BLOCK,
    IDENT,
    DaemonFactory,
    blob_file,
    flip_payload,
    save_raw,
    toks,
)

TENANT = Identity(IDENT.model_fingerprint, IDENT.kv_layout, tenant="t1",
                  model_name=IDENT.model_name)


def keys_of(rows: list[dict[str, Any]]) -> list[str]:
    return [r["key"] for r in rows]


# --------------------------------------------------------------------------- every command


def test_every_command_against_a_real_daemon(daemon_factory: DaemonFactory, tiny_model: Path,
                                             tmp_path: Path) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    a = ("-a", d.address)
    c = d.client()
    s = d.client(fast_path=False)
    with LlamaModel(tiny_model) as m:
        text_tokens = m.tokenize("the cat sat on the mat with a hat, " * 3)
        expected_first_text = m.detokenize(text_tokens[:32], render_special=True)
    # a..g: different models, tenants, reasons, sizes, lengths and ages.
    t = {n: toks(200 + i, 20 + 5 * i) for i, n in enumerate("abcdefg")}
    t["f"] = text_tokens  # real tokens of the tiny model, for `model-runtime inspect`
    # `model-runtime inspect` decodes only with the model the entry was saved with.
    tiny = Identity(hash_file(tiny_model), IDENT.kv_layout, model_name=IDENT.model_name)
    k = {
        "a": c.save(IDENT, t["a"], payload_for(t["a"], 1000), "cold").key,
        "b": c.save(IDENT, t["b"], payload_for(t["b"], 3000), "finish").key,
        "c": save_raw(c, IDENT, t["c"], payload_for(t["c"], 1000), "cold",
                      created=time.time() - 7200),
        "d": c.save(OTHER, t["d"], payload_for(t["d"], 1000), "continued").key,
        "e": c.save(TENANT, t["e"], payload_for(t["e"], 1000), "evict").key,
        "f": c.save(tiny, t["f"], payload_for(t["f"], 2000), "manual").key,
        "g": save_raw(c, IDENT, t["g"], payload_for(t["g"], 500), "shutdown",
                      created=time.time() - 3 * 86400),
    }
    h = {n: key.hex() for n, key in k.items()}
    name_of = {v: n for n, v in h.items()}

    def names(rows: list[dict[str, Any]]) -> str:
        return "".join(name_of.get(r["key"], "?") for r in rows)

    def left() -> str:
        return "".join(sorted(name_of[e.key.hex()] for e in c.list_entries()
                              if e.key.hex() in name_of))

    # Traffic for the latency section: lookups, reads on both paths and from both tiers.
    wait_for(lambda: len(c.list_entries(tier="ram")) == 7, "every entry placed in RAM")
    assert c.lookup(IDENT, t["a"]) is not None and c.lookup(IDENT, toks(1, 20)) is None
    for _ in range(3):  # a becomes the most read entry
        assert c.load(k["a"]).tier == "ram"
    assert s.load(k["b"]).tier == "ram"
    would = cli_json("prune", *a, "--max-ram-bytes", "0", "--dry-run")
    assert (would["ram_dropped"], would["removed"]) == (7, [])
    assert len(c.list_entries(tier="ram")) == 7  # a dry run drops nothing
    pruned_ram = cli_json("prune", *a, "--max-ram-bytes", "0")  # every RAM copy goes
    assert pruned_ram["ram_dropped"] == 7 and pruned_ram["removed"] == []
    assert c.load(k["b"]).tier == "disk" and s.load(k["c"]).tier == "disk"
    wait_for(lambda: len(c.list_entries(tier="ram")) == 2, "b and c promoted back to RAM")

    stats_json, stats_table, *listings = cli_many(
        ("stats", *a, "--json"), ("stats", *a, "--all"),
        ("ls", *a, "--json"),
        ("ls", *a, "--json", "--model", "other.gguf"),
        ("ls", *a, "--json", "--model", "fp-other"),  # a fingerprint prefix
        ("ls", *a, "--json", "--tenant", "t1"),
        ("ls", *a, "--json", "--reason", "finish"),
        ("ls", *a, "--json", "--tier", "ram"),
        ("ls", *a, "--json", "--tier", "disk"),
        ("ls", *a, "--json", "--min-tokens", "45"),
        ("ls", *a, "--json", "--sort", "size"),
        ("ls", *a, "--json", "--sort", "tokens"),
        ("ls", *a, "--json", "--sort", "age"),
        ("ls", *a, "--json", "--sort", "hits", "--limit", "2"),
        ("ls", *a),
        ("ls", *a, "--reason", "bogus"),
    )
    stats = json.loads(ok(stats_json))
    assert stats["block_size"] == BLOCK
    assert stats["tiers"]["disk"]["entries"] == 7 and stats["tiers"]["ram"]["entries"] == 2
    assert set(COUNTERS) <= set(stats["counters"]), "every declared counter, zeros included"
    assert stats["counters"]["saves_committed"] == 7
    assert stats["counters"]["lookup_hits_exact"] == 1
    assert stats["counters"]["lookup_misses"] == 1
    assert stats["counters"]["prune_ram_dropped"] == 7
    assert stats["counters"]["corrupt_blobs"] == 0
    lat = stats["latencies"]
    assert {"lookup", "commit", "write_stream", "read_ram_local", "read_ram_stream",
            "read_disk_local", "read_disk_stream"} <= set(lat), lat
    assert lat["lookup"]["count"] == 2 and lat["commit"]["count"] == 7
    assert lat["read_ram_local"]["count"] == 3
    for series in lat.values():
        assert 1 <= series["window"] <= series["count"]
        assert 0 <= series["p50_ms"] <= series["p90_ms"] <= series["p99_ms"]
    table = ok(stats_table)
    for word in ("TIER", "BUDGET", "counters", "lookup_hits_partial", "Lookups that found",
                 "saves_committed_manual", "start-up", "latencies", "read_disk_stream", "P99"):
        assert word in table, f"{word!r} missing from the stats table:\n{table}"

    (every, by_model, by_fp, by_tenant, by_reason, in_ram, on_disk, long_ones, by_size,
     by_tokens, by_age, by_hits, ls_table, bogus) = listings
    rows = json.loads(ok(every))
    assert sorted(names(rows)) == list("abcdefg")
    assert names(rows)[:2] == "cb"  # most recently used first: c, then b, were read last
    assert names(json.loads(ok(by_model))) == "d" == names(json.loads(ok(by_fp)))
    assert names(json.loads(ok(by_tenant))) == "e"
    assert names(json.loads(ok(by_reason))) == "b"
    assert sorted(names(json.loads(ok(in_ram)))) == ["b", "c"]
    assert all(r["tiers"] == ["disk", "ram"] for r in json.loads(ok(in_ram)))
    assert sorted(names(json.loads(ok(on_disk)))) == list("abcdefg")
    assert sorted(names(json.loads(ok(long_ones)))) == sorted(n for n in t if len(t[n]) >= 45)
    sizes = [r["bytes"] for r in json.loads(ok(by_size))]
    assert sizes == sorted(sizes, reverse=True)
    lengths = [r["tokens"] for r in json.loads(ok(by_tokens))]
    assert lengths == sorted(lengths, reverse=True)
    assert names(json.loads(ok(by_age)))[:2] == "gc"  # oldest first
    top = json.loads(ok(by_hits))
    assert names(top)[0] == "a" and top[0]["hits"] == 3 and len(top) == 2
    listed = ok(ls_table)
    assert "7 entries" in listed and all(key in listed for key in h.values()), listed
    assert bogus.returncode == 2 and "bogus" in bogus.stderr  # a usage error, not "0 entries"

    # inspect: JSON, decoded through the model, as a table, and an unknown key.
    detail, decoded, shown, unknown, malformed = cli_many(
        ("inspect", h["a"], *a, "--json"),
        (RUNTIME, "inspect", h["f"], *a, "--json", "--model", str(tiny_model)),
        ("inspect", h["e"], *a, "--tenant", "t1"),
        ("inspect", "ab" * 16, *a),
        ("inspect", "not-a-key", *a))
    info = json.loads(ok(detail))
    assert info["key"] == h["a"] and info["first_tokens"] == t["a"]
    assert (info["tokens"], info["reason"], info["model"]) == (20, "cold", "tiny.gguf")
    assert info["kv_layout"] == {"type_k": "f16"} and info["hits"] == 3
    assert Path(info["path"]) == blob_file(d, k["a"])
    text = json.loads(ok(decoded))
    assert text["first_text"] == expected_first_text and text["first_tokens"] == t["f"][:32]
    assert h["e"] in ok(shown) and "evict" in ok(shown)
    assert unknown.returncode == 1 and "no entry" in unknown.stderr
    assert malformed.returncode == 2

    # pin, then evict is refused; unpin, then evict works.
    ok(cli("pin", h["a"], *a))
    assert [e.pinned for e in c.list_entries() if e.key == k["a"]] == [True]
    refused = cli("evict", h["a"], *a)
    assert refused.returncode == 1 and "pinned" in refused.stderr, refused
    ok(cli("unpin", h["a"], *a))
    assert ok(cli("evict", h["a"], *a)).strip() == f"evicted {h['a']}"
    assert left() == "bcdefg"

    # prune by each filter: dry runs list and remove nothing; then the real prunes, run
    # at the same time (they select disjoint entries), remove exactly those.
    filters = {("--older-than", "1h"): "cg", ("--model", "other.gguf"): "d",
               ("--tenant", "t1"): "e", ("--reason", "finish"): "b"}
    dry_runs = cli_many(*[("prune", *a, *flags, "--dry-run", "--json") for flags in filters])
    for (flags, expected), dry in zip(filters.items(), dry_runs, strict=True):
        report = json.loads(ok(dry))
        assert report["dry_run"] and "".join(sorted(names(report["removed"]))) == expected, \
            flags
    assert left() == "bcdefg"
    real_runs = cli_many(*[("prune", *a, *flags, "--json") for flags in filters])
    for (flags, expected), done in zip(filters.items(), real_runs, strict=True):
        report = json.loads(ok(done))
        assert "".join(sorted(names(report["removed"]))) == expected, flags
        assert report["bytes_freed"] == sum(e["bytes"] for e in report["removed"])
    assert left() == "f"
    # --unused-for: f was never read; a fresh entry that is read stays.
    # The read is newer than the daemon's last write of use times to its index (once a
    # second): prune must count it anyway (it did not, and removed the entry just read).
    fresh = toks(300, 20)
    k_fresh = c.save(IDENT, fresh, payload_for(fresh, 800), "cold").key
    time.sleep(6.1)  # f's and the fresh entry's creation are over 6 s old...
    c.load(k_fresh)  # ...but the fresh entry was just read
    # In-process, and a window of 6 s: a new interpreter can take over a second to start
    # on a loaded machine; windows of 1 s, then of 3 s, were once over by the time prune
    # ran in a full suite on two cores (it then removed the fresh entry too, rightly).
    run = CliRunner().invoke(kvcache_main, ["prune", *a, "--unused-for", "6s", "--json"])
    assert run.exit_code == 0, run.output
    gone = json.loads(run.stdout)
    assert names(gone["removed"]) == "f"
    assert [e.key for e in c.list_entries()] == [k_fresh]
    # Without a filter or target the daemon refuses; a reason must be a real one.
    refused, typo = cli_many(("prune", *a), ("prune", *a, "--reason", "finnish"))
    assert refused.returncode == 1 and "needs a filter" in refused.stderr
    assert typo.returncode == 2 and "finnish" in typo.stderr
    # --max-bytes keeps a pinned entry, reported as skipped, and trims the rest by LRU.
    extra = {i: toks(400 + i, 20) for i in range(4)}
    extra_keys = [c.save(IDENT, v, payload_for(v, 2000), "cold").key for v in extra.values()]
    c.pin(extra_keys[0])
    size = c.inspect(extra_keys[1]).entry.size
    dry = cli_json("prune", *a, "--max-bytes", str(2 * size + 100), "--dry-run")
    assert len(c.list_entries()) == 5
    trimmed = cli_json("prune", *a, "--max-bytes", str(2 * size + 100))
    assert trimmed["skipped_pinned"] == 1
    assert keys_of(trimmed["removed"]) == keys_of(dry["removed"])  # the dry run was right
    assert k_fresh.hex() in keys_of(trimmed["removed"])  # least recently used first
    remaining = {e.key for e in c.list_entries()}
    assert extra_keys[0] in remaining and extra_keys[3] in remaining  # pinned; newest
    assert int(c.stats().tiers[1].bytes) <= 2 * size + 100
    human = ok(cli("prune", *a, "--max-bytes", "0", "--max-ram-bytes", "0"))
    assert "kept 1 pinned" in human and "RAM copies" in human, human
    assert [e.key for e in c.list_entries()] == [extra_keys[0]]
    ok(cli("unpin", extra_keys[0].hex(), *a))

    # verify: exit 0 when all is well, 1 when a blob is bad (and it is quarantined).
    v = toks(500, 20)
    k_bad = c.save(IDENT, v, payload_for(v, 1000), "cold").key
    good = json.loads(ok(cli("verify", *a, "--json")))
    assert good == {"checked": 2, "bad": []}
    flip_payload(blob_file(d, k_bad))
    bad = cli("verify", *a, "--json")
    assert bad.returncode == 1, bad
    assert keys_of(json.loads(bad.stdout)["bad"]) == [k_bad.hex()]
    assert [e.key for e in c.list_entries()] == [extra_keys[0]]
    assert len(os.listdir(d.data_dir / "quarantine")) == 1
    assert ok(cli("verify", *a)).strip().endswith("1 checked, 0 bad")

    # model-runtime warm: prefill a system prompt with the tiny model and save it (pinned
    # the 2nd time).
    system = tmp_path / "system.txt"
    system.write_text("You are a terse assistant. " * 20)
    warm = (RUNTIME, "warm", *a, "--model", str(tiny_model), "--system-file", str(system),
            "--threads", "1", "--n-ctx", "1024")
    first = cli_json(*warm)
    assert first["tokens"] > 100 and first["hit_kind"] == "cold" and not first["pinned"]
    again = ok(cli(*warm, "--pin"))
    assert again.startswith(f"already warm: {first['key']}") and "pinned" in again
    (entry,) = [e for e in c.list_entries() if e.key.hex() == first["key"]]
    assert entry.pinned and entry.n_tokens == first["tokens"] and entry.reason == "cold"
    c.close()
    s.close()


def test_every_command_against_a_missing_daemon_names_the_address(tmp_path: Path,
                                                                  tiny_model: Path) -> None:
    address = f"unix:{tmp_path}/nobody.sock"
    system = tmp_path / "system.txt"
    system.write_text("hello")
    key = "ab" * 16
    commands = [("stats",), ("stats", "--json"), ("ls",), ("inspect", key), ("verify",),
                ("prune", "--older-than", "1d"), ("evict", key), ("pin", key), ("unpin", key),
                (RUNTIME, "warm", "--model", str(tiny_model), "--system-file", str(system)),
                (RUNTIME, "inspect", key, "--model", str(tiny_model))]
    results = cli_many(*[(*cmd, "-a", address) for cmd in commands])
    for cmd, out in zip(commands, results, strict=True):
        assert out.returncode == 1, (cmd, out)
        assert f"no kvcache daemon at {address}" in out.stderr, (cmd, out.stderr)
        assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- old spellings
# `kvcache warm` and `kvcache inspect --model` run the model-runtime commands in their place
# (kvcache never loads a model itself: tests/unit/test_layering.py).


def moved_note(old: str, new: str) -> str:
    return f"note: `kvcache {old}` is now `model-runtime {new}`; running that"


def test_kvcache_warm_runs_model_runtime_warm(daemon_factory: DaemonFactory, tiny_model: Path,
                                              tmp_path: Path) -> None:
    d = daemon_factory()
    system = tmp_path / "system.txt"
    system.write_text("You are a terse assistant. " * 20)
    args = ("-a", d.address, "--model", str(tiny_model), "--system-file", str(system),
            "--threads", "1", "--n-ctx", "1024")
    old = cli("warm", *args, "--json", "--pin")
    saved = json.loads(ok(old))
    assert old.stderr.strip() == moved_note("warm", "warm"), old.stderr
    assert saved["tokens"] > 100 and saved["pinned"] and saved["hit_kind"] == "cold"
    with d.client() as c:
        (entry,) = c.list_entries()
    assert entry.key.hex() == saved["key"] and entry.pinned
    # The same command: model-runtime warm finds the state the old spelling saved.
    again, refused, usage = cli_many((RUNTIME, "warm", *args), ("warm", *args, "--threads", "0"),
                                     ("warm", "--help"))
    assert ok(again).startswith(f"already warm: {saved['key']}")
    # Its refusals and exit codes come through as they are.
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--threads" in refused.stderr.splitlines()[-1], refused.stderr
    assert ok(usage).startswith("Usage: model-runtime warm [OPTIONS]"), usage.stdout


def test_kvcache_inspect_with_a_model_runs_model_runtime_inspect(
        daemon_factory: DaemonFactory, tiny_model: Path, tmp_path: Path) -> None:
    """Over TCP with a token and a tenant: every option reaches model-runtime inspect."""
    token = write_token(tmp_path / "token")
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(token), "--tcp-admin")
    with LlamaModel(tiny_model) as m:
        tokens = m.tokenize("the cat sat on the mat with a hat, " * 3)
        first_text = m.detokenize(tokens[:4], render_special=True)
    tiny = Identity(hash_file(tiny_model), IDENT.kv_layout, tenant="t1",
                    model_name=tiny_model.name)
    with d.client() as c:
        key = c.save(tiny, tokens, payload_for(tokens, 1000), "cold").key
    args = (key.hex()[:8], "--address", tcp_address(d), "--token-file", str(token),
            "--tenant", "t1", "--tokens", "4", "--model", str(tiny_model))
    old, new, old_text, other_tenant, no_token = cli_many(
        ("inspect", *args, "--json"), (RUNTIME, "inspect", *args, "--json"),
        ("inspect", *args), ("inspect", *args, "--tenant", "t2"),
        ("inspect", key.hex(), "--address", tcp_address(d), "--model", str(tiny_model)))
    shown = json.loads(ok(old))
    assert old.stderr.strip() == moved_note("inspect --model", "inspect"), old.stderr
    assert shown["key"] == key.hex() and shown["tenant_id"]  # the salt's id, not the salt
    assert shown["first_tokens"] == tokens[:4] and shown["first_text"] == first_text
    same = json.loads(ok(new))
    assert {k: v for k, v in shown.items() if k != "age_seconds"} == \
        {k: v for k, v in same.items() if k != "age_seconds"}
    assert "first text: " + json.dumps(first_text) in ok(old_text)
    assert other_tenant.returncode == 1 and "Traceback" not in other_tenant.stderr
    assert no_token.returncode == 1 and "token" in no_token.stderr.lower(), no_token.stderr


@pytest.mark.parametrize("args, old, new", [
    (("warm", "--system-file", "system.txt"), "warm", "warm"),
    (("inspect", "ab" * 16, "--model", "model.gguf"), "inspect --model", "inspect"),
])
def test_an_old_spelling_names_its_new_command_when_model_runtime_is_missing(
        args: tuple[str, ...], old: str, new: str, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    for name in ("system.txt", "model.gguf"):
        (tmp_path / name).write_text("x")
    monkeypatch.chdir(tmp_path)
    # In-process, and with a name found nowhere: the command cannot run in its place.
    monkeypatch.setattr(moved_commands, "RUNTIME_SCRIPT", "model-runtime-missing")
    result = CliRunner().invoke(kvcache_main, list(args))
    assert result.exit_code == 1, result.output
    assert result.output.startswith(
        f"Error: `kvcache {old}` is now `model-runtime-missing {new}`, and no "
        "model-runtime-missing command was found (in "), result.output


# --------------------------------------------------------------------------- prune under load


def test_prune_while_writes_are_in_flight(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    a = ("-a", d.address)
    c = d.client()
    # Protected entries: two pinned by an operator, two held open by a reader throughout.
    protected = {}
    for i in range(4):
        tokens = toks(600 + i, 20)
        protected[c.save(IDENT, tokens, payload_for(tokens, 20_000), "cold").key] = tokens
    pinned, held = list(protected)[:2], list(protected)[2:]
    for key in pinned:
        c.pin(key)
    pins = [c.stub.OpenRead(pb.OpenReadRequest(key=key), timeout=10).pin_id for key in held]
    protected_bytes = sum(c.inspect(key).entry.size for key in protected)

    stop = threading.Event()
    errors: list[str] = []
    saved: list[int] = []

    def writer(n: int) -> None:
        rng = random.Random(n)
        with d.client(fast_path=n % 2 == 0) as w:  # both the file path and streaming
            i = 0
            while not stop.is_set():
                tokens = toks(10_000 * (n + 1) + i, 20 + rng.randrange(40))
                reason = blobfmt.SAVE_REASONS[i % len(blobfmt.SAVE_REASONS)]
                try:
                    result = w.save(IDENT, tokens, payload_for(tokens, rng.randrange(2000, 40_000)),
                                    reason)
                    if result.status != "saved":
                        errors.append(f"writer {n}: {result}")
                    saved.append(1)
                except CacheError as exc:
                    errors.append(f"writer {n}: {exc!r}")
                i += 1

    def reader() -> None:
        # Entries being read are never removed: every read of them succeeds, intact.
        with d.client() as r, d.client(fast_path=False) as rs:
            while not stop.is_set():
                for key, tokens in list(protected.items()):
                    try:
                        got = (r if random.random() < 0.5 else rs).load(key, prefix_of=tokens)
                        if bytes(got.payload) != payload_for(tokens, 20_000):
                            errors.append(f"reader: {key.hex()} changed")
                    except CacheError as exc:
                        errors.append(f"reader: {exc!r}")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    threads.append(threading.Thread(target=reader))
    for th in threads:
        th.start()
    target = protected_bytes + 200_000
    runs = []
    try:
        wait_for(lambda: len(saved) >= 20, "the writers to get going")
        for flags in (("--max-bytes", str(target)), ("--older-than", "0.2s"),
                      ("--reason", "finish"), ("--max-bytes", "1"), ("--unused-for", "0.1s"),
                      ("--max-bytes", str(target), "--max-ram-bytes", "100K")):
            runs.append((flags, cli_json("prune", *a, *flags)))
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    assert not errors, errors[:5]
    assert len(saved) >= 50, "the writers hardly wrote: the prunes did not overlap them"
    for flags, run in runs:
        removed = set(keys_of(run["removed"]))
        assert not removed & {k.hex() for k in protected}, (flags, "removed a protected entry")
        if flags == ("--max-bytes", "1"):  # every entry was selected: the protected stayed
            assert run["skipped_pinned"] == 2 and run["skipped_in_use"] >= 2, run
        if flags[0] == "--reason":
            assert {e["reason"] for e in run["removed"]} <= {"finish"}
    assert sum(len(run["removed"]) for _, run in runs) > 0

    # Quiet now: one more trim reaches the target; nothing leaked; everything verifies.
    final = cli_json("prune", *a, "--max-bytes", str(target))
    assert not set(keys_of(final["removed"])) & {k.hex() for k in protected}
    stats = c.stats()
    assert stats.tiers[1].bytes <= target, (stats.tiers[1].bytes, target)
    assert stats.in_flight == 0 and stats.tiers[1].reserved_bytes == 0
    assert os.listdir(d.data_dir / "tmp") == [], "temp files leaked"
    left = {e.key for e in c.list_entries()}
    assert set(protected) <= left
    checked = json.loads(ok(cli("verify", *a, "--json")))
    assert checked == {"checked": len(left), "bad": []}
    on_disk = {p.stem for p in (d.data_dir / "blobs").rglob("*.kvc")}
    assert on_disk == {k.hex() for k in left}, "blob files and index disagree"
    for pin_id in pins:
        c.stub.ReleaseRead(pb.ReleaseReadRequest(pin_id=pin_id), timeout=10)
    c.close()
