"""Sampling on llama.cpp's sampler chain, grammars and JSON schemas, with real llama.cpp.

The chain's rules are held on rows of scores made up for the purpose (what each setting
does to which token), then through the runtime on the tiny model: greedy output is the
raw scores' argmax, token by token, as it was before the chain; penalties, biases, seeds
and grammars change what they should; every chain is freed whatever ends its request.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import (
    GRAMMAR_WALK,
    ContextParams,
    GrammarDeadEnd,
    LlamaContext,
    LlamaError,
    LlamaModel,
    SamplerChain,
)
from model_runtime.request import Completion, RequestError, TokenEvent
from model_runtime.runtime import Runtime
from model_runtime.sampler import RequestSampler, chain_seed
from model_runtime.sampling import GrammarTrigger, Sampling, SamplingParams
from tests.support.tiny_llama import generate_greedy, prefill, sample_prompt

CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, prefill_chunk=128,
                       continued_interval=0, reuse_live=False)
TEXT = "the cat and the dog sat on the mat with a hat, in the end it is what it is. "

# A schema with nested objects, arrays, enums, required and optional properties.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 130},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "hat"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "home": {"type": "object",
                 "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                 "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "home"],
    "additionalProperties": False,
}


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """Enough of JSON Schema for SCHEMA: types, enums, required, additionalProperties,
    maxLength, maxItems, an integer's minimum and exclusiveMaximum."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) is not False
                     or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", math.inf)
                and all(conforms(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", math.inf)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -math.inf) <= value
                < schema.get("exclusiveMaximum", math.inf))
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"conforms() does not know {schema}")


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Iterator[LlamaModel]:
    m = LlamaModel(tiny_model)
    yield m
    m.close()


@pytest.fixture(scope="module")
def rt(tiny_model: Path) -> Iterator[Runtime]:
    with Runtime(tiny_model, cache_address=None, config=CONFIG) as runtime:
        yield runtime


@pytest.fixture
def fresh(tiny_model: Path) -> Iterator[Callable[..., Runtime]]:
    made: list[Runtime] = []

    def make(model_path: Path | None = None, **overrides: Any) -> Runtime:
        cfg = RuntimeConfig(**{**CONFIG.__dict__, **overrides})
        made.append(Runtime(model_path or tiny_model, cache_address=None, config=cfg))
        return made[-1]

    yield make
    for r in made:
        r.close()


def tok(model: LlamaModel, text: str) -> int:
    (token,) = model.tokenize(text, add_special=False, parse_special=False)
    return token


def row(model: LlamaModel, scores: dict[int, float], rest: float = -10.0) -> np.ndarray:
    out = np.full(model.n_vocab, rest, dtype=np.float32)
    for token, score in scores.items():
        out[token] = score
    return out


# --------------------------------------------------------------------------- the chain's rules


def test_each_setting_moves_the_tokens_it_should(model: LlamaModel) -> None:
    a, b, c = tok(model, "a"), tok(model, "b"), tok(model, "c")
    scores = row(model, {a: 5.0, b: 4.6, c: 4.0})

    def pick(history: Sequence[int] = (), **settings: Any) -> int:
        with SamplerChain(model, Sampling(**settings), history=history) as chain:
            return chain.sample(scores)

    assert pick() == a
    assert pick(logit_bias=((a, -math.inf),)) == b  # banned
    assert pick(logit_bias=((c, 2.0),)) == c
    # The repeat penalty covers the prompt (``history``): a's 5.0 becomes 5.0 / 2.
    assert pick(repeat_penalty=2.0, history=[a]) == b
    assert pick(repeat_penalty=2.0, history=[a], penalty_last_n=0) == a  # window 0: off
    # Presence and frequency penalties count generated tokens only, not the prompt.
    assert pick(presence_penalty=1.0, history=[a]) == a
    with SamplerChain(model, Sampling(presence_penalty=1.0)) as chain:
        chain.accept(a)
        assert chain.sample(scores) == b  # 5.0 - 1.0 < 4.6
    with SamplerChain(model, Sampling(frequency_penalty=0.3)) as chain:
        chain.accept(a)
        assert chain.sample(scores) == a  # 4.7 > 4.6
        chain.accept(a)
        assert chain.sample(scores) == b  # 4.4: per occurrence
    with SamplerChain(model, Sampling(presence_penalty=1.0, penalty_last_n=1)) as chain:
        chain.accept(a)
        chain.accept(c)  # a left the one-token window
        assert chain.sample(scores) == a
    # Truncations keep only the best here, whatever the draw.
    for settings in ({"top_k": 1}, {"min_p": 0.9}, {"top_p": 0.01}):
        for seed in range(5):
            with SamplerChain(model, Sampling(temperature=1.0, seed=seed,
                                              **settings)) as chain:
                assert chain.sample(scores) == a, settings


