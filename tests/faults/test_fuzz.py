"""Bad input, generated: the blob parser, every RPC of the daemon, write streams that lie,
the runtime's Complete, and keys that try to leave the data directory.

Every answer must be a correct result or a precise refusal: ``BlobError`` from the parser,
an expected gRPC status per RPC from the services (never UNKNOWN or INTERNAL, save grpcio's
own INTERNAL for bytes that are not a protobuf message at all, which never reach the
service), within a deadline, with the process still serving afterwards. Hypothesis runs derandomized with a
bounded number of examples, so CI sees the same inputs every time; the daemons are real
processes shared across the examples of a module.

Run with ``-s`` to see how many examples each RPC got and which statuses they produced.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import itertools
import math
import os
import random
import re
import threading
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import xxhash
import zstandard
from click.testing import CliRunner
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.cli import main as kvcache_cli
from kvcache.client import CacheClient, Identity
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK

Code = grpc.StatusCode
U32 = 2**32 - 1
U64 = 2**64 - 1
IDENT = Identity("fp-fuzz", {"type_k": "f16"}, model_name="fuzz.gguf")
ALICE = Identity("fp-fuzz", {"type_k": "f16"}, tenant="alice", model_name="fuzz.gguf")

# Statuses seen per RPC over the whole module, printed at the end (pytest -s).
SEEN: defaultdict[str, Counter[str]] = defaultdict(Counter)


def fuzz_settings(max_examples: int) -> settings:
    # deadline=None: examples talk to real processes on a shared 2-core machine, so their
    # duration says nothing; a hang fails through the per-call gRPC deadline instead.
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def status_report() -> Iterator[None]:
    yield
    if SEEN:
        print("\nstatuses seen per RPC (examples run: total):")
        for name, seen in sorted(SEEN.items()):
            detail = ", ".join(f"{code} {n}" for code, n in seen.most_common())
            print(f"  {name:<36} {sum(seen.values()):>5}: {detail}")


# ============================================================================ blob parser

_FIELDS = ("magic", "version", "codec", "flags", "meta_len", "payload_len", "raw_len",
           "meta_xxh3", "payload_xxh3", "reserved")
_WIDTH = {"version": 16, "codec": 8, "flags": 8, "meta_len": 32}  # others: u64
NS = keys.namespace(IDENT.model_fingerprint, IDENT.kv_layout)


def good_meta(tokens: Sequence[int]) -> blobfmt.BlobMeta:
    return blobfmt.BlobMeta(namespace=NS, model_fingerprint="fp-fuzz", kv_layout={"type_k": "f16"},
                            tokens=list(tokens), reason="cold", model_name="fuzz.gguf",
                            created=1234.5)


def encode(payload: bytes, codec: str, tokens: Sequence[int]) -> bytes:
    return b"".join(bytes(p) for p in blobfmt.encode_blob(good_meta(tokens), payload, codec))


def reheader(data: bytes, **fields: int) -> bytes:
    """``data`` with header fields replaced and the header checksum recomputed, so that a
    lie gets past the checksum and reaches the code that trusts the lengths."""
    values = dict(zip(_FIELDS, blobfmt._HEADER.unpack_from(data.ljust(blobfmt.HEADER_SIZE,
                                                                        b"\0")), strict=True))
    values.update(fields)
    head = blobfmt._HEADER.pack(*values.values())
    return head + blobfmt._HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head)) + \
        data[blobfmt.HEADER_SIZE :]


def header_of(data: bytes) -> dict[str, Any]:
    return dict(zip(_FIELDS, blobfmt._HEADER.unpack_from(data), strict=True))


def remeta(data: bytes, meta: object) -> bytes:
    """Replace the metadata by msgpack of ``meta``, with lengths and checksums made right."""
    h = header_of(data)
    body = data[blobfmt.HEADER_SIZE + h["meta_len"] :]
    meta_bytes = msgpack.packb(meta, use_bin_type=True)
    out = reheader(data[: blobfmt.HEADER_SIZE], meta_len=len(meta_bytes),
                   meta_xxh3=xxhash.xxh3_64_intdigest(meta_bytes))
    return out + meta_bytes + body


def repayload(data: bytes, payload: bytes, fix_lengths: bool) -> bytes:
    h = header_of(data)
    head_and_meta = data[: blobfmt.HEADER_SIZE + h["meta_len"]]
    fields: dict[str, int] = {"payload_xxh3": xxhash.xxh3_64_intdigest(payload)}
    if fix_lengths:
        fields.update(payload_len=len(payload), raw_len=len(payload))
    return reheader(head_and_meta, **fields) + payload


def boundary_ints(hi: int, near: Sequence[int] = ()) -> st.SearchStrategy[int]:
    """Integers in [0, hi], weighted towards the values that break length arithmetic."""
    special = {0, 1, 2, 59, 60, 61, 255, 1 << 16, 1 << 20, 1 << 31, 1 << 32, 1 << 34,
               1 << 60, hi - 1, hi, *near, *(n + d for n in near for d in (-1, 1))}
    return st.one_of(st.sampled_from(sorted(v for v in special if 0 <= v <= hi)),
                     st.integers(0, hi))


# msgpack-able junk for metadata fields: huge and negative ints, floats, nesting, and maps
# with non-string keys (msgpack refuses those when unpacking).
msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), U64), st.floats(),
              st.text(max_size=20), st.binary(max_size=40),
              st.sampled_from([2**40, 2**62, U64, -1, 10**8])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-(2**63), U64)),
                                            inner, max_size=4)),
    max_leaves=12)

payloads = st.one_of(st.binary(max_size=2000), st.builds(bytes, st.integers(0, 5000)))
token_lists = st.lists(st.integers(0, U32), max_size=40)
valid_blobs = st.builds(encode, payloads, st.sampled_from(["none", "zstd"]), token_lists)


def has_meta(data: bytes) -> bool:
    """Whether ``data`` holds a whole header and the metadata its header announces."""
    return len(data) >= blobfmt.HEADER_SIZE and \
        blobfmt.HEADER_SIZE + header_of(data)["meta_len"] <= len(data)


@st.composite
def mutated_blobs(draw: st.DrawFn) -> bytes:
    """A valid blob damaged one to three times: bits flipped, cut short, extended, spliced
    with another blob, or given lying lengths, metadata or payloads under checksums made
    right (so that the lie gets past them)."""
    data = draw(valid_blobs)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "extend", "splice", "lie", "meta",
                                     "meta_field", "payload", "zstd_frame"]))
        if kind == "flip" and data:
            out = bytearray(data)
            for pos in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=4)):
                out[pos] ^= 1 << draw(st.integers(0, 7))
            data = bytes(out)
        elif kind == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif kind == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif kind == "splice":  # another blob's header on this body, or the other way round
            other = draw(valid_blobs)
            cut = draw(st.sampled_from([blobfmt.HEADER_SIZE, len(data) // 2, len(other) // 3]))
            data = draw(st.sampled_from([other[:cut] + data[cut:], data[:cut] + other[cut:]]))
        elif kind == "lie" and len(data) >= blobfmt.HEADER_SIZE:
            name = draw(st.sampled_from(_FIELDS[1:]))
            h = header_of(data)
            near = [h["meta_len"], h["payload_len"], h["raw_len"], len(data)]
            data = reheader(data, **{name: draw(boundary_ints(2 ** _WIDTH.get(name, 64) - 1,
                                                              near))})
        elif not has_meta(data):
            continue
        elif kind == "meta":  # anything msgpack can hold, instead of a map
            data = remeta(data, draw(msgpack_values))
        elif kind == "meta_field":  # a map with one field of another type, or missing
            meta = good_meta(draw(token_lists)).to_dict()
            name = draw(st.sampled_from([*meta, "extra"]))
            if draw(st.booleans()):
                meta[name] = draw(msgpack_values)
            else:
                meta.pop(name, None)
            data = remeta(data, meta)
        elif kind == "payload":
            data = repayload(data, draw(st.binary(max_size=300)), draw(st.booleans()))
        elif kind == "zstd_frame":
            # A real zstd frame with or without a content size, under a header whose
            # raw_len may lie (the checksums are made right, so only lengths can stop it).
            raw = draw(st.binary(max_size=500))
            frame = zstandard.ZstdCompressor(write_content_size=draw(st.booleans())).compress(raw)
            data = reheader(repayload(data, frame, True), codec=1,
                            raw_len=draw(boundary_ints(U64, [len(raw)])))
    return data


def header_with_valid_checksum(fields: dict[str, int], tail: bytes) -> bytes:
    head = blobfmt._HEADER.pack(blobfmt.MAGIC, *(fields[n] for n in _FIELDS[1:]))
    return head + blobfmt._HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head)) + tail


@st.composite
def random_headers(draw: st.DrawFn) -> bytes:
    """A header with magic and checksum right and every other field made up, mostly with
    a version and codec that pass, so the lengths are what gets tested."""
    fields = {n: draw(boundary_ints(2 ** _WIDTH.get(n, 64) - 1)) for n in _FIELDS[1:]}
    if draw(st.integers(0, 3)):
        fields["version"] = blobfmt.FORMAT_VERSION
        fields["codec"] = draw(st.sampled_from(list(blobfmt.CODEC_NAMES)))
        if fields["codec"] == blobfmt.CODECS["none"]:
            fields["raw_len"] = fields["payload_len"]
    return header_with_valid_checksum(fields, draw(st.binary(max_size=200)))

arbitrary_bytes = st.one_of(st.binary(max_size=400),
                            st.builds(lambda b: blobfmt.MAGIC + b, st.binary(max_size=200)),
                            random_headers())


def feed_in_pieces(data: bytes, sizes: Sequence[int],
                   announced: int | None) -> tuple[blobfmt.BlobHeader, blobfmt.BlobMeta]:
    verifier = blobfmt.StreamVerifier(announced)
    view = memoryview(data)
    pos = 0
    for size in itertools.cycle(sizes or [len(data) or 1]):
        if pos >= len(data):
            break
        verifier.feed(view[pos : pos + size])
        pos += size
    return verifier.finish()


def outcome(fn: Callable[[], Any]) -> Any:
    """The result, or the BlobError; any other exception fails the test as it is."""
    try:
        return fn()
    except blobfmt.BlobError as exc:
        return exc


def kind_of(result: object) -> str:
    if not isinstance(result, blobfmt.BlobError):
        return "ok"
    return re.split(r"[0-9'(:]", str(result), maxsplit=1)[0].strip()


def parse_every_way(data: bytes, sizes: Sequence[int], announced: int | None) -> None:
    """Feed ``data`` to every parser and check that they agree with each other, refuse
    only with BlobError, and allocate in proportion to the input, never to a length field.
    """
    tracemalloc.start()
    try:
        decoded = outcome(lambda: blobfmt.decode_blob(data))
        head = outcome(lambda: blobfmt.read_header_and_meta(io.BytesIO(data)))
        verified = outcome(lambda: blobfmt.verify_file(io.BytesIO(data), chunk_bytes=7))
        streamed = outcome(lambda: feed_in_pieces(data, sizes, len(data)))
        other = outcome(lambda: feed_in_pieces(data, sizes, announced))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # msgpack objects and token lists cost a few dozen bytes per input byte; the zstd
    # decoder starts from a 1 MiB buffer. A length field driving allocation costs GiBs.
    assert peak <= (2 << 20) + 64 * len(data), f"{peak} bytes allocated for {len(data)}"
    ok = not isinstance(verified, blobfmt.BlobError)
    assert ok == (not isinstance(streamed, blobfmt.BlobError)), (verified, streamed)
    # What stopped it (--hypothesis-show-statistics): the cases must reach past checksums.
    event(f"decode_blob: {kind_of(decoded)}; verify_file: {kind_of(verified)}")
    if announced is not None and announced != len(data):
        assert isinstance(other, blobfmt.BlobError), "a blob of another size than announced"
    else:
        assert type(other) is type(streamed)
    if ok:
        assert verified == streamed
        assert not isinstance(head, blobfmt.BlobError) and head == verified
        assert verified[0].total_size == len(data)
    if not isinstance(decoded, blobfmt.BlobError):
        assert ok, f"decode_blob accepted what verify_file refused: {verified}"
        assert (decoded.header, decoded.meta) == verified
        assert len(decoded.payload) == decoded.header.raw_len
        if decoded.header.codec == "none":
            assert bytes(decoded.payload) == data[decoded.header.payload_offset :]


piece_sizes = st.lists(st.integers(1, 97), max_size=6)


@fuzz_settings(400)
@given(data=mutated_blobs(), sizes=piece_sizes, announced=st.none() | st.integers(0, 9000))
def test_mutated_blobs_decode_correctly_or_raise_blob_error(data: bytes, sizes: list[int],
                                                            announced: int | None) -> None:
    parse_every_way(data, sizes, announced)


@fuzz_settings(300)
@given(data=arbitrary_bytes, sizes=piece_sizes, announced=st.none() | st.integers(0, 500))
def test_arbitrary_bytes_are_refused_with_blob_error(data: bytes, sizes: list[int],
                                                     announced: int | None) -> None:
    parse_every_way(data, sizes, announced)


@fuzz_settings(60)
@given(payload=payloads, codec=st.sampled_from(["none", "zstd"]), tokens=token_lists,
       sizes=piece_sizes)
def test_valid_blobs_decode_in_any_chunking(payload: bytes, codec: str, tokens: list[int],
                                            sizes: list[int]) -> None:
    data = encode(payload, codec, tokens)
    blob = blobfmt.decode_blob(data)
    assert bytes(blob.payload) == payload and list(blob.meta.tokens) == tokens
    assert feed_in_pieces(data, sizes, len(data)) == (blob.header, blob.meta)
    parse_every_way(data, sizes, len(data))


PARSERS: dict[str, Callable[[bytes], object]] = {
    "decode_blob": blobfmt.decode_blob,
    "read_header_and_meta": lambda d: blobfmt.read_header_and_meta(io.BytesIO(d)),
    "verify_file": lambda d: blobfmt.verify_file(io.BytesIO(d)),
    "StreamVerifier": lambda d: feed_in_pieces(d, [17], None),
    "StreamVerifier(announced)": lambda d: feed_in_pieces(d, [17], len(d)),
}


def refused_cheaply(data: bytes, parsers: Sequence[str] = tuple(PARSERS)) -> list[str]:
    """Run the parsers; each must raise BlobError having allocated under 2 MiB."""
    messages = []
    for name in parsers:
        tracemalloc.start()
        try:
            with pytest.raises(blobfmt.BlobError) as info:
                PARSERS[name](data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 << 20, f"{name} allocated {peak} bytes"
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("fields", [
    {"payload_len": 2**60, "raw_len": 2**60}, {"payload_len": U64, "raw_len": U64},
    {"raw_len": 2**60}, {"meta_len": U32}, {"meta_len": blobfmt.MAX_META_BYTES},
    {"meta_len": 2**31},
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_a_header_claiming_huge_lengths_fails_fast(fields: dict[str, int]) -> None:
    data = reheader(encode(b"x" * 100, "none", [1, 2, 3]), **fields)
    # read_header_and_meta reads the head only: the payload's length is not its business.
    about_payload = "meta_len" not in fields and "payload_len" in fields
    refused_cheaply(data, [p for p in PARSERS
                           if not (about_payload and p == "read_header_and_meta")])


@pytest.mark.parametrize("raw_len", [2**34, 2**60, U64])
@pytest.mark.parametrize("content_size", [True, False])
def test_a_zstd_payload_claiming_a_huge_raw_length_fails_fast(raw_len: int,
                                                              content_size: bool) -> None:
    # Regression: without a content size in the frame, zstandard allocated raw_len up
    # front (16 GiB for 2^34; MemoryError, not BlobError, for 2^60).
    frame = zstandard.ZstdCompressor(write_content_size=content_size).compress(b"a" * 100)
    data = reheader(repayload(encode(b"", "zstd", [1]), frame, True), raw_len=raw_len)
    (message,) = refused_cheaply(data, ["decode_blob"])
    assert "header says" in message
    # Every other parser accepts it: they check the stored bytes, not what they decode to.
    assert blobfmt.verify_file(io.BytesIO(data))[0].raw_len == raw_len


def test_a_zstd_payload_longer_or_trailed_by_junk_is_refused() -> None:
    frame = zstandard.ZstdCompressor().compress(b"a" * 100)
    base = encode(b"", "zstd", [1])
    for payload, raw_len in ((frame, 99), (frame + b"junk", 100), (frame + frame, 100)):
        with pytest.raises(blobfmt.BlobError):
            blobfmt.decode_blob(reheader(repayload(base, payload, True), raw_len=raw_len))


def test_codec_none_with_a_lying_raw_length_is_refused() -> None:
    # Regression: every check at commit passed it, and then every load of it failed.
    data = reheader(encode(b"abc", "none", [1]), raw_len=999)
    for message in refused_cheaply(data):
        assert "raw_len 999" in message


@pytest.mark.parametrize("value", [2**40, 2**62, U64, 10**8, [1, 2], {"a": 1}, None, "text"])
@pytest.mark.parametrize("name", ["namespace", "tokens"])
def test_metadata_byte_fields_of_another_type_are_refused_without_allocating(
        name: str, value: object) -> None:
    # Regression: bytes(2**40) allocated a terabyte; bytes(2**62) raised OverflowError,
    # which escaped the daemon's Write as UNKNOWN and left the lease in flight.
    meta = good_meta([1, 2, 3]).to_dict()
    meta[name] = value
    data = remeta(encode(b"payload", "none", [1, 2, 3]), meta)
    for message in refused_cheaply(data):
        assert "metadata" in message


@pytest.mark.parametrize("fields", [
    {"parent": b"\x01" * 15, "base": 1}, {"parent": b"\x01" * 16, "base": 0},
    {"parent": b"\x01" * 16, "base": 3}, {"parent": b"\x01" * 16, "base": -1},
    {"parent": b"\x01" * 16, "base": 2**63}, {"parent": b"\x01" * 16, "base": "1"},
    {"parent": b"\x01" * 16, "base": True}, {"base": 2}, {"parent": 2**40, "base": 1},
    {"parent": "text", "base": 1}, {"cell_layout": 2**40}, {"cell_layout": [1]},
])
def test_piece_metadata_that_does_not_fit_its_tokens_is_refused(fields: dict[str, Any]
                                                                ) -> None:
    """A piece names a 16-byte parent and 0 < base < its tokens; anything else (or a
    base without a parent) is malformed metadata, refused before any allocation."""
    meta = good_meta([1, 2, 3]).to_dict()
    meta.update(fields)
    data = remeta(encode(b"payload", "none", [1, 2, 3]), meta)
    for message in refused_cheaply(data):
        assert "metadata" in message


# ============================================================================ daemon RPCs

IA, NF, OOR = Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.OUT_OF_RANGE


@dataclass(frozen=True)
class Rpc:
    name: str
    kind: str  # unary | server_stream | client_stream
    request: type[Message]
    allowed: frozenset[Code]  # besides OK
    examples: int


RPCS = [
    Rpc("Lookup", "unary", pb.LookupRequest, frozenset({IA}), 120),
    Rpc("Resolve", "unary", pb.Identity, frozenset({IA}), 40),
    # NOT_FOUND: a piece whose parent entry is not published.
    Rpc("Reserve", "unary", pb.ReserveRequest, frozenset({IA, NF, Code.RESOURCE_EXHAUSTED}),
        120),
    Rpc("Write", "client_stream", pb.WriteChunk, frozenset({IA, NF, OOR}), 80),
    Rpc("Commit", "unary", pb.CommitRequest, frozenset({IA, NF}), 50),
    Rpc("Abort", "unary", pb.AbortRequest, frozenset({NF}), 40),
    Rpc("Read", "server_stream", pb.ReadRequest, frozenset({IA, NF}), 70),
    Rpc("OpenRead", "unary", pb.OpenReadRequest, frozenset({IA, NF}), 70),
    Rpc("ReleaseRead", "unary", pb.ReleaseReadRequest, frozenset({NF}), 40),
    Rpc("Pin", "unary", pb.KeyRequest, frozenset({IA, NF}), 50),
    Rpc("Unpin", "unary", pb.KeyRequest, frozenset({IA, NF}), 50),
    Rpc("Delete", "unary", pb.KeyRequest, frozenset({IA, NF, Code.FAILED_PRECONDITION}), 50),
    Rpc("Stats", "unary", pb.StatsRequest, frozenset(), 10),
    # INVALID_ARGUMENT: an unknown sort, or a page token that is not one List gave.
    Rpc("List", "unary", pb.ListRequest, frozenset({IA}), 60),
    Rpc("Inspect", "unary", pb.InspectRequest, frozenset({IA, NF}), 70),
    Rpc("Verify", "server_stream", pb.VerifyRequest, frozenset({IA}), 50),
    Rpc("Prune", "unary", pb.PruneRequest, frozenset({IA}), 70),
]
# Calls go through grpc's generic multicallables with serialized bytes, so that requests
# can carry what the generated classes refuse to encode (negative varints, for one).
SERVICE_PATH = "/kvcache.v1.KVCache/"
CALL_TIMEOUT = 15.0

# Keys and ids that try to name a path. Over gRPC a key is 16 bytes that only ever become
# a file name as hex, and lease and pin ids are dictionary keys; the CLI parses keys.
TRAVERSAL = [
    "../../etc/passwd", "..", "../", "/etc/passwd", "%2e%2e", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "..%2f..%2fetc", "0" * 16 + "/" + "0" * 16, "00112233445566778899aabbccddee/f",
    "0" * 32 + "/../../etc/passwd", "blobs/../../canary.txt", "..\\..\\windows", "~", "\x00",
    "0" * 31 + "\x00", "0" * 32 + "\x00", "g" * 32, "0" * 64, "", " ", "\u2024\u2024/etc",
    "a" * 100_000, "/etc/passwd\x00\x00\x00\x00\x00", "../../../../etc/",
]
UPPERCASE_KEY = "0123456789ABCDEF0123456789ABCDEF"  # a well-formed key that does not exist

texts = st.one_of(
    st.text(max_size=30), st.sampled_from(TRAVERSAL[:-4]),
    # Long ids and reasons get echoed in error messages; 4-byte characters quadruple them.
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\U0001f600"]),
              st.sampled_from([300, 3000, 30_000])))
SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_UINT32: boundary_ints(U32),
    FieldDescriptor.TYPE_UINT64: boundary_ints(U64),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: texts,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
    FieldDescriptor.TYPE_ENUM: st.integers(-(2**31), 2**31 - 1),
}
INT_TYPES = (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
             FieldDescriptor.TYPE_ENUM)


def field_strategies(desc: Descriptor, overrides: dict[str, st.SearchStrategy[Any]],
                     depth: int = 0) -> dict[str, st.SearchStrategy[Any]]:
    """An arbitrary-value strategy per field of ``desc``; ``overrides`` replace some."""
    from google.protobuf import message_factory

    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.name in overrides:
            fields[f.name] = overrides[f.name]
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = (f.message_type.fields_by_name[n] for n in ("key", "value"))
            fields[f.name] = st.dictionaries(SCALARS[key.type], SCALARS[value.type],
                                             max_size=4)
        else:
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                inner = message_strategy(f.message_type, {}, depth + 1) if depth < 2 else \
                    st.just(message_factory.GetMessageClass(f.message_type)())
            else:
                inner = SCALARS[f.type]
            fields[f.name] = st.lists(inner, max_size=6) if f.is_repeated else inner
    return fields


def message_strategy(desc: Descriptor, overrides: dict[str, st.SearchStrategy[Any]],
                     depth: int = 0,
                     valid: dict[str, st.SearchStrategy[Any]] | None = None
                     ) -> st.SearchStrategy[Message]:
    """Messages of ``desc`` with any subset of fields set to arbitrary values (the empty
    message included). With ``valid``, half of them start from a valid request instead and
    get one or two fields replaced, so that checks past the first one are reached too."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(desc)
    fields = field_strategies(desc, overrides, depth)
    anything = st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))
    if not valid:
        return anything

    @st.composite
    def nearly_valid(draw: st.DrawFn) -> Message:
        kw = {name: draw(strategy) for name, strategy in valid.items()}
        for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
            kw[name] = draw(fields[name])
        return cls(**kw)

    return st.one_of(anything, nearly_valid())


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def wire(draw: st.DrawFn, messages: st.SearchStrategy[Message]) -> bytes:
    """A message as bytes, sometimes followed by negative varints for its integer fields:
    valid protobuf (the last value of a field wins) that no generated class would write.
    A uint32 field decodes -1 as 4294967295, a uint64 one as 2**64-1."""
    msg = draw(messages)
    data = msg.SerializeToString()
    numbers = [f.number for f in msg.DESCRIPTOR.fields if f.type in INT_TYPES
               and not f.is_repeated]
    if numbers:
        for number in draw(st.lists(st.sampled_from(numbers), max_size=2)):
            value = draw(st.sampled_from([-1, -2, -(2**31), -(2**63)]))
            data += varint(number << 3) + varint(value & U64)
    return data


