"""Where the code counts: counter names found in the source, for the check that every
declared counter is counted and every counted one declared."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from harness.procs import REPO


def _strings(node: ast.AST) -> Iterator[ast.Constant | ast.JoinedStr]:
    """String literals and f-strings in an expression (not the pieces of an f-string)."""
    if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                           and isinstance(node.value, str)):
        yield node  # type: ignore[misc]
        return
    for child in ast.iter_child_nodes(node):
        yield from _strings(child)


def _pattern(node: ast.JoinedStr) -> str:
    """An f-string as a regex over counter names: each ``{...}`` is a name part."""
    return "".join(re.escape(part.value) if isinstance(part, ast.Constant) else "[a-z_]+"
                   for part in node.values)


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def counter_uses(files: list[Path]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Counter names used in ``files``: literal names and f-string patterns (as regexes),
    each with where it is used. Found in ``counters[...]`` subscripts, ``self.count(...)``
    and ``self._count(...)`` calls, and arguments to (and defaults of) any function's
    ``counter`` parameter (e.g. ``_remove_entry(record, "evictions_disk")``)."""
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    helpers: dict[str, int] = {}  # function name -> position of its `counter` argument
    found: list[tuple[ast.AST, Path]] = []
    for f, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args]
                if "counter" in params:
                    helpers[node.name] = params.index("counter") - (params[:1] == ["self"])
                    default_at = params.index("counter") - (len(params) - len(a.defaults))
                    if default_at >= 0:
                        found.append((a.defaults[default_at], f))
                for p, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
                    if p.arg == "counter" and default is not None:
                        found.append((default, f))
                        helpers.setdefault(node.name, -1)
    for f, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript):
                target = node.value
                name = target.attr if isinstance(target, ast.Attribute) else \
                    getattr(target, "id", "")
                if name == "counters":
                    found.append((node.slice, f))
            elif isinstance(node, ast.Call):
                callee = _callee(node)
                is_self = isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                if callee in ("count", "_count") and is_self and node.args:
                    found.append((node.args[0], f))
                elif callee in helpers:
                    at = helpers[callee]
                    if 0 <= at < len(node.args):
                        found.append((node.args[at], f))
                    found.extend((k.value, f) for k in node.keywords if k.arg == "counter")
    literals: dict[str, list[str]] = {}
    patterns: dict[str, list[str]] = {}
    for expr, f in found:
        for s in _strings(expr):
            where = f"{f.relative_to(REPO)}:{s.lineno}"
            if isinstance(s, ast.JoinedStr):
                patterns.setdefault(_pattern(s), []).append(where)
            else:
                literals.setdefault(s.value, []).append(where)
    return literals, patterns
