"""One request's sampler (:class:`SamplerChain`): llama.cpp's sampler chain and grammar
over a row of scores; and :func:`grammar_refusal`, llama.cpp's last word on a grammar."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp as _lc
import numpy as np

from .binding import Owner
from .errors import GrammarDeadEnd, LlamaError
from .model import LlamaModel

if TYPE_CHECKING:  # (the request's part, checked where it is made)
    from ..sampling import Sampling

__all__ = ["GRAMMAR_WALK", "TOKEN_DATA", "SamplerChain", "grammar_refusal"]

#: llama.cpp's ``llama_token_data``: a candidate's id, score (logit) and probability.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA.itemsize == ctypes.sizeof(_lc.llama_token_data)


# Greedy under a grammar: how many of the best tokens are asked one by one before every
# token is masked (the answer is nearly always among the first few; asking 128 costs
# ~0.5 ms, a mask of SmolLM2's 49k tokens ~5 ms).
GRAMMAR_WALK = 128


@functools.lru_cache(maxsize=4)
def _candidates_template(n_vocab: int) -> np.ndarray:
    """Every token as a candidate, in id order, score and probability 0 (read-only)."""
    template = np.zeros(n_vocab, dtype=TOKEN_DATA)
    template["id"] = np.arange(n_vocab, dtype=np.int32)
    template.flags.writeable = False
    return template


def grammar_refusal(model: LlamaModel, grammar: str) -> str | None:
    """Why llama.cpp refuses to make a sampler of ``grammar`` (its log lines), or None
    when it accepts it. An accepted grammar is kept compiled (``model.grammars``): the
    samplers of the request it was checked for clone it."""
    return model.grammars.compile(model._vocab_h(), grammar)


class SamplerChain(Owner):
    """One request's sampler: llama.cpp's sampler chain, and a grammar kept beside it.
    Owns both (``llama_sampler*``); :meth:`close` frees them. Not thread-safe: one thread
    samples, accepts and closes.

    The chain, made of ``sampling`` (model_runtime.sampling.Sampling), in order: logit
    bias; the repeat penalty, over a window that starts with the last ``penalty_last_n``
    tokens of ``history`` (the prompt); presence and frequency penalties over the tokens
    accepted since (generated only); then either the most likely token (``greedy``), or
    top-k, top-p, min-p, temperature and a draw from llama.cpp's generator seeded with
    ``seed`` (a uint32; None: a random one). Settings that do nothing are left out of the
    chain. The caller resolves what depends on the request: a penalty window of -1 (the
    whole context) and each choice's own seed.

    :meth:`sample` works on a row of raw scores the caller holds (the runtime keeps them
    per sequence, and an exact cache hit has them from the store): every token becomes a
    candidate (built with numpy: a copy of an id template and one strided write of the
    scores), the chain picks one. With a grammar, as llama.cpp's own
    ``common_sampler_sample`` does: the grammar checks the chosen token alone (a few µs);
    only when it refuses it are all candidates masked by the grammar (milliseconds over a
    large vocabulary) and the chain applied again. Greedy alone asks the grammar of the
    next best tokens one by one first, which finds the same token without the mask nearly
    always (:meth:`_best_allowed`). :meth:`accept` then records the token in the chain
    (penalties) and the grammar.

    llama.cpp aborts the process when its grammar is fed a token it does not allow
    (``llama_sampler_accept`` throws through C), so nothing reaches the grammar that it
    has not allowed first: :meth:`accept` checks again, and raises instead.
    """

    live = 0  #: chains made and not yet closed, in this process (tests check for leaks)

    def __init__(self, model: LlamaModel, sampling: Sampling, *, grammar: str = "",
                 grammar_active: bool = True, history: Sequence[int] = ()) -> None:
        self.model = model
        self.n_vocab = model.n_vocab
        self._chain: Any = None
        self._grammar: Any = None
        if sampling.seed is not None and not 0 <= sampling.seed < _lc.LLAMA_DEFAULT_SEED:
            raise ValueError(f"seed must be a uint32 below {_lc.LLAMA_DEFAULT_SEED:#x}")
        # (llama.cpp's default seed asks its generator for a random one.)
        seed = _lc.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed
        params = _lc.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain = _lc.llama_sampler_chain_init(params)
        SamplerChain.live += 1
        try:
            for sampler in self._samplers(sampling, seed, history):
                _lc.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it
            if grammar:  # (compiled when the request was checked: cloned, ~0.1-0.5 ms)
                self._grammar = model.grammars.clone(model._vocab_h(), grammar)
        except BaseException:
            self.close()
            raise
        #: Whether the grammar constrains the output (a lazy one starts inactive).
        self.grammar_active = bool(self._grammar) and grammar_active
        # A chain of llama.cpp's greedy sampler alone picks the first highest score, as
        # numpy's argmax does: the row is then not copied into candidates (~0.5 ms a token
        # over a 49k vocabulary, against ~0.03 ms for the argmax).
        s = sampling
        self._argmax_only = s.greedy and not s.logit_bias and not (
            s.penalty_last_n > 0 and (s.repeat_penalty != 1.0 or s.presence_penalty or
                                      s.frequency_penalty))
        self._candidates = np.empty(self.n_vocab, dtype=TOKEN_DATA)
        self._logit_column = self._candidates.view(np.float32).reshape(self.n_vocab, 3)[:, 1]
        self._array = _lc.llama_token_data_array(
            self._candidates.ctypes.data_as(_lc.llama_token_data_p), self.n_vocab, -1, False)
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        self._one_array = _lc.llama_token_data_array(
            self._one.ctypes.data_as(_lc.llama_token_data_p), 1, -1, False)

    def _samplers(self, sampling: Sampling, seed: int, history: Sequence[int]
                  ) -> Iterator[Any]:
        s, logit_bias, last_n = sampling, sampling.logit_bias, max(0, sampling.penalty_last_n)
        if logit_bias:
            biases = (_lc.llama_logit_bias * len(logit_bias))(
                *(_lc.llama_logit_bias(token, bias) for token, bias in logit_bias))
            yield _lc.llama_sampler_init_logit_bias(self.n_vocab, len(logit_bias), biases)
        if last_n and s.repeat_penalty != 1.0:
            repeat = _lc.llama_sampler_init_penalties(self.n_vocab, last_n, s.repeat_penalty,
                                                      0.0, 0.0)
            for token in history[-last_n:]:  # (before it joins the chain: prompt only)
                _lc.llama_sampler_accept(repeat, token)
            yield repeat
        if last_n and (s.presence_penalty or s.frequency_penalty):
            yield _lc.llama_sampler_init_penalties(self.n_vocab, last_n, 1.0,
                                                   s.frequency_penalty, s.presence_penalty)
        if s.greedy:  # (top-k, top-p, min-p and temperature never drop the best token)
            yield _lc.llama_sampler_init_greedy()
            return
        if s.top_k:
            yield _lc.llama_sampler_init_top_k(s.top_k)
        if s.top_p < 1.0:
            yield _lc.llama_sampler_init_top_p(s.top_p, 1)
        if s.min_p > 0.0:
            yield _lc.llama_sampler_init_min_p(s.min_p, 1)
        yield _lc.llama_sampler_init_temp(s.temperature)
        yield _lc.llama_sampler_init_dist(seed)

    @property
    def has_grammar(self) -> bool:
        return bool(self._grammar)

    def close(self) -> None:
        if self._grammar:
            _lc.llama_sampler_free(self._grammar)
        self._grammar = None
        if self._chain:
            _lc.llama_sampler_free(self._chain)
            SamplerChain.live -= 1
        self._chain = None

    def _h(self) -> Any:
        if not self._chain:
            raise LlamaError("sampler chain is closed")
        return self._chain

    # -- sampling

    def _fill(self, logits: np.ndarray, banned: Sequence[int]) -> None:
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"a row of {self.n_vocab} scores is needed, got {logits.shape}")
        np.copyto(self._candidates, _candidates_template(self.n_vocab))
        self._logit_column[...] = logits
        if banned:
            self._logit_column[np.asarray(banned, dtype=np.int64)] = -np.inf
        array = self._array
        # (llama_cpp's type hints call the field an array; its _fields_ a pointer)
        array.data = self._candidates.ctypes.data_as(  # type: ignore[assignment]
            _lc.llama_token_data_p)
        array.size, array.selected, array.sorted = self.n_vocab, -1, False

    def _apply(self, sampler: Any) -> None:
        _lc.llama_sampler_apply(sampler, ctypes.byref(self._array))

    def _selected(self, why: str) -> int:
        array = self._array
        if not 0 <= array.selected < array.size:
            raise LlamaError("the sampler chain selected no token")
        chosen = array.data[array.selected]
        if not math.isfinite(chosen.logit):  # every candidate was at -inf
            raise GrammarDeadEnd(why)
        return int(chosen.id)

    def sample(self, logits: np.ndarray, banned: Sequence[int] = ()) -> int:
        """The chain's token for ``logits`` (raw scores, one per vocabulary entry), never
        one of ``banned``; with an active grammar, one the grammar allows. Nothing is
        recorded: :meth:`accept` the token taken. Raises :class:`GrammarDeadEnd` when no
        token is allowed at all (a -inf score for every one)."""
        chain = self._h()
        if self._argmax_only:
            token = self._argmax(logits, banned)
        else:
            self._fill(logits, banned)
            self._apply(chain)
            token = self._selected("no token is allowed here (the logit bias and the "
                                   "banned tokens leave none)")
        if not self.grammar_active or self.allows(token):
            return token
        if self._argmax_only:
            best = self._best_allowed(logits, banned)
            if best is not None:
                return best
        self._fill(logits, banned)
        self._apply(self._grammar)
        self._apply(chain)
        return self._selected("the grammar allows no token here")

    def _argmax(self, logits: np.ndarray, banned: Sequence[int]) -> int:
        """What the greedy sampler alone would pick: the first highest score."""
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"a row of {self.n_vocab} scores is needed, got {logits.shape}")
        if banned:
            logits = logits.copy()
            logits[np.asarray(banned, dtype=np.int64)] = -np.inf
        token = int(np.argmax(logits))
        if not math.isfinite(float(logits[token])):
            raise GrammarDeadEnd("no token is allowed here (the banned tokens leave none)")
        return token

    def _best_allowed(self, logits: np.ndarray, banned: Sequence[int]) -> int | None:
        """Greedy under a grammar that refused the best token: the first highest score the
        grammar allows, found by asking it of the :data:`GRAMMAR_WALK` best tokens one by
        one, best first, ties by id (a few µs each), as llama.cpp's greedy sampler picks
        over the grammar's mask of every token (milliseconds). None when the answer is
        not certain among them (none allowed, or the one allowed ties with a token left
        out): the caller then masks them all."""
        row = logits
        if banned:
            row = logits.copy()
            row[np.asarray(banned, dtype=np.int64)] = -np.inf
        walk = min(GRAMMAR_WALK, self.n_vocab)
        best = np.argpartition(-row, walk - 1)[:walk]
        scores = row[best]
        floor = scores.min()
        for token in best[np.lexsort((best, -scores))]:
            score = row[token]
            if not math.isfinite(float(score)) or (score == floor and walk < self.n_vocab):
                return None  # (banned from here on, or a tie with a token not asked)
            if self._allowed_by(self._grammar, int(token)):
                return int(token)
        return None

    def allows(self, token: int) -> bool:
        """Whether the grammar (active or not) allows ``token`` next; True without one."""
        if not self._grammar:
            return True
        return self._allowed_by(self._grammar, token)

    def _allowed_by(self, grammar: Any, token: int) -> bool:
        self._one[0] = (token, 1.0, 0.0)
        one = self._one_array
        # (llama_cpp's type hints call the field an array; its _fields_ a pointer)
        one.data = self._one.ctypes.data_as(_lc.llama_token_data_p)  # type: ignore[assignment]
        one.size, one.selected, one.sorted = 1, -1, False
        _lc.llama_sampler_apply(grammar, ctypes.byref(one))
        return bool(np.isfinite(self._one["logit"][0]))

    def grammar_ended(self) -> bool:
        """Whether the active grammar is complete and lets nothing follow but an end of
        generation (a mask of every token: milliseconds; asked only where an end token was
        sampled and does not end the output by itself)."""
        if not self.grammar_active:
            return False
        self._fill(np.zeros(self.n_vocab, dtype=np.float32), ())
        self._apply(self._grammar)
        allowed = self._candidates["id"][np.isfinite(self._logit_column)]
        return all(self.model.is_eog(int(token)) for token in allowed)

    def grammar_run(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in a row from here, the active grammar allows (all of
        them without one): checked on a copy of the grammar, this one left as it is. An
        end-of-generation token ends the run (nothing follows it)."""
        end = next((i + 1 for i, t in enumerate(tokens) if self.model.is_eog(t)), len(tokens))
        if not self.grammar_active:
            return end
        copy = _lc.llama_sampler_clone(self._grammar)
        if not copy:
            raise LlamaError("llama.cpp could not copy the grammar")
        try:
            for i, token in enumerate(tokens[:end]):
                if not self._allowed_by(copy, token):
                    return i
                if i + 1 < end:  # (an end-of-generation token is never fed to it)
                    _lc.llama_sampler_accept(copy, token)
            return end
        finally:
            _lc.llama_sampler_free(copy)

    def accept(self, token: int, *, feed_grammar: bool = True) -> None:
        """Record the token taken: in the chain, and in the active grammar (which must
        allow it: checked, as llama.cpp would abort the process otherwise), unless not
        ``feed_grammar`` (:meth:`start_grammar` fed it). An end-of-generation token
        ends the output and is not fed to the grammar."""
        if feed_grammar and self.grammar_active and not self.model.is_eog(token):
            if not self.allows(token):
                raise LlamaError(f"the grammar does not allow token {token} here")
            _lc.llama_sampler_accept(self._grammar, token)
        _lc.llama_sampler_accept(self._h(), token)

    def start_grammar(self, tokens: Sequence[int]) -> bool:
        """Activate the grammar from its start with ``tokens`` as its first output (a lazy
        grammar's trigger and what followed it). False, the grammar left inactive and
        at its start, when they do not follow it."""
        if not self._grammar:
            return False
        _lc.llama_sampler_reset(self._grammar)
        for token in tokens:
            if self.model.is_eog(token) or not self.allows(token):
                _lc.llama_sampler_reset(self._grammar)
                return False
            _lc.llama_sampler_accept(self._grammar, token)
        self.grammar_active = True
        return True
