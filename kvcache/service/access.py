"""Who the caller is and what it may touch: its token's scope (kvcache.auth.Scope), the
tenants it may name, the entries it may see. A runtime token names only its own tenants,
and every call by key answers an entry of another tenant exactly as a key that does not
exist: the store takes the tenants a caller may see and hides the others' entries on the
path of a missing key, after every argument is checked (tests/daemon/test_scoped_tokens.py,
tools/bench_tenant_probes.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from ..auth import ADMIN, Scope, presented_token
from ..errors import InvalidArgument, StoreError
from ..store import Seen, Store
from ..tenancy import TenantSalts
from ..v1 import kvcache_pb2 as pb


class PermissionDenied(StoreError):
    code = grpc.StatusCode.PERMISSION_DENIED


class CallerAccess:
    """The scope checks of one service. No token: an admin, as on the owner-only unix
    socket."""

    def __init__(self, store: Store, salts: TenantSalts, tokens: Mapping[str, Scope]) -> None:
        self.store = store
        self.salts = salts
        self.tokens = tokens
        # Each scope's tenant labels, computed once: a call by key costs the same whatever
        # the key (an HMAC per tenant only for keys that existed was a timing tell).
        self._labels: dict[Scope, Seen] = {
            scope: frozenset(salts.tenant_id(t) for t in scope.tenants)
            for scope in {*tokens.values()} if scope.tenants is not None}

    def scope(self, context: Any) -> Scope:
        return self.tokens.get(presented_token(context.invocation_metadata()), ADMIN)

    def seen(self, context: Any) -> Seen:
        """The tenant labels whose entries the caller may see (None: every tenant's). The
        store answers an entry of any other tenant as a key nobody saved, on that very
        path (kvcache.store.core.seen)."""
        scope = self.scope(context)
        return None if scope.tenants is None else self._labels[scope]

    def tenant_seen(self, tenant: str, context: Any) -> frozenset[str]:
        """The one tenant a data-path call names (its entry must be that tenant's), for a
        caller whose scope covers it."""
        self.check_tenant(tenant, context)
        return frozenset((self.salts.tenant_id(tenant),))

    def namespace(self, identity: pb.Identity, context: Any) -> bytes:
        """The namespace of ``identity``, for a caller whose scope covers its tenant."""
        if not identity.model_fingerprint:
            raise InvalidArgument("identity.model_fingerprint is required")
        self.check_tenant(identity.tenant, context)
        return self.salts.namespace(identity.model_fingerprint, dict(identity.kv_layout),
                                    identity.tenant)

    def check_tenant(self, tenant: str, context: Any) -> None:
        if not self.scope(context).may_use(tenant):
            # About the caller's own token, not about any entry: it reveals nothing.
            raise PermissionDenied(f"this token may not use tenant {tenant!r}" if tenant else
                                   "this token is bound to tenants: name one")
