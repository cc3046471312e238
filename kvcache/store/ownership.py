"""What kvcache may touch: only folders it made and marked, and its own file names in them.

A data directory carries a marker file (``.kvcache``). kvcache creates a missing data
directory; it adopts an existing one only when it is marked, empty, or plainly a data
directory of an earlier version; anything else is refused, never cleaned. It never
changes the mode of a folder it did not create: the subfolders it makes are owner-only,
which is what keeps the cached prompts private.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..common import make_private_dirs

DATA_MARKER = ".kvcache"
MARKER_FORMAT = 1
# The names kvcache itself puts in a data directory (the runtime's fingerprint memo and
# default socket, the gateway's stored responses included: they may come before any
# daemon ran there): a folder holding only these is one of ours that merely lacks the
# marker.
DATA_DIR_NAMES = frozenset({"index", "blobs", "tmp", "quarantine", "daemon.lock", "ram",
                            "kvcache.sock", "fingerprints.json", "tenant-secret",
                            "model-runtime.sock", "gateway-responses"})
# Blob files (<key>.kvc) and temp files (<key or lease id>.part): 16 bytes in hex. Only
# names of this shape are ever swept.
_OWN_FILE = re.compile(r"[0-9a-f]{32}\.(kvc|part)")
_MARKER_TMP = re.compile(re.escape(DATA_MARKER) + r"\.[0-9]+\.tmp")


class NotOwned(ValueError):
    """A path kvcache did not make: it refuses to use it rather than change it."""


def is_own_file_name(name: str) -> bool:
    return _OWN_FILE.fullmatch(name) is not None


def write_marker(path: Path, fields: dict[str, Any]) -> None:
    """Write a marker file atomically (a half-written one would make a folder foreign)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**fields, "format": MARKER_FORMAT}, indent=1) + "\n")
    os.replace(tmp, path)


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker's fields, or None when it is missing or not one of ours."""
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) and "format" in fields else None


def _is_earlier_data_dir(root: Path, names: set[str]) -> bool:
    """Made by a kvcache that wrote no marker: its LMDB index beside its lock or blobs."""
    return (root / "index").is_dir() and bool({"daemon.lock", "blobs"} & names)


def check_data_dir(root: Path) -> None:
    """Refuse (NotOwned) a ``root`` kvcache may not use as its data directory; a missing one
    passes. Changes nothing."""
    if not root.exists() and not root.is_symlink():
        return
    if not root.is_dir():
        raise NotOwned(f"{root} is not a directory: choose a new or empty directory for --dir")
    if read_marker(root / DATA_MARKER) is None:
        # Not ours by its marker (none, or a file of that name kvcache did not write):
        # ours only if it holds nothing but kvcache's names (a marker write cut short
        # leaves its temp file).
        names = {n for n in os.listdir(root) if not _MARKER_TMP.fullmatch(n)}
        if not (names <= DATA_DIR_NAMES or _is_earlier_data_dir(root, names)):
            raise NotOwned(f"{root} is not empty and is not a kvcache data directory (no "
                           f"{DATA_MARKER} marker): choose a new or empty directory")


def claim_data_dir(root: Path) -> None:
    """Create ``root`` or adopt it as a data directory (writing the marker), or refuse."""
    check_data_dir(root)
    if not root.exists() and not root.is_symlink():
        make_private_dirs(root)
    if read_marker(root / DATA_MARKER) is None:
        write_marker(root / DATA_MARKER, {
            "what": "kvcache data directory: the prompt-state cache's index and blobs. "
                    "Remove it only when no kvcache daemon uses it."})
