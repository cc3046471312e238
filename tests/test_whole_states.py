"""Warm equals cold for models whose states cannot be cut: sliding-window (olmo2 with a
window of 32), hybrid (lfm2: short convolutions between attention layers) and recurrent
(mamba2) tiny models.

A restored state of these models cannot be cut (llama.cpp would empty a sliding-window
state, and refuses to cut a recurrent one), so each reuse path must pick the best state it
can use whole, never cut one: an exact hit is the prompt's own checkpoint (stored with the
scores after it, so nothing is decoded again); a partial hit is the deepest stored state at
or below the prompt (checked against every state the test's requests saved); a live or a
sticky sequence serves in place only when the prompt extends it (a sliding-window one that
was never restored may also be cut, as llama.cpp keeps its full-size window cache), else
the daemon's deepest checkpoint wins over a cold prefill. Every output is compared token by
token and log probability by log probability with a cold run, as in test_determinism.py,
whose helpers this module shares; also after evictions, a daemon restart, from the shared
tier, over a corrupt blob, and across tenants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from redis_proc import redis_server
from test_daemon import blob_file, flip_payload
from test_determinism import BLOCKS, CONFIG, ask, flush, kind, outcome, prompts, words
from test_remote_daemon import wait_connected, wait_uploads

from model_runtime.request import Completion
from model_runtime.runtime import Runtime

KINDS = ("swa", "hybrid", "recurrent")
N_PROMPTS = 8


@pytest.fixture(params=KINDS)
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_model")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("whole-states") / "data", *BLOCKS).start()
    yield d
    d.close()


@pytest.fixture
def runtimes(request: pytest.FixtureRequest) -> Iterator[Callable[..., Runtime]]:
    made: list[Runtime] = []

    def make(model: Path, address: str | None, **overrides: object) -> Runtime:
        overrides.setdefault("tenant", request.node.name)
        rt = Runtime(model, cache_address=address,
                     config=replace(CONFIG, **overrides))  # type: ignore[arg-type]
        made.append(rt)
        return rt

    yield make
    for rt in reversed(made):
        rt.close()


class Stored:
    """The states the test's requests saved (each with the scores after it, as every
    runtime save keeps them), to say which one a lookup must serve."""

    def __init__(self) -> None:
        self.states: set[tuple[int, ...]] = set()

    def add(self, prompt: list[int], done: Completion) -> Completion:
        held = prompt + done.tokens
        for save in done.saves:
            self.states.add(tuple(held[: save["tokens"]]))
        return done

    def deepest(self, tokens: list[int]) -> int:
        """The longest stored state that is a prefix of ``tokens`` (the whole prompt
        included: stored with its scores, it is served whole)."""
        return max((len(s) for s in self.states if tuple(tokens[: len(s)]) == s), default=0)


def sequence_after(prompt: list[int], done: Completion) -> list[int]:
    """What the request's sequence holds when it ends: its last token is decoded only
    when generation stopped after it (an end-of-generation token is never decoded)."""
    return prompt + (done.tokens if done.finish_reason == "stop" else done.tokens[:-1])


def agree(warm: Completion, cold: Completion, what: object, *, bitwise: bool = True) -> None:
    """The same tokens and log probabilities: bit for bit (``bitwise``), or within 1e-3
    for a sliding-window model, whose restored window cache holds its cells in other
    places than a cold run's full-size one, so that attention adds the same terms in
    another order (log probabilities measured up to ~1e-4 apart; the tokens the same)."""
    if bitwise:
        assert outcome(warm) == outcome(cold), what
        return
    assert warm.tokens == cold.tokens, what
    for w, c in zip(warm.logprobs, cold.logprobs, strict=True):
        assert w.token == c.token and w.logprob == pytest.approx(c.logprob, abs=1e-3), what


def bitwise(rt: Runtime) -> bool:
    """Whether restores of the model give a cold run's numbers bit for bit (see agree)."""
    return rt.engine.model.n_swa == 0


