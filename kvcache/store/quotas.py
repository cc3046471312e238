"""Tenant quotas: the most bytes one tenant's entries may hold in each local tier.

Optional (``kvcache serve --tenant-disk-quota``, ``--tenant-ram-quota``), by tenant name
or for every tenant (``*``). The store knows tenants by the label their entries carry
(kvcache.tenancy), so the daemon hands it quotas by label (:meth:`TenantQuotas.by_name`).

A tenant at its quota makes room among its own entries (kvcache.store.eviction), least
valuable first, so what its saves push out of the shared budget is bounded by its quota;
an entry larger than the quota is refused (disk) or never copied (RAM). Usage is the
store's Tally, kept per tenant, recounted from the index at a start-up that reconciles
and recorded by a clean shutdown (tests/daemon/test_quotas.py).

Entries are per namespace and a tenant's namespace is its own (a salted hash), so no
entry is shared between tenants: each counts against exactly one tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..common import TIER_DISK, TIER_RAM

EVERY_TENANT = "*"
QUOTA_OPTIONS = {TIER_DISK: "--tenant-disk-quota", TIER_RAM: "--tenant-ram-quota"}


@dataclass(frozen=True)
class TenantQuotas:
    """Quotas by tenant label (entries without a tenant: ""), per tier; a tenant named in
    none gets the tier's default (None: no quota)."""

    disk: Mapping[str, int] = field(default_factory=dict)
    ram: Mapping[str, int] = field(default_factory=dict)
    disk_default: int | None = None
    ram_default: int | None = None

    def of(self, tier: str, tenant_id: str) -> int | None:
        """The quota of ``tenant_id`` in ``tier`` (None: none)."""
        if tier == TIER_DISK:
            return self.disk.get(tenant_id, self.disk_default)
        return self.ram.get(tenant_id, self.ram_default)

    def __bool__(self) -> bool:
        return bool(self.disk or self.ram) or self.disk_default is not None \
            or self.ram_default is not None

    @classmethod
    def by_name(cls, disk: Mapping[str, int], ram: Mapping[str, int],
                label: Callable[[str], str]) -> TenantQuotas:
        """Quotas given by tenant name (``*``: every tenant not named), labelled with
        ``label`` (TenantSalts.tenant_id)."""
        return cls(disk={label(n): q for n, q in disk.items() if n != EVERY_TENANT},
                   ram={label(n): q for n, q in ram.items() if n != EVERY_TENANT},
                   disk_default=disk.get(EVERY_TENANT), ram_default=ram.get(EVERY_TENANT))


def parse_quota(text: str, parse_size: Callable[[str], int]) -> tuple[str, int]:
    """``NAME=SIZE`` (``*=SIZE``: every tenant) -> (name, bytes). ValueError says what is
    wrong."""
    name, sep, size = text.partition("=")
    name = name.strip()
    if not sep or not name or not size.strip():
        raise ValueError(f"{text!r} is not TENANT=SIZE (e.g. alice=2G, or '*=1G' for every "
                         "tenant)")
    return name, parse_size(size)
