"""Every counter the daemon keeps, with its meaning: the one list ``stats`` and the
Prometheus endpoint report (zeros included, so ``rate()`` works from the first scrape)
and whose help texts become the metrics' HELP lines.

Names are incremented as literals in the store package, server.py and the remote
package; tests/daemon/test_counters.py
checks both directions (every name used is declared here, every declared name is used)
and provokes each one against a real daemon.
"""

from __future__ import annotations

from .blob import SAVE_REASONS
from .common import LOCAL_TIERS

# Grouped by topic: the sections of the `kvcache stats` table.
SECTIONS: dict[str, dict[str, str]] = {
    "lookups": {
        "lookups": "Longest-prefix lookups answered",
        "lookup_hits": "Lookups that found a saved prefix",
        "lookup_hits_exact": "Lookup hits covering every requested token (up to max_tokens)",
        "lookup_hits_partial": "Lookup hits covering a shorter prefix of the request",
        "lookup_misses": "Lookups that found nothing",
        "lookups_waited_in_flight": "Lookups before a save that waited for another "
                                    "writer's save of a longer shared prefix, which was "
                                    "published or dropped meanwhile",
        "lookups_in_flight_timeout": "Lookups before a save that gave up waiting for "
                                     "another writer's save of a longer shared prefix "
                                     "(the saver drops its save)",
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
        "saves_refused_tenant_limit": "Reservations refused: the tenant had "
                                      "--max-saves-per-tenant saves in flight",
        "saves_refused_reserved_bytes": "Reservations refused: the tenant's saves in flight "
                                        "had reserved --max-reserved-bytes-per-tenant bytes",
        "saves_refused_quota": "Saves refused: the entry could not fit its tenant's disk "
                               "quota (--tenant-disk-quota)",
    },
    "reads": {
        "reads": "Entries opened for reading (streamed or same-host)",
        **{f"reads_{tier}": f"Reads served from the {tier} tier" for tier in LOCAL_TIERS},
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
        "evictions_ram": "RAM copies dropped to make room in the RAM tier (by the "
                         "reclaimer or by a placement)",
        "evictions_disk": "Entries evicted to make room in the disk tier (by the reclaimer "
                          "or by a save)",
        "evictions_disk_inline": "Entries a save evicted itself: the reclaimer had not made "
                                 "the room it needed (part of evictions_disk)",
        "evictions_ram_inline": "RAM copies a placement dropped itself: the reclaimer had "
                                "not made the room (part of evictions_ram)",
        "reclaims_disk": "Reclaimer passes over the disk tier: it held more than its high "
                         "watermark (--reclaim-high) and gave up entries down to the low one",
        "reclaims_ram": "Reclaimer passes over the RAM tier (as reclaims_disk)",
        "evictions_quota_disk": "Entries evicted to make room within their tenant's disk "
                                "quota (--tenant-disk-quota)",
        "evictions_quota_ram": "RAM copies dropped to make room within their tenant's RAM "
                               "quota (--tenant-ram-quota)",
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
        "pins_expired": "Expiring pins (a ttl given to Pin or PinTenantEntry) released by "
                        "time",
        "tenant_pins": "Expiring pins made on the data path (PinTenantEntry: a runtime "
                       "keeping a cache_control breakpoint's entry)",
        "tenant_pins_refused": "Data-path pins refused: the tenant's expiring pins would "
                               "hold more than --max-pinned-bytes-per-tenant (or its disk "
                               "quota)",
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

# The shared tier's counters (kvcache/remote/), reported by every daemon next to SECTIONS
# (zeros without a remote) and shown as their own section by `kvcache stats`.
# tests/daemon/test_counters.py provokes SECTIONS with no redis-server; tests/remote/test_remote.py checks
# these both ways and, with tests/remote/test_remote_daemon.py, provokes each against real ones.
REMOTE_ERROR_KINDS = ("connection", "timeout", "response", "auth")
REMOTE_SECTION: dict[str, str] = {
    "remote_lookups": "Remote lookups answered",
    "remote_hits": "Remote lookups that found an entry sharing a prefix with the request",
    "remote_misses": "Remote lookups that found nothing (the remote down, slow or empty)",
    "remote_skipped_disconnected": "Remote lookups and fetches answered as misses at once: "
                                   "the remote was disconnected",
    "remote_fetches": "Remote fetches of a chain's pieces",
    "remote_fetch_pieces": "Pieces fetched from the remote and verified",
    "remote_fetch_short": "Remote fetches that returned only a prefix of the chain asked for "
                          "(a piece gone, refused or past the fetch budget)",
    "remote_fetch_failed": "Remote fetches that returned nothing usable",
    "remote_fetch_budget_exceeded": "Remote fetches stopped by their time budget",
    "remote_bytes_fetched": "Blob bytes fetched from the remote and verified",
    "remote_puts": "Entries uploaded to the remote",
    "remote_bytes_sent": "Bytes written to the remote (parts, records, block index)",
    "remote_put_skipped_present": "Uploads skipped: the remote already holds the entry",
    "remote_put_skipped_in_flight": "Uploads skipped: another host was uploading the entry",
    "remote_put_unreadable": "Uploads abandoned: the local blob was gone or failed "
                             "verification",
    "remote_put_errors": "Uploads that failed on the remote (error reply, full, down, slow)",
    "remote_full": "Uploads refused because the remote is out of memory (maxmemory with "
                   "noeviction)",
    "remote_dropped_queue_full": "Uploads dropped: the upload queue was full",
    "remote_dropped_disconnected": "Uploads dropped: the remote was disconnected",
    "remote_signature_failures": "Remote values refused: unsigned or signed with another key",
    "remote_verify_failures": "Remote values refused: malformed, failing checksums or not "
                              "matching their key",
    **{f"remote_errors_{kind}": f"Remote calls that failed: {kind}"
       for kind in REMOTE_ERROR_KINDS},
    "remote_reconnects": "Reconnections to the remote after it was lost",
    "remote_fetched_stored": "Fetched pieces committed into the local tiers",
    "remote_fetched_not_stored": "Fetched pieces the local store refused (full, parent "
                                 "gone): the lookup was answered from what was stored",
}
