"""The ``kvcache`` operator commands, and the ``model-runtime`` ones that need a model
(``warm``, ``inspect``), as operators meet them: real daemon processes, the real command
line, piped and on a real terminal (a pseudo-terminal of a set width).

Each test provokes one rule: prune filters narrow every byte target and the RAM target
only drops copies; destructive commands ask first on a terminal and only there; keys are
never cut and any unique prefix names an entry; stats is a short summary with details on
request; inspect speaks in dates, words and (model-runtime inspect) the entry's own model;
verify can check without moving anything; messages are plain sentences without gRPC's
own log lines; numbers are checked before they reach the wire; model-runtime warm refuses
bad input in one line; long commands show progress only on a terminal; serve's
defaults are the configs' own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from harness.payloads import payload_for

from kvcache import keys
from kvcache.cli.render import human_bytes
from kvcache.cli.serve import serve
from kvcache.client import CacheClient, Identity
from kvcache.remote.config import RemoteConfig
from kvcache.store import StoreConfig
from model_runtime.chat.templates import ChatTemplate
from model_runtime.identity import hash_file
from tests.support.commands import OTHER, RUNTIME, command_line, ok, on_terminal
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, IDENT, DaemonFactory, blob_file, flip_payload, toks

BOB = Identity(IDENT.model_fingerprint, IDENT.kv_layout, tenant="bob",
               model_name=IDENT.model_name)
ALICE = Identity(IDENT.model_fingerprint, IDENT.kv_layout, tenant="alice",
                 model_name=IDENT.model_name)
TRACEBACK = "Traceback"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The commands' environment: no terminal width of the test runner's, gRPC's logging
    left to the command, and model fingerprints remembered under tmp_path."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("COLUMNS", "LINES", "GRPC_VERBOSITY", "GRPC_TRACE")}
    return {**base, "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}


def cli_many(env: dict[str, str], *commands: Sequence[str], timeout: float = 120
             ) -> list[subprocess.CompletedProcess[str]]:
    """Run commands side by side, stdin not a terminal; results in order."""
    procs = [subprocess.Popen(command_line(args), env=env, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for args in commands]
    results = []
    try:
        for args, p in zip(commands, procs, strict=True):
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(list(args), p.returncode, out, err))
    finally:
        for p in procs:  # one that hangs (a daemon that should have refused to start)
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return cli_many(env, args)[0]


def cli_json(env: dict[str, str], *args: str) -> Any:
    return json.loads(ok(cli(env, *args, "--json")))


def refused(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The command failed with ``code`` and one ``Error:`` line holding ``words``."""
    assert result.returncode == code, (result.args, result.returncode, result.stderr)
    assert TRACEBACK not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], (word, result.stderr)
    return errors[0]


def keys_in(rows: list[dict[str, Any]]) -> set[str]:
    return {r["key"] for r in rows}


def listed(c: CacheClient, **filters: Any) -> set[bytes]:
    return {e.key for e in c.list_entries(**filters)}


# --------------------------------------------------------------------------- prune


