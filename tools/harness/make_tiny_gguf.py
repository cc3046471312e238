"""Write a tiny random-weight llama-architecture GGUF for fast tests.

The model is real enough for llama.cpp to load, tokenize arbitrary UTF-8, prefill, decode
and save/restore KV state, yet small enough (about 0.3 MB with the defaults) that a
2048-token prefill takes a fraction of a second on one thread.

Tokenizer: a SentencePiece-style ("llama") vocabulary with byte fallback:

* ids 0..4: ``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS), ``<|im_start|>``, ``<|im_end|>``
  (the last four are CONTROL tokens; llama.cpp marks ``<|im_end|>`` end-of-generation
  by its text);
* 256 byte tokens ``<0x00>``..``<0xFF>``, so any UTF-8 text tokenizes and round-trips;
* ``▁`` (the SentencePiece space), the printable ASCII characters and a few dozen merged
  pieces, so ordinary English does not degenerate into byte tokens.

``tokenizer.ggml.add_space_prefix`` is false, so ``detokenize(tokenize(s)) == s`` exactly.

Weights are drawn from ``numpy.random.default_rng(seed)`` in a fixed order and written as
f32; the same arguments always give a byte-identical file.  The output projection has a
large scale on purpose: it spreads the logits so that greedy argmax is not decided by
float rounding (restored vs. cold prefill must give the same greedy tokens).

Importing from tests: ``tools/`` is on pytest's ``pythonpath`` (pyproject.toml)::

    from harness.make_tiny_gguf import write_tiny_llama_gguf

:func:`write_tiny_swa_gguf` writes the same thing as a sliding-window model (architecture
``olmo2`` with ``attention.sliding_window``), for tests of the SWA restore trap.
:func:`write_tiny_hybrid_gguf` writes an attention + recurrent model (architecture ``lfm2``:
short-convolution layers, whose state is a rolling window of inputs, between attention
layers) and :func:`write_tiny_recurrent_gguf` a purely recurrent one (``mamba2``), with the
tensor names, shapes and hyperparameters of the vendored llama.cpp's model definitions
(``src/models/lfm2.cpp``, ``src/models/mamba2.cpp``). Their states cannot be cut.

CLI (``tools/make_tiny_gguf.py`` calls :func:`main`): ``python tools/make_tiny_gguf.py
OUT.gguf [--arch plain|swa|hybrid|recurrent] [--seed N] [--no-chat-template]
[--chat-template chatml|hermes|think] [--sliding-window W]``.
The ``hermes`` and ``think`` templates (tools in the Hermes style of Qwen 2.5; with
``<think>`` reasoning as Qwen 3) add their tags to the vocabulary as user-defined tokens;
they are for the plain model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "CHAT_TEMPLATES",
    "HERMES_TEMPLATE",
    "THINK_TEMPLATE",
    "SPECIAL_TOKENS",
    "main",
    "ARCHS",
    "write_tiny_hybrid_gguf",
    "write_tiny_llama_gguf",
    "write_tiny_recurrent_gguf",
    "write_tiny_swa_gguf",
]

# Same shape as SmolLM2-Instruct's template (ChatML with a default system message).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with tools in the Hermes style of Qwen 2.5 (our own wording): tools in the system
# message, calls between <tool_call> tags with the arguments written by `tojson`, tool
# results in a user turn between <tool_response> tags.
_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures, within <tools></tools>:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments "
    "within <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<arguments>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_TOOL_RESULT = (
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)
HERMES_TEMPLATE = (
    _TOOLS_SYSTEM
    + "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' "
    "+ (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    + _TOOL_RESULT
    + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The Hermes template with reasoning in the way of Qwen 3 (our own wording): an assistant
# turn after the last user message keeps its <think> block, earlier ones lose it;
# arguments given as a string are written as they are; enable_thinking=false closes an
# empty block in the generation prompt.
THINK_TEMPLATE = (
    _TOOLS_SYSTEM
    + "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- set reasoning = message.reasoning_content or '' %}"
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and reasoning %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    + _TOOL_RESULT
    + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
#: --chat-template choices: the template and the tokens it adds to the vocabulary (as
#: user-defined tokens: each one token, shown in the output, as in Qwen's vocabulary).
CHAT_TEMPLATES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "chatml": (CHATML_TEMPLATE, ()),
    "hermes": (HERMES_TEMPLATE, ("<tool_call>", "</tool_call>")),
    "think": (THINK_TEMPLATE, ("<tool_call>", "</tool_call>", "<think>", "</think>")),
    "none": (None, ()),
}

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# gguf.TokenType values (kept literal so the vocabulary is readable without the enum).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_BYTE = 1, 2, 3, 4, 6

_SPACE = "\u2581"  # SentencePiece's visible space
# Merged pieces, most preferred first (SPM merges the pair with the highest score).
_MERGES = (
    "▁t",
    "th",
    "he",
    "▁the",
    "in",
    "er",
    "an",
    "re",
    "on",
    "▁a",
    "en",
    "at",
    "ou",
    "ed",
    "nd",
    "▁s",
    "▁o",
    "ing",
    "▁w",
    "es",
    "is",
    "or",
    "it",
    "▁c",
    "▁f",
    "▁p",
    "▁b",
    "ar",
    "▁m",
    "▁to",
    "▁of",
    "▁and",
    "▁in",
    "ll",
    "le",
    "▁is",
    "as",
    "▁h",
    "st",
    "▁d",
    "ly",
    "▁that",
    "ion",
    "ent",
    "▁for",
    "▁you",
    "▁with",
    "▁it",
    "\n\n",
    "▁▁",
    "▁▁▁▁",
)


def _vocabulary(added: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    tokens: list[str] = list(SPECIAL_TOKENS)
    types: list[int] = [_TT_UNKNOWN] + [_TT_CONTROL] * (len(SPECIAL_TOKENS) - 1)
    scores: list[float] = [0.0] * len(SPECIAL_TOKENS)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(_TT_BYTE)
        scores.append(0.0)
    singles = [_SPACE, "\n"] + [chr(c) for c in range(0x21, 0x7F)]
    for ch in singles:
        tokens.append(ch)
        types.append(_TT_NORMAL)
        scores.append(-1000.0)
    for rank, piece in enumerate(_MERGES):
        assert piece not in tokens, piece
        tokens.append(piece)
        types.append(_TT_NORMAL)
        scores.append(-float(rank))
    for piece in added:
        tokens.append(piece)
        types.append(_TT_USER_DEFINED)
        scores.append(0.0)
    return tokens, scores, types


def write_tiny_llama_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 4096,
    with_chat_template: bool = True,
    chat_template: str = "chatml",
    k_quant: bool = False,
) -> Path:
    """Write the tiny llama model to ``path`` and return it as a Path.

    ``chat_template``: a key of :data:`CHAT_TEMPLATES` (``hermes`` and ``think`` add their
    tags to the vocabulary). ``k_quant``: the layers' matrices as random Q4_K blocks (the
    type of most published models, which llama.cpp's CPU backend computes with kernels of
    its own; ``n_embd`` a multiple of 256). Deterministic: the same arguments give a
    byte-identical file.
    """
    return _write(
        path,
        arch="llama",
        seed=seed,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train,
        with_chat_template=with_chat_template,
        sliding_window=0,
        chat_template=chat_template,
        k_quant=k_quant,
    )


def write_tiny_swa_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    sliding_window: int = 32,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 4096,
    with_chat_template: bool = True,
) -> Path:
    """Write a tiny *sliding-window* model (architecture ``olmo2`` with
    ``attention.sliding_window``; pattern 4: layers 0-2 of every 4 use the window).

    For tests of the SWA trap: a restored state of such a model holds only the last
    window of positions, so it must never be truncated.  Same vocabulary and template
    as :func:`write_tiny_llama_gguf`.
    """
    if sliding_window < 1:
        raise ValueError("sliding_window must be >= 1")
    return _write(
        path,
        arch="olmo2",
        seed=seed,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train,
        with_chat_template=with_chat_template,
        sliding_window=sliding_window,
    )


def write_tiny_hybrid_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 4096,
    with_chat_template: bool = True,
) -> Path:
    """Write a tiny *hybrid* model (architecture ``lfm2``): even layers are short
    convolutions (recurrent state: the last ``shortconv.l_cache - 1`` inputs), odd layers
    attention. ``llama_model_is_hybrid`` is true for it: its state is the attention
    cells followed by the recurrent state, and cannot be cut."""
    if n_layer < 2:
        raise ValueError("a hybrid model needs at least 2 layers (convolution, attention)")
    return _write(path, arch="lfm2", seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                  n_head_kv=n_head_kv, n_ctx_train=n_ctx_train,
                  with_chat_template=with_chat_template, sliding_window=0)


def write_tiny_recurrent_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ctx_train: int = 4096,
    with_chat_template: bool = True,
) -> Path:
    """Write a tiny *recurrent* model (architecture ``mamba2``, no attention at all):
    ``llama_model_is_recurrent`` is true for it; its state is one fixed-size recurrent
    state per sequence, whatever the number of tokens, and cannot be cut."""
    return _write(path, arch="mamba2", seed=seed, n_layer=n_layer, n_embd=n_embd, n_head=4,
                  n_head_kv=2, n_ctx_train=n_ctx_train,
                  with_chat_template=with_chat_template, sliding_window=0)


def _write(
    path: str | Path,
    *,
    arch: str,
    seed: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ctx_train: int,
    with_chat_template: bool,
    sliding_window: int,
    chat_template: str = "chatml",
    k_quant: bool = False,
) -> Path:
    import gguf  # imported lazily: only this tool needs it

    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, n_head by n_head_kv")
    path = Path(path)
    template, added = CHAT_TEMPLATES[chat_template]
    tokens, scores, types = _vocabulary(added)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    n_ff = 2 * n_embd
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float) -> np.ndarray:
        # numpy shape is ggml's ne reversed: a (rows, cols) array is ne = (cols, rows).
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        """A layer's matrix: f32, or random Q4_K blocks (gguf-py cannot quantize to it)."""
        if not k_quant:
            w.add_tensor(name, rand(rows, cols, scale=scale))
            return
        if cols % _QK_K:
            raise ValueError(f"Q4_K rows hold multiples of {_QK_K} values, not {cols}")
        blocks = rng.integers(0, 256, (rows, cols // _QK_K, _Q4_K_BYTES), dtype=np.uint8)
        # d and dmin (f16) so that d * scale * q - dmin * min stays within about +-scale.
        blocks[..., 0:2] = np.frombuffer(np.float16(scale / 512).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(scale / 1024).tobytes(), np.uint8)
        w.add_tensor(name, blocks.reshape(rows, -1),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_K)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"kvcache-tiny-{arch}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    # (The plain and SWA models' keys stay in this order: their files, hence their
    # fingerprints and cache namespaces, are the same as before the other kinds.)
    if arch == "mamba2":
        w.add_feed_forward_length(0)  # unused; the loader reads them (as the converter writes)
        w.add_head_count(0)
        _add_mamba2_hparams(w, n_embd)
    else:
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        if arch == "lfm2":  # per layer: 0 marks a convolution (recurrent) layer
            w.add_head_count_kv([0 if i % 2 == 0 else n_head_kv for i in range(n_layer)])
            w.add_shortconv_l_cache(_SHORTCONV_L_CACHE)
        else:
            w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if with_chat_template and template is not None:
        w.add_chat_template(template)

    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd, scale=1.0))
    for i in range(n_layer):
        p = f"blk.{i}."
        if arch == "mamba2":
            _add_mamba2_layer(w, p, n_embd, rand, ones)
            continue
        if arch in ("llama", "lfm2"):
            w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        if arch == "lfm2" and i % 2 == 0:
            # Short convolution (src/models/lfm2.cpp): conv {l_cache, n_embd},
            # in_proj {n_embd, 3 n_embd}, out_proj {n_embd, n_embd} (ggml ne order).
            w.add_tensor(p + "shortconv.conv.weight",
                         rand(n_embd, _SHORTCONV_L_CACHE, scale=0.5))
            w.add_tensor(p + "shortconv.in_proj.weight", rand(3 * n_embd, n_embd, scale=0.3))
            w.add_tensor(p + "shortconv.out_proj.weight", rand(n_embd, n_embd, scale=0.3))
        else:
            # Sharp-ish attention (q, k scale 0.5) so the output depends on the context.
            matrix(p + "attn_q.weight", n_embd, n_embd, scale=0.5)
            matrix(p + "attn_k.weight", n_embd_kv, n_embd, scale=0.5)
            matrix(p + "attn_v.weight", n_embd_kv, n_embd, scale=0.2)
            matrix(p + "attn_output.weight", n_embd, n_embd, scale=0.2)
            if arch == "lfm2":  # per-head q/k norms
                w.add_tensor(p + "attn_q_norm.weight", ones(head_dim))
                w.add_tensor(p + "attn_k_norm.weight", ones(head_dim))
        if arch == "olmo2":  # post-norm with q/k norms instead of pre-norm
            w.add_tensor(p + "attn_q_norm.weight", ones(n_embd))
            w.add_tensor(p + "attn_k_norm.weight", ones(n_embd_kv))
            w.add_tensor(p + "post_attention_norm.weight", ones(n_embd))
        else:
            w.add_tensor(p + "ffn_norm.weight", ones(n_embd))
        matrix(p + "ffn_gate.weight", n_ff, n_embd, scale=0.1)
        matrix(p + "ffn_up.weight", n_ff, n_embd, scale=0.1)
        matrix(p + "ffn_down.weight", n_embd, n_ff, scale=0.1)
        if arch == "olmo2":
            w.add_tensor(p + "post_ffw_norm.weight", ones(n_embd))
    # (LFM2's final norm is named token_embd_norm in its GGUFs: llama-arch.cpp.)
    w.add_tensor("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight",
                 ones(n_embd))
    w.add_tensor("output.weight", rand(n_vocab, n_embd, scale=1.0))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Q4_K: 256 values a block, 144 bytes (d and dmin f16, 12 bytes of scales, 128 of quants).
