"""Scoped tokens and secret tenant salts, against real daemons over TCP.

A daemon's token file gives each token a scope: an admin token (a bare token, the
original one-token file, is one) or a runtime token bound to tenants. A runtime token
for alice cannot look up, read, pin, delete or list bob's entries, and cannot tell
whether a key exists: every call by key answers bob's entry exactly as a key nobody
saved. A tenant's namespace is salted with a secret the daemon holds (kvcache.tenancy),
so knowing a tenant's name gives neither its keys nor its label.
"""

from __future__ import annotations

import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvcache import keys
from kvcache.auth import (
    ADMIN,
    AuthConfigError,
    ClientAuth,
    Scope,
    parse_token_lines,
    read_token_table,
)
from kvcache.client import CacheClient, CacheError, Identity
from kvcache.tenancy import SECRET_FILE_NAME, TenantSalts
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import tcp_address, write_token
from tests.support.entries import DaemonFactory, toks

LAYOUT = {"type_k": "f16"}
ALICE = Identity("fp-scoped", LAYOUT, tenant="alice", model_name="tiny.gguf")
BOB = Identity("fp-scoped", LAYOUT, tenant="bob", model_name="tiny.gguf")
CAROL = Identity("fp-scoped", LAYOUT, tenant="carol", model_name="tiny.gguf")
NOBODY = Identity("fp-scoped", LAYOUT, model_name="tiny.gguf")
TOKENS = {name: secrets.token_hex(16) for name in ("admin", "alice", "bob")}


def token_file(path: Path) -> Path:
    path.write_text("# kvcache tokens: one a line, then its scope\n"
                    f"{TOKENS['admin']} admin\n\n"
                    f"{TOKENS['alice']} tenants=alice\n"
                    f"{TOKENS['bob']} tenants=bob,carol\n")
    path.chmod(0o600)
    return path


def client_of(address: str, tmp_path: Path, who: str) -> CacheClient:
    return CacheClient(address, auth=ClientAuth.load(
        token_file=write_token(tmp_path / f"{who}.token", TOKENS[who])))


def answer(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)  # type: ignore[call-overload]  # a stream answers as it is read
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    except CacheError as exc:
        return exc.code, str(exc)  # type: ignore[return-value]
    return grpc.StatusCode.OK, ""


# -- the token file --------------------------------------------------------------------------


def test_token_file_format(tmp_path: Path) -> None:
    p = tmp_path / "tokens"
    t1, t2, t3 = (secrets.token_hex(16) for _ in range(3))
    # The original format: one bare token, an admin token.
    assert parse_token_lines(f"{t1}\n", p) == {t1: ADMIN}
    table = parse_token_lines(f"# comment\n\n{t1} admin\n{t2} tenants=alice\n"
                              f"  {t3}   tenants=bob,carol  \n", p)
    assert table == {t1: ADMIN, t2: Scope(frozenset({"alice"})),
                     t3: Scope(frozenset({"bob", "carol"}))}
    assert table[t3].may_use("carol") and not table[t3].may_use("alice")
    assert not table[t3].may_use("") and ADMIN.may_use("") and ADMIN.may_use("anyone")
    for text, message in ((f"{t1} tenant=alice", "line 1: the scope"),
                          (f"{t1} tenants=alice,", "empty tenant name"),
                          (f"{t1} admin\n{t1} tenants=bob", "line 2: a token given twice"),
                          (f"{t1} admin extra", "the scope"),
                          ("short admin", "at least 16"),
                          ("# nothing but a comment\n", "at least 16")):
        with pytest.raises(AuthConfigError, match=message):
            parse_token_lines(text, p)
    loose = token_file(tmp_path / "loose")
    loose.chmod(0o640)
    with pytest.raises(AuthConfigError, match=f"chmod 600 {loose}"):
        read_token_table(loose)


# -- a runtime token -------------------------------------------------------------------------


