"""What a grammar may cost, checked before anything is built: every bound of a JSON schema
(``minLength``, ``maxLength``, ``minItems``, ``maxItems``, a ``pattern``'s repetitions),
its nesting and its number of alternatives, and the size of the grammar it becomes.

A bound is cheap to write and expensive to honour: ``{"minLength": 100000000}`` is 26
bytes of schema, and llama-cpp-python's converter used to write that many copies of a
rule out (half a gigabyte of text) before anything refused it. So a schema is walked
first, the way the converter (:mod:`.schema_converter`) will walk it, and refused with the
place of the first bound over :data:`MAX_REPETITIONS` or where the grammar passes
:data:`MAX_GRAMMAR_SYMBOLS`; only then is it converted.

Sizes are counted as llama.cpp holds a grammar once it has written out its repetitions
(``x{m,n}`` is ``m`` copies of ``x`` and a chain of ``n - m`` optional rules), the measure
:func:`model_runtime.grammar.check_gbnf` applies to GBNF text: the estimate here is an
upper bound of that count (tests/unit/test_grammar_budget.py compares them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# llama.cpp's MAX_REPETITION_THRESHOLD: it refuses a larger minimum, and reads a larger
# maximum as none (``"a"{0,3000}`` accepts 5,000 a's), so no bound above it is honoured.
MAX_REPETITIONS = 2000
# The symbols of one request's grammar once its repetitions are written out: about 12
# strings of maxLength 2000, or 100,000 characters of enum values. llama.cpp compiles
# that many in ~10 ms, and the runtime checks their text in well under 100 ms.
MAX_GRAMMAR_SYMBOLS = 100_000
# Alternatives in one place: an enum's values, anyOf/oneOf's schemas, a type list, an
# object's properties, a tuple's items (OpenAI's structured outputs allow 1,000 enum
# values). Each one is a stack llama.cpp may follow at once while sampling.
MAX_ALTERNATIVES = 1000
# A schema inside a schema inside ...: the converter recurses once per level.
MAX_SCHEMA_DEPTH = 48
# Parentheses inside parentheses, in GBNF or in a pattern: parsers recurse per level.
MAX_NESTING = 64

_BASE = 8  # a rule's own symbols: its end, quotes, ``space``, a reference to it
_SPACE = 90  # the ``space`` rule (schema_converter.SPACE_RULE) written out
# A primitive's rules (the largest: any JSON value), made once per grammar, then referred to.
_PRIMITIVE = 400
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"))
_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3",
                      "uuid4", "uuid5"})


class BudgetError(ValueError):
    """A schema over budget: ``param`` is the place (``where`` and the path within the
    schema, e.g. ``response_format.json_schema.schema.properties.text.maxLength``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def repetition_cost(item: int, low: int, high: int | None) -> int:
    """Symbols of ``item`` (``item`` symbols) repeated ``{low,high}`` (None: no maximum)
    once written out: ``low`` copies, then a chain of optional rules of ``item`` and 3
    more (llama.cpp's expansion; :func:`model_runtime.grammar.check_gbnf` counts so)."""
    optional = 1 if high is None else high - low
    return item * low + optional * (item + 3) + 1


@dataclass
class Budget:
    """The symbols spent so far on one grammar's schemas (several tools and a response
    format share one grammar, so they share one budget)."""

    limit: int = MAX_GRAMMAR_SYMBOLS
    spent: int = 0

    def add(self, schema: Any, where: str) -> int:
        """Check ``schema`` (found at ``where``) and count its grammar's symbols; raises
        :class:`BudgetError` at the first bound or place over budget. Returns its cost."""
        walk = _Walk(schema, where, self)
        # The rules every schema's grammar has: ``space`` (llama.cpp's whitespace rule,
        # its repetitions written out: _SPACE symbols) and a few more.
        walk.spend(4 * _BASE + _SPACE, where)
        walk.visit(schema, where, 0)
        return walk.cost

    def spend(self, symbols: int, param: str) -> None:
        self.spent += symbols
        if self.spent > self.limit:
            raise BudgetError(param, f"the grammar would hold more than {self.limit} "
                                     f"symbols once its repetitions are written out "
                                     f"(about {self.spent} here); a string's maxLength or "
                                     f"an array's maxItems costs about 4 symbols each, an "
                                     f"enum value its length")


def schema_cost(schema: Any, where: str, limit: int = MAX_GRAMMAR_SYMBOLS) -> int:
    """The symbols of ``schema``'s grammar (an upper bound); :class:`BudgetError` when it
    or one of its bounds is over budget."""
    return Budget(limit).add(schema, where)


@dataclass
class _Walk:
    """One schema walked as the converter visits it (the same dispatch, in the same
    order): only what becomes grammar is counted and checked."""

    root: Any
    where: str
    budget: Budget
    cost: int = 0
    refs_seen: set[str] = field(default_factory=set)
    primitives: set[str] = field(default_factory=set)
    merging: set[int] = field(default_factory=set)  # allOf components being merged

    def spend(self, symbols: int, param: str) -> None:
        self.cost += symbols
        self.budget.spend(symbols, param)

    def visit(self, schema: Any, path: str, depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise BudgetError(path, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} "
                                    "levels here")
        if not isinstance(schema, Mapping):
            return  # the converter refuses it, saying why
        self.spend(_BASE, path)
        kind = schema.get("type")
        if "$ref" in schema:
            self.ref(schema["$ref"], path, depth)
        elif "oneOf" in schema or "anyOf" in schema:
            key = "oneOf" if schema.get("oneOf") else "anyOf"
            self.each(schema.get(key), f"{path}.{key}", depth)
        elif isinstance(kind, list):
            self.count(kind, f"{path}.type")
            for name in kind:
                self.primitive(str(name), f"{path}.type")
        elif "const" in schema:
            self.spend(_literal(schema["const"]), f"{path}.const")
        elif "enum" in schema:
            values = schema["enum"]
            self.count(values, f"{path}.enum")
            if isinstance(values, list):
                self.spend(sum(_literal(v) + 1 for v in values), f"{path}.enum")
        elif kind in (None, "object") and ("properties" in schema or (
                "additionalProperties" in schema and
                schema["additionalProperties"] is not True)):
            self.object(schema, path, depth)
        elif kind in (None, "object") and "allOf" in schema:
            self.all_of(schema["allOf"], f"{path}.allOf", depth)
        elif kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            self.array(schema, path, depth)
        elif kind in (None, "string") and "pattern" in schema:
            self.spend(pattern_cost(schema["pattern"], f"{path}.pattern"), f"{path}.pattern")
        elif kind in (None, "string") and schema.get("format") in _FORMATS:
            self.primitive(str(schema["format"]), path)
        elif kind == "string" and ("minLength" in schema or "maxLength" in schema):
            low, high = _bounds(schema, path, *_BOUNDS[0])
            self.primitive("char", path)
            self.spend(repetition_cost(1, low, high), f"{path}.{_BOUNDS[0][high is not None]}")
        else:
            self.primitive(str(kind), path)

    def primitive(self, name: str, path: str) -> None:
        """A reference to a primitive's rules, made the first time."""
        self.spend(2 if name in self.primitives else _PRIMITIVE, path)
        self.primitives.add(name)

    def each(self, schemas: Any, path: str, depth: int) -> None:
        self.count(schemas, path)
        if isinstance(schemas, list):
            for i, schema in enumerate(schemas):
                self.visit(schema, f"{path}[{i}]", depth + 1)

    def count(self, values: Any, path: str) -> None:
        if isinstance(values, (list, Mapping)) and len(values) > MAX_ALTERNATIVES:
            raise BudgetError(path, f"{_name(path)} has {len(values)} alternatives; at "
                                    f"most {MAX_ALTERNATIVES} are accepted in one place")

    def ref(self, ref: Any, path: str, depth: int) -> None:
        """A reference is converted once, wherever it is used."""
        if not isinstance(ref, str) or ref in self.refs_seen:
            return
        self.refs_seen.add(ref)
        target, target_path = self.resolve(ref)
        if target is not None:
            self.visit(target, target_path, depth + 1)

    def resolve(self, ref: str) -> tuple[Any, str]:
        """A local reference's schema and its path (None: the converter refuses it)."""
        if not ref.startswith("#/"):
            return None, ""
        node, path = self.root, self.where
        for part in ref[2:].split("/"):
            if not isinstance(node, Mapping) or part not in node:
                return None, ""
            node, path = node[part], f"{path}.{part}"
        return node, path

    def object(self, schema: Mapping[str, Any], path: str, depth: int) -> None:
        properties = schema.get("properties", {})
        self.count(properties, f"{path}.properties")
        required = schema.get("required", [])
        if isinstance(properties, Mapping):
            for name, sub in properties.items():
                at = f"{path}.properties.{name}"
                optional = 8 if not isinstance(required, list) or name not in required else 0
                self.spend(_literal(name) + _BASE + optional, at)
                self.visit(sub, at, depth + 1)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping) or extra is True:
            self.spend(_BASE * 2, f"{path}.additionalProperties")
            self.primitive("string", f"{path}.additionalProperties")
            if isinstance(extra, Mapping):
                self.visit(extra, f"{path}.additionalProperties", depth + 1)

    def all_of(self, components: Any, path: str, depth: int) -> None:
        """allOf's components' properties merged into one object: the converter visits
        a referenced component's properties again for every use (so they cost again)."""
        self.count(components, path)
        if not isinstance(components, list):
            return
        for i, component in enumerate(components):
            parts = component.get("anyOf") if isinstance(component, Mapping) else None
            if isinstance(parts, list):
                self.count(parts, f"{path}[{i}].anyOf")
                for j, part in enumerate(parts):
                    self.merge(part, f"{path}[{i}].anyOf[{j}]", depth)
            else:
                self.merge(component, f"{path}[{i}]", depth)

    def merge(self, component: Any, path: str, depth: int) -> None:
        if not isinstance(component, Mapping):
            return
        ref = component.get("$ref")
        if isinstance(ref, str):
            component, path = self.resolve(ref)
            if not isinstance(component, Mapping):
                return
        if id(component) in self.merging:  # the converter would recurse without end
            raise BudgetError(path, "allOf refers back to itself through $ref")
        self.merging.add(id(component))
        try:
            properties = component.get("properties")
            self.count(properties, f"{path}.properties")
            if isinstance(properties, Mapping):
                for name, sub in properties.items():
                    at = f"{path}.properties.{name}"
                    self.spend(_literal(name) + _BASE + 8, at)
                    self.visit(sub, at, depth + 1)
        finally:
            self.merging.discard(id(component))

    def array(self, schema: Mapping[str, Any], path: str, depth: int) -> None:
        items = schema.get("items") or schema.get("prefixItems")
        if isinstance(items, list):
            self.each(items, f"{path}.items", depth)
            return
        self.visit(items, f"{path}.items", depth + 1)
        low, high = _bounds(schema, path, *_BOUNDS[1])
        self.spend(repetition_cost(1, low, high) + _BASE,
                   f"{path}.{_BOUNDS[1][high is not None]}")