_QK_K, _Q4_K_BYTES = 256, 144
# LFM2's short convolution length (its real models use 3).
_SHORTCONV_L_CACHE = 3
# Mamba-2 sizes: inner 2 n_embd, heads of 16 channels, state 16, one group, kernel 4.
_MAMBA2_D_STATE, _MAMBA2_HEAD_DIM, _MAMBA2_D_CONV = 16, 16, 4


def _mamba2_sizes(n_embd: int) -> tuple[int, int, int]:
    d_inner = 2 * n_embd
    return d_inner, d_inner // _MAMBA2_HEAD_DIM, d_inner + 2 * _MAMBA2_D_STATE


def _add_mamba2_hparams(w: object, n_embd: int) -> None:
    d_inner, n_head, _ = _mamba2_sizes(n_embd)
    w.add_ssm_conv_kernel(_MAMBA2_D_CONV)  # type: ignore[attr-defined]
    w.add_ssm_inner_size(d_inner)  # type: ignore[attr-defined]
    w.add_ssm_state_size(_MAMBA2_D_STATE)  # type: ignore[attr-defined]
    w.add_ssm_time_step_rank(n_head)  # type: ignore[attr-defined]
    w.add_ssm_group_count(1)  # type: ignore[attr-defined]


def _add_mamba2_layer(w: object, p: str, n_embd: int, rand: Callable[..., np.ndarray],
                      ones: Callable[[int], np.ndarray]) -> None:
    """One Mamba-2 block as src/models/mamba2.cpp loads it (numpy shapes are ggml's ne
    reversed)."""
    d_inner, n_head, conv_dim = _mamba2_sizes(n_embd)
    add = w.add_tensor  # type: ignore[attr-defined]
    add(p + "attn_norm.weight", ones(n_embd))
    add(p + "ssm_in.weight", rand(d_inner + conv_dim + n_head, n_embd, scale=0.3))
    add(p + "ssm_conv1d.weight", rand(conv_dim, _MAMBA2_D_CONV, scale=0.5))
    add(p + "ssm_conv1d.bias", rand(conv_dim, scale=0.1))
    add(p + "ssm_dt.bias", rand(n_head, scale=0.5))
    # A = -exp(A_log) as the converter writes it: negative, so the state decays.
    add(p + "ssm_a", -np.exp(rand(n_head, 1, scale=0.5)).astype(np.float32))
    add(p + "ssm_d", ones(n_head).reshape(n_head, 1))
    add(p + "ssm_norm.weight", ones(d_inner).reshape(1, d_inner))
    add(p + "ssm_out.weight", rand(n_embd, d_inner, scale=0.3))


