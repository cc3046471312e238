"""The gateway's shape, held by the code itself (model_runtime/gateway/__init__.py):

* Its folders are layered, bottom first: ``workers`` (processes and the calls to them),
  ``pipeline`` (what every API's request goes through), ``apis`` (each API's adapter,
  formatter and routes), then the application (``app``, ``server``, ``command``). A
  module imports nothing of a layer above its own: the pipeline knows no API, the
  workers know neither.
* No API imports another's formatter or routes (what they share is the pipeline's).
* No module imports another inside a function (an import circle dodged so; the command
  line's lazy imports, which keep ``model-runtime --help`` quick, aside), and the
  modules' imports form no circle.
* No function has more than 12 parameters (the command line's aside), no module more than
  650 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from harness.procs import REPO

GATEWAY = REPO / "model_runtime" / "gateway"
PACKAGE = "model_runtime.gateway"
# Layers, bottom first; a module outside the folders is placed by its name.
LAYERS = {"__init__": 0, "errors": 0, "limits": 0, "connections": 0, "keys": 0,
          "settings": 1, "workers": 2, "metrics": 2, "fleet": 3, "pipeline": 4, "apis": 5,
          "app": 6, "server": 7, "command": 8}
COMMAND_LINE = {"command.py"}  # click's options are its parameters; its imports are lazy
MAX_PARAMETERS = 12
MAX_LINES = 650


def module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY).with_suffix("").parts
    return ".".join([PACKAGE, *parts]).removesuffix(".__init__")


def layer(module: str) -> int:
    top = module.removeprefix(PACKAGE).lstrip(".").split(".")[0] or "__init__"
    return LAYERS[top]


def sources() -> list[Path]:
    return sorted(GATEWAY.rglob("*.py"))


MODULES = {module_name(path) for path in sources()}


def gateway_imports(path: Path, tree: ast.Module) -> list[tuple[ast.stmt, str]]:
    """Each gateway module ``tree`` imports (relative imports made absolute), with the
    statement that imports it."""
    mine = module_name(path)
    package = mine if path.name == "__init__.py" else mine.rsplit(".", 1)[0]
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] \
                if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            # `from . import x` names a module; `from .x import y` names one of x's.
            named = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.extend((node, name) for name in named or
                         ([target] if target in MODULES else []))
        elif isinstance(node, ast.Import):
            found.extend((node, a.name) for a in node.names if a.name in MODULES)
    return found


def test_a_module_imports_nothing_of_a_layer_above_its_own() -> None:
    wrong = []
    for path in sources():
        mine = module_name(path)
        for _, name in gateway_imports(path, ast.parse(path.read_text())):
            if layer(name) > layer(mine):
                wrong.append(f"{mine} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_an_api_uses_no_other_api_s_formatter_or_routes() -> None:
    wrong = []
    for path in sources():
        mine = module_name(path)
        if not mine.startswith(f"{PACKAGE}.apis."):
            continue
        api = mine.split(".")[3]
        for _, name in gateway_imports(path, ast.parse(path.read_text())):
            parts = name.split(".")
            if len(parts) > 4 and parts[2] == "apis" and parts[3] != api and \
                    parts[4] in ("formatter", "routes"):
                wrong.append(f"{mine} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_inside_a_function_and_no_circle() -> None:
    inside, graph = [], {}
    for path in sources():
        mine = module_name(path)
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        edges = set()
        for node, name in gateway_imports(path, tree):
            if id(node) not in top_level and path.name not in COMMAND_LINE:
                inside.append(f"{mine}:{node.lineno} imports {name}")
            if name != mine:
                edges.add(name)
        graph[mine] = edges
    assert not inside, "\n".join(inside)
    # Depth-first search for a back edge.
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                raise AssertionError(" -> ".join([*path, module, other]))
            if other not in state:
                visit(other, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_no_function_takes_more_than_12_parameters_and_no_module_is_over_650_lines() -> None:
    wrong = []
    for path in sources():
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            wrong.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        if path.name in COMMAND_LINE:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                count = len([n for n in names if n not in ("self", "cls")])
                if count > MAX_PARAMETERS:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                                 f"{count} parameters")
    assert not wrong, "\n".join(wrong)