def test_prune_filters_narrow_every_target(daemon_factory: DaemonFactory,
                                           env: dict[str, str]) -> None:
    """`prune --max-bytes 1M --tenant alice` removed other tenants' entries (filters were
    OR'd with the target) and `--max-ram-bytes 0 --reason finish` removed whole entries."""
    d = daemon_factory("--block-size", str(BLOCK))
    a = ("-a", d.address)
    with d.client() as c:
        mine: dict[str, list[bytes]] = {}
        for n, (owner, ident) in enumerate((("alice", ALICE), ("bob", BOB), ("none", IDENT))):
            mine[owner] = [c.save(ident, t, payload_for(t, 3000), reason).key
                           for i, reason in enumerate(("cold", "finish", "cold", "finish"))
                           for t in [toks(100 * n + i, 20 + i)]]
        every = {k for ks in mine.values() for k in ks}
        wait_for(lambda: listed(c, tier="ram") == every, "every entry placed in RAM")
        c.pin(mine["alice"][0])
        disk_used = c.stats().tiers[1].bytes
        size = c.inspect(mine["alice"][1]).entry.size

        # A disk target with a tenant: only alice's unpinned entries, least recently used
        # first, and only until the tier fits.
        target = disk_used - size - 1  # one entry is not enough, two are
        trimmed = cli_json(env, "prune", *a, "--max-bytes", str(target), "--tenant", "alice")
        removed = keys_in(trimmed["removed"])
        assert removed == {k.hex() for k in mine["alice"][1:3]}, trimmed
        assert trimmed["skipped_pinned"] == 1
        assert listed(c) == every - {bytes.fromhex(k) for k in removed}

        # Filters alone still remove everything they select...
        dry = cli_json(env, "prune", *a, "--reason", "finish", "--tenant", "bob", "--dry-run")
        assert keys_in(dry["removed"]) == {mine["bob"][1].hex(), mine["bob"][3].hex()}

        # ...and a RAM target only ever drops RAM copies, of the selected entries only.
        before = listed(c)
        ram = cli_json(env, "prune", *a, "--max-ram-bytes", "0", "--reason", "finish")
        assert ram["removed"] == [] and ram["bytes_freed"] == 0
        finish = {k for ks in mine.values() for k in ks[1::2]} & before
        assert set(ram["ram_dropped_keys"]) == {k.hex() for k in finish}
        assert ram["ram_dropped"] == len(finish)
        assert listed(c) == before, "a RAM target removed entries"
        assert listed(c, tier="ram") == before - finish
        # A model filter narrows a disk target too: another model's entries stay.
        k_other = c.save(OTHER, toks(77, 30), payload_for(toks(77, 30), 3000), "cold").key
        # (Its RAM copy is made in the background, which holds the entry like a read.)
        wait_for(lambda: k_other in listed(c, tier="ram"), "the RAM copy")
        everything = cli_json(env, "prune", *a, "--max-bytes", "0", "--model", "other")
        assert [r["model"] for r in everything["removed"]] == ["other.gguf"]
        assert listed(c) == before


# --------------------------------------------------------------------------- confirmation


def test_a_confirmed_plan_removes_only_what_it_showed_for_removal(
        daemon_factory: DaemonFactory) -> None:
    """Entries shown only as "drop the RAM copy" are never removed, even when the disk
    still exceeds the target once the shown removals are done."""
    d = daemon_factory("--block-size", str(BLOCK))
    with d.client() as c:
        saved = [c.save(IDENT, t, payload_for(t, 3000), "cold").key
                 for t in (toks(900 + i, 20) for i in range(3))]
        wait_for(lambda: listed(c, tier="ram") == set(saved), "every entry placed in RAM")
        r = c.prune(max_disk_bytes=1, max_ram_bytes=1, confirmed_plan=True,
                    keys=[saved[0]], ram_drop_keys=[saved[1]])
        assert [e.key for e in r.removed] == [saved[0]]
        assert [e.key for e in r.ram_dropped_entries] == [saved[1]]
        assert listed(c) == {saved[1], saved[2]}
        assert listed(c, tier="ram") == {saved[2]}
        # A confirmed plan with nothing to remove removes nothing.
        r = c.prune(max_disk_bytes=1, confirmed_plan=True)
        assert list(r.removed) == [] and listed(c) == {saved[1], saved[2]}


