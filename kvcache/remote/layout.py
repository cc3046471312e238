"""What the remote tier stores: key names, the signed (or encrypted) value envelope, the
entry record.

Everything read back is untrusted: :func:`open_value` and :meth:`RemoteRecord.unpack`
raise :class:`ValueRefused` (a signature problem) or :class:`ValueInvalid` (anything else)
for a value that is not exactly what a kvcache daemon wrote.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .. import keys

RECORD_VERSION = 1
_MAGIC = b"KVR1"
_UNSIGNED = 0
_SIGNED = 1
_ENCRYPTED = 2
_TAG_BYTES = 32
_NONCE_BYTES = 12
_GCM_TAG_BYTES = 16
_HEAD = len(_MAGIC) + 1
_SIGN_DOMAIN = b"kvcache.remote.v1\x00"
_ENCRYPT_DOMAIN = b"kvcache.remote-encryption-key.v1\x00"
_NAMES_DOMAIN = b"kvcache.remote-names.v2\x00"
# The layout of keyed names (Names): part of every one, so that a fleet's entries stored
# under the plain names of layout 1 are never read as, nor mixed with, these.
KEYED_NAMES_VERSION = 2
# Far beyond any real chain or blob, low enough that a crafted record cannot make a
# reader build huge key lists.
MAX_CHAIN = 4096
MAX_PARTS = 1 << 16


class ValueInvalid(ValueError):
    """A remote value is malformed, or does not match what it claims to be."""


class ValueRefused(ValueInvalid):
    """A remote value is unsigned while a signing key is set, or its signature is wrong."""


# -------------------------------------------------------------------------------- names


class Names:
    """Redis key names under one prefix. Every key of an entry shares the hash tag
    ``{<id>}``, so they live in one cluster slot (one node: one round trip).

    With the fleet's key (a signed or encrypted tier) names are keyed (layout 2, under
    ``P:2:``): the id of an entry or a block is HMAC-SHA256(name key, its key)[:16],
    never the key itself. Entry keys and block hashes are hashes of a namespace and
    tokens, and a namespace without a tenant is an unsalted hash of the model, so a
    plain name let anyone who can list the server confirm a guessed prompt; a keyed one
    tells nothing to whoever lacks the fleet's key. Without a key (an unsigned tier,
    whose values show the tokens anyway) names are the keys' hex (layout 1, under
    ``P:``)."""

    def __init__(self, prefix: str, signing_key: bytes | None = None) -> None:
        self.prefix = prefix
        self._key = None if signing_key is None else hmac.new(
            signing_key, _NAMES_DOMAIN, hashlib.sha256).digest()
        self.base = prefix if self._key is None else f"{prefix}:{KEYED_NAMES_VERSION}"

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def _id(self, kind: bytes, value: bytes) -> str:
        if self._key is None:
            return value.hex()
        return hmac.new(self._key, kind + value, hashlib.sha256).digest()[:16].hex()

    def record(self, key: bytes) -> bytes:
        return f"{self.base}:{{{self._id(b'e', key)}}}:rec".encode()

    def part(self, key: bytes, i: int) -> bytes:
        return f"{self.base}:{{{self._id(b'e', key)}}}:p{i}".encode()

    def lock(self, key: bytes) -> bytes:
        return f"{self.base}:{{{self._id(b'e', key)}}}:up".encode()

    def block(self, block_hash: bytes) -> bytes:
        return f"{self.base}:b:{self._id(b'b', block_hash)}".encode()

    @property
    def record_pattern(self) -> str:
        """SCAN pattern of every record key (of this layout only)."""
        return f"{self.base}:{{*}}:rec"


# -------------------------------------------------------------------------------- envelope


def _tag(signing_key: bytes, name: bytes, body: bytes | memoryview) -> bytes:
    mac = hmac.new(signing_key, _SIGN_DOMAIN, hashlib.sha256)
    mac.update(struct.pack("<I", len(name)))
    mac.update(name)
    mac.update(body)
    return mac.digest()


def _aead(signing_key: bytes) -> AESGCM:
    """AES-256-GCM under a key derived from the fleet's signing key (one secret to give
    every host; the derivation keeps the two uses apart)."""
    return AESGCM(hmac.new(signing_key, _ENCRYPT_DOMAIN, hashlib.sha256).digest())


def _aad(name: bytes) -> bytes:
    """What an encrypted value is bound to besides its key: the name it is stored under
    (a value cannot be moved to another name)."""
    return _SIGN_DOMAIN + struct.pack("<I", len(name)) + name


def seal(name: bytes, body: bytes | memoryview, signing_key: bytes | None,
         encrypt: bool = False) -> bytes:
    """The value stored under ``name``: a small header, then either the body after an
    HMAC-SHA256 over the key name and the body when a signing key is set (a value cannot
    be moved to another name), or, with ``encrypt``, a random nonce and the body
    encrypted and authenticated (AES-256-GCM) with the key name as associated data."""
    if signing_key is None:
        if encrypt:
            raise ValueError("encryption needs the signing key")
        return b"".join((_MAGIC, bytes((_UNSIGNED,)), body))
    if encrypt:
        nonce = os.urandom(_NONCE_BYTES)  # 96 random bits: no repeat in 2**32 values
        return b"".join((_MAGIC, bytes((_ENCRYPTED,)), nonce,
                         _aead(signing_key).encrypt(nonce, bytes(body), _aad(name))))
    return b"".join((_MAGIC, bytes((_SIGNED,)), _tag(signing_key, name, body), body))


def open_value(name: bytes, value: bytes, signing_key: bytes | None,
               require_encrypted: bool = False) -> memoryview:
    """The body of a value read from ``name``. With a signing key, only a value signed
    or encrypted with it for this very name is accepted (with ``require_encrypted``, only
    an encrypted one). Without one, signatures are not checked (the blob checksums and
    key recomputation still are) and encrypted values cannot be read."""
    view = memoryview(value)
    label = name.decode(errors="replace")
    if len(view) < _HEAD or view[: len(_MAGIC)] != _MAGIC:
        raise ValueInvalid(f"{label}: not a kvcache remote value")
    flag = view[len(_MAGIC)]
    if flag == _ENCRYPTED:
        if signing_key is None:
            raise ValueRefused(f"{label}: encrypted value, and no fleet key to open it")
        if len(view) < _HEAD + _NONCE_BYTES + _GCM_TAG_BYTES:
            raise ValueInvalid(f"{label}: malformed value header")
        nonce = bytes(view[_HEAD : _HEAD + _NONCE_BYTES])
        try:
            return memoryview(_aead(signing_key).decrypt(
                nonce, bytes(view[_HEAD + _NONCE_BYTES :]), _aad(name)))
        except InvalidTag:
            raise ValueRefused(f"{label}: encrypted value fails authentication") from None
    if require_encrypted and flag in (_UNSIGNED, _SIGNED):
        raise ValueRefused(f"{label}: value not encrypted")
    if flag == _UNSIGNED:
        if signing_key is not None:
            raise ValueRefused(f"{label}: unsigned value")
        return view[_HEAD:]
    if flag != _SIGNED or len(view) < _HEAD + _TAG_BYTES:
        raise ValueInvalid(f"{label}: malformed value header")
    body = view[_HEAD + _TAG_BYTES :]
    if signing_key is not None and not hmac.compare_digest(
            view[_HEAD : _HEAD + _TAG_BYTES], _tag(signing_key, name, body)):
        raise ValueRefused(f"{label}: signature mismatch")
    return body


# -------------------------------------------------------------------------------- record


class _Linkable(Protocol):
    @property
    def key(self) -> bytes: ...
    @property
    def base(self) -> int: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def size(self) -> int: ...


@dataclass(frozen=True)
class ChainLink:
    """One entry of a chain: its key, the tokens it takes from its ancestors (``base``),
    its length and its blob's size in bytes."""

    key: bytes
    base: int
    n_tokens: int
    size: int

    @classmethod
    def of(cls, record: _Linkable) -> ChainLink:
        """From anything with these four fields (e.g. :class:`kvcache.record.Record`)."""
        return cls(record.key, record.base, record.n_tokens, record.size)


