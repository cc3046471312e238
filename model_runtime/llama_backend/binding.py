"""What is process-wide in llama.cpp: its backend, its log (silenced, sent to stderr, or
captured for one call), its build options; and :class:`Owner`, the lifetime every object of
this package that holds a llama.cpp pointer shares."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import llama_cpp as _lc

from .. import kernels

__all__ = [
    "BATCH_VARIANT_OPTIONS",
    "LOG_ENV",
    "Owner",
    "batch_variant_options",
    "build_options",
    "capturing_log",
    "compute_apart",
    "ensure_backend",
    "max_parallel_sequences",
    "set_llama_logging",
]

LOG_ENV = "KVCACHE_LLAMA_LOG"


class _LogSink(threading.local):
    """Where llama.cpp's log lines go: stderr when logging is on, and the calling
    thread's capture list while :func:`capturing_log` runs (llama.cpp logs on the thread
    that called it, so a capture holds that call's lines alone)."""

    enabled = False  # process-wide, set by set_llama_logging (class attribute)
    lines: list[str] | None = None  # per thread


_sink = _LogSink()


@_lc.llama_log_callback
def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """The one log callback; a module global so the C callback outlives every caller."""
    line = text.decode("utf-8", errors="replace")
    if _sink.lines is not None:
        _sink.lines.append(line)
    if _LogSink.enabled:
        sys.stderr.write(line)


@contextlib.contextmanager
def capturing_log() -> Iterator[list[str]]:
    """The log lines llama.cpp writes on this thread meanwhile (its reasons for a NULL)."""
    lines: list[str] = []
    _sink.lines = lines
    try:
        yield lines
    finally:
        _sink.lines = None


_backend_lock = threading.Lock()
_backend_ready = False


def set_llama_logging(enabled: bool) -> None:
    """Send llama.cpp/ggml logs to stderr (``True``) or drop them (``False``). Process-wide."""
    _LogSink.enabled = enabled
    _lc.llama_log_set(_log, ctypes.c_void_p(0))


#: llama.cpp's CPU backend computes K-quant (Q2_K..Q6_K, IQ*) matrix products of 8 rows or
#: more with tiled kernels and smaller ones with vec_dot, which round otherwise: a token's
#: scores then depend on the size of the chunk it is decoded in (on Gemma-3-270M's Q4_K
#: weights by up to 3 in a logit, greedy output changing after a restore). The runtime
#: turns the tiled kernels off (this variable read once, at the first product) unless the
#: caller set it or ``GGML_CPU_TILED_MM_FORCE``: prefill of such models is slower, decode
#: (one row) is what it was.
TILED_MM_ENV = "GGML_CPU_TILED_MM"


def ensure_backend(verbose: bool) -> None:
    """Initialize llama.cpp's backend, once per process, its log on or off as
    :data:`LOG_ENV` says (and, but for the fast kernel set, its tiled K-quant kernels
    off, see :data:`TILED_MM_ENV`);
    ``verbose`` turns the log on."""
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            if TILED_MM_ENV not in os.environ and f"{TILED_MM_ENV}_FORCE" not in os.environ \
                    and kernels.active() != kernels.FAST:  # (llama.cpp's default: on)
                os.environ[TILED_MM_ENV] = "0"
            env = os.environ.get(LOG_ENV, "").strip().lower()
            set_llama_logging(env not in ("", "0", "false", "no", "off"))
            _lc.llama_backend_init()
            _backend_ready = True
    if verbose:
        set_llama_logging(True)


def max_parallel_sequences() -> int:
    """The most sequences one context can hold (llama.cpp's compile-time limit)."""
    return int(_lc.llama_max_parallel_sequences())


#: Build options of llama.cpp's CPU backend whose kernels compute a token decoded alone (or
#: at some places in a batch) with other rounding than the same token inside a batch:
#: llamafile's sgemm (f16 attention products; on SmolLM2 the scores after a restored
#: prompt's last token, decoded alone, differed by up to 0.42) and the weight repacking of
#: Q4_0/Q4_K/IQ4_NL (matrix rows in groups of four: on Gemma-3's Q4_K weights, a
#: position's scores depended on the length of the chunk it was computed in).
BATCH_VARIANT_OPTIONS = ("LLAMAFILE", "REPACK")
#: Flash attention, a context's option: llama.cpp computes a single token over 512+ KV
#: cells split across threads, and a batch of rows in tiles, each summing in its own order
#: (on SmolLM2 the last token's scores after 700 cells differed by up to 0.83). The
#: deterministic kernel set computes it by its vec-only path alone (patched).
FLASH_ATTN_OPTION = "FLASH_ATTN"


def build_options() -> dict[str, str]:
    """What llama.cpp reports of its build (``llama_print_system_info``): CPU features and
    options, each ``name -> value`` (e.g. ``{"AVX2": "1", "LLAMAFILE": "1"}``)."""
    info = _lc.llama_print_system_info().decode("utf-8", errors="replace")
    options: dict[str, str] = {}
    for part in info.split("|"):
        name, sep, value = part.rpartition("=")
        if sep:
            options[name.split(":")[-1].strip()] = value.strip()
    return options


def batch_variant_options(*, flash_attn: bool = False) -> list[str]:
    """The options of this llama.cpp build, and flash attention when a context has it, that
    make results depend on batching (the deterministic kernel set's llamafile and flash
    attention are patched not to: see model_runtime/kernels.py)."""
    options = build_options()
    deterministic = kernels.active() == kernels.DETERMINISTIC
    patched = {"LLAMAFILE"} if deterministic else set()
    variant = [name for name in BATCH_VARIANT_OPTIONS
               if options.get(name) == "1" and name not in patched]
    return variant + [FLASH_ATTN_OPTION] if flash_attn and not deterministic else variant


class Owner:
    """Owns a llama.cpp object: ``close()`` frees it; usable as a context manager."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; prefer close()
        with contextlib.suppress(Exception):  # e.g. during interpreter shutdown
            self.close()


_O = TypeVar("_O", bound=Owner)


R = TypeVar("R")


def compute_apart(work: Callable[..., R], *args: Any) -> R:
    """``work(*args)`` run on a thread of its own, which ends with it: for llama.cpp
    computations made before the model thread takes over (start-up checks, measures).

    llama.cpp's CPU backend runs each graph on an OpenMP team of the calling thread, and
    a thread keeps its team for as long as it lives. A team left behind by a thread that
    computed once (the one that built the runtime) competes with the model thread's for
    the cores: on 2 cores every single-token decode took ~3x as long (11 ms, 33 ms with
    the builder's team about, SmolLM2, 2 threads). A thread that ends takes its team
    with it. (tests/runtime/test_runtime.py)"""
    result: list[R] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work(*args))
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="llama-apart")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
