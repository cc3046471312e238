"""The store's settings: one frozen dataclass, shared by every part of the store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
# The default bound of a tenant's reserved bytes, in largest entries: a few saves of the
# largest entry in flight at once.
RESERVED_ENTRIES = 4


@dataclass(frozen=True)
class StoreConfig:
    root: Path
    # The folder the RAM tier's own subfolder is made in (see kvcache.store.ramtier); None: a
    # memory file system (/dev/shm) when there is one.
    ram_dir: Path | None = None
    ram_bytes: int = 2 * GiB
    disk_bytes: int = 50 * GiB
    min_free_bytes: int = 1 * GiB
    block_size: int = 256
    lease_seconds: float = 30.0
    pin_seconds: float = 60.0
    # How long a delete waits for the daemon's own work on an entry (its RAM copy being
    # made, a check of its copies, a piece being saved on it) before refusing: an
    # operator's delete right after a save should not fail on a copy it cannot see.
    delete_wait_seconds: float = 5.0
    max_tokens: int = 1 << 20
    max_blob_bytes: int = 16 * GiB  # the largest entry a save may reserve
    # Saves one tenant (entries without a tenant count as one) may have open at once:
    # each holds a temp file and a lease, and a client opening leases without end must
    # run out of its own, not of everyone's.
    max_saves_per_tenant: int = 64
    # Bytes one tenant's open saves may have reserved at once (0: RESERVED_ENTRIES times
    # max_blob_bytes): what its writers may yet write, and push others' entries out for.
    max_reserved_bytes_per_tenant: int = 0
    usage_flush_seconds: float = 1.0

    @property
    def reserved_bytes_bound(self) -> int:
        """The most bytes one tenant's open saves may have reserved at once."""
        return self.max_reserved_bytes_per_tenant or RESERVED_ENTRIES * self.max_blob_bytes
