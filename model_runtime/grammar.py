"""Grammars a request's output must follow: GBNF checked before a request is queued, and
JSON Schema converted to GBNF.

llama.cpp parses a grammar when its sampler is made, and on a bad one says why only on
its stderr (``llama_sampler_init_grammar`` returns NULL), so :func:`check_gbnf` parses
the text first with the same rules, and says which line and column failed and how. It
also refuses what llama.cpp accepts but cannot serve: a repetition ``{m,n}`` with ``m``
above ``n`` (llama.cpp loops forever on it) or ``n`` above 2,000 (llama.cpp reads it as
no maximum), a grammar that expands beyond :data:`MAX_GRAMMAR_SYMBOLS` or nests
parentheses deeper than :data:`MAX_NESTING`, a token id outside the vocabulary, a NUL
character (the C string would end there), and left recursion (llama.cpp refuses it,
naming only a rule index). What passes is then compiled by llama.cpp once
(:func:`model_runtime.llama_backend.grammar_refusal`), which has the last word.

JSON Schema goes through llama.cpp's own converter, as llama-cpp-python ports it (pure
Python: :func:`json_schema_to_gbnf`, :mod:`.schema_converter`), once
:mod:`.grammar_budget` has checked its bounds.

The syntax, as llama.cpp's parser reads it (src/llama-grammar.cpp)::

    rule      ::= name ws "::=" alternates (newline | end)
    alternates ::= sequence ("|" sequence)*        newlines allowed after "|" and in ()
    item      ::= "literal" | [class] | [^class] | name | ( alternates ) | . | <token>
                  | !<token>, each optionally followed by * + ? {m} {m,} {m,n}
    escapes   \\x.. \\u.... \\U........ \\t \\r \\n \\\\ \\" \\[ \\] \\-      comments: # to end of line
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import SettingError
from .grammar_budget import (
    MAX_GRAMMAR_SYMBOLS,
    MAX_NESTING,
    MAX_REPETITIONS,
    BudgetError,
    schema_cost,
)
from .schema_converter import converter_class

ROOT = "root"
# Runs the parser takes whole rather than a character at a time (a grammar may be
# megabytes of text: it is bounded by its symbols, not its length).
_PLAIN_LITERAL = re.compile(r'[^"\\\x00]+')
_PLAIN_SPACE = re.compile(r"[ \t]+|#[^\r\n]*")
_PLAIN_SPACE_NEWLINES = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)+")
_NAME = re.compile(r"[A-Za-z0-9-]+")
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]",
            "-": "-"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class GrammarError(SettingError):
    """A grammar (or the schema it came from) the runtime refuses, saying where and why."""


@dataclass
class _Item:
    """One item of a sequence: a terminal (``kind`` "char", "token" or "empty" for
    ``""``), a rule reference (``name``), or a group of alternatives; repeated at least
    ``min_times`` times."""

    kind: str
    name: str = ""
    alternatives: list[list[_Item]] = field(default_factory=list)
    min_times: int = 1
    size: int = 1  # its symbols in the rule (a literal's characters; repetitions copy them)


def _is_word_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    """llama.cpp's grammar parser, rule for rule, keeping what the checks need: each
    rule's alternatives, where each name is used and defined, and the expanded size."""

    def __init__(self, src: str, n_vocab: int | None,
                 token_of: Callable[[str], int | None]) -> None:
        self.src = src
        self.n_vocab = n_vocab  # None: token references are not checked
        self.token_of = token_of
        self.rules: dict[str, list[list[_Item]]] = {}
        self.defined_at: dict[str, int] = {}
        self.used_at: dict[str, int] = {}
        self.size = 0
        self.depth = 0  # parentheses open

    # -- errors ---------------------------------------------------------------------------

    def fail(self, pos: int, message: str) -> GrammarError:
        line = self.src.count("\n", 0, pos) + 1
        column = pos - (self.src.rfind("\n", 0, pos) + 1) + 1
        near = self.src[pos:pos + 20].split("\n")[0]
        where = f"line {line}, column {column}" + (f" (at {near!r})" if near else "")
        return GrammarError("grammar", f"is not valid GBNF: {where}: {message}")

    def at(self, pos: int) -> str:
        return self.src[pos] if pos < len(self.src) else ""

    # -- lexical --------------------------------------------------------------------------

    def space(self, pos: int, newline_ok: bool) -> int:
        blank = _PLAIN_SPACE_NEWLINES if newline_ok else _PLAIN_SPACE
        while match := blank.match(self.src, pos):
            if match.end() == pos:
                break
            pos = match.end()
        return pos

    def name(self, pos: int) -> int:
        match = _NAME.match(self.src, pos)
        if match is None:
            raise self.fail(pos, "expecting a rule name")
        return match.end()

    def integer(self, pos: int) -> tuple[int, int]:
        end = pos
        while self.at(end).isascii() and self.at(end).isdigit():
            end += 1
        if end == pos:
            raise self.fail(pos, "expecting an integer")
        return int(self.src[pos:end]), end

    def char(self, pos: int) -> tuple[int, int]:
        """A character (its code point, as llama.cpp reads it) and where the next starts."""
        c = self.at(pos)
        if not c:
            raise self.fail(pos, "unexpected end of input")
        if c != "\\":
            return ord(c), pos + 1
        kind = self.at(pos + 1)
        if kind in _HEX_DIGITS:
            digits = self.src[pos + 2:pos + 2 + _HEX_DIGITS[kind]]
            if len(digits) != _HEX_DIGITS[kind] or any(
                    d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(pos, f"expecting {_HEX_DIGITS[kind]} hex digits after \\{kind}")
            return int(digits, 16), pos + 2 + len(digits)
        if kind in _ESCAPES:
            return ord(_ESCAPES[kind]), pos + 2
        raise self.fail(pos, f"unknown escape \\{kind}" if kind else "unexpected end of input")

    # -- structure ------------------------------------------------------------------------

    def parse(self) -> None:
        if "\x00" in self.src:
            raise self.fail(self.src.index("\x00"), "a NUL character (llama.cpp reads the "
                                                    "grammar as a C string, which ends there)")
        pos = self.space(0, True)
        while pos < len(self.src):
            pos = self.rule(pos)
        for name, used in self.used_at.items():
            if name not in self.rules:
                raise self.fail(used, f"undefined rule {name!r}")
        if ROOT not in self.rules:
            raise GrammarError("grammar", f"is not valid GBNF: it has no {ROOT!r} rule "
                                          "(where the output starts)")
        self.check_size()
        self.check_left_recursion()

    def check_size(self) -> None:
        """Checked as the grammar is read: a large one is refused before it is all read."""
        if self.size > MAX_GRAMMAR_SYMBOLS:
            raise GrammarError("grammar", f"expands to {self.size} symbols once its "
                                          f"repetitions are written out; at most "
                                          f"{MAX_GRAMMAR_SYMBOLS} are accepted")

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.src[pos:end]
        pos = self.space(end, False)
        if self.src[pos:pos + 3] != "::=":
            raise self.fail(pos, f"expecting ::= after the rule name {name!r}")
        pos = self.space(pos + 3, True)
        alternatives, pos = self.alternates(pos, nested=False)
        self.size += 1  # (its end)
        # (A rule defined twice: llama.cpp keeps the last definition.)
        self.rules[name] = alternatives
        self.defined_at[name] = end
        if self.at(pos) == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif self.at(pos) == "\n":
            pos += 1
        elif pos < len(self.src):
            raise self.fail(pos, "expecting a newline or the end after the rule")
        return self.space(pos, True)

    def alternates(self, pos: int, nested: bool) -> tuple[list[list[_Item]], int]:
        first, pos = self.sequence(pos, nested)
        alternatives = [first]
        while self.at(pos) == "|":
            pos = self.space(pos + 1, True)
            seq, pos = self.sequence(pos, nested)
            alternatives.append(seq)
            self.size += 1
        return alternatives, pos

    def sequence(self, pos: int, nested: bool) -> tuple[list[_Item], int]:
        items: list[_Item] = []
        while pos < len(self.src):
            self.check_size()
            c = self.at(pos)
            if c == '"':
                pos += 1
                n = 0
                while self.at(pos) != '"':
                    if plain := _PLAIN_LITERAL.match(self.src, pos):
                        n += plain.end() - pos
                        pos = plain.end()
                        continue
                    if not self.at(pos):
                        raise self.fail(pos, "unexpected end of input inside a literal")
                    _, pos = self.char(pos)
                    n += 1
                items.append(_Item("char" if n else "empty", size=n))
                self.size += n
                pos = self.space(pos + 1, nested)
            elif c == "[":
                pos += 1
                if self.at(pos) == "^":
                    pos += 1
                while self.at(pos) != "]":
                    if not self.at(pos):
                        raise self.fail(pos, "unexpected end of input inside a character "
                                             "class")
                    _, pos = self.char(pos)
                    if self.at(pos) == "-" and self.at(pos + 1) != "]":
                        if not self.at(pos + 1):
                            raise self.fail(pos, "unexpected end of input in a range")
                        _, pos = self.char(pos + 1)
                items.append(_Item("char"))
                self.size += 1
                pos = self.space(pos + 1, nested)
            elif c in "<!":
                start = pos
                if c == "!":
                    pos += 1
                pos = self.token(pos, start)
                items.append(_Item("token"))
                self.size += 1
                pos = self.space(pos, nested)
            elif _is_word_char(c):
                end = self.name(pos)
                name = self.src[pos:end]
                self.used_at.setdefault(name, pos)
                items.append(_Item("ref", name=name))
                self.size += 1
                pos = self.space(end, nested)
            elif c == "(":
                start = pos
                self.depth += 1
                if self.depth > MAX_NESTING:
                    raise self.fail(start, f"parentheses nest deeper than {MAX_NESTING} "
                                           "levels")
                alternatives, pos = self.alternates(self.space(pos + 1, True), nested=True)
                if self.at(pos) != ")":
                    raise self.fail(start, "this ( is never closed")
                self.depth -= 1
                items.append(_Item("group", alternatives=alternatives))
                self.size += 1
                pos = self.space(pos + 1, nested)
            elif c == ".":
                items.append(_Item("char"))
                self.size += 1
                pos = self.space(pos + 1, nested)
            elif c in "*+?{":
                if not items:
                    raise self.fail(pos, f"{c} repeats nothing (it must follow an item)")
                pos = self.repetition(pos, items[-1], nested)
            else:
                break
        return items, pos

    def token(self, pos: int, start: int) -> int:
        if self.at(pos) != "<":
            raise self.fail(pos, "expecting < after !")
        end = self.src.find(">", pos)
        if end < 0:
            raise self.fail(start, "this token reference is never closed with >")
        inner = self.src[pos + 1:end]
        if inner.startswith("[") and inner.endswith("]"):
            digits = inner[1:-1]
            if not (digits.isascii() and digits.isdigit()):
                raise self.fail(start, f"expecting a token id in <[...]>, got {inner!r}")
            if self.n_vocab is not None and int(digits) >= self.n_vocab:
                raise self.fail(start, f"token id {digits} is outside the vocabulary "
                                       f"(0 to {self.n_vocab - 1})")
        elif self.n_vocab is not None and self.token_of(self.src[pos:end + 1]) is None:
            raise self.fail(start, f"{self.src[pos:end + 1]!r} is not one token of this "
                                   "model's vocabulary")
        return end + 1

    def repetition(self, pos: int, item: _Item, nested: bool) -> int:
        start, c = pos, self.at(pos)
        pos = self.space(pos + 1, nested)
        if c in "*+?":
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        else:
            if not (self.at(pos).isascii() and self.at(pos).isdigit()):
                raise self.fail(pos, "expecting a number after {")
            low, pos = self.integer(pos)
            pos = self.space(pos, nested)
            high = low
            if self.at(pos) == ",":
                pos = self.space(pos + 1, nested)
                high = None
                if self.at(pos).isascii() and self.at(pos).isdigit():
                    high, pos = self.integer(pos)
                    pos = self.space(pos, nested)
            if self.at(pos) != "}":
                raise self.fail(pos, "expecting } to close the repetition")
            pos = self.space(pos + 1, nested)
            if low > MAX_REPETITIONS:
                raise self.fail(start, f"a repetition of at least {low} exceeds llama.cpp's "
                                       f"limit of {MAX_REPETITIONS}")
            if high is not None and high > MAX_REPETITIONS:
                # (llama.cpp would read it as no maximum: not the grammar given)
                raise self.fail(start, f"a repetition of at most {high} exceeds llama.cpp's "
                                       f"limit of {MAX_REPETITIONS} (it would allow any "
                                       f"number); write * or + for no maximum")
            if high is not None and high < low:
                raise self.fail(start, f"repetition {{{low},{high}}}: the minimum is above "
                                       "the maximum")
        # llama.cpp writes S{m,n} as m copies of S's symbols in the rule, then a chain of
        # n - m optional rules (one when unbounded), each holding S once more.
        optional = 1 if high is None else high - low
        expanded = item.size * low + (1 if optional else 0)
        self.size += expanded - item.size + optional * (item.size + 3)
        item.size = expanded
        item.min_times *= low
        return pos

    # -- left recursion -------------------------------------------------------------------

    def check_left_recursion(self) -> None:
        """llama.cpp cannot run a rule that may reach itself before consuming anything."""
        nullable: dict[str, bool] = dict.fromkeys(self.rules, False)

        def seq_nullable(seq: list[_Item]) -> bool:
            return all(item_nullable(i) for i in seq)

        def item_nullable(item: _Item) -> bool:
            if item.min_times == 0 or item.kind == "empty":
                return True
            if item.kind == "ref":
                return nullable[item.name]
            if item.kind == "group":
                return any(seq_nullable(s) for s in item.alternatives)
            return False

        changed = True
        while changed:
            changed = False
            for name, alternatives in self.rules.items():
                if not nullable[name] and any(seq_nullable(s) for s in alternatives):
                    nullable[name] = changed = True

        def leftmost(alternatives: list[list[_Item]], out: set[str]) -> None:
            for seq in alternatives:
                for item in seq:
                    if item.kind == "ref":
                        out.add(item.name)
                    elif item.kind == "group":
                        leftmost(item.alternatives, out)
                    if not item_nullable(item):
                        break

        firsts: dict[str, set[str]] = {}
        for name, alternatives in self.rules.items():
            firsts[name] = set()
            leftmost(alternatives, firsts[name])
        for name in self.rules:
            seen, todo = set(), list(firsts[name])
            while todo:
                other = todo.pop()
                if other == name:
                    raise self.fail(self.defined_at[name] - len(name),
                                    f"rule {name!r} is left-recursive (it can reach itself "
                                    "before matching anything), which llama.cpp cannot run")
                if other not in seen:
                    seen.add(other)
                    todo.extend(firsts[other])


def check_gbnf(text: str, n_vocab: int | None,
               token_of: Callable[[str], int | None] = lambda _: None) -> None:
    """Raise :class:`GrammarError` unless ``text`` is GBNF llama.cpp can run: parsed by
    its rules, every rule defined, a ``root``, no left recursion, repetitions it can
    expand, within :data:`MAX_GRAMMAR_SYMBOLS` and :data:`MAX_NESTING`. ``token_of`` maps
    a ``<token>`` reference to its id (None: not one token); with ``n_vocab`` None (no
    model at hand: the gateway) token references are not checked."""
    _Parser(text, n_vocab, token_of).parse()


def expanded_symbols(text: str) -> int:
    """The symbols of GBNF ``text`` once llama.cpp has written out its repetitions (the
    measure :data:`MAX_GRAMMAR_SYMBOLS` bounds); :class:`GrammarError` as
    :func:`check_gbnf` (token references unchecked)."""
    parser = _Parser(text, None, lambda _: None)
    parser.parse()
    return parser.size


# The port's rule for a character of a JSON string lets control characters through (raw
# newlines, \x16: invalid JSON, seen in its output); llama.cpp's own converter excludes
# them, as JSON does. Excluded too: what llama.cpp's UTF-8 decoder takes for a character
# but is none (surrogates; "code points" beyond U+10FFFF, which it makes of any byte from
# 0xF5 on: invalid UTF-8, seen in its output as one character of a maxLength that Python
# decodes to four U+FFFD).
_PORT_JSON_CHAR = r'char ::= [^"\\] | '
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F\uD800-\uDFFF\U00110000-\UFFFFFFFF] | '