def check_chain(chain: Sequence[ChainLink]) -> None:
    """Root first, each link taking a part of its predecessor's tokens."""
    if not chain or len(chain) > MAX_CHAIN:
        raise ValueInvalid(f"a chain of {len(chain)} links")
    prev: ChainLink | None = None
    for link in chain:
        if len(link.key) != keys.KEY_BYTES or link.size <= 0:
            raise ValueInvalid("a chain link with a bad key or size")
        if prev is None:
            if link.base != 0:
                raise ValueInvalid("a chain whose root is a piece")
        elif not prev.base < link.base <= prev.n_tokens:
            raise ValueInvalid(f"a chain link with base {link.base} after one of "
                               f"[{prev.base}, {prev.n_tokens})")
        if not link.base < link.n_tokens:
            raise ValueInvalid(f"a chain link with base {link.base} of {link.n_tokens} tokens")
        prev = link


@dataclass(frozen=True)
class RemoteRecord:
    """An entry as the remote holds it: what a lookup needs (namespace, tokens, chain)
    without reading its parts, and what the operator view shows."""

    key: bytes
    namespace: bytes
    tokens: bytes  # packed u32 LE
    parent: bytes
    base: int
    size: int  # bytes of the blob
    parts: int
    chain: tuple[ChainLink, ...]  # root first, this entry last
    codec: str = ""
    reason: str = ""
    created: float = 0.0
    model_name: str = ""
    model_fingerprint: str = ""
    tenant_id: str = ""

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // 4

    def pack(self) -> bytes:
        return msgpack.packb({
            "v": RECORD_VERSION, "key": self.key, "ns": self.namespace, "tokens": self.tokens,
            "parent": self.parent, "base": self.base, "size": self.size, "parts": self.parts,
            "chain": [[c.key, c.base, c.n_tokens, c.size] for c in self.chain],
            "codec": self.codec, "reason": self.reason, "created": self.created,
            "model_name": self.model_name, "fp": self.model_fingerprint,
            "tenant": self.tenant_id,
        }, use_bin_type=True)

    @classmethod
    def unpack(cls, body: bytes | memoryview, key: bytes | None,
               block_size: int) -> RemoteRecord:
        """Decode and check a record read from ``key``'s record name (None: a name read
        by a listing; the caller checks the record is that name's): well typed, its
        tokens and namespace recompute to its key, its chain ends with it."""
        try:
            raw = msgpack.unpackb(body, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueInvalid(f"record does not decode: {exc!r}") from None
        if not isinstance(raw, dict) or raw.get("v") != RECORD_VERSION:
            raise ValueInvalid("record is not a version-1 map")
        try:
            chain = tuple(ChainLink(_bytes(c[0]), _int(c[1]), _int(c[2]), _int(c[3]))
                          for c in _list(raw["chain"]))
            record = cls(
                key=_bytes(raw["key"]), namespace=_bytes(raw["ns"]),
                tokens=_bytes(raw["tokens"]), parent=_bytes(raw["parent"]),
                base=_int(raw["base"]), size=_int(raw["size"]), parts=_int(raw["parts"]),
                chain=chain, codec=_str(raw["codec"]), reason=_str(raw["reason"]),
                created=_float(raw["created"]), model_name=_str(raw["model_name"]),
                model_fingerprint=_str(raw["fp"]), tenant_id=_str(raw["tenant"]),
            )
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueInvalid(f"record fields: {exc!r}") from None
        record.check(record.key if key is None else key, block_size)
        return record

    def check(self, key: bytes, block_size: int) -> None:
        if self.key != key or len(self.namespace) != keys.KEY_BYTES or not self.tokens \
                or len(self.tokens) % 4:
            raise ValueInvalid("record key, namespace or tokens malformed")
        if keys.entry_key(self.namespace, self.tokens, block_size).key != key:
            raise ValueInvalid("record tokens do not recompute to its key")
        if not 0 < self.parts <= MAX_PARTS or self.parts > self.size:
            raise ValueInvalid(f"record of {self.size} bytes in {self.parts} parts")
        check_chain(self.chain)
        if self.chain[-1] != ChainLink(key, self.base, self.n_tokens, self.size):
            raise ValueInvalid("record chain does not end with the entry itself")
        expected_parent = self.chain[-2].key if len(self.chain) > 1 else b""
        if self.parent != expected_parent:
            raise ValueInvalid("record parent differs from its chain")


def _bytes(v: Any) -> bytes:
    if not isinstance(v, bytes):
        raise TypeError(f"a {type(v).__name__} where bytes belong")
    return v


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(f"{v!r} where a non-negative integer belongs")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"a {type(v).__name__} where a string belongs")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"a {type(v).__name__} where a number belongs")
    return float(v)


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list) or len(v) > MAX_CHAIN:
        raise TypeError("the chain is not a list of at most MAX_CHAIN links")
    return v
