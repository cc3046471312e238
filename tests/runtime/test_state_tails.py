"""States with a tail: a hybrid model's (lfm2: attention, then the convolution layers'
state) and a sliding-window model's with full-attention layers (olmo2, window 32: the
full-attention cache, then the window's). The cells before the tail are cut and joined
like a plain state's; a hybrid model's tail is the state at the last position and is
kept whole, a window's cells are stored with the piece that holds their positions.

The proof is llama.cpp's own bytes: a checkpoint stored as the cells after its parent's
and its own tail, joined with its parent, must equal byte for byte the state llama.cpp
writes after a prefill of all its tokens, and continue as a cold run does. Then the
runtime: a next turn of such a model stores only its new cells and its tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from harness.procs import Daemon

from kvcache.blob import BlobMeta
from kvcache.client import LoadedBlob
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
from model_runtime.runtime import Runtime
from model_runtime.state import pieces
from model_runtime.state.build import build_state
from model_runtime.state.cut import planes_bytes
from model_runtime.state.layout import (
    FORM_CELLS,
    FORM_PLANES,
    FORM_STATE,
    Layout,
    StateFormatError,
    form_of,
)
from model_runtime.state.parse import parse, window_of
from tests.support.runtime_calls import flush
from tests.support.tiny_llama import generate_greedy, prefill, sample_prompt
from tests.support.warm_cold import BLOCKS

N = 100  # tokens of the deeper checkpoint
BASE = 40  # tokens of the shallower one, its parent


@pytest.fixture(params=["hybrid", "swa"])
def model_path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_model")


@pytest.fixture
def ctx(model_path: Path) -> Iterator[LlamaContext]:
    with LlamaModel(model_path) as model, LlamaContext(
            model, ContextParams(n_ctx=512, n_batch=64, n_seq_max=2, n_threads=1)) as c:
        yield c


def state_after(ctx: LlamaContext, seq_id: int, tokens: list[int]) -> bytes:
    """llama.cpp's state of ``seq_id`` after a cold prefill of ``tokens``."""
    ctx.seq_clear(seq_id)
    prefill(ctx, seq_id, tokens)
    return bytes(ctx.state_seq_get(seq_id))


def blob(tokens: list[int], cut: pieces.Cut, base: int = 0) -> LoadedBlob:
    meta = BlobMeta(namespace=b"n" * 16, model_fingerprint="fp", kv_layout={}, tokens=tokens,
                    reason="finish", parent=b"p" * 16 if base else b"", base=base,
                    cell_layout=cut.cell_layout)
    return LoadedBlob(meta, memoryview(cut.payload), "ram", len(cut.payload), key=bytes(16))


def tokens_of(ctx: LlamaContext, n: int) -> list[int]:
    return sample_prompt(ctx.model.tokenize, n)


def test_a_state_with_a_tail_is_cells_then_a_tail_rebuilt_byte_for_byte(
        ctx: LlamaContext) -> None:
    assert ctx.state_has_tail and not ctx.can_truncate_restored()
    # Its own namespace (see model_runtime.state): whole states stored before are not built on.
    assert ctx.kv_layout()["state_tail"] == ("window" if ctx.state_window else "1")
    assert ctx.state_window == (ctx.model.n_swa if ctx.model.n_swa else 0)
    state = state_after(ctx, 0, tokens_of(ctx, N))
    with pytest.raises(StateFormatError, match="after the KV cache|follow the KV cache"):
        parse(state)  # read as a plain state, the tail is refused, not taken for cells
    cells = parse(state, tail=True)
    assert cells.is_prefix and cells.n_cells == N and cells.layout.tail
    assert 0 < len(cells.tail) < len(state)
    rebuilt = build_state(cells.layout, planes_bytes(cells, 0, N), seq_id=0,
                          forms=FORM_PLANES, tail=cells.tail)
    assert rebuilt == state
    # The layout says so: a reader that knows no tails refuses it by its version.
    d = cells.layout.to_dict(FORM_PLANES)
    assert d["version"] not in (1, 2, 3) and form_of(d) == FORM_PLANES
    assert Layout.from_dict(d) == cells.layout
    assert Layout.from_dict(cells.layout.to_dict(FORM_STATE)) == cells.layout
    with pytest.raises(ValueError, match="with a tail"):
        cells.layout.to_dict(FORM_CELLS)
    with pytest.raises(ValueError, match="a tail for a layout without one"):
        build_state(replace(cells.layout, tail=False), planes_bytes(cells, 0, N), seq_id=0,
                    forms=FORM_PLANES, tail=cells.tail)


def test_a_checkpoint_stores_its_new_cells_and_tail_and_joins_into_llama_cpp_s_bytes(
        ctx: LlamaContext) -> None:
    tokens = tokens_of(ctx, N + 8)
    shallow = state_after(ctx, 0, tokens[:BASE])
    deep = state_after(ctx, 0, tokens[:N])
    window = ctx.state_window
    root = pieces.cut(shallow, 0, tail=True, window=window)
    piece = pieces.cut(deep, BASE, tail=True, window=window)
    chain = [blob(tokens[:BASE], root), blob(tokens[:N], piece, base=BASE)]
    cells = parse(deep, tail=True)
    # What a checkpoint stores: its own cells and its tail (a window's: the cells of its
    # last `window` positions), not the parent's cells again.
    tail = len(cells.tail) if not window else \
        window * window_of(cells, window).layout.cell_width
    assert len(piece.payload) == (N - BASE) * cells.layout.cell_width + tail
    assert len(piece.payload) < len(deep)
    joined = pieces.join(chain, N, seq_id=0, n_stream=ctx.state_streams)
    assert joined.state == deep and list(joined.tokens) == tokens[:N]
    assert pieces.join(chain[:1], BASE, seq_id=0, n_stream=ctx.state_streams).state == shallow
    # Restored into the other sequence, it continues as a cold run of the same tokens.
    ctx.seq_clear(1)
    assert ctx.state_seq_set(1, joined.state) > 0
    index = prefill(ctx, 1, tokens[N:N + 1], start=N)
    warm = generate_greedy(ctx, 1, index, N + 1, 6)
    ctx.seq_clear(0)
    index = prefill(ctx, 0, tokens[:N + 1])
    assert warm == generate_greedy(ctx, 0, index, N + 1, 6)


