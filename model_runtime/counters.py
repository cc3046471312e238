"""Every counter the model runtime keeps, with its meaning: the one list its ``Stats``
RPC and Prometheus endpoint report (zeros included) and whose help texts become the
metrics' HELP lines.

Names are counted as literals or f-strings in the engine, executor, resolver, save_points,
saver and speculator modules;
tests/daemon/test_counters.py checks that every name used is declared here (and every declared
name is used) and provokes each one with a real runtime and a real daemon.
"""

from __future__ import annotations

from kvcache.common import (
    HIT_EXACT,
    HIT_KINDS,
    HIT_PARTIAL,
    RESTORE_TIERS,
    RUNTIME_SAVE_REASONS,
)

RESTORED_KINDS = (HIT_EXACT, HIT_PARTIAL)  # sticky reuses a live sequence, cold restores nothing
SKIP_STATUSES = ("already_present", "in_flight")  # CacheClient.save's non-saved results
KEY_SOURCES = ("parent", "session")  # candidates tried before the longest-prefix lookup

COUNTERS: dict[str, str] = {
    # requests
    "requests_completed": "Requests that completed (any finish reason)",
    "requests_failed": "Admitted requests that ended in an error (sticky_busy, decode "
                       "failure, shutdown before they started)",
    "admission_waits": "Requests that waited for a free sequence",
    "sessions_evicted": "Idle sessions whose sequence was taken for another request",
    **{f"hits_{kind}": f"Completed requests with cache hit kind {kind}" for kind in HIT_KINDS},
    "cold_prefills": "Requests that prefilled their whole prompt (nothing restored)",
    # cache resolution
    **{f"resolved_by_{source}": f"States found through the request's {source} key"
       for source in KEY_SOURCES},
    **{f"{source}_key_unusable": f"{source.capitalize()} keys that could not be loaded or "
                                 "did not fit the prompt" for source in KEY_SOURCES},
    **{f"restored_from_{tier}": f"Longest-prefix hits loaded from the daemon's {tier} tier"
       for tier in RESTORE_TIERS},
    "restored_from_cache": "Longest-prefix hits loaded without the daemon naming a tier",
    "lookups_waited_own_save": "Lookups asked again after waiting for this runtime's "
                               "queued saves that serve more of the prompt than the "
                               "daemon's answer or a live sequence "
                               "(session_resume_wait_ms)",
    "hand_offs_cut_short": "Steps that began before every reader keeping up had sent the "
                           "token it was given (hand_off_ms)",
    "lookups_awaited": "Cache answers the model thread held the running requests' next "
                       "batch for, so the new request started in it (resolve_wait_ms)",
    "lookups_after_batch": "Cache answers that came after the model thread had held the "
                           "next batch as long as it would and run it: the new request "
                           "started a batch later",
    **{f"restores_{kind}": f"States restored into a sequence for {kind} hits"
       for kind in RESTORED_KINDS},
    "live_reuses": "Requests served in place by an idle sequence's live KV (tier live, "
                   "no restore)",
    "restore_failed": "States llama.cpp rejected on restore (the request went cold)",
    "restores_skipped_copy_pending": "States found but not restored into a sequence whose "
                                     "copy to a request's choices no decode had made yet "
                                     "(the request went cold)",
    "rejected_states_deleted": "Rejected states deleted from the cache so no request "
                               "retries them",
    "corrupt_blobs": "Hits whose blob failed verification (quarantined by the daemon)",
    "cache_unavailable": "Cache calls that found the daemon unreachable or too slow",
    "cache_errors": "Cache calls the daemon answered with an error (the request went cold)",
    # saves
    **{f"saves_queued_{reason}": f"{reason.capitalize()} saves queued for the daemon"
       for reason in RUNTIME_SAVE_REASONS},
    **{f"saves_{reason}": f"{reason.capitalize()} saves the daemon published"
       for reason in RUNTIME_SAVE_REASONS},
    "tokens_saved": "Tokens in the states the daemon published",
    "tokens_stored": "Tokens whose cells those saves sent: a piece's own, after the prefix "
                     "the daemon already held",
    "saves_built_on_prefix": "Saves stored as a piece built on a prefix the daemon "
                             "already held (only the cells after it were sent)",
    "saves_parent_gone": "Piece saves whose parent was evicted between the lookup and "
                         "the save (stored whole instead)",
    **{f"saves_skipped_{status}": f"Saves the daemon skipped as {status.replace('_', ' ')}"
       for status in SKIP_STATUSES},
    "saves_dropped": "Saves dropped (backlog, daemon unavailable, or refused)",
    "saves_dropped_backlog": "Saves dropped because max_pending_saves were already queued "
                             "(a checkpoint for a prefill's sake: when fewer than three "
                             "places were left, two being kept for the saves of the "
                             "prompt's end and its finish)",
    "saves_skipped_copy_pending": "Saves not taken of a prompt copied to a request's other "
                                  "choices before the decode that makes the copy (a "
                                  "choice that ended at its first token)",
    "saves_dropped_unavailable": "Saves dropped because the daemon was unreachable",
    "saves_dropped_in_flight_prefix": "Saves dropped because another writer's save of a "
                                      "longer shared prefix was still being written after "
                                      "the wait (in_flight_wait_ms)",
    "saves_failed": "Saves the daemon refused (e.g. no room in its disk budget)",
    "pins_sent": "Expiring pins of cache_control breakpoints the daemon took",
    "pins_failed": "Expiring pins the daemon refused (entry gone, ttl over its longest, "
                   "or the tenant's pins holding as much as they may)",
    "pins_dropped": "Expiring pins dropped because max_pending_saves were already queued",
    "shutdown_saves_skipped": "Live sequences not saved at shutdown: the deadline had passed",
    # speculation
    "draft_tokens": "Drafted tokens verified beside a pending token (speculative decoding)",
    "draft_tokens_accepted": "Drafted tokens taken as drafted (each saved a decode step; "
                             "acceptance rate: this over draft_tokens)",
    # bugs
    "internal_errors": "Exceptions that escaped a model-thread step (a bug: requests in "
                       "flight were failed, serving went on)",
}