def raw_call(channel: grpc.Channel, rpc: Rpc, payload: bytes | list[bytes],
             timeout: float = CALL_TIMEOUT) -> tuple[Code, str, list[bytes]]:
    """Call ``rpc`` with serialized request(s); the status, details and raw responses."""
    path = SERVICE_PATH + rpc.name
    try:
        if rpc.kind == "unary":
            responses = [channel.unary_unary(path)(payload, timeout=timeout)]
        elif rpc.kind == "server_stream":
            responses = list(channel.unary_stream(path)(payload, timeout=timeout))
        else:
            responses = [channel.stream_unary(path)(iter(payload), timeout=timeout)]
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        # The client's own deadline: the daemon did not answer in 15 s. Its own refusals
        # (a wait cut short) say what they waited for.
        assert not (code == Code.DEADLINE_EXCEEDED and details == "Deadline Exceeded"), \
            f"{rpc.name} hung"
        return code, details, []
    return Code.OK, "", responses


def check_status(rpc: Rpc, code: Code, details: str, label: str = "") -> None:
    SEEN[label or rpc.name][code.name] += 1
    assert code == Code.OK or code in rpc.allowed, f"{rpc.name} answered {code.name}: {details}"
    if code != Code.OK:
        assert details, f"{rpc.name} answered {code.name} without saying why"
        # Clipped by the daemon, so that the status itself reaches the caller.
        assert len(details) <= 500, f"{len(details)}-character details"


