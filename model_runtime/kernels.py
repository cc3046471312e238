"""Which build of llama.cpp's CPU kernels a process runs: chosen before llama.cpp loads.

llama-cpp-python loads its shared libraries once, when ``llama_cpp`` is first imported,
from ``LLAMA_CPP_LIB_PATH`` if set. ``tools/build_kernels.sh`` (run by ``tools/setup.sh``)
builds two sets beside the virtualenv's llama-cpp-python, each a folder of its libraries
with its own ``libggml-cpu``:

``deterministic`` (the default)
    llamafile's tinyBLAS for every float product, single tokens included (a one-line
    patch: llama.cpp leaves products of one token to ggml's vec_dot, which sums in another
    order), and no weight repacking or tiled K-quant kernels. A token is computed bit for
    bit alike alone or anywhere in a batch: every reuse of KV continues exactly as a cold
    prefill would (README, "Warm equals cold").
``fast``
    llama.cpp's defaults, as llama-server runs them: llamafile as shipped, weight
    repacking and tiled K-quant kernels. A reused state may continue otherwise than a
    cold run (llama-server's README says as much of its own prompt cache).

Without the sets (a bare ``pip install``), the library llama-cpp-python was built with is
used: ``tools/setup.sh`` builds it without llamafile and repacking, deterministic too but
slower on attention (``builtin``).

:func:`choose` runs when ``model_runtime`` is imported, before anything of it can import
``llama_cpp``; it reads :data:`ENV`. A command line's ``--kernels`` is taken by starting
the command again with :data:`ENV` set (:func:`relaunch_with`): a library once loaded
cannot be swapped. Pure standard library: nothing here may load llama.cpp.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "MODEL_RUNTIME_KERNELS"
DIR_ENV = "MODEL_RUNTIME_KERNELS_DIR"  # where the sets are (default: in the virtualenv)
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python's own
DETERMINISTIC, FAST, BUILTIN = "deterministic", "fast", "builtin"
CHOICES = (DETERMINISTIC, FAST)
DEFAULT = DETERMINISTIC


class KernelsError(Exception):
    """A kernel set asked for that this installation does not have."""


def sets_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path(sys.prefix) / "kvcache-kernels")


def folder_of(name: str) -> Path:
    return sets_dir() / name


def built(name: str) -> bool:
    return (folder_of(name) / "libllama.so").is_file()


def requested() -> str:
    """The set :data:`ENV` asks for (the default when unset)."""
    name = os.environ.get(ENV, "").strip().lower() or DEFAULT
    if name not in CHOICES:
        raise KernelsError(f"{ENV}={name!r}: the kernel sets are {', '.join(CHOICES)}")
    return name


def choose() -> None:
    """Point llama-cpp-python at the set :data:`ENV` asks for, unless the process already
    loaded llama.cpp or its caller named a library of its own (``LLAMA_CPP_LIB_PATH``
    naming another folder than the sets': a parent process's choice, inherited, is made
    again). A deterministic set that was not built falls back to the builtin library
    (deterministic too, see the module's docstring); a missing fast set is said when the
    model loads (:func:`check`)."""
    named = os.environ.get(LIB_PATH_ENV)
    if "llama_cpp.llama_cpp" in sys.modules or (named and not _one_of_the_sets(named)):
        return
    try:
        name = requested()
    except KernelsError:
        return  # said by check(), where it can be an error
    if built(name):
        os.environ[LIB_PATH_ENV] = str(folder_of(name))
    elif named:
        del os.environ[LIB_PATH_ENV]


def _one_of_the_sets(folder: str) -> bool:
    return Path(folder).resolve().parent == sets_dir().resolve()


def active() -> str:
    """The set this process loaded: ``deterministic``, ``fast``, ``builtin`` (the
    library llama-cpp-python was built with) or the folder a caller named."""
    import llama_cpp.llama_cpp as lib  # loads llama.cpp if nothing has yet

    loaded = Path(lib._lib._name).resolve().parent  # type: ignore[attr-defined]
    for name in CHOICES:
        if built(name) and loaded == folder_of(name).resolve():
            return name
    if loaded == (Path(lib.__file__).parent / "lib").resolve():
        return BUILTIN
    return str(loaded)


def check() -> str:
    """The set loaded, once it is the one asked for: raises KernelsError when ``fast``
    was asked for and another set is running (the fast set was not built, or llama.cpp
    was loaded before the choice could be made)."""
    name = active()
    wanted = requested()
    if wanted == FAST and name != FAST:
        raise KernelsError(
            f"{ENV}=fast, but this process runs the {name} kernels: "
            + ("build them with `bash tools/build_kernels.sh`" if not built(FAST) else
               "llama.cpp was loaded before model_runtime could choose (import "
               "model_runtime before llama_cpp)"))
    return name


def relaunch_with(name: str) -> None:
    """Start this command again with :data:`ENV` set to ``name``, unless :func:`choose`
    already acted on that set (it is the one :data:`ENV` asks for). Never returns when it
    starts it again."""
    if name not in CHOICES:
        raise KernelsError(f"--kernels {name!r}: the kernel sets are {', '.join(CHOICES)}")
    if requested() == name:
        return
    env = {**os.environ, ENV: name}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "model_runtime", *sys.argv[1:]], env)
