"""Which package may import which: the rule of the module map, held by the code itself.

* The daemon's package (``kvcache``) never depends on the model runtime: importing every
  one of its modules loads no ``model_runtime`` module, and no module of it names one,
  not even in an import inside a function (commands that need a model are
  ``model-runtime``'s).
* ``kvcache.common``, the names and gRPC helpers both packages share, is a leaf: it
  imports nothing else of the project.
* The runtime reaches the daemon through its client and that leaf, never through the
  daemon's server, service, store, index or shared tier.
* The gRPC service (``kvcache.service``) is layered: each of its parts imports only the
  parts below it (SERVICE_LAYERS), and none imports the daemon that serves it
  (``kvcache.server``).
* The store's modules are layered (the map in kvcache/store/__init__.py): each imports
  only modules of the layers below it, never one beside or above it, not even for an
  annotation, and the shared core at the bottom imports nothing else of the store.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from harness.procs import REPO

PROJECT = ("kvcache", "model_runtime")
LEAF = "kvcache.common"
DAEMON_INTERNALS = ("kvcache.server", "kvcache.service", "kvcache.store", "kvcache.index",
                    "kvcache.remote")
# The parts of kvcache.service, bottom first: a part may import those of earlier layers.
SERVICE_LAYERS = (("messages", "filters", "stats"), ("access",), ("base",),
                  ("data_path", "admin"), ("__init__",))
STORE = "kvcache.store"
# The store's layers, bottom first: a module may import modules of lower layers only.
STORE_LAYERS = (
    ("core", "policy", "quotas", "ownership"),
    ("ramtier", "entries"),
    ("eviction",),
    ("placement", "reclaim"),
    ("integrity",),
    ("reads", "publish", "listing"),
    ("prune", "reconcile"),
    ("recovery",),
    ("facade",),
    ("__init__",),
)


def loaded_after(code: str) -> list[str]:
    """The project's modules a clean interpreter holds after running ``code``."""
    report = (f"{code}\nimport json, sys\n"
              f"print(json.dumps(sorted(m for m in sys.modules "
              f"if m.split('.')[0] in {PROJECT!r})))")
    result = subprocess.run([sys.executable, "-c", report], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (relative imports made absolute)."""
    here = list(path.relative_to(REPO).parts[:-1])  # its package
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.add(target)
            # `from . import keys`: the name may be a module of that package.
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def sources(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "v1" not in p.parts)


def test_importing_every_module_of_kvcache_loads_nothing_of_the_runtime() -> None:
    loaded = loaded_after(
        "import pkgutil, importlib, kvcache\n"
        "for m in pkgutil.walk_packages(kvcache.__path__, 'kvcache.'):\n"
        "    importlib.import_module(m.name)")
    assert "kvcache.cli" in loaded and "kvcache.server" in loaded, loaded  # the walk ran
    assert [m for m in loaded if m.split(".")[0] == "model_runtime"] == []


def test_no_module_of_kvcache_names_the_runtime_even_inside_a_function() -> None:
    found = {str(path.relative_to(REPO)): sorted(n for n in imported_names(path)
                                                 if n.split(".")[0] == "model_runtime")
             for path in sources("kvcache")}
    assert len(found) > 30, "the scan found almost nothing: is it broken?"
    assert {path: names for path, names in found.items() if names} == {}


def test_the_shared_module_is_a_leaf() -> None:
    assert loaded_after(f"import {LEAF}") == ["kvcache", LEAF]
    path = REPO / Path(*LEAF.split(".")).with_suffix(".py")
    project = {n for n in imported_names(path) if n.split(".")[0] in PROJECT}
    assert project == set(), "kvcache.common must import nothing of the project"


def test_the_runtime_uses_no_daemon_internals() -> None:
    found = {str(path.relative_to(REPO)): sorted(
        n for n in imported_names(path)
        if any(n == m or n.startswith(f"{m}.") for m in DAEMON_INTERNALS))
        for path in sources("model_runtime")}
    assert {path: names for path, names in found.items() if names} == {}


def store_imports(path: Path) -> set[str]:
    """The store's modules ``path`` imports, by their name in the package (``__init__``:
    the package itself, e.g. ``from . import Store``)."""
    package = REPO / Path(*STORE.split("."))
    found = set()
    for name in imported_names(path):
        parts = name.split(".")
        if parts[:2] != STORE.split(".") or len(parts) < 3:
            continue  # outside the store, or the package named only to import a module
        module = parts[2]
        found.add(module if (package / f"{module}.py").exists() else "__init__")
    return found


def test_each_store_module_imports_only_the_layers_below_it() -> None:
    layer_of = {m: i for i, layer in enumerate(STORE_LAYERS) for m in layer}
    modules = {p.stem: p for p in (REPO / Path(*STORE.split("."))).glob("*.py")}
    assert set(modules) == set(layer_of), "every store module has its layer"
    upward = {name: sorted(m for m in store_imports(path) if layer_of[m] >= layer_of[name])
              for name, path in modules.items()}
    assert {name: found for name, found in upward.items() if found} == {}
    assert store_imports(modules["core"]) == set()
    # The scan sees imports: the facade builds on every part.
    assert store_imports(modules["facade"]) >= {"core", "entries", "publish", "reconcile"}


def test_the_service_parts_import_only_the_parts_below_them() -> None:
    package = REPO / "kvcache" / "service"
    assert {p.stem for p in package.glob("*.py")} == {n for layer in SERVICE_LAYERS
                                                     for n in layer}, "a part with no layer"
    below: set[str] = set()
    found = {}
    for layer in SERVICE_LAYERS:
        for part in layer:
            names = imported_names(package / f"{part}.py")
            parts = {n.split(".")[2] for n in names if n.startswith("kvcache.service.")}
            found[part] = sorted(parts - below)
            if "kvcache.server" in names:
                found[part].append("kvcache.server")
        below.update(layer)
    # the scan saw the imports: the RPCs are built on base
    assert "kvcache.service.base" in imported_names(package / "admin.py")
    assert {part: names for part, names in found.items() if names} == {}


# model_runtime.state, bottom first (the map in its __init__): each module of the format
# imports only those before it; buffers and seams stand beside them, importing none.
STATE = REPO / "model_runtime" / "state"
STATE_ORDER = ("layout", "parse", "cut", "build", "pieces")
STATE_BESIDE = ("buffers", "seams")


def test_the_state_modules_build_only_on_those_before_them() -> None:
    assert {p.stem for p in STATE.glob("*.py")} == {*STATE_ORDER, *STATE_BESIDE, "__init__"}
    found = {}
    for name in (*STATE_ORDER, *STATE_BESIDE, "__init__"):
        names = imported_names(STATE / f"{name}.py")
        inside = {n.split(".")[2] for n in names
                  if n.startswith("model_runtime.state.") and n.count(".") == 2}
        allowed = set(STATE_ORDER[:STATE_ORDER.index(name)]) if name in STATE_ORDER else set()
        # Pure over bytes: nothing of llama.cpp's bindings, nothing else of the runtime.
        outside = {n for n in names if n.split(".")[0] in PROJECT
                   and not n.startswith(("model_runtime.state", "kvcache.client"))}
        found[name] = sorted((inside - allowed) | outside)
    assert {name: names for name, names in found.items() if names} == {}
    # the scan saw the imports: pieces cuts and builds
    assert {"model_runtime.state.cut", "model_runtime.state.build"} <= imported_names(
        STATE / "pieces.py")


def test_an_entry_record_belongs_to_neither_the_index_nor_the_ordering() -> None:
    """kvcache.index keeps the ordering's tables in its transactions, so it imports
    kvcache.ordering; the ordering reads records, which kvcache.record defines: it imports
    nothing of the index, not even for an annotation, and the record neither of them."""
    ordering = imported_names(REPO / "kvcache" / "ordering.py")
    record = imported_names(REPO / "kvcache" / "record.py")
    assert "kvcache.index" not in ordering
    assert "kvcache.record" in ordering  # the scan saw its imports
    assert {"kvcache.index", "kvcache.ordering"} & record == set()
