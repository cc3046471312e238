"""GBNF grammars (llama.cpp's grammar format) for structured output and tool calls.

JSON schemas become rules through llama.cpp's converter as llama-cpp-python ports it
(``llama_cpp.llama_grammar.SchemaConverter``, pure Python, as
:mod:`model_runtime.schema_converter` runs it), with JSON's own string rule (no raw
control characters, which the port allows and every JSON parser refuses). Several
schemas share one grammar: each one's ``$defs`` are renamed apart first (the converter
names a definition's rule after its last path segment alone). Every schema is checked
against the grammar's budget (:mod:`model_runtime.grammar_budget`) before it is
converted; :func:`constraint_cost` checks a whole request's before any is.

The grammars here (tests/unit/test_chat_grammars.py parses each one with llama.cpp and feeds it
the texts it must accept and refuse):

* :func:`schema_grammar`: one JSON value of a schema (``response_format``);
* :func:`tool_call_grammar`: the calls of a family's syntax, for ``required``, a named
  function, or (lazy, from the family's trigger on) ``auto``;
* :func:`envelope_grammar`: the generic family's JSON envelope, a reply or tool calls;

each optionally preceded by a reasoning block (``<think>`` … ``</think>``) that cannot
contain its end marker, or starting inside one when the prompt opened it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..grammar_budget import Budget, BudgetError
from ..schema_converter import converter_class
from .formats import HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKER, Family
from .messages import Tool

__all__ = ["Constraint", "SchemaError", "envelope_grammar", "gbnf_literal",
           "schema_grammar", "schemas_cost", "tool_call_grammar"]

# What llama.cpp's grammar decodes from bytes that are not UTF-8 (it reads 0xF5-0xFF as the
# lead of a 4-byte sequence, and 0xED 0xA0-0xBF as any other 3-byte one): surrogates and
# values past U+10FFFF. Left out of the string classes, so a constrained string is valid
# UTF-8 (every JSON parser decodes it as written, and its length is what the schema says).
NOT_UTF8 = r'\uD800-\uDFFF\U00110000-\U003FFFFF'
# JSON's characters in a string: no raw control characters (the port allows them). NUL
# is left out of the classes: llama.cpp reads a grammar as a C string.
JSON_CHAR = (r'[^"\\\x7F\x01-\x1F' + NOT_UTF8 + r'] | "\\" (["\\/bfnrt] | '
             r'"u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])')
# A string as json.dumps(ensure_ascii=False) writes it: replies in the generic envelope are
# then written back into the history byte for byte.
CANONICAL_STRING = (r'"\"" ( [^"\\\x01-\x1F' + NOT_UTF8 + r'] | '
                    r'"\\" (["\\bfnrt] | "u00" [01] [0-9a-f]) )* "\""')
# Between the parts of a tool call: what models write there, and no runaway whitespace.
WS = '| " " | "\\n"'


class SchemaError(ValueError):
    """A JSON schema that cannot be turned into a grammar; ``param`` names where it came
    from, the message what failed."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail


@dataclass(frozen=True)
class Constraint:
    """What a request's output is held to: a GBNF grammar, applied from the first token,
    or (``triggers`` given) only from where the output first contains one of them."""

    grammar: str
    triggers: tuple[str, ...] = ()


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def schemas_cost(schemas: Sequence[tuple[Any, str]]) -> int:
    """The symbols of one grammar's schemas (each with the place it came from), checked
    against one budget before any is converted: :class:`SchemaError` naming the first
    bound or place over it."""
    budget = Budget()
    for schema, where in schemas:
        try:
            budget.add(schema, where)
        except BudgetError as exc:
            raise SchemaError(exc.param, exc.message) from None
    return budget.spent


def _char_class(chars: set[str], negate: bool) -> str:
    body = "".join("\\" + c if c in "]\\^-[" else c for c in sorted(chars))
    return f"[{'^' if negate else ''}{body}]"