def test_greedy_is_the_first_best_score_as_numpy_s_argmax(model: LlamaModel) -> None:
    rng = np.random.default_rng(1)
    with SamplerChain(model, Sampling()) as chain:
        for _ in range(50):
            scores = rng.normal(size=model.n_vocab).astype(np.float32)
            scores[rng.integers(model.n_vocab, size=2)] = scores.max()  # a tie
            assert chain.sample(scores) == int(np.argmax(scores))


def test_greedy_alone_skips_the_chain_and_picks_what_the_chain_picks(
        model: LlamaModel) -> None:
    """A chain of the greedy sampler alone takes numpy's argmax without filling the
    candidates; llama.cpp's greedy sampler (reached here through a zero bias, which keeps
    the full path) picks the same token, ties and banned tokens included."""
    rng = np.random.default_rng(2)
    with SamplerChain(model, Sampling()) as fast, \
            SamplerChain(model, Sampling(logit_bias=((0, 0.0),))) as full:
        assert fast._argmax_only and not full._argmax_only
        for _ in range(50):
            scores = rng.normal(size=model.n_vocab).astype(np.float32)
            best = rng.integers(model.n_vocab, size=3)
            scores[best] = scores.max() + 1.0  # a three-way tie
            banned = [int(best[0])]
            assert fast.sample(scores) == full.sample(scores)
            assert fast.sample(scores, banned) == full.sample(scores, banned)
        with pytest.raises(GrammarDeadEnd):
            fast.sample(np.full(model.n_vocab, -np.inf, dtype=np.float32))


def test_a_draw_follows_its_seed(model: LlamaModel) -> None:
    scores = np.random.default_rng(2).normal(size=model.n_vocab).astype(np.float32)

    def draws(seed: int) -> list[int]:
        with SamplerChain(model, Sampling(temperature=1.5, seed=seed)) as chain:
            out = []
            for _ in range(30):
                out.append(chain.sample(scores))
                chain.accept(out[-1])
            return out

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5  # a draw, not the argmax
    assert chain_seed(7, 1) == chain_seed(8, 0) == 8
    assert chain_seed(2**64 - 1) == (2**64 - 1) % (2**32 - 1)
    assert 0 <= chain_seed(None) < 2**32 - 1


def test_a_grammar_masks_only_when_the_chain_s_token_is_refused(model: LlamaModel) -> None:
    a, b = tok(model, "a"), tok(model, "b")
    scores = row(model, {a: 5.0, b: 1.0})
    with SamplerChain(model, Sampling(), grammar='root ::= ("a" | "b")+') as chain:
        assert chain.sample(scores) == a
    with SamplerChain(model, Sampling(), grammar='root ::= "b" "a"') as chain:
        assert chain.sample(scores) == b  # a refused: the grammar's mask, then the chain
        chain.accept(b)
        assert chain.sample(scores) == a
        chain.accept(a)
        eog = model.eos_token
        assert chain.sample(row(model, {a: 5.0, eog: 0.0})) == eog  # complete: only the end
        with pytest.raises(LlamaError, match="does not allow"):
            chain.accept(a)  # checked: llama.cpp would abort the process


