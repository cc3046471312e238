"""Tenant isolation, beyond tests/daemon/test_daemon.py::test_tenants_are_isolated (exact lookups,
the List filter, a NOT_FOUND Inspect, separate keys for the same tokens).

A tenant's salt goes into the namespace every key is hashed from, so bob's requests name
other keys than alice's for the same tokens. These tests check that no tenant-scoped
answer tells bob anything about alice's entries: not their keys, not their existence (an
answer about alice's entry must be indistinguishable from one about a key that does not
exist), and that nobody can file an entry under another tenant's label.

What is not tenant-scoped, by design:

* Read, OpenRead, Pin, Unpin, Delete and Verify take a key and no tenant. A key is an
  unguessable 128-bit name; the tests below show that bob cannot learn alice's keys from
  any tenant-scoped call. On TCP, a runtime token bound to bob's tenant gets alice's
  entries answered as missing keys by these calls too (tests/daemon/test_scoped_tokens.py).
* List, Inspect and Prune without a tenant, Stats and Verify are the operator's view of
  every entry. What protects it is the daemon's unix socket, created owner-only (0600,
  tests/daemon/test_daemon.py::test_socket_and_directories_are_owner_only): whoever can connect
  is the operator.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from harness.payloads import blob_bytes

from kvcache import keys
from kvcache.client import CacheClient, Identity
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import BLOCK, toks

LAYOUT = {"type_k": "f16"}
ALICE = Identity("fp-tenants", LAYOUT, tenant="alice", model_name="tiny.gguf")
BOB = Identity("fp-tenants", LAYOUT, tenant="bob", model_name="tiny.gguf")
NOBODY = Identity("fp-tenants", LAYOUT, model_name="tiny.gguf")  # no tenant at all
TENANTS = {"alice": ALICE, "bob": BOB, "": NOBODY}
DAEMON_ARGS = ("--block-size", str(BLOCK))  # module_daemon's


def status(fn: object, *args: object, **kwargs: object) -> tuple[grpc.StatusCode, str]:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    """A 70-token prompt: four full blocks and a tail."""
    return toks(1, 70)


@pytest.fixture(scope="module")
def alices(module_daemon: DaemonProcess, prompt: list[int]) -> dict[int, bytes]:
    """Alice's saved prefixes of the prompt (aligned and not), by length."""
    with module_daemon.client() as c:
        return {n: c.save(ALICE, prompt[:n], bytes([n]) * 500, "cold").key
                for n in (16, 40, 70)}


def test_lookups_never_cross_tenants(module_daemon: DaemonProcess, prompt: list[int],
                                     alices: dict[int, bytes]) -> None:
    with module_daemon.client() as c:
        s = c.stub

        def lookup(identity: Identity, tokens: list[int], max_tokens: int = 0
                   ) -> pb.LookupResponse:
            return s.Lookup(pb.LookupRequest(identity=identity.message(), tokens=tokens,
                                             max_tokens=max_tokens), timeout=10)

        # Alice finds her longest prefix of every extension of the prompt.
        assert lookup(ALICE, prompt + [5, 6]).key == alices[70]
        assert lookup(ALICE, prompt[:50]).key == alices[40]
        assert lookup(ALICE, prompt, max_tokens=39).key == alices[16]
        # Bob and the tenant-less identity: exact, longer and partial prompts, with and
        # without a cap, all get byte for byte the answer of a prompt nobody ever saved.
        never = toks(2, 90)
        for other in (BOB, NOBODY):
            for n in (16, 17, 40, 50, 70, 90):
                tokens = (prompt + never)[:n]
                for cap in (0, 39, n):
                    answer = lookup(other, tokens, cap)
                    assert not answer.found, f"{other.tenant or 'no tenant'} found {n}"
                    assert answer.SerializeToString() == \
                        lookup(other, never[:n], cap).SerializeToString()
        # Bob's own shorter entry is his answer, never alice's longer one; and alice
        # keeps hers.
        bobs = c.save(BOB, prompt[:24], b"b" * 500, "cold").key
        assert bobs not in alices.values()
        for n in (24, 40, 70):
            answer = lookup(BOB, prompt[:n])
            assert (answer.key, answer.matched_tokens) == (bobs, 24)
        assert lookup(ALICE, prompt).key == alices[70]
        assert lookup(NOBODY, prompt).found is False


