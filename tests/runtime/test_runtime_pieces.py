"""The runtime stores states as pieces and restores them joined: real llama.cpp (the tiny
generated model), a real daemon, real files.

A save stores only the cells after the longest prefix the daemon already holds; a restore
joins the pieces of a chain into llama.cpp's own bytes. Greedy output after a restore
from pieces, after a cut of a longer or diverging chain, and from an entry of the
previous (whole-state) format equals a cold prefill's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvcache.blob import BlobMeta, encode_blob
from kvcache.client import CacheClient, LoadedBlob
from kvcache.v1 import kvcache_pb2 as pb
from model_runtime.llama_backend import LlamaModel
from model_runtime.runtime import Runtime
from model_runtime.state import pieces
from model_runtime.state.build import build_state
from model_runtime.state.cut import cells_bytes, planes_bytes
from model_runtime.state.layout import FORM_CELLS, FORM_PLANES, FORM_STATE, form_of
from model_runtime.state.parse import layout_of, parse
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.runtime_calls import (
    CONFIG,
    TEXT_A,
    TEXT_B,
    daemon_counters,
    delta,
    flush,
    prompt,
)
from tests.support.tiny_llama import prefill
from tests.unit.test_state_format import fresh_state, new_ctx
from tests.unit.test_state_format import prompt as model_prompt

# These tests follow the daemon path (no live reuse), with states of at least 8 tokens.
PIECES_CONFIG = replace(CONFIG, n_seq_max=1)
DAEMON_ARGS = ("--block-size", "32")  # each test's daemon's


@pytest.fixture
def make_runtime(daemon: DaemonProcess, tiny_model: Path) -> Iterator[Callable[..., Runtime]]:
    made: list[Runtime] = []

    def make(cache_address: str | None = daemon.address, **overrides: Any) -> Runtime:
        rt = Runtime(tiny_model, cache_address=cache_address,
                     config=replace(PIECES_CONFIG, **overrides))
        made.append(rt)
        return rt

    yield make
    for rt in reversed(made):
        rt.close()


def waiting_lookups(cache: DaemonProcess) -> int:
    """Lookups now waiting for another writer's save in flight."""
    with CacheClient(cache.address, timeout=10) as c:
        return c.stats().waiting_lookups


def disk_bytes(address: str) -> tuple[int, int]:
    """(stored bytes, logical bytes) of the daemon."""
    with CacheClient(address, timeout=10) as c:
        stats = c.stats()
    return next(t.bytes for t in stats.tiers if t.tier == 2), stats.logical_bytes


def blob(tokens: list[int], payload: bytes | memoryview, base: int = 0, parent: bytes = b"",
         layout: bytes = b"") -> LoadedBlob:
    meta = BlobMeta(namespace=b"n" * 16, model_fingerprint="fp", kv_layout={}, tokens=tokens,
                    reason="finish", parent=parent, base=base, cell_layout=layout)
    return LoadedBlob(meta, memoryview(payload), "ram", len(payload), key=bytes(16))


