"""Warm equals cold: every way a request reuses KV gives what a cold prefill gives.

For each of 50 prompts, a cold run (no cache, no reuse) is the reference; each reuse path
must give the same generated tokens and the same log probabilities, bit for bit (the
top-5 at every step too), so the numbers behind the tokens are compared, not just the
argmax. Paths: an exact hit from the daemon with the scores stored at the prompt's end
(nothing decoded before the first token), an exact hit from a longer state (its last
token computed again), partial hits whose suffix is 1, 2, 7 or 40 tokens, a state joined
from three pieces, a live sequence (partial and exact), a sticky session whose next turn
holds the generated reply, a request of two choices restored once and copied (choice i
is what seed + i gives), greedy and seeded sampling; a subset also after a daemon
restart and from the shared tier on another host. What a sequence held before (long
generations cut short, a session, a copy, another tenant's requests) changes none of it.

That holds because llama.cpp, as tools/setup.sh builds it, computes a token decoded
alone exactly as inside a batch (checked first; see llama_backend.BATCH_VARIANT_OPTIONS).
The tiny model runs on one thread; the same suite on SmolLM2 is marked slow.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from model_runtime.llama_backend import batch_variant_options
from model_runtime.request import Completion
from model_runtime.runtime import Runtime, default_model_path
from tests.support.daemon_proc import DaemonProcess
from tests.support.redis_proc import redis_server
from tests.support.remote_tier import wait_connected, wait_uploads
from tests.support.runtime_calls import flush
from tests.support.warm_cold import (
    BLOCKS,
    CONFIG,
    MAX_TOKENS,
    TEXT,
    ask,
    kind,
    outcome,
    prompts,
    words,
)

N_PROMPTS = 50
# module_daemon's short blocks: the tests' entries spread over blocks rather than crowding
# one (where more than 32 end, a lookup may fall short by less than a block; README, Keys).
DAEMON_ARGS = BLOCKS


def check_every_path(model: Path, daemon: DaemonProcess, make: Callable[..., Runtime],
                     n_prompts: int, *, speculate: bool = False) -> dict[str, int]:
    """Run every reuse path of ``n_prompts`` prompts against a cold reference; returns
    how often each ran (each is asserted equal to cold where it runs). ``speculate``: the
    warm runtimes speculate (prompt lookup) and each warm request predicts cold's reply
    with one token wrong, so that every path verifies drafts, takes some and refuses
    others (counted as "drafted", "accepted" and "rejected"); cold never speculates."""
    cold = make(model, None, n_seq_max=1)
    assert cold.batch_invariant, f"llama.cpp built with {batch_variant_options()}"
    mode = {"speculative": "ngram" if speculate else "off"}
    writer = make(model, daemon.address, **mode)
    reader = make(model, daemon.address, **mode)  # another process's view: restores only
    live = make(model, None, reuse_live=True, **mode)
    ran: dict[str, int] = {}
    references: dict[tuple[tuple[int, ...], int | None], Completion] = {}

    def reference(tokens: list[int], seed: int | None) -> Completion:
        key = (tuple(tokens), seed)
        if key not in references:
            references[key] = ask(cold, tokens, seed)
        return references[key]

    def asked(rt: Runtime, tokens: list[int], seed: int | None = None,
              **kw: object) -> Completion:
        if speculate:  # cold's reply with its middle token wrong
            guess = list(reference(tokens, seed).tokens)
            if guess:
                guess[len(guess) // 2] = (guess[len(guess) // 2] + 1) % rt.model.n_vocab
            kw["prediction"] = guess
        return ask(rt, tokens, seed, **kw)

    def same(path: str, warm: Completion, tokens: list[int], seed: int | None = None) -> None:
        assert outcome(warm) == outcome(reference(tokens, seed)), (path, len(tokens))
        ran[path] = ran.get(path, 0) + 1
        if speculate:
            for name, n in (("drafted", warm.drafted_tokens),
                            ("accepted", warm.accepted_tokens),
                            ("rejected", warm.drafted_tokens - warm.accepted_tokens)):
                ran[name] = ran.get(name, 0) + n

    for i, p in enumerate(prompts(cold, n_prompts)):
        seed = i if i % 3 == 0 else None  # every third prompt sampled with a seed
        first = asked(writer, p, seed)
        # Cold, unless an earlier prompt begins with the same words: a plain-attention
        # entry serves the tokens it shares (then it must give cold's output too).
        assert first.cache_hit_kind == "cold" or \
            (first.cache_hit_kind, first.cache_tier) in {("partial", "ram"), ("partial", "disk")}
        assert first.cache_delta["tokens_read"] < len(p) - 1, "a new prompt found whole"
        same("cold", first, p, seed)
        flush(writer)

        again = asked(reader, p, seed)
        assert kind(again) == ("exact", len(p)), "the prompt's scores were stored with it"
        same("exact, stored scores", again, p, seed)

        # Restored once, copied to a second sequence: choice i is what a request with
        # seed + i gives (greedy: both are the cold reply).
        for choice in asked(reader, p, seed, n=2):  # type: ignore[union-attr]
            assert kind(choice) == ("exact", len(p))
            same(f"n=2, choice {choice.choice}", choice, p,
                 None if seed is None else seed + choice.choice)

        shorter = p[: len(p) - 2]
        inner = asked(reader, shorter, seed)
        assert kind(inner) == ("exact", len(shorter) - 1)
        same("exact, last token computed again", inner, shorter, seed)

        for n_more in (1, 2, 7, 40):
            longer = p + words(cold, n_more, seed=i * 10 + n_more)
            warm = asked(reader, longer, seed)
            # (At least p: where the extra words begin as the reply did, the finish
            # state serves more.)
            assert warm.cache_delta["tokens_read"] >= len(p), n_more
            same(f"partial, {n_more}-token suffix", warm, longer, seed)
        flush(reader)

        # The reply's cells (computed one token at a time) reused by the next turn,
        # restored from three pieces: the cold boundary's, the prompt's, the finish's.
        turn = p + first.tokens[:-1] + words(cold, 5, seed=i)
        joined = asked(reader, turn, seed)
        assert joined.cache_hit_kind == "partial"
        assert joined.cache_delta["tokens_read"] >= len(p) + max(len(first.tokens) - 1, 0)
        same("joined pieces, reply reused", joined, turn, seed)

        live.complete(tokens=p, max_tokens=MAX_TOKENS)
        extended = p + words(cold, 9, seed=i + 1)
        warm = asked(live, extended, seed)
        assert warm.cache_tier == "live" and warm.cache_delta["tokens_read"] >= len(p)
        same("live, partial", warm, extended, seed)
        warm = asked(live, p, seed)
        assert (warm.cache_tier, kind(warm)) == ("live", ("exact", len(p)))
        same("live, exact with kept scores", warm, p, seed)

        session = f"s{i}"
        opening = asked(live, p, seed, session_id=session)
        same("sticky, first turn", opening, p, seed)
        follow = p + opening.tokens[:-1] + words(cold, 6, seed=i + 2)
        warm = asked(live, follow, seed, session_id=session)
        assert warm.cache_hit_kind == "sticky"
        same("sticky, reply reused", warm, follow, seed)
    return ran


def test_this_build_computes_a_token_alike_alone_or_in_a_batch(tiny_model: Path) -> None:
    with Runtime(tiny_model, cache_address=None, config=CONFIG) as rt:
        assert rt.kernels == "deterministic"  # (tests/runtime/test_kernels.py)
        assert rt.batch_invariant
        assert batch_variant_options() == []


def test_every_reuse_path_gives_what_a_cold_prefill_gives(
        tiny_model: Path, module_daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    ran = check_every_path(tiny_model, module_daemon, runtimes, N_PROMPTS)
    assert min(ran.values()) == N_PROMPTS and len(ran) == 14, ran


def test_every_reuse_path_gives_what_a_cold_prefill_gives_with_speculation(
        tiny_model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    # Speculation on as a path: drafts verified in one batch (taken, and refused) give
    # the tokens and the log probabilities single steps give, after every kind of reuse.
    n_prompts = 12
    ran = check_every_path(tiny_model, daemon, runtimes, n_prompts, speculate=True)
    drafted, accepted, rejected = (ran.pop(k) for k in ("drafted", "accepted", "rejected"))
    assert min(ran.values()) == n_prompts and len(ran) == 14, ran
    assert accepted > n_prompts * 14 and rejected > n_prompts, (drafted, accepted, rejected)


def test_requests_running_together_give_what_each_gives_alone(
        tiny_model: Path, runtimes: Callable[..., Runtime]) -> None:
    # Two sequences in one batch every tick (one prefilling while the other decodes, or
    # both decoding): each stream's tokens are computed as they would be alone.
    rt = runtimes(tiny_model, None, n_seq_max=2, prefill_chunk=16)
    cold = runtimes(tiny_model, None, n_seq_max=1)
    batch = prompts(cold, 12, seed=3)
    def run(r: Runtime, tokens: list[int]) -> Completion:
        return r.complete(tokens=tokens, max_tokens=20, logprobs=True, top_logprobs=5,
                          timeout=60)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for pair in zip(batch[::2], batch[1::2], strict=True):
            together = list(pool.map(lambda p: run(rt, p), pair))
            for p, done in zip(pair, together, strict=True):
                assert outcome(done) == outcome(run(cold, p))


def test_what_a_sequence_held_before_leaves_no_trace_in_a_later_request(
        tiny_model_no_eog: Path, runtimes: Callable[..., Runtime]) -> None:
    # A worker's sequences carry their past: long generations cut short, a sticky session,
    # a prompt copied for n=2, both tenants' requests. A prompt of more than 1024 tokens
    # (several chunks, past where those filled the stream) served then (partially from
    # a live sequence sharing only BOS, exactly from it, and cold for another tenant, who
    # reuses nothing of the first's) gives what a fresh runtime gives, to the last bit.
    # (The reuse paths of one request are exercised above; here the sequences' history.)
    sizes = {"n_ctx": 2048, "n_batch": 512, "prefill_chunk": 256}
    used = runtimes(tiny_model_no_eog, None, n_seq_max=2, reuse_live=True, **sizes)
    fresh = runtimes(tiny_model_no_eog, None, n_seq_max=1, **sizes)
    history = prompts(used, 4, seed=7)

    def cut(tenant: str, tokens: list[int], after: int) -> None:
        # A streamed reply of up to 1900 tokens whose caller leaves after ``after``.
        events = used.complete(tokens=tokens, max_tokens=1900, stream=True, tenant=tenant)
        for n, _ in enumerate(events):  # type: ignore[arg-type]
            if n == after:
                break
        events.close()  # type: ignore[union-attr]

    with ThreadPoolExecutor(max_workers=2) as pool:  # both sequences at once
        list(pool.map(lambda a: cut(*a), [("alice", history[0], 1500),
                                          ("bob", history[1], 700)]))
    ask(used, history[2], tenant="bob", n=2)
    ask(used, history[3], tenant="alice", session_id="held")  # pinned: one sequence left
    cut("alice", history[0], 1200)

    long = [used.tokenize(TEXT)[0]] + words(used, 1029, seed=11)
    cold = outcome(ask(fresh, long))
    first = ask(used, long, tenant="alice")
    again = ask(used, long, tenant="alice")
    other = ask(used, long, tenant="bob")
    assert (first.cache_tier, first.cache_hit_kind) == ("live", "partial")
    assert (again.cache_tier, kind(again)) == ("live", ("exact", len(long)))
    assert kind(other) == ("cold", 0)
    assert outcome(first) == outcome(again) == outcome(other) == cold


def test_restores_after_a_daemon_restart_give_what_a_cold_prefill_gives(
        tiny_model: Path, tmp_path: Path, runtimes: Callable[..., Runtime]) -> None:
    d = DaemonProcess(tmp_path / "data", *BLOCKS).start()
    try:
        writer = runtimes(tiny_model, d.address)
        cold = runtimes(tiny_model, None, n_seq_max=1)
        batch = prompts(cold, 10, seed=1)
        firsts = []
        for p in batch:  # each one's saves sent before the next: none dropped by a full
            firsts.append(ask(writer, p))  # backlog (3 saves a request, 8 queued at most)
            flush(writer)
        d.close()
        d = DaemonProcess(tmp_path / "data", *BLOCKS).start()
        reader = runtimes(tiny_model, d.address)
        for p, first in zip(batch, firsts, strict=True):
            warm = ask(reader, p)
            assert kind(warm) == ("exact", len(p))
            assert outcome(warm) == outcome(first) == outcome(ask(cold, p))
            longer = p + words(cold, 3, seed=len(p))
            warm = ask(reader, longer)
            assert warm.cache_hit_kind == "partial"
            assert outcome(warm) == outcome(ask(cold, longer))
    finally:
        d.close()


def test_states_from_the_shared_tier_give_what_a_cold_prefill_gives(
        tiny_model: Path, daemon_factory: Callable[..., DaemonProcess],
        runtimes: Callable[..., Runtime], tmp_path: Path) -> None:
    # One fleet key: it signs the values and salts the tenant namespaces alike on both.
    fleet_key = tmp_path / "fleet-key"
    fleet_key.write_text("the-fleet-key-of-the-determinism-test\n")
    fleet_key.chmod(0o600)
    with redis_server() as server:
        a, b = (daemon_factory("--remote", server.url, "--block-size", "16",
                               "--remote-signing-key-file", str(fleet_key), name=name)
                for name in ("a", "b"))
        wait_connected(a)
        wait_connected(b)
        writer, reader = runtimes(tiny_model, a.address), runtimes(tiny_model, b.address)
        cold = runtimes(tiny_model, None, n_seq_max=1)
        batch = prompts(cold, 5, seed=2)
        firsts = [ask(writer, p) for p in batch]
        flush(writer)
        wait_uploads(a, sum(len(f.saves) for f in firsts), timeout=60)
        served = set()
        for p, first in zip(batch, firsts, strict=True):
            warm = reader.complete(tokens=p, max_tokens=MAX_TOKENS, logprobs=True,
                                   top_logprobs=5, timeout=30)
            served.add(warm.cache_tier)
            assert outcome(warm) == outcome(first) == outcome(ask(cold, p))
        assert "remote" in served


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~170 SmolLM2 requests: ~6 minutes on 2 quiet cores
def test_every_reuse_path_gives_what_a_cold_prefill_gives_on_smollm2(
        module_daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    ran = check_every_path(default_model_path(), module_daemon, runtimes, 12)
    assert min(ran.values()) == 12 and len(ran) == 14, ran
