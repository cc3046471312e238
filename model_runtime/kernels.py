"""Which build of llama.cpp's CPU kernels a process runs, and how their threads wait for
work: both chosen before llama.cpp loads.

llama-cpp-python loads its shared libraries once, when ``llama_cpp`` is first imported,
from ``LLAMA_CPP_LIB_PATH`` if set. ``tools/build_kernels.sh`` (run by ``tools/setup.sh``)
builds two sets beside the virtualenv's llama-cpp-python, each a folder of its libraries
with its own ``libggml-cpu``:

``deterministic`` (the default)
    llamafile's tinyBLAS for every float product, single tokens included (a one-line
    patch: llama.cpp leaves products of one token to ggml's vec_dot, which sums in another
    order; a second deals a single token's row tiles to the threads in turn, without
    tinyBLAS's shared counter and barriers, which cost such small products more than
    their sums), and no weight repacking or tiled K-quant kernels. A token is computed
    bit for bit alike alone or anywhere in a batch: every reuse of KV continues exactly
    as a cold prefill would (README, "Warm equals cold").
``fast``
    llama.cpp's defaults, as llama-server runs them: llamafile as shipped, weight
    repacking and tiled K-quant kernels. A reused state may continue otherwise than a
    cold run (llama-server's README says as much of its own prompt cache).

Without the sets (a bare ``pip install``), the library llama-cpp-python was built with is
used: ``tools/setup.sh`` builds it without llamafile and repacking, deterministic too but
slower on attention (``builtin``).

llama.cpp computes each graph on an OpenMP team (libgomp) and synchronizes its threads at
every node with an OpenMP barrier. A thread that arrives first spins, then sleeps:
OpenMP's default spins up to 300,000 times (``spin``, what llama-server runs). On cores
busy with other work (other processes, or this process's own Python: sampling, gRPC, a
gateway) a spinning thread holds the core the thread it waits for needs. ``brief`` (the
default, :data:`WAIT_ENV`) spins 1,000 times (``GOMP_SPINCOUNT``), then sleeps: as fast
on a quiet machine, 3.3x as fast as ``spin`` with two busy processes on 2 cores; sleeping at once
(``OMP_WAIT_POLICY=passive``) made every barrier a system call and a SmolLM2 token ~5x
slower even on a quiet machine (README, "How llama.cpp's threads wait";
``tools/bench_threads_wait.py``). ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set by the
caller without :data:`WAIT_ENV` are left as they are.

:func:`choose` runs when ``model_runtime`` is imported, before anything of it can import
``llama_cpp``; it reads :data:`ENV` and :data:`WAIT_ENV`. A command line's ``--kernels``
and ``--threads-wait`` are taken by starting the command again with the variable set
(:func:`relaunch_with`): a library once loaded cannot be swapped, and libgomp reads its
settings when it loads. Pure standard library: nothing here may load llama.cpp.
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
WAIT_ENV = "MODEL_RUNTIME_THREADS_WAIT"
OMP_WAIT_ENV = "OMP_WAIT_POLICY"  # OpenMP's own
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"  # libgomp's own
BRIEF_SPINS = "1000"  # (1,000-10,000 measured alike quiet; 1,000 best with other work)
BRIEF, SPIN = "brief", "spin"
WAITS = (BRIEF, SPIN)
DEFAULT_WAIT = BRIEF


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
    """The kernel set (:func:`choose_kernels`) and the threads' way of waiting
    (:func:`choose_wait`)."""
    choose_kernels()
    choose_wait()


def requested_wait() -> str:
    """How :data:`WAIT_ENV` asks llama.cpp's threads to wait (the default when unset)."""
    name = os.environ.get(WAIT_ENV, "").strip().lower() or DEFAULT_WAIT
    if name not in WAITS:
        raise KernelsError(f"{WAIT_ENV}={name!r}: the ways to wait are {', '.join(WAITS)}")
    return name


def choose_wait() -> None:
    """Set libgomp's spinning as :data:`WAIT_ENV` asks (``brief``: GOMP_SPINCOUNT 1,000;
    ``spin``: OpenMP's default), unless llama.cpp is loaded already or the caller set
    OpenMP's own variables without :data:`WAIT_ENV`."""
    if "llama_cpp.llama_cpp" in sys.modules or (WAIT_ENV not in os.environ and (
            OMP_WAIT_ENV in os.environ or SPIN_COUNT_ENV in os.environ)):
        return
    try:
        name = requested_wait()
    except KernelsError:
        return  # said by check(), where it can be an error
    os.environ.pop(OMP_WAIT_ENV, None)
    if name == BRIEF:
        os.environ[SPIN_COUNT_ENV] = BRIEF_SPINS
    else:
        os.environ.pop(SPIN_COUNT_ENV, None)


def choose_kernels() -> None:
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
    requested_wait()  # (a bad value is an error here)
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
    if requested() != name:
        _relaunch(ENV, name)


def relaunch_waiting(name: str) -> None:
    """:func:`relaunch_with` for the threads' way of waiting (:data:`WAIT_ENV`)."""
    if name not in WAITS:
        raise KernelsError(f"--threads-wait {name!r}: the ways are {', '.join(WAITS)}")
    if waiting() != name:
        _relaunch(WAIT_ENV, name)


def waiting() -> str:
    """How this process's OpenMP threads wait, as libgomp read it when it loaded:
    ``brief``, ``spin``, or the caller's own OpenMP settings."""
    policy, spins = os.environ.get(OMP_WAIT_ENV), os.environ.get(SPIN_COUNT_ENV)
    if policy is None and spins == BRIEF_SPINS:
        return BRIEF
    if policy is None and spins is None:
        return SPIN
    return " ".join(f"{k}={v}" for k, v in ((OMP_WAIT_ENV, policy), (SPIN_COUNT_ENV, spins))
                    if v is not None)


def _relaunch(variable: str, value: str) -> None:
    env = {**os.environ, variable: value}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "model_runtime", *sys.argv[1:]], env)
