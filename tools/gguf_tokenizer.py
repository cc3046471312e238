"""A Hugging Face tokenizer directory from a GGUF file, offline (for routers that tokenize
by themselves, such as vllm-router's ``VLLM_ROUTER_TOKENIZER`` or Dynamo's frontend):

    python tools/gguf_tokenizer.py MODEL.gguf OUT_DIR

The GGUF holds the vocabulary, the merges, the special tokens, the chat template and the
name of llama.cpp's pre-tokenizer; this writes them as ``tokenizer.json`` (built with the
``tokenizers`` library), ``tokenizer_config.json`` (the chat template, BOS and EOS) and
``config.json`` (what loaders ask of a model directory: vocab size, BOS/EOS ids). Byte-level
BPE vocabularies (``tokenizer.ggml.model`` gpt2) with the pre-tokenizers below are
supported; any other is refused, never approximated: a router tokenizing otherwise than
the engine would credit prefixes that are not there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) and the Hugging Face equivalent.
PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}
CONTROL = 3  # llama.cpp's token type of a control (special) token


class UnsupportedVocabulary(ValueError):
    pass


def _field(reader: GGUFReader, name: str) -> Any:
    f = reader.fields.get(name)
    if f is None:
        return None
    if f.types and f.types[0].name == "ARRAY":
        if f.types[-1].name == "STRING":
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]


def write_tokenizer_dir(gguf_path: Path, out: Path) -> Path:
    reader = GGUFReader(gguf_path)
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if kind != "gpt2" or (pre or "default") not in PRE_TOKENIZERS:
        raise UnsupportedVocabulary(
            f"{gguf_path.name}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not "
            f"supported (byte-level BPE, 'gpt2', with {', '.join(PRE_TOKENIZERS)})")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre or "default"]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == CONTROL])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), \
        _field(reader, "tokenizer.ggml.eos_token_id")
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": _field(reader, "tokenizer.chat_template"),
              "bos_token": tokens[bos] if bos is not None else None,
              "eos_token": tokens[eos] if eos is not None else None,
              "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token"))}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    arch = _field(reader, "general.architecture") or "llama"
    (out / "config.json").write_text(json.dumps({
        "model_type": arch, "vocab_size": len(tokens), "bos_token_id": bos,
        "eos_token_id": eos,
        "max_position_embeddings": _field(reader, f"{arch}.context_length")}, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        print(write_tokenizer_dir(args.gguf, args.out))
    except UnsupportedVocabulary as exc:
        parser.exit(2, f"gguf_tokenizer: {exc}\n")


if __name__ == "__main__":
    main()
