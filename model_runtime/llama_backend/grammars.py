"""Grammars compiled by llama.cpp, kept per model by their text (:class:`CompiledGrammars`).

Compiling a grammar (``llama_sampler_init_grammar``: parse, write out its repetitions,
check it) takes up to ~30 ms for one at the runtime's budget (eleven strings of 2,000
characters); cloning a compiled one takes ~0.4 ms. The runtime compiles a request's
grammar when it checks it, on the thread that received the request; each sampler made
on the model thread then clones it, so that another request's tokens never wait for a
compile. An agent sends the same tools' grammar with every turn: it is compiled once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llama_cpp as _lc

from .binding import capturing_log
from .errors import LlamaError

__all__ = ["CompiledGrammars"]

KEPT = 8  # grammars kept per model (the least recently used is freed past it)


class CompiledGrammars:
    """One model's compiled grammars (``llama_sampler*``, owned), by text. Thread-safe:
    requests are checked on several threads while the model thread clones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_text: OrderedDict[str, Any] = OrderedDict()

    def compile(self, vocab: Any, text: str) -> str | None:
        """Compile ``text`` (unless kept already): None, or why llama.cpp refuses it (its
        log lines)."""
        with self._lock:
            if text in self._by_text:
                self._by_text.move_to_end(text)
                return None
        with capturing_log() as lines:  # (outside the lock: a compile takes a while)
            sampler = _lc.llama_sampler_init_grammar(vocab, text.encode(), b"root")
        if not sampler:
            return " ".join(line.strip() for line in lines if line.strip()) or \
                "it could not parse it"
        with self._lock:
            if text in self._by_text:  # compiled meanwhile on another thread
                _lc.llama_sampler_free(sampler)
            else:
                self._by_text[text] = sampler
                while len(self._by_text) > KEPT:
                    _lc.llama_sampler_free(self._by_text.popitem(last=False)[1])
        return None

    def clone(self, vocab: Any, text: str) -> Any:
        """A new ``llama_sampler*`` of ``text`` (the caller owns it), compiled first if
        it is not kept; :class:`LlamaError` with llama.cpp's reasons if it is refused."""
        with self._lock:
            sampler = self._by_text.get(text)
            if sampler is not None:
                self._by_text.move_to_end(text)
                return _lc.llama_sampler_clone(sampler)
        refusal = self.compile(vocab, text)
        if refusal is not None:
            raise LlamaError(f"llama.cpp refused the grammar: {refusal}")
        return self.clone(vocab, text)

    def __contains__(self, text: object) -> bool:
        with self._lock:
            return text in self._by_text

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_text)

    def close(self) -> None:
        with self._lock:
            for sampler in self._by_text.values():
                _lc.llama_sampler_free(sampler)
            self._by_text.clear()
