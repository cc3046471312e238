"""Speculative decoding changes no token: with drafts verified in one batch, a request
gives what it gives without them, token for token and log probability for log
probability, whatever else it asks for (a grammar, n choices, penalties, stop strings,
sampling with a seed), and whatever happens to it (a ``continued`` save, cancellation).

Drafts come from a request's ``prediction`` where a test needs them on demand (the tiny
model's random text seldom repeats itself, so prompt lookup alone drafts little): a
prediction that is the reply without speculation, with a token changed, makes the
runtime verify drafts it takes and drafts it refuses. Prompt lookup and a draft model
are each exercised too. Every reuse path with speculation on is in
tests/runtime/test_determinism.py; the pure parts in tests/unit/test_speculation_drafts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from model_runtime.config import SettingError
from model_runtime.draft_model import DraftModelError
from model_runtime.request import Completion
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess
from tests.support.runtime_calls import flush
from tests.support.warm_cold import BLOCKS, outcome, prompts

Make = Callable[..., Runtime]


def reply(rt: Runtime, tokens: list[int], **kw: object) -> Completion:
    kw.setdefault("max_tokens", 24)
    done = rt.complete(tokens=tokens, logprobs=True, top_logprobs=5, timeout=60,
                       **kw)  # type: ignore[arg-type]
    assert isinstance(done, Completion)
    return done


def wrong_at(tokens: list[int], *places: int, n_vocab: int) -> list[int]:
    """``tokens`` with the token at each of ``places`` replaced by another."""
    out = list(tokens)
    for at in places:
        out[at] = (out[at] + 1) % n_vocab
    return out


def test_drafts_taken_and_refused_give_the_reply_without_speculation(
        tiny_model: Path, runtimes: Make) -> None:
    off = runtimes(tiny_model, None, speculative="off")
    on = runtimes(tiny_model, None, speculative="ngram")
    drafted = accepted = 0
    for p in prompts(off, 8, seed=4):
        cold = reply(off, p)
        guess = wrong_at(cold.tokens, len(cold.tokens) // 3, 2 * len(cold.tokens) // 3,
                         n_vocab=off.model.n_vocab)
        warm = reply(on, p, prediction=guess)
        assert outcome(warm) == outcome(cold)
        assert warm.prediction_tokens == len(guess)
        assert warm.accepted_prediction_tokens <= warm.accepted_tokens <= warm.drafted_tokens
        drafted += warm.drafted_tokens
        accepted += warm.accepted_tokens
    assert accepted > 40 and drafted > accepted, (drafted, accepted)


def test_prompt_lookup_drafts_change_no_token(tiny_model: Path, runtimes: Make) -> None:
    # No prediction: drafts by prompt lookup alone, from the prompt and the output so far
    # (a repeat penalty below 1 favours tokens seen, so the tiny model's long replies
    # come back to stretches of themselves).
    off = runtimes(tiny_model, None, speculative="off")
    on = runtimes(tiny_model, None, speculative="ngram")
    drafted = accepted = 0
    for p in prompts(off, 6, seed=5):
        cold = reply(off, p, max_tokens=100, repeat_penalty=0.5)
        warm = reply(on, p, max_tokens=100, repeat_penalty=0.5)
        assert outcome(warm) == outcome(cold)
        assert warm.prediction_tokens == 0
        drafted += warm.drafted_tokens
        accepted += warm.accepted_tokens
    assert drafted > accepted > 0, (drafted, accepted)


def test_a_request_may_turn_speculation_on_or_off_for_itself(
        tiny_model: Path, runtimes: Make) -> None:
    off = runtimes(tiny_model, None, speculative="off")
    on = runtimes(tiny_model, None, speculative="ngram")
    p = prompts(off, 1, seed=6)[0]
    cold = reply(off, p)
    assert reply(on, p, prediction=cold.tokens, speculative=False).drafted_tokens == 0
    # A prediction drafts on a runtime whose default is off; asked for, prompt lookup too.
    predicted = reply(off, p, prediction=cold.tokens)
    assert predicted.accepted_tokens > 0 and outcome(predicted) == outcome(cold)
    assert outcome(reply(off, p, speculative=True)) == outcome(cold)
    with pytest.raises(SettingError, match="speculative"):
        off.complete(tokens=p, max_tokens=2, speculative="yes")  # type: ignore[arg-type]
    with pytest.raises(SettingError, match="prediction"):
        off.complete(tokens=p, max_tokens=2, prediction=[off.model.n_vocab])


def test_a_draft_token_the_grammar_refuses_ends_the_draft(
        tiny_model: Path, runtimes: Make) -> None:
    # The prediction is the grammar's first 3 tokens, then a token the grammar refuses:
    # the 2 after the first are drafted and taken, the refused one never drafted (it
    # would be verified and refused: drafted 3, accepted 2), and the output is the
    # grammar's without speculation.
    grammar = "root ::= [a-m ]+"
    off = runtimes(tiny_model, None, speculative="off")  # the prediction drafts alone
    refused = off.tokenize("Z")[-1]
    checked = 0
    for p in prompts(off, 6, seed=7):
        cold = reply(off, p, grammar=grammar, speculative=False)
        assert cold.text.strip(" abcdefghijklm") == ""
        if len(cold.tokens) < 4:
            continue
        warm = reply(off, p, grammar=grammar, prediction=cold.tokens[:3] + [refused])
        assert outcome(warm) == outcome(cold)
        assert (warm.drafted_tokens, warm.accepted_tokens) == (2, 2)
        checked += 1
    assert checked >= 3


def test_n_choices_penalties_and_seeded_sampling_are_what_they_are_without(
        tiny_model: Path, runtimes: Make) -> None:
    off = runtimes(tiny_model, None, speculative="off")
    on = runtimes(tiny_model, None, speculative="ngram")
    sampling = {"temperature": 0.9, "seed": 11, "top_k": 40, "repeat_penalty": 1.3,
                "presence_penalty": 0.4, "frequency_penalty": 0.2}
    for p in prompts(off, 3, seed=8):
        cold = off.complete(tokens=p, max_tokens=24, logprobs=True, top_logprobs=3, n=2,
                            **sampling)  # type: ignore[arg-type]
        assert isinstance(cold, list)
        # Each choice's own reply predicted: both draft, neither changes.
        for guess_of in (0, 1):
            warm = on.complete(tokens=p, max_tokens=24, logprobs=True, top_logprobs=3,
                               n=2, prediction=cold[guess_of].tokens,
                               **sampling)  # type: ignore[arg-type]
            assert isinstance(warm, list)
            assert [outcome(c) for c in warm] == [outcome(c) for c in cold]
            assert warm[guess_of].accepted_tokens > 0
        again = on.complete(tokens=p, max_tokens=24, n=2, prediction=cold[0].tokens,
                            **sampling)  # type: ignore[arg-type]
        assert isinstance(again, list)
        assert [c.tokens for c in again] == [c.tokens for c in cold]


def test_a_stop_string_inside_a_draft_ends_the_text_where_it_would(
        tiny_model: Path, runtimes: Make) -> None:
    off = runtimes(tiny_model, None, speculative="off")
    on = runtimes(tiny_model, None, speculative="ngram")
    stopped = 0
    for p in prompts(off, 6, seed=9):
        full = reply(off, p, max_tokens=30)
        if len(full.text) < 12:
            continue
        stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
        cold = reply(off, p, max_tokens=30, stop=[stop])
        warm = reply(on, p, max_tokens=30, stop=[stop], prediction=full.tokens)
        assert outcome(warm) == outcome(cold)
        assert (warm.text, warm.finish_reason, warm.stop_sequence) == \
            (cold.text, cold.finish_reason, cold.stop_sequence) == \
            (cold.text, "stop", stop)
        # The prediction ran past the stop: nothing after it was emitted.
        assert warm.accepted_tokens > 0 and len(warm.tokens) < len(full.tokens)
        stopped += 1
    assert stopped >= 3


def test_a_continued_save_never_holds_a_draft_not_verified(
        tiny_model: Path, runtimes: Make, tmp_path: Path) -> None:
    # Saves every 4 tokens while drafts (some refused) are verified: each saved state,
    # restored by a runtime that does not speculate, continues exactly as a cold prefill
    # of its tokens does, so its cells hold those tokens and nothing drafted after them.
    d = DaemonProcess(tmp_path / "data", *BLOCKS).start()
    try:
        writer = runtimes(tiny_model, d.address, speculative="ngram", continued_interval=4)
        reader = runtimes(tiny_model, d.address, speculative="off")
        cold = runtimes(tiny_model, None, speculative="off", n_seq_max=1)
        checked = 0
        for p in prompts(cold, 4, seed=10):
            ref = reply(cold, p, max_tokens=24)
            guess = wrong_at(ref.tokens, 5, 10, 15, n_vocab=cold.model.n_vocab)
            first = reply(writer, p, max_tokens=24, prediction=guess)
            assert outcome(first) == outcome(ref)
            assert first.drafted_tokens > first.accepted_tokens > 0
            continued = [s for s in first.saves if s["reason"] == "continued"]
            assert continued, first.saves
            flush(writer)
            for save in continued:
                held = save["tokens"]  # prompt and output the saved cells hold
                assert held > len(p)
                more = p + ref.tokens[:held - len(p) + 1]
                warm = reply(reader, more, max_tokens=8)
                assert warm.cache_delta["tokens_read"] >= held, (save, warm.cache_delta)
                assert outcome(warm) == outcome(reply(cold, more, max_tokens=8))
                checked += 1
        assert checked >= 8
    finally:
        d.close()


def test_a_cancelled_speculating_request_leaves_its_sequence_clean(
        tiny_model_no_eog: Path, runtimes: Make) -> None:
    # Cut off while drafts are verified; its sequence, reused in place by the next
    # request for the same prompt, serves what a cold prefill gives, and every sequence
    # is free again (a request of n_seq_max choices runs).
    on = runtimes(tiny_model_no_eog, None, speculative="ngram", reuse_live=True)
    cold = runtimes(tiny_model_no_eog, None, speculative="off", n_seq_max=1)
    for p in prompts(cold, 3, seed=12):
        ref = reply(cold, p, max_tokens=200)
        events = on.complete(tokens=p, max_tokens=200, stream=True,
                             prediction=wrong_at(ref.tokens, 20, 60, n_vocab=cold.model.n_vocab))
        for n, _ in enumerate(events):  # type: ignore[arg-type]
            if n == 40:
                break
        events.close()  # type: ignore[union-attr]
        warm = reply(on, p, max_tokens=200)
        assert warm.cache_tier == "live"
        assert outcome(warm) == outcome(ref)
        both = on.complete(tokens=p, max_tokens=8, n=2, timeout=60)
        assert isinstance(both, list) and len(both) == 2


@pytest.fixture(scope="module")
def larger_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model's larger sibling (the same vocabulary, 6 layers of 256), which the
    tiny model can draft for: its guesses cost less than the tokens they may save."""
    from harness.make_tiny_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("larger") / "larger.gguf",
                                 n_layer=6, n_embd=256, n_head=8, n_head_kv=4)


