"""The operator's filters over entries (``kvcache ls`` and ``kvcache prune``), as
predicates over records. Pure: no store, no caller."""

from __future__ import annotations

from collections.abc import Callable

from ..record import Record
from ..tenancy import TenantSalts
from ..v1 import kvcache_pb2 as pb

# A fingerprint prefix shorter than this would match models by chance (one in 16 for a
# single hex digit): shorter text matches model names only.
MIN_FINGERPRINT_PREFIX = 4


def model_matches(record: Record, model: str) -> bool:
    """The model filter of ls and prune: the model's file name or its beginning, or at
    least MIN_FINGERPRINT_PREFIX leading characters of its fingerprint (any case)."""
    if record.model_name.startswith(model):
        return True
    return len(model) >= MIN_FINGERPRINT_PREFIX and \
        record.model_fingerprint.lower().startswith(model.lower())


def record_filter(salts: TenantSalts, model: str = "", tenant: str = "", reason: str = "",
                  tier: int = 0, min_tokens: int = 0, older_than: float = 0.0,
                  unused_for: float = 0.0, now: float = 0.0, key_prefix: str = "",
                  only_keys: frozenset[bytes] = frozenset()
                  ) -> Callable[[Record], bool] | None:
    """A predicate over records from operator filters (None when no filter is set); an
    entry must pass every filter given. Filters are text and taken as text: one that
    cannot match (a key prefix that is not hex digits) matches nothing."""
    tenant_id = salts.tenant_id(tenant)
    prefix = key_prefix.lower()  # keys are shown in lowercase hex; typed in any case
    if not any((model, tenant, reason, tier, min_tokens, older_than, unused_for, prefix,
                only_keys)):
        return None

    def match(r: Record) -> bool:
        if only_keys and r.key not in only_keys:
            return False
        if prefix and not r.key.hex().startswith(prefix):
            return False
        if model and not model_matches(r, model):
            return False
        if tenant and r.tenant_id != tenant_id:
            return False
        if reason and r.reason != reason:
            return False
        if tier == pb.TIER_RAM and not r.in_ram:
            return False
        if min_tokens and r.n_tokens < min_tokens:
            return False
        if older_than and now - r.created < older_than:
            return False
        return not (unused_for and now - r.last_touch < unused_for)

    return match


def within(keys_: frozenset[bytes], predicate: Callable[[Record], bool] | None
           ) -> Callable[[Record], bool]:
    """Only these keys (none when empty), and what ``predicate`` also accepts."""
    return lambda r: r.key in keys_ and (predicate is None or predicate(r))