def _bounds(schema: Mapping[str, Any], path: str, low_name: str,
            high_name: str) -> tuple[int, int | None]:
    low = _bound(schema.get(low_name, 0), f"{path}.{low_name}")
    high = schema.get(high_name)
    if high is None:
        return low, None
    high = _bound(high, f"{path}.{high_name}")
    if high < low:
        raise BudgetError(f"{path}.{high_name}", f"{high_name} {high} is below {low_name} "
                                                 f"{low}")
    return low, high


def _bound(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not \
            0 <= value <= MAX_REPETITIONS:
        raise BudgetError(param, f"{_name(param)} must be an integer from 0 to "
                                 f"{MAX_REPETITIONS} (llama.cpp's limit on a repetition), "
                                 f"got {value!r}")
    return value


def _name(param: str) -> str:
    """The last part of a place (``maxLength`` of ``...properties.text.maxLength``)."""
    return param.rsplit(".", 1)[-1]


def _literal(value: Any) -> int:
    """Symbols of a JSON value written as a literal: one per character."""
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError):
        return 0  # the converter refuses it


def pattern_cost(pattern: Any, param: str) -> int:
    """Symbols of a ``pattern``'s grammar (an upper bound): its characters, and each
    repetition ``{m,n}`` of the atom before it (a character, an escape, a class or a
    group: its text's length) written out; a group's own repetitions are counted inside
    it. Refuses a repetition over :data:`MAX_REPETITIONS` and groups nested deeper than
    :data:`MAX_NESTING`."""
    if not isinstance(pattern, str):
        return 0  # the converter refuses it
    cost = len(pattern)
    opened: list[int] = []  # where each open group starts
    atom = 1  # the symbols of the last atom: a group's its text's length at most
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            atom, i = 1, i + 2
        elif c == "[":
            atom = 1
            i += 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "(":
            opened.append(i)
            if len(opened) > MAX_NESTING:
                raise BudgetError(param, f"the pattern's groups nest deeper than "
                                         f"{MAX_NESTING} levels")
            i += 1
        elif c == ")":
            atom = i - opened.pop() if opened else 1
            i += 1
        elif c == "{":
            end = pattern.find("}", i)
            if end < 0:
                return cost  # the converter refuses it
            low, high = _quantifier(pattern[i + 1:end], param)
            cost += repetition_cost(atom, low, high)
            i = end + 1
        else:
            if c not in "*+?|":
                atom = 1
            i += 1
    return cost


def _quantifier(text: str, param: str) -> tuple[int, int | None]:
    """``{m}``, ``{m,}``, ``{,n}`` or ``{m,n}``'s bounds as the converter reads them, each
    at most :data:`MAX_REPETITIONS`."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) if p else None for p in parts]
    except ValueError:
        return 0, 0  # the converter refuses it
    if len(values) > 2 or (len(values) == 1 and values[0] is None):
        return 0, 0  # the converter refuses it
    if any(v is not None and not 0 <= v <= MAX_REPETITIONS for v in values):
        raise BudgetError(param, f"the pattern's repetition {{{text}}} is over "
                                 f"{MAX_REPETITIONS} (llama.cpp's limit on a repetition)")
    low = values[0] or 0
    high = values[0] if len(values) == 1 else values[1]
    if high is not None and high < low:
        raise BudgetError(param, f"the pattern's repetition {{{text}}}: the minimum is above "
                                 "the maximum")
    return low, high
