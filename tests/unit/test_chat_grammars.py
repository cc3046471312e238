"""Grammars for structured output and tool calls, checked by llama.cpp: each one parses,
and sampling under it can write the texts it must allow and none it must not
(model_runtime/chat/grammars.py; tests/support/grammar_check.py feeds the tiny model's tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from model_runtime.chat.formats import Family
from model_runtime.chat.grammars import (
    SchemaError,
    envelope_grammar,
    gbnf_literal,
    schema_grammar,
    tool_call_grammar,
)
from model_runtime.chat.messages import Tool
from model_runtime.llama_backend import LlamaModel
from tests.support.grammar_check import GrammarChecker

WEATHER = Tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"],
    "additionalProperties": False})
NOOP = Tool("noop")
THINK = ("<think>", "</think>")


@pytest.fixture(scope="module")
def check(tiny_model: Path) -> Iterator[GrammarChecker]:
    with LlamaModel(tiny_model) as model:
        yield GrammarChecker(model)


def test_json_schema_nested_types_enums_refs_and_required(check: GrammarChecker) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
        "size": {"enum": ["S", "M"]}, "dims": {"type": "object", "properties": {
            "w": {"type": "number"}}, "required": ["w"]}},
        "required": ["name", "dims"], "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "enum": ["a", "b"]}}}
    grammar = schema_grammar(schema, "response_format")
    assert check.parses(grammar)
    # Required properties first (the converter's order), then the optional ones in order.
    assert check.accepts(grammar, '{"name": "x", "dims": {"w": 1.5}, "tags": ["a", "b"], '
                                  '"size": "M"}')
    assert check.accepts(grammar, '{"name": "", "dims": {"w": -2}}')
    for bad in ('{"dims": {"w": 1}}', '{"name": "x", "dims": {}}', '{"name": "x", '
                '"dims": {"w": 1}, "extra": 1}', '{"name": "x", "dims": {"w": 1}, '
                '"tags": ["c"]}', '{"name": "a\nb", "dims": {"w": 1}}', '[1]'):
        assert not check.accepts(grammar, bad), bad


def test_json_object_is_any_object(check: GrammarChecker) -> None:
    grammar = schema_grammar({"type": "object"}, "response_format")
    assert check.accepts(grammar, '{"a": [1, {"b": null}], "c": "d"}')
    assert not check.accepts(grammar, '"just a string"')


def test_two_schemas_with_the_same_definition_name_stay_apart(check: GrammarChecker) -> None:
    def tool(name: str, kind: str) -> Tool:
        return Tool(name, {"type": "object", "properties": {"x": {"$ref": "#/$defs/T"}},
                           "required": ["x"], "$defs": {"T": {"type": kind}}})
    grammar = envelope_grammar([tool("a", "string"), tool("b", "integer")], reply=False,
                               calls=True, parallel=True)
    assert check.accepts(grammar, '{"tool_calls": [{"name": "a", "arguments": {"x": "s"}}, '
                                  '{"name": "b", "arguments": {"x": 3}}]}')
    assert not check.accepts(grammar, '{"tool_calls": [{"name": "b", "arguments": '
                                      '{"x": "s"}}]}')


def test_the_generic_envelope_reply_or_calls_per_tool_choice(check: GrammarChecker) -> None:
    reply = '{"response": "It is \\"sunny\\".\\nBye"}'
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    two = ('{"tool_calls": [{"name": "noop", "arguments": {}}, {"name": "get_weather", '
           '"arguments": {"city": "Rome", "days": 2}}]}')
    auto = envelope_grammar([WEATHER, NOOP], reply=True, calls=True, parallel=True)
    assert all(check.accepts(auto, t) for t in (reply, call, two))
    required = envelope_grammar([WEATHER, NOOP], reply=False, calls=True, parallel=False)
    assert check.accepts(required, call)
    assert not check.accepts(required, reply) and not check.accepts(required, two)
    none = envelope_grammar([WEATHER, NOOP], reply=True, calls=False, parallel=True)
    assert check.accepts(none, reply) and not check.accepts(none, call)
    # Escapes only as json.dumps writes them: a reply is written back byte for byte.
    assert not check.accepts(auto, '{"response": "caf\\u00e9"}')
    assert not check.accepts(auto, '{"tool_calls": [{"name": "get_weather", "arguments": '
                                   '{"days": 2}}]}')  # city is required
    assert not check.accepts(auto, '{"tool_calls": [{"name": "other", "arguments": {}}]}')


def test_hermes_calls_after_optional_reasoning_that_cannot_hold_its_end(
        check: GrammarChecker) -> None:
    grammar = tool_call_grammar(Family.HERMES, [WEATHER], parallel=True, reasoning=THINK)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert check.parses(grammar)
    assert check.accepts(grammar, call)
    assert check.accepts(grammar, f"{call}\n{call}")
    assert check.accepts(grammar, f"<think>\nIt asks </thin > for </think\nweather.\n</think>"
                                  f"\n\n{call}")
    assert not check.accepts(grammar, f"<think>a</think>b</think>{call}")
    assert not check.accepts(grammar, "Hello")
    single = tool_call_grammar(Family.HERMES, [WEATHER], parallel=False)
    assert not check.accepts(single, f"{call}\n{call}")
    inside = tool_call_grammar(Family.HERMES, [WEATHER], parallel=False, reasoning=THINK,
                               inside_reasoning=True)
    assert check.accepts(inside, f"still thinking</think>\n\n{call}")
    assert not check.accepts(inside, call)


def test_llama3_and_mistral_call_syntax(check: GrammarChecker) -> None:
    llama = tool_call_grammar(Family.LLAMA3, [WEATHER, NOOP], parallel=True)
    assert check.accepts(llama, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert check.accepts(llama, '{"type": "function", "name": "noop", "parameters": {}}')
    assert not check.accepts(llama, '{"name": "noop", "arguments": {}}')
    mistral = tool_call_grammar(Family.MISTRAL, [WEATHER, NOOP], parallel=True)
    assert check.accepts(mistral, '[TOOL_CALLS][{"name": "noop", "arguments": {}}, {"name": '
                                  '"get_weather", "arguments": {"city": "Oslo"}, "id": '
                                  '"a1b2c3d4e"}]')
    assert not check.accepts(mistral, '[{"name": "noop", "arguments": {}}]')


def test_tools_and_a_response_format_together(check: GrammarChecker) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"]}
    hermes = tool_call_grammar(Family.HERMES, [NOOP], parallel=False, content_schema=schema)
    assert check.accepts(hermes, '{"answer": "x"}')
    assert check.accepts(hermes, '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not check.accepts(hermes, "free text")
    generic = envelope_grammar([NOOP], reply=True, calls=True, parallel=False,
                               content_schema=schema)
    assert check.accepts(generic, '{"response": {"answer": "x"}}')
    assert not check.accepts(generic, '{"response": "x"}')


@pytest.mark.parametrize("schema, part", [
    ({"type": "strin"}, "Unrecognized schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"$ref": "https://example.com/schema.json"}, "Fetching remote schemas"),
    ("not an object", "must be an object")])
def test_a_schema_that_cannot_be_constrained_says_which_part(schema: object, part: str) -> None:
    with pytest.raises(SchemaError) as err:
        schema_grammar(schema, "response_format.json_schema.schema")
    assert str(err.value).startswith("response_format.json_schema.schema: ")
    assert part in str(err.value)


def test_a_bad_tool_schema_names_its_tool() -> None:
    bad = Tool("broken", {"type": "object", "properties": {"x": {"type": "nope"}}})
    with pytest.raises(SchemaError, match=r"^tools\[1\]\.function\.parameters: "):
        envelope_grammar([NOOP, bad], reply=True, calls=True, parallel=True)


def test_gbnf_literals_escape_what_gbnf_needs() -> None:
    assert gbnf_literal('a"b\\c\nd\te\x01') == '"a\\"b\\\\c\\nd\\te\\x01"'
