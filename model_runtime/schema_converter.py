"""llama.cpp's JSON-Schema-to-GBNF converter as llama-cpp-python ports it
(``llama_cpp.llama_grammar.SchemaConverter``), with two costs of the port taken out.

* Repetitions are written as GBNF's ``x{m,n}``, which llama.cpp expands itself into a flat
  chain of rules, as llama.cpp's own converter now writes them. The port writes them out:
  ``m`` copies of ``x`` then ``n - m`` optional groups nested in each other, so a
  ``maxLength`` of 600 nested 600 deep (too deep for the runtime's grammar check) and a
  ``minLength`` of 10^8 was half a gigabyte of text.
* Whitespace between tokens of the JSON is what llama.cpp's converter allows (a space,
  or one or two newlines and up to 20 spaces or tabs of indent), not the port's single
  optional space: a model that writes its JSON indented (most do) writes it as it
  would, and as llama-server lets it for the same schema.
* An object's optional properties are chained in linear time; the port rebuilds the rest
  of the chain from every property on (cubic: 1,000 optional properties took 5 s, 3,000
  took 150 s), for the same rules.

* An integer's ``minimum``, ``maximum``, ``exclusiveMinimum`` and ``exclusiveMaximum``
  are kept to (:func:`integer_range`, as llama.cpp's converter does); the port drops them.
  A type list (``["integer", "null"]``) keeps the schema's other keywords for each type.

Bounds are not checked here: :mod:`.grammar_budget` walks a schema before it is converted.
The port's ``visit`` and ``_visit_pattern`` run as they are, their module's
``_build_repetition`` replaced by :func:`compact_repetition` for this class only (the
port's module is left untouched).
"""

from __future__ import annotations

import functools
import json
import math
import types
from collections.abc import Callable
from typing import Any

__all__ = ["SPACE_RULE", "compact_repetition", "converter_class", "integer_bounds",
           "integer_range"]

# llama.cpp's rule for whitespace (common/json-schema-to-grammar.cpp, SPACE_RULE).
SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'


def compact_repetition(item_rule: str, min_items: int, max_items: int | None,
                       separator_rule: str | None = None,
                       item_rule_is_literal: bool = False) -> str:
    """``item_rule`` repeated ``min_items`` to ``max_items`` times (None: no maximum),
    ``separator_rule`` between two, as GBNF (llama.cpp's ``build_repetition``).
    (``item_rule_is_literal``: the port's own argument, of no use here.)"""
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return f"{item_rule}?"
    if not separator_rule:
        if min_items == 1 and max_items is None:
            return f"{item_rule}+"
        if min_items == 0 and max_items is None:
            return f"{item_rule}*"
        return f"{item_rule}{{{min_items},{'' if max_items is None else max_items}}}"
    rest = compact_repetition(f"({separator_rule} {item_rule})", max(min_items - 1, 0),
                              None if max_items is None else max_items - 1)
    result = f"{item_rule} {rest}"
    return f"({result})?" if min_items == 0 else result