def test_joined_pieces_are_llama_cpp_bytes(tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as model, new_ctx(model) as ctx:
        tokens = model_prompt(model, 150)
        state = fresh_state(ctx, 0, tokens)
        for cuts in ([0], [0, 1], [0, 32, 33], [0, 77, 140, 149]):
            chain = []
            for i, base in enumerate(cuts):
                end = cuts[i + 1] if i + 1 < len(cuts) else len(tokens)
                # Each piece as a save of tokens[:end] stores it: its cells from its base.
                piece = pieces.cut(fresh_state(ctx, 0, tokens[:end]), base)
                chain.append(blob(tokens[:end], piece.payload, base,
                                  b"p" * 16 if base else b"", piece.cell_layout))
            assert bytes(pieces.join(chain, 150, seq_id=0).state) == state
            # A shorter prefix is llama.cpp's state of those tokens, for the sequence asked
            # for; or, when the root alone serves it and holds at most twice as many
            # tokens, the root as stored (llama.cpp's bytes, cut after the restore).
            root_tokens = cuts[1] if len(cuts) > 1 else len(tokens)
            for n, seq in ((100, 0), (60, 3), (100, 3)):
                joined = pieces.join(chain, n, seq_id=seq)
                as_stored = root_tokens >= n and root_tokens <= 2 * n
                assert list(joined.tokens) == tokens[: root_tokens if as_stored else n]
                want = chain[0].payload if as_stored else fresh_state(ctx, seq, tokens[:n])
                assert bytes(joined.state) == bytes(want), (cuts, n, seq)
                if as_stored:  # not a copy
                    assert np.shares_memory(np.frombuffer(joined.state, np.uint8),
                                            np.frombuffer(chain[0].payload, np.uint8))


def test_a_root_is_stored_as_llama_cpp_s_bytes_and_restored_as_stored(
        tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as model, new_ctx(model) as ctx:
        tokens = model_prompt(model, 120)
        state = fresh_state(ctx, 0, tokens)
        root = pieces.cut(state, 0)
        assert bytes(root.payload) == state and root.n_cells == 120
        assert form_of(msgpack.unpackb(root.cell_layout)) == FORM_STATE
        chain = [blob(tokens, root.payload, layout=root.cell_layout)]
        # Set as stored into another sequence and cut: llama.cpp's state of the prefix.
        joined = pieces.join(chain, 90, seq_id=2)
        assert ctx.state_seq_set(2, joined.state) == len(joined.state)
        assert ctx.seq_truncate(2, 90)
        assert bytes(ctx.state_seq_get(2)) == fresh_state(ctx, 2, tokens[:90])
        # A root that does not hold positions 0..n-1 is refused, not handed to llama.cpp.
        layout = layout_of(state)
        shifted = build_state(layout, planes_bytes(state, 0, 120), seq_id=0,
                              forms=FORM_PLANES, first_pos=1)
        with pytest.raises(pieces.StateFormatError, match="positions 0..n-1"):
            pieces.join([blob(tokens, shifted, layout=root.cell_layout)], 90, seq_id=2)


def test_cell_major_pieces_of_the_first_piece_format_join_with_planar_ones(
        tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as model, new_ctx(model) as ctx:
        tokens = model_prompt(model, 120)
        state = fresh_state(ctx, 0, tokens)
        cells = parse(fresh_state(ctx, 0, tokens[:70]))
        old_layout = msgpack.packb(cells.layout.to_dict(FORM_CELLS))
        old_root = blob(tokens[:70], cells_bytes(cells, 0, 70), layout=old_layout)
        child = pieces.cut(state, 70)
        chain = [old_root, blob(tokens, child.payload, 70, b"p" * 16, child.cell_layout)]
        assert bytes(pieces.join(chain, 120, seq_id=0).state) == state
        assert bytes(pieces.join(chain, 90, seq_id=2).state) == fresh_state(ctx, 2, tokens[:90])


def test_a_join_for_a_split_cache_is_taken_as_it_is(tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as model, new_ctx(model, kv_unified=False) as ctx:
        assert ctx.state_streams == 4  # one KV stream per sequence
        tokens = model_prompt(model, 120)
        state = fresh_state(ctx, 0, tokens)  # single-stream (canonical) bytes
        root = pieces.cut(state, 0)
        joined = pieces.join([blob(tokens[:120], root.payload, layout=root.cell_layout)],
                             90, seq_id=2, n_stream=ctx.state_streams)
        assert parse(joined.state).layout.n_stream == 4
        # All of it consumed as written: no widening copy, nothing added.
        assert ctx.state_seq_set(2, joined.state) == len(joined.state)
        restored = bytes(ctx.state_seq_get(2))
        assert restored == fresh_state(ctx, 2, tokens[:90])


def test_pieces_that_do_not_fit_are_refused() -> None:
    layout = b"\x85"  # not a layout
    with pytest.raises(pieces.StateFormatError):
        pieces.join([blob([1, 2], b"xx", layout=layout)], 2, seq_id=0)
    whole = blob([1, 2, 3], b"state")
    assert pieces.join([whole], 2, seq_id=0).n_tokens == 3  # cut after the restore
    with pytest.raises(pieces.StateFormatError, match="whole state"):
        pieces.join([whole, whole], 3, seq_id=0)


def test_conversations_over_one_system_prompt_store_it_once(
        make_runtime: Callable[..., Runtime], daemon: DaemonProcess, tiny_model: Path) -> None:
    rt = make_runtime()
    system = prompt(rt, 300)
    users = [rt.tokenize(f" question {i}: " + TEXT_B * (i + 1))[1:] for i in range(4)]
    first = rt.complete(tokens=system + users[0], prefix_tokens=300, max_tokens=12)
    flush(rt)
    stored_one, logical_one = disk_bytes(daemon.address)
    before = dict(rt.stats())
    outs = [rt.complete(tokens=system + u, prefix_tokens=300, max_tokens=12) for u in users[1:]]
    flush(rt)
    after = dict(rt.stats())
    assert first.cache_hit_kind == "cold"
    assert {o.cache_hit_kind for o in outs} == {"partial"}
    # Every later save (each conversation's prompt, then its finish state) was a piece
    # on what was stored before it: only new cells were sent.
    saves = delta(before, after, "saves_finish") + delta(before, after, "saves_prompt")
    assert saves == 6 and delta(before, after, "saves_built_on_prefix") == saves
    assert delta(before, after, "tokens_stored") < delta(before, after, "tokens_saved") / 4
    stored, logical = disk_bytes(daemon.address)
    # Three more conversations of ~330 tokens cost about their own ~60 tokens each.
    assert stored - stored_one < (logical - logical_one) / 3
    # Greedy output from pieces equals a cold prefill's, for each conversation.
    plain = make_runtime(cache_address=None)
    for u, out in zip(users[1:], outs, strict=True):
        assert out.tokens == plain.complete(tokens=system + u, max_tokens=12).tokens
    # A fresh runtime restores a whole conversation (its finish piece on the prompt).
    again = make_runtime()
    full = system + users[2] + outs[1].tokens[:-1]
    warm = again.complete(tokens=full + users[3], max_tokens=12)
    assert warm.cache_hit_kind == "partial" and warm.cache_delta["tokens_read"] == len(full)
    assert warm.tokens == plain.complete(tokens=full + users[3], max_tokens=12).tokens


def test_a_save_after_a_restore_writes_only_new_cells(make_runtime: Callable[..., Runtime],
                                                      daemon: DaemonProcess) -> None:
    rt = make_runtime()
    p = prompt(rt, 200)
    first = rt.complete(tokens=p, max_tokens=10)
    flush(rt)
    turn = p + first.tokens[:-1] + rt.tokenize(TEXT_B)[1:]
    before_daemon = daemon_counters(daemon.address)
    resumed = make_runtime()
    second = resumed.complete(tokens=turn, max_tokens=10)
    flush(resumed)
    read = second.cache_delta["tokens_read"]
    assert second.cache_hit_kind == "partial" and read == len(p) + len(first.tokens) - 1
    # Each of its saves was a piece on what it restored: none re-sent those cells.
    stats = resumed.stats()
    n_saves = len(second.saves)
    assert n_saves and stats["saves_built_on_prefix"] == n_saves
    assert stats["tokens_stored"] <= stats["tokens_saved"] - n_saves * read
    assert delta(before_daemon, daemon_counters(daemon.address), "pieces_committed") == n_saves


def test_a_save_waits_for_another_writers_longer_prefix_and_builds_on_it(
        make_runtime: Callable[..., Runtime], daemon: DaemonProcess) -> None:
    rt = make_runtime(in_flight_wait_ms=20_000)
    system = prompt(rt, 96)
    # The other writer's state of the system prompt (a real one, from its own context).
    other = make_runtime(cache_address=None, reuse_live=True)  # keeps its KV afterwards
    other.complete(tokens=system, max_tokens=1)  # the first token needs no decode
    root = pieces.cut(bytes(other.ctx.state_seq_get(0)), 0)
    meta = BlobMeta(namespace=rt.identity.namespace, model_fingerprint=rt.identity.model_fingerprint,
                    kv_layout=dict(rt.identity.kv_layout), tokens=system, reason="cold",
                    cell_layout=root.cell_layout)
    data = b"".join(bytes(part) for part in encode_blob(meta, root.payload))
    writer = CacheClient(daemon.address, timeout=10)
    lease = writer.stub.Reserve(pb.ReserveRequest(
        identity=rt.identity.message(), tokens=system, size=len(data), reason="cold"),
        timeout=10)
    before = daemon_counters(daemon.address)
    done = rt.complete(tokens=system + rt.tokenize(TEXT_B)[1:], max_tokens=4)
    # Its first save (the cold one, of the system prompt) waits for the writer's.
    wait_for(lambda: waiting_lookups(daemon) == 1, "the save to wait for the other writer")
    writer.stub.Write(iter([pb.WriteChunk(lease_id=lease.lease_id, data=data)]), timeout=10)
    writer.stub.Commit(pb.CommitRequest(lease_id=lease.lease_id), timeout=10)
    writer.close()
    flush(rt)
    stats = rt.stats()
    # The cold save of the system prompt waited and found it stored; the prompt's and
    # the finish state's were built on it: only their own cells were sent.
    assert (stats["saves_skipped_already_present"], stats["saves_built_on_prefix"]) == (1, 2)
    full = system + rt.tokenize(TEXT_B)[1:] + done.tokens[:-1]
    assert stats["tokens_stored"] == len(full) - len(system)
    after = daemon_counters(daemon.address)
    assert delta(before, after, "lookups_waited_in_flight") == 1
    # The conversation restores from the writer's piece and its own, equal to cold.
    again = make_runtime()
    warm = again.complete(tokens=full + [done.tokens[-1]], max_tokens=6)
    assert warm.cache_delta["tokens_read"] == len(full)
    cold = make_runtime(cache_address=None).complete(tokens=full + [done.tokens[-1]],
                                                     max_tokens=6)
    assert warm.tokens == cold.tokens


def test_a_save_gives_up_on_a_writer_that_does_not_finish(
        make_runtime: Callable[..., Runtime], daemon: DaemonProcess) -> None:
    rt = make_runtime(in_flight_wait_ms=200)
    system = prompt(rt, 96)
    with CacheClient(daemon.address, timeout=10) as writer:
        lease = writer.stub.Reserve(pb.ReserveRequest(
            identity=rt.identity.message(), tokens=system + [7], size=1000, reason="cold"),
            timeout=10)
        rt.complete(tokens=system + rt.tokenize(TEXT_B)[1:], max_tokens=4)
        flush(rt)
        writer.stub.Abort(pb.AbortRequest(lease_id=lease.lease_id), timeout=10)
    stats = rt.stats()
    # Its finish state shares the 96 tokens being written: dropped, not stored twice.
    assert stats["saves_dropped_in_flight_prefix"] == 1 and stats["saves_finish"] == 0
    assert daemon_counters(daemon.address)["lookups_in_flight_timeout"] >= 1


def test_a_diverging_chain_is_cut_and_matches_cold(make_runtime: Callable[..., Runtime]
                                                   ) -> None:
    rt = make_runtime()
    base = prompt(rt, 260)
    rt.complete(tokens=base, max_tokens=6)
    flush(rt)
    # Shares the first 150 tokens with the stored chain, then diverges.
    diverging = base[:150] + rt.tokenize(TEXT_B * 3)[1:]
    warm = make_runtime().complete(tokens=diverging, max_tokens=12)
    cold = make_runtime(cache_address=None).complete(tokens=diverging, max_tokens=12)
    assert warm.cache_hit_kind == "partial" and warm.cache_delta["tokens_read"] == 150
    assert warm.tokens == cold.tokens


def test_an_entry_of_the_previous_format_is_restored(make_runtime: Callable[..., Runtime],
                                                     daemon: DaemonProcess) -> None:
    rt = make_runtime()
    p = prompt(rt, 120, TEXT_A)
    # The state as the previous version stored it: whole, no parent, no cell layout.
    with CacheClient(daemon.address) as c:
        assert c.save(rt.identity, p, whole_state(rt, p), "finish").status == "saved"
    question = p + rt.tokenize(TEXT_B)[1:]
    warm = make_runtime().complete(tokens=question, max_tokens=12)
    cold = make_runtime(cache_address=None).complete(tokens=question, max_tokens=12)
    assert warm.cache_hit_kind == "partial" and warm.cache_delta["tokens_read"] == len(p)
    assert warm.tokens == cold.tokens


def whole_state(rt: Runtime, tokens: list[int]) -> bytes:
    """llama.cpp's state of ``tokens``, from the runtime's own (idle) context."""
    ctx = rt.engine.ctx

    def run() -> bytes:
        ctx.seq_clear(0)
        prefill(ctx, 0, tokens)
        state = bytes(ctx.state_seq_get(0))
        ctx.seq_clear(0)
        return state

    return rt.engine.call(run)
