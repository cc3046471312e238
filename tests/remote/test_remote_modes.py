"""The shared tier's protection modes, with real redis-server and daemons: signed by
default (a daemon refuses --remote without a key unless told --remote-unsigned, which it
logs and shows in stats), and encrypted with the fleet key on request (--remote-encrypt:
nothing in Redis reveals a prompt, and a value altered there is refused)."""

from __future__ import annotations

import json
from pathlib import Path

from kvcache import keys
from kvcache.remote.layout import Names, open_value
from tests.remote.test_remote_daemon import (
    IDENT,
    cells,
    cli,
    delta,
    local_keys,
    lookup,
    save,
    toks,
)
from tests.support.redis_proc import RedisServer
from tests.support.remote_tier import B, Host, counters, key_file, wait_uploads


def test_remote_needs_a_signing_key_unless_unsigned_is_asked(tmp_path: Path) -> None:
    never = tmp_path / "never"
    key = key_file(tmp_path / "key", "a-fleet-signing-key-of-this-test\n")
    for args, message in (
            ([], "--remote needs --remote-signing-key-file"),
            (["--remote-unsigned", "--remote-signing-key-file", str(key)], "contradict"),
            (["--remote-unsigned", "--remote-encrypt"], "--remote-encrypt needs"),
            (["--remote-encrypt"], "--remote needs --remote-signing-key-file")):
        done = cli("serve", "--dir", str(never), "--remote", "redis://127.0.0.1:1/0", *args)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not never.exists()


def test_an_unsigned_shared_tier_is_logged_and_shown(host: Host) -> None:
    unsigned = host("u", "--remote-unsigned")
    signed = host("s")
    assert "SHARED TIER UNSIGNED" in unsigned.log()
    assert "UNSIGNED" not in signed.log()
    for d, expected in ((unsigned, True), (signed, False)):
        done = cli("stats", "--json", "--address", d.address)
        remote = json.loads(done.stdout)["remote"]
        assert (remote["unsigned_by_choice"], remote["signed"]) == (expected, not expected)
        assert remote["encrypted"] is False
        text = cli("stats", "--address", d.address).stdout
        assert ("UNSIGNED (--remote-unsigned)" in text) == expected, text


def test_encrypted_values_reveal_no_prompt(host: Host, server: RedisServer,
                                           tmp_path: Path) -> None:
    fleet = key_file(tmp_path / "encrypting-fleet-key", "the-encrypting-fleet-key\n")
    names = Names("kvc", b"the-encrypting-fleet-key")
    a = host("a", "--remote-signing-key-file", str(fleet), "--remote-encrypt")
    b = host("b", "--remote-signing-key-file", str(fleet), "--remote-encrypt")
    t = toks(71, 150)
    key = save(a, t)
    wait_uploads(a, 1)
    assert json.loads(cli("stats", "--json", "--address", a.address).stdout)[
        "remote"]["encrypted"] is True

    # Nothing stored in Redis shows the tokens or the state: not the record, not the
    # parts, not the block pointers.
    payload, packed = cells(t, 0), keys.tokens_to_bytes(t)
    with server.client() as r:
        values = {name: r.get(name) for name in r.scan_iter(match="*", count=1000)}
    assert names.record(key) in values and names.part(key, 0) in values
    for name, value in values.items():
        assert value[:5] == b"KVR1\x02", name  # the encrypted envelope, every one
        assert packed[:64] not in value and payload[:64] not in value, name
    # Nor do the names: the entry has no tenant, so whoever knows the model and guesses
    # the prompt computes its key and block hashes; none of them is in any name.
    guessed = [key.hex(), *(h.hex() for h in keys.block_hashes(IDENT.namespace, packed, B))]
    assert len(values) >= 2 + len(t) // B
    assert not [n for n in values if any(g.encode() in n for g in guessed)]
    assert all(n.startswith(b"kvc:2:") for n in values)  # the keyed layout, every one
    # Without the fleet key a value cannot even be opened.
    refused = 0
    for name, value in values.items():
        try:
            open_value(name, value, None)
        except ValueError:
            refused += 1
    assert refused == len(values)

    # Host B, with the key, restores it from the remote as it is.
    hit = lookup(b, t)
    assert hit is not None and (hit.key, hit.tier) == (key, "remote")
    with b.client() as c:
        assert bytes(c.load(key).payload) == payload

    # A byte changed in Redis: refused (authentication), never restored.
    u = toks(72, 150)
    altered = save(a, u)
    wait_uploads(a, 2)
    with server.client() as r:
        value = bytearray(r.get(names.part(altered, 0)))
        value[len(value) // 2] ^= 0x01
        r.set(names.part(altered, 0), bytes(value))
    before = counters(b)
    assert lookup(b, u) is None
    assert delta(before, counters(b))["remote_signature_failures"] >= 1
    assert altered not in local_keys(b)
    assert lookup(b, u, identity=IDENT) is None  # and not stored since


def test_an_encrypting_host_refuses_values_stored_in_clear(host: Host,
                                                           tmp_path: Path) -> None:
    """A value signed but not encrypted (a host of the fleet without --remote-encrypt)
    is refused by a host that requires encryption: its readers were promised that what
    they restore was never readable in Redis."""
    fleet = key_file(tmp_path / "mixed-fleet-key", "the-mixed-fleet-key-of-a-test\n")
    plain = host("p", "--remote-signing-key-file", str(fleet))
    strict = host("e", "--remote-signing-key-file", str(fleet), "--remote-encrypt")
    t = toks(73, 150)
    save(plain, t)
    wait_uploads(plain, 1)
    before = counters(strict)
    assert lookup(strict, t) is None
    assert delta(before, counters(strict))["remote_signature_failures"] >= 1
    assert local_keys(strict) == set()