def _converter() -> Any:
    from llama_cpp.llama_grammar import PRIMITIVE_RULES, BuiltinRule

    class StrictConverter(converter_class()):  # type: ignore[misc]
        def _add_primitive(self, name: str, rule: Any) -> str:
            if name == "char":
                rule = BuiltinRule(JSON_CHAR, [])
            if name in self._rules:
                return name
            key = self._add_rule(name, rule.content)
            for dep in rule.deps:
                if dep not in self._rules:
                    self._add_primitive(dep, PRIMITIVE_RULES[dep])
            return str(key)

    return StrictConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _prefix_definitions(schema: Any, prefix: str) -> Any:
    """A copy of ``schema`` whose top-level ``$defs``/``definitions`` (and the local
    references to them) carry ``prefix``: rules of several schemas stay apart."""
    schema = copy.deepcopy(schema)
    if not isinstance(schema, dict):
        return schema
    renames: dict[str, str] = {}
    for section in ("$defs", "definitions"):
        defs = schema.get(section)
        if isinstance(defs, dict):
            schema[section] = {f"{prefix}{k}": v for k, v in defs.items()}
            renames.update({f"#/{section}/{k}": f"#/{section}/{prefix}{k}" for k in defs})

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref in renames:
                node["$ref"] = renames[ref]
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


class Rules:
    """The rules of one grammar under construction."""

    def __init__(self) -> None:
        self._conv = _converter()
        self._budget = Budget()

    def add(self, name: str, body: str) -> str:
        return str(self._conv._add_rule(name, body))

    def schema(self, schema: Any, name: str, where: str) -> str:
        """The rule for one value of ``schema``; :class:`SchemaError` naming ``where``
        when the converter cannot take it."""
        if not isinstance(schema, Mapping):
            raise SchemaError(where, f"a JSON schema must be an object, got "
                                     f"{json.dumps(schema)[:80]}")
        try:
            self._budget.add(schema, where)
        except BudgetError as exc:
            raise SchemaError(exc.param, exc.message) from None
        try:
            prepared = _prefix_definitions(dict(schema), f"{name}-")
            resolved = self._conv.resolve_refs(prepared, f"{name}:")
            return str(self._conv.visit(resolved, name))
        except RecursionError:
            raise SchemaError(where, "the schema nests too deeply") from None
        except Exception as exc:  # the converter asserts, or trips over a malformed part
            detail = str(exc) or type(exc).__name__
            raise SchemaError(where, f"this schema cannot be turned into a grammar: "
                                     f"{detail[:300]}") from None

    def primitive(self, name: str) -> str:
        from llama_cpp.llama_grammar import PRIMITIVE_RULES

        return str(self._conv._add_primitive(name, PRIMITIVE_RULES[name]))

    def until(self, name: str, literal: str) -> str:
        """Any text up to and including the first ``literal``: one rule per matched
        prefix of it (a matcher that never lets the literal pass inside the text)."""
        n = len(literal)
        names = [f"{name}-{k}" for k in range(n)]
        alphabet = set(literal)
        for k in range(n):
            alternatives = []
            special: set[str] = set()
            for ch in sorted(alphabet):
                seen = literal[:k] + ch
                if ch == literal[k] and k + 1 == n:
                    alternatives.append(gbnf_literal(ch))
                    special.add(ch)
                    continue
                dest = max(j for j in range(0, min(k + 1, n - 1) + 1)
                           if seen.endswith(literal[:j]))
                if dest:
                    alternatives.append(f"{gbnf_literal(ch)} {names[dest]}")
                    special.add(ch)
            alternatives.insert(0, f"{_char_class(special, negate=True)} {names[0]}")
            self.add(names[k], " | ".join(alternatives))
        return names[0]

    def grammar(self, root: str) -> str:
        self._conv._rules["root"] = root
        return str(self._conv.format_grammar())


def _with_reasoning(rules: Rules, body: str, reasoning: tuple[str, str] | None,
                    inside: bool) -> str:
    """``body`` after an optional reasoning block, or after the rest of one the prompt
    opened (``inside``)."""
    if reasoning is None:
        return body
    start, end = reasoning
    rest = rules.until("reasoning", end)
    ws = rules.add("ws", WS)
    if inside:
        return f"{rest} {ws} {ws} ( {body} )"
    return f"( {gbnf_literal(start)} {rest} {ws} {ws} )? ( {body} )"


def schema_grammar(schema: Any, where: str, *, reasoning: tuple[str, str] | None = None,
                   inside_reasoning: bool = False) -> str:
    """One JSON value of ``schema`` (``{"type": "object"}`` for ``json_object``)."""
    rules = Rules()
    value = rules.schema(schema, "value", where)
    return rules.grammar(_with_reasoning(rules, value, reasoning, inside_reasoning))


