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

Bounds are not checked here: :mod:`.grammar_budget` walks a schema before it is converted.
The port's ``visit`` and ``_visit_pattern`` run as they are, their module's
``_build_repetition`` replaced by :func:`compact_repetition` for this class only (the
port's module is left untouched).
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable
from typing import Any

__all__ = ["SPACE_RULE", "compact_repetition", "converter_class"]

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
        visit = rebound(port.SchemaConverter.visit)
        _visit_pattern = rebound(port.SchemaConverter._visit_pattern)

        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self._rules["space"] = SPACE_RULE

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