def json_schema_to_gbnf(schema_json: str, name: str = "root") -> str:
    """llama.cpp's JSON-Schema-to-GBNF converter (as llama-cpp-python ports it, with
    JSON strings' characters limited to those JSON and UTF-8 allow unescaped): the
    grammar of one JSON value valid for the schema, its rule named ``name``. Raises what
    the converter raises on a schema it cannot convert."""
    converter = converter_class()(prop_order={}, allow_fetch=False, dotall=False,
                                  raw_pattern=False)
    schema = converter.resolve_refs(json.loads(schema_json), "input")
    converter.visit(schema, "" if name == "root" else name)
    return "\n".join(_JSON_CHAR + line[len(_PORT_JSON_CHAR):]
                     if line.startswith(_PORT_JSON_CHAR) else line
                     for line in converter.format_grammar().split("\n"))


def json_schema_grammar(schema: Mapping[str, Any] | str, name: str = ROOT) -> str:
    """GBNF for one JSON value valid for ``schema`` (a dict or its JSON text), the value's
    rule named ``name`` (``root`` by default; another name lets a grammar embed it, e.g.
    ``root ::= "<tool_call>" call "</tool_call>"`` with ``name="call"``). Raises
    :class:`GrammarError` naming what could not be converted."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        parsed = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise GrammarError("json_schema", f"is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise GrammarError("json_schema", f"must be a JSON object (a schema), got "
                                          f"{type(parsed).__name__}")
    try:
        schema_cost(parsed, "json_schema")
    except BudgetError as exc:
        raise GrammarError(exc.param, exc.message) from None
    try:
        return json_schema_to_gbnf(text, name)
    except RecursionError:
        raise GrammarError("json_schema", "nests too deeply to convert") from None
    except Exception as exc:  # the converter raises bare asserts, KeyErrors, ValueErrors
        raise GrammarError("json_schema", f"cannot be converted to a grammar: "
                                          f"{_converter_message(exc)}") from None


def _converter_message(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"unknown reference or type {exc.args[0]!r}"
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


JSON_OBJECT_SCHEMA: Mapping[str, Any] = {"type": "object"}


def grammar_of(grammar: str, json_schema: Mapping[str, Any] | str | None,
               json_object: bool) -> str:
    """The GBNF a request's output must follow ("" for none), from whichever of
    ``grammar``, ``json_schema`` and ``json_object`` it gives (at most one)."""
    given = [n for n, v in (("grammar", grammar), ("json_schema", json_schema),
                            ("json_object", json_object)) if v]
    if len(given) > 1:
        raise SettingError(given[1], f"cannot be combined with {given[0]}: give one "
                                     "constraint of the output")
    if json_schema is not None and json_schema != "" and not given:
        raise SettingError("json_schema", "must not be empty")
    if json_object:
        return json_schema_grammar(JSON_OBJECT_SCHEMA)
    if json_schema:
        return json_schema_grammar(json_schema)
    if not isinstance(grammar, str):
        raise SettingError("grammar", f"must be GBNF text, got {type(grammar).__name__}")
    return grammar


def check_grammar(model: Any, text: str) -> None:
    """Refuse a grammar this model's llama.cpp cannot use, with the reason: checked by
    :func:`check_gbnf`, then compiled once by llama.cpp (any thread: it reads only the
    vocabulary)."""
    from .llama_backend import grammar_refusal

    def token_of(ref: str) -> int | None:  # (as llama.cpp reads <...>: the text with <>)
        ids = model.tokenize(ref, add_special=False, parse_special=True)
        return ids[0] if len(ids) == 1 else None

    check_gbnf(text, model.n_vocab, token_of)
    refusal = grammar_refusal(model, text)
    if refusal is not None:
        raise GrammarError("grammar", f"was refused by llama.cpp: {refusal}")
