"""One runtime serves every tenant, and tenants share nothing.

A request's ``tenant`` salts the namespace its lookups, saves and keys use; the runtime's
own ``config.tenant`` is the default. Isolation is held on every path a prompt's KV could
travel between tenants: the daemon's entries (a lookup, a ``parent_key``, a key), an idle
sequence's live KV, a pinned session, a save still queued. Real daemon, real llama.cpp
(the tiny model, one thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvcache.client import CacheClient
from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion
from model_runtime.runtime import Runtime
from model_runtime.service import request_from_message
from model_runtime.v1 import runtime_pb2 as pb
from tests.support.daemon_proc import DaemonProcess
from tests.support.tiny_llama import sample_prompt, saves_held

CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, prefill_chunk=128,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       reuse_live=True, tenant="house")
TEXT = "we went up the hill and down the road to see the sea, the cat and the dog. "


@pytest.fixture
def runtime(module_daemon: DaemonProcess, tiny_model: Path,
            request: pytest.FixtureRequest) -> Iterator[Callable[..., Runtime]]:
    made: list[Runtime] = []

    def make(**overrides: Any) -> Runtime:
        overrides.setdefault("tenant", request.node.name)
        made.append(Runtime(tiny_model, cache_address=module_daemon.address,
                            config=replace(CONFIG, **overrides)))
        return made[-1]

    yield make
    for rt in made:
        rt.close()


@pytest.fixture
def names(request: pytest.FixtureRequest) -> tuple[str, str]:
    """Two tenants of this test alone (the daemon is shared by the module's tests)."""
    return f"alice-{request.node.name}", f"bob-{request.node.name}"


def ask(rt: Runtime, tokens: list[int], tenant: str | None, **kw: Any) -> Completion:
    done = rt.complete(tokens=tokens, max_tokens=4, tenant=tenant, **kw)
    assert isinstance(done, Completion)
    return done


def flush(rt: Runtime) -> None:
    assert rt.engine.saver.flush(30)


def test_another_tenant_never_gets_a_hit_on_a_tenant_s_prompt(
        runtime: Callable[..., Runtime], module_daemon: DaemonProcess,
        names: tuple[str, str]) -> None:
    a, b = names
    rt = runtime()
    p = sample_prompt(rt.tokenize, 100, TEXT)
    alice = ask(rt, p, a)
    flush(rt)
    assert alice.cache_hit_kind == "cold" and alice.finish_key
    # Bob, on the same runtime: alice's sequence is idle and holds the prompt, the daemon
    # holds her saves. He gets neither.
    bob = ask(rt, p, b)
    assert (bob.cache_hit_kind, bob.cache_tier, bob.cache_delta["tokens_read"]) == ("cold", "", 0)
    assert bob.tokens == alice.tokens  # (the same model: the same greedy tokens)
    assert bob.finish_key != alice.finish_key  # his own namespace, his own keys
    flush(rt)
    # Alice's own requests do reuse: live, and from the daemon after a restart.
    again = ask(rt, p, a)
    assert again.cache_hit_kind == "exact"
    rt2 = runtime()
    assert ask(rt2, p, a).cache_tier in ("ram", "disk")
    # The runtime's own tenant is a tenant like the others.
    assert ask(rt2, p, None).cache_hit_kind == "cold"
    # Bob's entries live in bob's namespace, as the daemon sees it.
    with CacheClient(module_daemon.address) as c:
        for tenant, key in ((a, alice.finish_key), (b, bob.finish_key)):
            identity = rt.engine.identities.of(tenant)
            hit = c.lookup(identity, p + alice.tokens[:3])
            assert hit is not None and hit.key.hex() == key


def test_a_key_of_another_tenant_is_no_way_in(runtime: Callable[..., Runtime],
                                              names: tuple[str, str]) -> None:
    a, b = names
    rt = runtime()
    p = sample_prompt(rt.tokenize, 80, TEXT)
    alice = ask(rt, p, a)
    flush(rt)
    before = rt.stats()["parent_key_unusable"]
    bob = ask(rt, p, b, parent_key=alice.finish_key)
    assert bob.cache_hit_kind == "cold"
    assert rt.stats()["parent_key_unusable"] == before + 1
    assert ask(rt, p, a, parent_key=alice.finish_key).cache_hit_kind != "cold"


def test_a_session_id_names_a_session_per_tenant(runtime: Callable[..., Runtime],
                                                 names: tuple[str, str]) -> None:
    a, b = names
    rt = runtime()
    p = sample_prompt(rt.tokenize, 60, TEXT)
    first = ask(rt, p, a, session_id="chat")
    turn = p + first.tokens[:-1] + sample_prompt(rt.tokenize, 6, "and then")[1:]
    # Bob names alice's session: it is another session, on another sequence, cold.
    bob = ask(rt, turn, b, session_id="chat")
    assert (bob.cache_hit_kind, bob.cache_delta["tokens_read"]) == ("cold", 0)
    assert set(rt.engine.sessions) == {(a, "chat"), (b, "chat")}
    # Alice's session is untouched: her next turn is sticky on her live sequence.
    again = ask(rt, turn, a, session_id="chat")
    assert again.cache_hit_kind == "sticky"
    assert again.cache_delta["tokens_read"] >= len(p)


def test_another_tenant_never_waits_for_a_tenant_s_queued_save(
        runtime: Callable[..., Runtime], names: tuple[str, str]) -> None:
    a, b = names
    rt = runtime(session_resume_wait_ms=3000, reuse_live=False)
    p = sample_prompt(rt.tokenize, 100, TEXT)
    with saves_held(rt.engine.saver):
        ask(rt, p, a)  # its saves stay queued in the runtime
        bob = ask(rt, p + [5, 6, 7], b)
        assert bob.timings["ttft_ms"] < 2500, "bob waited for alice's save"
        assert rt.stats()["lookups_waited_own_save"] == 0
    flush(rt)


def test_the_tenant_travels_in_the_request_message() -> None:
    assert request_from_message(pb.CompleteRequest(prompt="x")).tenant is None  # the runtime's
    assert request_from_message(pb.CompleteRequest(prompt="x", tenant="bob")).tenant == "bob"
    assert request_from_message(pb.CompleteRequest(prompt="x", tenant="")).tenant == ""

