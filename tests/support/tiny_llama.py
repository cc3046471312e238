"""Helpers for tests that run real llama.cpp on the tiny generated models.

A plain module, not a conftest: ``tests/conftest.py`` (or a test file) defines the
fixtures and calls these functions, e.g.::

    @pytest.fixture(scope="session")
    def tiny_model_path(tmp_path_factory):
        return make_tiny_model(tmp_path_factory)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from harness.make_tiny_gguf import (
    write_tiny_hybrid_gguf,
    write_tiny_llama_gguf,
    write_tiny_recurrent_gguf,
    write_tiny_swa_gguf,
)

if TYPE_CHECKING:
    from model_runtime.llama_backend import LlamaContext

__all__ = [
    "generate_greedy",
    "make_tiny_hybrid_model",
    "make_tiny_model",
    "make_tiny_recurrent_model",
    "make_tiny_swa_model",
    "prefill",
    "sample_prompt",
]

SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the window. "
    "Überall grüßen Füchse; 日本語のテキストも少し。 Numbers: 3.14159, 2718, 42! "
)


def make_tiny_model(tmp_path_factory: pytest.TempPathFactory, *, seed: int = 0,
                    chat_template: str = "chatml") -> Path:
    """Write the tiny llama GGUF (2 layers, n_embd 64, ~0.5 MB) into a session temp dir,
    with one of make_tiny_gguf's chat templates (ChatML, Hermes-style tools, <think>)."""
    return write_tiny_llama_gguf(
        tmp_path_factory.mktemp("tiny_model") / f"tiny-{chat_template}-{seed}.gguf",
        seed=seed, chat_template=chat_template)


def make_tiny_swa_model(
    tmp_path_factory: pytest.TempPathFactory, *, sliding_window: int = 32
) -> Path:
    """Write a tiny sliding-window model (olmo2 architecture, 4 layers)."""
    d = tmp_path_factory.mktemp("tiny_swa_model")
    return write_tiny_swa_gguf(d / "tiny-swa.gguf", sliding_window=sliding_window, n_layer=4)


def make_tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Write a tiny hybrid model (lfm2: convolution and attention layers, 4 layers)."""
    d = tmp_path_factory.mktemp("tiny_hybrid_model")
    return write_tiny_hybrid_gguf(d / "tiny-hybrid.gguf")


def make_tiny_recurrent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Write a tiny recurrent model (mamba2, 2 layers)."""
    d = tmp_path_factory.mktemp("tiny_recurrent_model")
    return write_tiny_recurrent_gguf(d / "tiny-recurrent.gguf")


def sample_prompt(
    tokenize: Callable[[str], list[int]], n_tokens: int, text: str = SAMPLE_TEXT
) -> list[int]:
    """Exactly ``n_tokens`` tokens of repeated mixed text (BOS first, via ``tokenize``)."""
    full = text
    toks = tokenize(full)
    while len(toks) < n_tokens:
        full += text
        toks = tokenize(full)
    return toks[:n_tokens]


def prefill(ctx: LlamaContext, seq_id: int, tokens: Sequence[int], start: int = 0) -> int:
    """Decode ``tokens`` into ``seq_id`` from position ``start`` in n_batch chunks.

    Returns the batch index holding the logits of the last token (in the last decode).
    """
    n_batch = ctx.n_batch
    last = 0
    for i in range(0, len(tokens), n_batch):
        chunk = list(tokens[i : i + n_batch])
        pos = start + i
        want = [False] * len(chunk)
        if i + n_batch >= len(tokens):
            want[-1] = True
        ctx.decode(chunk, list(range(pos, pos + len(chunk))), [seq_id] * len(chunk), want)
        last = len(chunk) - 1
    return last


def generate_greedy(
    ctx: LlamaContext, seq_id: int, logits_index: int, next_pos: int, n: int
) -> list[int]:
    """``n`` greedy tokens, starting from the logits at ``logits_index`` of the last decode."""
    out: list[int] = []
    idx = logits_index
    for _ in range(n):
        tok = int(np.argmax(ctx.logits(idx)))
        out.append(tok)
        ctx.decode([tok], [next_pos], [seq_id], [True])
        next_pos += 1
        idx = 0
    return out


@contextlib.contextmanager
def saves_held(saver: Any) -> Iterator[threading.Event]:
    """Within the block, the saver's next save waits before it asks the daemon anything
    until the yielded event is set (at the latest when the block ends): a save that stays
    queued in the runtime, with the real client and daemon behind it."""
    gate = threading.Event()
    client = saver.client
    # A piece asks for its parent first; a whole state (a recurrent model's) is saved at
    # once.
    originals = {name: getattr(client, name) for name in ("lookup_before_save", "save")}

    def holding(call: Any) -> Any:
        def held(*args: Any, **kwargs: Any) -> Any:
            gate.wait(30)
            return call(*args, **kwargs)
        return held

    for name, call in originals.items():
        setattr(client, name, holding(call))
    try:
        yield gate
    finally:
        gate.set()
        for name, call in originals.items():
            setattr(client, name, call)