def test_destructive_commands_ask_first_on_a_terminal_only(daemon_factory: DaemonFactory,
                                                           env: dict[str, str]) -> None:
    # No RAM tier: a RAM copy being made holds its entry like a read (and prune keeps it).
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    a = ("-a", d.address)
    with d.client() as c:
        finish = [c.save(IDENT, t, payload_for(t, 2000), "finish").key
                  for t in (toks(900 + i, 20) for i in range(3))]
        keep = c.save(IDENT, toks(950, 20), payload_for(toks(950, 20), 2000), "cold").key

        # Declined: the plan was shown (every key in full), nothing removed, exit 1.
        code, shown = on_terminal(env, "prune", *a, "--reason", "finish", answer="n")
        assert code == 1, shown
        assert "prune will remove 3 entries" in shown and "Go ahead? [y/N]" in shown
        assert all(k.hex() in shown for k in finish) and keep.hex() not in shown
        assert "cancelled; nothing was changed" in shown and TRACEBACK not in shown
        assert listed(c) == {*finish, keep}

        # Accepted: only what was shown goes, even an entry saved meanwhile that matches
        # the same filters stays.
        late: list[bytes] = []

        def save_late() -> None:
            t = toks(960, 20)
            late.append(c.save(IDENT, t, payload_for(t, 2000), "finish").key)

        code, shown = on_terminal(env, "prune", *a, "--reason", "finish", answer="y",
                                  before_answer=save_late)
        assert code == 0, shown
        assert "removed 3 entries" in shown
        assert listed(c) == {keep, *late}

        # --yes, and stdin that is not a terminal: no question, done at once.
        code, shown = on_terminal(env, "prune", *a, "--reason", "finish", "--yes")
        assert code == 0 and "[y/N]" not in shown and "removed 1 entry" in shown, shown
        assert listed(c) == {keep}

        # evict by prefix: the entry is shown and asked for; declined, it stays.
        prefix = keep.hex()[:6]
        code, shown = on_terminal(env, "evict", prefix, *a, answer="n")
        assert code == 1 and "evict will remove 1 entry" in shown and keep.hex() in shown
        assert listed(c) == {keep}
        code, shown = on_terminal(env, "evict", prefix, *a, answer="y")
        assert code == 0 and f"evicted {keep.hex()}" in shown, shown
        assert listed(c) == set()

        # Not a terminal: scripts proceed without being asked (and never hang).
        t = toks(970, 20)
        scripted = c.save(IDENT, t, payload_for(t, 2000), "cold").key
        assert ok(cli(env, "evict", scripted.hex()[:8], *a)).strip() == \
            f"evicted {scripted.hex()}"
        t = toks(971, 20)
        c.save(IDENT, t, payload_for(t, 2000), "cold")
        report = cli_json(env, "prune", *a, "--reason", "cold")
        assert len(report["removed"]) == 1 and listed(c) == set()
        # Nothing to prune: nothing to ask.
        code, shown = on_terminal(env, "prune", *a, "--reason", "cold")
        assert code == 0 and "[y/N]" not in shown and "removed 0 entries" in shown, shown


# --------------------------------------------------------------------------- keys


def colliding_tokens(ns: bytes, digits: int = 4) -> tuple[list[int], list[int]]:
    """Two prompts whose keys share their first ``digits`` hex digits."""
    seen: dict[str, list[int]] = {}
    for seed in range(100_000):
        tokens = toks(50_000 + seed, 20)
        prefix = keys.entry_key(ns, tokens, BLOCK).key.hex()[:digits]
        if prefix in seen:
            return seen[prefix], tokens
        seen[prefix] = tokens
    raise AssertionError("no colliding prefix found")


def test_keys_are_never_cut_and_any_unique_prefix_names_an_entry(
        daemon_factory: DaemonFactory, env: dict[str, str]) -> None:
    d = daemon_factory("--block-size", str(BLOCK))
    a = ("-a", d.address)
    with d.client() as c:
        long_name = Identity(IDENT.model_fingerprint, IDENT.kv_layout, tenant="t",
                             model_name="a-model-file-name-long-enough-to-crowd-a-line.gguf")
        first, second = colliding_tokens(IDENT.namespace)
        twins = [c.save(IDENT, t, payload_for(t, 1000), "cold").key for t in (first, second)]
        lone = c.save(long_name, toks(5, 40), payload_for(toks(5, 40), 1000), "finish").key
        every = [*twins, lone]
        shared = twins[0].hex()[:4]
        assert twins[1].hex().startswith(shared)

        # ls never cuts a key: piped at 80 columns, and on terminals of 80 and 40.
        piped = cli_many({**env, "COLUMNS": "80"}, ("ls", *a))[0]
        for width in (80, 40):
            code, shown = on_terminal(env, "ls", *a, columns=width)
            assert code == 0, shown
            assert all(k.hex() in shown for k in every), (width, shown)
            assert "…" not in shown
        assert all(k.hex() in ok(piped) for k in every) and "…" not in piped.stdout
        assert long_name.model_name in piped.stdout  # a pipe gets every column

        # A unique prefix (any case) works wherever a key is taken.
        lone_prefix = lone.hex()[:5].upper()
        pinned, shown_, checked = cli_many(
            env, ("pin", lone_prefix, *a), ("inspect", lone_prefix, *a, "--json"),
            ("verify", lone_prefix, twins[0].hex()[:9], *a, "--json"))
        assert ok(pinned).strip() == f"pinned {lone.hex()}"
        assert json.loads(ok(shown_))["key"] == lone.hex()
        assert json.loads(ok(checked)) == {"checked": 2, "bad": []}
        assert c.inspect(lone).entry.pinned
        ok(cli(env, "unpin", lone_prefix, *a))
        assert not c.inspect(lone).entry.pinned

        # An ambiguous prefix is a usage error listing the candidates, in full; nothing
        # is done, not even for the keys named before it.
        for command in (("inspect", shared), ("pin", lone_prefix, shared),
                        ("evict", lone_prefix, shared), ("verify", shared)):
            out = cli(env, *command, *a)
            assert out.returncode == 2 and TRACEBACK not in out.stderr, out.stderr
            assert f"key prefix {shared} is ambiguous" in out.stderr, out.stderr
            assert all(k.hex() in out.stderr for k in twins), out.stderr
        assert listed(c) == set(every) and not c.inspect(lone).entry.pinned
        # A prefix nothing starts with; a prefix too short to be one; another tenant's.
        missing = next(p for p in (f"{i:04x}" for i in range(65536))
                       if not any(k.hex().startswith(p) for k in every))
        unknown, short, hidden = cli_many(env, ("inspect", missing, *a),
                                          ("evict", "abc", *a),
                                          ("inspect", lone.hex()[:6], "--tenant", "x", *a))
        refused(unknown, 1, "not found", missing)
        refused(short, 2, "32 hex digits", "at least 4")
        refused(hidden, 1, "not found")
        assert listed(c) == set(every)