def check_every_path_whole(model: Path, daemon: DaemonProcess,
                           make: Callable[..., Runtime], n_prompts: int) -> dict[str, int]:
    """check_every_path of test_determinism.py for states that cannot be cut."""
    cold = make(model, None, n_seq_max=1)
    assert cold.batch_invariant
    assert not cold.ctx.can_truncate_restored()
    cuts_live = not cold.engine.model.is_recurrent  # a live SWA sequence may be cut
    writer = make(model, daemon.address)
    reader = make(model, daemon.address)
    live = make(model, daemon.address, reuse_live=True)
    stored = Stored()
    ran: dict[str, int] = {}

    def same(path: str, warm: Completion, tokens: list[int], seed: int | None) -> None:
        agree(warm, ask(cold, tokens, seed), (path, len(tokens)), bitwise=bitwise(cold))
        ran[path] = ran.get(path, 0) + 1

    def deepest_hit(tokens: list[int]) -> tuple[str, int]:
        n = stored.deepest(tokens)
        return ("exact" if n == len(tokens) else "partial" if n else "cold"), n

    for i, p in enumerate(prompts(cold, n_prompts)):
        seed = i if i % 3 == 0 else None
        first = stored.add(p, ask(writer, p, seed))
        assert first.cache_hit_kind == "cold"
        assert ("prompt", len(p)) in [(s["reason"], s["tokens"]) for s in first.saves]
        same("cold", first, p, seed)
        flush(writer)

        again = stored.add(p, ask(reader, p, seed))
        assert kind(again) == ("exact", len(p)), "the prompt's checkpoint, with its scores"
        same("exact, the prompt's checkpoint", again, p, seed)

        for path, tokens in (
                ("partial, shorter prompt", p[: len(p) - 2]),
                *((f"partial, {n}-token suffix", p + words(cold, n, seed=i * 10 + n))
                  for n in (1, 7, 40)),
                ("partial, next turn after the reply", sequence_after(p, first)
                 + words(cold, 5, seed=i))):
            expected = deepest_hit(tokens)
            warm = stored.add(tokens, ask(reader, tokens, seed))
            assert kind(warm) == expected, path
            same(path, warm, tokens, seed)
            flush(reader)

        # Live: a prompt extending a finished sequence continues it in place.
        out = stored.add(p, live.complete(tokens=p, max_tokens=MAX_LIVE))
        extended = sequence_after(p, out) + words(cold, 9, seed=i + 1)
        warm = stored.add(extended, ask(live, extended, seed))
        assert warm.cache_tier == "live"
        assert warm.cache_delta["tokens_read"] == len(sequence_after(p, out))
        same("live, continued", warm, extended, seed)
        flush(live)
        # The prompt again: the live sequence is longer and cannot be cut (a restored
        # one, or a recurrent one), so the prompt's checkpoint serves it.
        warm = stored.add(p, ask(live, p, seed))
        assert kind(warm) == ("exact", len(p))
        assert warm.cache_tier in ("ram", "disk")
        same("live, exact or its checkpoint", warm, p, seed)

        session = f"s{i}"
        opening = stored.add(p, ask(live, p, seed, session_id=session))
        same("sticky, first turn", opening, p, seed)
        follow = sequence_after(p, opening) + words(cold, 6, seed=i + 2)
        warm = stored.add(follow, ask(live, follow, seed, session_id=session))
        assert kind(warm) == ("sticky", len(sequence_after(p, opening)))
        same("sticky, reply reused", warm, follow, seed)
        flush(live)
        # A turn that leaves the session's sequence inside it: that sequence holds a
        # restored state, or a recurrent one, which cannot be cut; the daemon's deepest
        # checkpoint serves.
        other = p + words(cold, 6, seed=i + 3)
        expected = deepest_hit(other)
        warm = stored.add(other, ask(live, other, seed, session_id=session))
        if warm.cache_hit_kind != "sticky":  # (a never restored SWA sequence is cut)
            assert kind(warm) == expected and expected[1] >= len(p)
        else:
            assert cuts_live
        same("sticky, diverging turn", warm, other, seed)
        flush(live)
    return ran


MAX_LIVE = 6