def test_greedy_under_a_grammar_asks_the_best_tokens_and_picks_what_the_mask_picks(
        model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy alone, its best token refused, asks the grammar of the next best ones one by
    one instead of masking every token, and picks what llama.cpp's greedy sampler picks
    over the mask (reached through a zero bias, which keeps the full path): ties by id,
    banned tokens skipped; an allowed token beyond the tokens asked, or one tied with a
    token not asked, falls back to the mask."""
    grammar = "root ::= [a-m]+"
    pieces = [model.token_to_piece(t) for t in range(model.n_vocab)]
    allowed = np.array([t for t, p in enumerate(pieces) if p and set(p) <= set(b"abcdefghijklm")])
    refused = np.setdiff1d(np.arange(model.n_vocab), allowed)
    assert len(allowed) > 4 and len(refused) > GRAMMAR_WALK
    rng = np.random.default_rng(3)
    masks = []
    with SamplerChain(model, Sampling(), grammar=grammar) as walk, \
            SamplerChain(model, Sampling(logit_bias=((0, 0.0),)), grammar=grammar) as full:
        assert walk._argmax_only and not full._argmax_only
        fill = walk._fill
        monkeypatch.setattr(walk, "_fill", lambda *a: (masks.append(1), fill(*a))[1])

        def check(scores: np.ndarray, banned: Sequence[int] = ()) -> int:
            got = walk.sample(scores, banned)
            assert got == full.sample(scores, banned) and got in allowed
            return got

        for _ in range(30):  # the best token refused, an allowed one a few places down
            scores = rng.normal(size=model.n_vocab).astype(np.float32)
            scores[rng.choice(refused)] = scores.max() + 1.0
            check(scores)
        assert not masks
        scores = row(model, {int(refused[0]): 9.0, **{int(t): 5.0 for t in allowed[:3]}})
        assert check(scores) == allowed[0]  # a three-way tie: the lowest id
        assert check(scores, banned=[int(allowed[0])]) == allowed[1]
        assert not masks
        # Every asked token refused: the allowed ones sit below GRAMMAR_WALK refused ones.
        scores = row(model, {**{int(t): 8.0 - i / 100 for i, t in
                                enumerate(refused[:GRAMMAR_WALK + 5])}, int(allowed[2]): 1.0})
        assert check(scores) == allowed[2] and len(masks) == 1
        # The last token asked ties with an allowed token not asked (a higher id might be
        # asked in its place): the mask decides.
        top = {int(t): 8.0 for t in refused[:GRAMMAR_WALK - 1]}
        scores = row(model, {**top, int(refused[-1]): 2.0, int(allowed[-1]): 2.0,
                             int(allowed[0]): 2.0})
        assert check(scores) == allowed[0] and len(masks) == 2


def starting_with(model: LlamaModel, prefix: bytes) -> list[int]:
    """Every token whose text starts with ``prefix`` (byte tokens included)."""
    return [t for t in range(model.n_vocab) if model.token_to_piece(t).startswith(prefix)]


def test_no_allowed_token_is_a_dead_end_not_a_guess(model: LlamaModel) -> None:
    q = tok(model, "q")
    banned = tuple((t, -math.inf) for t in starting_with(model, b"q"))
    with SamplerChain(model, Sampling(logit_bias=banned), grammar='root ::= "q"') as chain, \
            pytest.raises(GrammarDeadEnd, match="grammar allows no token"):
        chain.sample(row(model, {q: 1.0}))
    for sampling in (Sampling(), Sampling(temperature=0.7, top_k=5)):
        with SamplerChain(model, sampling) as chain, pytest.raises(GrammarDeadEnd):
            chain.sample(row(model, {}), banned=range(model.n_vocab))


def test_a_lazy_grammar_waits_for_its_trigger_and_never_takes_a_token_it_cannot_follow(
        model: LlamaModel) -> None:
    th, the, at, t = tok(model, "th"), tok(model, " the"), tok(model, "at"), tok(model, "t")
    x, bang = tok(model, "x"), tok(model, "!")
    params = SamplingParams(grammar='root ::= "t" "!"', grammar_triggers=(GrammarTrigger("t"),))
    sampler = RequestSampler(model, params, prompt=[1], choice=0, n_ctx=64)
    try:
        assert sampler.take(row(model, {x: 9.0, t: 1.0})) == x  # free text first
        assert sampler.waiting_for_trigger
        # "th" and " the" hold the trigger followed by text the grammar refuses: never
        # taken. "at" holds it at its end: the grammar starts inside it, with "t".
        assert sampler.take(row(model, {th: 10.0, the: 9.0, at: 8.0, t: 7.0})) == at
        assert not sampler.waiting_for_trigger
        assert sampler.take(row(model, {x: 9.0, bang: 1.0})) == bang  # constrained now
    finally:
        sampler.close()
    # A pattern's first capturing group marks where the grammar starts.
    params = SamplingParams(grammar='root ::= "!" [a-z]', grammar_triggers=(
        GrammarTrigger(r"x+(!)", pattern=True),))
    sampler = RequestSampler(model, params, prompt=[1], choice=0, n_ctx=64)
    try:
        assert sampler.take(row(model, {x: 9.0})) == x
        assert sampler.take(row(model, {bang: 9.0})) == bang
        assert sampler.take(row(model, {x: 1.0, tok(model, "1"): 9.0})) == x
    finally:
        sampler.close()


def test_chains_are_counted_until_closed(model: LlamaModel) -> None:
    before = SamplerChain.live
    chains = [SamplerChain(model, Sampling(), grammar='root ::= "a"') for _ in range(3)]
    assert SamplerChain.live == before + 3
    for chain in chains:
        chain.close()
        chain.close()  # twice is harmless
    assert SamplerChain.live == before
    with pytest.raises(LlamaError, match="refused the grammar"):
        SamplerChain(model, Sampling(), grammar="root ::= nothing")
    assert SamplerChain.live == before  # a failed construction frees what it made


# --------------------------------------------------------------------------- through the runtime


def test_greedy_output_is_the_raw_scores_argmax_token_by_token(
        rt: Runtime, tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as m, LlamaContext(m, ContextParams(
            n_ctx=1024, n_batch=256, n_seq_max=1, n_threads=1)) as ctx:
        for i, n in enumerate((5, 40, 130)):
            tokens = sample_prompt(m.tokenize, n, TEXT[i:] + TEXT)
            ctx.seq_clear(0)
            last = prefill(ctx, 0, tokens)
            reference = generate_greedy(ctx, 0, last, len(tokens), 24)
            done = rt.complete(tokens=tokens, max_tokens=24)
            assert isinstance(done, Completion)
            stop = next((k for k, t in enumerate(reference) if m.is_eog(t)), len(reference))
            assert done.tokens == reference[:stop]


def test_penalties_and_biases_change_the_output(rt: Runtime) -> None:
    p = sample_prompt(rt.tokenize, 30, TEXT)
    greedy = rt.complete(tokens=p, max_tokens=30)
    assert isinstance(greedy, Completion)
    same = rt.complete(tokens=p, max_tokens=30, repeat_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0, penalty_last_n=0, logit_bias={})
    assert same.tokens == greedy.tokens  # type: ignore[union-attr]
    for settings in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
                     {"repeat_penalty": 1.8, "penalty_last_n": -1},
                     {"logit_bias": {greedy.tokens[0]: -math.inf}}):
        changed = rt.complete(tokens=p, max_tokens=30, **settings)
        assert changed.tokens != greedy.tokens, settings  # type: ignore[union-attr]
    favoured = rt.tokenize("z")[-1]
    biased = rt.complete(tokens=p, max_tokens=3, logit_bias={favoured: 100})
    assert biased.tokens == [favoured] * 3  # type: ignore[union-attr]


def test_a_seed_reproduces_its_sampled_output(rt: Runtime) -> None:
    p = sample_prompt(rt.tokenize, 40, TEXT)
    kw: dict[str, Any] = {"tokens": p, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95,
                          "top_k": 40, "min_p": 0.01}
    one, two = rt.complete(seed=99, **kw), rt.complete(seed=99, **kw)
    other = rt.complete(seed=100, **kw)
    assert one.tokens == two.tokens  # type: ignore[union-attr]
    assert other.tokens != one.tokens  # type: ignore[union-attr]


def test_json_schema_output_always_parses_and_conforms(rt: Runtime) -> None:
    p = sample_prompt(rt.tokenize, 25, TEXT)
    for i, temperature in enumerate((0.0, 0.7, 1.0, 1.3)):
        for seed in range(3):
            done = rt.complete(tokens=p, max_tokens=200, json_schema=SCHEMA,
                               temperature=temperature, seed=seed + 10 * i)
            assert done.finish_reason == "stop", done.text  # type: ignore[union-attr]
            value = json.loads(done.text)  # type: ignore[union-attr]
            assert conforms(value, SCHEMA), value
            if temperature == 0.0:
                break
    obj = rt.complete(tokens=p, max_tokens=200, json_object=True, temperature=0.8, seed=4)
    assert isinstance(json.loads(obj.text), dict)  # type: ignore[union-attr]
    # A schema given as JSON text is the same schema.
    text = rt.complete(tokens=p, max_tokens=200, json_schema=json.dumps(SCHEMA))
    assert conforms(json.loads(text.text), SCHEMA)  # type: ignore[union-attr]


def test_a_grammar_that_cannot_end_finishes_with_length(rt: Runtime) -> None:
    p = sample_prompt(rt.tokenize, 20, TEXT)
    done = rt.complete(tokens=p, max_tokens=9, grammar='root ::= "ab" root')
    assert done.finish_reason == "length"  # type: ignore[union-attr]
    assert done.text == "ababababa"  # type: ignore[union-attr]
    full = rt.complete(tokens=p, until_context_full=True, grammar='root ::= "ab" root')
    assert full.finish_reason == "length"  # type: ignore[union-attr]
    assert len(p) + len(full.tokens) == rt.ctx.n_ctx  # type: ignore[union-attr]


def test_ignore_eos_goes_on_to_the_end_of_a_grammar_not_past_it(rt: Runtime) -> None:
    """With ignore_eos an end token does not end the output, except where a complete
    grammar lets nothing else follow (it would fill the output with ends); a grammar that
    may go on goes on to max_tokens."""
    p = sample_prompt(rt.tokenize, 20, TEXT)
    done = rt.complete(tokens=p, max_tokens=30, ignore_eos=True, grammar='root ::= "cat"')
    assert done.finish_reason == "stop" and done.text == "cat"  # type: ignore[union-attr]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    done = rt.complete(tokens=p, max_tokens=60, ignore_eos=True, json_schema=schema)
    assert done.finish_reason == "stop"  # type: ignore[union-attr]
    assert set(json.loads(done.text)) == {"ok"}  # type: ignore[union-attr]
    more = rt.complete(tokens=p, max_tokens=12, ignore_eos=True, grammar='root ::= [a-z ]+')
    assert more.finish_reason == "length"  # type: ignore[union-attr]
    assert len(more.tokens) == 12  # type: ignore[union-attr]
    assert not any(rt.model.is_eog(t) for t in rt.complete(  # type: ignore[union-attr]
        tokens=p, max_tokens=30, ignore_eos=True, grammar='root ::= "cat"').tokens)


def test_a_lazy_grammar_constrains_from_its_trigger_on(rt: Runtime) -> None:
    p = sample_prompt(rt.tokenize, 20, TEXT)
    free = rt.complete(tokens=p, max_tokens=40)
    pieces = [rt.model.token_to_piece(t).decode("latin-1") for t in free.tokens]  # type: ignore[union-attr]
    # The trigger: a character the greedy output first writes as a token of its own, a
    # few tokens in.
    k = next(k for k in range(3, len(pieces)) if len(pieces[k]) == 1 and pieces[k].isalpha()
             and pieces[k] not in "".join(pieces[:k]))
    trigger = pieces[k]
    done = rt.complete(tokens=p, max_tokens=40, grammar=f'root ::= "{trigger}" [0-9]{{1,3}} ">"',
                       grammar_triggers=[trigger])
    assert done.tokens[:k] == free.tokens[:k]  # type: ignore[union-attr]  # free until then
    assert re.fullmatch(re.escape(trigger) + "[0-9]{1,3}>",
                        rt.model.detokenize(done.tokens[k:]))  # type: ignore[union-attr]
    assert done.finish_reason == "stop"  # type: ignore[union-attr]


@pytest.mark.parametrize("bad, message", [
    ({"grammar": 'root ::= "a" | ( "b"'}, r"grammar is not valid GBNF: line 1, column 16"),
    ({"grammar": 'root ::= item\nitem ::= "x"{3,2}'}, r"line 2, column 13.*minimum is above"),
    ({"grammar": 'root ::= root "a"'}, r"left-recursive"),
    ({"grammar": 'start ::= "a"'}, r"no 'root' rule"),
    ({"json_schema": {"type": "objekt"}}, r"json_schema cannot be converted.*objekt"),
    ({"json_schema": "{not json"}, r"json_schema is not JSON"),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, r"json_schema cannot be converted"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, r"cannot be combined"),
    ({"grammar_triggers": ["x"]}, r"grammar_triggers need a grammar"),
    ({"grammar": 'root ::= "a"', "grammar_triggers": "<"}, r"a list of triggers"),
    ({"logit_bias": {10**6: 1.0}}, r"logit_bias token ids must be below"),
    ({"logit_bias": {5: 101.0}}, r"logit_bias values must be numbers from -100"),
    ({"min_p": 1.5}, r"min_p"), ({"repeat_penalty": 0.0}, r"repeat_penalty"),
    ({"penalty_last_n": -2}, r"penalty_last_n"),
    ({"presence_penalty": math.nan}, r"presence_penalty"),
])
def test_bad_grammars_schemas_and_settings_are_refused_and_serving_goes_on(
        fresh: Callable[..., Runtime], tiny_model_no_eog: Path, bad: dict[str, Any],
        message: str) -> None:
    rt = fresh(tiny_model_no_eog, n_ctx=2048)
    running = rt.complete(tokens=sample_prompt(rt.tokenize, 30, TEXT), max_tokens=300,
                          stream=True, grammar='root ::= [a-z ] root', temperature=0.5,
                          seed=1)
    assert isinstance(next(running), TokenEvent)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=message):
        rt.complete(tokens=sample_prompt(rt.tokenize, 20, TEXT), max_tokens=4, **bad)
    done = list(running)[-1]  # type: ignore[call-overload]
    assert isinstance(done, Completion) and done.finish_reason == "length"
    assert len(done.tokens) == 300 and re.fullmatch(r"[a-z ]+", done.text)
    stats = rt.stats()
    assert stats["internal_errors"] == 0 and stats["requests_failed"] == 0


def test_a_trigger_pattern_that_is_not_a_regular_expression_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pattern '\(' is not a regular expression"):
        GrammarTrigger("(", pattern=True)
    with pytest.raises(ValueError, match="non-empty"):
        GrammarTrigger("")


def test_a_grammar_no_token_can_continue_fails_that_request_alone(rt: Runtime) -> None:
    p = sample_prompt(rt.tokenize, 20, TEXT)
    bans = {t: -math.inf for t in starting_with(rt.model, b"q")}
    with pytest.raises(RequestError, match="grammar allows no token") as err:
        rt.complete(tokens=p, max_tokens=5, grammar='root ::= "q"', logit_bias=bans)
    assert err.value.code == "grammar_dead_end"
    assert rt.complete(tokens=p, max_tokens=3).tokens  # type: ignore[union-attr]


def test_requests_in_one_tick_keep_their_own_grammar_seed_and_temperature(
        fresh: Callable[..., Runtime]) -> None:
    rt = fresh(n_seq_max=2)
    p1, p2 = (sample_prompt(rt.tokenize, n, TEXT[k:] + TEXT) for n, k in ((30, 0), (24, 9)))
    asks: list[dict[str, Any]] = [
        {"tokens": p1, "max_tokens": 40, "grammar": 'root ::= [a-z ]+ "."', "temperature": 0.9,
         "seed": 5},
        {"tokens": p2, "max_tokens": 150, "json_schema": SCHEMA, "temperature": 1.2, "seed": 6},
    ]
    batches: list[set[int]] = []
    run = rt.engine.executor.run

    def spy(plan: Any) -> None:  # which requests each llama_decode carried
        batches.append({row.request.id for row in plan.rows if row.decode})
        run(plan)

    rt.engine.executor.run = spy  # type: ignore[method-assign]
    gate = threading.Barrier(2)

    def go(kw: dict[str, Any]) -> Completion:
        gate.wait()
        return rt.complete(**kw)  # type: ignore[return-value]

    together: dict[int, Completion] = {}
    threads = [threading.Thread(target=lambda i=i, kw=kw: together.update({i: go(kw)}))
               for i, kw in enumerate(asks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    rt.engine.executor.run = run  # type: ignore[method-assign]
    assert any(len(b) == 2 for b in batches), "the two never decoded in one batch"
    assert re.fullmatch(r"[a-z ]+\.", together[0].text), together[0].text
    assert conforms(json.loads(together[1].text), SCHEMA)
    for i, kw in enumerate(asks):  # the same seeds, one at a time: the same tokens
        assert rt.complete(**kw).tokens == together[i].tokens  # type: ignore[union-attr]


def test_every_chain_is_freed_however_its_request_ends(fresh: Callable[..., Runtime],
                                                       tiny_model_no_eog: Path) -> None:
    rt = fresh(tiny_model_no_eog, n_ctx=2048)
    p = sample_prompt(rt.tokenize, 20, TEXT)
    before = SamplerChain.live
    rt.complete(tokens=p, max_tokens=5, grammar='root ::= [a-z]+')  # finished
    stream = rt.complete(tokens=p, max_tokens=500, stream=True, temperature=1.0)
    next(stream)  # type: ignore[call-overload]
    stream.close()  # type: ignore[union-attr]  # cancelled mid-way
    with pytest.raises(RequestError):  # failed
        rt.complete(tokens=p, max_tokens=5, grammar='root ::= "q"',
                    logit_bias={t: -math.inf for t in range(rt.model.n_vocab)})
    # Still running when counted: letters can always follow (a JSON object could close
    # after a few tokens and end the request first).
    running = rt.complete(tokens=p, max_tokens=1500, stream=True, grammar='root ::= [a-z]+')
    next(running)  # type: ignore[call-overload]
    rt.engine.call(lambda: None)  # (the cancel above is handled by now)
    assert SamplerChain.live == before + 1  # the one running
    rt.close()  # ends it with "shutdown"
    assert list(running)[-1].finish_reason == "shutdown"  # type: ignore[call-overload]
    assert SamplerChain.live == before