# Digits of an integer at most, as the port's integer rule allows (an integral part of 16).
MAX_DIGITS = 16
INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords the port's visit reads before a schema's type (bounds beside them are theirs).
DECIDED_BEFORE_TYPE = ("$ref", "oneOf", "anyOf", "const", "enum")


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and greatest integer ``schema``'s bounds allow (None: unbounded), from
    ``minimum``/``maximum`` and ``exclusiveMinimum``/``exclusiveMaximum`` (numbers, or as
    in draft 4, booleans that make the others exclusive). Raises ValueError for a bound
    that is not a number."""
    def number(key: str) -> float | None:
        value = schema.get(key)
        if value is None or isinstance(value, bool):
            return None
        if not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{key} must be a number, got {value!r}")
        return value

    lows: list[int] = []  # the least integer each lower bound allows
    highs: list[int] = []
    if (low := number("minimum")) is not None:
        lows.append(math.floor(low) + 1 if schema.get("exclusiveMinimum") is True
                    else math.ceil(low))
    if (high := number("maximum")) is not None:
        highs.append(math.ceil(high) - 1 if schema.get("exclusiveMaximum") is True
                     else math.floor(high))
    if (low := number("exclusiveMinimum")) is not None:
        lows.append(math.floor(low) + 1)
    if (high := number("exclusiveMaximum")) is not None:
        highs.append(math.ceil(high) - 1)
    return max(lows, default=None), min(highs, default=None)


def _same_length(low: str, high: str) -> list[str]:
    """GBNF alternatives for the digit strings of one length from ``low`` to ``high``."""
    if not low:
        return [""]
    if low == high:
        return [f'"{low}"']
    if low[0] == high[0]:
        return [f'"{low[0]}" ({" | ".join(_same_length(low[1:], high[1:]))})'
                if len(low) > 1 else f'"{low}"']
    rest = len(low) - 1
    out = []
    first, last = int(low[0]), int(high[0])
    if rest and low[1:] != "0" * rest:  # the first digit with the rest from low[1:] up
        out.append(f'"{low[0]}" ({" | ".join(_same_length(low[1:], "9" * rest))})')
        first += 1
    if rest and high[1:] != "9" * rest:  # the last digit with the rest up to high[1:]
        out.append(f'"{high[0]}" ({" | ".join(_same_length("0" * rest, high[1:]))})')
        last -= 1
    if first <= last:  # the digits between, with any rest
        out.append(f"[{first}-{last}]" + (f" [0-9]{{{rest}}}" if rest else ""))
    return out


def _naturals(low: int, high: int | None) -> list[str]:
    """GBNF alternatives for the numbers from ``low`` >= 0 to ``high`` (None: up to
    :data:`MAX_DIGITS` digits, or ``low``'s), written without leading zeros."""
    out = []
    top = max(MAX_DIGITS, len(str(low))) if high is None else len(str(high))
    for length in range(len(str(low)), top + 1):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        end = 10 ** length - 1 if high is None else min(high, 10 ** length - 1)
        if start > end:
            continue
        if high is None and start == 10 ** (length - 1) and length > 1:
            out.append(f"[1-9] [0-9]{{{length - 1},{top - 1}}}")  # and all longer
            break
        if start == 10 ** (length - 1) and end == 10 ** length - 1 and length > 1:
            out.append(f"[1-9] [0-9]{{{length - 1}}}")
        else:
            out.extend(_same_length(str(start).zfill(length), str(end)))
    return out


def integer_range(least: int | None, greatest: int | None) -> str:
    """A GBNF expression for exactly the JSON integers from ``least`` to ``greatest``
    (None: unbounded, up to :data:`MAX_DIGITS` digits), with no leading zeros and no
    ``-0``. Raises ValueError when no integer is in the range."""
    if least is not None and greatest is not None and least > greatest:
        raise ValueError(f"no integer is at least {least} and at most {greatest}")
    parts = []
    if least is None or least < 0:  # the negatives: "-" and their magnitudes
        low_magnitude = 1 if greatest is None or greatest >= 0 else -greatest
        high_magnitude = None if least is None else -least
        parts.append('"-" (' + " | ".join(_naturals(low_magnitude, high_magnitude)) + ")")
    if greatest is None or greatest >= 0:
        parts.extend(_naturals(max(least or 0, 0), greatest))
    return "(" + " | ".join(parts) + ")"


@functools.cache
def converter_class() -> type:
    """The converter class (made once, at first use: importing llama_cpp loads the
    library)."""
    from llama_cpp import llama_grammar as port

    namespace = {**vars(port), "_build_repetition": compact_repetition}

    def rebound(method: Callable[..., Any]) -> Callable[..., Any]:
        fn = types.FunctionType(method.__code__, namespace, method.__name__,
                                method.__defaults__, method.__closure__)
        fn.__kwdefaults__ = method.__kwdefaults__
        return fn

    class LeanConverter(port.SchemaConverter):  # type: ignore[misc,name-defined]
        _visit_pattern = rebound(port.SchemaConverter._visit_pattern)

        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self._rules["space"] = SPACE_RULE

        def visit(self, schema: dict[str, Any], name: str) -> str:
            """The port's ``visit``, but for an integer with bounds (kept to) and a type
            list (each type with the schema's other keywords)."""
            kind = schema.get("type")
            rule_name = name + "-" if name in port.RESERVED_NAMES else name or "root"
            # (in the port's order: a reference or a union, then a type list, then a
            # constant or an enum, then the type)
            if not any(k in schema for k in ("$ref", "oneOf", "anyOf")) and isinstance(
                    kind, list):
                return str(self._add_rule(rule_name, self._generate_union_rule(
                    name, [{**schema, "type": t} for t in kind])))
            if not any(k in schema for k in DECIDED_BEFORE_TYPE) and kind == "integer" and any(
                    k in schema for k in INTEGER_BOUNDS):
                least, greatest = integer_bounds(schema)
                if least is not None or greatest is not None:
                    return str(self._add_rule(
                        rule_name, f"{integer_range(least, greatest)} space"))
            return str(LeanConverter._port_visit(self, schema, name))

        _port_visit = rebound(port.SchemaConverter.visit)

        def _build_object_rule(self, properties: list[tuple[str, Any]], required: set[str],
                               name: str, additional_properties: Any) -> str:
            """The port's object rule, the same rules made once each: the required
            properties in order, then any one optional property followed by a chain
            of the optional ones after it."""
            order = self._prop_order
            prefix = f"{name}{'-' if name else ''}"
            ranked = sorted(enumerate(properties),
                            key=lambda ikv: (order.get(ikv[1][0], len(order)), ikv[0]))
            sorted_props = [kv[0] for _, kv in ranked]
            kv_rules = {}
            for prop_name, prop_schema in properties:
                value = self.visit(prop_schema, f"{prefix}{prop_name}")
                kv_rules[prop_name] = self._add_rule(
                    f"{prefix}{prop_name}-kv",
                    rf'{self._format_literal(json.dumps(prop_name))} space ":" space {value}')
            required_props = [k for k in sorted_props if k in required]
            optional = [k for k in sorted_props if k not in required]
            if additional_properties is True or isinstance(additional_properties, dict):
                sub = f"{prefix}additional"
                value = self.visit({} if additional_properties is True
                                   else additional_properties, f"{sub}-value")
                kv_rules["*"] = self._add_rule(
                    f"{sub}-kv", self._add_primitive("string", port.PRIMITIVE_RULES["string"])
                    + f' ":" space {value}')
                optional.append("*")
            rule = '"{" space ' + ' "," space '.join(kv_rules[k] for k in required_props)
            if optional:
                rule += " ("
                if required_props:
                    rule += ' "," space ( '
                rule += " | ".join(self._optional_chains(optional, kv_rules, prefix))
                if required_props:
                    rule += " )"
                rule += " )?"
            return rule + ' "}" space'

        def _optional_chains(self, keys: list[str], kv_rules: dict[str, str],
                             prefix: str) -> list[str]:
            """For each optional key: it, then a rule for the keys after it, each
            optional (the port's ``get_recursive_refs``), the rules made from the last
            key backwards, as the port's recursion makes them."""
            def head(k: str, first_is_optional: bool) -> str:
                if k == "*":
                    return str(self._add_rule(f"{prefix}additional-kvs",
                                              f'{kv_rules[k]} ( "," space {kv_rules[k]} )*'))
                return f'( "," space {kv_rules[k]} )?' if first_is_optional else kv_rules[k]

            rest: dict[int, str] = {}  # index -> the rule of the keys from there on
            for j in range(len(keys) - 1, 0, -1):
                body = head(keys[j], True) + (f" {rest[j + 1]}" if j + 1 in rest else "")
                rest[j] = str(self._add_rule(f"{prefix}{keys[j - 1]}-rest", body))
            return [head(k, False) + (f" {rest[i + 1]}" if i + 1 in rest else "")
                    for i, k in enumerate(keys)]

    return LeanConverter
