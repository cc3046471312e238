"""The crash harness's look at the daemon's folders after a restart (tools/crash_harness.py):
no temp file left, and the index and the files agree."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

from kvcache.store.ramtier import RAM_MARKER
from kvcache.v1 import kvcache_pb2 as pb


def orphans(data_dir: Path, ram_dir: Path) -> list[Path]:
    """Temp files under the data or RAM directory, and anything in the data's tmp/."""
    found = [p for root in (data_dir, ram_dir) for p in root.rglob("*.part")]
    found += [p for p in (data_dir / "tmp").iterdir() if p not in found]
    return found


def file_sizes(paths: Iterable[Path]) -> dict[bytes, int]:
    """Key -> size of the blob files among ``paths``; one gone meanwhile is left out."""
    sizes = {}
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            sizes[bytes.fromhex(path.stem)] = path.stat().st_size
    return sizes


def index_against_files(data_dir: Path, ram_dir: Path, listed: dict[bytes, pb.Entry]
                        ) -> list[tuple[str, str]]:
    """What disagrees, as (counter, message): every listed entry has its blob file of its
    size, and its RAM copy when it says it has one; every blob or RAM file is listed; no
    piece is listed without its parent."""
    found: list[tuple[str, str]] = []
    blobs = list((data_dir / "blobs").glob("*/*"))
    rams = list(ram_dir.iterdir())
    for path in blobs + rams:  # .part files are counted as orphans
        if path.suffix not in (".kvc", ".part") and path.name != RAM_MARKER:
            found.append(("index_file_mismatches", f"stray file {path}"))
    on_disk = file_sizes(p for p in blobs if p.suffix == ".kvc")
    in_ram = file_sizes(p for p in rams if p.suffix == ".kvc")
    for key, entry in listed.items():
        size = on_disk.pop(key, None)
        if size != entry.size:
            found.append(("index_file_mismatches", f"{key.hex()}: indexed with {entry.size} "
                          f"bytes, blob file has {size}"))
        ram_size = in_ram.pop(key, None)
        if pb.TIER_RAM in entry.tiers and ram_size != entry.size:
            found.append(("index_file_mismatches", f"{key.hex()}: indexed in RAM, RAM copy "
                          f"has {ram_size} bytes"))
        elif pb.TIER_RAM not in entry.tiers and ram_size is not None:
            found.append(("index_file_mismatches", f"{key.hex()}: a RAM copy the index does "
                          "not know"))
    for key, entry in listed.items():  # no piece is visible without its parent
        if entry.parent and entry.parent not in listed:
            found.append(("broken_chains", f"{key.hex()}: listed, its parent "
                          f"{entry.parent.hex()} is not"))
    found += [("index_file_mismatches", f"{key.hex()}: blob file not indexed")
              for key in on_disk]
    found += [("index_file_mismatches", f"{key.hex()}: RAM file not indexed")
              for key in in_ram]
    return found
