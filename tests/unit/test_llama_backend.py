"""model_runtime.llama_backend against real llama.cpp, on tiny generated models.

Every assertion about generation compares greedy *tokens*, never raw floats: single-token
and batched kernels may round differently (see DESIGN.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness.make_tiny_gguf import write_tiny_llama_gguf

from model_runtime.chat.templates import ChatTemplate
from model_runtime.llama_backend import (
    ContextParams,
    LlamaContext,
    LlamaDecodeError,
    LlamaModel,
    set_llama_logging,
)
from tests.support.tiny_llama import generate_greedy, prefill, sample_prompt

N_NEW = 16


@pytest.fixture(scope="session")
def model(tiny_model: Path) -> Iterator[LlamaModel]:
    with LlamaModel(tiny_model) as m:
        yield m


def new_ctx(model: LlamaModel, **kw: object) -> LlamaContext:
    params = {"n_ctx": 1024, "n_batch": 256, "n_ubatch": 256, "n_seq_max": 4, "n_threads": 1}
    params.update(kw)
    return LlamaContext(model, ContextParams(**params))  # type: ignore[arg-type]


@pytest.fixture
def ctx(model: LlamaModel) -> Iterator[LlamaContext]:
    with new_ctx(model) as c:
        yield c


def cold_run(ctx: LlamaContext, seq: int, prompt: list[int], n_new: int = N_NEW) -> list[int]:
    idx = prefill(ctx, seq, prompt)
    return generate_greedy(ctx, seq, idx, len(prompt), n_new)


def warm_start(
    ctx: LlamaContext, seq: int, state: bytes, prompt: list[int], n_new: int = N_NEW
) -> list[int]:
    """Restore a state of the whole prompt, drop its last cell, re-decode it, generate."""
    n = len(prompt)
    assert ctx.state_seq_set(seq, state) == len(state)
    assert ctx.seq_pos_max(seq) == n - 1
    assert ctx.seq_truncate(seq, n - 1)
    assert ctx.seq_pos_max(seq) == n - 2
    ctx.decode([prompt[-1]], [n - 1], [seq], [True])
    return generate_greedy(ctx, seq, 0, n, n_new)


# --------------------------------------------------------------------------- generator


def test_tiny_gguf_is_deterministic_and_small(tmp_path: Path) -> None:
    a = write_tiny_llama_gguf(tmp_path / "a.gguf", seed=7).read_bytes()
    b = write_tiny_llama_gguf(tmp_path / "b.gguf", seed=7).read_bytes()
    c = write_tiny_llama_gguf(tmp_path / "c.gguf", seed=8).read_bytes()
    assert a == b
    assert a != c
    assert len(a) < 2_000_000


# --------------------------------------------------------------------------- model


def test_model_metadata(model: LlamaModel) -> None:
    assert (model.n_layer, model.n_embd, model.n_head, model.n_head_kv) == (2, 64, 4, 2)
    assert model.n_ctx_train == 4096
    assert 300 <= model.n_vocab <= 1000
    assert model.n_swa == 0
    assert model.is_recurrent is False
    assert model.description.startswith("llama")
    assert (model.bos_token, model.eos_token) == (1, 2)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, the quick brown fox.",
        "  leading spaces,\ttabs\nand\n\nnewlines  ",
        "Grüße, naïve café — 日本語のテキスト 🙂🚀 ∑x²",
    ],
)
def test_tokenize_detokenize_round_trip(model: LlamaModel, text: str) -> None:
    toks = model.tokenize(text, add_special=False)
    assert toks and model.bos_token not in toks
    assert model.detokenize(toks) == text
    assert b"".join(model.token_to_piece(t) for t in toks) == text.encode()
    with_bos = model.tokenize(text)
    assert with_bos[0] == model.bos_token and with_bos[1:] == toks
    assert model.detokenize(with_bos) == text  # BOS is a control token: renders as ""


def test_tokenize_uses_merged_pieces(model: LlamaModel) -> None:
    text = "the cat and the dog"
    assert len(model.tokenize(text, add_special=False)) < len(text)


def test_detokenize_rejects_out_of_vocabulary(model: LlamaModel) -> None:
    with pytest.raises(ValueError):
        model.detokenize([model.n_vocab])
    with pytest.raises(ValueError):
        model.token_to_piece(-1)


def test_chat_template_renders_and_tokenizes_specials(model: LlamaModel) -> None:
    src = model.chat_template()
    assert src is not None and "<|im_start|>" in src
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = ChatTemplate.of_model(model).render(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = ChatTemplate.of_model(model).render(messages, add_generation_prompt=False)
    assert not no_gen.endswith("assistant\n")
    default_system = ChatTemplate.of_model(model).render([{"role": "user", "content": "x"}])
    assert default_system.startswith("<|im_start|>system\n")

    toks = model.tokenize(text, add_special=False, parse_special=True)
    im_start, im_end = 3, 4
    assert model.token_text(im_start) == "<|im_start|>"
    assert model.token_text(im_end) == "<|im_end|>"
    assert toks.count(im_start) == 3 and toks.count(im_end) == 2
    assert model.is_control(im_start) and model.is_control(im_end)
    assert model.is_eog(im_end) and model.is_eog(model.eos_token)
    assert not model.is_eog(im_start)
    # Without parse_special the marker is plain text, i.e. many ordinary tokens.
    plain = model.tokenize(text, add_special=False, parse_special=False)
    assert im_start not in plain and len(plain) > len(toks)
    assert model.detokenize(toks, render_special=True) == text
    assert model.token_to_piece(im_end) == b""
    assert model.token_to_piece(im_end, render_special=True) == b"<|im_end|>"


# --------------------------------------------------------------------------- generation


def test_context_geometry(model: LlamaModel) -> None:
    with new_ctx(model, n_ctx=512, n_seq_max=3) as c:
        assert (c.n_seq_max, c.n_ctx, c.n_ctx_total) == (3, 512, 1536)
    with new_ctx(model, n_ctx=512, n_seq_max=3, kv_unified=True) as c:
        assert (c.n_seq_max, c.n_ctx, c.n_ctx_total) == (3, 512, 512)


def test_warm_restore_into_other_sequence_matches_cold(
    ctx: LlamaContext, model: LlamaModel
) -> None:
    prompt = sample_prompt(model.tokenize, 300)
    idx = prefill(ctx, 0, prompt)
    state = ctx.state_seq_get(0)  # right after the prefill
    assert len(state) == ctx.state_seq_size(0)
    cold = generate_greedy(ctx, 0, idx, len(prompt), N_NEW)
    assert len(set(cold)) > 1, "the tiny model should not emit a constant token"

    ctx.clear()
    assert ctx.seq_pos_max(0) == -1
    warm = warm_start(ctx, 2, state, prompt)
    assert warm == cold
    assert ctx.seq_pos_max(2) == len(prompt) + N_NEW - 1


def test_greedy_depends_on_the_prompt(ctx: LlamaContext, model: LlamaModel) -> None:
    a = cold_run(ctx, 0, sample_prompt(model.tokenize, 120))
    b = cold_run(ctx, 1, sample_prompt(model.tokenize, 120, text="Lorem ipsum dolor sit. "))
    assert a != b


def test_partial_restore_then_prefill_rest_matches_cold(
    ctx: LlamaContext, model: LlamaModel
) -> None:
    prompt = sample_prompt(model.tokenize, 400)
    cold = cold_run(ctx, 0, prompt)
    ctx.clear()

    p = 256
    prefill(ctx, 1, prompt[:p])
    state = ctx.state_seq_get(1)
    ctx.clear()
    assert ctx.state_seq_set(3, state) == len(state)
    assert (ctx.seq_pos_min(3), ctx.seq_pos_max(3)) == (0, p - 1)
    idx = prefill(ctx, 3, prompt[p:], start=p)
    assert generate_greedy(ctx, 3, idx, len(prompt), N_NEW) == cold


@pytest.mark.parametrize("kv_unified", [False, True])
def test_two_sequences_in_one_batch_match_each_alone(model: LlamaModel, kv_unified: bool) -> None:
    pa = sample_prompt(model.tokenize, 150)
    pb = sample_prompt(model.tokenize, 90, text="Lorem ipsum dolor sit amet, 日本. ")
    with new_ctx(model, n_seq_max=2, kv_unified=kv_unified) as c:
        alone_a = cold_run(c, 0, pa)
        c.clear()
        alone_b = cold_run(c, 1, pb)
        c.clear()

        toks = pa + pb
        want = [False] * len(toks)
        want[len(pa) - 1] = want[-1] = True
        c.decode(
            toks, list(range(len(pa))) + list(range(len(pb))), [0] * len(pa) + [1] * len(pb), want
        )
        ia, ib = len(pa) - 1, len(toks) - 1
        out_a: list[int] = []
        out_b: list[int] = []
        for step in range(N_NEW):
            ta, tb = int(c.logits(ia).argmax()), int(c.logits(ib).argmax())
            out_a.append(ta)
            out_b.append(tb)
            c.decode([ta, tb], [len(pa) + step, len(pb) + step], [0, 1], [True, True])
            ia, ib = 0, 1
    assert out_a == alone_a
    assert out_b == alone_b


def test_state_is_portable_across_seq_count_and_unified(model: LlamaModel) -> None:
    """Split caches write one cell count per stream (= n_seq_max); states are canonicalized
    so they restore into contexts with any n_seq_max / kv_unified."""
    prompt = sample_prompt(model.tokenize, 200)
    with new_ctx(model, n_seq_max=4) as src:
        prefill(src, 3, prompt)
        state = src.state_seq_get(3)
        src.clear()
        cold = cold_run(src, 3, prompt)
    with new_ctx(model, n_seq_max=1) as one:
        prefill(one, 0, prompt)
        single = one.state_seq_get(0)
    # Identical layout from a 1-sequence and a 4-sequence context; only the source seq id
    # (in the header and in every cell) differs.
    assert len(single) == len(state)
    for kw in ({"n_seq_max": 1}, {"n_seq_max": 2}, {"n_seq_max": 3, "kv_unified": True}):
        with new_ctx(model, **kw) as dst:
            seq = dst.n_seq_max - 1
            assert warm_start(dst, seq, state, prompt) == cold, kw
    with new_ctx(model, n_seq_max=2, kv_unified=True) as uni:
        prefill(uni, 1, prompt)
        uni_state = uni.state_seq_get(1)
    with new_ctx(model, n_seq_max=4) as dst:
        assert warm_start(dst, 0, uni_state, prompt) == cold


def test_state_get_into_a_kept_buffer_equals_a_fresh_copy(model: LlamaModel) -> None:
    """Saves copy states into reused buffers (model_runtime/state/buffers.py): the same bytes, also for a
    split cache whose state is made canonical in place; a short buffer is left alone."""
    prompt = sample_prompt(model.tokenize, 120)
    for kw in ({"n_seq_max": 1}, {"n_seq_max": 3}):
        with new_ctx(model, **kw) as c:
            seq = c.n_seq_max - 1
            prefill(c, seq, prompt)
            fresh = bytes(c.state_seq_get(seq))
            buffer = np.full(c.state_seq_size(seq) + 4096, 0xAB, dtype=np.uint8)
            assert bytes(c.state_seq_get(seq, out=buffer)) == fresh, kw
            assert bytes(c.state_seq_get(seq, out=buffer)) == fresh, kw  # reused again
            short = np.zeros(100, dtype=np.uint8)
            assert bytes(c.state_seq_get(seq, out=short)) == fresh, kw
            assert not short.any()
            with pytest.raises(ValueError, match="uint8"):
                c.state_seq_get(seq, out=np.empty(len(buffer), dtype=np.float32))


def test_state_set_accepts_bytes_bytearray_memoryview(ctx: LlamaContext, model: LlamaModel) -> None:
    prompt = sample_prompt(model.tokenize, 50)
    prefill(ctx, 0, prompt)
    state = ctx.state_seq_get(0)
    for data in (state, bytearray(state), memoryview(state), memoryview(bytearray(state))):
        assert ctx.state_seq_set(1, data) == len(state)
        assert ctx.seq_pos_max(1) == len(prompt) - 1


def test_state_size_per_token(ctx: LlamaContext, model: LlamaModel) -> None:
    # 2 layers x (K + V) x 2 KV heads x 16 dims x f16 = 256 bytes of KV per token, plus
    # 12 bytes of cell metadata (position, seq count, seq id).  Fixed: 16 bytes of header
    # (magic, seq id, n_stream, cell count), v_trans + n_layer, 12 bytes per layer for K
    # (type, row size) and for V (transposed: type, element size, row width).
    prompt = sample_prompt(model.tokenize, 100)
    empty = len(ctx.state_seq_get(0))
    prefill(ctx, 0, prompt)
    size = len(ctx.state_seq_get(0))
    assert empty == 16
    assert size - empty - 8 - 2 * 2 * 12 == 268 * len(prompt)


# --------------------------------------------------------------------------- rejection


def test_garbage_state_is_rejected_without_crash(ctx: LlamaContext, model: LlamaModel) -> None:
    prompt = sample_prompt(model.tokenize, 60)
    prefill(ctx, 0, prompt)
    good = ctx.state_seq_get(0)
    prefill(ctx, 1, prompt)
    for bad in (
        b"",
        b"\x00" * 3,
        b"\x00" * 1000,
        bytes(range(256)) * 20,
        good[: len(good) // 2],
        good[:-1],
        b"\xff" * 8 + good[8:],
    ):
        assert ctx.state_seq_set(1, bad) == 0
        assert ctx.seq_pos_max(1) == -1  # a rejected restore leaves the sequence empty
    # An empty state (llama.cpp would leave the old cells) also replaces the sequence.
    prefill(ctx, 2, prompt)
    assert ctx.state_seq_set(2, ctx.state_seq_get(3)) == 16
    assert ctx.seq_pos_max(2) == -1
    # The context is still healthy.
    assert ctx.seq_pos_max(0) == len(prompt) - 1
    assert warm_start(ctx, 1, good, prompt, n_new=2)


@pytest.mark.parametrize(
    "other",
    [
        {"type_k": "q8_0"},
        {"type_v": "f32"},
        {"flash_attn": True},
    ],
)
def test_state_of_other_kv_layout_is_rejected(model: LlamaModel, other: dict) -> None:
    prompt = sample_prompt(model.tokenize, 60)
    with new_ctx(model, n_seq_max=2) as f16, new_ctx(model, n_seq_max=2, **other) as alt:
        prefill(f16, 0, prompt)
        prefill(alt, 0, prompt)
        s_f16, s_alt = f16.state_seq_get(0), alt.state_seq_get(0)
        assert f16.kv_layout() != alt.kv_layout()
        assert f16.state_seq_set(1, s_alt) == 0
        assert alt.state_seq_set(1, s_f16) == 0
        assert f16.seq_pos_max(1) == alt.seq_pos_max(1) == -1
        assert alt.state_seq_set(1, s_alt) == len(s_alt)


def test_state_of_model_with_other_layer_count_is_rejected(
    model: LlamaModel, tmp_path: Path
) -> None:
    prompt = sample_prompt(model.tokenize, 40)
    with new_ctx(model, n_seq_max=1) as c:
        prefill(c, 0, prompt)
        state = c.state_seq_get(0)
    with (
        LlamaModel(write_tiny_llama_gguf(tmp_path / "l3.gguf", n_layer=3)) as m3,
        new_ctx(m3, n_seq_max=1) as c3,
    ):
        assert c3.state_seq_set(0, state) == 0


def test_state_larger_than_capacity_is_rejected(model: LlamaModel) -> None:
    prompt = sample_prompt(model.tokenize, 300)
    with (
        new_ctx(model, n_ctx=512, n_seq_max=1) as big,
        new_ctx(model, n_ctx=256, n_seq_max=2) as small,
    ):
        prefill(big, 0, prompt)
        state = big.state_seq_get(0)
        assert small.n_ctx == 256
        assert small.state_seq_set(0, state) == 0
        assert small.seq_pos_max(0) == -1


# --------------------------------------------------------------------------- layout


def test_kv_layout(model: LlamaModel) -> None:
    with new_ctx(model) as base:
        layout = base.kv_layout()
        assert base.can_truncate_restored()
    assert layout["type_k"] == "f16" and layout["n_layer"] == "2"
    assert layout["n_head_kv"] == "2" and layout["n_embd_head_k"] == "16"
    assert layout["n_swa"] == "0" and layout["is_recurrent"] == "false"
    assert all(isinstance(v, str) for v in layout.values())
    for kw in ({"type_k": "q8_0"}, {"type_v": "f32"}, {"flash_attn": True}):
        with new_ctx(model, **kw) as c:
            assert c.kv_layout() != layout, kw
    # Settings that do not change the (canonical) state format keep the layout.
    for kw in ({"n_ctx": 512}, {"n_seq_max": 1}, {"kv_unified": True}, {"n_batch": 64}):
        with new_ctx(model, **kw) as c:
            assert c.kv_layout() == layout, kw


def test_swa_model_restored_state_must_not_be_truncated(tiny_swa_model: Path) -> None:
    with (
        LlamaModel(tiny_swa_model) as m,
        new_ctx(m, n_ctx=512, n_seq_max=2) as c,
    ):
        assert m.n_swa == 32
        assert not c.can_truncate_restored()
        assert c.kv_layout()["n_swa"] == "32"
        prompt = sample_prompt(m.tokenize, 150)
        p = 100
        cold = cold_run(c, 0, prompt)
        c.clear()
        prefill(c, 0, prompt[:p])
        state = c.state_seq_get(0)
        c.clear()
        assert c.state_seq_set(1, state) == len(state)
        # Only the last window survives a save/restore.
        assert c.seq_pos_min(1) > 0 and c.seq_pos_max(1) == p - 1
        # Extending (never truncating) a restored SWA state is exact.
        idx = prefill(c, 1, prompt[p:], start=p)
        assert generate_greedy(c, 1, idx, len(prompt), N_NEW) == cold


@pytest.mark.parametrize(("fixture", "arch", "recurrent", "hybrid"), [
    ("tiny_hybrid_model", "lfm2", False, True),
    ("tiny_recurrent_model", "mamba2", True, False),
])
def test_hybrid_and_recurrent_models_are_detected_and_never_cut(
        fixture: str, arch: str, recurrent: bool, hybrid: bool,
        request: pytest.FixtureRequest) -> None:
    import llama_cpp

    with (
        LlamaModel(request.getfixturevalue(fixture)) as m,
        new_ctx(m, n_ctx=512, n_seq_max=2) as c,
    ):
        assert m.description.startswith(arch)
        assert bool(llama_cpp.llama_model_is_recurrent(m._model)) is recurrent
        assert bool(llama_cpp.llama_model_is_hybrid(m._model)) is hybrid
        assert m.is_recurrent and m.n_swa == 0
        assert not c.can_truncate_restored()
        assert c.kv_layout()["is_recurrent"] == "true"
        prompt = sample_prompt(m.tokenize, 150)
        p = 100
        cold = cold_run(c, 0, prompt)
        c.clear()
        prefill(c, 0, prompt[:p])
        state = c.state_seq_get(0)
        # llama.cpp refuses to cut a recurrent state (the runtime never asks it to).
        assert not c.seq_truncate(0, p - 10)
        c.clear()
        assert c.state_seq_set(1, state) == len(state)
        # Extending a restored state is exact.
        idx = prefill(c, 1, prompt[p:], start=p)
        assert generate_greedy(c, 1, idx, len(prompt), N_NEW) == cold


def test_the_generator_writes_each_kind_from_the_command_line(tmp_path: Path) -> None:
    from harness.make_tiny_gguf import ARCHS, main

    for arch in ARCHS:
        out = tmp_path / f"{arch}.gguf"
        assert main([str(out), "--arch", arch]) == 0
        with LlamaModel(out) as m:
            assert m.n_vocab > 300
            assert (m.n_swa > 0) == (arch == "swa")
            assert m.is_recurrent == (arch in ("hybrid", "recurrent"))


# --------------------------------------------------------------------------- errors


def test_batch_larger_than_n_batch_is_value_error(ctx: LlamaContext) -> None:
    n = ctx.n_batch + 1
    with pytest.raises(ValueError, match="n_batch"):
        ctx.decode([5] * n, list(range(n)), [0] * n, [False] * n)


def test_malformed_batches_are_value_errors(ctx: LlamaContext, model: LlamaModel) -> None:
    with pytest.raises(ValueError):
        ctx.decode([], [], [], [])
    with pytest.raises(ValueError):
        ctx.decode([5, 6], [0], [0, 0], [False, True])
    with pytest.raises(ValueError):
        ctx.decode([5], [0], [ctx.n_seq_max], [True])
    with pytest.raises(ValueError):
        ctx.decode([model.n_vocab], [0], [0], [True])
    with pytest.raises(ValueError):
        ctx.seq_clear(-1)
    with pytest.raises(ValueError):
        ctx.state_seq_get(ctx.n_seq_max)


def test_decode_errors_raise_and_leave_context_usable(model: LlamaModel) -> None:
    with new_ctx(model, n_ctx=256, n_seq_max=2) as c:
        toks = sample_prompt(model.tokenize, 257)
        prefill(c, 0, toks[:256])
        with pytest.raises(LlamaDecodeError) as err:  # sequence 0 is full
            c.decode([toks[256]], [256], [0], [True])
        assert err.value.code == 1
        with pytest.raises(LlamaDecodeError) as err:  # position gap
            c.decode([5], [300], [0], [True])
        assert err.value.code == -1
        # Sequence 1 has its own stream, untouched by 0 being full.
        prefill(c, 1, toks[:256])
        assert c.seq_pos_max(0) == c.seq_pos_max(1) == 255
        assert c.seq_truncate(0, 10) and c.seq_pos_max(0) == 9


def test_logits_only_for_requested_rows(ctx: LlamaContext) -> None:
    ctx.decode([1, 5, 6], [0, 1, 2], [0, 0, 0], [False, True, False])
    row = ctx.logits(1)
    assert row.shape == (ctx.model.n_vocab,) and row.dtype.name == "float32"
    assert bool(np.isfinite(row).all())  # finite: no NaN, no inf
    for bad in (0, 2, 3, -1):
        with pytest.raises(IndexError):
            ctx.logits(bad)


def test_llama_logging_is_silent_by_default(
    tiny_model: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with LlamaModel(tiny_model) as m, new_ctx(m, n_seq_max=1):
        pass
    assert capfd.readouterr().err == ""
    set_llama_logging(True)
    try:
        with LlamaModel(tiny_model):
            pass
    finally:
        set_llama_logging(False)
    assert "llama_model_loader" in capfd.readouterr().err


K_QUANT_PROBE = """
import json, os, sys
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
with LlamaModel(sys.argv[1]) as model, LlamaContext(
        model, ContextParams(n_ctx=256, n_seq_max=1, n_threads=1)) as ctx:
    print(json.dumps({"alike": ctx.computes_batches_alike(),
                      "tiled": os.environ.get("GGML_CPU_TILED_MM")}))
"""


def test_k_quant_weights_give_a_token_the_same_scores_in_any_batch(tmp_path: Path) -> None:
    """llama.cpp computes K-quant products of 8 rows or more with tiled kernels and smaller
    ones otherwise, so a token's scores depend on its chunk's size: the backend turns the
    tiled kernels off unless the caller chose (each case in a process of its own, as
    llama.cpp reads the variable once)."""
    path = write_tiny_llama_gguf(tmp_path / "q4k.gguf", n_embd=256, k_quant=True)

    def probe(**env: str) -> dict[str, object]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED")}
        done = subprocess.run([sys.executable, "-c", K_QUANT_PROBE, str(path)],
                              env={**clean, **env}, capture_output=True, text=True,
                              timeout=120, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    assert probe() == {"alike": True, "tiled": "0"}
    # The caller's choice is kept; with the tiled kernels a chunk's size shows.
    assert probe(GGML_CPU_TILED_MM="1") == {"alike": False, "tiled": "1"}
    assert probe(GGML_CPU_TILED_MM_FORCE="1") == {"alike": True, "tiled": None}
