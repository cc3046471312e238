"""Who the caller is and what it may touch: its token's scope (kvcache.auth.Scope), the
tenants it may name, the entries it may see. A runtime token names only its own tenants,
and every call by key answers an entry of another tenant exactly as a key that does not
exist (tests/daemon/test_scoped_tokens.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from ..auth import ADMIN, Scope, presented_token
from ..errors import InvalidArgument, NotFound, StoreError
from ..store import Store
from ..tenancy import TenantSalts
from ..v1 import kvcache_pb2 as pb
from .messages import check_key


class PermissionDenied(StoreError):
    code = grpc.StatusCode.PERMISSION_DENIED


class CallerAccess:
    """The scope checks of one service. No token: an admin, as on the owner-only unix
    socket."""

    def __init__(self, store: Store, salts: TenantSalts, tokens: Mapping[str, Scope]) -> None:
        self.store = store
        self.salts = salts
        self.tokens = tokens

    def scope(self, context: Any) -> Scope:
        return self.tokens.get(presented_token(context.invocation_metadata()), ADMIN)

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

    def may_see(self, key: bytes, context: Any) -> bool:
        """Whether the caller's scope covers the entry ``key`` (one that does not exist
        included: it answers as such)."""
        scope = self.scope(context)
        if scope.tenants is None:
            return True
        owner = self.store.tenant_of(key)
        return owner is None or owner in {self.salts.tenant_id(t) for t in scope.tenants}

    def check_key_scope(self, key: bytes, context: Any) -> bytes:
        """``key``, when the caller may see it; else NotFound, worded as for a key that
        does not exist, and answered before any wait (no timing tells them apart)."""
        if not self.may_see(check_key(key), context):
            raise NotFound(f"no entry {key.hex()}")
        return key