def open_channel(address: str) -> grpc.Channel:
    # No client-side send limit, so what is tested is the daemon's own 16 MiB limit.
    return grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20)])


_token_seeds = itertools.count(1)


def fresh_tokens(n: int = 20) -> list[int]:
    """Tokens nobody has used in this module (every lease needs a key of its own)."""
    rng = random.Random(next(_token_seeds) * 7919)
    return [rng.randrange(1, 60_000) for _ in range(n)]


def blob_for(identity: Identity, tokens: list[int], payload: bytes) -> bytes:
    meta = blobfmt.BlobMeta(namespace=identity.namespace,
                            model_fingerprint=identity.model_fingerprint,
                            kv_layout=dict(identity.kv_layout), tokens=list(tokens),
                            reason="cold", model_name=identity.model_name,
                            tenant_id="", created=1234.5)
    return b"".join(bytes(p) for p in blobfmt.encode_blob(meta, payload))


BASELINE = [(IDENT, [7] * 20), (IDENT, list(range(1, 41))), (ALICE, [7] * 20)]


@dataclass
class Live:
    """Real keys, leases and pins for the generated requests to hit, besides junk."""

    client: CacheClient
    keys: list[bytes]
    tokens: list[list[int]]
    leases: list[str]
    pins: list[str]
    blob_size: int

    @classmethod
    def make(cls, d: DaemonProcess) -> Live:
        c = d.client()
        found = []
        for identity, tokens in BASELINE:
            saved = c.save(identity, tokens, bytes(range(256)) * 2, "cold")
            c.pin(saved.key)  # a generated Prune, Delete or byte budget must not take it
            found.append(saved.key)
        # One lease holding a complete valid blob (its Commit succeeds), one empty.
        leases = []
        tokens = fresh_tokens()
        data = blob_for(IDENT, tokens, b"p" * 300)
        for payload in (data, b""):
            res = c.stub.Reserve(pb.ReserveRequest(identity=IDENT.message(), tokens=tokens,
                                                   size=len(data), reason="cold"), timeout=10)
            assert res.status == pb.ReserveResponse.GRANTED
            if payload:
                c.stub.Write(iter([pb.WriteChunk(lease_id=res.lease_id, data=payload)]),
                             timeout=10)
            leases.append(res.lease_id)
            tokens = fresh_tokens()
        pins = [c.stub.OpenRead(pb.OpenReadRequest(key=found[0]), timeout=10).pin_id
                for _ in range(2)]
        return cls(c, found, [t for _, t in BASELINE], leases, pins, len(data))

    def release(self) -> None:
        for lease in self.leases:
            with contextlib.suppress(grpc.RpcError):
                self.client.stub.Abort(pb.AbortRequest(lease_id=lease), timeout=10)
        for pin in self.pins:
            with contextlib.suppress(grpc.RpcError):
                self.client.stub.ReleaseRead(pb.ReleaseReadRequest(pin_id=pin), timeout=10)
        self.client.close()

    def overrides(self) -> dict[str, st.SearchStrategy[Any]]:
        key = st.one_of(st.binary(max_size=40), st.binary(min_size=16, max_size=16),
                        st.sampled_from(self.keys),
                        st.sampled_from([t.encode() for t in TRAVERSAL]))
        tokens = st.one_of(st.lists(st.integers(0, U32), max_size=40),
                           st.sampled_from(self.tokens))
        return {
            "key": key, "keys": st.lists(key, max_size=5),
            "lease_id": st.one_of(texts, st.sampled_from(self.leases)),
            "pin_id": st.one_of(texts, st.sampled_from(self.pins)),
            "identity": st.one_of(st.sampled_from([IDENT.message(), ALICE.message()]),
                                  message_strategy(pb.Identity.DESCRIPTOR, {})),
            "tokens": tokens,
            "packed_tokens": st.one_of(st.binary(max_size=64),
                                       tokens.map(keys.tokens_to_bytes)),
            "reason": st.one_of(texts, st.sampled_from(blobfmt.SAVE_REASONS)),
            "tenant": st.one_of(texts, st.just("alice")),
            "model": st.one_of(texts, st.sampled_from(["fuzz.gguf", "fp-fuzz", "fp"])),
            "size": boundary_ints(U64, near=[self.blob_size, 64 << 20]),
        }

    def valid(self, rpc: Rpc) -> dict[str, st.SearchStrategy[Any]]:
        """What a well-formed request of ``rpc`` looks like, field by field."""
        identity = st.sampled_from([IDENT.message(), ALICE.message()])
        key = st.sampled_from(self.keys)
        return {
            "Lookup": {"identity": identity, "tokens": st.sampled_from(self.tokens),
                       "common_prefix": st.booleans()},
            "Reserve": {"identity": identity,
                        "tokens": st.lists(st.integers(1, 60_000), min_size=1, max_size=40),
                        "size": st.sampled_from([self.blob_size, 1 << 20]),
                        "reason": st.sampled_from(blobfmt.SAVE_REASONS)},
            "Write": {"lease_id": st.sampled_from(self.leases), "offset": st.just(0),
                      "data": st.binary(max_size=80)},
            "Commit": {"lease_id": st.sampled_from(self.leases)},
            "Abort": {"lease_id": st.sampled_from(self.leases)},
            "Read": {"key": key}, "OpenRead": {"key": key}, "Pin": {"key": key},
            "Unpin": {"key": key}, "Delete": {"key": key},
            "ReleaseRead": {"pin_id": st.sampled_from(self.pins)},
            "Inspect": {"key": key, "tenant": st.sampled_from(["", "alice"])},
            "Verify": {"keys": st.lists(key, max_size=3)},
            "Prune": {"dry_run": st.just(True), "tenant": st.just("alice")},
            "List": {"tenant": st.sampled_from(["", "alice"])},
        }.get(rpc.name, {})