# --------------------------------------------------------------------------- stats


def test_stats_is_a_short_summary_with_details_on_request(daemon_factory: DaemonFactory,
                                                          env: dict[str, str]) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--min-free-bytes", "1M")
    a = ("-a", d.address)
    with d.client() as c:
        for i in range(3):
            t = toks(700 + i, 20)
            c.save(IDENT, t, payload_for(t, 10_000), "cold")
        c.lookup(IDENT, toks(700, 20))  # a hit
        c.lookup(IDENT, toks(1, 20))  # a miss
    narrow = {**env, "COLUMNS": "80"}
    summary, details, data = cli_many(narrow, ("stats", *a), ("stats", "--all", *a),
                                      ("stats", "--json", *a))
    lines = ok(summary).splitlines()
    assert len(lines) <= 20, summary.stdout
    # Only a line that names a path may run past 80 columns: a path is never cut.
    assert all(len(line) <= 80 for line in lines if str(d.data_dir.parent) not in line), \
        summary.stdout
    text = summary.stdout
    for words in ("ENTRIES", "BUDGET", "free disk space", "saves keep 1.0 MiB free",
                  "room for saves", "50.0% hits", str(d.data_dir), "RAM tier",
                  "saves in flight", "stats --all"):
        assert words in text, f"{words!r} missing:\n{text}"
    assert "saves_committed" not in text  # counters are details

    everything = ok(details)
    for name in ("saves_duplicate_in_flight", "reconcile_removed", "lookup_hits_partial",
                 "Lookups that found", "P99 MS"):
        assert name in everything, f"{name!r} missing (or cut):\n{everything}"

    exact = json.loads(ok(data))
    # Humanized in tables, exact in JSON.
    assert human_bytes(exact["counters"]["bytes_committed"]) in everything
    disk, ram = exact["tiers"]["disk"], exact["tiers"]["ram"]
    assert exact["min_free_bytes"] == 1 << 20
    st = os.statvfs(d.data_dir)
    assert abs(disk["free_bytes"] - st.f_bavail * st.f_frsize) < 1 << 30
    assert ram["free_bytes"] > 0 and Path(ram["directory"]).is_dir()
    assert exact["counters"]["bytes_committed"] == disk["bytes"]  # raw numbers


# --------------------------------------------------------------------------- inspect


