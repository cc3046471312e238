"""The crash harness's look at the daemon's folders after a restart (tools/crash_harness.py):
no temp file left, and the index and the files agree."""

from __future__ import annotations

from pathlib import Path

from harness.crash_workload import Ledger
from kvcache.store.ramtier import RAM_MARKER
from kvcache.v1 import kvcache_pb2 as pb


def orphans(data_dir: Path, ram_dir: Path) -> list[Path]:
    """Temp files under the data or RAM directory, and anything in the data's tmp/."""
    found = [p for root in (data_dir, ram_dir) for p in root.rglob("*.part")]
    found += [p for p in (data_dir / "tmp").iterdir() if p not in found]
    return found


def index_against_files(data_dir: Path, ram_dir: Path, listed: dict[bytes, pb.Entry],
                        ledger: Ledger) -> None:
    """Every listed entry has its blob file of its size, and its RAM copy when it says it
    has one; every blob or RAM file is listed; no piece is listed without its parent."""
    on_disk: dict[bytes, int] = {}
    for path in (data_dir / "blobs").glob("*/*"):
        if path.suffix != ".kvc":
            if path.suffix != ".part":  # .part files are counted as orphans
                ledger.problem("index_file_mismatches", f"stray file {path}")
            continue
        on_disk[bytes.fromhex(path.stem)] = path.stat().st_size
    in_ram: dict[bytes, int] = {}
    for path in ram_dir.iterdir():
        if path.suffix == ".kvc":
            in_ram[bytes.fromhex(path.stem)] = path.stat().st_size
        elif path.suffix != ".part" and path.name != RAM_MARKER:
            ledger.problem("index_file_mismatches", f"stray file {path}")
    for key, entry in listed.items():
        size = on_disk.pop(key, None)
        if size != entry.size:
            ledger.problem("index_file_mismatches", f"{key.hex()}: indexed with "
                           f"{entry.size} bytes, blob file has {size}")
        ram_size = in_ram.pop(key, None)
        if pb.TIER_RAM in entry.tiers and ram_size != entry.size:
            ledger.problem("index_file_mismatches", f"{key.hex()}: indexed in RAM, "
                           f"RAM copy has {ram_size} bytes")
        elif pb.TIER_RAM not in entry.tiers and ram_size is not None:
            ledger.problem("index_file_mismatches", f"{key.hex()}: a RAM copy the "
                           "index does not know")
    for key, entry in listed.items():  # no piece is visible without its parent
        if entry.parent and entry.parent not in listed:
            ledger.problem("broken_chains", f"{key.hex()}: listed, its parent "
                           f"{entry.parent.hex()} is not")
    for key in on_disk:
        ledger.problem("index_file_mismatches", f"{key.hex()}: blob file not indexed")
    for key in in_ram:
        ledger.problem("index_file_mismatches", f"{key.hex()}: RAM file not indexed")