def _call_rules(rules: Rules, family: Family, tools: Sequence[Tool], where: str) -> str:
    """The rule for one call of any of ``tools``, in ``family``'s JSON object."""
    ws = rules.add("ws", WS)
    key = "parameters" if family is Family.LLAMA3 else "arguments"
    alternatives = []
    for i, tool in enumerate(tools):
        args = rules.schema(tool.parameters, f"tool-{i}-args",
                            f"{where}[{i}].function.parameters")
        head = f'"{{" {ws} '
        if family is Family.LLAMA3:
            head += f'( "\\"type\\"" {ws} ":" {ws} "\\"function\\"" {ws} "," {ws} )? '
        body = (f'{head}"\\"name\\"" {ws} ":" {ws} {gbnf_literal(json.dumps(tool.name))} '
                f'{ws} "," {ws} {gbnf_literal(json.dumps(key))} {ws} ":" {ws} {args} {ws}')
        if family is Family.MISTRAL:
            body += f'( "," {ws} "\\"id\\"" {ws} ":" {ws} "\\"" [a-zA-Z0-9]{{9}} "\\"" {ws} )? '
        alternatives.append(rules.add(f"call-{i}", body + '"}"'))
    return rules.add("call", " | ".join(alternatives))


def tool_call_grammar(family: Family, tools: Sequence[Tool], *, parallel: bool,
                      where: str = "tools", reasoning: tuple[str, str] | None = None,
                      inside_reasoning: bool = False, content_schema: Any = None) -> str:
    """One call (or, ``parallel``, one or more) of ``tools`` in ``family``'s syntax. With
    ``content_schema``, a JSON value of it instead of the calls is allowed too (tools
    and ``response_format`` together). Used lazily (from the family's trigger on) for
    ``auto``; from the start, after optional reasoning, for ``required`` and a named tool."""
    if family is Family.GENERIC:
        raise ValueError("the generic family uses envelope_grammar")
    rules = Rules()
    call = _call_rules(rules, family, tools, where)
    ws = rules.add("ws", WS)
    if family is Family.HERMES:
        one = rules.add("tool-call", f'{gbnf_literal(HERMES_OPEN)} {ws} {call} {ws} '
                                     f'{gbnf_literal(HERMES_CLOSE)}')
        calls = f"{one} ( {ws} {one} )*" if parallel else one
    elif family is Family.LLAMA3:
        calls = f'{call} ( {ws} ";"? {ws} {call} )*' if parallel else call
    else:  # Family.MISTRAL
        more = f' ( {ws} "," {ws} {call} )*' if parallel else ""
        calls = f'{gbnf_literal(MISTRAL_MARKER)} {ws} "[" {ws} {call}{more} {ws} "]"'
    body = rules.add("tool-calls", calls)
    if content_schema is not None:
        body = f"{body} | {rules.schema(content_schema, 'content', 'response_format')}"
    return rules.grammar(_with_reasoning(rules, body, reasoning, inside_reasoning))


def envelope_grammar(tools: Sequence[Tool], *, reply: bool, calls: bool, parallel: bool,
                     where: str = "tools", content_schema: Any = None,
                     reasoning: tuple[str, str] | None = None,
                     inside_reasoning: bool = False) -> str:
    """The generic family's output, written exactly so: ``{"response": "…"}`` (``reply``;
    a JSON value of ``content_schema`` in place of the string when given) and/or
    ``{"tool_calls": [{"name": "…", "arguments": {…}}, …]}`` (``calls``; one call unless
    ``parallel``)."""
    if not (reply or calls):
        raise ValueError("the envelope needs a reply or calls")
    rules = Rules()
    alternatives = []
    if reply:
        value = (rules.schema(content_schema, "content", "response_format")
                 if content_schema is not None else rules.add("reply", CANONICAL_STRING))
        alternatives.append(f'"{{\\"response\\": " {value} "}}"')
    if calls:
        names = []
        for i, tool in enumerate(tools):
            args = rules.schema(tool.parameters, f"tool-{i}-args",
                                f"{where}[{i}].function.parameters")
            head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
            names.append(rules.add(f"call-{i}", f'{gbnf_literal(head)} {args} "}}"'))
        call = rules.add("call", " | ".join(names))
        more = f' ( ", " {call} )*' if parallel else ""
        alternatives.append(f'"{{\\"tool_calls\\": [" {call}{more} "]}}"')
    body = " | ".join(f"( {a} )" for a in alternatives)
    return rules.grammar(_with_reasoning(rules, body, reasoning, inside_reasoning))
