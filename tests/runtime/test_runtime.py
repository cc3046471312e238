"""The model runtime (``Runtime(...).complete``) against real llama.cpp and a real daemon.

Every test runs the tiny generated GGUF on one thread. Hit kinds, save points, failure
paths and sampling are provoked and asserted through the public API, the engine's
counters and the daemon's counters; generated *tokens* are compared, never floats.

How hits arise (RuntimeConfig below: save_block 32, trim 8, min_save_tokens 8):

* a request's ``cold`` save is taken at its boundary: ``prefix_tokens``/the end of the
  system message, else the last 32-aligned position at least 8 tokens before the end
  (a 100-token prompt: 64);
* its ``finish`` save holds prompt + generated tokens but the last (sampled, not yet
  decoded) one;
* saves are asynchronous: tests wait with ``engine.saver.flush`` before relying on them.
"""

from __future__ import annotations

import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvcache.client import CacheClient
from model_runtime.chat.templates import ChatTemplate
from model_runtime.completion_request import CompletionRequest
from model_runtime.counters import COUNTERS
from model_runtime.event_channel import ChannelEvents, EventChannel
from model_runtime.request import (
    Completion,
    PromptDone,
    RequestError,
    TokenEvent,
    WholeAnswerEvents,
    common_prefix,
)
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.runtime_calls import (
    CONFIG,
    TEXT_A,
    TEXT_B,
    TEXT_C,
    TEXT_D,
    daemon_counters,
    delta,
    flush,
    prompt,
)
from tests.support.tiny_llama import saves_held

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plain(tiny_model: Path) -> Iterator[Runtime]:
    """No cache: every request is a cold prefill. The reference for outputs."""
    with Runtime(tiny_model, cache_address=None, config=replace(CONFIG, n_seq_max=1)) as rt:
        yield rt


@pytest.fixture
def make_runtime(request: pytest.FixtureRequest, module_daemon: DaemonProcess,
                 tiny_model: Path) -> Iterator[Callable[..., Runtime]]:
    """``make_runtime(model=..., cache=address|None, **config overrides)``; the tenant is
    the test's name, so tests sharing the daemon never see each other's entries."""
    made: list[Runtime] = []

    def make(model: Path | None = None, cache: str | None | bool = True,
             **overrides: Any) -> Runtime:
        overrides.setdefault("tenant", request.node.name)
        address = module_daemon.address if cache is True else (cache or None)
        rt = Runtime(model or tiny_model, cache_address=address,  # type: ignore[arg-type]
                     config=replace(CONFIG, **overrides))
        made.append(rt)
        return rt

    yield make
    for rt in reversed(made):
        rt.close()


def kinds(c: Completion) -> tuple[str, int]:
    return c.cache_hit_kind, c.cache_delta["tokens_read"]


# --------------------------------------------------------------------------- hit kinds