def test_inspect_speaks_in_dates_and_words_and_checks_the_model(
        daemon_factory: DaemonFactory, env: dict[str, str], tiny_model: Path,
        tmp_path: Path) -> None:
    from model_runtime.llama_backend import LlamaModel

    d = daemon_factory("--block-size", str(BLOCK))
    a = ("-a", d.address)
    with LlamaModel(tiny_model) as m:
        text_tokens = m.tokenize("the cat sat on the mat with a hat " * 8)
        whole_text = m.detokenize(text_tokens, render_special=True)  # "<s>the cat..."
    real = Identity(hash_file(tiny_model), {"type_k": "f16"}, model_name=tiny_model.name)
    # Files that are not loadable GGUFs, each with an entry claiming to be of it.
    bad_files = {"text": tmp_path / "notes.gguf", "empty": tmp_path / "empty.gguf",
                 "truncated": tmp_path / "cut.gguf"}
    bad_files["text"].write_text("just some text\n")
    bad_files["empty"].write_bytes(b"")
    bad_files["truncated"].write_bytes(tiny_model.read_bytes()[:100_000])
    with d.client() as c:
        k = c.save(real, text_tokens, payload_for(text_tokens, 1000), "cold").key
        wait_for(lambda: k in listed(c, tier="ram"), "the RAM copy")
        claims = {}
        for name, path in bad_files.items():
            ident = Identity(hash_file(path), {"type_k": "f16"}, model_name=path.name)
            t = toks(len(name), 20)
            claims[name] = c.save(ident, t, payload_for(t, 500), "cold").key
        other = c.save(IDENT, toks(3, 20), payload_for(toks(3, 20), 500), "cold").key

    human, every, every_json, decoded, wrong, *bad = cli_many(
        env, ("inspect", k.hex(), *a), ("inspect", k.hex(), "--tokens", "0", *a),
        ("inspect", k.hex(), "--tokens", "0", "--json", *a),
        (RUNTIME, "inspect", k.hex(), "--tokens", "0", "--json", "--model", str(tiny_model),
         *a),
        (RUNTIME, "inspect", other.hex(), "--model", str(tiny_model), *a),
        *[(RUNTIME, "inspect", claims[name].hex(), "--model", str(path), *a)
          for name, path in bad_files.items()])
    shown = ok(human)
    assert "tiers: disk, ram" in shown and "pinned: no" in shown, shown
    assert re.search(r"created: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d:\d\d \(\d+s ago\)",
                     shown), shown
    assert "last used: never" in shown
    for python_repr in ("['", "False", "True", "{'"):
        assert python_repr not in shown, shown
    assert "first 32 tokens:" in shown and "last 32 tokens:" in shown
    assert " ".join(map(str, text_tokens[:32])) in " ".join(shown.split())
    # --tokens 0 shows every token (it showed none at the front).
    assert " ".join(ok(every).split()).count(" ".join(map(str, text_tokens))) == 1
    assert json.loads(ok(every_json))["first_tokens"] == text_tokens
    assert json.loads(ok(decoded))["first_text"] == whole_text
    refused(wrong, 2, "--model", "not the model this entry was saved with", "tiny.gguf")
    for name, result in zip(bad_files, bad, strict=True):
        refused(result, 2, "--model", bad_files[name].name)


def chat_tokens(model_path: Path) -> tuple[list[int], str]:
    """A chat as the runtime renders it (special tokens in it), and its text."""
    from model_runtime.llama_backend import LlamaModel

    with LlamaModel(model_path) as m:
        text = ChatTemplate.of_model(m).render([{"role": "system", "content": "Be brief. " * 10},
                                      {"role": "user", "content": "Where is the cat?"}])
        return m.tokenize(text, add_special=False, parse_special=True), text


def test_model_runtime_inspect_shows_special_tokens_and_takes_the_default_model(
        daemon_factory: DaemonFactory, env: dict[str, str], tiny_model: Path) -> None:
    """The decoded text is the entry's tokens as they are: ``<|im_start|>system`` (it
    showed ``system``). Without --model the default model is taken, as serve and complete
    take it (--model was required); it is not the tiny model's entry's, and says so."""
    d = daemon_factory("--block-size", str(BLOCK))
    a = ("-a", d.address)
    tokens, text = chat_tokens(tiny_model)
    assert text.startswith("<|im_start|>system")
    real = Identity(hash_file(tiny_model), {"type_k": "f16"}, model_name=tiny_model.name)
    with d.client() as c:
        k = c.save(real, tokens, payload_for(tokens, 1000), "cold").key
    decoded, human, default = cli_many(
        env, (RUNTIME, "inspect", k.hex(), "--tokens", "0", "--json", "--model",
              str(tiny_model), *a),
        (RUNTIME, "inspect", k.hex(), "--model", str(tiny_model), *a),
        (RUNTIME, "inspect", k.hex(), *a))
    assert json.loads(ok(decoded))["first_text"] == text
    assert "<|im_start|>system" in ok(human) and "<|im_start|>user" in ok(human)
    refused(default, 2, "--model", "the default model SmolLM2-135M-Instruct",
            f"not the model this entry was saved with ({tiny_model.name})",
            "give its GGUF file with --model")