def request_strategy(rpc: Rpc, live: Live) -> st.SearchStrategy[bytes | list[bytes]]:
    one = wire(message_strategy(rpc.request.DESCRIPTOR, live.overrides(),
                                valid=live.valid(rpc)))
    return st.lists(one, max_size=5) if rpc.kind == "client_stream" else one


def clean_up_after(channel: grpc.Channel, rpc: Rpc, responses: list[bytes]) -> None:
    """Give back what a successful call took, so examples do not pile up leases or pins."""
    if rpc.name == "Reserve" and responses:
        res = pb.ReserveResponse.FromString(responses[0])
        if res.status == pb.ReserveResponse.GRANTED:
            channel.unary_unary(SERVICE_PATH + "Abort")(
                pb.AbortRequest(lease_id=res.lease_id).SerializeToString(), timeout=10)
    elif rpc.name == "OpenRead" and responses:
        pin = pb.OpenReadResponse.FromString(responses[0]).pin_id
        channel.unary_unary(SERVICE_PATH + "ReleaseRead")(
            pb.ReleaseReadRequest(pin_id=pin).SerializeToString(), timeout=10)


def assert_healthy(d: DaemonProcess) -> None:
    """Still running, a fresh save round-trips, every blob verifies, nothing left over."""
    assert d.proc is not None and d.proc.poll() is None, "the daemon died:\n" + d.log()[-3000:]
    with d.client() as c:
        tokens = fresh_tokens()
        payload = random.Random(tokens[0]).randbytes(700)
        saved = c.save(IDENT, tokens, payload, "manual")
        assert saved.status == "saved", saved
        assert bytes(c.load(saved.key).payload) == payload
        results = list(c.verify())
        assert results and all(r.ok for r in results), [r for r in results if not r.ok]
        wait_for(lambda: c.stats().in_flight == 0, "every lease to be gone")
    assert os.listdir(d.data_dir / "tmp") == []
    assert_no_tracebacks(d.log())


