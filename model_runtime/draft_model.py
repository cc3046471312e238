"""A draft model (``--draft-model FILE``): a smaller model of the same vocabulary that
guesses the main model's next tokens, greedily, for it to verify.

It has a context of its own with a sequence beside each of the main context's: draft
sequence ``i`` holds the tokens of the history (prompt and output) of the request last
drafted for on main sequence ``i``, and is reused by the same rule as a live sequence of
the main model: a request keeps the longest common prefix of what it holds (same tenant
only) and computes the rest, at most a prefill chunk per tick, drafting only once it has
caught up. Its KV is never saved: after a restore of the main sequence from the daemon it
computes the prompt itself. Model thread only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .llama_backend import ContextParams, LlamaContext, LlamaModel
from .request import common_prefix
from .speculation import measure_step_cost


class DraftModelError(ValueError):
    """A draft model that cannot draft for the main model (said at start-up)."""


def vocabulary_mismatch(main: LlamaModel, draft: LlamaModel) -> str | None:
    """Why ``draft``'s vocabulary is not ``main``'s (its tokens must be the same ids of
    the same texts, or its guesses mean other tokens), or None when it is."""
    if main.n_vocab != draft.n_vocab:
        return f"it has {draft.n_vocab} tokens, the model {main.n_vocab}"
    for token in range(main.n_vocab):
        a, b = main.token_text(token), draft.token_text(token)
        if a != b:
            return f"token {token} is {b!r} there and {a!r} in the model"
    return None


@dataclass
class DraftJob:
    """One request's draft this tick: its main sequence, its tenant, its history (prompt,
    output, the pending token last) and how many tokens to draft."""

    seq_id: int
    tenant: str
    history: Sequence[int]
    n: int


class DraftModel:
    def __init__(self, path: str | os.PathLike[str], main: LlamaContext, *,
                 verbose: bool = False) -> None:
        self.model = LlamaModel(path, verbose=verbose)
        try:
            why = vocabulary_mismatch(main.model, self.model)
            if why is not None:
                raise DraftModelError(f"the draft model {self.model.path.name} does not share "
                                      f"the vocabulary of {main.model.path.name}: {why}")
            p = main.params
            self.ctx = LlamaContext(self.model, ContextParams(
                n_ctx=main.n_ctx, n_batch=p.n_batch, n_ubatch=p.n_ubatch,
                n_seq_max=main.n_seq_max, n_threads=p.n_threads))
        except BaseException:
            self.model.close()
            raise
        if not self.ctx.can_truncate_restored():
            self.close()
            raise DraftModelError(f"the draft model {path} keeps a state that cannot be cut "
                                  "(sliding-window or recurrent): its rejected guesses could "
                                  "not be taken out; use a plain-attention model")
        self.tokens: list[list[int]] = [[] for _ in range(self.ctx.n_seq_max)]
        self.tenants = [""] * self.ctx.n_seq_max
        seq = self.ctx.n_seq_max - 1
        cost = measure_step_cost(
            lambda n, at: self.ctx.decode([1] * n, list(range(at, at + n)), [seq] * n,
                                          [i == n - 1 for i in range(n)]),
            lambda keep: self._cut(seq, keep))
        #: What one guess of one request costs (a decode of one token).
        self.step_ms = cost.fixed_ms + cost.per_token_ms

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def _cut(self, seq: int, keep: int) -> None:
        if not self.ctx.seq_truncate(seq, keep):
            self.ctx.seq_clear(seq)
            keep = 0
        del self.tokens[seq][keep:]

    def catch_up(self, job: DraftJob, budget: int) -> bool:
        """Make the job's draft sequence hold its history but the last token, computing
        at most ``budget`` tokens now. True when it does."""
        seq, want = job.seq_id, job.history[:-1]
        if self.tenants[seq] != job.tenant:
            self._cut(seq, 0)
            self.tenants[seq] = job.tenant
        self._cut(seq, common_prefix(self.tokens[seq], want))
        have = len(self.tokens[seq])
        todo = list(want[have:have + min(budget, self.ctx.n_batch)])
        if todo:
            self.ctx.decode(todo, list(range(have, have + len(todo))), [seq] * len(todo),
                            [False] * len(todo))
            self.tokens[seq].extend(todo)
        return len(self.tokens[seq]) == len(want)

    def draft(self, jobs: Sequence[DraftJob]) -> list[list[int]]:
        """Each job's greedy guesses (its sequence caught up), one batched decode per
        guessed place: the model's most likely token after the history, then after that
        one, and so on."""
        out: list[list[int]] = [[] for _ in jobs]
        feed = [job.history[-1] for job in jobs]
        for step in range(max((job.n for job in jobs), default=0)):
            active = [i for i, job in enumerate(jobs) if job.n > step]
            seqs = [jobs[i].seq_id for i in active]
            self.ctx.decode([feed[i] for i in active], [len(self.tokens[s]) for s in seqs],
                            seqs, [True] * len(active))
            for row, (i, seq) in enumerate(zip(active, seqs, strict=True)):
                self.tokens[seq].append(feed[i])
                guess = int(np.argmax(self.ctx.logits(row)))
                out[i].append(guess)
                feed[i] = guess
        return out
