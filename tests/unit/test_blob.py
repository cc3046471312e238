"""The blob file format: round trips, and every kind of damage is detected."""

from __future__ import annotations

import io
import random

import pytest

from kvcache import blob as blobfmt
from kvcache import keys

NS = keys.namespace("fp-test", {"type_k": "f16"})


def make_meta(tokens: list[int] | None = None, reason: str = "cold") -> blobfmt.BlobMeta:
    return blobfmt.BlobMeta(
        namespace=NS, model_fingerprint="fp-test", kv_layout={"type_k": "f16"},
        tokens=tokens if tokens is not None else list(range(37)), reason=reason,
        model_name="tiny.gguf", tenant_id=keys.tenant_id("t1"), created=1234.5)


def make_blob(payload: bytes, codec: str = "none", tokens: list[int] | None = None) -> bytes:
    return b"".join(bytes(p) for p in blobfmt.encode_blob(make_meta(tokens), payload, codec))


def payload_of(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("n", [0, 1, 1000, 300_000])
def test_round_trip(codec: str, n: int) -> None:
    payload = payload_of(n)
    data = make_blob(payload, codec)
    blob = blobfmt.decode_blob(data)
    assert bytes(blob.payload) == payload
    assert blob.header.codec == codec
    assert blob.header.raw_len == n
    assert blob.header.total_size == len(data)
    meta = blob.meta
    assert list(meta.tokens) == list(range(37))
    assert meta.namespace == NS
    assert meta.model_fingerprint == "fp-test"
    assert dict(meta.kv_layout) == {"type_k": "f16"}
    assert meta.reason == "cold"
    assert meta.model_name == "tiny.gguf"
    assert meta.tenant_id == keys.tenant_id("t1")
    assert meta.created == 1234.5
    assert meta.producer.startswith("kvcache/")


def test_zstd_shrinks_compressible_payloads() -> None:
    payload = b"\x00\x01" * 100_000
    assert len(make_blob(payload, "zstd")) < len(payload) // 10
    assert bytes(blobfmt.decode_blob(make_blob(payload, "zstd")).payload) == payload


def test_header_layout() -> None:
    data = make_blob(b"abc")
    assert data[:4] == blobfmt.MAGIC
    assert blobfmt.HEADER_SIZE == 60
    header = blobfmt.parse_header(data)
    assert header.version == blobfmt.FORMAT_VERSION
    assert header.payload_len == 3
    assert data[header.payload_offset :] == b"abc"


def test_unknown_reason_and_codec_are_refused() -> None:
    with pytest.raises(blobfmt.BlobError, match="reason"):
        blobfmt.encode_blob(make_meta(reason="whenever"), b"x")
    with pytest.raises(blobfmt.BlobError, match="codec"):
        blobfmt.encode_blob(make_meta(), b"x", codec="lz4")


def damaged(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0xFF
    return bytes(out)


def test_every_single_byte_flip_is_detected() -> None:
    data = make_blob(payload_of(200))
    for pos in range(len(data)):
        bad = damaged(data, pos)
        with pytest.raises(blobfmt.BlobError):
            blobfmt.decode_blob(bad)
            pytest.fail(f"a flipped byte at offset {pos} of {len(data)} went unnoticed")
        with pytest.raises(blobfmt.BlobError):
            blobfmt.verify_file(io.BytesIO(bad))
        v = blobfmt.StreamVerifier(len(bad))
        with pytest.raises(blobfmt.BlobError):
            v.feed(bad)
            v.finish()


@pytest.mark.parametrize("where", ["header", "meta", "payload", "payload_end"])
def test_truncation_is_detected(where: str) -> None:
    data = make_blob(payload_of(500))
    header = blobfmt.parse_header(data)
    cut = {"header": 30, "meta": blobfmt.HEADER_SIZE + 5, "payload": header.payload_offset + 100,
           "payload_end": len(data) - 1}[where]
    short = data[:cut]
    with pytest.raises(blobfmt.BlobError):
        blobfmt.decode_blob(short)
    with pytest.raises(blobfmt.BlobError):
        blobfmt.verify_file(io.BytesIO(short))
    v = blobfmt.StreamVerifier()
    v.feed(short)
    with pytest.raises(blobfmt.BlobError, match="truncated"):
        v.finish()


def test_trailing_bytes_are_detected() -> None:
    data = make_blob(b"payload") + b"\x00"
    with pytest.raises(blobfmt.BlobError):
        blobfmt.decode_blob(data)
    with pytest.raises(blobfmt.BlobError, match="trailing"):
        blobfmt.verify_file(io.BytesIO(data))
    v = blobfmt.StreamVerifier(len(data) - 1)
    with pytest.raises(blobfmt.BlobError, match="more bytes"):
        v.feed(data)


def test_garbage_is_not_a_blob() -> None:
    with pytest.raises(blobfmt.BlobError, match="magic"):
        blobfmt.decode_blob(b"\x00" * 100)
    with pytest.raises(blobfmt.BlobError, match="truncated"):
        blobfmt.parse_header(b"KVCB")


def test_verify_file_reads_header_and_meta() -> None:
    data = make_blob(payload_of(1 << 16))
    header, meta = blobfmt.verify_file(io.BytesIO(data), chunk_bytes=1000)
    assert header.total_size == len(data)
    assert list(meta.tokens) == list(range(37))
    # read_header_and_meta reads the head only: a damaged payload is not its business.
    bad = damaged(data, len(data) - 1)
    header2, _ = blobfmt.read_header_and_meta(io.BytesIO(bad))
    assert header2 == header


@pytest.mark.parametrize("chunk", [1, 7, 59, 60, 61, 4096])
def test_stream_verifier_accepts_any_chunking(chunk: int) -> None:
    data = make_blob(payload_of(3000), tokens=list(range(50)))
    v = blobfmt.StreamVerifier(len(data))
    for start in range(0, len(data), chunk):
        v.feed(memoryview(data)[start : start + chunk])
    header, meta = v.finish()
    assert header.total_size == len(data)
    assert list(meta.tokens) == list(range(50))


def test_stream_verifier_refuses_a_size_other_than_announced() -> None:
    data = make_blob(payload_of(100))
    v = blobfmt.StreamVerifier(len(data) + 10)
    with pytest.raises(blobfmt.BlobError, match="announced"):
        v.feed(data)


def test_metadata_must_be_complete() -> None:
    meta_bytes = blobfmt.msgpack.packb({"namespace": NS}, use_bin_type=True)
    header = blobfmt.BlobHeader(1, "none", len(meta_bytes), 0, 0,
                                blobfmt.xxhash.xxh3_64_intdigest(meta_bytes), 0)
    with pytest.raises(blobfmt.BlobError, match="metadata"):
        blobfmt.parse_meta(header, meta_bytes)