def assert_no_tracebacks(log: str) -> None:
    """No log record with a traceback, except grpcio's own for undecodable requests."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", log)
    bad = [r for r in records if ("Traceback" in r or "Exception calling" in r)
           and "Exception deserializing" not in r.split("\n", 1)[0]]
    assert not bad, "logged:\n" + "\n".join(bad)[-4000:]


@pytest.fixture(scope="module")
def fuzz_daemon(module_daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    # A small disk budget, so generated sizes reach RESOURCE_EXHAUSTED as well as GRANTED.
    return module_daemon_factory("--block-size", str(BLOCK), "--disk-bytes", "64M")


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
def test_every_rpc_answers_generated_requests_with_a_precise_status(
        fuzz_daemon: DaemonProcess, rpc: Rpc) -> None:
    """Generated requests, from junk in every field to valid ones with a field or two
    replaced (real keys, leases and pins among the junk): OK or one of the statuses this
    RPC documents, with a reason, within the deadline; then the daemon is still sound."""
    live = Live.make(fuzz_daemon)
    channel = open_channel(fuzz_daemon.address)
    requests = request_strategy(rpc, live)

    @fuzz_settings(rpc.examples)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        code, details, responses = raw_call(channel, rpc, data.draw(requests))
        check_status(rpc, code, details)
        clean_up_after(channel, rpc, responses)

    try:
        run()
    finally:
        channel.close()
        live.release()
    assert_healthy(fuzz_daemon)


def test_empty_requests_get_a_precise_status(fuzz_daemon: DaemonProcess) -> None:
    with open_channel(fuzz_daemon.address) as channel:
        for rpc in RPCS:
            payloads: list[bytes | list[bytes]] = [[], [b""], [b"", b""]] \
                if rpc.kind == "client_stream" else [b""]
            for payload in payloads:
                code, details, responses = raw_call(channel, rpc, payload)
                check_status(rpc, code, details, f"{rpc.name} (empty)")
                clean_up_after(channel, rpc, responses)
    assert_healthy(fuzz_daemon)


def test_undecodable_bytes_are_refused_by_grpc_itself(fuzz_daemon: DaemonProcess) -> None:
    """Bytes that are not a protobuf message (or a string field that is not UTF-8) never
    reach the service: grpcio answers INTERNAL "Exception deserializing request!", the
    status gRPC's own table assigns to "error parsing request proto". The daemon keeps
    serving."""
    with open_channel(fuzz_daemon.address) as channel:
        # A varint that never ends, a field longer than the message, a lone tag; and, for
        # the RPCs whose field 1 is a string (lease, pin, model), bytes that are not UTF-8.
        for payload, only in ((b"\xff\xff\xff\xff", ""), (b"\x0a\xff\xff\xff\x0f", ""),
                              (b"\x08", ""), (b"\x0a\x02\xc3\x28", "Commit Abort ReleaseRead List")):
            for rpc in [r for r in RPCS if not only or r.name in only.split()]:
                body: bytes | list[bytes] = [payload] if rpc.kind == "client_stream" \
                    else payload
                code, details, _ = raw_call(channel, rpc, body)
                SEEN[f"{rpc.name} (undecodable)"][code.name] += 1
                assert code == Code.INTERNAL and "deserializing" in details, (code, details)
    assert_healthy(fuzz_daemon)


# ============================================================================ sizes


def token_request(rpc: str, n: int, packed: bool, token: int = 1) -> bytes:
    """A Lookup or Reserve of ``n`` copies of ``token``, serialized without building a
    list of n Python ints where the wire form can be written directly."""
    if packed:
        tokens = {"packed_tokens": token.to_bytes(4, "little") * n}
    else:
        tokens = {"tokens": [token] * n}
    if rpc == "Lookup":
        return pb.LookupRequest(identity=IDENT.message(), **tokens).SerializeToString()
    return pb.ReserveRequest(identity=IDENT.message(), size=1000, reason="cold",
                             **tokens).SerializeToString()


MAX_TOKENS = 1 << 20  # the daemon's default limit


@pytest.mark.parametrize("packed", [False, True], ids=["tokens", "packed"])
@pytest.mark.parametrize("rpc", ["Lookup", "Reserve"])
def test_token_lists_up_to_and_beyond_the_limits(fuzz_daemon: DaemonProcess, rpc: str,
                                                 packed: bool) -> None:
    spec = next(r for r in RPCS if r.name == rpc)
    cases = [
        (MAX_TOKENS + 1, 1, IA, "exceed the limit"),  # one over max_tokens
        (2 * MAX_TOKENS, 1, IA, "exceed the limit"),  # 8 MiB packed, under 16 MiB
        # Over the 16 MiB message limit: gRPC refuses it before the daemon parses it
        # (5 bytes per large id in the repeated form, 4 in the packed one).
        ((17 << 20) // (4 if packed else 5) + 1, U32, Code.RESOURCE_EXHAUSTED, ""),
    ]
    with open_channel(fuzz_daemon.address) as channel:
        for n, token, expected, fragment in cases:
            code, details, _ = raw_call(channel, spec, token_request(rpc, n, packed, token),
                                        timeout=60)
            SEEN[f"{rpc} ({n} tokens)"][code.name] += 1
            assert code == expected and fragment in details, (n, code, details)
        # Exactly the limit is served.
        code, details, responses = raw_call(channel, spec, token_request(rpc, MAX_TOKENS,
                                                                         packed), timeout=60)
        assert code == Code.OK, details
        clean_up_after(channel, spec, responses)
    assert_healthy(fuzz_daemon)


@pytest.mark.parametrize("rpc, field, value", [
    ("Reserve", "size", 0), ("Reserve", "size", blobfmt.HEADER_SIZE),
    ("Reserve", "size", U64), ("Reserve", "size", -1), ("Reserve", "size", (16 << 30) + 1),
    ("Lookup", "max_tokens", -1), ("Read", "chunk_bytes", -1), ("Read", "wait_ms", -1),
    ("Write", "offset", -1), ("Prune", "max_disk_bytes", -1), ("List", "limit", -1),
    ("List", "min_tokens", -1), ("List", "tier", -(2**31)),
])
def test_negative_and_huge_integers_get_a_precise_status(
        fuzz_daemon: DaemonProcess, rpc: str, field: str, value: int) -> None:
    """A negative number sent for an unsigned field (as protobuf encodes a negative int64)
    arrives as a huge one; neither reaches the store unchecked."""
    spec = next(r for r in RPCS if r.name == rpc)
    live = Live.make(fuzz_daemon)
    live.release()  # only its published (pinned) entries are wanted here
    with open_channel(fuzz_daemon.address) as channel:
        tokens = fresh_tokens()
        base = {
            "Reserve": pb.ReserveRequest(identity=IDENT.message(), tokens=tokens, size=1000,
                                         reason="cold"),
            "Lookup": pb.LookupRequest(identity=IDENT.message(), tokens=tokens),
            "Read": pb.ReadRequest(key=live.keys[0]),
            "Write": pb.WriteChunk(lease_id="no-such-lease"),
            "Prune": pb.PruneRequest(dry_run=True),
            "List": pb.ListRequest(),
        }[rpc]
        number = base.DESCRIPTOR.fields_by_name[field].number
        payload = base.SerializeToString() + varint(number << 3) + varint(value & U64)
        code, details, responses = raw_call(channel, spec, [payload] if rpc == "Write"
                                            else payload)
        check_status(spec, code, details, f"{rpc} ({field}={value})")
        clean_up_after(channel, spec, responses)
        if rpc == "Reserve" and (value & U64) > 16 << 30:  # over the largest blob allowed
            assert code == IA and "exceeds the limit" in details, details
    assert_healthy(fuzz_daemon)


# ============================================================================ lying streams

STREAM = next(r for r in RPCS if r.name == "Write")

chunk_ops = st.lists(st.tuples(
    st.sampled_from(["next", "next", "next", "skip", "overlap", "anywhere", "overflow"]),
    st.integers(0, 700),
    st.sampled_from(["same", "same", "same", "omit", "other", "unknown"])), max_size=6)


def simulate(chunks: list[tuple[str, int, bytes]],
             sizes: dict[str, int]) -> tuple[Code, dict[str, int], set[str]]:
    """What the daemon must answer to a write stream: the status, the bytes each lease
    holds afterwards, and the leases the stream aborted."""
    written = dict.fromkeys(sizes, 0)
    aborted: set[str] = set()
    lease = ""
    for lease_id, offset, data in chunks:
        if not lease:
            if not lease_id:
                return IA, written, aborted  # the first chunk must name its lease
            lease = lease_id
        elif lease_id and lease_id != lease:
            return IA, written, aborted  # one lease per stream
        if lease not in sizes:
            return NF, written, aborted
        if offset != written[lease]:
            return OOR, written, aborted  # the lease survives a wrong offset
        if written[lease] + len(data) > sizes[lease]:
            aborted.add(lease)
            return OOR, written, aborted
        written[lease] += len(data)
    if not lease:
        return IA, written, aborted
    if written[lease] < sizes[lease]:
        aborted.add(lease)  # a stream that ends short is a lost writer
        return IA, written, aborted
    return Code.OK, written, aborted


def test_write_streams_that_lie_get_the_status_they_earn(fuzz_daemon: DaemonProcess) -> None:
    """Offsets that skip or overlap, more bytes than reserved, fewer and then the end,
    chunks of another lease or of none: each stream gets exactly the status a model of
    the protocol predicts, and only an honest complete stream publishes anything."""
    c = fuzz_daemon.client()
    channel = open_channel(fuzz_daemon.address)
    payload = random.Random(5).randbytes(1500)

    @fuzz_settings(60)
    @given(ops=chunk_ops, finish=st.booleans())
    def run(ops: list[tuple[str, int, str]], finish: bool) -> None:
        # Two leases of the same size (same token count, same payload length): A is the
        # one the stream is about, B the "other lease".
        toks_a, toks_b = fresh_tokens(), fresh_tokens()
        blob_a = blob_for(IDENT, toks_a, payload)
        leases = {}
        for name, toks in (("A", toks_a), ("B", toks_b)):
            res = c.stub.Reserve(pb.ReserveRequest(identity=IDENT.message(), tokens=toks,
                                                   size=len(blob_a), reason="cold"), timeout=10)
            assert res.status == pb.ReserveResponse.GRANTED
            leases[name] = res.lease_id
        names = {"same": leases["A"], "omit": "", "other": leases["B"],
                 "unknown": "no-such-lease"}
        chunks: list[tuple[str, int, bytes]] = []
        pos = 0  # where an honest writer would be
        for kind, n, lease_kind in ops:
            offset = {"next": pos, "skip": pos + 1 + n, "overlap": max(0, pos - 1 - n),
                      "anywhere": n * 7919, "overflow": pos}[kind]
            data = blob_a[offset : offset + n]
            if kind == "overflow":
                data = blob_a[offset:] + b"!" * (1 + n % 5)
            chunks.append((names[lease_kind], offset, data))
            if offset == pos:
                pos += len(data)
        if finish:
            chunks.append((leases["A"], pos, blob_a[pos:]))
        sizes = {lease: len(blob_a) for lease in leases.values()}
        expected, written, aborted = simulate(chunks, sizes)
        code, details, _ = raw_call(channel, STREAM, [
            pb.WriteChunk(lease_id=lid, offset=off, data=d).SerializeToString()
            for lid, off, d in chunks])
        check_status(STREAM, code, details, "Write (lying streams)")
        assert code == expected, f"{code.name} ({details}), a model of the protocol says " \
                                 f"{expected.name}"
        # Commit each lease: only a complete write of A's own blob publishes.
        for name, lease in leases.items():
            complete = written[lease] == len(blob_a) and lease not in aborted
            code, details, _ = raw_call(channel, next(r for r in RPCS if r.name == "Commit"),
                                        pb.CommitRequest(lease_id=lease).SerializeToString())
            want = (Code.OK if name == "A" else IA) if complete else \
                (NF if lease in aborted else IA)
            assert code == want, (name, code, details)
        assert (c.lookup(IDENT, toks_a) is not None) == (written[leases["A"]] == len(blob_a)
                                                          and leases["A"] not in aborted)
        assert c.lookup(IDENT, toks_b) is None
        assert c.stats().in_flight == 0 and os.listdir(fuzz_daemon.data_dir / "tmp") == []

    try:
        run()
    finally:
        channel.close()
        c.close()
    assert_healthy(fuzz_daemon)


def test_a_write_stream_that_stalls_loses_its_lease_at_its_deadline(
        fuzz_daemon: DaemonProcess) -> None:
    """A writer that sends half a blob and then nothing: its call ends at its deadline,
    and the daemon drops the reservation then, not when the 30 s lease runs out."""
    with fuzz_daemon.client() as c:
        tokens = fresh_tokens()
        data = blob_for(IDENT, tokens, b"s" * 5000)
        res = c.stub.Reserve(pb.ReserveRequest(identity=IDENT.message(), tokens=tokens,
                                               size=len(data), reason="cold"), timeout=10)
        release = threading.Event()

        def stalling() -> Iterator[pb.WriteChunk]:
            yield pb.WriteChunk(lease_id=res.lease_id, data=data[:2000])
            release.wait(30)  # a writer stuck between chunks

        try:
            with pytest.raises(grpc.RpcError) as info:
                c.stub.Write(stalling(), timeout=1.5)
        finally:
            release.set()
        assert info.value.code() == Code.DEADLINE_EXCEEDED
        # Well before the lease's own 30 s, and counted as a lost writer, not an expiry.
        wait_for(lambda: c.stats().in_flight == 0, "the stalled writer's lease to go",
                 timeout=15)
        assert not Path(res.local_path).exists()
        assert c.stats().counters["saves_disconnected"] >= 1
        # The key is free again.
        assert c.save(IDENT, tokens, b"s" * 5000, "cold").status == "saved"
    assert_healthy(fuzz_daemon)


# ============================================================================ waits and echoes


def test_readers_waiting_past_their_deadline_do_not_hold_the_daemon(
        fuzz_daemon: DaemonProcess) -> None:
    """Forty readers ask to wait 49 days (wait_ms 2**32-1) for a key whose writer is
    silent, each with a 1 s deadline. Regression: the daemon kept waiting after the
    callers gave up, its 32 workers all blocked until the lease expired (30 s), and every
    other RPC queued behind them."""
    with fuzz_daemon.client() as c:
        tokens = fresh_tokens()
        res = c.stub.Reserve(pb.ReserveRequest(identity=IDENT.message(), tokens=tokens,
                                               size=1000, reason="cold"), timeout=10)
        assert res.status == pb.ReserveResponse.GRANTED

        def wait_read(i: int) -> Code:
            try:
                if i % 2:
                    c.stub.OpenRead(pb.OpenReadRequest(key=res.key, wait_ms=U32), timeout=1.0)
                else:
                    list(c.stub.Read(pb.ReadRequest(key=res.key, wait_ms=U32), timeout=1.0))
            except grpc.RpcError as exc:
                return exc.code()
            return Code.OK

        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            codes = Counter(pool.map(wait_read, range(40)))
        assert codes == {Code.DEADLINE_EXCEEDED: 40}, codes
        SEEN["OpenRead+Read (waiting)"].update(code.name for code in codes.elements())
        # Right after their deadlines the daemon serves others again; before the fix this
        # call queued until the lease expired, some 29 s later.
        c.stub.Stats(pb.StatsRequest(), timeout=10.0)
        c.stub.Abort(pb.AbortRequest(lease_id=res.lease_id), timeout=10)
    assert_healthy(fuzz_daemon)


@pytest.mark.parametrize("length", [10_000, 100_000])
def test_errors_about_long_ids_still_carry_their_status(fuzz_daemon: DaemonProcess,
                                                        length: int) -> None:
    """Regression: an error message quoting a 10 kB lease id or reason overflowed gRPC's
    8 KiB trailer limit, and the caller got RESOURCE_EXHAUSTED "Stream removed" instead."""
    long = "\U0001f600" * (length // 4) + "x" * (length % 4)
    by_name = {r.name: r for r in RPCS}
    cases = [
        ("Commit", pb.CommitRequest(lease_id=long), NF),
        ("Abort", pb.AbortRequest(lease_id=long), NF),
        ("ReleaseRead", pb.ReleaseReadRequest(pin_id=long), NF),
        ("Reserve", pb.ReserveRequest(identity=IDENT.message(), tokens=[1, 2], size=1000,
                                      reason=long), IA),
    ]
    with open_channel(fuzz_daemon.address) as channel:
        for name, request, expected in cases:
            code, details, _ = raw_call(channel, by_name[name], request.SerializeToString())
            check_status(by_name[name], code, details, f"{name} (long id)")
            assert code == expected, (name, code, details)
            assert details.endswith("...")
        code, details, _ = raw_call(channel, STREAM, [
            pb.WriteChunk(lease_id=long, data=b"x").SerializeToString()])
        assert code == NF, details
    assert_healthy(fuzz_daemon)


def entries_of(c: CacheClient) -> set[bytes]:
    return {e.key for e in c.list_entries()}


@pytest.mark.parametrize("field", ["older_than_seconds", "unused_for_seconds"])
@pytest.mark.parametrize("value", [math.nan, -1.0, -math.inf, math.inf])
def test_prune_refuses_ages_that_are_not_a_duration(fuzz_daemon: DaemonProcess, field: str,
                                                    value: float) -> None:
    """Regression: NaN or a negative age matched every entry, so a bogus filter removed
    everything the "refusing to remove everything" check exists to keep."""
    with fuzz_daemon.client() as c:
        c.save(IDENT, fresh_tokens(), b"keep me", "cold")
        before = entries_of(c)
        err = pytest.raises(grpc.RpcError, c.stub.Prune, pb.PruneRequest(**{field: value}),
                            timeout=10).value
        SEEN[f"Prune ({field}={value})"][err.code().name] += 1
        assert err.code() == IA and field in err.details()
        assert entries_of(c) == before


@pytest.mark.parametrize("args", [
    ["--older-than", "nan"], ["--older-than", "-1h"], ["--unused-for", "-5"],
    ["--unused-for", "inf"], ["--max-bytes", "nan"], ["--max-bytes", "inf"],
    ["--max-ram-bytes", "-1G"],
])
def test_cli_prune_refuses_sizes_and_durations_that_are_not_numbers(
        fuzz_daemon: DaemonProcess, args: list[str]) -> None:
    # Regression: `--older-than nan` removed every entry; `--max-bytes nan` crashed with
    # a traceback (int(nan)).
    with fuzz_daemon.client() as c:
        c.save(IDENT, fresh_tokens(), b"keep me", "cold")
        before = entries_of(c)
        result = CliRunner().invoke(kvcache_cli, ["prune", "-a", fuzz_daemon.address, *args])
        assert result.exit_code == 2, result.output
        assert "Invalid value" in result.output and result.exception is not None
        assert entries_of(c) == before


# ============================================================================ path traversal


def tree(root: Path, skip: Sequence[Path]) -> dict[str, tuple[int, int, int]]:
    """Every file and directory under ``root`` with its size, mtime and mode."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if any(path == s or s in path.parents for s in skip):
                continue
            st_ = path.lstat()
            out[str(path.relative_to(root))] = (st_.st_size, st_.st_mtime_ns, st_.st_mode)
    return out


