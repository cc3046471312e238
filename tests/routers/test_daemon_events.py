"""The daemon's KV events, read by the real NVIDIA Dynamo indexer (ai-dynamo-runtime):
what a daemon stores is matched to that daemon with the right length and tier; what goes
(delete, prune, eviction) is unmatched; RAM copies made and dropped re-tier the blocks; a
restarted daemon leaves the indexer's view right; a late subscriber catches up by replay.
"""

from __future__ import annotations

import pytest

from kvcache.client import Identity
from tests.support.entries import toks
from tests.support.kv_events import (
    BLOCK,
    IDENT,
    DaemonFactory,
    IndexerFactory,
    endpoint,
    event_args,
    save,
    tier,
    wait_match,
)

pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the dev extra) is missing")


def test_stored_entries_are_matched_to_the_daemon_holding_them(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    events = [endpoint(), endpoint()]
    daemons = [daemon_factory(*event_args(e), name=f"host{i}") for i, e in enumerate(events)]
    indexer = indexer_factory({1: [events[0]], 2: [events[1]]})
    own = [toks(1, 3 * BLOCK + 5), toks(2, 2 * BLOCK + 1)]
    shared = toks(3, 2 * BLOCK)
    for d, tokens in zip(daemons, own, strict=True):
        with d.client() as c:
            save(c, tokens)
            save(c, shared)
    # Whole blocks only: 53 tokens are 3 blocks of 16.
    first = wait_match(indexer, own[0], lambda a: tier(a, 1) == 3 * BLOCK, "host 1's prompt")
    assert tier(first, 2) == 0
    second = wait_match(indexer, own[1], lambda a: tier(a, 2) == 2 * BLOCK, "host 2's prompt")
    assert tier(second, 1) == 0
    # The same prompt on both: the same block ids, credited to both.
    both = wait_match(indexer, shared, lambda a: tier(a, 1) == tier(a, 2) == 2 * BLOCK,
                      "the shared prompt on both hosts")
    assert tier(both, 1, "gpu") == 0  # the daemon holds no live sequence


def test_a_piece_holds_its_own_blocks_and_its_parent_the_rest(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    ev = endpoint()
    d = daemon_factory(*event_args(ev))
    indexer = indexer_factory({1: [ev]})
    tokens = toks(4, 4 * BLOCK + 3)
    with d.client() as c:
        parent = save(c, tokens[: 2 * BLOCK + 7])
        child = save(c, tokens, parent=parent, base=2 * BLOCK + 7)
        wait_match(indexer, tokens, lambda a: tier(a, 1) == 4 * BLOCK, "the whole chain")
        c.delete(child)
        # The parent still holds its own two blocks; the child's (3 and 4) are gone.
        wait_match(indexer, tokens, lambda a: tier(a, 1) == 2 * BLOCK, "the parent's blocks")
        c.delete(parent)
        wait_match(indexer, tokens, lambda a: tier(a, 1) == 0, "nothing")


def test_a_block_shared_by_entries_goes_with_the_last_of_them(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    ev = endpoint()
    d = daemon_factory(*event_args(ev))
    indexer = indexer_factory({1: [ev]})
    base = toks(5, 2 * BLOCK)
    with d.client() as c:
        a = save(c, base + toks(6, 5))
        b = save(c, base + toks(7, 9))
        wait_match(indexer, base, lambda r: tier(r, 1) == 2 * BLOCK, "the shared blocks")
        c.delete(a)
        # b still holds both blocks: nothing removed (the indexer would drop them at once).
        after = wait_match(indexer, base, lambda r: tier(r, 1) == 2 * BLOCK, "still held")
        assert tier(after, 1) == 2 * BLOCK
        c.delete(b)
        wait_match(indexer, base, lambda r: tier(r, 1) == 0, "gone with the last holder")


def test_prune_and_eviction_unmatch_what_they_remove(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    ev = endpoint()
    # Room for about two entries of 48 tokens x 64 bytes on disk.
    d = daemon_factory(*event_args(ev), "--disk-bytes", "8K", "--ram-bytes", "0")
    indexer = indexer_factory({1: [ev]})
    prompts = [toks(10 + i, 3 * BLOCK) for i in range(3)]
    with d.client() as c:
        keys = [save(c, p) for p in prompts[:2]]
        for p in prompts[:2]:
            wait_match(indexer, p, lambda r: tier(r, 1) == 3 * BLOCK, "stored")
        save(c, prompts[2])  # evicts the least recently used: the first
        wait_match(indexer, prompts[0], lambda r: tier(r, 1) == 0, "the evicted entry")
        wait_match(indexer, prompts[2], lambda r: tier(r, 1) == 3 * BLOCK, "the new entry")
        c.prune(keys=[keys[1]], max_disk_bytes=1)
        wait_match(indexer, prompts[1], lambda r: tier(r, 1) == 0, "the pruned entry")


def test_ram_copies_made_and_dropped_move_blocks_between_host_memory_and_disk(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    ev = endpoint()
    d = daemon_factory(*event_args(ev))
    indexer = indexer_factory({1: [ev]})
    tokens = toks(20, 3 * BLOCK)
    with d.client() as c:
        save(c, tokens)  # written through to disk, then copied to RAM in the background
        wait_match(indexer, tokens, lambda r: tier(r, 1, "cpu") == 3 * BLOCK,
                   "in host memory")
        c.prune(max_ram_bytes=1)  # every RAM copy goes; the disk copy stays
        moved = wait_match(indexer, tokens, lambda r: tier(r, 1, "cpu") == 0, "on disk only")
        assert tier(moved, 1, "disk") == 3 * BLOCK
    # What Dynamo's indexer calls the tiers the words map to.
    tiers = {e["storage_tier"] for e in indexer.dump()["default:default"]["events"]}
    assert tiers == {"disk"}


def test_a_restarted_daemon_leaves_the_indexer_right(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    ev = endpoint()
    d = daemon_factory(*event_args(ev))
    indexer = indexer_factory({1: [ev]})
    kept, gone = toks(30, 2 * BLOCK), toks(31, 2 * BLOCK)
    with d.client() as c:
        save(c, kept)
        save(c, gone)
    wait_match(indexer, gone, lambda r: tier(r, 1) == 2 * BLOCK, "before the restart")
    d.stop()
    # While it is down its blocks are unreachable: the last batch cleared them.
    wait_match(indexer, kept, lambda r: tier(r, 1) == 0, "nothing while it is down")
    d.start()
    wait_match(indexer, kept, lambda r: tier(r, 1) == 2 * BLOCK, "re-announced at start-up")
    with d.client() as c:
        c.delete(c.lookup(IDENT, gone).key)
    wait_match(indexer, gone, lambda r: tier(r, 1) == 0, "a removal after the restart")
    d.stop()
    # Another data directory on the same endpoint: nothing of the first is matched.
    other = daemon_factory(*event_args(ev), name="other")
    with other.client() as c:
        save(c, toks(32, BLOCK))
    wait_match(indexer, toks(32, BLOCK), lambda r: tier(r, 1) == BLOCK, "the new host's")
    assert tier(indexer.query(kept), 1) == 0


def test_tenants_are_matched_apart_and_never_named(
        daemon_factory: DaemonFactory, indexer_factory: IndexerFactory) -> None:
    ev = endpoint()
    d = daemon_factory(*event_args(ev))
    indexer = indexer_factory({1: [ev]})
    tokens = toks(40, 2 * BLOCK)
    alice = Identity(IDENT.model_fingerprint, IDENT.kv_layout, "alice-corp", IDENT.model_name)
    with d.client() as c:
        save(c, tokens, identity=alice)
    wait_match(indexer, tokens, lambda r: tier(r, 1) == 2 * BLOCK, "alice's prompt")
    assert "alice" not in d.log()  # (nothing logs it either)
