"""The service's protobuf messages: request fields checked and decoded, store records
encoded. Pure functions of their arguments (no store, no caller, no gRPC context)."""

from __future__ import annotations

from .. import keys
from ..common import TIER_DISK, TIER_RAM
from ..errors import InvalidArgument
from ..record import Record
from ..v1 import kvcache_pb2 as pb

# The store's tier names as the protocol's enum.
TIERS: dict[str, pb.Tier] = {TIER_RAM: pb.TIER_RAM, TIER_DISK: pb.TIER_DISK}


def request_tokens(request: pb.LookupRequest | pb.ReserveRequest) -> bytes:
    """The request's tokens as packed u32 LE, from whichever field carries them."""
    if request.packed_tokens:
        if len(request.tokens):
            raise InvalidArgument("give tokens or packed_tokens, not both")
        if len(request.packed_tokens) % 4:
            raise InvalidArgument("packed_tokens is not a whole number of u32 values")
        return request.packed_tokens
    return keys.tokens_to_bytes(request.tokens)


def check_key(key: bytes) -> bytes:
    if len(key) != keys.KEY_BYTES:
        raise InvalidArgument(f"a key is {keys.KEY_BYTES} bytes, got {len(key)}")
    return key


def tier_of(record: Record) -> pb.Tier:
    """The fastest tier holding the entry."""
    return pb.TIER_RAM if record.in_ram else pb.TIER_DISK


def entry_message(record: Record, children: int = 0) -> pb.Entry:
    tiers = [pb.TIER_DISK] + ([pb.TIER_RAM] if record.in_ram else [])
    return pb.Entry(
        key=record.key, model_name=record.model_name, model_fingerprint=record.model_fingerprint,
        tenant_id=record.tenant_id, n_tokens=record.n_tokens, size=record.size, tiers=tiers,
        reason=record.reason, created=record.created, last_used=record.last_used,
        hits=record.hits, pinned=record.pinned, codec=record.codec, namespace=record.namespace,
        parent=record.parent, base=record.base, logical_size=record.logical_size,
        children=children, pin_expires=record.pin_expires,
    )


def chain_message(chain: list[Record]) -> list[pb.Piece]:
    return [pb.Piece(key=r.key, base=r.base, n_tokens=r.n_tokens, size=r.size, tier=tier_of(r))
            for r in chain]
