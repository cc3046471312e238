"""Every counter the daemon keeps, with its meaning: the one list ``stats`` and the
Prometheus endpoint report (zeros included, so ``rate()`` works from the first scrape)
and whose help texts become the metrics' HELP lines.

Names are incremented as literals in store.py and server.py; tests/test_counters.py
checks both directions (every name used is declared here, every declared name is used)
and provokes each one against a real daemon.
"""

from __future__ import annotations

from .blob import SAVE_REASONS

# store.TIER_RAM and store.TIER_DISK (not imported: store.py imports this module).
TIERS = ("ram", "disk")

# Grouped by topic: the sections of the `kvcache stats` table.
SECTIONS: dict[str, dict[str, str]] = {
    "lookups": {
        "lookups": "Longest-prefix lookups answered",
        "lookup_hits": "Lookups that found a saved prefix",
        "lookup_hits_exact": "Lookup hits covering every requested token (up to max_tokens)",
        "lookup_hits_partial": "Lookup hits covering a shorter prefix of the request",
        "lookup_misses": "Lookups that found nothing",
    },
    "saves": {
        "reserves": "Reserve calls (save attempts)",
        "saves_granted": "Reservations granted a lease to write",
        "saves_committed": "Saves published (verified, fsynced, indexed)",
        **{f"saves_committed_{reason}": f"Saves published with reason {reason}"
           for reason in SAVE_REASONS},
        "bytes_committed": "Blob bytes published",
        "pieces_committed": "Saves published as pieces: only the cells after a prefix "
                            "another entry's chain already holds",
        "saves_parent_gone": "Piece saves refused because their parent entry was gone "
                             "(evicted, deleted or quarantined since the writer looked)",
        "saves_duplicate": "Reservations refused as duplicates (present or in flight)",
        "saves_duplicate_present": "Reservations of a key already published",
        "saves_duplicate_in_flight": "Reservations of a key another writer is saving",
        "saves_invalid": "Saves rejected at commit: the blob failed verification or did "
                         "not match its reservation",
        "saves_aborted": "Reservations aborted by their writer, by a bad chunk or at "
                         "shutdown",
        "saves_disconnected": "Streamed saves whose writer went away mid-stream",
        "leases_expired": "Reservations aborted after their lease ran out without traffic",
        "saves_refused_full": "Reservations refused: no room within the disk budget or "
                              "watermark",
    },
    "reads": {
        "reads": "Entries opened for reading (streamed or same-host)",
        **{f"reads_{tier}": f"Reads served from the {tier} tier" for tier in TIERS},
        "read_misses": "Reads of a key that is not published (or still being written, when "
                       "the reader would not wait)",
        "read_waits": "Reads that waited for an in-flight save to be published",
        "read_wait_timeouts": "Waiting reads whose wait ran out before the save was "
                              "published",
        "read_wait_aborted": "Waiting reads whose awaited save was aborted",
        "read_pins_expired": "Same-host read pins released by expiry (the reader never "
                             "released them)",
    },
    "tiers": {
        "ram_placements": "Entries copied into the RAM tier",
        "evictions_ram": "RAM copies dropped to make room in the RAM tier",
        "evictions_disk": "Entries evicted to make room in the disk tier",
    },
    "integrity": {
        "corrupt_blobs": "Indexed entries found corrupt and quarantined",
        "dependents_removed": "Entries removed with the entry they were built on (a "
                              "quarantined, deleted or broken parent)",
        "quarantined_files": "Files moved to quarantine (corrupt entries, unreadable or "
                             "misnamed blob files)",
    },
    "administration": {
        "pins": "Entries pinned by an operator",
        "unpins": "Entries unpinned by an operator",
        "deletes": "Entries removed by an operator (evict)",
        "prune_removed": "Entries removed by prune",
        "prune_ram_dropped": "RAM copies dropped by prune",
    },
    "start-up": {
        "orphans_swept": "Temp files of unfinished saves removed at start-up",
        "reconcile_added": "Blob files re-indexed from their headers at start-up",
        "reconcile_removed": "Index rows dropped at start-up: damaged, their blob file "
                             "missing or of the wrong size (a good blob is re-indexed), or "
                             "their parent gone",
    },
}

COUNTERS: dict[str, str] = {name: text for section in SECTIONS.values()
                            for name, text in section.items()}
