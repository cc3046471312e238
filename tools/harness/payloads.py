"""Payloads and blobs for tests and tools that follow from their tokens alone, so that any
entry a daemon returns can be checked on its own, without a record of what was saved."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import Identity
from kvcache.store import BLOB_SUFFIX


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


def write_blob_files(data_dir: Path, identity: Identity, block_size: int,
                     entries: Iterable[tuple[Sequence[int], bytes]]) -> int:
    """Entries' blob files (each ``(tokens, payload)``) written where a daemon of
    ``data_dir`` keeps them, without index rows: its start-up indexes them from their
    headers. Entry i is created i seconds after the first, so the eviction order is
    theirs. Synced; returns how many were written."""
    blobs = data_dir / "blobs"
    blobs.mkdir(mode=0o700, parents=True, exist_ok=True)
    n = 0
    for n, (tokens, payload) in enumerate(entries, start=1):
        key = keys.entry_key(identity.namespace, tokens, block_size).key.hex()
        folder = blobs / key[:2]
        if not folder.is_dir():
            folder.mkdir(mode=0o700)
        data = blob_bytes(identity, tokens, payload, created=1_700_000_000.0 + n - 1)
        fd = os.open(folder / f"{key}{BLOB_SUFFIX}",
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    os.sync()
    return n
