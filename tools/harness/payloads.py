"""Payloads and blobs for tests and tools that follow from their tokens alone, so that any
entry a daemon returns can be checked on its own, without a record of what was saved."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import Identity


def payload_for(tokens: Sequence[int], size: int | tuple[int, int], salt: bytes = b"") -> bytes:
    """Bytes seeded by the tokens (and ``salt``: entries with equal tokens that must
    differ). ``size`` is a byte count, or a ``(low, high)`` range the count is drawn from
    with the same seed."""
    rng = random.Random(keys.tokens_to_bytes(tokens) + salt)
    n = size if isinstance(size, int) else rng.randrange(*size)
    return rng.randbytes(n)


def blob_bytes(identity: Identity, tokens: Sequence[int], payload: bytes, reason: str = "cold",
               *, created: float | None = None, tenant_id: str | None = None,
               parent: bytes = b"", base: int = 0, namespace: bytes | None = None) -> bytes:
    """The blob exactly as ``CacheClient.save`` encodes it; ``tenant_id`` replaces the label
    (none without a tenant: give a tenant's, from CacheClient.resolve, to file an entry
    under a tenant); ``parent`` and ``base`` make it a piece; ``namespace``: a tenant's
    (CacheClient.namespace_of), the identity's own without a tenant."""
    meta = blobfmt.BlobMeta(
        namespace=identity.namespace if namespace is None else namespace,
        model_fingerprint=identity.model_fingerprint,
        kv_layout=dict(identity.kv_layout), tokens=list(tokens), reason=reason,
        model_name=identity.model_name,
        tenant_id="" if tenant_id is None else tenant_id,
        parent=parent, base=base, **({"created": created} if created is not None else {}))
    return b"".join(bytes(p) for p in blobfmt.encode_blob(meta, payload))
