"""The Store in-process, as the unit tests make and fill it: the identity and block size
entries are saved under, one entry reserved, written and committed, reads, and waits for
the store's background work (RAM placement, the reclaimer, start-up recovery)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import payloads
from harness.payloads import payload_for

from kvcache import keys
from kvcache.client import Identity
from kvcache.index import Record
from kvcache.store import Store, StoreConfig
from kvcache.store.recovery import Recovery
from tests.support.daemon_proc import wait_for

FP = "fp-test"
LAYOUT = {"type_k": "f16"}
NS = keys.namespace(FP, LAYOUT)
BLOCK = 16

# blob_bytes(tokens, payload, reason="cold"): the blob of an entry of namespace NS.
blob_bytes = functools.partial(payloads.blob_bytes, Identity(FP, LAYOUT))


def raw(tokens: list[int]) -> bytes:
    return keys.tokens_to_bytes(tokens)


def put(store: Store, tokens: list[int], size: int = 1000, reason: str = "cold", *,
        tenant_id: str | None = None, ns: bytes = NS) -> Record:
    """Reserve, write (in two chunks) and commit one entry (``tenant_id``: filed under
    that tenant label, in namespace ``ns``)."""
    data = payloads.blob_bytes(Identity(FP, LAYOUT), tokens, payload_for(tokens, size),
                               reason, tenant_id=tenant_id, namespace=ns)
    res = store.reserve(ns, raw(tokens), len(data), reason, FP, tenant_id=tenant_id)
    assert res.status == "granted", res
    half = len(data) // 2
    store.write(res.lease_id, 0, data[:half])
    store.write(res.lease_id, half, data[half:])
    return store.commit(res.lease_id)


def read_all(store: Store, key: bytes) -> bytes:
    pin, chunks = store.iter_read(key)
    return b"".join(bytes(c) for c in chunks)


def ram_settled(store: Store) -> None:
    """Wait for the (single) RAM placement worker to finish what was queued."""
    store._ram_worker.submit(lambda: None).result(timeout=30)


def entry_size(tokens: list[int], size: int = 1000) -> int:
    return len(blob_bytes(tokens, payload_for(tokens, size)))


def present(store: Store, *token_lists: list[int]) -> list[bool]:
    return [store.index.get(keys.entry_key(NS, t, BLOCK).key) is not None for t in token_lists]


def hold_recovery(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the background check after a crash (of any store of this process) wait before
    each folder until the returned event is set: a test sees the store serving with
    nothing checked yet. The wait ends too when the store closes."""
    go_on = threading.Event()
    real = Recovery._check_folder

    def check_folder(self: Recovery, folder: int) -> None:
        while not go_on.wait(0.05):
            if self._closed.is_set():  # the store closes before the test lets it go on
                return
        real(self, folder)

    monkeypatch.setattr(Recovery, "_check_folder", check_folder)
    return go_on


def recovered(store: Store) -> None:
    """Wait until the store's start-up recovery (after a crash) has checked everything."""
    wait_for(lambda: store.recovery().state in ("none", "done"),
             "the start-up recovery to finish", timeout=60)


def store_factory(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """Stores on ``tmp_path/data`` (RAM tier in ``tmp_path/ram``), closed after the test.
    Without overrides a store keeps no free-space watermark and evicts only when a save
    needs room (the reclaimer's watermarks at 100%: what a save evicts is then
    deterministic); tests of the reclaimer set its watermarks."""
    stores: list[Store] = []

    def make(**overrides: object) -> Store:
        settings: dict[str, object] = {"min_free_bytes": 0, "block_size": BLOCK,
                                       "reclaim_low": 1.0, "reclaim_high": 1.0, **overrides}
        config = StoreConfig(root=tmp_path / "data", ram_dir=tmp_path / "ram",
                             **settings)  # type: ignore[arg-type]
        store = Store(config)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()
