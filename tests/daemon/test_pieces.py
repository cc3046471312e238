"""Each prefix stored once: entries as pieces built on other entries, over a real daemon.

A piece holds only the cells after the first ``base`` tokens, which its parent's chain
holds. These tests use opaque payloads of ``WIDTH`` bytes per token (the daemon never
reads payloads) and check what the daemon promises: pieces are validated against their
parent, stored bytes are counted once, leaves are evicted first, pins and reads protect
what an entry is built on, removing an entry removes what is built on it, a corrupt
piece takes its dependents with it, and start-up drops broken chains. The runtime's
side (cutting real llama.cpp states, joining them, greedy output) is in
test_runtime_pieces.py.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.client import CacheClient, CacheError, CorruptBlob, Identity, LoadedBlob
from kvcache.v1 import kvcache_pb2 as pb
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import blob_file, flip_payload, ram_file, toks

IDENT = Identity("fp-pieces", {"type_k": "f16"}, model_name="tiny.gguf")
WIDTH = 256  # payload bytes per token
LAYOUT = b"layout-1"  # opaque to the daemon

DaemonFactory = Callable[..., DaemonProcess]


def cells(tokens: list[int], start: int) -> bytes:
    """The payload of tokens[start:]: each token's cells depend on its prefix's length
    and its own id, so joined pieces can be compared with a whole state."""
    return b"".join(random.Random(i * 65_537 + t).randbytes(WIDTH)
                    for i, t in enumerate(tokens[start:], start))


def save(client: CacheClient, tokens: list[int], parent: bytes = b"", base: int = 0,
         identity: Identity = IDENT, reason: str = "finish") -> bytes:
    result = client.save(identity, tokens, cells(tokens, base), reason, parent=parent,
                         base=base, cell_layout=LAYOUT)
    assert result.status == "saved", result
    return result.key


def joined(chain: list[LoadedBlob], n: int) -> bytes:
    """The first n tokens' cells of a chain, as the runtime joins them."""
    out = b""
    for i, blob in enumerate(chain):
        end = chain[i + 1].meta.base if i + 1 < len(chain) else len(blob.meta.tokens)
        take = min(end, n) - blob.meta.base
        out += bytes(blob.payload[: take * WIDTH])
    return out


def placed(client: CacheClient, *keys: bytes) -> None:
    """Wait for the entries' RAM copies: placing one (in the background) holds the entry,
    and prune skips held entries, so a test of its plans waits first."""
    wait_for(lambda: set(keys) <= {e.key for e in client.list_entries(tier="ram")},
             "the RAM copies")


def stored_files(d: DaemonProcess) -> dict[str, int]:
    return {p.stem: p.stat().st_size for p in (d.data_dir / "blobs").rglob("*.kvc")}


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[CacheClient]:
    with daemon.client() as c:
        yield c


# -- stored once ----------------------------------------------------------------------------


def test_two_entries_sharing_a_prefix_store_it_once(daemon: DaemonProcess,
                                                    client: CacheClient) -> None:
    system = toks(1, 400)
    a = system + toks(2, 50)
    b = system + toks(3, 70)
    key_a = save(client, a)
    hit = client.lookup(IDENT, b, common_prefix=True)
    assert hit is not None and hit.key == key_a and hit.matched_tokens == 400
    parent = hit.parent_for(400)
    assert parent is not None and parent.key == key_a
    key_b = save(client, b, parent=parent.key, base=400)

    files = stored_files(daemon)
    # b's blob holds its own 70 tokens' cells (plus header and token ids), not 470.
    assert files[key_b.hex()] < 70 * WIDTH + 4 * len(b) + 1024
    assert files[key_a.hex()] > 450 * WIDTH
    stats = client.stats()
    disk = next(t for t in stats.tiers if t.tier == 2)
    assert disk.bytes == sum(files.values())
    assert stats.logical_bytes > disk.bytes * 1.7  # b's logical size counts all 470 tokens

    # Both restore exactly: b's chain is a's first 400 tokens and b's own 70.
    hit = client.lookup(IDENT, b, common_prefix=True)
    assert hit is not None and hit.key == key_b and hit.matched_tokens == len(b)
    assert [(p.key, p.base, p.n_tokens) for p in hit.chain] == [(key_a, 0, 450),
                                                                  (key_b, 400, 470)]
    chain = client.load_chain(hit.key, prefix_of=b, pieces=hit.pieces_for(len(b)))
    assert joined(chain, len(b)) == cells(b, 0)
    # Without the lookup's chain (a parent or session key), the parents are followed.
    chain = client.load_chain(key_b, prefix_of=b)
    assert [c.key for c in chain] == [key_a, key_b]
    assert joined(chain, 420) == cells(b, 0)[: 420 * WIDTH]

    entries = {e.key: e for e in client.list_entries()}
    assert entries[key_a].children == 1 and entries[key_b].parent == key_a
    assert entries[key_b].base == 400 and entries[key_b].logical_size > entries[key_b].size
    detail = client.inspect(key_b)
    assert [p.key for p in detail.chain] == [key_a, key_b]


