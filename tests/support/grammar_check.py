"""Grammars checked by llama.cpp itself (no tests here): a GBNF text parsed by its grammar
sampler, and texts fed to it token by token on the tiny model's vocabulary, the way a
constrained request samples them."""

from __future__ import annotations

import ctypes

import llama_cpp as lc

from model_runtime.llama_backend import LlamaModel


class GrammarChecker:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.vocab = lc.llama_model_get_vocab(model.handle)

    def parses(self, grammar: str) -> bool:
        sampler = lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            return False
        lc.llama_sampler_free(sampler)
        return True

    def accepts(self, grammar: str, text: str) -> bool:
        """Whether sampling under ``grammar`` can produce ``text`` and then end (an
        end-of-generation token is allowed after it)."""
        sampler = lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        assert sampler, "the grammar does not parse"
        try:
            for token in self.model.tokenize(text, add_special=False, parse_special=False):
                if not self._allowed(sampler, token):
                    return False
                lc.llama_sampler_accept(sampler, token)
            return self._allowed(sampler, self.model.eos_token)
        finally:
            lc.llama_sampler_free(sampler)

    @staticmethod
    def _allowed(sampler: lc.llama_sampler_p, token: int) -> bool:
        data = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
        array = lc.llama_token_data_array(data, 1, -1, False)
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        return bool(data[0].logit > -1e30)
