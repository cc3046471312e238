"""Grammars are checked before a request is queued: GBNF read by llama.cpp's rules, with
the line and column of what failed, and JSON Schema converted by llama.cpp's converter.

Each grammar below is also compiled by llama.cpp itself (the tiny model's vocabulary):
what the check lets through, llama.cpp accepts; what llama.cpp refuses, the check
refuses with a reason. The check refuses a few grammars llama.cpp would take and then
hang on or misuse (``{2,1}`` loops forever in llama.cpp; those are not compiled here).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_runtime.grammar import (
    GrammarError,
    check_gbnf,
    check_grammar,
    grammar_of,
    json_schema_grammar,
)
from model_runtime.llama_backend import LlamaError, LlamaModel, SamplerChain, grammar_refusal
from model_runtime.llama_backend.grammars import KEPT
from model_runtime.sampling import Sampling
from model_runtime.schema_converter import integer_range


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Iterator[LlamaModel]:
    m = LlamaModel(tiny_model)
    yield m
    m.close()


VALID = [
    'root ::= "a"',
    'root ::= "a" | ',  # an empty alternative
    "root ::= ",
    "root ::= [^]",
    "root ::= .",
    'root ::= "a"\n\nroot ::= "b"',  # defined twice: the last one counts
    'root ::= "a" "b"*{3}',
    'root ::= "\\u00e9" [\\x41-\\x5A] "\\t\\r\\n\\\\\\"\\[\\]\\-"',
    'root ::= ("a"{40}){60}',
    'root ::= ( "a"\n | "b" )  # newlines inside parentheses',
    "root ::= <[5]> !<[6]> <|im_end|>",
    'root ::= "a" root',  # right recursion: endless, but fine
    '  root ::= "a"  \r\n',
    'root::="a"',
    'root ::= "日本" [あ-ん]+',
]

# (grammar, where and what) — the message must say both.
INVALID = [
    ('expr ::= "a"', "no 'root' rule"),
    ('root ::= root "a" | "b"', "line 1, column 1 .*'root' is left-recursive"),
    ('root ::= x\nx ::= "c"? root', "'root' is left-recursive"),
    ('root ::= x\nx ::= y?\ny ::= x "a"', "line 2, column 1 .*'x' is left-recursive"),
    ('root ::= "a"* root', "left-recursive"),
    ("root ::= [a-", "column 12 .*unexpected end of input in a range"),
    ('root ::= "abc', "column 14.*end of input inside a literal"),
    ('root ::= "\\q"', "column 11 .*unknown escape \\\\q"),
    ('root ::= "\\x4"', "expecting 2 hex digits after \\\\x"),
    ('root ::= "a"{3000}', "at least 3000 exceeds llama.cpp's limit of 2000"),
    ('root ::= ( "a" ', "column 10 .*this \\( is never closed"),
    ('root ::= "a" ) ', "column 14 .*expecting a newline or the end"),
    ("root ::= x", "column 10 .*undefined rule 'x'"),
    ('root ::= "a" # comment\n  | "b"', "line 2, column 3 .*expecting a rule name"),
    ('root ::= "a" ::= "b"', "expecting a newline or the end"),
    ('root := "a"', "column 6 .*expecting ::= after the rule name 'root'"),
    ("root ::= <nosuch>", "'<nosuch>' is not one token"),
    ('root ::= * "a"', "\\* repeats nothing"),
    ('root ::= "a"{x}', "expecting a number after \\{"),
    ('root ::= "a"{2', "expecting \\} to close"),
]

# Refused here although llama.cpp takes them: it would hang, run out of memory, read a
# shorter grammar than given, or wait for a token that does not exist.
REFUSED_BEFORE_LLAMA = [
    ("root ::= <[999999]>", "token id 999999 is outside the vocabulary \\(0 to 99\\)"),
    ('root ::= "a"{2,1}', "repetition \\{2,1\\}: the minimum is above the maximum"),
    ('root ::= "ab"{2000}{2000}', "expands to 8000001 symbols"),
    # llama.cpp reads a maximum above 2000 as none: "a"{0,3000} would take 5000 a's.
    ('root ::= x\nx ::= "a"{0,3000}', "at most 3000 exceeds llama.cpp's limit of 2000"),
    ('root ::= "a"{0,100000000}', "at most 100000000 exceeds"),
    ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "parentheses nest deeper than 64"),
    ('root ::= "a"\x00"b"', "a NUL character"),
]


@pytest.mark.parametrize("grammar", VALID)
def test_what_the_check_lets_through_llama_cpp_accepts(model: LlamaModel, grammar: str) -> None:
    check_grammar(model, grammar)
    assert grammar_refusal(model, grammar) is None


@pytest.mark.parametrize("grammar, message", INVALID)
def test_what_llama_cpp_refuses_the_check_refuses_saying_where_and_why(
        model: LlamaModel, grammar: str, message: str) -> None:
    assert grammar_refusal(model, grammar) is not None
    with pytest.raises(GrammarError, match=message):
        check_grammar(model, grammar)


@pytest.mark.parametrize("grammar, message", REFUSED_BEFORE_LLAMA)
def test_grammars_llama_cpp_cannot_serve_are_refused_before_it_sees_them(
        grammar: str, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        check_gbnf(grammar, n_vocab=100)


def test_a_checked_grammar_is_compiled_once_then_cloned_by_its_samplers(
        model: LlamaModel) -> None:
    """The check compiles (off the model thread); samplers clone what it compiled, so
    the model thread never waits for a compile; the least recently used go past KEPT."""
    grammars = [f'root ::= "g{i}" [a-z]{{0,50}}' for i in range(KEPT + 1)]
    check_grammar(model, grammars[0])
    assert grammars[0] in model.grammars
    chains = [SamplerChain(model, Sampling(), grammar=grammars[0]) for _ in range(2)]
    try:
        assert all(chain.has_grammar for chain in chains)
    finally:
        for chain in chains:
            chain.close()
    for grammar in grammars[1:]:
        check_grammar(model, grammar)
    assert grammars[0] not in model.grammars and len(model.grammars) == KEPT
    with SamplerChain(model, Sampling(), grammar=grammars[0]) as chain:  # compiled again
        assert chain.has_grammar
    with pytest.raises(LlamaError, match="refused the grammar"):
        SamplerChain(model, Sampling(), grammar='root ::= "a" (')


def test_llama_cpp_s_own_reasons_are_captured(model: LlamaModel) -> None:
    assert "left recursion" in (grammar_refusal(model, 'root ::= root "a"') or "")
    assert "root" in (grammar_refusal(model, 'item ::= "a"') or "")


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "where": {"type": "object", "properties": {"x": {"type": "number"}},
                  "required": ["x"]},
        "note": {"type": "string"},
    },
    "required": ["id", "where"],
    "additionalProperties": False,
}


def test_a_json_schema_becomes_a_grammar_llama_cpp_accepts(model: LlamaModel) -> None:
    gbnf = json_schema_grammar(SCHEMA)
    check_grammar(model, gbnf)
    assert json_schema_grammar(json.dumps(SCHEMA)) == gbnf
    assert grammar_of("", SCHEMA, False) == gbnf
    # JSON strings: no control characters, nothing that is not UTF-8.
    (char,) = [line for line in gbnf.splitlines() if line.startswith("char ::=")]
    assert "\\x00-\\x1F" in char and "\\uD800-\\uDFFF" in char
    embedded = json_schema_grammar(SCHEMA, name="call")
    check_grammar(model, f'root ::= "<tool_call>" call "</tool_call>"\n{embedded}')
    check_grammar(model, grammar_of("", None, True))  # json_object


def test_a_schema_s_grammar_lets_json_be_written_indented_as_llama_cpp_s_does(
        model: LlamaModel) -> None:
    """Whitespace between a JSON value's parts is llama.cpp's: a space, or newlines and
    an indent (of at most 20), so a model writing its JSON indented is let write it so
    (the port the converter comes from allowed one space only)."""
    def allowed(text: str) -> bool:
        tokens = model.tokenize(text, add_special=False, parse_special=False)
        with SamplerChain(model, Sampling(), grammar=json_schema_grammar(SCHEMA)) as chain:
            return chain.grammar_run(tokens) == len(tokens)

    assert allowed('{"id": 1, "where": {"x": 2}}')
    assert allowed('{\n  "id": 1,\n  "where": {\n    "x": 2\n  }\n}')
    assert allowed('{\n\n\t"id" : 1 , "where": {"x": 2}}')
    assert not allowed('{\n\n\n"id": 1')  # three newlines
    assert not allowed('{' + ' ' * 22 + '"id": 1')  # an indent of more than 20


@pytest.mark.parametrize("least, greatest", [
    (lo, hi) for lo in (None, -1000, -101, -100, -20, -9, -1, 0, 1, 9, 10, 99, 100, 347, 1000)
    for hi in (None, -100, -99, -10, -1, 0, 7, 9, 10, 19, 100, 101, 999, 12345)
    if lo is None or hi is None or lo <= hi])
def test_an_integer_range_is_exactly_the_integers_between_its_bounds(
        least: int | None, greatest: int | None) -> None:
    """Every integer from -1,500 to 1,500 (and a few of 15 and 16 digits) matches the
    range's expression where it lies between the bounds and nowhere else; no leading
    zeros, no -0. (Digits, "-", classes and counts only: read as a regular expression.)"""
    pattern = re.compile(integer_range(least, greatest).replace('"', "").replace(" ", ""))
    for n in [*range(-1500, 1501), 10**15, -(10**15), 9 * 10**15, 10**16]:
        inside = (least is None or n >= least) and (greatest is None or n <= greatest)
        assert bool(pattern.fullmatch(str(n))) == (inside and n < 10**16), n
    assert not any(pattern.fullmatch(text) for text in ("-0", "01", "-01", "007", ""))


def test_an_integer_range_beyond_sixteen_digits_is_still_one() -> None:
    for least, greatest in ((10**17, None), (None, -(10**17)), (3, 10**20), (10**17 + 5,
                                                                         10**17 + 5)):
        pattern = re.compile(integer_range(least, greatest).replace('"', "").replace(" ", ""))
        for n in (least, greatest):
            if n is not None:
                assert pattern.fullmatch(str(n)) and not pattern.fullmatch(str(n + (
                    -1 if n == least else 1)))


def test_an_integer_s_bounds_are_kept_to_by_the_grammar_llama_cpp_runs(
        model: LlamaModel) -> None:
    """minimum, maximum and their exclusive forms (numbers, or draft 4's booleans), in a
    type list too (which keeps an enum as well); bounds no integer meets, or that are not
    numbers, are refused."""
    def allows(schema: dict[str, object], text: str) -> bool:
        tokens = model.tokenize(text, add_special=False, parse_special=False)
        with SamplerChain(model, Sampling(), grammar=json_schema_grammar(schema)) as chain:
            return chain.grammar_run(tokens) == len(tokens)

    n = {"type": "integer", "minimum": 3, "exclusiveMaximum": 42}
    assert all(allows(n, f"{v} ") for v in (3, 17, 41))
    assert not any(allows(n, f"{v} ") for v in (2, 42, 100, -5, 0))
    nullable = {"type": ["integer", "null"], "minimum": -2.5, "maximum": 8}
    assert allows(nullable, "null ") and allows(nullable, "-2 ") and allows(nullable, "8 ")
    assert not allows(nullable, "-3 ") and not allows(nullable, "9 ")
    either = {"type": ["string", "null"], "enum": ["ab", None]}  # (the port dropped it)
    assert allows(either, '"ab"') and allows(either, "null") and not allows(either, '"b"')
    optional = {"anyOf": [{"type": "integer", "exclusiveMinimum": True, "minimum": 0},
                          {"type": "null"}]}
    assert allows(optional, "1 ") and not allows(optional, "0 ")
    with pytest.raises(GrammarError, match="no integer is at least 5 and at most 4"):
        json_schema_grammar({"type": "integer", "minimum": 5, "maximum": 4.5})
    with pytest.raises(GrammarError, match="minimum must be a number"):
        json_schema_grammar({"type": "integer", "minimum": "1"})


@pytest.mark.parametrize("schema, message", [
    ({"type": "objekt"}, "cannot be converted to a grammar: Unrecognized schema"),
    ([1, 2], "must be a JSON object"),
    ("{nope", "is not JSON"),
    ({"$ref": "#/definitions/missing"}, "cannot be converted"),
    ({"type": "string", "pattern": "(("}, "cannot be converted"),
])
def test_a_schema_that_cannot_be_converted_is_refused_saying_why(
        schema: object, message: str) -> None:
    with pytest.raises(GrammarError, match=f"json_schema {message}"):
        json_schema_grammar(schema)  # type: ignore[arg-type]


def test_one_constraint_at_a_time() -> None:
    with pytest.raises(ValueError, match="json_object cannot be combined with grammar"):
        grammar_of('root ::= "a"', None, True)
    with pytest.raises(ValueError, match="json_schema cannot be combined with grammar"):
        grammar_of('root ::= "a"', SCHEMA, False)
    assert grammar_of("", None, False) == ""
