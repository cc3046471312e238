"""The gRPC service: a thin translation between protobuf messages and the Store.

Its parts, each importing only those above it in this list:

* ``messages`` — request fields checked and decoded, store records encoded (pure);
* ``filters`` — the operator's entry filters of ``ls`` and ``prune`` (pure);
* ``stats`` — the store's and the shared tier's figures, typed, and the gauges from them;
* ``access`` — the caller's token scope: which tenants it may name, which entries it sees;
* ``base`` — the service's state, store errors as gRPC statuses, latency metrics;
* ``data_path`` — the RPCs of a model runtime: lookup, save, load, delete;
* ``admin`` — the operator's RPCs: stats, list, inspect, verify, pin, prune;

and here the servicer made of the two kinds of RPCs. The daemon that serves it (listeners,
auth, start and shutdown) is kvcache.server.
"""

from __future__ import annotations

from ..v1 import kvcache_pb2 as pb
from ..v1 import kvcache_pb2_grpc as pb_grpc
from .admin import OPERATOR_RPCS, AdminRPCs
from .data_path import DataPathRPCs

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# Calls that see every tenant's entries or change what others rely on. The unix socket's
# owner is the operator; TCP callers get them only with --tcp-admin (see OperatorGate).
OPERATOR_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in OPERATOR_RPCS)


class KVCacheService(DataPathRPCs, AdminRPCs, pb_grpc.KVCacheServicer):
    """The RPCs. A caller's scope is its token's (kvcache.auth.Scope; no token: an admin,
    as on the owner-only unix socket). A runtime token names only its own tenants; every
    call by key answers an entry of another tenant exactly as a key that does not exist
    (tests/daemon/test_scoped_tokens.py)."""


__all__ = ["OPERATOR_METHODS", "SERVICE_NAME", "KVCacheService"]