def test_reserve_does_not_reveal_another_tenants_entry_or_save(
        module_daemon: DaemonProcess, prompt: list[int], alices: dict[int, bytes]) -> None:
    """ALREADY_PRESENT or IN_FLIGHT for bob would tell him that alice saved (or is saving)
    these tokens: he must get GRANTED, for a key of his own."""
    with module_daemon.client() as c:
        s = c.stub

        def reserve(identity: Identity, tokens: list[int]) -> pb.ReserveResponse:
            return s.Reserve(pb.ReserveRequest(identity=identity.message(), tokens=tokens,
                                               size=1000, reason="cold"), timeout=10)

        in_flight = toks(3, 30)
        alice_lease = reserve(ALICE, in_flight)
        assert alice_lease.status == pb.ReserveResponse.GRANTED
        assert reserve(ALICE, in_flight).status == pb.ReserveResponse.IN_FLIGHT
        assert reserve(ALICE, prompt[:40]).status == pb.ReserveResponse.ALREADY_PRESENT
        for other in (BOB, NOBODY):
            for tokens in (in_flight, prompt[:40], prompt):
                answer = reserve(other, tokens)
                assert answer.status == pb.ReserveResponse.GRANTED, other
                assert answer.key not in set(alices.values()) | {alice_lease.key}
                s.Abort(pb.AbortRequest(lease_id=answer.lease_id), timeout=10)
        s.Abort(pb.AbortRequest(lease_id=alice_lease.lease_id), timeout=10)


def test_inspecting_another_tenants_key_is_indistinguishable_from_a_missing_key(
        module_daemon: DaemonProcess, prompt: list[int], alices: dict[int, bytes]) -> None:
    with module_daemon.client() as c:
        nobodys = c.save(NOBODY, toks(4, 20), b"n" * 300, "cold").key
        # A corrupt entry of alice's: bob's Inspect must not find that out either (nor
        # quarantine it, which would show in the counters and lose alice her entry).
        broken = c.save(ALICE, toks(5, 20), b"c" * 300, "cold").key
        # Once its RAM copy is made, nothing in the background reads it any more.
        wait_for(lambda: pb.TIER_RAM in next(e.tiers for e in c.list_entries()
                                             if e.key == broken), "the RAM copy")
        path = module_daemon.data_dir / "blobs" / broken.hex()[:2] / f"{broken.hex()}.kvc"
        path.write_bytes(b"\0" * path.stat().st_size)

        def inspect(key: bytes, tenant: str) -> tuple[grpc.StatusCode, str]:
            code, details = status(c.stub.Inspect, pb.InspectRequest(key=key, tenant=tenant),
                                   timeout=10)
            return code, details.replace(key.hex(), "<key>")

        missing = bytes(range(16))
        for asker, theirs in (("bob", [alices[16], alices[70], broken, nobodys]),
                              ("alice", [nobodys]), ("eve", [alices[40]])):
            expected = inspect(missing, asker)
            assert expected[0] == grpc.StatusCode.NOT_FOUND
            for key in theirs:
                assert inspect(key, asker) == expected, (asker, key.hex())
        assert path.exists(), "bob's Inspect quarantined alice's entry"
        assert c.stats().counters.get("corrupt_blobs", 0) == 0
        # Alice herself sees hers.
        assert c.inspect(alices[70], tenant="alice").entry.n_tokens == 70
        assert c.inspect(nobodys).entry.tenant_id == ""
        c.stub.Delete(pb.KeyRequest(key=broken), timeout=10)


def test_list_and_prune_filters_never_show_another_tenant(
        module_daemon: DaemonProcess, prompt: list[int], alices: dict[int, bytes]) -> None:
    with module_daemon.client() as c:
        mine = {name: {c.save(ident, toks(10 + i, 20 + 10 * i), b"m" * 300, reason).key
                       for i, reason in enumerate(("cold", "finish"))}
                for name, ident in TENANTS.items()}
        alice_all = mine["alice"] | set(alices.values())
        # Whose an entry is, independently of its label: the namespace its key hangs in.
        by_namespace = {name: {e.key for e in c.list_entries()
                               if e.namespace == c.namespace_of(
                                   Identity("fp-tenants", LAYOUT, tenant=name))}
                        for name in ("bob", "eve")}
        assert mine["bob"] <= by_namespace["bob"] and not by_namespace["eve"]
        for tenant in ("bob", "eve"):
            for filters in ({}, {"model": "tiny.gguf"}, {"model": "fp-ten"},
                            {"reason": "cold"}, {"min_tokens": 20}, {"tier": "disk"},
                            {"tier": "ram"}, {"limit": 1}):
                listed = {e.key for e in c.list_entries(tenant=tenant, **filters)}
                assert not listed & (alice_all | mine[""]), (tenant, filters)
                assert listed <= by_namespace[tenant]
            dry = c.prune(tenant=tenant, dry_run=True)
            assert {e.key for e in dry.removed} == by_namespace[tenant]
        # A real prune by bob's tenant removes bob's entries only.
        c.prune(tenant="bob")
        left = {e.key for e in c.list_entries()}
        assert not left & by_namespace["bob"]
        # The operator view (no tenant) shows every entry: see the module docstring.
        assert alice_all | mine[""] <= left