def test_a_state_with_a_tail_is_served_only_whole_and_never_joined_with_other_runs(
        ctx: LlamaContext) -> None:
    tokens = tokens_of(ctx, N)
    shallow = state_after(ctx, 0, tokens[:BASE])
    deep = state_after(ctx, 0, tokens)
    window = ctx.state_window
    chain = [blob(tokens[:BASE], pieces.cut(shallow, 0, tail=True, window=window)),
             blob(tokens, pieces.cut(deep, BASE, tail=True, window=window), base=BASE)]
    with pytest.raises(StateFormatError, match="serves all of its 100 tokens, not 70"):
        pieces.join(chain, 70, seq_id=0)
    with pytest.raises(ValueError, match="holds it at cell 100"):
        pieces.cut(deep, BASE, 70, tail=True, window=window)
    # Cells without a tail do not carry a chain of states with tails on.
    cells = parse(deep, tail=True)
    plain = pieces.Cut(planes_bytes(cells, BASE, N), pieces.encode_layout(replace(
        cells.layout, tail=False, window=0, window_layers=())), N)
    with pytest.raises(StateFormatError, match="another cell layout"):
        pieces.join([chain[0], blob(tokens, plain, base=BASE)], N, seq_id=0)
    # A piece that lost its tail is refused, not restored with cells read as a tail.
    short = pieces.Cut(memoryview(bytes(chain[1].payload)[:(N - BASE) * 3]),
                       chain[1].meta.cell_layout, N)
    with pytest.raises(StateFormatError, match="and a tail"):
        pieces.join([chain[0], blob(tokens, short, base=BASE)], N, seq_id=0)


def test_a_next_turn_stores_only_its_new_cells_and_its_tail(
        model_path: Path, daemon_factory: Callable[..., Daemon],
        runtimes: Callable[..., Runtime]) -> None:
    d = daemon_factory(*BLOCKS)
    rt = runtimes(model_path, d.address)
    cold = runtimes(model_path, None, n_seq_max=1)
    first_prompt = sample_prompt(rt.tokenize, 150)
    first = rt.complete(tokens=first_prompt, max_tokens=4)
    flush(rt)
    turn = first_prompt + first.tokens + sample_prompt(rt.tokenize, 30)[1:]
    before = rt.stats()
    second = rt.complete(tokens=turn, max_tokens=4)
    flush(rt)
    after = rt.stats()
    assert second.cache_hit_kind == "partial"
    assert second.tokens == cold.complete(tokens=turn, max_tokens=4).tokens
    saved = after["tokens_saved"] - before["tokens_saved"]
    stored = after["tokens_stored"] - before["tokens_stored"]
    # Every save of the turn was built on a stored prefix: it stored only the cells after
    # it (and its tail), not the turn's whole state again.
    built = after["saves_built_on_prefix"] - before["saves_built_on_prefix"]
    assert built == len(second.saves) >= 2
    assert stored < saved / 3, (stored, saved)


def test_a_window_is_joined_from_the_pieces_that_hold_its_positions(tiny_swa_model: Path) -> None:
    with LlamaModel(tiny_swa_model) as model, LlamaContext(
            model, ContextParams(n_ctx=512, n_batch=64, n_seq_max=2, n_threads=1)) as ctx:
        window = ctx.state_window
        assert window == 32
        tokens = tokens_of(ctx, 230)
        states = {n: state_after(ctx, 0, tokens[:n]) for n in (120, 150, 160, 200, 230)}
        # Checkpoints of 120, then 150 and 230 built each on the one before: 230's window
        # (198..229) is all its own, 150's (118..149) takes 118 and 119 from 120's piece.
        chain = [blob(tokens[:120], pieces.cut(states[120], 0, tail=True, window=window)),
                 blob(tokens[:150], pieces.cut(states[150], 120, tail=True, window=window),
                      base=120)]
        assert pieces.join(chain, 150, seq_id=0).state == states[150]
        chain.append(blob(tokens[:230], pieces.cut(states[230], 150, tail=True,
                                                   window=window), base=150))
        assert pieces.join(chain, 230, seq_id=0).state == states[230]
        # A piece built on the middle of a longer one would need window cells that one
        # does not keep (200's holds 168..199, 160's needs 128..159): refused, as the
        # runtime never builds so (it takes a parent that ends where the piece starts).
        branch = [blob(tokens[:200], pieces.cut(states[200], 0, tail=True, window=window)),
                  blob(tokens[:160], pieces.cut(states[160], 150, tail=True, window=window),
                       base=150)]
        with pytest.raises(StateFormatError, match="window's cells from 128"):
            pieces.join(branch, 160, seq_id=0)
