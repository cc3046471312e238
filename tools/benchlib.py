"""Small helpers shared by the benchmarks in tools/: timing, percentiles, page-cache
control, machine info, JSON output, and a kvcache daemon run as a child process.

Kept free of any import from tests/ (tools must run without the test suite).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import json
import mmap
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvcache.index import dir_fsync
from kvcache.ramtier import tier_dir
from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the JSON document."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- timing and statistics -------------------------------------------------------------------


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


def target(name: str, value: float, limit: float, op: str = "<=", unit: str = "",
           primary: bool = True) -> dict[str, Any]:
    """One target check. Secondary targets apply a primary target's bar to a variant the
    brief asks to report alongside it (streaming save, start-up with a rebuilt index)."""
    ok = value <= limit if op == "<=" else value < limit
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


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
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


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": _cpu_model(),
        "mem_total_bytes": _mem_total_bytes(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in
                     ("kvcache", "grpcio", "lmdb", "protobuf", "zstandard", "xxhash",
                      "msgpack", "numpy")},
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
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


# -- a daemon in a child process -------------------------------------------------------------


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` (Linux): the child gets SIGTERM if the benchmark dies without
    stopping it. libc and its prctl are looked up here, in the parent: between fork and
    exec the child makes one plain call (no dlopen or symbol lookup, whose locks another
    thread of the parent may hold)."""
    try:
        prctl = _load_libc().prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


class Daemon:
    """``python -m kvcache.cli serve`` in a child process, on a short unix socket path.

    ``start()`` returns the seconds from spawning the process to its first successful
    Stats RPC (the start-up time a client sees).
    """

    def __init__(self, data_dir: Path, ram_parent: Path, *extra_args: str, name: str = "daemon",
                 log_dir: Path | None = None) -> None:
        self.data_dir = data_dir
        self.ram_parent = ram_parent  # --ram-dir: the tier is the daemon's own subfolder
        self.extra_args = list(extra_args)
        self.name = name
        # sun_path is 108 bytes: keep the socket in a short directory of its own.
        self._sock_dir = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.socket = self._sock_dir / "kv.sock"
        self.log_path = (log_dir or data_dir.parent) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    @property
    def ram_dir(self) -> Path:
        """The RAM tier folder the daemon makes under ``ram_parent``."""
        return tier_dir(self.data_dir, self.ram_parent)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "kvcache.cli", "serve", "--dir", str(self.data_dir),
                "--socket", str(self.socket), "--ram-dir", str(self.ram_parent),
                "--min-free-bytes", "0", "--log-level", "WARNING", *self.extra_args]

    def start(self, timeout: float = 60.0) -> float:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} is already running")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p))
        preexec = die_with_parent()
        with open(self.log_path, "ab") as log_file:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.argv(), stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env,
                                         preexec_fn=preexec)
        self._wait_ready(t0 + timeout)
        return time.perf_counter() - t0

    def _wait_ready(self, deadline: float) -> None:
        """Poll for the socket every 2 ms, then one Stats RPC that waits for the channel.
        Short reconnect backoffs keep the measured time within a few ms of the truth."""
        while not self.socket.exists():
            self._check_alive()
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name}: no socket before the deadline\n{self.log_tail()}")
            time.sleep(0.002)
        options = [("grpc.initial_reconnect_backoff_ms", 5), ("grpc.min_reconnect_backoff_ms", 5),
                   ("grpc.max_reconnect_backoff_ms", 20)]
        with grpc.insecure_channel(self.address, options=options) as channel:
            stub = pb_grpc.KVCacheStub(channel)
            while True:
                self._check_alive()
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise RuntimeError(f"{self.name}: no Stats answer in time\n{self.log_tail()}")
                try:
                    stub.Stats(pb.StatsRequest(), timeout=min(left, 1.0), wait_for_ready=True)
                    return
                except grpc.RpcError:
                    continue

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.proc = None
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log_tail()}")

    def log_tail(self, n_chars: int = 3000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n_chars:]

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop it and remove its socket folder and RAM tier (a tier outlives its daemon
        on purpose, so nothing else would)."""
        self.stop()
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        shutil.rmtree(self.ram_dir, ignore_errors=True)
