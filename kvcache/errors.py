"""Store errors, each carrying the gRPC status code the service answers with."""

from __future__ import annotations

import grpc


class StoreError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class NotFound(StoreError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(StoreError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(StoreError):
    code = grpc.StatusCode.OUT_OF_RANGE


class StoreFull(StoreError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class QuotaExceeded(StoreFull):
    """A tenant's entry cannot fit its quota of a tier (kvcache.store.quotas)."""


class TooManySaves(StoreError):
    """One tenant holds as many open leases, or reserved bytes, as it may."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Busy(StoreError):
    """The entry is pinned or being read, so it cannot be removed now."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Corrupt(StoreError):
    code = grpc.StatusCode.DATA_LOSS


class WaitTimeout(StoreError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class LeaseLost(StoreError):
    """Unknown, expired or already finished lease."""

    code = grpc.StatusCode.NOT_FOUND


class DirectoryInUse(StoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION
