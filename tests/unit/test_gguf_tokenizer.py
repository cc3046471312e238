"""tools/gguf_tokenizer.py: a GGUF's tokenizer as a Hugging Face directory, offline. It
tokenizes as llama.cpp does (SmolLM2, slow: the real model), and a vocabulary it cannot
reproduce is refused, never approximated."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from gguf_tokenizer import UnsupportedVocabulary, write_tokenizer_dir
from tokenizers import Tokenizer


def test_a_vocabulary_it_cannot_reproduce_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedVocabulary, match="'llama'"):
        write_tokenizer_dir(tiny_model, tmp_path / "tok")
    assert not (tmp_path / "tok").exists()


@pytest.mark.slow
def test_smollm2_tokenizes_as_llama_cpp_does(tmp_path: Path) -> None:
    from model_runtime.llama_backend import LlamaModel
    from model_runtime.runtime import default_model_path

    out = write_tokenizer_dir(default_model_path(), tmp_path / "tok")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"]
    hf = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = LlamaModel(default_model_path())
    try:
        root = Path(__file__).resolve().parents[2]
        texts = [(root / "README.md").read_text()[:30_000],
                 (root / "kvcache" / "keys.py").read_text(),
                 "<|im_start|>system\nDigits 12345, 3.14; tabs\tünïcödé 日本語 🎉<|im_end|>\n"]
        rng = random.Random(7)
        pieces = ["a", " ", "  ", "\n", "1", "22", "'s", "é", "<|im_start|>", "Hello", ".",
                  "!?", "\t", "中", "<|im_end|>"]
        texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 300)))
                  for _ in range(100)]
        for text in texts:
            assert hf.encode(text, add_special_tokens=False).ids == \
                model.tokenize(text, add_special=False, parse_special=True), text[:80]
    finally:
        model.close()
