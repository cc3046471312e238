"""The figures the Stats RPC answers and the Prometheus metrics export: the store's and
the shared tier's state, typed, the gauges drawn from them, free disk space."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict, cast

from ..common import TIER_DISK, TIER_RAM
from ..counters import REMOTE_SECTION
from ..remote import RemoteTier
from ..store import Store, StoreStats
from ..store.core import RecoveryProgress
from ..v1 import kvcache_pb2 as pb

# A gauge's name and labels, as kvcache.metrics.Metrics.add_snapshot takes them.
Gauges = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class RemoteCounters(TypedDict):
    counters: dict[str, int]  # every name of counters.REMOTE_SECTION, zeros included


class RemoteState(RemoteCounters, total=False):
    """What ``RemoteTier.stats()`` reports; without a shared tier, only its counters."""

    connected: bool
    url: str
    cluster: bool
    signed: bool
    unsigned_by_choice: bool
    encrypted: bool
    queue_depth: int
    queue_max: int
    last_error: str


def store_stats(store: Store) -> StoreStats:
    return store.stats()


def recovery_message(p: RecoveryProgress) -> pb.RecoveryStats:
    """The check after a crash, as Stats answers it."""
    return pb.RecoveryStats(state=p.state, entries=p.entries, entries_checked=p.entries_checked,
                            folders_checked=p.folders_checked, seconds=p.seconds,
                            checked_on_read=p.checked_on_read)


def remote_state(tier: RemoteTier | None) -> RemoteState:
    """RemoteTier.stats(), or, without a shared tier, its counters at zero (every
    declared name is reported)."""
    if tier is None:
        return {"counters": dict.fromkeys(REMOTE_SECTION, 0)}
    return cast(RemoteState, tier.stats())


def free_bytes(path: Path) -> int:
    """Free space for the daemon on the file system holding ``path`` (0 if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def store_gauges(store: Store) -> Gauges:
    s = store_stats(store)
    cfg = store.config
    return {
        ("tier_entries", (("tier", TIER_RAM),)): s["ram_entries"],
        ("tier_entries", (("tier", TIER_DISK),)): s["disk_entries"],
        ("tier_bytes", (("tier", TIER_RAM),)): s["ram_used"],
        ("tier_bytes", (("tier", TIER_DISK),)): s["disk_used"],
        ("tier_budget_bytes", (("tier", TIER_RAM),)): cfg.ram_bytes,
        ("tier_budget_bytes", (("tier", TIER_DISK),)): cfg.disk_bytes,
        ("reserved_bytes", ()): s["reserved_bytes"],
        ("in_flight", ()): s["in_flight"],
        ("waiting_lookups", ()): s["waiting_lookups"],
        ("read_pins", ()): s["read_pins"],
        # After a crash: 1 while the index and the files are checked in the background.
        ("recovery_running", ()): float(s["recovery"].state == "running"),
        ("recovery_entries_checked", ()): s["recovery"].entries_checked,
    }


def remote_gauges(state: RemoteState) -> Gauges:
    """The shared tier's gauges, from remote_state (none without a shared tier)."""
    if "connected" not in state:
        return {}
    return {("remote_connected", ()): float(bool(state["connected"])),
            ("remote_queue_depth", ()): float(state["queue_depth"])}