@pytest.mark.slow
def test_model_runtime_inspect_decodes_with_the_default_model(
        daemon_factory: DaemonFactory, env: dict[str, str]) -> None:
    from model_runtime.runtime import default_model_path

    d = daemon_factory("--block-size", str(BLOCK))
    model = default_model_path()
    tokens, text = chat_tokens(model)
    ident = Identity(hash_file(model), {"type_k": "f16"}, model_name=model.name)
    with d.client() as c:
        k = c.save(ident, tokens, payload_for(tokens, 1000), "cold").key
    shown = json.loads(ok(cli(env, RUNTIME, "inspect", k.hex(), "--tokens", "0", "--json",
                              "-a", d.address)))
    assert shown["first_text"] == text and text.startswith("<|im_start|>system")


# --------------------------------------------------------------------------- --model filter


def test_the_model_filter_is_a_name_or_fingerprint_prefix(daemon_factory: DaemonFactory,
                                                          env: dict[str, str]) -> None:
    """The help says "model name or fingerprint prefix"; the daemon only matched a whole
    name, so `--model tiny` listed (and pruned) nothing."""
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    a = ("-a", d.address)
    with d.client() as c:
        tiny = {c.save(IDENT, t, payload_for(t, 500), "cold").key
                for t in (toks(10 + i, 20) for i in range(2))}
        other = c.save(OTHER, toks(20, 20), payload_for(toks(20, 20), 500), "cold").key
        by_name, whole, by_fp, fp_any_case, too_short, case = cli_many(
            env, ("ls", *a, "--model", "tiny", "--json"),
            ("ls", *a, "--model", "tiny.gguf", "--json"),
            ("ls", *a, "--model", "fp-oth", "--json"),
            ("ls", *a, "--model", "FP-OTHER-M", "--json"),
            ("ls", *a, "--model", "fp-", "--json"),  # 3 characters: names only
            ("ls", *a, "--model", "TINY", "--json"))  # file names keep their case
        assert keys_in(json.loads(ok(by_name))) == {k.hex() for k in tiny}
        assert keys_in(json.loads(ok(whole))) == {k.hex() for k in tiny}
        assert keys_in(json.loads(ok(by_fp))) == {other.hex()}
        assert keys_in(json.loads(ok(fp_any_case))) == {other.hex()}
        assert json.loads(ok(too_short)) == [] and json.loads(ok(case)) == []
        pruned = cli_json(env, "prune", *a, "--model", "ti")
        assert keys_in(pruned["removed"]) == {k.hex() for k in tiny}
        assert listed(c) == {other}


# --------------------------------------------------------------------------- verify


def test_verify_can_check_without_moving_anything_and_take_keys(
        daemon_factory: DaemonFactory, env: dict[str, str]) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    a = ("-a", d.address)
    with d.client() as c:
        good, bad = (c.save(IDENT, t, payload_for(t, 3000), "cold").key
                     for t in (toks(30, 20), toks(31, 20)))
        flip_payload(blob_file(d, bad))
        check_all, check_bad, check_good, human = cli_many(
            env, ("verify", *a, "--check-only", "--json"),
            ("verify", bad.hex()[:7], *a, "--check-only", "--json"),
            ("verify", good.hex()[:7], *a, "--json"),
            ("verify", *a, "--check-only"))
        assert check_all.returncode == 1 and check_bad.returncode == 1
        report = json.loads(check_all.stdout)
        assert report["checked"] == 2
        assert [(b["key"], b["quarantined"]) for b in report["bad"]] == [(bad.hex(), False)]
        assert "checksum" in report["bad"][0]["error"]
        single = json.loads(check_bad.stdout)
        assert single["checked"] == 1 and [b["key"] for b in single["bad"]] == [bad.hex()]
        assert json.loads(ok(check_good)) == {"checked": 1, "bad": []}
        assert human.returncode == 1
        assert f"BAD {bad.hex()}" in human.stdout and "left in place" in human.stdout
        # Nothing was moved: the bad entry is still listed, its file in place.
        assert listed(c) == {good, bad} and blob_file(d, bad).exists()
        assert os.listdir(d.data_dir / "quarantine") == []
        assert c.stats().counters["corrupt_blobs"] == 0
        # Without --check-only, the named bad entry is quarantined.
        quarantined = cli(env, "verify", bad.hex()[:7], *a, "--json")
        assert quarantined.returncode == 1
        assert json.loads(quarantined.stdout)["bad"][0]["quarantined"] is True
        assert listed(c) == {good} and len(os.listdir(d.data_dir / "quarantine")) == 1
        # A full key of no entry: named as not found, nothing quarantined.
        gone = cli(env, "verify", bad.hex(), *a)
        assert gone.returncode == 1
        assert f"NOT FOUND {bad.hex()}: no such entry" in gone.stdout
        assert "quarantined" not in gone.stdout