def test_a_draft_model_changes_no_token(tiny_model: Path, larger_model: Path,
                                       runtimes: Make) -> None:
    # The tiny model drafts for its larger sibling (random weights: few of its guesses
    # are taken, and drafting stops as that is learned); the replies are those without
    # speculation, the second request of each prompt reusing its draft sequence's prefix.
    off = runtimes(larger_model, None, speculative="off")
    rt = Runtime(larger_model, config=replace(off.config, speculative="draft"),
                 draft_model_path=tiny_model)
    try:
        assert rt.draft_model is not None
        drafted = 0
        for p in prompts(off, 3, seed=13):
            for tokens in (p, p + reply(off, p).tokens[:5]):
                warm = reply(rt, tokens)
                assert outcome(warm) == outcome(reply(off, tokens))
                drafted += warm.drafted_tokens
        assert drafted > 0
    finally:
        rt.close()


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(
        tiny_model: Path, tiny_hermes_model: Path, runtimes: Make) -> None:
    draft = replace(runtimes(tiny_model, None).config, speculative="draft")
    with pytest.raises(DraftModelError, match="does not share the vocabulary .* tokens"):
        Runtime(tiny_model, config=draft, draft_model_path=tiny_hermes_model)
    with pytest.raises(SettingError, match="draft needs a draft model"):
        Runtime(tiny_model, config=draft)