def test_nothing_bob_can_ask_names_alices_keys(module_daemon: DaemonProcess, prompt: list[int],
                                              alices: dict[int, bytes]) -> None:
    """Every key-bearing answer to a tenant-scoped request bob can make about alice's
    prompt: none is hers, so Read and OpenRead (which take keys, not tenants) never get
    one of hers from him."""
    with module_daemon.client() as c:
        s = c.stub
        seen: set[bytes] = set()
        for n in range(1, len(prompt) + 1, 3):
            answer = s.Lookup(pb.LookupRequest(identity=BOB.message(), tokens=prompt[:n]),
                              timeout=10)
            seen.add(answer.key)
            res = s.Reserve(pb.ReserveRequest(identity=BOB.message(), tokens=prompt[:n],
                                              size=1000, reason="cold"), timeout=10)
            seen.add(res.key)
            if res.lease_id:
                s.Abort(pb.AbortRequest(lease_id=res.lease_id), timeout=10)
        seen |= {e.key for e in c.list_entries(tenant="bob")}
        seen |= {e.key for e in c.prune(tenant="bob", dry_run=True).removed}
        assert not seen & set(alices.values())
        # And the keys he does learn are his: what he reads under them is his own.
        for key in seen - {b""}:
            code, _ = status(c.stub.OpenRead, pb.OpenReadRequest(key=key), timeout=10)
            assert code == grpc.StatusCode.NOT_FOUND or \
                c.inspect(key).entry.tenant_id == keys.tenant_id("bob")


@pytest.mark.parametrize("local_write", [False, True], ids=["streamed", "same-host file"])
def test_an_entry_cannot_be_filed_under_another_tenant(module_daemon: DaemonProcess,
                                                       local_write: bool) -> None:
    """The tenant label every filter matches comes from the blob's metadata, which the
    writer produces. Regression: bob's blob labelled with alice's tenant id was published
    and then listed, inspected and pruned as alice's; a blob labelled with no tenant hid
    its entry from its own tenant's filters."""
    with module_daemon.client() as c:
        s = c.stub
        label_of = {name: c.resolve(ident)[1] for name, ident in TENANTS.items()}
        cases = [(BOB, label_of["alice"]), (ALICE, ""), (NOBODY, label_of["bob"]),
                 (BOB, "not-a-tenant-id")]
        for i, (writer, label) in enumerate(cases):
            tokens = toks(40 + i + 10 * local_write, 20)
            data = blob_bytes(writer, tokens, b"f" * 400, tenant_id=label,
                              namespace=c.namespace_of(writer))
            res = s.Reserve(pb.ReserveRequest(identity=writer.message(), tokens=tokens,
                                              size=len(data), reason="cold"), timeout=10)
            if local_write:
                Path(res.local_path).write_bytes(data)
            else:
                s.Write(iter([pb.WriteChunk(lease_id=res.lease_id, data=data)]), timeout=10)
            code, details = status(s.Commit, pb.CommitRequest(lease_id=res.lease_id,
                                                              local_write=local_write),
                                   timeout=10)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in details, details
            assert c.lookup(writer, tokens) is None
            # The honest label is accepted.
            assert c.save(writer, tokens, b"f" * 400, "cold").status == "saved"
            assert c.inspect(c.lookup(writer, tokens).key).entry.tenant_id == \
                label_of[writer.tenant]
        assert c.stats().in_flight == 0
        assert not list((module_daemon.data_dir / "tmp").iterdir())


def test_the_operator_view_is_behind_an_owner_only_socket(module_daemon: DaemonProcess,
                                                         alices: dict[int, bytes]) -> None:
    """List without a tenant shows every tenant's entries: by design, for the operator.
    It is the socket's mode that keeps everyone else from asking."""
    with CacheClient(module_daemon.address) as c:
        assert set(alices.values()) <= {e.key for e in c.list_entries()}
    assert module_daemon.socket.stat().st_mode & 0o077 == 0