# --------------------------------------------------------------------------- messages


def test_messages_are_plain_sentences_without_grpc_log_lines(daemon: DaemonProcess,
                                                             env: dict[str, str],
                                                             tmp_path: Path) -> None:
    a = ("-a", daemon.address)
    missing = "0123456789abcdef" * 2
    bogus_ca = tmp_path / "ca.pem"
    bogus_ca.write_text("not a certificate\n")
    tls = ("stats", "-a", "127.0.0.1:1", "--tls-ca", str(bogus_ca))  # a closed port
    results = cli_many(env, ("evict", missing, *a), ("pin", missing, *a),
                       ("inspect", missing, *a), ("prune", *a), tls)
    *not_found, no_filter, quiet = results
    for result in not_found:
        line = refused(result, 1, f"not found: no entry {missing}")
        assert "NOT_FOUND" not in line and "StatusCode" not in line
    refused(no_filter, 1, "invalid request: prune needs a filter")
    assert quiet.returncode == 1 and quiet.stderr.count("\n") == 1, quiet.stderr
    refused(quiet, 1, "no kvcache daemon at 127.0.0.1:1")
    # A user who asks for gRPC's own logs gets them.
    loud = cli({**env, "GRPC_VERBOSITY": "ERROR"}, *tls)
    assert loud.returncode == 1 and loud.stderr.count("\n") > 1, loud.stderr


# --------------------------------------------------------------------------- numbers


def test_numbers_are_checked_before_they_reach_the_wire(daemon: DaemonProcess,
                                                        env: dict[str, str],
                                                        tmp_path: Path) -> None:
    a = ("-a", daemon.address)
    with daemon.client() as c:
        t = toks(40, 20)
        kept = c.save(IDENT, t, payload_for(t, 500), "cold").key
    too_big = cli_many(
        env, ("prune", *a, "--max-bytes", "1e30"), ("prune", *a, "--max-ram-bytes", "5E"),
        ("prune", *a, "--max-bytes", str((1 << 62) + 1)),
        ("ls", *a, "--min-tokens", "99999999999999999999"),
        ("ls", *a, "--min-tokens", str(1 << 32)), ("ls", *a, "--limit", "-1"),
        ("inspect", kept.hex(), *a, "--tokens", "-1"),
        *[("serve", "--dir", str(tmp_path / "never"), "--ram-dir", str(tmp_path / "never-ram"),
           "--socket", str(tmp_path / "never.sock"), *size)
          for size in (("--ram-bytes", "1e30"), ("--disk-bytes", "99999999999999999999"))],
        timeout=60)
    for result in too_big:
        refused(result, 2, "Invalid value")
    assert not (tmp_path / "never").exists() and not (tmp_path / "never-ram").exists()
    # The largest size still goes through (here: as a dry run that removes nothing).
    largest = cli_json(env, "prune", *a, "--max-bytes", str(1 << 62), "--dry-run")
    assert largest["removed"] == []
    assert listed_keys(daemon) == {kept}


def listed_keys(d: DaemonProcess) -> set[bytes]:
    with d.client() as c:
        return listed(c)


def test_serve_defaults_are_the_configs_own() -> None:
    """``kvcache serve`` spells its defaults as operators type them (``2G``), for its
    help; they must stay the values the store and the shared tier default to."""
    store = {f.name: f.default for f in dataclasses.fields(StoreConfig)}
    remote = {f.name: f.default for f in dataclasses.fields(RemoteConfig)}
    given = serve.make_context("serve", []).params
    pairs = {"ram_bytes": store["ram_bytes"], "disk_bytes": store["disk_bytes"],
             "min_free_bytes": store["min_free_bytes"], "block_size": store["block_size"],
             "max_entry_bytes": store["max_blob_bytes"],
             "max_saves_per_tenant": store["max_saves_per_tenant"],
             "lease_seconds": store["lease_seconds"], "pin_seconds": store["pin_seconds"],
             "remote_timeout": remote["op_timeout_s"]}
    assert {name: given[name] for name in pairs} == pairs
    # Unset, the per-tenant reservation bound is the store's own rule (0: derived).
    assert given["max_reserved_bytes_per_tenant"] is None
    assert store["max_reserved_bytes_per_tenant"] == 0