def test_a_chain_of_three_and_a_prompt_that_needs_only_its_root(client: CacheClient) -> None:
    t = toks(4, 300)
    k1 = save(client, t[:100])
    k2 = save(client, t[:200], parent=k1, base=100)
    k3 = save(client, t[:300], parent=k2, base=200)
    prompt = t[:150] + toks(5, 40)
    hit = client.lookup(IDENT, prompt, common_prefix=True)
    assert hit is not None and hit.matched_tokens == 150
    assert [p.key for p in hit.pieces_for(150)] == [k1, k2]  # k3's own cells start at 200
    chain = client.load_chain(hit.key, prefix_of=prompt, shares=150,
                              pieces=hit.pieces_for(150))
    assert joined(chain, 150) == cells(t, 0)[: 150 * WIDTH]
    chain = client.load_chain(k3, prefix_of=t, shares=90)  # only the root is needed
    assert [c.key for c in chain] == [k1]


# -- a piece must fit its parent ------------------------------------------------------------


def reserve_error(client: CacheClient, tokens: list[int], parent: bytes, base: int,
                  identity: Identity = IDENT) -> CacheError:
    with pytest.raises(CacheError) as err:
        client.save(identity, tokens, cells(tokens, base), "finish", parent=parent, base=base,
                    cell_layout=LAYOUT)
    return err.value


def test_a_piece_is_refused_unless_its_parent_holds_its_base(client: CacheClient) -> None:
    t = toks(6, 300)
    k1 = save(client, t[:100])
    k2 = save(client, t[:200], parent=k1, base=100)
    other = toks(7, 300)
    cases = [
        (t[:250], b"\x01" * 16, 200, grpc.StatusCode.NOT_FOUND, "gone"),
        (other, k2, 150, grpc.StatusCode.INVALID_ARGUMENT, "does not end a chain"),
        (t[:150] + other[:50], k2, 160, grpc.StatusCode.INVALID_ARGUMENT, "does not end"),
        # k2's own cells start at 100: a piece sharing only 90 tokens builds on k1.
        (t[:90] + other[:50], k2, 90, grpc.StatusCode.INVALID_ARGUMENT, "own cells"),
        (t[:250], k2, 220, grpc.StatusCode.INVALID_ARGUMENT, "does not end"),
    ]
    for tokens, parent, base, code, words in cases:
        exc = reserve_error(client, tokens, parent, base)
        assert exc.code == code and words in str(exc), (base, exc)
    # A piece of no cells: the client refuses to encode it, the daemon to reserve it.
    with pytest.raises(ValueError, match="base 250 for 250 tokens"):
        client.save(IDENT, t[:250], b"", "finish", parent=k2, base=250)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Reserve(pb.ReserveRequest(
            identity=IDENT.message(), packed_tokens=keys.tokens_to_bytes(t[:250]), size=999,
            reason="finish", parent=k2, base=250))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "0 < base < 250" in err.value.details()
    # Another tenant's (or model's) entry is never a parent: tenants share no pieces.
    tenant = Identity(IDENT.model_fingerprint, IDENT.kv_layout, tenant="acme")
    exc = reserve_error(client, t[:250], k2, 200, identity=tenant)
    assert exc.code == grpc.StatusCode.INVALID_ARGUMENT and "another" in str(exc)
    assert client.lookup(tenant, t[:250], common_prefix=True) is None
    # Nothing was published by the refused saves.
    assert len(client.list_entries()) == 2


def test_a_blob_naming_another_parent_than_its_reservation_is_refused(
        client: CacheClient) -> None:
    t = toks(8, 200)
    k1 = save(client, t[:100])
    meta = blobfmt.BlobMeta(namespace=IDENT.namespace, model_fingerprint=IDENT.model_fingerprint,
                            kv_layout=dict(IDENT.kv_layout), tokens=t, reason="finish",
                            model_name=IDENT.model_name, parent=k1, base=99)
    data = b"".join(bytes(p) for p in blobfmt.encode_blob(meta, cells(t, 99)))
    resp = client.stub.Reserve(pb.ReserveRequest(
        identity=IDENT.message(), packed_tokens=keys.tokens_to_bytes(t), size=len(data),
        reason="finish", parent=k1, base=100))
    assert resp.status == pb.ReserveResponse.GRANTED
    client.stub.Write(iter([pb.WriteChunk(lease_id=resp.lease_id, offset=0, data=data)]))
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Commit(pb.CommitRequest(lease_id=resp.lease_id))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parent and base" in err.value.details()
    assert client.stats().counters["saves_invalid"] == 1


