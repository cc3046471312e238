"""Cache keys: pure functions, identical in every process and on every machine.

* namespace = xxh3_128 over a canonical encoding of (model fingerprint, KV layout,
  tenant salt). llama.cpp accepts a state from a different model of the same shape, so
  the fingerprint is of the file's bytes, not its name.
* block hashes: ``h0 = namespace``, ``hk = xxh3_128(h(k-1) || block k as u32 LE)``.
  One pass over a prompt yields the key of every aligned prefix.
* an entry of any length hangs under the block hash of its last full block (its
  *anchor*) together with its *tail* (the tokens after that block). Its key is the
  anchor itself when the tail is empty, else ``xxh3_128(anchor || tail as u32 LE)``.
  Tails are shorter than a block, so an entry key never equals a block hash of a
  different prefix.

No Python ``hash()`` anywhere: it is salted per process.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import xxhash

KEY_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1
_NAMESPACE_DOMAIN = b"kvcache.namespace.v1\x00"
_TENANT_DOMAIN = b"kvcache.tenant.v1\x00"


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as packed little-endian u32 (the form every hash is taken over)."""
    packed = array.array("I", tokens)  # raises OverflowError for ids outside u32
    if packed.itemsize != 4:  # pragma: no cover - every platform we support has 4-byte "I"
        packed = array.array("L", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def bytes_to_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"token bytes length {len(data)} is not a multiple of 4")
    packed = array.array("I")
    packed.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """How many leading u32 tokens two packed token strings share: a bisection whose
    steps copy and compare only the part not yet known equal (about 2n bytes in all;
    bytes slices, since memoryview comparison goes element by element)."""
    n = min(len(a), len(b)) // 4
    if a[: n * 4] == b[: n * 4]:
        return n
    lo, hi = 0, n  # a[:4*lo] == b[:4*lo], a[:4*hi] != b[:4*hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * 4 : mid * 4] == b[lo * 4 : mid * 4]:  # the first lo tokens agree
            lo = mid
        else:
            hi = mid
    return lo


def tenant_id(tenant: str) -> str:
    """Stable, non-reversible label of a tenant salt (the salt itself is never stored)."""
    if not tenant:
        return ""
    return xxhash.xxh3_64_hexdigest(_TENANT_DOMAIN + tenant.encode())


def namespace(model_fingerprint: str, kv_layout: Mapping[str, str], tenant: str = "") -> bytes:
    """The 16-byte namespace of (model, KV layout, tenant)."""
    if not model_fingerprint:
        raise ValueError("model_fingerprint is required")
    canonical = msgpack.packb(
        [model_fingerprint, sorted((str(k), str(v)) for k, v in kv_layout.items()), tenant],
        use_bin_type=True,
    )
    return xxhash.xxh3_128_digest(_NAMESPACE_DOMAIN + canonical)


def block_hashes(ns: bytes, tokens: Sequence[int] | bytes, block_size: int) -> list[bytes]:
    """``[h0, h1, ..., hK]`` for the K full blocks of ``tokens`` (h0 is the namespace)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    raw = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    step = block_size * 4
    hashes = [ns]
    prev = ns
    for start in range(0, len(raw) - step + 1, step):
        prev = xxhash.xxh3_128_digest(prev + raw[start : start + step])
        hashes.append(prev)
    return hashes


@dataclass(frozen=True)
class EntryKey:
    """Where an entry of ``n_tokens`` tokens lives in the index."""

    key: bytes
    anchor: bytes  # block hash of the entry's last full block (the namespace if none)
    tail: bytes  # the tokens after that block, packed u32 LE (shorter than one block)
    n_tokens: int


def key_under(anchor: bytes, tail: bytes) -> bytes:
    """The key of the entry hanging under ``anchor`` with ``tail`` (packed u32 LE)."""
    return anchor if not tail else xxhash.xxh3_128_digest(anchor + tail)


def entry_key(ns: bytes, tokens: Sequence[int] | bytes, block_size: int) -> EntryKey:
    raw = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    n_tokens = len(raw) // 4
    hashes = block_hashes(ns, raw, block_size)
    anchor = hashes[-1]
    tail = raw[(len(hashes) - 1) * block_size * 4 :]
    return EntryKey(key=key_under(anchor, tail), anchor=anchor, tail=tail, n_tokens=n_tokens)


def passes(ns: bytes, tokens: Sequence[int] | bytes, block_size: int) -> list[tuple[bytes, bytes]]:
    """``(h_k, block k+1 as packed u32 LE)`` for each full block k+1 of the tokens
    (k < n // B): the rows by which a longest-common-prefix lookup finds an entry that
    goes through h_k (see index.py)."""
    raw = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    hashes = block_hashes(ns, raw, block_size)
    step = block_size * 4
    return [(hashes[k], raw[k * step : (k + 1) * step]) for k in range(len(hashes) - 1)]


def parse_key(text: str) -> bytes:
    """A key as operators type it: 32 hex digits."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"not a key (32 hex digits expected): {text!r}") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"not a key (32 hex digits expected): {text!r}")
    return key