# --------------------------------------------------------------------------- warm


def test_warm_refuses_bad_input_in_one_line(daemon: DaemonProcess, env: dict[str, str],
                                            tiny_model: Path, tmp_path: Path) -> None:
    a = ("-a", daemon.address)
    system = tmp_path / "system.txt"
    system.write_text("You are a terse assistant.\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Vous êtes un assistant concis.\n".encode("latin-1"))
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("You are terse. " * 200)
    huge_prompt = tmp_path / "huge.txt"  # more than the tiny model's whole context
    huge_prompt.write_text("You are terse. " * 1200)
    text_gguf = tmp_path / "text.gguf"
    text_gguf.write_text("not a model\n")
    empty_gguf = tmp_path / "empty.gguf"
    empty_gguf.write_bytes(b"")
    cut_gguf = tmp_path / "cut.gguf"
    cut_gguf.write_bytes(tiny_model.read_bytes()[:100_000])
    model = ("--model", str(tiny_model))
    warm = (RUNTIME, "warm", *a, "--threads", "1")
    cases = {
        ("--system-file", str(latin1), *model): ("--system-file", "not UTF-8", "0xea at offset 5"),
        ("--system-file", str(long_prompt), *model, "--n-ctx", "256"):
            ("--n-ctx", "the system prompt is", "tokens", "--n-ctx 256"),
        ("--system-file", str(huge_prompt), *model):
            ("--system-file", f"{tiny_model.name}'s context of 4,096 tokens"),
        ("--system-file", str(system), "--model", str(text_gguf)): ("--model", "text.gguf"),
        ("--system-file", str(system), "--model", str(empty_gguf)): ("--model", "empty"),
        ("--system-file", str(system), "--model", str(cut_gguf)): ("--model", "cut.gguf"),
        ("--system-file", str(system), *model, "--threads", "0"): ("--threads",),
        ("--system-file", str(system), *model, "--n-ctx", "0"): ("--n-ctx",),
        ("--system-file", str(system), *model, "--n-ctx", "2000000000"):
            ("--n-ctx", "trained for"),
        ("--system-file", str(system), *model, "--type-k", "q9"): ("--type-k", "q9"),
    }
    results = cli_many(env, *[(*warm, *args) for args in cases])
    for words, result in zip(cases.values(), results, strict=True):
        refused(result, 2, *words)
    assert listed_keys(daemon) == set(), "a refused warm saved something"
    # The long prompt with room enough works (the tiny model's context is 4,096).
    saved = cli_json(env, *warm, "--system-file", str(long_prompt), *model)
    assert saved["tokens"] > 256 and bytes.fromhex(saved["key"]) in listed_keys(daemon)


# --------------------------------------------------------------------------- progress


def test_long_commands_show_progress_on_a_terminal_only(daemon_factory: DaemonFactory,
                                                         env: dict[str, str]) -> None:
    d = daemon_factory("--block-size", str(BLOCK), "--ram-bytes", "0")
    a = ("-a", d.address)
    with d.client() as c:
        for i in range(20):
            t = toks(800 + i, 20)
            c.save(IDENT, t, payload_for(t, 20_000), "cold")
    code, shown = on_terminal(env, "verify", *a)
    assert code == 0 and "verifying" in shown and "20 checked, 0 bad" in shown, shown
    code, shown = on_terminal(env, "verify", *a, "--json")
    assert code == 0 and "verifying" not in shown and json.loads(shown)["checked"] == 20
    code, shown = on_terminal(env, "prune", *a, "--max-bytes", "0", "--yes")
    assert code == 0 and "pruning" in shown and "removed 20 entries" in shown, shown
    with d.client() as c:
        t = toks(850, 20)
        c.save(IDENT, t, payload_for(t, 20_000), "cold")
    piped_verify = cli(env, "verify", *a)  # (before the prune: it would race it)
    piped_prune = cli(env, "prune", *a, "--max-bytes", "0")
    assert ok(piped_verify).strip() == "1 checked, 0 bad" and piped_verify.stderr == ""
    assert "removed 1 entry" in ok(piped_prune) and piped_prune.stderr == ""