def test_every_reuse_path_of_a_state_that_cannot_be_cut_gives_what_a_cold_prefill_gives(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    ran = check_every_path_whole(model, daemon, runtimes, N_PROMPTS)
    assert min(ran.values()) == N_PROMPTS and len(ran) == 12, ran


def test_checkpoints_every_interval_of_a_long_prefill_serve_a_late_divergence(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    rt = runtimes(model, daemon.address, checkpoint_interval=40, save_block=512)
    cold = runtimes(model, None, n_seq_max=1)
    p = prompts(cold, 1, seed=5)[0] + words(cold, 150, seed=5)
    first = rt.complete(tokens=p, max_tokens=4)
    assert len(p) > 200
    assert [(s["reason"], s["tokens"]) for s in first.saves][:-1] == [
        *(("cold", n) for n in range(40, len(p), 40)), ("prompt", len(p))]
    flush(rt)
    # Diverging after 130 tokens: the checkpoint at 120 serves, not a cold prefill.
    late = p[:130] + words(cold, 12, seed=6)
    warm = ask(rt, late)
    assert kind(warm) == ("partial", 120)
    agree(warm, ask(cold, late), "late", bitwise=bitwise(cold))


def test_an_evicted_session_resumes_from_its_evict_save(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    rt = runtimes(model, daemon.address, n_seq_max=1)
    cold = runtimes(model, None, n_seq_max=1)
    a, b = prompts(cold, 2, seed=7)
    opening = ask(rt, a, session_id="a")
    ask(rt, b, session_id="b")  # takes session a's only sequence: evict save first
    assert rt.stats()["sessions_evicted"] == 1
    flush(rt)
    turn = sequence_after(a, opening) + words(cold, 5, seed=8)
    warm = ask(rt, turn, session_id="a")
    assert kind(warm) == ("partial", len(sequence_after(a, opening)))
    agree(warm, ask(cold, turn), "evicted", bitwise=bitwise(cold))


def test_shutdown_saves_and_a_daemon_restart_give_what_a_cold_prefill_gives(
        model: Path, tmp_path: Path, runtimes: Callable[..., Runtime]) -> None:
    d = DaemonProcess(tmp_path / "data", *BLOCKS).start()
    try:
        cold = runtimes(model, None, n_seq_max=1)
        # As many sessions as sequences (the reader has as many: for these models the
        # number of sequences is part of the state's layout, hence of its namespace).
        batch = prompts(cold, CONFIG.n_seq_max, seed=1)
        writer = runtimes(model, d.address, save_finish=False)
        firsts = [ask(writer, p, session_id=f"s{n}") for n, p in enumerate(batch)]
        writer.close()  # the sessions' states: saved as `shutdown`
        assert writer.stats()["saves_shutdown"] == len(batch)
        d.close()
        d = DaemonProcess(tmp_path / "data", *BLOCKS).start()
        reader = runtimes(model, d.address)
        for p, first in zip(batch, firsts, strict=True):
            warm = ask(reader, p)
            assert kind(warm) == ("exact", len(p))
            assert outcome(first) == outcome(ask(cold, p))
            agree(warm, first, "restart, exact", bitwise=bitwise(cold))
            turn = sequence_after(p, first) + words(cold, 3, seed=len(p))
            warm = ask(reader, turn)
            assert kind(warm) == ("partial", len(sequence_after(p, first)))  # its shutdown save
            agree(warm, ask(cold, turn), "restart, partial", bitwise=bitwise(cold))
    finally:
        d.close()


def test_states_from_the_shared_tier_give_what_a_cold_prefill_gives(
        model: Path, daemon_factory: Callable[..., DaemonProcess],
        runtimes: Callable[..., Runtime]) -> None:
    with redis_server() as server:
        a = daemon_factory("--remote", server.url, *BLOCKS, name="a")
        b = daemon_factory("--remote", server.url, *BLOCKS, name="b")
        wait_connected(a)
        wait_connected(b)
        writer, reader = runtimes(model, a.address), runtimes(model, b.address)
        cold = runtimes(model, None, n_seq_max=1)
        batch = prompts(cold, 3, seed=2)
        firsts = [ask(writer, p) for p in batch]
        flush(writer)
        wait_uploads(a, sum(len(f.saves) for f in firsts), timeout=60)
        for p, first in zip(batch, firsts, strict=True):
            turn = sequence_after(p, first) + words(cold, 4, seed=len(p))
            warm = ask(reader, turn)  # the finish state, the deepest whole prefix
            assert (warm.cache_tier, kind(warm)) == ("remote", ("partial", len(turn) - 4))
            agree(warm, ask(cold, turn), "remote, partial", bitwise=bitwise(cold))
            warm = ask(reader, p)  # the prompt's checkpoint, not hidden by its finish
            assert (warm.cache_tier, kind(warm)) == ("remote", ("exact", len(p)))
            assert outcome(first) == outcome(ask(cold, p))
            agree(warm, first, "remote, exact", bitwise=bitwise(cold))


def test_a_corrupt_checkpoint_falls_back_to_the_next_deepest(
        model: Path, daemon_factory: Callable[..., DaemonProcess],
        runtimes: Callable[..., Runtime]) -> None:
    d = daemon_factory("--ram-bytes", "0", *BLOCKS)  # reads hit the damaged disk copy
    rt = runtimes(model, d.address)
    cold = runtimes(model, None, n_seq_max=1)
    p = prompts(cold, 1, seed=9)[0] + words(cold, 40, seed=9)
    first = rt.complete(tokens=p, max_tokens=4)
    saves = {s["reason"]: s for s in first.saves}
    flush(rt)
    flip_payload(blob_file(d, bytes.fromhex(saves["prompt"]["key"])))
    warm = ask(rt, p)
    assert kind(warm) == ("partial", saves["cold"]["tokens"])
    agree(warm, ask(cold, p), "corrupt", bitwise=bitwise(cold))
    stats = rt.stats()
    assert stats["corrupt_blobs"] == 1 and stats["restore_failed"] == 0


def test_tenants_never_share_a_state(model: Path, daemon: DaemonProcess,
                                     runtimes: Callable[..., Runtime]) -> None:
    a = runtimes(model, daemon.address, tenant="whole-a")
    b = runtimes(model, daemon.address, tenant="whole-b")
    a_again = runtimes(model, daemon.address, tenant="whole-a")
    cold = runtimes(model, None, n_seq_max=1)
    p = prompts(cold, 1, seed=11)[0]
    ask(a, p)
    flush(a)
    other = ask(b, p)
    assert kind(other) == ("cold", 0)
    same_tenant = ask(a_again, p)
    assert kind(same_tenant) == ("exact", len(p))
    assert outcome(other) == outcome(ask(cold, p))
    agree(same_tenant, other, "tenants", bitwise=bitwise(cold))
