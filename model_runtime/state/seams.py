"""Where a text may be tokenized in two parts with the same tokens as in one.

llama.cpp's tokenizer first cuts a text at every special token's text
(``tokenizer_st_partition`` in src/llama-vocab.cpp: special tokens longest first, each
found left to right in the raw pieces not cut yet) and then tokenizes the raw pieces one
by one, none depending on another's text. So where the text is cut anyway, the tokens of
the whole are the tokens of what comes before followed by those of what comes after (the
latter without BOS), provided the vocabulary adds nothing at the end (EOS, SEP).

Cut at seams, a long text is also tokenized in linear time: llama.cpp's partition costs
grows with the number of special tokens times the text's length (a 30,000-message chat:
171 s whole, ~1,000x its 3,000-message tenth's cost per message; see :func:`cut_points`).

A chat's system message renders to the same text on every request; its tokens are kept,
and only what follows it needs tokenizing when :func:`is_seam` holds there (tokenizing a
1,470-token chat took 1.1 ms on a 2-core machine, its last turn alone microseconds; the
cost grows with the system prompt). Pure functions.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecialToken:
    """A token llama.cpp cuts the text at (control, user-defined or unknown)."""

    text: str
    # LSTRIP: llama.cpp drops the whitespace before it from the piece on its left, which
    # a tokenization of that piece alone would keep.
    lstrip: bool = False


def is_seam(text: str, at: int, specials: Sequence[SpecialToken]) -> bool:
    """Whether llama.cpp cuts ``text`` at ``at`` before tokenizing its pieces.

    It does when a special token's text starts there (it is found there, or a longer
    one starting there is) and no special token's text spans ``at`` (one starting
    before it and ending after it would be found first, or would swallow the start).
    Refused where a special token starting there strips the whitespace on its left.
    """
    if not 0 < at < len(text):
        return False
    starting = [s for s in specials if s.text and text.startswith(s.text, at)]
    if not starting or any(s.lstrip for s in starting):
        return False
    for special in specials:
        n = len(special.text)
        if n < 2:
            continue
        # Searched where an occurrence would start in [at - n + 1, at - 1], so end after
        # ``at``: any found spans it.
        if text.find(special.text, max(0, at - n + 1), at + n - 1) != -1:
            return False
    return True


@functools.lru_cache(maxsize=8)
def _special_pattern(texts: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def cut_points(text: str, specials: Sequence[SpecialToken], every: int) -> list[int]:
    """Seams of ``text`` (:func:`is_seam`) at least ``every`` characters apart, the first
    at or after ``every``: where it can be tokenized piece by piece with the tokens of
    the whole. Linear in the text's length (tests/runtime/test_token_seams.py)."""
    texts = tuple(sorted({s.text for s in specials if s.text}))
    if not texts or every < 1:
        return []
    pattern = _special_pattern(texts)
    cuts: list[int] = []
    at = every
    while at < len(text):
        found = pattern.search(text, at)
        if found is None:
            break
        start = found.start()
        if is_seam(text, start, specials):
            cuts.append(start)
            at = start + every
        else:
            at = start + 1
    return cuts
