"""An entry's record: the row the index keeps for each published entry (its key, where its
tokens hang, its blob's size and metadata, its use and its pin), packed with msgpack.

Its own module, below both kvcache.index, which stores records, and kvcache.ordering,
which orders them, so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgpack
import xxhash

__all__ = ["Record"]


@dataclass(frozen=True)
class Record:
    key: bytes
    namespace: bytes
    anchor: bytes
    tail: bytes
    n_tokens: int
    size: int  # bytes of the blob file
    codec: str
    reason: str
    created: float
    model_name: str
    model_fingerprint: str
    tenant_id: str
    in_ram: bool = False
    hits: int = 0
    last_used: float = 0.0
    pinned: bool = False
    # A piece: the entry whose chain holds this one's first ``base`` tokens; its own blob
    # holds only the cells after them. b"" and 0 for a whole state.
    parent: bytes = b""
    base: int = 0
    # An expiring pin's end (time.time(); 0.0: none): the pin is released by time, and
    # kept in the row so that it outlives a restart. Written only when set, so rows stay
    # as the previous version wrote them.
    pin_expires: float = 0.0

    def pack(self) -> bytes:
        # Not dataclasses.asdict: it deep-copies every field (4x slower on rebuilds).
        return msgpack.packb({name: getattr(self, name) for name in self._fields()},
                             use_bin_type=True)

    def _fields(self) -> tuple[str, ...]:
        # A whole state's row is written as the previous version wrote it (no piece fields).
        names = _RECORD_FIELDS if self.parent else _WHOLE_FIELDS
        return names if self.pin_expires else tuple(n for n in names if n != "pin_expires")

    @property
    def own_tokens(self) -> int:
        """Tokens whose cells this entry's own blob holds."""
        return self.n_tokens - self.base

    @property
    def logical_size(self) -> int:
        """Bytes the entry's whole state would take stored alone, estimated for a piece:
        its blob plus its payload's bytes per token for the ``base`` tokens it takes from
        its chain. (The blob also holds every token id, 4 bytes each, and about half a
        kilobyte of other metadata: not payload.)"""
        if not self.base:
            return self.size
        payload = max(0, self.size - 4 * self.n_tokens - 512)
        return self.size + payload * self.base // self.own_tokens

    def seal(self) -> bytes:
        """xxh3_64 of the fields its blob vouches for, kept in the ``seals`` database at
        publish: a row whose size, n_tokens, tail, namespace, reason... changed on disk no
        longer matches it. (Not a field: older versions reject rows with unknown fields.)"""
        sealed = _SEALED_FIELDS if self.parent else _SEALED_WHOLE_FIELDS
        return xxhash.xxh3_64_digest(
            msgpack.packb([getattr(self, name) for name in sealed], use_bin_type=True))

    @property
    def usage_ok(self) -> bool:
        return (type(self.in_ram) is bool and type(self.pinned) is bool
                and type(self.pin_expires) is float
                and type(self.hits) is int and type(self.last_used) is float)

    @classmethod
    def unpack(cls, data: bytes) -> Record:
        return cls(**msgpack.unpackb(data, raw=False))

    @property
    def last_touch(self) -> float:
        """When the entry was last useful: its last read, else its creation."""
        return max(self.last_used, self.created)


_RECORD_FIELDS = tuple(f.name for f in fields(Record))
_PIECE_FIELDS = ("parent", "base")
_WHOLE_FIELDS = tuple(name for name in _RECORD_FIELDS if name not in _PIECE_FIELDS)
# What a blob's header and metadata determine; the rest (tier, usage, pin) changes in place.
_SEALED_FIELDS = tuple(name for name in _RECORD_FIELDS
                       if name not in ("in_ram", "hits", "last_used", "pinned",
                                       "pin_expires"))
_SEALED_WHOLE_FIELDS = tuple(name for name in _SEALED_FIELDS if name not in _PIECE_FIELDS)
