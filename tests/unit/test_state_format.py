"""model_runtime.state (parse, cut, build) against llama.cpp's own state bytes, on tiny
generated models.

The proof that a cut is right is llama.cpp itself: a state's first k cells, rebuilt,
must equal byte for byte what ``llama_state_seq_get_data`` returns after
``llama_memory_seq_rm(seq, k, -1)``, and must restore to the same greedy continuation as
a cold prefill of those k tokens.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness.make_tiny_gguf import write_tiny_llama_gguf

from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaLoadError, LlamaModel
from model_runtime.state.build import Scratch, build_state
from model_runtime.state.cut import cells_bytes, planes_bytes
from model_runtime.state.layout import (
    FORM_CELLS,
    FORM_PLANES,
    FORM_STATE,
    STATE_MAGIC,
    LayerLayout,
    Layout,
    StateFormatError,
    form_of,
    run_size,
)
from model_runtime.state.parse import CellState, layout_of, parse
from tests.support.tiny_llama import generate_greedy, prefill, sample_prompt

N_NEW = 8
LENGTHS = [1, 7, 255, 256, 257, 300, 600]
CUTS = [0, 1, 2, 37, 100, 255, 256, 257, 299, 511]

# (type_k, type_v, flash_attn).  Flash attention off stores V transposed (v_trans 1).
# llama.cpp refuses a quantized V without flash attention, and a quantized K or V with
# flash attention when the block size (32) does not divide the head size: the KV-config
# tests use a model with 32-wide heads.
KV_CONFIGS = [
    pytest.param(("f16", "f16", False), id="f16-transposed-v"),
    pytest.param(("f16", "f16", True), id="f16-flash"),
    pytest.param(("q8_0", "q8_0", True), id="q8_0-flash"),
    pytest.param(("q8_0", "f16", False), id="q8_0k-f16v-transposed-v"),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    """The tiny llama shape with 32-wide heads (4 heads, 2 KV heads, n_embd 128)."""
    path = write_tiny_llama_gguf(
        tmp_path_factory.mktemp("state_format") / "wide.gguf", n_embd=128, n_head=4, n_head_kv=2
    )
    with LlamaModel(path) as m:
        yield m
    path.unlink()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Iterator[LlamaModel]:
    with LlamaModel(tiny_model) as m:
        yield m


def new_ctx(model: LlamaModel, **kw: object) -> LlamaContext:
    params: dict[str, object] = {
        "n_ctx": 1024,
        "n_batch": 512,
        "n_ubatch": 512,
        "n_seq_max": 4,
        "n_threads": 1,
        "kv_unified": True,  # one stream: the backend hands llama.cpp's bytes through as is
    }
    params.update(kw)
    return LlamaContext(model, ContextParams(**params))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=KV_CONFIGS)
def kv_ctx(request: pytest.FixtureRequest, wide_model: LlamaModel) -> Iterator[LlamaContext]:
    type_k, type_v, flash_attn = request.param
    with new_ctx(wide_model, type_k=type_k, type_v=type_v, flash_attn=flash_attn) as c:
        yield c


@pytest.fixture
def ctx(model: LlamaModel) -> Iterator[LlamaContext]:
    with new_ctx(model) as c:
        yield c


def state_of(ctx: LlamaContext, seq: int) -> bytes:
    return bytes(ctx.state_seq_get(seq))


def prompt(model: LlamaModel, n: int) -> list[int]:
    return sample_prompt(model.tokenize, n)


def fresh_state(ctx: LlamaContext, seq: int, tokens: list[int]) -> bytes:
    """The state of ``seq`` after a cold prefill of ``tokens`` into an emptied context."""
    ctx.clear()
    prefill(ctx, seq, tokens)
    return state_of(ctx, seq)


def prefill_interleaved(ctx: LlamaContext, prompts: dict[int, list[int]], chunk: int) -> None:
    """Prefill several sequences with batches that each carry a chunk of every one, so
    their cells interleave in a shared KV buffer."""
    for i in range(0, max(len(p) for p in prompts.values()), chunk):
        toks, pos, seqs = [], [], []
        for seq, p in prompts.items():
            part = p[i : i + chunk]
            toks += part
            pos += range(i, i + len(part))
            seqs += [seq] * len(part)
        ctx.decode(toks, pos, seqs, [False] * len(toks))


CUT_IN = {FORM_CELLS: cells_bytes, FORM_PLANES: planes_bytes}


def rebuilt(state: bytes | CellState, cuts: list[int], seq_id: int,
            form: str = FORM_CELLS) -> memoryview:
    """The state cut at ``cuts`` into runs of ``form`` and joined again."""
    cs = state if isinstance(state, CellState) else parse(state)
    bounds = [0, *cuts, cs.n_cells]
    runs = [CUT_IN[form](cs, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    return build_state(cs.layout, runs, seq_id=seq_id, positions=np.sort(cs.positions),
                       forms=form)


def warm_greedy(
    ctx: LlamaContext, seq: int, state: bytes | memoryview, tokens: list[int]
) -> list[int]:
    """Restore a state of ``tokens``, drop its last cell, re-decode it, generate."""
    n = len(tokens)
    assert ctx.state_seq_set(seq, state) == len(state)
    assert ctx.seq_pos_max(seq) == n - 1
    assert ctx.seq_truncate(seq, n - 1)
    ctx.decode([tokens[-1]], [n - 1], [seq], [True])
    return generate_greedy(ctx, seq, 0, n, N_NEW)


def cold_greedy(ctx: LlamaContext, seq: int, tokens: list[int]) -> list[int]:
    ctx.seq_clear(seq)
    idx = prefill(ctx, seq, tokens)
    return generate_greedy(ctx, seq, idx, len(tokens), N_NEW)


# --------------------------------------------------------------------------- cut and join


@pytest.mark.parametrize("n", LENGTHS)
def test_cut_anywhere_and_joined_is_llama_cpp_bytes(
    kv_ctx: LlamaContext, wide_model: LlamaModel, n: int
) -> None:
    state = fresh_state(kv_ctx, 1, prompt(wide_model, n))
    cs = parse(state)
    assert cs.n_cells == n and cs.is_prefix and cs.seq_id == 1
    assert cs.layout.v_trans is not kv_ctx.params.flash_attn
    assert cs.layout.state_size(n) == len(state)
    assert len(cells_bytes(cs, 0, n)) == n * cs.layout.cell_width
    for a in sorted({c for c in CUTS if c <= n} | {n - 1, n}):
        assert rebuilt(cs, [a], seq_id=1) == state, f"cut at {a}"
    odd = [c for c in (1, 37, 255, 256, 299) if c < n]
    assert rebuilt(cs, odd, seq_id=1) == state
    whole = b"".join(bytes(cells_bytes(cs, a, b)) for a, b in ((0, n // 3), (n // 3, n)))
    assert build_state(cs.layout, whole, forms=FORM_CELLS, seq_id=1) == state


@pytest.mark.parametrize("n", [1, 257, 600])
def test_planar_runs_cut_anywhere_join_to_llama_cpp_bytes(
    kv_ctx: LlamaContext, wide_model: LlamaModel, n: int
) -> None:
    state = fresh_state(kv_ctx, 1, prompt(wide_model, n))
    cs = parse(state)
    assert len(planes_bytes(cs, 0, n)) == n * cs.layout.cell_width
    for a in sorted({c for c in CUTS if c <= n} | {n - 1, n}):
        assert rebuilt(cs, [a], seq_id=1, form=FORM_PLANES) == state, f"cut at {a}"
    odd = [c for c in (1, 37, 255, 256, 299) if c < n]
    assert rebuilt(cs, odd, seq_id=1, form=FORM_PLANES) == state


def test_planar_run_is_llama_cpp_planes_without_headers(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    cs = parse(fresh_state(kv_ctx, 0, prompt(wide_model, 20)))
    want = [cs.k_planes[il][3:9] for il in range(cs.n_layer)]
    if cs.layout.v_trans:  # each channel's elements of the six cells
        want += [cs.v_planes[il][:, 3:9] for il in range(cs.n_layer)]
    else:
        want += [cs.v_planes[il][3:9] for il in range(cs.n_layer)]
    assert planes_bytes(cs, 3, 9) == b"".join(w.tobytes() for w in want)


def test_runs_of_every_form_join_and_take_leading_cells(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    tokens = prompt(wide_model, 300)
    cs = parse(fresh_state(kv_ctx, 1, tokens))
    # A state-form run is llama.cpp's bytes of its cells, whatever sequence they came from.
    as_state = bytes(build_state(cs.layout, planes_bytes(cs, 0, 60), seq_id=5,
                                 forms=FORM_PLANES))
    assert len(as_state) == run_size(cs.layout, FORM_STATE, 60)
    runs = [as_state, cells_bytes(cs, 60, 100), planes_bytes(cs, 100, 257),
            planes_bytes(cs, 257, 300)]
    forms = [FORM_STATE, FORM_CELLS, FORM_PLANES, FORM_PLANES]
    for takes, k in (([60, 40, 157, 43], 300), ([60, 40, 60, 0], 160), ([37, 0, 0, 0], 37)):
        joined = build_state(cs.layout, runs, seq_id=1, forms=forms, takes=takes)
        assert kv_ctx.seq_truncate(1, k)
        assert joined == state_of(kv_ctx, 1), f"first {k} cells"
    with pytest.raises(ValueError, match="asked for"):
        build_state(cs.layout, runs, seq_id=1, forms=forms, takes=[61, 0, 0, 0])
    shifted = bytes(build_state(cs.layout, planes_bytes(cs, 0, 60), seq_id=1,
                                forms=FORM_PLANES, first_pos=5))
    with pytest.raises(StateFormatError, match="positions 0..n-1"):
        build_state(cs.layout, shifted, seq_id=1, forms=FORM_STATE)
    other = Layout(cs.layout.v_trans, cs.layout.layers[:1])
    with pytest.raises(StateFormatError, match="another layout"):
        build_state(other, as_state, seq_id=1, forms=FORM_STATE)
    with pytest.raises(ValueError, match="forms and takes"):
        build_state(cs.layout, runs, seq_id=1, forms=forms[:2])
    with pytest.raises(ValueError, match="unknown run form"):
        build_state(cs.layout, runs[0], seq_id=1, forms="rows")


def test_a_scratch_buffer_is_reused_and_builds_the_same_bytes(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    state = fresh_state(kv_ctx, 1, prompt(wide_model, 300))
    cs = parse(state)
    run = planes_bytes(cs, 0, 300)
    scratch = Scratch()
    assert build_state(cs.layout, run, seq_id=1, forms=FORM_PLANES, scratch=scratch) == state
    first = scratch.take(1)
    shorter = build_state(cs.layout, run, seq_id=1, forms=FORM_PLANES, takes=[100],
                          scratch=scratch)
    assert kv_ctx.seq_truncate(1, 100)
    assert shorter == state_of(kv_ctx, 1)
    assert np.shares_memory(first, scratch.take(1)), "the buffer is kept, not reallocated"


def test_layout_dict_names_its_run_form(small_state: bytes) -> None:
    layout = layout_of(small_state)
    for form in (FORM_CELLS, FORM_PLANES, FORM_STATE):
        d = layout.to_dict(form)
        assert form_of(d) == form and Layout.from_dict(d) == layout
    # Planar by default; version 1 is cell-major, 3 llama.cpp's own bytes.
    assert [layout.to_dict(f)["version"] for f in (FORM_PLANES, FORM_CELLS, FORM_STATE)] == \
        [2, 1, 3]


def test_prefix_of_state_is_llama_cpp_state_after_seq_rm(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    cs = parse(fresh_state(kv_ctx, 2, prompt(wide_model, 600)))
    for k in (599, 300, 257, 256, 255, 37, 1):
        assert kv_ctx.seq_truncate(2, k)
        prefix = build_state(cs.layout, cells_bytes(cs, 0, k), forms=FORM_CELLS, seq_id=2)
        assert prefix == state_of(kv_ctx, 2), f"prefix of {k} cells"


def test_layout_does_not_depend_on_length_and_round_trips_a_dict(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    short = layout_of(fresh_state(kv_ctx, 0, prompt(wide_model, 3)))
    long = layout_of(fresh_state(kv_ctx, 3, prompt(wide_model, 300)))
    assert short == long
    assert short.n_layer == wide_model.n_layer
    assert Layout.from_dict(json.loads(json.dumps(short.to_dict()))) == short


def test_a_cell_is_its_k_rows_then_its_v_values(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    cs = parse(fresh_state(kv_ctx, 0, prompt(wide_model, 20)))
    layout = cs.layout
    cell = 7
    want = [cs.k_planes[il][cell] for il in range(cs.n_layer)]
    if layout.v_trans:  # stored untransposed: the cell's channels side by side
        want += [cs.v_planes[il][:, cell] for il in range(cs.n_layer)]
    else:
        want += [cs.v_planes[il][cell] for il in range(cs.n_layer)]
    assert cells_bytes(cs, cell, cell + 1) == b"".join(w.tobytes() for w in want)
    assert [w for _, w in layout.k_columns() + layout.v_columns()] == [
        len(w.tobytes()) for w in want
    ]


def test_smollm2_shaped_layout_has_the_documented_width() -> None:
    # 30 layers, 3 KV heads x 64, f16: 23,052 bytes of state per token, of which 12
    # are the cell's position and sequence id.
    layers = tuple(LayerLayout(1, 384, 1, 2, 192) for _ in range(30))
    layout = Layout(v_trans=True, layers=layers)
    assert layout.cell_width == 23_040
    assert layout.state_size(2) - layout.state_size(1) == 23_052


# --------------------------------------------------------------------------- restore


@pytest.mark.parametrize("k", [1, 100, 256, 257])
def test_restored_prefix_continues_like_cold_prefill(
    ctx: LlamaContext, model: LlamaModel, k: int
) -> None:
    tokens = prompt(model, 600)
    cs = parse(fresh_state(ctx, 0, tokens))
    ctx.seq_clear(0)  # room for a warm and a cold copy in the shared buffer
    prefix = build_state(
        cs.layout, [cells_bytes(cs, 0, k // 2), cells_bytes(cs, k // 2, k)], forms=FORM_CELLS, seq_id=0
    )
    warm = warm_greedy(ctx, 2, prefix, tokens[:k])
    assert warm == cold_greedy(ctx, 3, tokens[:k])


def test_restored_prefix_continues_like_cold_prefill_with_flash_attention(
    kv_ctx: LlamaContext, wide_model: LlamaModel
) -> None:
    tokens = prompt(wide_model, 300)
    cs = parse(fresh_state(kv_ctx, 0, tokens))
    prefix = build_state(cs.layout, cells_bytes(cs, 0, 137), forms=FORM_CELLS, seq_id=0)
    assert warm_greedy(kv_ctx, 1, prefix, tokens[:137]) == cold_greedy(kv_ctx, 2, tokens[:137])


def test_built_state_restores_into_another_sequence(ctx: LlamaContext, model: LlamaModel) -> None:
    tokens = prompt(model, 300)
    cs = parse(fresh_state(ctx, 0, tokens))
    for seq in (1, 3):
        built = build_state(cs.layout, cells_bytes(cs, 0, 200), forms=FORM_CELLS, seq_id=seq)
        assert ctx.state_seq_set(seq, built) == len(built)
        assert state_of(ctx, seq) == built


def test_empty_run_builds_llama_cpp_empty_state(ctx: LlamaContext, model: LlamaModel) -> None:
    cs = parse(fresh_state(ctx, 0, prompt(model, 10)))
    empty = state_of(ctx, 2)
    assert build_state(cs.layout, [], forms=FORM_CELLS, seq_id=2) == empty
    assert build_state(cs.layout, cells_bytes(cs, 4, 4), forms=FORM_CELLS, seq_id=2) == empty
    with pytest.raises(StateFormatError, match="no cells"):
        parse(empty)


# --------------------------------------------------------------------------- several sequences


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_state_of_one_sequence_among_others(model: LlamaModel, kv_unified: bool) -> None:
    tokens = prompt(model, 300)
    others = sample_prompt(model.tokenize, 400, text="Other sequences hold other tokens. ")
    with new_ctx(model, kv_unified=kv_unified) as c:
        prefill_interleaved(c, {0: others[:170], 1: tokens, 2: others[50:]}, chunk=64)
        state = state_of(c, 1)
        cs = parse(state)
        assert cs.is_prefix and cs.n_cells == 300
        assert cs.layout.n_stream == 1  # split caches come back in single-stream form
        assert rebuilt(cs, [64, 65, 257], seq_id=1) == state
        assert rebuilt(cs, [64, 65, 257], seq_id=1, form=FORM_PLANES) == state
        for k in (257, 64, 3):
            assert c.seq_truncate(1, k)
            assert build_state(cs.layout, cells_bytes(cs, 0, k), forms=FORM_CELLS, seq_id=1) == state_of(c, 1)
        assert c.seq_pos_max(0) == 169 and c.seq_pos_max(2) == 349


def test_cells_out_of_position_order_are_cut_by_position(
    ctx: LlamaContext, model: LlamaModel
) -> None:
    tokens = prompt(model, 130)
    prefill(ctx, 0, tokens[:40])
    prefill(ctx, 1, tokens[:100])
    ctx.seq_clear(0)  # frees the first cells of the shared buffer...
    prefill(ctx, 1, tokens[100:], start=100)  # ...which the continuation reuses
    cs = parse(state_of(ctx, 1))
    assert not cs.in_position_order and not cs.is_prefix
    assert sorted(cs.positions.tolist()) == list(range(130))
    built = rebuilt(cs, [50, 101], seq_id=1)
    assert rebuilt(cs, [50, 101], seq_id=1, form=FORM_PLANES) == built
    assert parse(built).is_prefix
    assert warm_greedy(ctx, 2, built, tokens) == cold_greedy(ctx, 3, tokens)
    with new_ctx(model) as empty:  # a restore into free cells places them in order
        assert empty.state_seq_set(1, built) == len(built)
        assert state_of(empty, 1) == built


# --------------------------------------------------------------------------- positions


def test_positions_may_start_anywhere_or_be_given(ctx: LlamaContext, model: LlamaModel) -> None:
    cs = parse(fresh_state(ctx, 0, prompt(model, 20)))
    run = cells_bytes(cs, 0, 20)
    shifted = parse(build_state(cs.layout, run, forms=FORM_CELLS, seq_id=0, first_pos=5))
    assert shifted.positions.tolist() == list(range(5, 25)) and not shifted.is_prefix
    given = list(range(20))
    assert build_state(cs.layout, run, forms=FORM_CELLS, seq_id=0, positions=given) == build_state(
        cs.layout, run, forms=FORM_CELLS, seq_id=0
    )
    with pytest.raises(ValueError, match="19 positions for 20 cells"):
        build_state(cs.layout, run, forms=FORM_CELLS, seq_id=0, positions=given[:-1])
    with pytest.raises(ValueError, match="int32"):
        build_state(cs.layout, run, forms=FORM_CELLS, seq_id=0, first_pos=2**31 - 5)


# --------------------------------------------------------------------------- streams


def widen(state: bytes, n_stream: int, stream: int) -> bytes:
    """A single-stream state as a split KV cache writes it: ``n_stream`` cell counts, the
    cells after count ``stream``, every other count 0."""
    magic, seq, _ = struct.unpack_from("<IiI", state)
    zeros = b"\0\0\0\0"
    return (
        struct.pack("<IiI", magic, seq, n_stream)
        + zeros * stream
        + state[12:]
        + zeros * (n_stream - 1 - stream)
    )


def test_split_cache_state_parses_and_rebuilds_exactly(
    ctx: LlamaContext, model: LlamaModel
) -> None:
    wide = widen(fresh_state(ctx, 2, prompt(model, 100)), n_stream=4, stream=2)
    cs = parse(wide)
    assert (cs.layout.n_stream, cs.layout.stream, cs.n_cells) == (4, 2, 100)
    assert rebuilt(cs, [33], seq_id=2) == wide
    assert Layout.from_dict(cs.layout.to_dict()) == cs.layout


def test_cells_in_two_streams_are_refused(ctx: LlamaContext, model: LlamaModel) -> None:
    state = fresh_state(ctx, 0, prompt(model, 10))
    magic, seq, _ = struct.unpack_from("<IiI", state)
    two = struct.pack("<IiI", magic, seq, 2) + state[12:] + state[12:]
    with pytest.raises(StateFormatError, match="more than one stream"):
        parse(two)


# --------------------------------------------------------------------------- malformed


@pytest.fixture
def small_state(ctx: LlamaContext, model: LlamaModel) -> bytes:
    return fresh_state(ctx, 1, prompt(model, 10))


def test_truncated_state_is_refused(small_state: bytes) -> None:
    meta_end = 16 + 12 * 10
    for end in (
        0,
        3,
        11,
        15,
        20,
        meta_end,
        meta_end + 5,
        len(small_state) // 2,
        len(small_state) - 1,
    ):
        with pytest.raises(StateFormatError, match="truncated"):
            parse(small_state[:end])


def test_trailing_bytes_are_refused(small_state: bytes) -> None:
    with pytest.raises(StateFormatError, match="1 trailing bytes"):
        parse(small_state + b"\0")


def test_wrong_magic_is_refused(small_state: bytes) -> None:
    with pytest.raises(StateFormatError, match="magic"):
        parse(b"\0\0\0\0" + small_state[4:])
    assert struct.unpack_from("<I", small_state)[0] == STATE_MAGIC


def test_cell_with_two_sequence_ids_is_refused(small_state: bytes) -> None:
    cell3 = 16 + 12 * 3  # pos, n_seq_id, seq_id
    two = bytearray(small_state)
    struct.pack_into("<I", two, cell3 + 4, 2)
    two[cell3 + 12 : cell3 + 12] = struct.pack("<i", 0)
    with pytest.raises(StateFormatError, match="cell 3 has 2 sequence ids"):
        parse(bytes(two))


def test_cell_of_another_sequence_is_refused(small_state: bytes) -> None:
    other = bytearray(small_state)
    struct.pack_into("<i", other, 16 + 12 * 5 + 8, 3)
    with pytest.raises(StateFormatError, match="cell 5 belongs to sequence 3, not 1"):
        parse(bytes(other))


@pytest.mark.parametrize(
    ("offset_after_meta", "value", "message"),
    [
        (0, 2, "v_trans is 2"),
        (4, 0, "implausible layer count 0"),
        (4, 1_000_000, "implausible layer count"),
        (12, 0, "K row size of layer 0 is 0"),
    ],
)
def test_inconsistent_data_header_is_refused(
    small_state: bytes, offset_after_meta: int, value: int, message: str
) -> None:
    bad = bytearray(small_state)
    struct.pack_into("<I", bad, 16 + 12 * 10 + offset_after_meta, value)
    with pytest.raises(StateFormatError, match=message):
        parse(bytes(bad))


def test_implausible_stream_count_is_refused(small_state: bytes) -> None:
    for n_stream in (0, 100_000):
        bad = bytearray(small_state)
        struct.pack_into("<I", bad, 8, n_stream)
        with pytest.raises(StateFormatError, match="stream count"):
            parse(bytes(bad))


def test_sliding_window_model_state_is_refused(tiny_swa_model: Path) -> None:
    with LlamaModel(tiny_swa_model) as m, new_ctx(m) as c:
        state = fresh_state(c, 0, prompt(m, 100))
    with pytest.raises(StateFormatError, match="second cache"):
        parse(state)


def test_llama_cpp_refuses_quantized_v_without_flash_attention(wide_model: LlamaModel) -> None:
    # Hence a transposed V (flash attention off) always has whole-byte elements.
    with pytest.raises(LlamaLoadError):
        new_ctx(wide_model, type_k="q8_0", type_v="q8_0", flash_attn=False)


def test_bad_ranges_and_runs_are_value_errors(small_state: bytes) -> None:
    cs = parse(small_state)
    for a, b in ((-1, 3), (3, 2), (0, 11)):
        with pytest.raises(ValueError, match="outside"):
            cells_bytes(cs, a, b)
        with pytest.raises(ValueError, match="outside"):
            planes_bytes(cs, a, b)
    with pytest.raises(ValueError, match="not a multiple"):
        build_state(cs.layout, [cells_bytes(cs, 0, 2), b"\0"], forms=FORM_CELLS, seq_id=1)
    with pytest.raises(ValueError, match="int32"):
        build_state(cs.layout, cells_bytes(cs, 0, 2), forms=FORM_CELLS, seq_id=2**31)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "unsupported layout version"),
        ({"version": True}, "unsupported layout version"),
        ({"v_trans": "yes"}, "not an integer"),
        ({"v_trans": 2}, "not 0 or 1"),
        ({"layers": [[1, 2**40, 1, 2, 16]]}, "invalid sizes"),
        ({"layers": [[-1, 64, 1, 2, 16]]}, "invalid sizes"),
        ({"layers": []}, "no layers"),
        ({"layers": [[1, 0, 1, 2, 16]]}, "invalid sizes"),
        ({"layers": [[1, 64, 1, 2, 0]]}, "invalid sizes"),
        ({"layers": [[1, 64, 1, 2]]}, "5 numbers"),
        ({"stream": 1}, "stream 1 of 1"),
        ({"n_stream": 0}, "stream 0 of 0"),
    ],
)
def test_malformed_layout_dict_is_refused(
    small_state: bytes, change: dict[str, object], message: str
) -> None:
    d = layout_of(small_state).to_dict()
    assert d["v_trans"] == 1
    with pytest.raises(StateFormatError, match=message):
        Layout.from_dict({**d, **change})
    missing = dict(d)
    del missing["layers"]
    with pytest.raises(StateFormatError, match="malformed layout"):
        Layout.from_dict(missing)
