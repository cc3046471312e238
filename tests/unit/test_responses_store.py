"""The stored responses (model_runtime/gateway/apis/responses/store.py) on real SQLite files:
owner-only, bounded in count and bytes (oldest first), expired by age, per tenant, kept
across a reopen."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from model_runtime.gateway.apis.responses.store import ResponseStore, StoredResponse
from model_runtime.gateway.settings import ResponsesSettings


def item(rid: str, tenant: str = "t", text: str = "hi", created: float | None = None
         ) -> StoredResponse:
    return StoredResponse(rid, tenant, "m", time.time() if created is None else created,
                          {"id": rid, "output_text": text},
                          [{"role": "user", "content": text}], "ab" * 16, 10, 14)


def test_kept_owner_only_and_across_a_reopen(tmp_path: Path) -> None:
    folder = tmp_path / "responses"
    store = ResponseStore(ResponsesSettings(folder))
    assert not folder.exists()  # nothing written before the first use
    store.put(item("r1"))
    store.close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()] == [0o600]
    again = ResponseStore(ResponsesSettings(folder))
    got = again.get("t", "r1")
    assert got is not None and got.messages == [{"role": "user", "content": "hi"}]
    assert got.finish_key == "ab" * 16 and (got.prompt_tokens, got.state_tokens) == (10, 14)
    again.close()


def test_a_folder_others_could_read_is_made_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "responses"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    store = ResponseStore(ResponsesSettings(folder))
    store.put(item("r1"))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    store.close()


def test_another_tenants_id_is_not_found(tmp_path: Path) -> None:
    store = ResponseStore(ResponsesSettings(tmp_path / "s"))
    store.put(item("r1", tenant="alice"))
    assert store.get("bob", "r1") is None
    assert not store.delete("bob", "r1")
    assert store.get("alice", "r1") is not None
    assert store.delete("alice", "r1") and store.get("alice", "r1") is None
    store.close()


def test_count_bound_drops_the_oldest(tmp_path: Path) -> None:
    store = ResponseStore(ResponsesSettings(tmp_path / "s", max_count=3))
    now = time.time()
    for i in range(5):
        store.put(item(f"r{i}", created=now + i))
    assert [store.get("t", f"r{i}") is not None for i in range(5)] == \
        [False, False, True, True, True]
    assert store.evicted == 2 and store.count() == 3
    store.close()


def test_byte_bound_drops_the_oldest_and_never_keeps_one_too_large(tmp_path: Path) -> None:
    one = len(b'{"id": "r0", "output_text": "') + 1000 + 2 + \
        len(b'[{"role": "user", "content": "') + 1000 + 3
    store = ResponseStore(ResponsesSettings(tmp_path / "s", max_bytes=2 * one + 10))
    now = time.time()
    for i in range(3):
        store.put(item(f"r{i}", text="x" * 1000, created=now + i))
    assert [store.get("t", f"r{i}") is not None for i in range(3)] == [False, True, True]
    store.put(item("big", text="x" * 5000, created=now + 9))  # alone over the bound
    assert store.get("t", "big") is None and store.count() == 0
    store.close()


def test_expired_responses_are_gone(tmp_path: Path) -> None:
    store = ResponseStore(ResponsesSettings(tmp_path / "s", ttl_s=60))
    store.put(item("old", created=time.time() - 61))
    store.put(item("new"))
    assert store.get("t", "old") is None and store.get("t", "new") is not None
    assert store.count() == 1  # dropped when the next one was stored
    store.close()


@pytest.mark.parametrize("bad", [{"max_count": 0}, {"max_bytes": -1}, {"ttl_s": 0},
                                 {"max_count": True}])
def test_bad_bounds_are_refused(tmp_path: Path, bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ResponsesSettings(tmp_path, **bad)  # type: ignore[arg-type]