def test_a_runtime_token_reaches_only_its_tenants(daemon_factory: DaemonFactory,
                                                 tmp_path: Path) -> None:
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file",
                       str(token_file(tmp_path / "tokens")), "--block-size", "16",
                       "--tcp-admin")
    address = tcp_address(d)
    prompt = toks(61, 40)
    with client_of(address, tmp_path, "alice") as alice, \
            client_of(address, tmp_path, "bob") as bob, \
            client_of(address, tmp_path, "admin") as admin:
        key = alice.save(ALICE, prompt, b"a" * 600, "cold").key
        assert alice.lookup(ALICE, prompt).key == key

        # Naming another tenant (or none) is refused as such: it is about the token,
        # not about any entry.
        for call in (lambda: alice.lookup(BOB, prompt), lambda: alice.lookup(NOBODY, prompt),
                     lambda: alice.save(BOB, prompt, b"b" * 600, "cold"),
                     lambda: alice.resolve(BOB), lambda: bob.lookup(ALICE, prompt)):
            code, details = answer(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert bob.lookup(BOB, prompt) is None  # bob's own namespace: another key

        # By key: alice's entry is, to bob, a key that does not exist; same code, same
        # words, and no wait even for a key being written.
        absent = secrets.token_bytes(16)
        stub = bob.stub

        def by_key(k: bytes) -> dict[str, tuple[grpc.StatusCode, str]]:
            calls = {
                "Read": lambda: stub.Read(pb.ReadRequest(key=k, wait_ms=30_000), timeout=5),
                "OpenRead": lambda: stub.OpenRead(pb.OpenReadRequest(key=k, wait_ms=30_000),
                                                  timeout=5),
                "Delete": lambda: stub.Delete(pb.KeyRequest(key=k), timeout=5),
                "Pin": lambda: stub.Pin(pb.KeyRequest(key=k), timeout=5),
                "Unpin": lambda: stub.Unpin(pb.KeyRequest(key=k), timeout=5),
                "Inspect": lambda: stub.Inspect(pb.InspectRequest(key=k), timeout=5),
                "Verify": lambda: stub.Verify(pb.VerifyRequest(keys=[k]), timeout=5),
            }
            return {name: (code, details.replace(k.hex(), "KEY"))
                    for name, call in calls.items() for code, details in [answer(call)]}

        # A save of alice's still being written.
        in_flight = toks(62, 40)
        lease = alice.stub.Reserve(pb.ReserveRequest(
            identity=ALICE.message(), tokens=in_flight, size=4096, reason="cold"), timeout=5)
        writing = keys.entry_key(alice.namespace_of(ALICE), in_flight, 16).key
        assert lease.key == writing
        told = by_key(absent)
        assert told == by_key(key) == by_key(writing)
        assert {name: code for name, (code, _) in told.items()} == {
            "Read": grpc.StatusCode.NOT_FOUND, "OpenRead": grpc.StatusCode.NOT_FOUND,
            "Delete": grpc.StatusCode.NOT_FOUND,
            # Operator calls: never a runtime token's, even with --tcp-admin.
            "Pin": grpc.StatusCode.PERMISSION_DENIED,
            "Unpin": grpc.StatusCode.PERMISSION_DENIED,
            "Inspect": grpc.StatusCode.PERMISSION_DENIED,
            "Verify": grpc.StatusCode.PERMISSION_DENIED}
        # A piece of bob's naming alice's entry as its parent: a parent that is gone.
        def as_parent(k: bytes) -> tuple[grpc.StatusCode, str]:
            code, details = answer(lambda: stub.Reserve(pb.ReserveRequest(
                identity=BOB.message(), tokens=prompt + [7], size=4096, reason="cold",
                parent=k, base=20), timeout=5))
            return code, details.replace(k.hex(), "KEY")

        assert as_parent(key) == as_parent(absent)
        assert as_parent(key)[0] == grpc.StatusCode.NOT_FOUND
        # Stats: the block size, and nothing that moves with alice's traffic.
        seen = bob.stats()
        assert seen.block_size == 16 and not seen.counters and not seen.tiers
        assert not seen.latencies and admin.stats().counters["saves_committed"] == 1
        for call in (bob.list_entries, lambda: bob.list_entries(tenant="alice"),
                     lambda: bob.prune(tenant="alice", older_than_seconds=0.0)):
            assert answer(call)[0] == grpc.StatusCode.PERMISSION_DENIED
        alice.stub.Abort(pb.AbortRequest(lease_id=lease.lease_id), timeout=5)

        # Alice's own entry, by key, is hers.
        assert bytes(alice.load(key).payload) == b"a" * 600
        # The admin token sees and may do everything (operator calls: --tcp-admin).
        assert admin.lookup(ALICE, prompt).key == key
        assert key in {e.key for e in admin.list_entries(tenant="alice")}
        admin.pin(key)
        admin.unpin(key)
    with d.client() as local:  # the owner-only unix socket: the operator, no token
        assert key in {e.key for e in local.list_entries()}, "bob's calls removed it"
        assert local.delete(key) == 0


def probes(stub: object, identity: Identity, tokens: list[int]
           ) -> dict[str, Callable[[bytes], object]]:
    """Every call that takes a key, each with arguments valid but for the key, and with
    an argument wrong besides it (the answer must not depend on whose the key is)."""
    def reserve(**fields: object) -> Callable[[bytes], object]:
        base = {"identity": identity.message(), "tokens": tokens + [7], "size": 4096,
                "reason": "cold", "base": 20, **fields}
        return lambda k: stub.Reserve(pb.ReserveRequest(parent=k, **base),  # type: ignore[attr-defined, arg-type]
                                      timeout=5)

    s = stub  # the stub's methods are made at run time: no types to check
    return {
        "Read": lambda k: list(s.Read(pb.ReadRequest(key=k, wait_ms=30_000), timeout=5)),  # type: ignore[attr-defined]
        "OpenRead": lambda k: s.OpenRead(pb.OpenReadRequest(key=k, wait_ms=30_000),  # type: ignore[attr-defined]
                                         timeout=5),
        "Delete": lambda k: s.Delete(pb.KeyRequest(key=k), timeout=5),  # type: ignore[attr-defined]
        "Pin": lambda k: s.Pin(pb.KeyRequest(key=k, ttl_seconds=5), timeout=5),  # type: ignore[attr-defined]
        "Unpin": lambda k: s.Unpin(pb.KeyRequest(key=k), timeout=5),  # type: ignore[attr-defined]
        "Inspect": lambda k: s.Inspect(pb.InspectRequest(key=k), timeout=5),  # type: ignore[attr-defined]
        "Verify": lambda k: list(s.Verify(pb.VerifyRequest(keys=[k]), timeout=5)),  # type: ignore[attr-defined]
        "Reserve(parent)": reserve(),
        "Reserve(parent, bad reason)": reserve(reason="no-such-reason"),
        "Reserve(parent, base 0)": reserve(base=0),
        "Reserve(parent, base past the tokens)": reserve(base=99),
        "Reserve(parent, size too small)": reserve(size=3),
        "Reserve(parent, no fingerprint)": reserve(identity=pb.Identity(tenant=identity.tenant)),
        "EntryTokens": lambda k: s.EntryTokens(  # type: ignore[attr-defined]
            pb.EntryTokensRequest(key=k, tenant=identity.tenant), timeout=5),
        "PinTenantEntry": lambda k: s.PinTenantEntry(  # type: ignore[attr-defined]
            pb.PinTenantEntryRequest(key=k, tenant=identity.tenant, ttl_seconds=30), timeout=5),
        "PinTenantEntry(ttl 0)": lambda k: s.PinTenantEntry(  # type: ignore[attr-defined]
            pb.PinTenantEntryRequest(key=k, tenant=identity.tenant), timeout=5),
        "PinTenantEntry(ttl past the longest)": lambda k: s.PinTenantEntry(  # type: ignore[attr-defined]
            pb.PinTenantEntryRequest(key=k, tenant=identity.tenant, ttl_seconds=1e9),
            timeout=5),
    }


def test_every_call_by_key_answers_a_foreign_key_as_an_absent_one(
        daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """Whatever else is wrong with a call, another tenant's key gets the answer of a key
    nobody saved: arguments are checked first (a Reserve naming bob's entry as its parent
    with a bad reason was NOT_FOUND, with a key nobody saved INVALID_ARGUMENT), and the
    store hides the entry on the path of a missing key, counters included. (Their timing
    is tools/bench_tenant_probes.py's.)"""
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file",
                       str(token_file(tmp_path / "tokens")), "--block-size", "16",
                       "--tcp-admin")
    address = tcp_address(d)
    prompt = toks(64, 40)
    with client_of(address, tmp_path, "alice") as alice, \
            client_of(address, tmp_path, "bob") as bob, d.client() as operator:
        published = bob.save(BOB, prompt, b"b" * 600, "cold").key
        in_flight = toks(65, 40)
        lease = bob.stub.Reserve(pb.ReserveRequest(
            identity=BOB.message(), tokens=in_flight, size=4096, reason="cold"), timeout=5)
        foreign = {"published": published, "being written": lease.key}
        for name, call in probes(alice.stub, ALICE, prompt).items():
            answers = {}
            for kind, key in {**foreign, "absent": secrets.token_bytes(16)}.items():
                before = dict(operator.stats().counters)
                code, details = answer(lambda: call(key))  # noqa: B023 - called at once
                after = dict(operator.stats().counters)
                moved = {c: after[c] - before.get(c, 0) for c in after
                         if after[c] != before.get(c, 0)}
                answers[kind] = (code, details.replace(key.hex(), "KEY"), moved)
            assert answers["published"] == answers["being written"] == answers["absent"], name
            # A key of the wrong length is refused as such, whoever asks.
            assert answer(lambda: call(b"short"))[0] in (  # noqa: B023
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED), name
        bob.stub.Abort(pb.AbortRequest(lease_id=lease.lease_id), timeout=5)
        assert answer(lambda: bob.stub.Reserve(pb.ReserveRequest(
            identity=BOB.message(), tokens=prompt + [7], size=4096, reason="no-such-reason",
            parent=published, base=20), timeout=5))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert bytes(bob.load(published).payload) == b"b" * 600  # nothing alice did took it


def test_a_runtime_token_reads_and_pins_its_tenants_entries_within_bounds(
        daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """The data path's EntryTokens and PinTenantEntry (what a runtime needs to continue a
    state and keep a cache_control breakpoint, where Inspect and Pin are the operator's):
    on entries of the tenants the token is bound to, the tenant named; pins last at most
    --max-tenant-pin-seconds, and what a tenant's pins hold (an entry and what it is built
    on, each once) at most --max-pinned-bytes-per-tenant, or its disk quota."""
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file",
                       str(token_file(tmp_path / "tokens")), "--block-size", "16",
                       "--max-tenant-pin-seconds", "60", "--max-pinned-bytes-per-tenant", "3000",
                       "--tenant-disk-quota", "carol=2000")
    address = tcp_address(d)
    with client_of(address, tmp_path, "alice") as alice, \
            client_of(address, tmp_path, "bob") as bob, d.client() as operator:
        prompt = toks(66, 40)
        root = alice.save(ALICE, prompt[:20], b"r" * 900, "cold").key
        piece = alice.save(ALICE, prompt, b"p" * 600, "cold", parent=root, base=20).key
        sizes = {e.key: e.size for e in operator.list_entries()}
        assert alice.entry_tokens(piece, tenant="alice") == prompt
        assert alice.entry_tokens(root, tenant="alice") == prompt[:20]
        for call in (lambda: bob.entry_tokens(piece, tenant="alice"),
                     lambda: bob.pin_tenant_entry(piece, 30, tenant="alice")):
            assert answer(call)[0] == grpc.StatusCode.PERMISSION_DENIED
        # Named for another tenant than its own, an entry is one nobody saved.
        assert answer(lambda: alice.entry_tokens(piece, tenant=""))[0] == \
            grpc.StatusCode.PERMISSION_DENIED
        assert answer(lambda: operator.entry_tokens(piece, tenant="bob"))[0] == \
            grpc.StatusCode.NOT_FOUND

        # The piece pinned: it and its root are held (pins protect what they build on).
        t0 = time.time()
        pinned = alice.pin_tenant_entry(piece, 30, tenant="alice")
        assert t0 + 30 <= pinned.pin_expires <= time.time() + 30
        assert (pinned.pinned_bytes, pinned.pinned_bytes_limit) == (
            sizes[root] + sizes[piece], 3000)
        shown = {e.key: e for e in operator.list_entries()}
        assert shown[piece].pinned and shown[piece].pin_expires == pinned.pin_expires
        assert not shown[root].pinned
        # Pinned again: extended, counted once.
        again = alice.pin_tenant_entry(piece, 40, tenant="alice")
        assert again.pinned_bytes == pinned.pinned_bytes and again.pin_expires > pinned.pin_expires
        assert alice.pin_tenant_entry(root, 5, tenant="alice").pinned_bytes == \
            pinned.pinned_bytes
        # Past the longest pin: refused as such, the pin as it was.
        code, words = answer(lambda: alice.pin_tenant_entry(piece, 61, tenant="alice"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 60" in words
        # More than the tenant's pins may hold: refused, nothing pinned.
        other = alice.save(ALICE, toks(67, 40), b"o" * 1500, "cold").key
        code, words = answer(lambda: alice.pin_tenant_entry(other, 30, tenant="alice"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3000" in words, words
        assert not {e.key: e for e in operator.list_entries()}[other].pinned
        # Bob's pins are his own account: his entry pins within his bound.
        bobs = bob.save(BOB, toks(68, 40), b"b" * 1500, "cold").key
        assert bob.pin_tenant_entry(bobs, 30, tenant="bob").pinned_bytes == sizes_of(
            operator, bobs)
        # Carol's disk quota (2000) is below the bound: it bounds her pins.
        carols = bob.save(CAROL, toks(69, 40), b"c" * 1200, "cold").key
        assert bob.pin_tenant_entry(carols, 30, tenant="carol").pinned_bytes_limit == 2000
        # An operator's pin without end stays so, and holds nothing of alice's account.
        operator.pin(other)
        kept = alice.pin_tenant_entry(other, 30, tenant="alice")
        assert kept.pin_expires == 0 and kept.pinned_bytes == pinned.pinned_bytes
        counted = dict(operator.stats().counters)
        assert counted["tenant_pins"] == 5 and counted["tenant_pins_refused"] == 1


def sizes_of(client: CacheClient, key: bytes) -> int:
    return next(e.size for e in client.list_entries() if e.key == key)


def test_tenant_salts_come_from_the_daemons_secret(daemon_factory: DaemonFactory,
                                                   tmp_path: Path) -> None:
    """The name gives neither the namespace nor the label; two daemons salt alike only
    when they share the secret; a daemon keeps its secret across restarts."""
    shared = tmp_path / "tenant-secret"
    shared.write_text(secrets.token_hex(32) + "\n")
    shared.chmod(0o600)
    a = daemon_factory(name="a")
    b = daemon_factory(name="b")
    c = daemon_factory("--tenant-secret-file", str(shared), name="c")
    e = daemon_factory("--tenant-secret-file", str(shared), name="e")
    resolved = {}
    for name, daemon in (("a", a), ("b", b), ("c", c), ("e", e)):
        with daemon.client() as client:
            resolved[name] = client.resolve(ALICE)
            # Entries without a tenant are shared by every daemon, as before.
            assert client.resolve(NOBODY) == (keys.namespace("fp-scoped", LAYOUT), "")
    by_name = (keys.namespace("fp-scoped", LAYOUT, "alice"), keys.tenant_id("alice"))
    assert all(r[0] != by_name[0] and r[1] != by_name[1] for r in resolved.values())
    assert resolved["a"] != resolved["b"]
    assert resolved["c"] == resolved["e"] == (
        TenantSalts(shared.read_bytes().rstrip()).namespace("fp-scoped", LAYOUT, "alice"),
        TenantSalts(shared.read_bytes().rstrip()).tenant_id("alice"))

    # The daemon's own secret: owner-only, and the same after a restart (its tenants'
    # entries are found again).
    secret_file = a.data_dir / SECRET_FILE_NAME
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    with a.client() as client:
        key = client.save(ALICE, toks(63, 30), b"s" * 300, "cold").key
    a.stop()
    a.start()
    with a.client() as client:
        assert client.resolve(ALICE) == resolved["a"]
        assert client.lookup(ALICE, toks(63, 30)).key == key