# -- what an entry is built on --------------------------------------------------------------


def test_eviction_takes_leaves_first_and_keeps_the_shared_prefix(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--disk-bytes", "400K", "--ram-bytes", "0", "--block-size", "16")
    with d.client() as client:
        system = toks(10, 600)  # ~155 KB, the oldest entry
        root = save(client, system)
        tails = []
        for i in range(12):  # ~13 KB each: the budget holds about 18
            conv = system + toks(100 + i, 50)
            tails.append(save(client, conv, parent=root, base=600))
        # Fill past the budget: the oldest tails go, the root (least recently used of
        # all, but built on) stays.
        for i in range(12, 40):
            save(client, system + toks(100 + i, 50), parent=root, base=600)
        keys_now = {e.key for e in client.list_entries()}
        assert root in keys_now
        assert tails[0] not in keys_now
        stats = client.stats()
        assert stats.counters["evictions_disk"] > 0
        assert stats.counters["dependents_removed"] == 0
        assert next(t for t in stats.tiers if t.tier == 2).bytes <= 400 * 1024


def test_pins_and_reads_protect_what_an_entry_is_built_on(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--disk-bytes", "300K", "--ram-bytes", "0", "--block-size", "16")
    with d.client() as client:
        t = toks(11, 500)
        root = save(client, t[:400])
        leaf = save(client, t, parent=root, base=400)
        client.pin(leaf)
        # Unrelated entries fill the disk: neither the pinned leaf nor its root may go.
        for i in range(20):
            save(client, toks(300 + i, 100))
        keys_now = {e.key for e in client.list_entries()}
        assert {root, leaf} <= keys_now
        # A delete of the root would take the pinned leaf: refused, nothing removed.
        with pytest.raises(CacheError) as err:
            client.delete(root)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "pinned" in str(err.value) and leaf.hex() in str(err.value)
        client.unpin(leaf)
        resp = client.stub.Delete(pb.KeyRequest(key=root))
        assert resp.dependents_removed == 1
        keys_now = {e.key for e in client.list_entries()}
        assert root not in keys_now and leaf not in keys_now
        assert leaf.hex() not in stored_files(d) and root.hex() not in stored_files(d)



def test_a_delete_waits_for_the_daemon_s_own_work_on_an_entry(
        daemon: DaemonProcess, client: CacheClient) -> None:
    """What the daemon itself does with an entry holds it for a moment (its RAM copy
    being made right after a save, a piece being saved on it): an operator's delete
    waits for that instead of failing."""
    from tests.support.commands import cli, ok

    # Right after a save its RAM copy is being made: evict it at once.
    t = toks(20, 300)
    root = save(client, t[:200], reason="cold")
    out = ok(cli("evict", root.hex(), "--address", daemon.address))
    assert f"evicted {root.hex()}" in out and client.list_entries() == []
    # A piece being saved on an entry: the delete returns once that save has ended.
    root = save(client, t[:200], reason="cold")
    placed(client, root)
    lease = client.stub.Reserve(pb.ReserveRequest(
        identity=IDENT.message(), packed_tokens=keys.tokens_to_bytes(t), size=100 * WIDTH,
        reason="finish", parent=root, base=200), timeout=10)
    assert lease.status == pb.ReserveResponse.GRANTED
    ended = threading.Timer(0.3, lambda: client.stub.Abort(
        pb.AbortRequest(lease_id=lease.lease_id), timeout=10))
    ended.start()
    started = time.monotonic()
    client.delete(root)
    assert time.monotonic() - started >= 0.25
    ended.join()
    assert client.list_entries() == []


def test_prune_removes_an_entry_only_with_what_is_built_on_it(client: CacheClient) -> None:
    t = toks(12, 300)
    root = save(client, t[:200], reason="cold")
    leaf = save(client, t, parent=root, base=200, reason="finish")
    placed(client, root, leaf)
    # Only the root matches: it stays (the finish entry is built on it), said so.
    resp = client.prune(reason="cold")
    assert not resp.removed and resp.skipped_shared == 1
    # A byte target takes the leaf first, then the root.
    resp = client.prune(max_disk_bytes=1, dry_run=True)
    assert [e.key for e in resp.removed] == [leaf, root]
    resp = client.prune(reason="finish")
    assert [e.key for e in resp.removed] == [leaf]
    resp = client.prune(reason="cold")
    assert [e.key for e in resp.removed] == [root]


def test_a_corrupt_piece_takes_what_is_built_on_it(daemon: DaemonProcess,
                                                   client: CacheClient) -> None:
    t = toks(13, 300)
    k1 = save(client, t[:100])
    k2 = save(client, t[:200], parent=k1, base=100)
    k3 = save(client, t, parent=k2, base=200)
    # Both copies of the middle of the chain flipped, once the RAM copy is made (the
    # daemon makes it in the background).
    wait_for(lambda: k2 in {e.key for e in client.list_entries(tier="ram")},
             "the piece's RAM copy")
    flip_payload(blob_file(daemon, k2))
    flip_payload(ram_file(daemon, k2))
    hit = client.lookup(IDENT, t, common_prefix=True)
    assert hit is not None and hit.key == k3
    with pytest.raises(CorruptBlob):
        client.load_chain(hit.key, prefix_of=t, pieces=hit.pieces_for(len(t)))
    # Quarantined with everything built on it; the root still serves its prefix.
    hit = client.lookup(IDENT, t, common_prefix=True)
    assert hit is not None and hit.key == k1 and hit.matched_tokens == 100
    counters = client.stats().counters
    assert counters["corrupt_blobs"] == 1 and counters["dependents_removed"] == 1
    assert {e.key for e in client.list_entries()} == {k1}


# -- a lookup that opens its pieces ---------------------------------------------------------


def read_pins(daemon: DaemonProcess) -> int:
    """Read pins the daemon holds now, as another client sees them."""
    with daemon.client() as other:
        return other.stats().read_pins


def test_a_lookup_opens_the_pieces_it_matched_and_loading_them_releases_them(
        daemon: DaemonProcess, client: CacheClient) -> None:
    t = toks(21, 300)
    root = save(client, t[:200], reason="cold")
    leaf = save(client, t, parent=root, base=200)
    prompt = t[:250] + toks(22, 10)  # both pieces hold some of its tokens
    # Not opened when fewer tokens match than the caller would restore.
    hit = client.lookup(IDENT, prompt, common_prefix=True, open_min_tokens=251)
    assert hit is not None and hit.matched_tokens == 250
    assert not any(p.pin_id for p in hit.chain) and read_pins(daemon) == 0
    hit = client.lookup(IDENT, prompt, common_prefix=True, open_min_tokens=250)
    assert hit is not None and hit.matched_tokens == 250
    assert [p.key for p in hit.chain] == [root, leaf] and hit.block_size == 256
    assert all(p.pin_id and p.path.endswith(".kvc") for p in hit.chain)
    assert read_pins(daemon) == 2  # held until loaded: no eviction in between
    chain = client.load_chain(hit.key, prefix_of=prompt, shares=250,
                              pieces=hit.pieces_for(250), block_size=hit.block_size)
    assert joined(chain, 250) == cells(t[:250], 0)
    client.stats()  # a client's next call follows its releases (sent in the background)
    assert read_pins(daemon) == 0
    # Only the pieces holding matched tokens are opened; a hit not loaded is released.
    hit = client.lookup(IDENT, t[:150], common_prefix=True, open_min_tokens=1)
    assert hit is not None and hit.matched_tokens == 150
    assert [bool(p.pin_id) for p in hit.chain] == [p.base < 150 for p in hit.chain]
    assert read_pins(daemon) == 1
    client.release(hit)
    client.close()  # waits for the release
    assert read_pins(daemon) == 0
    # A client of a daemon on another host reads by streaming: nothing to open.
    with CacheClient(daemon.address, fast_path=False) as remote:
        hit = remote.lookup(IDENT, prompt, common_prefix=True, open_min_tokens=1)
        assert hit is not None and not any(p.pin_id or p.path for p in hit.chain)
        chain = remote.load_chain(hit.key, prefix_of=prompt, shares=250,
                                  pieces=hit.pieces_for(250))
        assert joined(chain, 250) == cells(t[:250], 0)
    assert read_pins(daemon) == 0


def test_a_corrupt_opened_piece_is_quarantined_and_the_other_pins_released(
        daemon: DaemonProcess, client: CacheClient) -> None:
    t = toks(23, 300)
    k1 = save(client, t[:100])
    k2 = save(client, t[:200], parent=k1, base=100)
    k3 = save(client, t, parent=k2, base=200)
    placed(client, k2)
    flip_payload(blob_file(daemon, k2))
    flip_payload(ram_file(daemon, k2))
    hit = client.lookup(IDENT, t, common_prefix=True, open_min_tokens=1)
    assert hit is not None and [p.key for p in hit.chain] == [k1, k2, k3]
    with pytest.raises(CorruptBlob):
        client.load_chain(hit.key, prefix_of=t, pieces=hit.pieces_for(len(t)),
                          block_size=hit.block_size)
    client.stats()
    assert read_pins(daemon) == 0  # k1's (read well) and k3's (never read) released too
    assert {e.key for e in client.list_entries()} == {k1}  # k2 quarantined, k3 with it


# -- start-up -------------------------------------------------------------------------------


def test_start_up_drops_pieces_whose_parent_is_gone(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        t = toks(14, 300)
        k1 = save(client, t[:100])
        k2 = save(client, t[:200], parent=k1, base=100)
        k3 = save(client, t, parent=k2, base=200)
        other = save(client, toks(15, 120))
    daemon.stop()
    blob_file(daemon, k2).unlink()  # lost
    daemon.start()
    with daemon.client() as client:
        assert {e.key for e in client.list_entries()} == {k1, other}
        counters = client.stats().counters
        assert counters["reconcile_removed"] == 2  # the lost one, and the piece on it
        assert k3.hex() not in stored_files(daemon)


def test_a_lost_index_is_rebuilt_parents_first(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        t = toks(16, 300)
        chain_keys = [save(client, t[:100])]
        chain_keys.append(save(client, t[:200], parent=chain_keys[0], base=100))
        chain_keys.append(save(client, t, parent=chain_keys[1], base=200))
        logical = client.stats().logical_bytes
    daemon.stop()
    shutil.rmtree(daemon.data_dir / "index")
    daemon.start()
    with daemon.client() as client:
        assert client.stats().counters["reconcile_added"] == 3
        assert client.stats().logical_bytes == logical
        chain = client.load_chain(chain_keys[2], prefix_of=t)
        assert [c.key for c in chain] == chain_keys
        assert joined(chain, 300) == cells(t, 0)


def test_an_entry_of_the_previous_format_is_still_served(client: CacheClient) -> None:
    """A whole state (no parent, no cell layout), as the previous version wrote it."""
    t = toks(17, 150)
    payload = cells(t, 0)
    assert client.save(IDENT, t, payload, "finish").status == "saved"
    hit = client.lookup(IDENT, t + toks(18, 10), common_prefix=True)
    assert hit is not None and len(hit.chain) == 1 and hit.chain[0].base == 0
    chain = client.load_chain(hit.key, prefix_of=t, pieces=hit.chain)
    assert len(chain) == 1 and bytes(chain[0].payload) == payload
    assert not chain[0].meta.cell_layout and not chain[0].meta.parent


# -- what operators see ---------------------------------------------------------------------


def test_operators_see_pieces_in_stats_ls_inspect_evict_and_prune(
        daemon: DaemonProcess, client: CacheClient) -> None:
    from tests.support.commands import cli, cli_json, ok

    t = toks(19, 300)
    root = save(client, t[:200], reason="cold")
    leaf = save(client, t, parent=root, base=200)
    placed(client, root, leaf)
    sock = ["--address", daemon.address]

    stats = cli_json("stats", *sock)
    assert stats["logical_bytes"] == client.stats().logical_bytes
    assert stats["logical_bytes"] > stats["tiers"]["disk"]["bytes"]
    assert "shared prefixes" in ok(cli("stats", *sock))

    rows = {r["key"]: r for r in cli_json("ls", *sock)}
    assert rows[leaf.hex()]["parent"] == root.hex() and rows[leaf.hex()]["base"] == 200
    assert rows[leaf.hex()]["shared_bytes"] > rows[leaf.hex()]["bytes"]
    assert rows[root.hex()]["children"] == 1 and rows[root.hex()]["shared_bytes"] == 0
    assert "SHARED" in ok(cli("ls", *sock))

    detail = cli_json("inspect", leaf.hex(), *sock)
    assert [(p["key"], p["base"], p["end"]) for p in detail["chain"]] == \
        [(root.hex(), 0, 200), (leaf.hex(), 200, 300)]
    text = ok(cli("inspect", leaf.hex()[:8], *sock))
    assert "2 pieces" in text and "tokens 200-300" in text

    out = ok(cli("prune", "--reason", "cold", *sock))
    assert "1 that other entries are built on" in out
    out = ok(cli("evict", root.hex(), leaf.hex(), *sock))
    assert f"evicted {root.hex()} and 1 entry built on it" in out
    assert f"evicted {leaf.hex()} (with an entry it was built on)" in out
    assert client.list_entries() == []