def test_the_thread_that_builds_a_runtime_computes_nothing(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp computes on an OpenMP team of the calling thread, kept while the thread
    lives: a builder that computed once (the start-up checks) left a team that slowed
    every decode of the model thread ~3x on 2 cores. Start-up computes on threads that
    end; requests on the model thread."""
    from model_runtime.llama_backend import LlamaContext

    computed_on: list[str] = []
    decode = LlamaContext.decode

    def recorded(self: LlamaContext, *args: Any, **kwargs: Any) -> Any:
        computed_on.append(threading.current_thread().name)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(LlamaContext, "decode", recorded)
    with Runtime(tiny_model, cache_address=None, config=CONFIG) as rt:
        started = set(computed_on)
        rt.complete(prompt="The quick brown fox", max_tokens=3)
    me = threading.current_thread().name
    assert started and me not in started and started <= {"llama-apart"}
    assert set(computed_on) - started == {"model"}  # requests: the model thread alone


def test_hit_kinds_cold_exact_partial_sticky(make_runtime: Callable[..., Runtime]) -> None:
    rt = make_runtime()
    p = prompt(rt, 100)
    first = rt.complete(tokens=p, max_tokens=8)
    assert first.finish_reason == "length" and len(first.tokens) == 8
    assert kinds(first) == ("cold", 0)
    # cold at the last 32-aligned position >= 8 before the end; the prompt, with the
    # scores its first token came from; finish: all but the last token.
    assert [(s["reason"], s["tokens"]) for s in first.saves] == \
        [("cold", 64), ("prompt", 100), ("finish", 107)]
    assert first.finish_key == first.saves[-1]["key"]
    assert first.cache_delta["tokens_saved"] == 107
    flush(rt)

    # Each entry carries the scores after its last token: an exact hit on it decodes
    # nothing before its first token (all of the prompt is read from the cache).
    boundary = rt.complete(tokens=p[:64], max_tokens=4)  # equals the cold entry
    assert kinds(boundary) == ("exact", 64)
    assert boundary.cache_tier in ("ram", "disk") and boundary.timings["prefill_ms"] == 0
    assert kinds(rt.complete(tokens=p, max_tokens=4)) == ("exact", 100)
    finished = p + first.tokens[:-1]  # equals the finish entry
    exact = rt.complete(tokens=finished, max_tokens=4)
    assert kinds(exact) == ("exact", 107)
    # Greedy from the restored finish state continues the first request's output.
    assert exact.tokens[0] == first.tokens[-1]
    # Diverging after 80 tokens: the finish state serves them, cut after the restore.
    partial = rt.complete(tokens=p[:80] + prompt(rt, 20, TEXT_B)[1:], max_tokens=4)
    assert kinds(partial) == ("partial", 80)
    flush(rt)
    # The exact request's finish state holds first.tokens[-1] too: 108 tokens shared.
    longer = rt.complete(tokens=p + first.tokens + [40, 41, 42], max_tokens=4)
    assert kinds(longer) == ("partial", len(p) + len(first.tokens))

    q = prompt(rt, 50, TEXT_C)
    opened = rt.complete(tokens=q, max_tokens=6, session_id="s")
    assert opened.cache_hit_kind == "cold" and opened.session_id == "s"
    follow = q + opened.tokens + prompt(rt, 12, TEXT_B)[1:]
    sticky = rt.complete(tokens=follow, max_tokens=6, session_id="s")
    assert kinds(sticky) == ("sticky", len(q) + len(opened.tokens) - 1)

    stats = rt.stats()
    for kind, n in (("cold", 2), ("exact", 3), ("partial", 2), ("sticky", 1)):
        assert stats[f"hits_{kind}"] == n, stats
    assert stats["restores_exact"] == 3 and stats["restores_partial"] == 2


def test_explicit_and_system_message_boundaries(make_runtime: Callable[..., Runtime]) -> None:
    rt = make_runtime()
    p = prompt(rt, 120)
    declared = rt.complete(tokens=p, prefix_tokens=45, max_tokens=3)
    assert declared.saves[0] == {"reason": "cold", "tokens": 45, "key": declared.saves[0]["key"]}
    flush(rt)
    assert kinds(rt.complete(tokens=p[:45] + [7, 8, 9], max_tokens=3)) == ("partial", 45)

    system = TEXT_B * 4
    chat = rt.complete(messages=[{"role": "system", "content": system},
                                 {"role": "user", "content": "hello there"}], max_tokens=3)
    boundary = chat.saves[0]["tokens"]
    assert chat.saves[0]["reason"] == "cold"
    tokens, expected = rt.render_chat([{"role": "system", "content": system},
                                       {"role": "user", "content": "x"}])
    assert boundary == expected and tokens[:boundary] == rt.tokenize(
        ChatTemplate.of_model(rt.model).render([{"role": "system", "content": system}],
                                     add_generation_prompt=False))
    assert rt._head_tokens.cache_info().hits >= 1  # the system message tokenized once
    flush(rt)
    # The system message's state is there; the first chat's finish state also holds the
    # user turn's opening tokens, so it serves a little more than the boundary.
    other = rt.complete(prompt="something else", system=system, max_tokens=3)
    chat_tokens, _ = rt.render_chat([{"role": "system", "content": system},
                                     {"role": "user", "content": "hello there"}])
    other_tokens, _ = rt.render_chat([{"role": "system", "content": system},
                                      {"role": "user", "content": "something else"}])
    finished = chat_tokens + chat.tokens[:-1]
    assert kinds(other) == ("partial", common_prefix(finished, other_tokens))
    assert other.cache_delta["tokens_read"] > boundary


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("case", ["exact-boundary", "exact-finish", "partial", "sticky"])
def test_warm_greedy_output_equals_cold_greedy_output(
        make_runtime: Callable[..., Runtime], plain: Runtime, case: str) -> None:
    rt = make_runtime()
    p = prompt(rt, 100, TEXT_C)
    first = rt.complete(tokens=p, max_tokens=8, session_id="s")
    flush(rt)
    if case == "exact-boundary":
        tokens, kind = p[:64], "exact"
    elif case == "exact-finish":
        tokens, kind = p + first.tokens[:-1], "exact"
    elif case == "partial":
        tokens, kind = p[:70] + prompt(rt, 30, TEXT_A)[1:], "partial"
    else:
        tokens, kind = p + first.tokens + prompt(rt, 10, TEXT_B)[1:], "sticky"
    warm = rt.complete(tokens=tokens, max_tokens=24, session_id="s" if kind == "sticky" else "")
    cold = plain.complete(tokens=tokens, max_tokens=24)
    assert warm.cache_hit_kind == kind and cold.cache_hit_kind == "cold"
    assert warm.tokens == cold.tokens
    assert warm.text == cold.text and warm.finish_reason == cold.finish_reason


def test_a_saved_state_that_goes_on_differently_serves_the_tokens_it_shares(
        make_runtime: Callable[..., Runtime], plain: Runtime) -> None:
    """An agent loop's next prompt re-tokenizes the last reply: it shares all but the end
    of the previous finish state. That state is restored and cut where they part."""
    rt = make_runtime()
    p = prompt(rt, 100)
    first = rt.complete(tokens=p, max_tokens=8)
    flush(rt)
    step = p + first.tokens[:3] + prompt(rt, 30, TEXT_C)[1:]
    fresh = make_runtime()  # another process: nothing live, only the daemon
    done = fresh.complete(tokens=step, max_tokens=8)
    assert kinds(done) == ("partial", common_prefix(p + first.tokens[:-1], step))
    assert done.cache_delta["tokens_read"] >= 103
    assert done.tokens == plain.complete(tokens=step, max_tokens=8).tokens
    # Sharing fewer tokens than min_save_tokens with a longer state: not worth a restore.
    few = p[:5] + prompt(rt, 40, TEXT_B)[1:]
    assert kinds(fresh.complete(tokens=few, max_tokens=2)) == ("cold", 0)


# --------------------------------------------------------------------------- live sequences
# With reuse_live (the default; off in CONFIG so the tests above follow the daemon path), a
# finished sequence keeps its KV and the next prompt sharing a prefix with it is served in
# place: truncate, prefill the rest, no restore (cache_tier "live").


def daemon_reads(rt: Runtime) -> int:
    counters = daemon_counters(rt.cache.address)  # type: ignore[union-attr]
    return sum(v for k, v in counters.items() if k.startswith("reads_"))


def test_an_idle_sequence_serves_a_shared_prefix_in_place(
        make_runtime: Callable[..., Runtime], plain: Runtime) -> None:
    rt = make_runtime(reuse_live=True, n_seq_max=1)
    p = prompt(rt, 100)
    first = rt.complete(tokens=p, max_tokens=8)
    flush(rt)
    reads = daemon_reads(rt)
    # Diverges from the live sequence after 90 tokens: truncated there, not restored.
    other = p[:90] + prompt(rt, 20, TEXT_B)
    done = rt.complete(tokens=other, max_tokens=8)
    assert (done.cache_hit_kind, done.cache_tier) == ("partial", "live")
    assert done.cache_delta["tokens_read"] == common_prefix(p, other) >= 90
    assert daemon_reads(rt) == reads, "nothing was loaded from the daemon"
    assert done.tokens == plain.complete(tokens=other, max_tokens=8).tokens
    # An agent loop's next step extends the sequence: nothing is cut, only new tokens run.
    step = other + done.tokens + prompt(rt, 12, TEXT_C)
    nxt = rt.complete(tokens=step, max_tokens=8)
    assert (nxt.cache_hit_kind, nxt.cache_tier) == ("partial", "live")
    assert nxt.cache_delta["tokens_read"] == len(other) + len(done.tokens) - 1
    assert nxt.tokens == plain.complete(tokens=step, max_tokens=8).tokens
    assert rt.stats()["live_reuses"] == 2
    assert first.cache_hit_kind == "cold"


def test_a_live_sequence_no_saved_state_could_beat_starts_without_waiting_for_the_cache(
        make_runtime: Callable[..., Runtime], plain: Runtime) -> None:
    """Where the prompt's rest after an idle sequence's live KV is shorter than
    min_save_tokens, no state the daemon holds would be restored (it must serve that
    many more): the request starts at once, its lookup sent in the background only so
    the daemon counts the use. A longer rest waits for the daemon's answer."""
    # (No finish saves: the daemon's lookups are then the requests' own.)
    rt = make_runtime(reuse_live=True, n_seq_max=1, min_save_tokens=32, save_finish=False)
    address = rt.cache.address  # type: ignore[union-attr]
    p = prompt(rt, 100)
    first = rt.complete(tokens=p, max_tokens=8)
    flush(rt)
    lookups = daemon_counters(address)["lookups"]
    step = p + first.tokens + prompt(rt, 10, TEXT_C)  # a rest of about 18 tokens
    nxt = rt.complete(tokens=step, max_tokens=8)
    assert (nxt.cache_hit_kind, nxt.cache_tier) == ("partial", "live")
    assert nxt.timings["answer_wait_ms"] == 0  # no answer was waited for
    assert nxt.tokens == plain.complete(tokens=step, max_tokens=8).tokens
    deadline = time.monotonic() + 10
    while daemon_counters(address)["lookups"] == lookups:
        assert time.monotonic() < deadline, "the use was never sent to the daemon"
        time.sleep(0.02)
    assert daemon_counters(address)["lookups"] == lookups + 1
    longer = step + nxt.tokens + prompt(rt, 40, TEXT_B)  # a rest of about 48 tokens
    last = rt.complete(tokens=longer, max_tokens=4)
    assert (last.cache_hit_kind, last.cache_tier) == ("partial", "live")
    assert last.timings["answer_wait_ms"] > 0  # the resolver's answer came first


def test_the_source_that_covers_more_serves_and_a_live_sequence_wins_a_tie(
        make_runtime: Callable[..., Runtime], plain: Runtime) -> None:
    rt = make_runtime(reuse_live=True, n_seq_max=1)
    p = prompt(rt, 100)
    rt.complete(tokens=p, max_tokens=8)
    flush(rt)
    # Another prompt takes the only sequence: p's KV is gone from the context.
    rt.complete(tokens=prompt(rt, 60, TEXT_C), max_tokens=4)
    flush(rt)
    # The daemon's finish entry covers more than the live sequence (nothing in common).
    longer = p + prompt(rt, 10, TEXT_B)
    from_daemon = rt.complete(tokens=longer, max_tokens=6)
    assert from_daemon.cache_hit_kind == "partial"
    assert from_daemon.cache_tier in ("ram", "disk")
    assert from_daemon.tokens == plain.complete(tokens=longer, max_tokens=6).tokens
    flush(rt)
    # Exactly a saved prompt: the daemon holds all of it and the live sequence all but the
    # last token, which either way is decoded again: a tie, served live.
    again = rt.complete(tokens=longer, max_tokens=6)
    assert (again.cache_hit_kind, again.cache_tier) == ("exact", "live")
    assert again.tokens == from_daemon.tokens


def test_a_session_sequence_is_never_reused_by_another_request(
        make_runtime: Callable[..., Runtime]) -> None:
    rt = make_runtime(reuse_live=True, n_seq_max=2)
    p = prompt(rt, 80)
    mine = rt.complete(tokens=p, max_tokens=4, session_id="mine")
    flush(rt)
    other = rt.complete(tokens=p + mine.tokens, max_tokens=4)
    assert other.cache_tier != "live"  # restored from the daemon instead
    back = rt.complete(tokens=p + mine.tokens + prompt(rt, 8, TEXT_B), max_tokens=4,
                       session_id="mine")
    assert back.cache_hit_kind == "sticky"


# --------------------------------------------------------------------------- parent_key


def test_finish_key_as_parent_key_resumes(make_runtime: Callable[..., Runtime],
                                          plain: Runtime) -> None:
    rt = make_runtime()
    p = prompt(rt, 60, TEXT_B)
    first = rt.complete(tokens=p, max_tokens=10)
    flush(rt)
    turn = p + first.tokens + prompt(rt, 15, TEXT_C)[1:]
    resumed = rt.complete(tokens=turn, max_tokens=12, parent_key=first.finish_key)
    assert kinds(resumed) == ("partial", len(p) + len(first.tokens) - 1)
    assert rt.stats()["resolved_by_parent"] == 1
    assert resumed.tokens == plain.complete(tokens=turn, max_tokens=12).tokens

    # A parent that is not a prefix of the prompt (or unknown) is skipped, not fatal.
    before = rt.stats()
    other = rt.complete(tokens=prompt(rt, 40, TEXT_C), max_tokens=3,
                        parent_key=first.finish_key)
    unknown = rt.complete(tokens=p[:50], max_tokens=3, parent_key="ab" * 16)
    after = rt.stats()
    assert other.cache_hit_kind == "cold"
    # The lookup finds p's longer states instead; none ends at token 50 with the scores
    # after it, so the 50th is computed again (cached tokens count only those not).
    assert kinds(unknown) == ("exact", 49)
    assert delta(before, after, "parent_key_unusable") == 2
    assert delta(before, after, "resolved_by_parent") == 0


def test_parent_state_as_long_as_the_prompt_serves_whole_with_its_scores_for_sliding_window(
        make_runtime: Callable[..., Runtime], tiny_swa_model: Path) -> None:
    rt = make_runtime(tiny_swa_model)
    cold = make_runtime(tiny_swa_model, cache=None, n_seq_max=1)
    p = prompt(rt, 100)
    first = rt.complete(tokens=p, max_tokens=8)
    flush(rt)
    # Exactly the parent's tokens, stored with the scores after them: served whole, with
    # nothing cut (a restored SWA state cannot be) and nothing decoded again.
    turn = p + first.tokens[:-1]
    again = rt.complete(tokens=turn, max_tokens=4, parent_key=first.finish_key)
    assert kinds(again) == ("exact", len(turn))
    assert again.tokens == cold.complete(tokens=turn, max_tokens=4).tokens
    stats = rt.stats()
    assert stats["parent_key_unusable"] == 0 and stats["resolved_by_parent"] == 1


def test_state_as_long_as_the_prompt_without_scores_is_unusable_for_sliding_window(
        make_runtime: Callable[..., Runtime], tiny_swa_model: Path) -> None:
    rt = make_runtime(tiny_swa_model)
    cold = make_runtime(tiny_swa_model, cache=None, n_seq_max=1, reuse_live=True)
    p = prompt(rt, 100)
    rt.complete(tokens=p[:80], max_tokens=1)  # checkpoints at 64 (cold) and 80 (prompt)
    # A whole state of p stored without the scores after it (as by another producer):
    # it would have to be cut by one token for them, which a restored SWA state cannot
    # be; so the parent is skipped (and counted), and so is the lookup's hit of the
    # same entry, for the next shorter state (80).
    cold.complete(tokens=p, max_tokens=1)
    assert cold.engine.seqs[0].tokens == p
    state = cold.engine.call(lambda: bytes(cold.ctx.state_seq_get(0)))
    flush(rt)
    assert rt.engine.cache is not None
    key = rt.engine.cache.save(rt.engine.identity, p, state, "finish").key
    again = rt.complete(tokens=p, max_tokens=4, parent_key=key)
    assert kinds(again) == ("partial", 80)
    assert again.tokens == cold.complete(tokens=p, max_tokens=4).tokens
    stats = rt.stats()
    assert stats["parent_key_unusable"] == 1 and stats["resolved_by_parent"] == 0
    assert stats["restore_failed"] == 0


# --------------------------------------------------------------------------- save points


def test_continued_saves_every_interval(daemon_factory: Callable[..., DaemonProcess],
                                        make_runtime: Callable[..., Runtime],
                                        tiny_model_no_eog: Path) -> None:
    daemon = daemon_factory()
    rt = make_runtime(tiny_model_no_eog, cache=daemon.address, continued_interval=4)
    p = prompt(rt, 40)
    done = rt.complete(tokens=p, max_tokens=12)
    assert done.finish_reason == "length" and len(done.tokens) == 12
    # After the 4th, 8th and 12th sampled token: everything decoded so far (the first
    # also stores the prompt, with the scores of its end).
    assert [(s["reason"], s["tokens"]) for s in done.saves] == [
        ("cold", 32), ("prompt", 40), ("continued", 43), ("continued", 47), ("continued", 51)]
    # The finish state is the last continued save: not saved twice, and its key is it.
    assert done.finish_key == done.saves[-1]["key"]
    flush(rt)
    counters = daemon_counters(daemon.address)
    assert counters["saves_committed_continued"] == 3
    assert counters.get("saves_committed_finish", 0) == 0
    assert rt.stats()["saves_continued"] == 3
    # The continued state holds the scores after its last token: nothing is decoded again.
    resumed = rt.complete(tokens=p + done.tokens[:7], max_tokens=2)
    assert kinds(resumed) == ("exact", 47)


def test_evict_when_sessions_outnumber_sequences(
        daemon_factory: Callable[..., DaemonProcess], make_runtime: Callable[..., Runtime],
        plain: Runtime) -> None:
    daemon = daemon_factory()
    # No finish saves: the evict save is then the only copy of a session's end state.
    rt = make_runtime(cache=daemon.address, n_seq_max=2, save_finish=False)
    prompts = {s: prompt(rt, 40 + 10 * i, text) for i, (s, text)
               in enumerate((("a", TEXT_A), ("b", TEXT_B), ("c", TEXT_C)))}
    firsts = {}
    for session in ("a", "b"):
        firsts[session] = rt.complete(tokens=prompts[session], max_tokens=6, session_id=session)
        assert [s["reason"] for s in firsts[session].saves] == ["cold"]
    assert rt.stats().get("sessions_evicted", 0) == 0
    # A third session: no free sequence, so the least recently used idle one (a) goes.
    firsts["c"] = rt.complete(tokens=prompts["c"], max_tokens=6, session_id="c")
    assert firsts["c"].cache_hit_kind == "cold"
    assert rt.stats()["sessions_evicted"] == 1
    flush(rt)
    assert daemon_counters(daemon.address)["saves_committed_evict"] == 1
    tenant = rt.config.tenant  # (sessions are named per tenant)
    assert set(rt.engine.sessions) == {(tenant, "b"), (tenant, "c")}

    # Session a comes back (evicting b): restored from its evict save, not sticky.
    a = prompts["a"] + firsts["a"].tokens + prompt(rt, 9, TEXT_C)[1:]
    back = rt.complete(tokens=a, max_tokens=8, session_id="a")
    assert kinds(back) == ("partial", len(prompts["a"]) + 6 - 1)
    assert rt.stats()["resolved_by_session"] == 1
    assert rt.stats()["sessions_evicted"] == 2
    assert back.tokens == plain.complete(tokens=a, max_tokens=8).tokens


def test_a_prompt_waits_for_this_runtime_s_queued_save_of_its_prefix(
        make_runtime: Callable[..., Runtime], plain: Runtime) -> None:
    """The previous turn's sequence is gone (no live reuse here) and its finish save is
    still queued in this runtime: the next turn waits for it instead of going cold."""
    rt = make_runtime(reuse_live=False, session_resume_wait_ms=10_000)
    first_prompt = prompt(rt, 60)
    first = rt.complete(tokens=first_prompt, max_tokens=4)
    flush(rt)
    with saves_held(rt.engine.saver) as gate:
        second_prompt = first_prompt + first.tokens + prompt(rt, 20, TEXT_B)[1:]
        second = rt.complete(tokens=second_prompt, max_tokens=4)  # its finish save waits
        assert rt.engine.saver.in_flight(bytes.fromhex(second.finish_key)) is not None
        threading.Timer(0.3, gate.set).start()
        third_prompt = second_prompt + second.tokens + prompt(rt, 20, TEXT_C)[1:]
        third = rt.complete(tokens=third_prompt, max_tokens=4)
    assert kinds(third) == ("partial", len(second_prompt) + len(second.tokens) - 1)
    assert rt.stats()["lookups_waited_own_save"] == 1
    assert third.tokens == plain.complete(tokens=third_prompt, max_tokens=4).tokens


def test_close_saves_live_sequences_as_shutdown_and_a_new_runtime_restores_them(
        daemon_factory: Callable[..., DaemonProcess], make_runtime: Callable[..., Runtime],
        tiny_model: Path, plain: Runtime) -> None:
    daemon = daemon_factory()
    rt = make_runtime(cache=daemon.address, save_finish=False)
    p = prompt(rt, 50, TEXT_B)
    live = rt.complete(tokens=p, max_tokens=8, session_id="s")
    assert [s["reason"] for s in live.saves] == ["cold"]
    rt.close()  # the session's sequence (prompt + 7 decoded tokens) is saved now
    counters = daemon_counters(daemon.address)
    assert counters["saves_committed_shutdown"] == 1
    assert rt.stats()["saves_shutdown"] == 1

    again = make_runtime(cache=daemon.address)
    tokens = p + live.tokens[:-1]
    restored = again.complete(tokens=tokens, max_tokens=10)
    assert kinds(restored) == ("exact", len(tokens))
    assert restored.tokens == plain.complete(tokens=tokens, max_tokens=10).tokens


def test_requests_after_close_are_refused(make_runtime: Callable[..., Runtime]) -> None:
    rt = make_runtime()
    rt.engine.close()
    with pytest.raises(RequestError) as err:
        rt.complete(tokens=[1, 5, 6, 7], max_tokens=2)
    assert err.value.code == "unavailable"


def test_save_shutdown_off_also_holds_for_requests_running_at_close(
        make_runtime: Callable[..., Runtime], tiny_model_no_eog: Path) -> None:
    rt = make_runtime(tiny_model_no_eog, save_shutdown=False, n_ctx=2048)
    running = rt.complete(tokens=prompt(rt, 20), max_tokens=2000, stream=True)
    assert isinstance(next(running), TokenEvent)  # type: ignore[call-overload]
    rt.close()
    done = list(running)[-1]  # type: ignore[call-overload]
    assert done.finish_reason == "shutdown"
    assert done.finish_key == "" and done.saves == []
    assert rt.stats()["saves_queued_shutdown"] == 0


def test_close_fails_waiting_requests_without_evicting_a_session_for_them(
        make_runtime: Callable[..., Runtime], tiny_model_no_eog: Path) -> None:
    rt = make_runtime(tiny_model_no_eog, n_ctx=2048)  # two sequences
    # Session s's request runs first, so it is the first to end at close: its sequence
    # becomes an idle session, which the waiting request must not take.
    in_session = rt.complete(tokens=prompt(rt, 30), max_tokens=2000, session_id="s",
                             stream=True)
    assert isinstance(next(in_session), TokenEvent)  # type: ignore[call-overload]
    other = rt.complete(tokens=prompt(rt, 30, TEXT_B), max_tokens=2000, stream=True)
    assert isinstance(next(other), TokenEvent)  # type: ignore[call-overload]
    waiting = rt.complete(tokens=prompt(rt, 30, TEXT_C), max_tokens=4, stream=True)
    wait_for(lambda: rt.stats()["admission_waits"] == 1, "the third request to wait")
    rt.close()
    for running in (in_session, other):
        assert list(running)[-1].finish_reason == "shutdown"  # type: ignore[call-overload]
    with pytest.raises(RequestError) as err:
        list(waiting)  # type: ignore[call-overload]
    assert err.value.code == "unavailable"
    stats = rt.stats()
    assert stats["sessions_evicted"] == 0 and stats["saves_queued_evict"] == 0
    assert stats["saves_queued_shutdown"] == 2 and stats["requests_failed"] == 1


def test_a_dropped_save_is_not_reported_nor_taken_as_saved(
        daemon_factory: Callable[..., DaemonProcess], make_runtime: Callable[..., Runtime],
        tiny_model_no_eog: Path) -> None:
    daemon = daemon_factory()
    rt = make_runtime(tiny_model_no_eog, cache=daemon.address, n_seq_max=1,
                      max_pending_saves=1, continued_interval=1, cache_timeout_s=2.0)
    rt.complete(tokens=prompt(rt, 20), max_tokens=1)  # the runtime learns the block size
    flush(rt)
    p = prompt(rt, 40, TEXT_B)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        # The lookup times out; the first save blocks the sender, the next one waits in
        # its queue of one, the later ones (the last continued, the finish) are dropped.
        done = rt.complete(tokens=p, max_tokens=8, session_id="s")
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert rt.stats()["saves_dropped_backlog"] >= 2
    assert done.finish_key == "" and "finish" not in [s["reason"] for s in done.saves]
    flush(rt)
    # Another session takes the sequence: session s's state is saved now (evict) ...
    rt.complete(tokens=prompt(rt, 30, TEXT_C), max_tokens=2, session_id="t")
    assert rt.stats()["saves_queued_evict"] == 1
    flush(rt)
    # ... and the session resumes from that save.
    back = rt.complete(tokens=p + done.tokens + prompt(rt, 6, TEXT_A)[1:], max_tokens=2,
                       session_id="s")
    assert kinds(back) == ("partial", len(p) + len(done.tokens) - 1)
    assert rt.stats()["resolved_by_session"] == 1


def test_session_keys_are_kept_for_the_most_recent_sessions_only(
        make_runtime: Callable[..., Runtime]) -> None:
    rt = make_runtime(n_seq_max=4)
    rt.engine.save_points.max_session_keys = 2
    for session in ("a", "b", "c"):
        assert rt.complete(tokens=prompt(rt, 20), max_tokens=2, session_id=session).finish_key
    assert list(rt.engine.save_points.session_last_key) == [(rt.config.tenant, s)
                                                            for s in ("b", "c")]


def test_engine_stats_report_every_declared_counter(plain: Runtime) -> None:
    stats = plain.engine.stats()
    assert set(COUNTERS) <= set(stats)
    assert plain.stats() == stats


# --------------------------------------------------------------------------- failures


def test_daemon_killed_mid_request_then_back(daemon_factory: Callable[..., DaemonProcess],
                                             make_runtime: Callable[..., Runtime],
                                             tiny_model_no_eog: Path) -> None:
    daemon = daemon_factory()
    rt = make_runtime(tiny_model_no_eog, cache=daemon.address, n_ctx=2048)
    saved = prompt(rt, 100)
    rt.complete(tokens=saved, max_tokens=4)
    flush(rt)

    # Killed while a request decodes: it completes, its finish save is dropped.
    events = rt.complete(tokens=prompt(rt, 60, TEXT_B), max_tokens=1500, stream=True)
    assert isinstance(next(events), TokenEvent)  # type: ignore[call-overload]
    daemon.kill()
    done = list(events)[-1]
    assert isinstance(done, Completion) and done.finish_reason == "length"
    assert len(done.tokens) == 1500
    flush(rt)
    assert rt.stats()["saves_dropped_unavailable"] >= 1

    # While it is down: requests complete cold, nothing raises.
    down = rt.complete(tokens=saved, max_tokens=4)
    assert kinds(down) == ("cold", 0)
    assert rt.stats()["cache_unavailable"] >= 1
    assert rt.cache_reachable() is False

    # Back on the same data dir: hits again once the client has reconnected.
    daemon.start()
    with CacheClient(daemon.address) as probe:
        probe.wait_ready(timeout=20)
    deadline = time.monotonic() + 20
    while not rt.cache_reachable() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.cache_reachable()
    back = rt.complete(tokens=saved, max_tokens=4)  # the first request's finish state
    assert kinds(back) == ("exact", 100) and back.tokens == down.tokens


def test_state_from_other_kv_settings_is_never_restored(
        make_runtime: Callable[..., Runtime], module_daemon: DaemonProcess,
        plain: Runtime) -> None:
    f16 = make_runtime(type_k="f16")
    q8 = make_runtime(type_k="q8_0")
    assert replace(f16.identity, tenant="").namespace != replace(q8.identity, tenant="").namespace
    p = prompt(f16, 100, TEXT_B)
    f16.complete(tokens=p, max_tokens=4)
    flush(f16)
    # Another KV layout is another namespace: the f16 entries are invisible to q8_0.
    other = q8.complete(tokens=p[:64], max_tokens=4)
    assert kinds(other) == ("cold", 0)
    flush(q8)

    # Directly: a q8_0 state filed under the f16 identity (as a bug or a forged blob
    # would) is refused by llama.cpp; the request goes cold and counts restore_failed.
    q = prompt(f16, 90, TEXT_C)
    q8.complete(tokens=q, max_tokens=2)
    flush(q8)
    with CacheClient(module_daemon.address, timeout=10) as c:
        hit = c.lookup(q8.identity, q, max_tokens=64)
        assert hit is not None and hit.matched_tokens == 64
        payload = c.load(hit.key).payload
        assert c.save(f16.identity, q[:64], payload, "cold").status == "saved"
        # And plain garbage under another prefix.
        r = prompt(f16, 90, TEXT_A)
        assert c.save(f16.identity, r[:64], b"\x00" * 4096, "cold").status == "saved"
    for tokens in (q, r):
        done = f16.complete(tokens=tokens, max_tokens=12)
        assert kinds(done) == ("cold", 0)
        assert done.tokens == plain.complete(tokens=tokens, max_tokens=12).tokens
    stats = f16.stats()
    assert stats["restore_failed"] == 2
    assert stats.get("restores_partial", 0) == stats.get("restores_exact", 0) == 0


def test_concurrent_requests_match_requests_run_alone(
        make_runtime: Callable[..., Runtime], plain: Runtime) -> None:
    rt = make_runtime(n_seq_max=4, prefill_chunk=64)
    jobs: list[dict[str, Any]] = [
        {"tokens": prompt(rt, 40, TEXT_A), "max_tokens": 30},
        {"tokens": prompt(rt, 150, TEXT_B), "max_tokens": 20},
        {"tokens": prompt(rt, 300, TEXT_C), "max_tokens": 25},
        {"tokens": prompt(rt, 90, TEXT_D + TEXT_A), "max_tokens": 30, "temperature": 0.8,
         "top_k": 40, "seed": 11},
    ]
    alone = [plain.complete(**job).tokens for job in jobs]
    # Observe (not replace) the real decode: distinct sequences per llama_decode call.
    batches: list[int] = []
    decode = rt.ctx.decode

    def recording_decode(tokens: Any, positions: Any, seq_ids: Any, logits: Any) -> None:
        batches.append(len(set(seq_ids)))
        decode(tokens, positions, seq_ids, logits)

    rt.ctx.decode = recording_decode  # type: ignore[method-assign]

    def run_all() -> list[Completion]:
        barrier = threading.Barrier(len(jobs))
        results: list[Any] = [None] * len(jobs)

        def worker(i: int) -> None:
            barrier.wait()
            try:
                results[i] = rt.complete(timeout=120, **jobs[i])
            except Exception as exc:  # reported below
                results[i] = exc

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        return results

    # All cold, prefills interleaved with decodes: no prompt shares a prefix with another
    # (a request may otherwise wait for another's cold save, see Resolver._lookup).
    cold = run_all()
    assert [c.tokens for c in cold] == alone
    assert {c.cache_hit_kind for c in cold} == {"cold"}
    flush(rt)
    warm = run_all()  # all restored at once (finish states hold the whole prompts)
    assert [c.tokens for c in warm] == alone
    assert {c.cache_hit_kind for c in warm} == {"exact"}
    # The premise: sequences did share llama_decode batches (observed, not forced).
    assert max(batches) >= 2


def test_sticky_busy(make_runtime: Callable[..., Runtime], tiny_model_no_eog: Path) -> None:
    rt = make_runtime(tiny_model_no_eog, n_ctx=2048)
    running = rt.complete(tokens=prompt(rt, 30), max_tokens=2000, session_id="s",
                          stream=True)
    assert isinstance(next(running), TokenEvent)  # type: ignore[call-overload]
    with pytest.raises(RequestError) as err:
        rt.complete(tokens=prompt(rt, 30), max_tokens=2, session_id="s")
    assert err.value.code == "sticky_busy"
    # Other sessions are unaffected; the busy one is free again once its request ends.
    assert rt.complete(tokens=prompt(rt, 20), max_tokens=2, session_id="t").tokens
    running.close()  # type: ignore[union-attr]  (cancels the request)
    again = rt.complete(tokens=prompt(rt, 30), max_tokens=2, session_id="s")
    assert again.cache_hit_kind == "sticky"
    assert rt.stats()["requests_failed"] == 1


def test_prompt_longer_than_context_is_refused_and_serving_goes_on(
        make_runtime: Callable[..., Runtime]) -> None:
    rt = make_runtime(cache=None)
    too_long = prompt(rt, rt.ctx.n_ctx + 10)
    with pytest.raises(RequestError) as err:
        rt.complete(tokens=too_long, max_tokens=4)
    assert err.value.code == "prompt_too_long"
    with pytest.raises(RequestError) as err:
        rt.complete(tokens=too_long[: rt.ctx.n_ctx])  # no room for a token
    assert err.value.code == "prompt_too_long"
    assert f"does not fit the context of {rt.ctx.n_ctx} tokens" in str(err.value)
    # The longest prompt that fits generates exactly one token (the context is full).
    edge = rt.complete(tokens=too_long[: rt.ctx.n_ctx - 1])
    assert edge.finish_reason in ("length", "stop") and len(edge.tokens) <= 1
    assert rt.complete(tokens=too_long[:50], max_tokens=4).finish_reason


def test_prompt_plus_max_tokens_must_fit_the_context(
        make_runtime: Callable[..., Runtime]) -> None:
    """OpenAI's rule, for a max_tokens given: a prompt plus max_tokens beyond the context is
    refused, not cut short (4,091 tokens and max_tokens 50 in 4,096 returned 5 tokens and
    "length"). Without one: 128 at most, fewer when the context fills first."""
    rt = make_runtime(cache=None)
    n_ctx = rt.ctx.n_ctx
    long = prompt(rt, n_ctx - 5)
    with pytest.raises(RequestError) as err:
        rt.complete(tokens=long, max_tokens=50)
    assert err.value.code == "prompt_too_long"
    assert str(err.value) == (f"a prompt of {n_ctx - 5} tokens and max_tokens 50 need "
                              f"{n_ctx + 45} tokens; the context holds {n_ctx} per sequence "
                              "(shorten the prompt or lower max_tokens)")
    with pytest.raises(RequestError):
        rt.complete(tokens=long, max_tokens=6)  # one too many
    exact = rt.complete(tokens=long, max_tokens=5, temperature=0)  # exactly the context
    unbounded = rt.complete(tokens=long, temperature=0)  # none given: until it is full
    assert exact.tokens == unbounded.tokens and 1 <= len(exact.tokens) <= 5
    with pytest.raises(RequestError) as err:
        rt.complete(tokens=long, max_tokens=5, until_context_full=True)
    assert err.value.code == "invalid_argument"
    assert rt.stats()["requests_completed"] == 2


@pytest.mark.parametrize("bad", [
    {"tokens": []},
    {"tokens": [1, 2, 10**6]},
    {"prompt": "a", "tokens": [1, 2]},
    {},
    {"messages": []},
])
def test_invalid_requests_are_refused(make_runtime: Callable[..., Runtime],
                                      bad: dict[str, Any]) -> None:
    rt = make_runtime(cache=None)
    with pytest.raises(RequestError) as err:
        rt.complete(max_tokens=2, **bad)
    assert err.value.code == "invalid_argument"


# --------------------------------------------------------------------------- SWA


def test_sliding_window_states_are_never_truncated(make_runtime: Callable[..., Runtime],
                                                   tiny_swa_model: Path) -> None:
    rt = make_runtime(tiny_swa_model)
    plain_swa = make_runtime(tiny_swa_model, cache=None, n_seq_max=1)
    assert not rt.ctx.can_truncate_restored()
    p = prompt(rt, 100)
    first = rt.complete(tokens=p, max_tokens=8)
    # (96: a checkpoint before the prompt's end, tests/runtime/test_seam_checkpoints.py)
    assert [(s["reason"], s["tokens"]) for s in first.saves] == [
        ("cold", 64), ("cold", 96), ("prompt", 100), ("finish", 107)]
    flush(rt)

    def check(tokens: list[int], expected: tuple[str, int], session: str = "") -> Completion:
        done = rt.complete(tokens=tokens, max_tokens=16, session_id=session)
        assert kinds(done) == expected
        assert done.tokens == plain_swa.complete(tokens=tokens, max_tokens=16).tokens
        flush(rt)
        return done

    # Exactly a saved entry, with the scores after it: served whole (nothing to cut).
    check(p[:64], ("exact", 64))
    check(p + first.tokens[:-1], ("exact", 107))  # the finish state, with its scores
    # Longer prompts extend a restored state without cutting it.
    grown = p + first.tokens + prompt(rt, 20, TEXT_B)[1:]
    restored = check(grown, ("partial", 107), session="s")
    # The session's live sequence is a restored SWA state: a prompt that diverges inside
    # it cannot be served by cutting it; it is resolved from the cache instead (the first
    # prompt's checkpoint at its end).
    check(grown[:100] + prompt(rt, 10, TEXT_C)[1:], ("partial", 100), session="s")
    # A prompt extending the live sequence is sticky (nothing cut).
    live = rt.engine.sessions[rt.config.tenant, "s"].tokens
    check(list(live) + [50, 51, 52], ("sticky", len(live)), session="s")
    assert restored.cache_tier in ("ram", "disk")
    stats = rt.stats()
    assert stats.get("restore_failed", 0) == 0


# --------------------------------------------------------------------------- sampling


def test_max_tokens_and_stop_strings(plain: Runtime) -> None:
    p = prompt(plain, 30)
    full = plain.complete(tokens=p, max_tokens=40)
    text = full.text
    five = plain.complete(tokens=p, max_tokens=5)
    assert five.finish_reason == "length" and five.tokens == full.tokens[:5]
    # A stop string taken from the middle of the greedy output ends the text before it.
    start = next(i for i in range(10, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    cut = text.index(stop)
    stopped = plain.complete(tokens=p, max_tokens=40, stop=[stop, "never-generated"])
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert stopped.tokens == full.tokens[: len(stopped.tokens)]


def test_seeded_sampling_is_reproducible(plain: Runtime) -> None:
    p = prompt(plain, 40, TEXT_B)
    kw = {"tokens": p, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95}
    one = plain.complete(seed=1234, **kw)
    two = plain.complete(seed=1234, **kw)
    other = plain.complete(seed=4321, **kw)
    greedy = plain.complete(tokens=p, max_tokens=24)
    assert one.tokens == two.tokens and one.text == two.text
    assert other.tokens != one.tokens
    assert one.tokens != greedy.tokens


@pytest.mark.parametrize("bad", [{"temperature": math.nan}, {"temperature": math.inf},
                                 {"temperature": 0.8, "top_k": 2.5},
                                 {"stop": [7]}])
def test_bad_sampling_settings_are_refused_and_other_requests_go_on(
        make_runtime: Callable[..., Runtime], tiny_model_no_eog: Path,
        bad: dict[str, Any]) -> None:
    rt = make_runtime(tiny_model_no_eog, cache=None, n_ctx=2048)
    running = rt.complete(tokens=prompt(rt, 30), max_tokens=400, stream=True)
    assert isinstance(next(running), TokenEvent)  # type: ignore[call-overload]
    with pytest.raises(ValueError):
        rt.complete(tokens=prompt(rt, 20, TEXT_B), max_tokens=4, **bad)
    done = list(running)[-1]  # type: ignore[call-overload]
    assert done.finish_reason == "length" and len(done.tokens) == 400
    stats = rt.stats()
    assert stats["internal_errors"] == 0 and stats["requests_failed"] == 0


def test_a_tiny_temperature_samples_the_greedy_tokens(plain: Runtime) -> None:
    p = prompt(plain, 40, TEXT_C)
    tiny = plain.complete(tokens=p, max_tokens=16, temperature=5e-324, seed=3)
    assert tiny.tokens == plain.complete(tokens=p, max_tokens=16).tokens


@pytest.mark.parametrize("stop", [(), ("zzz-never",)])
def test_streaming_events_end_with_the_completion(plain: Runtime, stop: tuple[str, ...]) -> None:
    p = prompt(plain, 30, TEXT_C)
    events = list(plain.complete(tokens=p, max_tokens=20, stream=True, stop=stop))
    *pieces, done = events
    assert isinstance(done, Completion)
    assert all(isinstance(e, TokenEvent) for e in pieces)
    assert [e.token for e in pieces if e.token >= 0] == done.tokens
    # Held-back text (a possible stop string) is flushed before the record.
    assert "".join(e.text for e in pieces) == done.text
    assert done.tokens == plain.complete(tokens=p, max_tokens=20, stop=stop).tokens


def test_abandoned_stream_cancels_the_request(make_runtime: Callable[..., Runtime],
                                              tiny_model_no_eog: Path) -> None:
    rt = make_runtime(tiny_model_no_eog, cache=None, n_ctx=2048)
    events = rt.complete(tokens=prompt(rt, 30), max_tokens=2000, stream=True)
    next(events)  # type: ignore[call-overload]
    events.close()  # type: ignore[union-attr]
    # The sequence is released: both sequences serve new requests.
    assert rt.complete(tokens=prompt(rt, 20), max_tokens=3).finish_reason == "length"
    assert rt.stats()["requests_completed"] >= 2


def test_sticky_truncation_then_finish_key_names_a_real_entry(
        make_runtime: Callable[..., Runtime], module_daemon: DaemonProcess) -> None:
    rt = make_runtime()
    p = prompt(rt, 100)
    rt.complete(tokens=p, max_tokens=8, session_id="s")  # live and saved: 107 tokens
    # Same session, diverging at 90 and as long again: the live sequence is cut to 90
    # and grows back to 107 tokens that are not the saved ones.
    second = rt.complete(tokens=p[:90] + prompt(rt, 11, TEXT_B)[1:], max_tokens=8,
                         session_id="s")
    assert kinds(second) == ("sticky", 90)
    assert [(s["reason"], s["tokens"]) for s in second.saves] == \
        [("prompt", 100), ("finish", 107)]
    flush(rt)
    with CacheClient(module_daemon.address, timeout=10) as c:
        blob = c.load(bytes.fromhex(second.finish_key))
    assert blob.meta.tokens == p[:90] + prompt(rt, 11, TEXT_B)[1:] + second.tokens[:-1]


def test_saver_survives_a_save_that_fails_unexpectedly(daemon: DaemonProcess) -> None:
    """A save that raises something other than a cache error (here, a token id that does
    not fit the wire format) is counted and logged; the sender thread goes on saving."""
    from collections import Counter

    from kvcache.client import Identity
    from model_runtime.saver import SaveJob, Saver

    counters: Counter[str] = Counter()
    ident = Identity("fp-saver", {"type_k": "f16"})
    with CacheClient(daemon.address) as client:
        saver = Saver(client, counters, threading.Lock())
        saver.submit(SaveJob(ident, ident.namespace, (1, 2, 1 << 40), b"x" * 100, "cold",
                             b"k" * 16))
        good = tuple(range(1, 40))
        saver.submit(SaveJob(ident, ident.namespace, good, b"y" * 100, "cold", b"g" * 16))
        assert saver.flush(30)
        saver.close()
        assert counters["saves_failed"] == 1 and counters["saves_cold"] == 1, counters
        assert client.lookup(ident, list(good)) is not None


def test_a_reader_that_fell_behind_takes_what_is_ready_in_one_batch(plain: Runtime) -> None:
    """Runtime.event_batches: read while the request runs, one event a batch at most
    (a reader keeping up); read after it ended, everything in one batch, in order: the
    same events either way (the service sends such a batch as one message)."""
    tokens = plain.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    ask = CompletionRequest.of(tokens=tokens, max_tokens=8)
    live = list(plain.event_batches(plain.submit(ask)))
    req = plain.submit(ask)
    while req.phase.value != "done":
        time.sleep(0.01)
    late = list(plain.event_batches(req))
    assert len(late) == 1 and len(late[0]) > 2
    flat = [e for batch in live for e in batch]

    def texts(events: list[Any]) -> list[str]:
        return [e.text for e in events if isinstance(e, TokenEvent)]

    assert texts(flat) == texts(late[0]) and isinstance(late[0][-1], Completion)


def test_a_final_record_the_event_channel_cannot_encode_fails_its_request_at_once(
        plain: Runtime) -> None:
    """A streamed request on the event channel has its events encoded by the model
    thread, its final record after the request was released: one that cannot be encoded
    (a bug, or generated messages older than the runtime) ends the request with an
    internal error, rather than leave its caller waiting for an end that never comes.
    The runtime goes on serving."""
    tokens = plain.tokenize("The quick brown fox jumps over the lazy dog.")
    ours, theirs = socket.socketpair()
    channel = EventChannel(ours)

    def encode(event: Any) -> list[bytes]:
        if isinstance(event, Completion):
            raise ValueError("Protocol message Timings has no field answer_wait_ms")
        return [b"event"]

    try:
        req = plain.submit(CompletionRequest.of(tokens=tokens, max_tokens=4),
                           events=ChannelEvents(channel, 7, encode))
        with pytest.raises(RequestError) as err:
            for _batch in plain.event_batches(req, timeout=30):
                pass
        assert err.value.code == "internal" and "answer_wait_ms" in str(err.value)
        assert plain.complete(tokens=tokens, max_tokens=2).finish_reason == "length"
    finally:
        channel.close()
        theirs.close()


def test_a_request_read_whole_gets_its_text_with_its_end_in_one_batch(plain: Runtime) -> None:
    """``whole`` (the gateway's requests without stream): read while it runs, the prompt's
    record, then one batch of every piece and the final record (one message, one
    wake-up); the same pieces and answer as when streamed. Cut short (cancelled), the
    text generated so far still comes, before its record."""
    tokens = plain.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    ask = dict(tokens=tokens, max_tokens=12, ignore_eos=True)
    streamed = [e for batch in plain.event_batches(plain.submit(CompletionRequest.of(**ask)))
                for e in batch]
    batches = list(plain.event_batches(plain.submit(CompletionRequest.of(**ask, whole=True))))
    # (the prompt's record comes in a batch of its own unless the reader came back only
    # after the answer was done: a fast model on a busy machine)
    assert not any(isinstance(e, TokenEvent) for batch in batches[:-1] for e in batch)
    assert len(batches) <= 2 and not isinstance(batches[0][0], TokenEvent), batches
    whole = [e for e in batches[-1] if not isinstance(e, PromptDone)]
    assert isinstance(whole[-1], Completion) and whole[-1].finish_reason == "length"
    assert [(e.token, e.text) for e in whole[:-1]] == [
        (e.token, e.text) for e in streamed if isinstance(e, TokenEvent)]
    assert whole[-1].text == streamed[-1].text and len(whole[-1].tokens) == 12

    for _attempt in range(3):  # (the tiny model may finish before a busy test cancels)
        req = plain.submit(CompletionRequest.of(tokens=tokens, max_tokens=900,
                                                ignore_eos=True, whole=True))
        wait_for(lambda r=req: len(r.generated) >= 3, "three tokens generated", timeout=60)
        plain.cancel(req)
        cut = [e for batch in plain.event_batches(req) for e in batch][1:]
        end = cut[-1]
        assert isinstance(end, Completion)
        if end.finish_reason == "cancelled":
            break
    assert isinstance(end, Completion) and end.finish_reason == "cancelled"
    assert "".join(e.text for e in cut[:-1] if isinstance(e, TokenEvent)) == end.text
    assert len(end.tokens) >= 3


def test_a_completion_not_streamed_is_read_whole(plain: Runtime,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtime.complete without ``stream`` asks for its answer whole (its caller would
    otherwise wake, and be waited for, once a token); streamed, it does not. The answer
    is the same."""
    asked: list[bool] = []
    submit = plain.engine.submit

    def recording(*args: Any, **kwargs: Any) -> Any:
        asked.append(isinstance(kwargs["events"], WholeAnswerEvents))
        return submit(*args, **kwargs)

    monkeypatch.setattr(plain.engine, "submit", recording)
    tokens = plain.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    done = plain.complete(tokens=tokens, max_tokens=6, ignore_eos=True)
    streamed = list(plain.complete(tokens=tokens, max_tokens=6, ignore_eos=True, stream=True))
    assert asked == [True, False]
    assert isinstance(done, Completion) and isinstance(streamed[-1], Completion)
    assert done.tokens == streamed[-1].tokens and done.text == streamed[-1].text


def test_a_step_waits_for_a_reader_that_keeps_up_to_send_its_token(
        make_runtime: Callable[..., Runtime]) -> None:
    """hand_off_ms: after a step, the model thread waits for each reader that was waiting
    for its token to come back for more (it has sent it) before the next step, so every
    token after the first was decoded after its reader came back from the one before; a
    reader slower than hand_off_ms is waited for that long, no more (counted)."""
    rt = make_runtime(cache=None, hand_off_ms=60_000.0)
    tokens: list[tuple[int, int]] = []  # (decoded, its reader came back) a token
    # (a prompt of five chunks: the reader waits before the first token comes)
    for batch in rt.event_batches(rt.submit(CompletionRequest.of(
            tokens=prompt(rt, 600), max_tokens=8, ignore_eos=True))):
        decoded = [e.decoded_ns for e in batch if isinstance(e, TokenEvent) and e.token >= 0]
        assert len(decoded) <= 1, batch  # kept up: one token a batch
        if decoded:
            time.sleep(0.02)  # sending it
        tokens += [(ns, time.monotonic_ns()) for ns in decoded]
    assert len(tokens) == 8 and rt.stats()["hand_offs_cut_short"] == 0
    assert all(tokens[i + 1][0] > tokens[i][1] for i in range(7)), tokens

    brief = make_runtime(cache=None, hand_off_ms=1.0)
    for batch in brief.event_batches(brief.submit(CompletionRequest.of(
            tokens=prompt(brief, 600), max_tokens=4, ignore_eos=True))):
        if any(isinstance(e, TokenEvent) for e in batch):
            time.sleep(0.05)
    assert brief.stats()["hand_offs_cut_short"] >= 1


def test_a_request_that_ends_holds_back_no_other_token_of_its_step(
        make_runtime: Callable[..., Runtime]) -> None:
    """A request's end (its finish save copies its state: milliseconds for a long one)
    comes after every other request's token of the same step is out, not before it."""
    rt = make_runtime(cache=None, n_seq_max=2)
    out_at_end: list[list[int]] = []  # when the short request ended: the long one's tokens

    def observe(done: Completion) -> None:
        if len(done.tokens) == 4:  # the short one
            out_at_end.append([e.decoded_ns for e in list(long.events.queue)
                               if isinstance(e, TokenEvent)])

    rt.engine.observers.append(observe)
    short = rt.submit(CompletionRequest.of(tokens=prompt(rt, 30), max_tokens=4,
                                           ignore_eos=True))
    long = rt.submit(CompletionRequest.of(tokens=prompt(rt, 30, TEXT_B), max_tokens=12,
                                          ignore_eos=True))
    wait_for(lambda: long.phase.value == "done", "both requests finished", timeout=120)
    last_step = [e.decoded_ns for e in list(short.events.queue)
                 if isinstance(e, TokenEvent) and e.token >= 0][-1]
    (tokens_out,) = out_at_end
    assert last_step in tokens_out  # the long request's token of that step was out


def test_a_reader_that_is_behind_is_not_waited_for(
        make_runtime: Callable[..., Runtime]) -> None:
    """A request nobody reads while it runs (its reader comes for the events at the end)
    is not waited for at all, however long hand_off_ms: it finishes on its own."""
    rt = make_runtime(cache=None, hand_off_ms=600_000.0)
    req = rt.submit(CompletionRequest.of(tokens=prompt(rt, 30), max_tokens=16,
                                         ignore_eos=True))
    wait_for(lambda: req.phase.value == "done", "the unread request finished", timeout=120)
    assert rt.stats()["hand_offs_cut_short"] == 0


@pytest.mark.parametrize(("resolve_wait_ms", "counted"),
                         [(30_000, "lookups_awaited"), (0, "lookups_after_batch")])
def test_a_new_request_s_cache_answer_is_waited_for_before_the_next_batch(
        make_runtime: Callable[..., Runtime], resolve_wait_ms: int, counted: str) -> None:
    """While a request decodes, a new one's cache lookup (on a resolver thread) is waited
    for, up to resolve_wait_ms, before the next batch: the new request starts in that
    batch rather than in the one after it (lookups_awaited), and the running request
    goes on. Not held for (0), the answer comes after the next batch has run
    (lookups_after_batch) and waits for it to end."""
    rt = make_runtime(resolve_wait_ms=resolve_wait_ms, n_seq_max=2)
    running = rt.complete(tokens=prompt(rt, 40), max_tokens=400, ignore_eos=True, stream=True)
    assert isinstance(next(iter(running)), TokenEvent)  # decoding now
    try:
        new = rt.complete(tokens=prompt(rt, 30, TEXT_B), max_tokens=2)
        assert new.finish_reason == "length" and new.cache_hit_kind == "cold"
        stats = rt.stats()
        assert stats[counted] == 1
        assert stats["lookups_awaited"] + stats["lookups_after_batch"] == 1
        if not resolve_wait_ms:
            assert new.timings["answer_wait_ms"] > 0
    finally:
        running.close()  # type: ignore[attr-defined]
