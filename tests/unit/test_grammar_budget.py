"""A schema's grammar is held to a budget before it is built (model_runtime/grammar_budget.py),
and the converter writes repetitions as llama.cpp's ``x{m,n}`` and objects in linear time
(model_runtime/schema_converter.py): bounds over llama.cpp's limit, too many alternatives,
nesting and grammars over the symbol budget are refused naming their place; what the
budget lets through, the runtime's check and llama.cpp accept, and they hold the output
to the bounds exactly.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model_runtime.chat.grammars import SchemaError, schema_grammar, schemas_cost
from model_runtime.grammar import GrammarError, expanded_symbols, json_schema_grammar
from model_runtime.grammar_budget import (
    MAX_ALTERNATIVES,
    MAX_GRAMMAR_SYMBOLS,
    BudgetError,
    schema_cost,
)
from model_runtime.llama_backend import LlamaModel
from model_runtime.schema_converter import SPACE_RULE, converter_class
from tests.support.grammar_check import GrammarChecker


@pytest.fixture(scope="module")
def check(tiny_model: Path) -> Iterator[GrammarChecker]:
    with LlamaModel(tiny_model) as model:
        yield GrammarChecker(model)


def string(**bounds: Any) -> dict[str, Any]:
    return {"type": "string", **bounds}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema, param, message", [
    (string(minLength=100_000_000), "s.minLength", "minLength must be an integer from 0 to "
                                                   "2000 .*got 100000000"),
    (string(maxLength=2001), "s.maxLength", "from 0 to 2000"),
    (string(maxLength=-1), "s.maxLength", "from 0 to 2000"),
    (string(maxLength=10.5), "s.maxLength", "got 10.5"),
    (string(maxLength=True), "s.maxLength", "got True"),
    (string(minLength=5, maxLength=4), "s.maxLength", "maxLength 4 is below minLength 5"),
    ({"type": "array", "items": {}, "minItems": 10**9}, "s.minItems", "from 0 to 2000"),
    ({"type": "array", "items": string(maxLength=3000)}, "s.items.maxLength", "2000"),
    ({"type": "object", "properties": {"x": {"type": "array", "items": {}, "maxItems": 9999}}},
     "s.properties.x.maxItems", "from 0 to 2000"),
    (string(pattern="^(ab){2,100000}$"), "s.pattern", "repetition \\{2,100000\\} is over "
                                                      "2000"),
    (string(pattern="^a{5,2}$"), "s.pattern", "minimum is above the maximum"),
    (string(pattern="^" + "(" * 65 + "a" + ")" * 65 + "$"), "s.pattern", "nest deeper"),
    ({"enum": list(range(MAX_ALTERNATIVES + 1))}, "s.enum", "1001 alternatives"),
    ({"anyOf": [{"type": "null"}] * (MAX_ALTERNATIVES + 1)}, "s.anyOf", "alternatives"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(MAX_ALTERNATIVES + 1)}},
     "s.properties", "alternatives"),
    (nested(60), "s" + ".properties.a" * 49, "nests deeper than 48 levels"),
    ({"$defs": {"A": string(maxLength=5000)}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/A"}}}, "s.$defs.A.maxLength", "2000"),
])
def test_a_bound_over_budget_is_refused_naming_its_place(schema: dict[str, Any], param: str,
                                                         message: str) -> None:
    with pytest.raises(BudgetError, match=message) as err:
        schema_cost(schema, "s")
    assert err.value.param == param


def test_the_grammar_s_size_is_bounded_where_it_passes_the_budget() -> None:
    """Each string within llama.cpp's limit, thirteen of them over the budget: refused at
    the thirteenth, with the count it reached."""
    schema = {"type": "object", "properties": {f"s{i}": string(maxLength=2000)
                                               for i in range(13)}}
    with pytest.raises(BudgetError, match=f"more than {MAX_GRAMMAR_SYMBOLS} symbols") as err:
        schema_cost(schema, "s")
    assert err.value.param == "s.properties.s12.maxLength"
    assert schema_cost({**schema, "properties": dict(list(schema["properties"].items())[:11])},
                       "s") < MAX_GRAMMAR_SYMBOLS


def test_one_grammar_s_schemas_share_one_budget() -> None:
    """Tools are each within budget, together over it: the first one past it is named."""
    params = {"type": "object", "properties": {f"s{i}": string(maxLength=2000)
                                               for i in range(4)}}
    schemas = [(params, f"tools[{i}].function.parameters") for i in range(4)]
    assert schemas_cost(schemas[:3]) < MAX_GRAMMAR_SYMBOLS
    with pytest.raises(SchemaError) as err:
        schemas_cost(schemas)
    assert err.value.param.startswith("tools[3].function.parameters.properties.")


def test_all_of_is_counted_as_the_converter_copies_it() -> None:
    """allOf merges a referenced schema's properties in again at each use; a chain of
    them doubles at each step (2^12 copies here, from a few hundred bytes), and a
    component that refers back to itself would never end."""
    defs: dict[str, Any] = {"d0": {"properties": {"x": string(maxLength=100)}}}
    for i in range(1, 13):
        ref = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"properties": {"a": {"allOf": [ref]}, "b": {"allOf": [ref]}}}
    chain = {"$defs": defs, "allOf": [{"$ref": "#/$defs/d12"}]}
    assert len(json.dumps(chain)) < 1500
    with pytest.raises(BudgetError, match="more than"):
        schema_cost(chain, "s")
    loop = {"$defs": {"A": {"properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}]}}}},
            "allOf": [{"$ref": "#/$defs/A"}]}
    with pytest.raises(BudgetError, match="refers back to itself"):
        schema_cost(loop, "s")


def test_the_request_that_built_half_a_gigabyte_is_refused_before_anything_is_built(
        ) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(GrammarError, match="json_schema.minLength"):
            json_schema_grammar({"type": "string", "minLength": 100_000_000})
        with pytest.raises(SchemaError):
            schema_grammar({"type": "string", "minLength": 100_000_000}, "response_format")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # (it was 500 MB of grammar text)


SCHEMAS = {
    "string": string(), "object": {"type": "object"}, "empty": {},
    "bounded string": string(minLength=5, maxLength=2000),
    "long string": string(minLength=2000),
    "array": {"type": "array", "items": string(maxLength=100), "minItems": 3,
              "maxItems": 2000},
    "tuple": {"type": "array", "prefixItems": [string(), {"type": "integer"}]},
    "enum": {"enum": [f"value-{i}" for i in range(1000)]},
    "const": {"const": {"a": [1, 2, 3], "b": "x" * 500}},
    "optional properties": {"type": "object", "properties": {
        f"p{i}": string() for i in range(1000)}},
    "required properties": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(1000)},
        "required": [f"p{i}" for i in range(1000)]},
    "additional": {"type": "object", "additionalProperties": {
        "type": "array", "items": string()}},
    "pattern": string(pattern="^[a-z]{2,2000}(abc){0,500}-x{3}[0-9]+$"),
    "nested pattern": string(pattern="^((ab){1,100}c){0,20}$"),
    "anyOf": {"anyOf": [string(maxLength=10), {"type": "null"},
                        {"type": "array", "items": {"type": "integer"}}]},
    "type list": {"type": ["string", "null", "integer", "boolean", "number"]},
    "refs": {"$defs": {"A": {"type": "object", "properties": {"x": string(maxLength=500)}}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/A"},
                                              "c": {"type": "array",
                                                    "items": {"$ref": "#/$defs/A"}}}},
    "allOf": {"$defs": {"A": {"properties": {"x": string(maxLength=500),
                                             "y": {"type": "integer"}}}},
              "type": "object", "properties": {f"k{i}": {"allOf": [
                  {"$ref": "#/$defs/A"}, {"properties": {"z": {"type": "boolean"}}}]}
                  for i in range(5)}},
    "at the edge": {"type": "object", "properties": {f"s{i}": string(maxLength=2000)
                                                     for i in range(11)}},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_budget_counts_at_least_what_llama_cpp_will_hold(name: str) -> None:
    """The estimate made before converting is an upper bound of the converted grammar's
    symbols as the runtime counts them, and not a loose one for large grammars."""
    schema = SCHEMAS[name]
    estimate = schema_cost(schema, "s")
    exact = max(expanded_symbols(json_schema_grammar(schema)),
                expanded_symbols(schema_grammar(schema, "s")))
    assert exact <= estimate
    assert estimate < 2 * exact + 2000


@pytest.mark.parametrize("schema, good, bad", [
    (string(maxLength=2000), "x" * 2000, "x" * 2001),
    (string(minLength=2000), "y" * 2000, "y" * 1999),
    (string(minLength=2, maxLength=4), "abc", "a"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [1, 2, 3], [1, 2, 3, 4]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1] * 50, [1]),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 0}, [], [1]),
    (string(pattern="^[a-c]{2,4}(xy){2}$"), "abcxyxy", "abcxy"),
])
def test_compact_repetitions_hold_the_output_to_its_bounds(check: GrammarChecker,
                                                           schema: dict[str, Any], good: Any,
                                                           bad: Any) -> None:
    for grammar in (json_schema_grammar(schema), schema_grammar(schema, "s")):
        assert check.accepts(grammar, json.dumps(good))
        assert not check.accepts(grammar, json.dumps(bad))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12)},
     "required": ["p3", "p7"]},
    {"type": "object", "properties": {"a": string(), "b": {"type": "integer"}},
     "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {f"p{i}": {} for i in range(5)},
     "additionalProperties": True},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"allOf": [{"properties": {"a": string()}}, {"anyOf": [{"properties": {"b": string()}}]}]},
])
def test_objects_convert_to_the_port_s_own_rules(schema: dict[str, Any]) -> None:
    """The linear object rule writes what llama-cpp-python's port writes (but for the
    rule of whitespace, which is llama.cpp's own)."""
    from llama_cpp.llama_grammar import SPACE_RULE as PORT_SPACE_RULE
    from llama_cpp.llama_grammar import SchemaConverter

    def convert(cls: type) -> str:
        converter = cls(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "x"), "")
        return str(converter.format_grammar())

    assert convert(converter_class()) == convert(SchemaConverter).replace(
        f"space ::= {PORT_SPACE_RULE}", f"space ::= {SPACE_RULE}")
