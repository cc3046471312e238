"""A request's sampler on the model thread: its llama.cpp sampler chain, made from its
:class:`~model_runtime.sampling.SamplingParams` when it gets a sequence and closed when
it ends, and the triggers of a lazy grammar.

Lazy grammars are triggered here rather than by llama.cpp's own lazy sampler
(``llama_sampler_init_grammar_lazy_patterns``), which aborts the process twice over: its
trigger patterns are compiled with ``std::regex`` inside the C call (a bad pattern throws
through C: abort), and when a trigger fires it feeds the grammar the text from the
trigger on, which throws (abort) when that text does not follow the grammar. Both were
seen on this machine. Here the grammar is started with the text from the trigger on only
where it follows it, token by token (:meth:`SamplerChain.start_grammar`); a token after
which it would not is never sampled (it is banned and the chain draws again).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .llama_backend import GrammarDeadEnd, LlamaModel, SamplerChain
from .sampling import SamplingParams

# llama.cpp's draw takes a uint32 seed, and 2**32 - 1 (LLAMA_DEFAULT_SEED) means "random".
SEED_MODULUS = 2**32 - 1
# Tokens a lazy grammar's trigger may refuse in a row before the request gives up.
MAX_TRIGGER_REFUSALS = 32


def chain_seed(seed: int | None, choice: int = 0) -> int:
    """The seed of choice ``choice``'s draw: ``(seed + choice) mod (2**32 - 1)``, or a
    random one without a seed."""
    if seed is None:
        return secrets.randbelow(SEED_MODULUS)
    return (seed + choice) % SEED_MODULUS


class RequestSampler:
    """One choice's sampler. :meth:`take` picks the next token from a row of raw scores
    and records it (penalties, grammar, trigger text); :meth:`close` frees the chain."""

    def __init__(self, model: LlamaModel, params: SamplingParams, *, prompt: Sequence[int],
                 choice: int, n_ctx: int) -> None:
        self.model = model
        lazy = bool(params.grammar_triggers)
        sampling = params.sampling
        window = n_ctx if sampling.penalty_last_n == -1 else sampling.penalty_last_n
        self.chain = SamplerChain(
            model, replace(sampling, seed=chain_seed(sampling.seed, choice),
                           penalty_last_n=window),
            grammar=params.grammar, grammar_active=not lazy, history=prompt)
        # While a lazy grammar waits: its triggers, and the output so far (its tokens and
        # their bytes, special tokens written out) to find them in.
        self._triggers = [t.regex() for t in params.grammar_triggers] if lazy else []
        self._tokens: list[int] = []
        self._starts: list[int] = []  # each token's first byte in _text
        self._text = b""

    @property
    def waiting_for_trigger(self) -> bool:
        return bool(self._triggers) and not self.chain.grammar_active

    def close(self) -> None:
        self.chain.close()

    def grammar_ended(self) -> bool:
        """Whether the grammar is complete: nothing may follow but an end of generation
        (False without one, or while a lazy one waits for its trigger)."""
        return self.chain.grammar_ended()

    def draftable(self, tokens: Sequence[int]) -> int:
        """How many of drafted ``tokens`` could follow, in a row from here: the grammar
        refusing one ends the draft before it (no token it refuses is ever sampled); an
        end-of-generation token ends it after it. (A lazy grammar waiting for its
        trigger constrains nothing yet.)"""
        return self.chain.grammar_run(tokens)

    def take(self, logits: np.ndarray) -> int:
        """The next token for ``logits``, recorded as generated. Raises
        :class:`GrammarDeadEnd` when the grammar lets no token follow."""
        if not self.waiting_for_trigger:
            token = self.chain.sample(logits)
            self.chain.accept(token)
            return token
        banned: list[int] = []
        for _ in range(MAX_TRIGGER_REFUSALS):
            token = self.chain.sample(logits, banned)
            piece = self.model.token_to_piece(token, render_special=True)
            start = self._trigger_start(self._text + piece)
            if start is None:  # no trigger yet: free text
                self.chain.accept(token)
                self._remember(token, piece)
                return token
            constrained = self._tokens_from(start, token, piece)
            if constrained is not None and self.chain.start_grammar(constrained):
                self.chain.accept(token, feed_grammar=False)  # (start_grammar fed it)
                self._tokens, self._starts, self._text = [], [], b""
                return token
            banned.append(token)  # the text from the trigger on would not follow it
        raise GrammarDeadEnd(f"{MAX_TRIGGER_REFUSALS} tokens in a row completed a trigger "
                             "with text its grammar does not allow")

    def _remember(self, token: int, piece: bytes) -> None:
        self._tokens.append(token)
        self._starts.append(len(self._text))
        self._text += piece

    def _trigger_start(self, text: bytes) -> int | None:
        """Where the earliest trigger in ``text`` starts the grammar's part: a match's
        first capturing group that matched something, else the match (llama.cpp's rule)."""
        best = None
        for regex in self._triggers:
            match = regex.search(text)
            if match is None:
                continue
            start = next((match.start(g) for g in range(1, (match.re.groups or 0) + 1)
                          if match.start(g) >= 0 and match.end(g) > match.start(g)),
                         match.start())
            best = start if best is None else min(best, start)
        return best

    def _tokens_from(self, start: int, token: int, piece: bytes) -> list[int] | None:
        """Tokens whose text is the output from byte ``start`` on, ``token`` (whose bytes
        are ``piece``) the last: the generated tokens from there, the first one cut where
        the trigger starts inside it (the rest of it tokenized again). None where that
        rest cannot be written as tokens of exactly its bytes."""
        tokens, starts = [*self._tokens, token], [*self._starts, len(self._text)]
        text = self._text + piece
        k = max(i for i, s in enumerate(starts) if s <= start)
        rest = tokens[k + 1:]
        if starts[k] == start:
            return [tokens[k], *rest]
        cut = text[start:starts[k + 1] if k + 1 < len(starts) else len(text)]
        try:
            retokenized = self.model.tokenize(cut.decode("utf-8"), add_special=False,
                                              parse_special=False)
        except UnicodeDecodeError:
            return None
        if b"".join(self.model.token_to_piece(t, render_special=True)
                    for t in retokenized) != cut:
            return None
        return [*retokenized, *rest]
