"""Per-tenant usage as Stats answers it: the store's numbers by tenant label, with the
name of each tenant the daemon knows.

The store knows tenants only by the label their entries carry (kvcache.tenancy: derived
from a secret, so a label cannot be matched against guessed names). Names come from what
the daemon was told: its quota options, its token file's scopes, and the saves made since
start-up (bounded: a caller naming tenants without end fills no memory).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from .store import Store
from .tenancy import TenantSalts
from .v1 import kvcache_pb2 as pb

# Names learnt from saves, at most: past it, new tenants show by label only.
MAX_LEARNT_NAMES = 10_000


class TenantNames:
    """Tenant label -> name, for the tenants the daemon has been told of. Thread-safe."""

    def __init__(self, salts: TenantSalts, configured: Iterable[str] = ()) -> None:
        self._salts = salts
        self._lock = threading.Lock()
        self._names: dict[str, str] = {salts.tenant_id(n): n for n in configured if n}
        self._configured = len(self._names)

    def learn(self, name: str) -> None:
        """A tenant a save was made for."""
        if not name:
            return
        label = self._salts.tenant_id(name)
        with self._lock:
            if label not in self._names \
                    and len(self._names) < self._configured + MAX_LEARNT_NAMES:
                self._names[label] = name

    def name(self, label: str) -> str:
        with self._lock:
            return self._names.get(label, "")


def usage_messages(store: Store, names: TenantNames,
                   tenant_ids: Iterable[str] | None = None) -> list[pb.TenantUsage]:
    """Stats' tenants: ``tenant_ids`` (a runtime token's own), or, for an admin, every
    tenant holding or saving anything and every tenant a quota names."""
    if tenant_ids is None:
        quotas = store.tenant_quotas
        tenant_ids = {*store.tenant_usage(), *quotas.disk, *quotas.ram}
    rows = [usage_message(label, names.name(label), u)
            for label, u in store.tenant_usage(tenant_ids).items()]
    # Named tenants by name, then the others by label.
    return sorted(rows, key=lambda t: (not t.tenant, t.tenant, t.tenant_id))


def usage_message(label: str, name: str, u: Mapping[str, int | None]) -> pb.TenantUsage:
    msg = pb.TenantUsage(tenant_id=label, tenant=name, disk_bytes=u["disk_bytes"],
                         disk_entries=u["disk_entries"], ram_bytes=u["ram_bytes"],
                         ram_entries=u["ram_entries"], open_saves=u["open_saves"],
                         reserved_bytes=u["reserved_bytes"])
    disk_quota, ram_quota = u["disk_quota_bytes"], u["ram_quota_bytes"]
    if disk_quota is not None:  # unset: no quota (the field is optional)
        msg.disk_quota_bytes = disk_quota
    if ram_quota is not None:
        msg.ram_quota_bytes = ram_quota
    return msg
