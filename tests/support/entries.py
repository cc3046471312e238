"""Entries on a real daemon, as the daemon tests make and inspect them: tokens of a test's
own, the identity saves use, raw Reserve and Write calls, where a daemon keeps an entry's
files, and a blob's payload damaged in place."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from harness.payloads import blob_bytes

from kvcache import blob as blobfmt
from kvcache.client import CacheClient, Identity
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, wait_for

BLOCK = 16
IDENT = Identity("fp-test", {"type_k": "f16"}, model_name="tiny.gguf")
PATHS = ["fast", "stream"]  # same-host file path, and gRPC streaming

DaemonFactory = Callable[..., DaemonProcess]


def toks(seed: int, n: int) -> list[int]:
    """A token list of its own for each test (so a shared daemon never mixes them)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 60_000) for _ in range(n)]


def counters(client: CacheClient) -> dict[str, int]:
    return dict(client.stats().counters)


def recovered(client: CacheClient, timeout: float = 60.0) -> None:
    """Wait until a daemon started after a crash has checked its index against its files
    (it serves meanwhile; see kvcache.store.recovery)."""
    wait_for(lambda: client.stats().recovery.state in ("", "none", "done"),
             "the check after the crash to finish", timeout)


def reserve(client: CacheClient, tokens: list[int], size: int, reason: str = "cold",
            identity: Identity = IDENT) -> pb.ReserveResponse:
    return client.stub.Reserve(pb.ReserveRequest(identity=identity.message(), tokens=tokens,
                                                 size=size, reason=reason), timeout=10)


def write(client: CacheClient, lease: str, data: bytes, offset: int = 0) -> pb.WriteResponse:
    return client.stub.Write(iter([pb.WriteChunk(lease_id=lease, offset=offset, data=data)]),
                             timeout=10)


def blob_file(d: DaemonProcess, key: bytes) -> Path:
    return d.data_dir / "blobs" / key.hex()[:2] / f"{key.hex()}.kvc"


def ram_file(d: DaemonProcess, key: bytes) -> Path:
    return d.ram_dir / f"{key.hex()}.kvc"


def flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = blobfmt.parse_header(data)
    mid = header.payload_offset + header.payload_len // 2
    data[mid : mid + 8] = bytes(b ^ 0x5A for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))


def save_raw(c: CacheClient, identity: Identity, tokens: list[int], payload: bytes,
             reason: str, created: float) -> bytes:
    """Save through the raw protocol with a chosen creation time (for age filters)."""
    data = blob_bytes(identity, tokens, payload, reason, created=created)
    res = reserve(c, tokens, len(data), reason, identity)
    write(c, res.lease_id, data)
    return c.stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10).key


def leftovers(d: DaemonProcess) -> list[str]:
    """Temp files anywhere in the data directory."""
    return sorted(str(p.relative_to(d.data_dir)) for p in d.data_dir.rglob("*.part"))