ARCHS = {
    "plain": write_tiny_llama_gguf,
    "swa": write_tiny_swa_gguf,
    "hybrid": write_tiny_hybrid_gguf,
    "recurrent": write_tiny_recurrent_gguf,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="plain",
                    help="plain (llama), swa (olmo2 with a sliding window), hybrid (lfm2: "
                         "attention + short convolutions), recurrent (mamba2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-layer", type=int, default=None,
                    help="layers (default 2; 4 for hybrid)")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATES), default="chatml",
                    help="the chat template: ChatML (SmolLM2's shape), Hermes-style tools "
                         "(Qwen 2.5's shape), or tools and <think> reasoning (Qwen 3's)")
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="the SWA variant's window (implies --arch swa; default 32 with --arch swa)",
    )
    args = ap.parse_args(argv)
    arch = "swa" if args.sliding_window else args.arch
    common: dict[str, object] = dict(
        seed=args.seed,
        n_embd=args.n_embd,
        with_chat_template=not args.no_chat_template,
    )
    if args.n_layer is not None:
        common["n_layer"] = args.n_layer
    if args.sliding_window:
        common["sliding_window"] = args.sliding_window
    if args.chat_template != "chatml":
        if arch != "plain":
            ap.error("--chat-template other than chatml is for --arch plain")
        common["chat_template"] = args.chat_template
    out = ARCHS[arch](args.out, **common)  # type: ignore[operator]
    print(f"{out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
