"""Where a request's draft tokens come from, without a model: prompt lookup and a
client's prediction of the output. Pure functions and small types over token ids.

*Prompt lookup*: an agent's output copies its context (a code edit repeats the file, a
tool call quotes a tool's output, JSON mirrors its schema), so where the last tokens of
prompt and output so far occurred before, what followed them then is a good guess of
what follows now. :class:`NgramTable` finds every earlier place of the last
:data:`KEY_TOKENS` tokens in O(1) (a dict of n-gram -> the places after its latest
occurrences, filled as tokens arrive); of those places the one that agrees with the
history furthest back wins (its *match*, in tokens), the most recent on a tie.
llama.cpp's ``ngram-simple`` drafts the same way with a linear scan for a 12-token
pattern; a table keeps each lookup O(1) over a prompt of any length, and the match
length it measures lets the caller draft only where the history agrees long enough.

*Prediction* (OpenAI's ``prediction``): the client's guess of the whole output. While
the output so far is the prediction's beginning, the prediction's next tokens are the
draft; once they part (an edit), the prediction is searched like the prompt, so the
draft picks up where the output rejoins it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Tokens of the n-gram a lookup starts from. Two keep the table small and still find a
#: copy one token after it starts; the match measured backward from there decides.
KEY_TOKENS = 2
#: Places kept per n-gram (its latest occurrences): a common n-gram ("\n    ") occurs
#: hundreds of times; the latest few are where a copy in progress is.
PLACES_PER_KEY = 4
#: How far back a match is measured: beyond it, longer agreement says no more.
MAX_MATCH = 32


#: Where a draft came from (each has its own acceptance statistics).
NGRAM, PREDICTION, MODEL = "ngram", "prediction", "model"


@dataclass(frozen=True)
class Draft:
    """Tokens guessed to follow the history; ``match``: how many tokens of history agree
    with the place they were copied from (the guess's support; for a draft model's, 0)."""

    tokens: tuple[int, ...]
    match: int
    source: str = NGRAM


NO_DRAFT = Draft((), 0)


class NgramTable:
    """Where each :data:`KEY_TOKENS`-gram of a token list occurred: the n-gram -> the
    positions of the tokens that followed its latest occurrences (oldest first). Only
    positions from ``start`` on are indexed (a prompt's table is shared by the choices of
    a request; each choice indexes its own output in a table of its own)."""

    def __init__(self, tokens: Sequence[int], start: int = 0, end: int | None = None) -> None:
        self.places: dict[tuple[int, ...], list[int]] = {}
        self.indexed = max(start, KEY_TOKENS)  # positions below this are not indexed
        self.add(tokens, len(tokens) if end is None else end)

    def add(self, tokens: Sequence[int], end: int) -> None:
        """Index the positions up to ``end`` (exclusive): position ``e`` is filed under the
        n-gram that ends right before it, so the n-gram ending the history is found only
        once a token follows it (a lookup never finds the history's own end)."""
        places = self.places
        for e in range(self.indexed, end):
            key = tuple(tokens[e - KEY_TOKENS:e])
            found = places.get(key)
            if found is None:
                places[key] = [e]
            else:
                found.append(e)
                if len(found) > PLACES_PER_KEY:
                    del found[0]
        self.indexed = max(self.indexed, end)


def match_length(source: Sequence[int], at: int, history: Sequence[int], limit: int) -> int:
    """How many tokens before ``source[at]`` equal the last tokens of ``history``
    (at most ``limit``)."""
    n = 0
    top = min(limit, at, len(history))
    while n < top and source[at - 1 - n] == history[-1 - n]:
        n += 1
    return n


def best_place(places: Sequence[int], source: Sequence[int], history: Sequence[int]
               ) -> tuple[int, int]:
    """Of ``places`` (positions in ``source``, oldest first), the one whose preceding
    tokens agree with the history's end the longest, most recent on a tie: (place,
    match), or (-1, 0)."""
    best, best_match = -1, 0
    for at in reversed(places):
        n = match_length(source, at, history, MAX_MATCH)
        if n > best_match:
            best, best_match = at, n
    return best, best_match


class Lookup:
    """One choice's drafts without a model: prompt lookup over its history (the prompt,
    whose table every choice of the request shares, then the choice's output, indexed as
    it grows) when ``ngrams``, and the client's prediction when one was given."""

    def __init__(self, prompt_table: NgramTable, history: list[int], n_prompt: int, *,
                 prediction: Prediction | None = None, ngrams: bool = True) -> None:
        self.prompt_table = prompt_table
        self.history = history  # prompt, then output (the pending token included)
        self.n_prompt = n_prompt
        self.own = NgramTable(history, start=n_prompt)
        self.prediction = prediction
        self.ngrams = ngrams
        # Whether the output so far is the prediction's beginning.
        self.on_prediction = prediction is not None

    @classmethod
    def of_prompt(cls, prompt: Sequence[int], *, prediction: Sequence[int] = (),
                  ngrams: bool = True) -> Lookup:
        return cls(NgramTable(prompt) if ngrams else NgramTable(()), list(prompt),
                   len(prompt), prediction=Prediction(list(prediction)) if prediction
                   else None, ngrams=ngrams)

    def fork(self) -> Lookup:
        """Another choice of the same prompt: the tables of prompt and prediction shared,
        no output."""
        return Lookup(self.prompt_table, self.history[:self.n_prompt], self.n_prompt,
                      prediction=self.prediction, ngrams=self.ngrams)

    @property
    def n_output(self) -> int:
        return len(self.history) - self.n_prompt

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the output gained (the pending token, accepted drafts)."""
        if self.on_prediction:
            assert self.prediction is not None
            start = self.n_output
            self.on_prediction = list(tokens) == self.prediction.tokens[start:start +
                                                                        len(tokens)]
        self.history.extend(tokens)
        if self.ngrams:  # (the last token is indexed with the next: see NgramTable.add)
            self.own.add(self.history, len(self.history) - 1)

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens: the prediction's next ones while the output is its
        beginning (the match: the whole output); else those after the best earlier place
        of the history's end, in the prediction, the output (a later copy of the same
        text is likelier to go on as the output does) or the prompt, where the history
        agrees with it the longest (the prediction on a tie)."""
        history = self.history
        if k <= 0 or len(history) <= KEY_TOKENS:
            return NO_DRAFT
        pred = self.prediction
        if pred is not None and self.on_prediction and self.n_output < len(pred.tokens):
            n = self.n_output
            return Draft(tuple(pred.tokens[n:n + k]), n, PREDICTION)
        key = tuple(history[-KEY_TOKENS:])
        best = NO_DRAFT
        if pred is not None:
            at, match = best_place(pred.table.places.get(key, ()), pred.tokens, history)
            if at >= 0:
                best = Draft(tuple(pred.tokens[at:at + k]), match, PREDICTION)
        if self.ngrams:
            for table in (self.own, self.prompt_table):
                at, match = best_place(table.places.get(key, ()), history, history)
                if match > best.match:
                    # (Never past the history's end: a place just behind it drafts what
                    # follows it.)
                    best = Draft(tuple(history[at:min(at + k, len(history))]), match)
        return best


class Prediction:
    """A client's prediction of the output, tokenized, with its n-gram table."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.table = NgramTable(tokens)
