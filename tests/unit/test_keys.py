"""Cache keys: pure functions that must give the same bytes in every process."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import xxhash

from kvcache import keys

FP = "fp-test"
LAYOUT = {"type_k": "f16", "type_v": "f16", "n_layer": "2"}


def test_tokens_pack_as_u32_little_endian() -> None:
    assert keys.tokens_to_bytes([1, 0x01020304, 2**32 - 1]) == (
        b"\x01\x00\x00\x00" + b"\x04\x03\x02\x01" + b"\xff\xff\xff\xff")
    assert keys.bytes_to_tokens(keys.tokens_to_bytes([5, 6, 7])) == [5, 6, 7]
    assert keys.tokens_to_bytes([]) == b""


def test_token_ids_outside_u32_are_refused() -> None:
    with pytest.raises(OverflowError):
        keys.tokens_to_bytes([2**32])
    with pytest.raises(OverflowError):
        keys.tokens_to_bytes([-1])
    with pytest.raises(ValueError, match="multiple of 4"):
        keys.bytes_to_tokens(b"\x00\x01\x02")


def test_namespace_is_16_bytes_and_deterministic() -> None:
    ns = keys.namespace(FP, LAYOUT)
    assert len(ns) == keys.KEY_BYTES
    assert ns == keys.namespace(FP, dict(LAYOUT))
    # Mapping order is irrelevant: the layout is canonicalised.
    assert ns == keys.namespace(FP, dict(reversed(list(LAYOUT.items()))))


def test_namespace_separates_model_layout_and_tenant() -> None:
    base = keys.namespace(FP, LAYOUT)
    variants = {
        "other fingerprint": keys.namespace("fp-other", LAYOUT),
        "other type_k": keys.namespace(FP, {**LAYOUT, "type_k": "q8_0"}),
        "extra layout field": keys.namespace(FP, {**LAYOUT, "flash_attn": "1"}),
        "tenant a": keys.namespace(FP, LAYOUT, "tenant-a"),
        "tenant b": keys.namespace(FP, LAYOUT, "tenant-b"),
    }
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants), variants


def test_namespace_requires_a_fingerprint() -> None:
    with pytest.raises(ValueError, match="model_fingerprint"):
        keys.namespace("", LAYOUT)


def test_namespace_and_keys_are_identical_in_another_process() -> None:
    """No salted Python hash() anywhere: a fresh interpreter computes the same keys."""
    code = (
        "from kvcache import keys;"
        f"ns = keys.namespace({FP!r}, {LAYOUT!r}, 'tenant-a');"
        "print(ns.hex(), keys.entry_key(ns, list(range(45)), 16).key.hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.split()
    ns = keys.namespace(FP, LAYOUT, "tenant-a")
    assert out == [ns.hex(), keys.entry_key(ns, list(range(45)), 16).key.hex()]


def test_block_hashes_follow_the_documented_chain() -> None:
    ns = keys.namespace(FP, LAYOUT)
    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks of 16, tail of 2
    hashes = keys.block_hashes(ns, tokens, 16)
    assert len(hashes) == 4
    assert hashes[0] == ns
    prev = ns
    for k in range(3):
        block = struct.pack("<16I", *tokens[16 * k : 16 * k + 16])
        prev = xxhash.xxh3_128_digest(prev + block)
        assert hashes[k + 1] == prev, f"block hash {k + 1} differs from the spec"
    # Bytes and token lists give the same answer.
    assert keys.block_hashes(ns, keys.tokens_to_bytes(tokens), 16) == hashes


def test_block_hashes_of_a_prefix_are_a_prefix() -> None:
    ns = keys.namespace(FP, LAYOUT)
    tokens = list(range(80))
    full = keys.block_hashes(ns, tokens, 16)
    for n in range(0, 80):
        assert keys.block_hashes(ns, tokens[:n], 16) == full[: n // 16 + 1]


def test_block_hashes_depend_on_token_order_and_block_size() -> None:
    ns = keys.namespace(FP, LAYOUT)
    a = keys.block_hashes(ns, list(range(32)), 16)
    b = keys.block_hashes(ns, [1, 0, *range(2, 32)], 16)
    assert a[1] != b[1]
    assert keys.block_hashes(ns, list(range(32)), 8)[2] != a[1]
    with pytest.raises(ValueError):
        keys.block_hashes(ns, [1, 2], 0)


def test_entry_key_of_an_aligned_entry_is_its_block_hash() -> None:
    ns = keys.namespace(FP, LAYOUT)
    tokens = list(range(32))
    e = keys.entry_key(ns, tokens, 16)
    hashes = keys.block_hashes(ns, tokens, 16)
    assert e.key == e.anchor == hashes[2]
    assert e.tail == b""
    assert e.n_tokens == 32


def test_entry_key_of_an_unaligned_entry_hangs_under_its_last_full_block() -> None:
    ns = keys.namespace(FP, LAYOUT)
    tokens = list(range(37))
    e = keys.entry_key(ns, tokens, 16)
    hashes = keys.block_hashes(ns, tokens, 16)
    assert e.anchor == hashes[2]
    assert e.tail == keys.tokens_to_bytes(tokens[32:])
    assert e.key == xxhash.xxh3_128_digest(hashes[2] + e.tail)
    assert e.n_tokens == 37
    # An entry shorter than a block hangs under the namespace.
    short = keys.entry_key(ns, [7, 8, 9], 16)
    assert short.anchor == ns and short.n_tokens == 3


def test_entry_keys_of_different_lengths_never_collide() -> None:
    ns = keys.namespace(FP, LAYOUT)
    tokens = list(range(200))
    seen = {keys.entry_key(ns, tokens[:n], 16).key for n in range(1, 201)}
    assert len(seen) == 200
    block_hashes = set(keys.block_hashes(ns, tokens, 16)[1:])
    unaligned = {keys.entry_key(ns, tokens[:n], 16).key for n in range(1, 201) if n % 16}
    assert not unaligned & block_hashes


def test_tenant_id_is_stable_and_hides_the_salt() -> None:
    assert keys.tenant_id("") == ""
    tid = keys.tenant_id("secret-tenant")
    assert tid == keys.tenant_id("secret-tenant")
    assert tid != keys.tenant_id("other-tenant")
    assert "secret" not in tid and len(tid) == 16


@pytest.mark.parametrize("text", ["", "abc", "zz" * 16, "00" * 15, "00" * 17])
def test_parse_key_refuses_anything_but_32_hex_digits(text: str) -> None:
    with pytest.raises(ValueError, match="32 hex digits"):
        keys.parse_key(text)


def test_parse_key_round_trips_hex() -> None:
    key = bytes(range(16))
    assert keys.parse_key(key.hex()) == key
    assert keys.parse_key(f"  {key.hex().upper()}\n") == key


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1000])
def test_common_prefix_tokens_counts_leading_tokens_that_agree(n: int) -> None:
    base = list(range(1, n + 1))
    for cut in sorted({0, 1, n // 2, max(n - 1, 0), n}):
        if cut > n:
            continue
        other = base[:cut] + [0] * (n - cut + 3)  # differs at `cut`, and is longer
        assert keys.common_prefix_tokens(keys.tokens_to_bytes(base),
                                         keys.tokens_to_bytes(other)) == cut
        # A difference in a token's high byte only (the comparison is per token).
        if cut < n:
            high = base[:cut] + [base[cut] + (1 << 24)] + base[cut + 1:]
            assert keys.common_prefix_tokens(keys.tokens_to_bytes(base),
                                             keys.tokens_to_bytes(high)) == cut
    assert keys.common_prefix_tokens(keys.tokens_to_bytes(base),
                                     keys.tokens_to_bytes(base[: n // 2])) == n // 2
