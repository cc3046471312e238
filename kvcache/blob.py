"""The blob file format: self-describing, versioned, checksummed.

Layout (all integers little-endian)::

    header  (60 bytes, fixed)
      magic         4s   b"KVCB"
      version       u16  FORMAT_VERSION
      codec         u8   0 none, 1 zstd
      flags         u8   reserved, 0
      meta_len      u32  length of the msgpack metadata
      payload_len   u64  stored (possibly compressed) payload length
      raw_len       u64  payload length after decoding
      meta_xxh3     u64  xxh3_64 of the metadata bytes
      payload_xxh3  u64  xxh3_64 of the stored payload bytes
      reserved      u64  0
      header_xxh3   u64  xxh3_64 of the 52 bytes above
    metadata (msgpack map)
    payload  (``llama_state_seq_get_data`` bytes, encoded by ``codec``)

The metadata holds namespace, model fingerprint and name, KV layout, token ids, save
reason, created time, producer version and tenant id: the index can be rebuilt from blob
files alone. A *piece* (an entry stored as the cells beyond another entry's) also names
that ``parent`` entry and ``base``, the tokens it takes from the parent's chain: its
payload holds only what follows them. ``cell_layout`` is the producer's own description
of such a payload, and ``logits`` the producer's scores for the token after the entry's
last one, so that a restore of exactly these tokens needs no decode to go on (both opaque
here: the daemon never reads them). Hit counts and last-use times are never written here (they live in the
index), so a published blob never changes.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack
import xxhash
import zstandard

from . import __version__
from .keys import KEY_BYTES, bytes_to_tokens, tokens_to_bytes

MAGIC = b"KVCB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBBIQQQQQ")
_HEADER_SUM = struct.Struct("<Q")
HEADER_SIZE = _HEADER.size + _HEADER_SUM.size  # 60
MAX_META_BYTES = 64 * 1024 * 1024  # 16M tokens of ids, far beyond any context

CODECS = {"none": 0, "zstd": 1}
CODEC_NAMES = {v: k for k, v in CODECS.items()}
SAVE_REASONS = ("cold", "prompt", "continued", "finish", "evict", "shutdown", "manual")


class BlobError(ValueError):
    """A blob is malformed, truncated or fails its checksums."""


@dataclass(frozen=True)
class BlobHeader:
    version: int
    codec: str
    meta_len: int
    payload_len: int
    raw_len: int
    meta_xxh3: int
    payload_xxh3: int

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + self.meta_len + self.payload_len

    @property
    def payload_offset(self) -> int:
        return HEADER_SIZE + self.meta_len


@dataclass(frozen=True)
class BlobMeta:
    namespace: bytes
    model_fingerprint: str
    kv_layout: Mapping[str, str]
    tokens: Sequence[int]
    reason: str
    model_name: str = ""
    tenant_id: str = ""
    created: float = field(default_factory=time.time)
    producer: str = f"kvcache/{__version__}"
    parent: bytes = b""  # the entry this one's first ``base`` tokens come from (b"": none)
    base: int = 0
    cell_layout: bytes = b""  # producer-defined (a run of cells' layout); b"": whole state
    logits: bytes = b""  # producer-defined: the next token's scores after the last token

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.parent and (len(self.parent) != KEY_BYTES or not 0 < self.base < n):
            raise BlobError(f"bad piece metadata: parent of {len(self.parent)} bytes, "
                            f"base {self.base} for {n} tokens")
        if not self.parent and self.base:
            raise BlobError(f"bad piece metadata: base {self.base} without a parent")

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "model_fingerprint": self.model_fingerprint,
            "model_name": self.model_name,
            "kv_layout": dict(self.kv_layout),
            "tokens": tokens_to_bytes(self.tokens),
            "reason": self.reason,
            "tenant_id": self.tenant_id,
            "created": self.created,
            "producer": self.producer,
            # Written only when set: a whole-state blob stays byte-identical to what the
            # previous version wrote (and readable by it).
            **({"parent": self.parent, "base": self.base} if self.parent else {}),
            **({"cell_layout": self.cell_layout} if self.cell_layout else {}),
            **({"logits": self.logits} if self.logits else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlobMeta:
        # bytes() of an int allocates that many zero bytes: a crafted blob whose namespace
        # or tokens is 2**40 made every reader allocate a terabyte (or die on OverflowError).
        for name in ("namespace", "tokens"):
            if not isinstance(d.get(name), bytes):
                raise BlobError(f"bad blob metadata: {name} is not a byte string")
        for name in ("parent", "cell_layout", "logits"):
            if not isinstance(d.get(name, b""), bytes):
                raise BlobError(f"bad blob metadata: {name} is not a byte string")
        try:
            return cls(
                namespace=bytes(d["namespace"]),
                model_fingerprint=str(d["model_fingerprint"]),
                model_name=str(d.get("model_name", "")),
                kv_layout={str(k): str(v) for k, v in dict(d["kv_layout"]).items()},
                tokens=bytes_to_tokens(bytes(d["tokens"])),
                reason=str(d["reason"]),
                tenant_id=str(d.get("tenant_id", "")),
                created=float(d["created"]),
                producer=str(d.get("producer", "")),
                parent=bytes(d.get("parent", b"")),
                base=_as_int(d.get("base", 0)),
                cell_layout=bytes(d.get("cell_layout", b"")),
                logits=bytes(d.get("logits", b"")),
            )
        except BlobError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise BlobError(f"bad blob metadata: {exc!r}") from None


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlobError(f"bad blob metadata: a {type(value).__name__} where an integer "
                        "belongs")
    return value


def encode_payload(payload: bytes | memoryview, codec: str, level: int = 1) -> bytes | memoryview:
    if codec == "none":
        return payload
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=level).compress(payload)
    raise BlobError(f"unknown codec {codec!r}")


def decode_payload(stored: bytes | memoryview, codec: str, raw_len: int) -> bytes | memoryview:
    if codec == "none":
        return stored
    if codec == "zstd":
        try:
            out, n = _zstd_decode(stored, raw_len)
        except zstandard.ZstdError as exc:
            raise BlobError(f"zstd payload does not decode: {exc}") from None
        if n != raw_len:
            got = f"more than {raw_len}" if n > raw_len else str(n)
            raise BlobError(f"payload decoded to {got} bytes, header says {raw_len}")
        return memoryview(out)[:n]
    raise BlobError(f"unknown codec {codec!r}")


def _zstd_decode(stored: bytes | memoryview, raw_len: int) -> tuple[bytearray, int]:
    """Decode into a buffer that grows with the bytes actually produced, stopping one byte
    past ``raw_len``. ``decompress(max_output_size=raw_len)`` allocated raw_len up front
    for a frame without a content size: a crafted header claiming 2^34 bytes allocated
    16 GiB, 2^60 raised MemoryError."""
    out = bytearray(min(raw_len + 1, max(8 * len(stored), 1 << 20)))
    n = 0
    with zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True) as reader:
        while True:
            if n == len(out):
                if n > raw_len:
                    break
                out += bytes(min(len(out), raw_len + 1 - n))
            with memoryview(out) as whole, whole[n:] as free:
                got = reader.readinto(free)
            if not got:
                break
            n += got
    return out, n


def pack_header_and_meta(meta: BlobMeta, stored_payload: bytes | memoryview, codec: str,
                         raw_len: int) -> bytes:
    meta_bytes = msgpack.packb(meta.to_dict(), use_bin_type=True)
    head = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        CODECS[codec],
        0,
        len(meta_bytes),
        len(stored_payload),
        raw_len,
        xxhash.xxh3_64_intdigest(meta_bytes),
        xxhash.xxh3_64_intdigest(stored_payload),
        0,
    )
    return head + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head)) + meta_bytes


def encode_blob(meta: BlobMeta, payload: bytes | memoryview, codec: str = "none",
                level: int = 1) -> list[bytes | memoryview]:
    """The blob as a list of byte strings to write one after another (no payload copy)."""
    if meta.reason not in SAVE_REASONS:
        raise BlobError(f"unknown save reason {meta.reason!r}")
    stored = encode_payload(payload, codec, level)
    return [pack_header_and_meta(meta, stored, codec, len(payload)), stored]


def parse_header(data: bytes | bytearray | memoryview) -> BlobHeader:
    if len(data) < HEADER_SIZE:
        raise BlobError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    head = bytes(data[: _HEADER.size])
    (stored_sum,) = _HEADER_SUM.unpack_from(data, _HEADER.size)
    magic, version, codec, flags, meta_len, payload_len, raw_len, meta_sum, payload_sum, _ = (
        _HEADER.unpack(head)
    )
    if magic != MAGIC:
        raise BlobError("not a kvcache blob (bad magic)")
    if xxhash.xxh3_64_intdigest(head) != stored_sum:
        raise BlobError("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise BlobError(f"unsupported blob format version {version}")
    if codec not in CODEC_NAMES:
        raise BlobError(f"unknown codec id {codec}")
    if meta_len > MAX_META_BYTES:
        raise BlobError(f"metadata length {meta_len} exceeds {MAX_META_BYTES}")
    # A stored payload is its own decoding: a lie here passed every check at commit, and
    # then every load of the entry failed.
    if codec == CODECS["none"] and raw_len != payload_len:
        raise BlobError(f"codec none, yet raw_len {raw_len} differs from payload_len "
                        f"{payload_len}")
    return BlobHeader(version, CODEC_NAMES[codec], meta_len, payload_len, raw_len, meta_sum,
                      payload_sum)


def parse_meta(header: BlobHeader, meta_bytes: bytes | memoryview) -> BlobMeta:
    if len(meta_bytes) != header.meta_len:
        raise BlobError(f"truncated metadata: {len(meta_bytes)} of {header.meta_len} bytes")
    if xxhash.xxh3_64_intdigest(meta_bytes) != header.meta_xxh3:
        raise BlobError("metadata checksum mismatch")
    try:
        raw = msgpack.unpackb(meta_bytes, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BlobError(f"metadata does not decode: {exc!r}") from None
    if not isinstance(raw, dict):
        raise BlobError("metadata is not a map")
    return BlobMeta.from_dict(raw)


def read_header_and_meta(f: BinaryIO) -> tuple[BlobHeader, BlobMeta]:
    """Read and check only the header and metadata of a blob file (not the payload)."""
    header = parse_header(f.read(HEADER_SIZE))
    return header, parse_meta(header, f.read(header.meta_len))


@dataclass(frozen=True)
class Blob:
    header: BlobHeader
    meta: BlobMeta
    payload: bytes | memoryview  # decoded


def decode_blob(data: bytes | bytearray | memoryview, *, verify: bool = True) -> Blob:
    """Parse a whole blob held in memory, checking every checksum."""
    view = memoryview(data)
    header = parse_header(view)
    if len(view) != header.total_size:
        raise BlobError(f"blob is {len(view)} bytes, header says {header.total_size}")
    meta = parse_meta(header, view[HEADER_SIZE : header.payload_offset])
    stored = view[header.payload_offset :]
    if verify and xxhash.xxh3_64_intdigest(stored) != header.payload_xxh3:
        raise BlobError("payload checksum mismatch")
    return Blob(header, meta, decode_payload(stored, header.codec, header.raw_len))


def verify_file(f: BinaryIO, chunk_bytes: int = 4 << 20) -> tuple[BlobHeader, BlobMeta]:
    """Check every checksum of a blob file by streaming it; raise BlobError if bad."""
    header, meta = read_header_and_meta(f)
    digest = xxhash.xxh3_64()
    remaining = header.payload_len
    while remaining:
        chunk = f.read(min(chunk_bytes, remaining))
        if not chunk:
            raise BlobError(f"truncated payload: {remaining} bytes missing")
        digest.update(chunk)
        remaining -= len(chunk)
    if f.read(1):
        raise BlobError("trailing bytes after payload")
    if digest.intdigest() != header.payload_xxh3:
        raise BlobError("payload checksum mismatch")
    return header, meta


def blob_size(parts: Iterable[bytes | memoryview]) -> int:
    return sum(len(p) for p in parts)


class StreamVerifier:
    """Checks a blob as its bytes arrive, so a streamed write is verified without re-reading.

    Feed every chunk in order; :meth:`finish` returns the header and metadata once the
    whole blob has arrived and every checksum holds, else raises :class:`BlobError`.
    """

    def __init__(self, expected_size: int | None = None) -> None:
        self.expected_size = expected_size
        self.received = 0
        self._prefix = bytearray()
        self.header: BlobHeader | None = None
        self.meta: BlobMeta | None = None
        self._digest = xxhash.xxh3_64()

    def feed(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        self.received += len(view)
        if self.expected_size is not None and self.received > self.expected_size:
            raise BlobError(f"more bytes than the {self.expected_size} announced")
        while self.meta is None:
            need = HEADER_SIZE if self.header is None else self.header.payload_offset
            take = min(len(view), need - len(self._prefix))
            self._prefix += view[:take]
            view = view[take:]
            if len(self._prefix) < need:
                return
            if self.header is None:
                self.header = parse_header(self._prefix)
                if self.expected_size is not None and self.header.total_size != self.expected_size:
                    raise BlobError(f"header says {self.header.total_size} bytes, "
                                    f"{self.expected_size} were announced")
            else:
                self.meta = parse_meta(self.header, bytes(self._prefix[HEADER_SIZE:]))
                self._prefix = bytearray()
        if len(view):
            self._digest.update(view)

    def finish(self) -> tuple[BlobHeader, BlobMeta]:
        if self.header is None or self.meta is None:
            raise BlobError(f"truncated blob: {self.received} bytes received")
        if self.received != self.header.total_size:
            raise BlobError(f"truncated blob: {self.received} of {self.header.total_size} bytes")
        if self._digest.intdigest() != self.header.payload_xxh3:
            raise BlobError("payload checksum mismatch")
        return self.header, self.meta