def test_keys_that_try_path_traversal_are_refused_everywhere(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Traversal-shaped keys, lease ids and pin ids in every RPC that takes one, and keys
    in the CLI's key commands: each is a clear refusal (INVALID_ARGUMENT or NOT_FOUND; the
    CLI exits 2 naming the bad key, or 1 with "not found" for a well-formed key that does
    not exist), and no file outside the data directory, or inside it, is touched."""
    d = daemon_factory("--block-size", str(BLOCK))
    canary = tmp_path / "canary.txt"  # right next to the data directory
    canary.write_text("still here\n")
    cwd = tmp_path / "cli-cwd"  # the CLI runs from here: a relative path would land in it
    cwd.mkdir()
    with d.client() as c:
        saved = [c.save(IDENT, fresh_tokens(), b"x" * 300, "cold").key for _ in range(2)]
        wait_for(lambda: c.stats().counters.get("ram_placements", 0) >= 2, "RAM copies")
    skip = [d.data_dir / "index", d.log_path]  # LMDB's own files; the daemon's log
    before = tree(tmp_path, skip)
    passwd = os.stat("/etc/passwd")

    by_name = {r.name: r for r in RPCS}
    with open_channel(d.address) as channel:
        for text in TRAVERSAL + [UPPERCASE_KEY]:
            key = text.encode()
            calls: list[tuple[str, bytes | list[bytes]]] = [
                ("Inspect", pb.InspectRequest(key=key)),
                ("Inspect", pb.InspectRequest(key=key, tenant=text)),
                ("Delete", pb.KeyRequest(key=key)), ("Pin", pb.KeyRequest(key=key)),
                ("Unpin", pb.KeyRequest(key=key)), ("OpenRead", pb.OpenReadRequest(key=key)),
                ("Read", pb.ReadRequest(key=key)),
                ("ReleaseRead", pb.ReleaseReadRequest(pin_id=text)),
                ("ReleaseRead", pb.ReleaseReadRequest(pin_id=text, corrupt=True)),
                ("Abort", pb.AbortRequest(lease_id=text)),
                ("Commit", pb.CommitRequest(lease_id=text)),
                ("Commit", pb.CommitRequest(lease_id=text, local_write=True)),
                ("Write", [pb.WriteChunk(lease_id=text, data=b"x")]),
                ("Verify", pb.VerifyRequest(keys=[key])),
            ]
            for name, request in calls:
                payload = [m.SerializeToString() for m in request] \
                    if isinstance(request, list) else request.SerializeToString()
                code, details, responses = raw_call(channel, by_name[name], payload)
                SEEN[f"{name} (traversal)"][code.name] += 1
                if name == "Verify" and code == Code.OK:  # a well-sized key: "no such entry"
                    (result,) = (pb.VerifyResult.FromString(r) for r in responses)
                    assert not result.ok and result.error == "no such entry"
                    continue
                assert code in (IA, NF), (name, text[:40], code, details)
                assert details
            # Filters take arbitrary text, as text: it matches nothing here.
            if text:
                for name, request, answer in (
                        ("List", pb.ListRequest(model=text, tenant=text), pb.ListResponse),
                        ("Prune", pb.PruneRequest(model=text, dry_run=True), pb.PruneResponse)):
                    code, details, responses = raw_call(channel, by_name[name],
                                                        request.SerializeToString())
                    assert code == Code.OK, details
                    found = answer.FromString(responses[0])
                    assert not (found.entries if name == "List" else found.removed)

    runner = CliRunner()
    monkeypatch.chdir(cwd)
    for command in ("inspect", "evict", "pin", "unpin"):
        for text in TRAVERSAL:
            result = runner.invoke(kvcache_cli, [command, text, "-a", d.address])
            SEEN[f"kvcache {command} (traversal)"][f"exit {result.exit_code}"] += 1
            assert result.exit_code == 2, (command, text[:40], result.output[-300:])
            assert "32 hex digits" in result.output
        # A well-formed key that names nothing: the daemon's refusal, exit 1.
        result = runner.invoke(kvcache_cli, [command, UPPERCASE_KEY, "-a", d.address])
        SEEN[f"kvcache {command} (traversal)"][f"exit {result.exit_code}"] += 1
        assert result.exit_code == 1 and "not found: no entry" in result.output, result.output

    after = tree(tmp_path, skip)
    assert after == before, {k: (before.get(k), after.get(k))
                             for k in set(before) ^ set(after) | {k for k in before
                                                                  if before[k] != after.get(k)}}
    assert canary.read_text() == "still here\n"
    now = os.stat("/etc/passwd")
    assert (now.st_mtime_ns, now.st_size) == (passwd.st_mtime_ns, passwd.st_size)
    with d.client() as c:  # the entries are all still there
        assert {e.key for e in c.list_entries()} == set(saved)
    assert_healthy(d)


# ============================================================================ model runtime

RT_SERVICE_PATH = "/model_runtime.v1.ModelRuntime/Complete"
RT_ALLOWED = frozenset({IA, Code.FAILED_PRECONDITION})  # bad input; sticky_busy


@pytest.fixture(scope="module")
def runtime_address(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
                    module_daemon: DaemonProcess) -> Iterator[tuple[str, DaemonProcess]]:
    """A daemon and ``model-runtime serve`` on the tiny model, as in test_runtime_service."""
    from tests.support.runtime_proc import RuntimeProcess

    tmp = tmp_path_factory.mktemp("fuzz_runtime")
    runtime = RuntimeProcess(tiny_model, module_daemon.address, tmp / "runtime.log")
    try:
        runtime.start()
        yield runtime.address, module_daemon
    finally:
        log = runtime.proc.log_path
        runtime.close()
        assert_no_tracebacks(log.read_text(errors="replace"))


def complete_requests() -> st.SearchStrategy[bytes]:
    from model_runtime.v1 import runtime_pb2 as rpb

    roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), texts)
    chat = st.builds(lambda ms: rpb.ChatMessages(messages=ms), st.lists(
        st.builds(rpb.ChatMessage, role=roles, content=texts), max_size=4))
    ids = st.one_of(st.integers(0, 300), st.integers(0, U32))
    tokens = st.one_of(st.builds(lambda t: rpb.TokenList(ids=t), st.lists(ids, max_size=40)),
                       st.just(rpb.TokenList(ids=[5] * 2000)))  # longer than the context
    overrides = {
        "prompt": texts, "system": texts, "chat": chat, "tokens": tokens,
        # Mostly short: a completion of the tiny model costs milliseconds per token.
        "max_tokens": st.sampled_from([0, 1, 2, 3, 8, U32]),
        "parent_key": st.one_of(texts, st.binary(max_size=20).map(bytes.hex),
                                st.binary(min_size=16, max_size=16).map(bytes.hex)),
        "stop": st.lists(texts, max_size=3),
    }
    valid = {"prompt": st.text(max_size=40), "max_tokens": st.sampled_from([1, 2, 4]),
             "temperature": st.sampled_from([0.0, 0.8]), "top_p": st.sampled_from([0.0, 0.9]),
             "seed": st.integers(0, U64)}
    return wire(message_strategy(rpb.CompleteRequest.DESCRIPTOR, overrides, valid=valid))


def test_runtime_complete_answers_generated_requests_with_a_precise_status(
        runtime_address: tuple[str, DaemonProcess]) -> None:
    """Negative (as huge) max_tokens, empty prompts, chats with any roles, token ids out of
    the vocabulary, NaN and infinite sampling settings, any parent key: a completion or a
    precise refusal, and the runtime keeps serving."""
    from model_runtime.v1 import runtime_pb2 as rpb
    from model_runtime.v1 import runtime_pb2_grpc as rpb_grpc

    address, daemon = runtime_address
    channel = open_channel(address)
    complete = channel.unary_stream(RT_SERVICE_PATH)
    requests = complete_requests()

    @fuzz_settings(60)
    @given(request=requests)
    def run(request: bytes) -> None:
        try:
            events = [rpb.CompleteEvent.FromString(e) for e in complete(request, timeout=60)]
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            SEEN["runtime Complete"][code.name] += 1
            assert code in RT_ALLOWED, f"Complete answered {code.name}: {details}"
            # (grammar_dead_end: a logit bias that bans every token the chain allows)
            assert details.split(":")[0] in ("invalid_argument", "prompt_too_long",
                                              "sticky_busy", "grammar_dead_end"), details
            return
        SEEN["runtime Complete"]["OK"] += 1
        assert events and events[-1].WhichOneof("event") == "done"

    try:
        run()
        # Still serving: a plain completion, and no request ever failed inside.
        stub = rpb_grpc.ModelRuntimeStub(channel)
        done = list(stub.Complete(rpb.CompleteRequest(prompt="still here", max_tokens=2),
                                  timeout=60))[-1].done
        assert done.finish_reason in ("length", "stop")
        counters = stub.Stats(rpb.RuntimeStatsRequest(), timeout=10).counters
        assert counters.get("internal_errors", 0) == 0, dict(counters)
    finally:
        channel.close()
    assert_healthy(daemon)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf])
def test_runtime_refuses_a_temperature_that_is_not_a_number(
        runtime_address: tuple[str, DaemonProcess], temperature: float) -> None:
    """Regression: NaN passed the `< 0` check and failed the model thread's step, which
    answered UNKNOWN to the request and to every other request decoding with it."""
    from model_runtime.v1 import runtime_pb2 as rpb
    from model_runtime.v1 import runtime_pb2_grpc as rpb_grpc

    with open_channel(runtime_address[0]) as channel:
        stub = rpb_grpc.ModelRuntimeStub(channel)
        bystander = stub.Complete(rpb.CompleteRequest(prompt="a bystander", max_tokens=40),
                                  timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Complete(rpb.CompleteRequest(prompt="hi", temperature=temperature,
                                                   max_tokens=4), timeout=60))
        assert info.value.code() == IA and "temperature" in info.value.details()
        assert list(bystander)[-1].WhichOneof("event") == "done"


@pytest.mark.parametrize("field, value", [("namespace", 2**62), ("tokens", 2**40),
                                          ("raw_len", 2**60)])
def test_a_crafted_blob_is_refused_while_it_streams_in(fuzz_daemon: DaemonProcess,
                                                       field: str, value: int) -> None:
    """Blobs with checksums made right around a bomb in the metadata or a lying raw_len.
    Regression: a namespace of 2**62 raised OverflowError inside Write, answered UNKNOWN
    and left the lease in flight."""
    with fuzz_daemon.client() as c:
        tokens = fresh_tokens()
        data = blob_for(IDENT, tokens, b"b" * 400)
        if field == "raw_len":
            data = reheader(data, raw_len=value)
        else:
            meta = blobfmt.decode_blob(data).meta.to_dict()
            meta[field] = value
            data = remeta(data, meta)
        res = c.stub.Reserve(pb.ReserveRequest(identity=IDENT.message(), tokens=tokens,
                                               size=len(data), reason="cold"), timeout=10)
        err = pytest.raises(grpc.RpcError, c.stub.Write,
                            iter([pb.WriteChunk(lease_id=res.lease_id, data=data)]),
                            timeout=10).value
        SEEN[f"Write (crafted blob: {field}={value})"][err.code().name] += 1
        assert err.code() == IA and "malformed blob" in err.details(), err.details()
        assert c.stats().in_flight == 0 and not Path(res.local_path).exists()
    assert_healthy(fuzz_daemon)
