"""Small helpers shared by the benchmarks in tools/: timing, percentiles, page-cache
control, machine info, JSON output, and the benchmarks' settings of procs.Daemon.

Kept free of any import from tests/ (tools must run without the test suite).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import json
import mmap
import operator
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from harness import procs

from kvcache.index import dir_fsync

REPO_ROOT = Path(__file__).resolve().parent.parent
if "pytest" not in sys.modules:  # (a test that imports a benchmark: the session has one)
    procs.use_own_kvcache_dir()  # a benchmark leaves no ~/.cache/kvcache behind


def log(message: str, name: str = "bench") -> None:
    """Progress goes to stderr: stdout carries only the JSON document."""
    print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- timing and statistics -------------------------------------------------------------------


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value}: at least {least}")
        return value
    return parse


# A count of rounds, requests or steps, which a median needs one of (zero left a benchmark
# to fail at its end, with nothing to take the median of).
at_least_one = at_least(1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once; return (seconds, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, like numpy's default."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_s: Sequence[float], unit: str = "ms", tails: bool = True) -> dict[str, Any]:
    """median / p10 / p90 (/ p99 with ``tails``) / min / max / n of samples in seconds,
    reported in ``unit`` ("ms" or "s")."""
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    out: dict[str, Any] = {"unit": unit, "n": len(samples_s)}
    points = (("median", 50), ("p10", 10), ("p90", 90)) + ((("p99", 99),) if tails else ())
    for name, q in points:
        out[name] = round(percentile(samples_s, q) * scale, 4)
    out["min"] = round(min(samples_s) * scale, 4)
    out["max"] = round(max(samples_s) * scale, 4)
    return out


def summary_ms(samples_ms: Sequence[float]) -> dict[str, Any]:
    """median / p10 / p90 / min / max / n of millisecond samples, to 0.01 ms ({"n": 0}
    for none). numpy's median and percentiles: the TTFT benchmarks' figures were always
    computed with them (``percentile`` rounds differently in the last bit)."""
    if not samples_ms:
        return {"n": 0}
    arr = np.asarray(samples_ms, dtype=float)
    stats = {"median": np.median(arr), "p10": np.percentile(arr, 10),
             "p90": np.percentile(arr, 90), "min": arr.min(), "max": arr.max()}
    return {"n": len(arr), **{k: round(float(v), 2) for k, v in stats.items()}}


def ratio_of(a: float | None, b: float | None) -> float | None:
    """a / b to three places; None when either is missing or zero."""
    return round(a / b, 3) if a and b else None


def ratio(numerator: dict[str, Any], denominator: dict[str, Any], stat: str = "median") -> float:
    """Ratio of one statistic of two summaries (same unit)."""
    return round(numerator[stat] / denominator[stat], 3) if denominator[stat] else float("inf")


def paired_ratio(numerator_s: Sequence[float], denominator_s: Sequence[float]) -> float:
    """Median of per-repeat ratios of interleaved samples: robust to slow drifts in
    machine load, which hit both members of a pair alike."""
    ratios = [a / b for a, b in zip(numerator_s, denominator_s, strict=True) if b > 0]
    return round(percentile(ratios, 50), 3)


def throughput_mb_s(n_bytes: int, seconds: float) -> float:
    return round(n_bytes / seconds / 1e6, 1) if seconds > 0 else float("inf")


def target(name: str, value: float | None, limit: float, op: str = "<=", unit: str = "",
           primary: bool = True) -> dict[str, Any]:
    """One target check (a value that could not be measured, None, fails it). Secondary
    targets apply a primary target's bar to a variant the brief asks to report alongside
    it (streaming save, start-up with a rebuilt index)."""
    compare = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}[op]
    ok = value is not None and compare(value, limit)
    return {"name": name, "value": value, "limit": f"{op} {limit}{unit}", "pass": bool(ok),
            "primary": primary}


# -- page cache ------------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def cached_fraction(path: Path) -> float | None:
    """Fraction of a file's pages resident in this kernel's page cache (mincore(2)), or
    None where that cannot be asked. A VM's host may still cache what the guest dropped."""
    try:
        size = path.stat().st_size
        if size == 0:
            return 0.0
        libc = _load_libc()
        page = mmap.PAGESIZE
        n_pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * n_pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                return round(sum(b & 1 for b in bytes(vec)) / n_pages, 4)
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to drop a file's clean pages (dirty pages stay: fsync first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree_from_page_cache(root: Path) -> int:
    """Drop every regular file under ``root`` from the page cache; returns the file count."""
    count = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                drop_from_page_cache(Path(dirpath) / name)
                count += 1
    return count


def read_file_into_new_buffer(path: Path, size: int) -> bytearray:
    """The plain-read baseline: open + readinto a fresh bytearray of the file's size."""
    buf = bytearray(size)
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(buf)
    if got != size:
        raise RuntimeError(f"short read of {path}: {got} of {size} bytes")
    return buf


def write_file(path: Path, data: bytes | memoryview, *, fsync: bool = True,
               rename_to: Path | None = None) -> None:
    """open + write + (fsync) + close; with ``rename_to`` also rename and fsync the
    directory, as a durable publish does."""
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        while view:
            view = view[f.write(view):]
        if fsync:
            os.fsync(f.fileno())
    if rename_to is not None:
        os.rename(path, rename_to)
        dir_fsync(rename_to.parent)


# -- machine ---------------------------------------------------------------------------------


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _mem_total_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def filesystem_of(path: Path) -> dict[str, str]:
    """Mount point, device and type of the filesystem holding ``path`` (from /proc/mounts)."""
    best = {"mount": "", "device": "", "type": ""}
    target_path = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            inside = target_path == mount or target_path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best["mount"]):
                best = {"mount": mount, "device": device, "type": fstype}
    return best


def git_revision(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit of the code under test, and whether kvcache/ has uncommitted edits."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "kvcache_dirty": bool(git("status", "--porcelain", "--", "kvcache"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "kvcache_dirty": None}


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages, to two places."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": cpu_model(),
        "mem_total_bytes": _mem_total_bytes(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": {name: package_version(name) for name in
                     ("kvcache", "grpcio", "lmdb", "protobuf", "zstandard", "xxhash",
                      "msgpack", "numpy")},
        "loadavg_at_start": loadavg(),
        "code": git_revision(),
    }


# -- output ----------------------------------------------------------------------------------


def emit_json(doc: dict[str, Any], out: Path | None) -> None:
    """Print the one JSON document to stdout and, if asked, write it to ``out``."""
    text = json.dumps(doc, indent=2, sort_keys=False, allow_nan=True)
    print(text, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def fmt_ms(ms: float) -> str:
    """A duration for a chart label or a table: seconds from 1 s on, else milliseconds."""
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


# -- a daemon in a child process -------------------------------------------------------------


class Daemon(procs.Daemon):
    """``kvcache serve`` as the benchmarks run it: WARNING-level logs into ``NAME.log`` in
    ``log_dir`` (by default beside the data dir), the RAM tier's parent given, a minute to
    start (a big index is rebuilt at start-up). ``start_seconds`` after ``start()`` is the
    time from spawning it to its first Stats answer (the start-up a client sees)."""

    start_timeout = 60.0
    stop_timeout = 20.0

    def __init__(self, data_dir: Path, ram_parent: Path, *extra_args: str, name: str = "daemon",
                 log_dir: Path | None = None) -> None:
        super().__init__(data_dir, "--log-level", "WARNING", *extra_args, ram_parent=ram_parent,
                         log_path=(log_dir or data_dir.parent) / f"{name}.log", name=name)
