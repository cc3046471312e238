"""Tenant quotas and reservation bounds, against real daemons over TCP.

With --tenant-disk-quota (and --tenant-ram-quota), a tenant at its quota makes room among
its own entries, least recently used first: its saves never push out another tenant's
entries for it. An entry larger than the quota is refused with RESOURCE_EXHAUSTED naming
the quota. Each tenant's saves in flight may have reserved at most
--max-reserved-bytes-per-tenant bytes. Stats shows each tenant's usage to an admin, and to
a token bound to tenants its own only; usage survives restarts.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from kvcache.auth import ClientAuth
from kvcache.cli import main as kvcache_main
from kvcache.client import CacheClient, CacheError, Identity
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, tcp_address, wait_for, write_token
from tests.support.entries import DaemonFactory, toks

ALICE = Identity("fp-quota", {"type_k": "f16"}, tenant="alice", model_name="m")
BOB = Identity("fp-quota", {"type_k": "f16"}, tenant="bob", model_name="m")
TOKENS = {"admin": secrets.token_hex(16), "alice": secrets.token_hex(16),
          "bob": secrets.token_hex(16)}
DISK = 4_000_000
ENTRY = 100_000  # payload bytes; a blob is a little larger
QUOTA = 450_000  # four of alice's entries fit, a fifth does not


def tcp_daemon(daemon_factory: DaemonFactory, tmp_path: Path, *extra: str) -> DaemonProcess:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKENS['admin']} admin\n{TOKENS['alice']} tenants=alice\n"
                      f"{TOKENS['bob']} tenants=bob\n")
    tokens.chmod(0o600)
    return daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(tokens),
                          "--disk-bytes", str(DISK), "--block-size", "16", *extra)


def client_of(d: DaemonProcess, tmp_path: Path, who: str) -> CacheClient:
    return CacheClient(tcp_address(d), auth=ClientAuth.load(
        token_file=write_token(tmp_path / f"{who}.token", TOKENS[who])))


def save(c: CacheClient, identity: Identity, seed: int, payload: int = ENTRY) -> bytes:
    result = c.save(identity, toks(seed, 30), bytes([seed % 256]) * payload, "cold")
    assert result.status == "saved"
    return result.key


def reserve(c: CacheClient, identity: Identity, seed: int, size: int) -> pb.ReserveResponse:
    return c.stub.Reserve(pb.ReserveRequest(identity=identity.message(), tokens=toks(seed, 20),
                                            size=size, reason="cold"), timeout=10)


def stored(d: DaemonProcess) -> set[bytes]:
    with d.client() as local:
        return {e.key for e in local.list_entries()}


def usage(c: CacheClient) -> dict[str, pb.TenantUsage]:
    return {t.tenant or t.tenant_id: t for t in c.stats().tenants}


def test_a_tenant_at_its_quota_evicts_its_own_least_recently_used(
        daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--ram-bytes", "0",
                   "--tenant-disk-quota", f"alice={QUOTA}")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob:
        bobs = {save(bob, BOB, 200 + i) for i in range(6)}  # bob has no quota
        alices = [save(alice, ALICE, 100 + i) for i in range(4)]
        assert stored(d) == bobs | set(alices)
        # Her oldest entry, read now, is her most recently used: the second oldest goes.
        alice.load(alices[0])
        alices.append(save(alice, ALICE, 104))
        assert stored(d) == bobs | {alices[0], *alices[2:]}
        for i in range(5, 12):
            alices.append(save(alice, ALICE, 100 + i))
            mine = usage(alice)["alice"]
            assert mine.disk_bytes <= QUOTA and mine.disk_entries == 4
            assert bobs <= stored(d)  # never one of bob's
        assert stored(d) == bobs | set(alices[-4:])
    with d.client() as local:
        counters = local.stats().counters
    assert counters["evictions_quota_disk"] == 8 and counters["evictions_disk"] == 0


def test_an_entry_larger_than_the_quota_is_refused(daemon_factory: DaemonFactory,
                                                   tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--ram-bytes", "0",
                   "--tenant-disk-quota", f"alice={QUOTA}", "--tenant-disk-quota", "*=1M")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob:
        kept = {save(alice, ALICE, 1), save(alice, ALICE, 2)}
        err = pytest.raises(grpc.RpcError, reserve, alice, ALICE, 3, QUOTA + 1).value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"quota of {QUOTA} bytes (--tenant-disk-quota)" in (err.details() or "")
        with pytest.raises(CacheError) as refused:
            alice.save(ALICE, toks(4, 30), b"x" * (QUOTA + 1000), "cold")
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stored(d) == kept  # nothing evicted for it
        # '*' is every other tenant's quota: bob's 1 MB.
        err = pytest.raises(grpc.RpcError, reserve, bob, BOB, 5, 1_100_000).value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota of 1048576 bytes" in (err.details() or "")
        assert reserve(bob, BOB, 6, 500_000).status == pb.ReserveResponse.GRANTED

        # Her entries pinned, no room can be made within her quota: refused, nothing goes.
        kept |= {save(alice, ALICE, 7), save(alice, ALICE, 8)}
        with d.client() as local:
            for key in kept:
                local.pin(key)
            with pytest.raises(CacheError) as full:
                alice.save(ALICE, toks(9, 30), b"y" * ENTRY, "cold")
            assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "within this tenant's disk quota" in str(full.value)
            assert stored(d) == kept
            unpinned = min(kept)
            local.unpin(unpinned)
            assert local.stats().counters["saves_refused_quota"] == 4
        # The daemon keeps serving her: unpinned, her entry makes room for the next.
        fresh = save(alice, ALICE, 10)
        assert stored(d) == (kept - {unpinned}) | {fresh}


def test_quota_usage_is_the_same_after_a_restart(daemon_factory: DaemonFactory,
                                                 tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--ram-bytes", "2M",
                   "--tenant-disk-quota", f"alice={QUOTA}")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob:
        alices = [save(alice, ALICE, 300 + i) for i in range(6)]
        bobs = {save(bob, BOB, 400 + i) for i in range(3)}
    with d.client() as local:
        wait_for(lambda: {e.key for e in local.list_entries(tier="ram")} == stored(d),
                 "every entry's RAM copy")
        before = usage(local)
    assert before["alice"].disk_entries == 4 and before["bob"].disk_entries == 3
    d.restart()  # a clean shutdown: its record holds the usage
    with d.client() as local:
        assert usage(local) == before
    d.stop()
    # A change while it was down: the next start-up counts every entry again.
    gone = alices[-1]
    (d.data_dir / "blobs" / gone.hex()[:2] / f"{gone.hex()}.kvc").unlink()
    d.start()
    with d.client() as local:
        after = usage(local)
        entry = before["alice"].disk_bytes - after["alice"].disk_bytes
        assert after["alice"].disk_entries == 3 and 0 < entry < QUOTA // 4
        assert after["bob"] == before["bob"]
    # Still held to it: two more of hers fit only with her oldest gone, bob's untouched
    # (saved on the unix socket: the TCP port is another one after a restart).
    with d.client() as local:
        newer = [save(local, ALICE, 310), save(local, ALICE, 311)]
        assert usage(local)["alice"].disk_bytes <= QUOTA
    assert stored(d) == bobs | set(alices[3:5]) | set(newer)


def test_a_tenant_at_its_ram_quota_drops_its_own_copies(daemon_factory: DaemonFactory,
                                                        tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--ram-bytes", "2M",
                   "--tenant-ram-quota", "alice=250K")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob, \
            d.client() as local:
        bobs = {save(bob, BOB, 500 + i) for i in range(3)}
        wait_for(lambda: local.stats().counters["ram_placements"] == 3, "bob's RAM copies")
        alices = []
        for i in range(5):
            alices.append(save(alice, ALICE, 600 + i))
            wait_for(lambda i=i: local.stats().counters["ram_placements"] == 4 + i,
                     "alice's RAM copy")
        in_ram = {e.key for e in local.list_entries(tier="ram")}
        assert in_ram == bobs | set(alices[-2:])
        mine = usage(alice)["alice"]
        assert mine.ram_entries == 2 and mine.ram_bytes <= 250 * 1024
        assert mine.ram_quota_bytes == 250 * 1024 and not mine.HasField("disk_quota_bytes")
        # Larger than her RAM quota: on disk only (a save, not refused).
        big = save(alice, ALICE, 700, payload=300_000)
        alice.load(big)  # a disk hit would place a copy if it could
        counters = local.stats().counters
        assert counters["evictions_quota_ram"] == 3 and counters["evictions_ram"] == 0
        assert big not in {e.key for e in local.list_entries(tier="ram")}


def test_reserved_bytes_are_bounded_per_tenant_and_come_back(daemon_factory: DaemonFactory,
                                                             tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--max-reserved-bytes-per-tenant", "300K",
                   "--lease-seconds", "2")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob:
        first = reserve(alice, ALICE, 1, 200 * 1024)
        second = reserve(alice, ALICE, 2, 100 * 1024)
        assert {first.status, second.status} == {pb.ReserveResponse.GRANTED}
        mine = usage(alice)["alice"]
        assert (mine.open_saves, mine.reserved_bytes) == (2, 300 * 1024)
        err = pytest.raises(grpc.RpcError, reserve, alice, ALICE, 3, 1000).value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-reserved-bytes-per-tenant" in (err.details() or "")
        assert reserve(bob, BOB, 1, 300 * 1024).status == pb.ReserveResponse.GRANTED
        alice.stub.Abort(pb.AbortRequest(lease_id=first.lease_id), timeout=10)
        assert reserve(alice, ALICE, 3, 200 * 1024).status == pb.ReserveResponse.GRANTED
        # Leases nobody writes expire (--lease-seconds 2) and give their bytes back.
        wait_for(lambda: usage(alice)["alice"].open_saves == 0, "alice's leases to expire")
        assert reserve(alice, ALICE, 4, 300 * 1024).status == pb.ReserveResponse.GRANTED
    with d.client() as local:
        assert local.stats().counters["saves_refused_reserved_bytes"] == 1


def test_the_default_bound_is_four_of_the_largest_entry(daemon_factory: DaemonFactory,
                                                        tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--max-entry-bytes", "100K")
    with client_of(d, tmp_path, "alice") as alice:
        for seed in range(4):
            assert reserve(alice, ALICE, seed, 100 * 1024).status == \
                pb.ReserveResponse.GRANTED
        err = pytest.raises(grpc.RpcError, reserve, alice, ALICE, 9, 1000).value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"limit of {4 * 100 * 1024}" in (err.details() or "")


def test_stats_shows_each_tenant_its_own_usage_only(daemon_factory: DaemonFactory,
                                                    tmp_path: Path) -> None:
    d = tcp_daemon(daemon_factory, tmp_path, "--ram-bytes", "0", "--tcp-admin",
                   "--tenant-disk-quota", f"alice={QUOTA}", "--tenant-disk-quota", "carol=1M")
    with client_of(d, tmp_path, "alice") as alice, client_of(d, tmp_path, "bob") as bob, \
            client_of(d, tmp_path, "admin") as admin:
        save(alice, ALICE, 1)
        save(bob, BOB, 2)
        save(bob, BOB, 3)
        lease = reserve(bob, BOB, 4, 5000)
        everyone = usage(admin)
        # carol has a quota and nothing yet; names come from the token file and quotas.
        assert set(everyone) == {"alice", "bob", "carol"}
        assert (everyone["bob"].disk_entries, everyone["bob"].open_saves) == (2, 1)
        assert everyone["alice"].disk_quota_bytes == QUOTA
        assert not everyone["bob"].HasField("disk_quota_bytes")
        assert everyone["carol"].disk_bytes == 0 and everyone["carol"].disk_quota_bytes == 1 << 20

        seen = alice.stats()
        assert [t.tenant for t in seen.tenants] == ["alice"]
        assert seen.tenants[0] == everyone["alice"]
        assert not seen.tiers and not seen.counters  # nothing of anyone else's
        assert [t.tenant for t in bob.stats().tenants] == ["bob"]
        bob.stub.Abort(pb.AbortRequest(lease_id=lease.lease_id), timeout=10)

    # The operator's view: `kvcache stats` lists the tenants, --json exactly.
    shown = CliRunner().invoke(kvcache_main, ["stats", "--address", d.address])
    assert shown.exit_code == 0, shown.output
    assert "DISK QUOTA" in shown.output and "439.5 KiB (22%)" in shown.output
    data = json.loads(CliRunner().invoke(kvcache_main, ["stats", "--address", d.address,
                                                        "--json"]).output)
    assert [(t["tenant"], t["disk_entries"]) for t in data["tenants"]] == \
        [("alice", 1), ("bob", 2), ("carol", 0)]  # named tenants by name
    # A tenant's token sees its own row only.
    own = CliRunner().invoke(kvcache_main, ["stats", "--address", tcp_address(d), "--json"],
                             env={"KVCACHE_TOKEN_FILE": str(tmp_path / "alice.token")})
    assert own.exit_code == 0, own.output
    assert [t["tenant"] for t in json.loads(own.output)["tenants"]] == ["alice"]


def test_quota_options_are_checked(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    for args, message in ((["--tenant-disk-quota", "alice"], "not TENANT=SIZE"),
                          (["--tenant-ram-quota", "alice=lots"], "not a size"),
                          (["--tenant-disk-quota", "a=1M", "--tenant-disk-quota", "a=2M"],
                           "given twice")):
        run = CliRunner().invoke(kvcache_main, ["serve", "--dir", str(tmp_path / "d"), *args])
        assert run.exit_code == 2 and message in run.output, run.output
        assert not (tmp_path / "d").exists()  # refused before anything was made
