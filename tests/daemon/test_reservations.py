"""What a reservation may cost others, against real daemons over TCP.

Room on the disk tier is made as a save's bytes arrive (or at a local writer's commit),
never at Reserve: a client that reserves the whole budget and aborts, or never writes,
evicts nothing of anyone's. Each tenant may have --max-saves-per-tenant saves in flight,
and no save may reserve more than --max-entry-bytes.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest

from kvcache.auth import ClientAuth
from kvcache.client import CacheClient, Identity
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, tcp_address, write_token
from tests.support.entries import DaemonFactory, toks

ALICE = Identity("fp-reserve", {"type_k": "f16"}, tenant="alice", model_name="m")
BOB = Identity("fp-reserve", {"type_k": "f16"}, tenant="bob", model_name="m")
TOKENS = {"alice": secrets.token_hex(16), "bob": secrets.token_hex(16)}
DISK = 2_000_000
ENTRY = 150_000  # payload bytes of alice's entries: ten fill three quarters of DISK


def tcp_daemon(daemon_factory: DaemonFactory, tmp_path: Path, *extra: str) -> DaemonProcess:
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} tenants={name}\n" for name, t in TOKENS.items()))
    tokens.chmod(0o600)
    return daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(tokens),
                          "--disk-bytes", str(DISK), "--ram-bytes", "0",
                          "--block-size", "16", *extra)


def client_of(d: DaemonProcess, tmp_path: Path, who: str) -> CacheClient:
    return CacheClient(tcp_address(d), auth=ClientAuth.load(
        token_file=write_token(tmp_path / f"{who}.token", TOKENS[who])))


def reserve(c: CacheClient, identity: Identity, seed: int, size: int) -> pb.ReserveResponse:
    return c.stub.Reserve(pb.ReserveRequest(identity=identity.message(), tokens=toks(seed, 20),
                                            size=size, reason="cold"), timeout=10)


def fill_with_alices(d: DaemonProcess, tmp_path: Path) -> set[bytes]:
    with client_of(d, tmp_path, "alice") as alice:
        return {alice.save(ALICE, toks(100 + i, 30), bytes([i]) * ENTRY, "cold").key
                for i in range(10)}


def stored(d: DaemonProcess) -> set[bytes]:
    with d.client() as local:
        return {e.key for e in local.list_entries()}


def test_a_reservation_nobody_writes_evicts_nothing(daemon_factory: DaemonFactory,
                                                    tmp_path: Path) -> None:
    """Regression: one Reserve near --disk-bytes, then Abort, evicted 12 of 14 entries."""
    d = tcp_daemon(daemon_factory, tmp_path)
    alices = fill_with_alices(d, tmp_path)
    with client_of(d, tmp_path, "bob") as bob:
        for seed in range(3):  # aborted, and left to its writer (who never writes)
            granted = reserve(bob, BOB, seed, DISK - 1000)
            assert granted.status == pb.ReserveResponse.GRANTED
            if seed < 2:
                bob.stub.Abort(pb.AbortRequest(lease_id=granted.lease_id), timeout=10)
        assert stored(d) == alices
        with d.client() as local:
            s = local.stats()
        assert s.counters["evictions_disk"] == 0
        disk = next(t for t in s.tiers if t.tier == pb.TIER_DISK)
        assert disk.reserved_bytes == 0  # no room is held for bytes that never came
        # A save of one's own that does not fit still refuses up front, evicting nothing.
        err = pytest.raises(grpc.RpcError, reserve, bob, BOB, 9, DISK + 1).value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stored(d) == alices


def test_room_is_made_as_the_bytes_arrive(daemon_factory: DaemonFactory,
                                          tmp_path: Path) -> None:
    """Bytes written do make room (the least recently used entries go, as many as the
    bytes need), over TCP and for a local writer on the unix socket, whose bytes the
    daemon first sees at commit."""
    d = tcp_daemon(daemon_factory, tmp_path)
    alices = fill_with_alices(d, tmp_path)
    with client_of(d, tmp_path, "bob") as bob:
        saved = bob.save(BOB, toks(200, 30), b"b" * 800_000, "cold")
        assert saved.status == "saved"
    left = stored(d)
    assert saved.key in left and 0 < len(alices - left) < len(alices)
    with d.client() as local:
        assert local.fast_path
        piece = local.save(BOB, toks(201, 30), b"c" * 600_000, "cold")
        assert piece.status == "saved"
        s = local.stats()
    assert piece.key in stored(d)
    disk = next(t for t in s.tiers if t.tier == pb.TIER_DISK)
    assert disk.bytes <= DISK and disk.reserved_bytes == 0


def test_saves_in_flight_are_capped_per_tenant(daemon_factory: DaemonFactory,
                                              tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--max-saves-per-tenant", "2")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob:
        first, _ = reserve(alice, ALICE, 1, 5000), reserve(alice, ALICE, 2, 5000)
        err = pytest.raises(grpc.RpcError, reserve, alice, ALICE, 3, 5000).value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-saves-per-tenant" in (err.details() or "")
        # Bob's saves are his own to count.
        assert reserve(bob, BOB, 1, 5000).status == pb.ReserveResponse.GRANTED
        alice.stub.Abort(pb.AbortRequest(lease_id=first.lease_id), timeout=10)
        assert reserve(alice, ALICE, 3, 5000).status == pb.ReserveResponse.GRANTED
    with d.client() as local:
        assert local.stats().counters["saves_refused_tenant_limit"] == 1


def test_the_largest_entry_is_configurable(daemon_factory: DaemonFactory,
                                           tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--max-entry-bytes", "100K")
    with client_of(d, tmp_path, "alice") as alice:
        err = pytest.raises(grpc.RpcError, reserve, alice, ALICE, 1, 200_000).value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the limit of 102400" in (err.details() or "")
        assert reserve(alice, ALICE, 2, 50_000).status == pb.ReserveResponse.GRANTED
