"""The size rules of the code, held by the code: no module of kvcache or model_runtime over
650 lines, and no function taking more than 12 parameters (``self`` and ``cls`` not
counted), outside the command-line modules, whose commands take their options as
parameters. (A request of the runtime is one object, model_runtime.completion_request's
CompletionRequest, and a sampler chain is made of its sampling part: neither takes its
fields one by one.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from harness.procs import REPO

PACKAGES = ("kvcache", "model_runtime")
MAX_LINES = 650
MAX_PARAMETERS = 12
# A command's options are its parameters (click passes each as one).
COMMAND_LINE = ("kvcache/cli/", "model_runtime/cli.py", "model_runtime/gateway/command.py")


def modules() -> list[Path]:
    found = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
             if "v1" not in p.relative_to(REPO).parts]
    assert len(found) > 100, "the scan found almost nothing: is it broken?"
    return found


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef
                                                                  | ast.AsyncFunctionDef]]:
    """Every function and method, by its qualified name (nested ones included)."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((prefix + node.name, node))
            out += functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            out += functions(node, f"{prefix}{node.name}.")
    return out


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_module_is_over_650_lines() -> None:
    long = {relative(p): n for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_function_takes_more_than_12_parameters() -> None:
    over = {}
    for path in modules():
        name = relative(path)
        if name.startswith(COMMAND_LINE):
            continue
        for qualname, fn in functions(ast.parse(path.read_text(), name)):
            if parameters(fn) > MAX_PARAMETERS:
                over[(name, qualname)] = parameters(fn)
    assert over == {}


# --------------------------------------------------------------------------- tests

DAEMON_FIXTURES = {"daemon", "daemon_factory", "module_daemon", "module_daemon_factory"}
DAEMON_CLASSES = {"DaemonProcess", "Daemon"}  # the harness's class, by either name


def fixtures(tree: ast.AST) -> list[tuple[ast.FunctionDef, str]]:
    """The fixture functions of a module, with their scope."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not ast.unparse(decorator).startswith("pytest.fixture"):
                continue
            keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
            scope = next((ast.literal_eval(k.value) for k in keywords if k.arg == "scope"),
                         "function")
            found.append((node, scope))
    return found


def test_the_daemon_fixtures_are_defined_once() -> None:
    """tests/conftest.py's daemon fixtures are the only ones of their names, and a daemon
    shared beyond one test comes from them: no fixture of a wider scope than a test's
    starts one itself (a module's gateway, runtime or daemons take theirs from
    ``module_daemon`` or ``module_daemon_factory``)."""
    redefined, own_shared = [], []
    paths = sorted((REPO / "tests").rglob("*.py"))
    for path in paths:
        name = relative(path)
        for fn, scope in fixtures(ast.parse(path.read_text(), name)):
            if fn.name in DAEMON_FIXTURES and name != "tests/conftest.py":
                redefined.append(f"{name}::{fn.name}")
            calls = {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
            if scope != "function" and calls & DAEMON_CLASSES:
                own_shared.append(f"{name}::{fn.name}")
    assert len(paths) > 100, "the scan found almost nothing: is it broken?"
    assert (redefined, own_shared) == ([], [])
