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

    from make_tiny_gguf import write_tiny_llama_gguf

:func:`write_tiny_swa_gguf` writes the same thing as a sliding-window model (architecture
``olmo2`` with ``attention.sliding_window``), for tests of the SWA restore trap.

CLI: ``python tools/make_tiny_gguf.py OUT.gguf [--seed N] [--no-chat-template]
[--chat-template chatml|hermes|think|none] [--sliding-window W]``. The ``hermes`` and
``think`` templates (tools in the Hermes style of Qwen 2.5; with ``<think>`` reasoning as
Qwen 3) add their tags to the vocabulary as user-defined tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "CHAT_TEMPLATES",
    "HERMES_TEMPLATE",
    "THINK_TEMPLATE",
    "SPECIAL_TOKENS",
    "main",
    "write_tiny_llama_gguf",
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
) -> Path:
    """Write the tiny llama model to ``path`` and return it as a Path.

    ``chat_template``: a key of :data:`CHAT_TEMPLATES` (``hermes`` and ``think`` add their
    tags to the vocabulary). Deterministic: the same arguments give a byte-identical file.
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

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"kvcache-tiny-{arch}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
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
        if arch == "llama":
            w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        # Sharp-ish attention (q, k scale 0.5) so the output depends on the context.
        w.add_tensor(p + "attn_q.weight", rand(n_embd, n_embd, scale=0.5))
        w.add_tensor(p + "attn_k.weight", rand(n_embd_kv, n_embd, scale=0.5))
        w.add_tensor(p + "attn_v.weight", rand(n_embd_kv, n_embd, scale=0.2))
        w.add_tensor(p + "attn_output.weight", rand(n_embd, n_embd, scale=0.2))
        if arch == "olmo2":  # post-norm with q/k norms instead of pre-norm
            w.add_tensor(p + "attn_q_norm.weight", ones(n_embd))
            w.add_tensor(p + "attn_k_norm.weight", ones(n_embd_kv))
            w.add_tensor(p + "post_attention_norm.weight", ones(n_embd))
        else:
            w.add_tensor(p + "ffn_norm.weight", ones(n_embd))
        w.add_tensor(p + "ffn_gate.weight", rand(n_ff, n_embd, scale=0.1))
        w.add_tensor(p + "ffn_up.weight", rand(n_ff, n_embd, scale=0.1))
        w.add_tensor(p + "ffn_down.weight", rand(n_embd, n_ff, scale=0.1))
        if arch == "olmo2":
            w.add_tensor(p + "post_ffw_norm.weight", ones(n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    w.add_tensor("output.weight", rand(n_vocab, n_embd, scale=1.0))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATES), default="chatml",
                    help="the chat template: ChatML (SmolLM2's shape), Hermes-style tools "
                         "(Qwen 2.5's shape), or tools and <think> reasoning (Qwen 3's)")
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="write the SWA variant (olmo2 architecture) with this window",
    )
    args = ap.parse_args(argv)
    common = dict(
        seed=args.seed,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        with_chat_template=not args.no_chat_template,
    )
    if args.sliding_window:
        out = write_tiny_swa_gguf(args.out, sliding_window=args.sliding_window, **common)
    else:
        out = write_tiny_llama_gguf(args.out, chat_template=args.chat_template, **common)
    print(f"{out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
