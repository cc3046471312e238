"""Requests of n choices: the prompt is computed (or restored, or reused in place) once
and copied to n - 1 more sequences, each choice with its own sampler chain and seed.

With the tiny model on one thread: greedy choices each equal a cold single request (warm
equals cold for them is in tests/runtime/test_determinism.py), seeded choice i is a single
request with seed + i and repeats, every choice follows its grammar and streams its own
tagged events, the prompt counts once, n sequences are held at once (more than the
runtime has is refused; fewer free: it waits, and later requests wait behind it), a
cancel ends every choice, and the saves: the prompt's once, each choice's finish its own.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from model_runtime.completion_request import CompletionRequest
from model_runtime.config import RuntimeConfig, SettingError
from model_runtime.llama_backend import SamplerChain
from model_runtime.request import Completion, RequestError, TokenEvent
from model_runtime.runtime import Runtime
from model_runtime.sampling import SamplingParams
from tests.support.daemon_proc import DaemonProcess
from tests.support.runtime_calls import flush
from tests.support.tiny_llama import sample_prompt
from tests.support.warm_cold import outcome

CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=3, n_threads=1, prefill_chunk=64,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0)
TEXT = "the cat and the dog sat on the mat with a hat, in the end it is what it is. "
SAMPLED = {"temperature": 1.0, "top_k": 40}


@pytest.fixture
def make(request: pytest.FixtureRequest,
         tiny_model: Path) -> Iterator[Callable[..., Runtime]]:
    """``make(model=..., cache=address|None, **config overrides)``; the test's name is
    its tenant."""
    made: list[Runtime] = []

    def runtime(model: Path | None = None, cache: str | None = None,
                **overrides: Any) -> Runtime:
        overrides.setdefault("tenant", request.node.name)
        made.append(Runtime(model or tiny_model, cache_address=cache,
                            config=replace(CONFIG, **overrides)))
        return made[-1]

    yield runtime
    for rt in reversed(made):
        rt.close()


def prompt(rt: Runtime, n: int) -> list[int]:
    return sample_prompt(rt.tokenize, n, TEXT)


def choices(rt: Runtime, **kwargs: Any) -> list[Completion]:
    done = rt.complete(**kwargs)
    assert isinstance(done, list), "n > 1 gives a list of Completions"
    assert [c.choice for c in done] == list(range(kwargs["n"]))
    return done


def idle(rt: Runtime) -> bool:
    """No request runs, waits or holds a sequence (asked on the model thread)."""
    sched = rt.engine.scheduler
    return rt.engine.call(lambda: not (sched.running or sched.waiting or sched.busy()))


def test_greedy_choices_each_equal_a_cold_single_request(
        make: Callable[..., Runtime]) -> None:
    cold = make(n_seq_max=1, reuse_live=False)
    rt = make()
    p = prompt(rt, 90)
    reference = cold.complete(tokens=p, max_tokens=10, logprobs=True, top_logprobs=3)
    assert isinstance(reference, Completion)
    before = rt.stats()
    three = choices(rt, tokens=p, max_tokens=10, n=3, logprobs=True, top_logprobs=3)
    after = rt.stats()
    for c in three:
        assert outcome(c) == outcome(reference)
        assert (c.prompt_tokens, c.cache_hit_kind) == (len(p), "cold")
    # The prompt was computed once: one request, one cold prefill, one hit counted.
    for name in ("requests_completed", "cold_prefills", "hits_cold"):
        assert after[name] - before[name] == 1, name
    assert idle(rt)


def test_seeded_choices_are_each_their_seed_and_repeat(make: Callable[..., Runtime]) -> None:
    rt = make()
    p = prompt(rt, 60)
    asked = {"tokens": p, "max_tokens": 12, "seed": 7, **SAMPLED}
    three = choices(rt, n=3, **asked)
    assert len({tuple(c.tokens) for c in three}) == 3, "each choice draws with its own seed"
    assert [c.tokens for c in choices(rt, n=3, **asked)] == [c.tokens for c in three]
    for c in three:
        single = rt.complete(**{**asked, "seed": 7 + c.choice})
        assert isinstance(single, Completion) and single.tokens == c.tokens, c.choice


def test_more_choices_than_sequences_and_bad_n_are_refused(
        make: Callable[..., Runtime]) -> None:
    rt = make()
    p = prompt(rt, 20)
    with pytest.raises(RequestError, match=r"n 4 needs 4 sequences.*has 3 \(n_seq_max\)") \
            as err:
        rt.complete(tokens=p, max_tokens=2, n=4)
    assert err.value.code == "invalid_argument"
    with pytest.raises(RequestError, match="session_id"):
        rt.complete(tokens=p, max_tokens=2, n=2, session_id="s")
    with pytest.raises(SettingError, match="n"):
        rt.complete(tokens=p, max_tokens=2, n=0)
    assert len(choices(rt, tokens=p, max_tokens=2, n=3)) == 3
    assert idle(rt)


def test_a_request_of_n_waits_for_n_free_sequences_and_later_ones_wait_behind_it(
        make: Callable[..., Runtime], tiny_model_no_eog: Path) -> None:
    rt = make(tiny_model_no_eog)
    p = prompt(rt, 30)
    running = rt.complete(tokens=p, max_tokens=900, stream=True)
    next(running)  # type: ignore[call-overload]  # one sequence busy, two free
    waits = rt.stats()["admission_waits"]
    three = rt.complete(tokens=p, max_tokens=4, n=3, stream=True)
    later = rt.complete(tokens=p, max_tokens=4, stream=True)  # a free sequence, yet it waits
    sched = rt.engine.scheduler
    assert rt.engine.call(lambda: (len(sched.waiting), sched.busy())) == (2, 1)
    assert rt.stats()["admission_waits"] - waits == 2
    running.close()  # type: ignore[union-attr]  # cancelled: its sequence frees the three
    done = [e for e in three if isinstance(e, Completion)]  # type: ignore[union-attr]
    assert sorted(c.choice for c in done) == [0, 1, 2]
    assert all(len(c.tokens) == 4 for c in done)
    assert [e for e in later if isinstance(e, Completion)][0].tokens == done[0].tokens  # type: ignore[union-attr]
    assert idle(rt)


def test_a_cancel_ends_every_choice(make: Callable[..., Runtime],
                                    tiny_model_no_eog: Path) -> None:
    rt = make(tiny_model_no_eog, reuse_live=False)  # (a prompt is computed each time)
    p = prompt(rt, 40)
    chains = SamplerChain.live
    stream = rt.complete(tokens=p, max_tokens=900, n=3, seed=1, stream=True, **SAMPLED)
    seen: set[int] = set()
    for event in stream:  # type: ignore[union-attr]
        assert isinstance(event, TokenEvent)
        seen.add(event.choice)
        if seen == {0, 1, 2}:
            break
    stream.close()  # type: ignore[union-attr]
    assert idle(rt) and SamplerChain.live == chains
    # Cancelled before its prompt was done (in one model-thread step: submitted, then
    # cancelled before the first tick): a record per choice, and the held sequences free.
    def submit_and_cancel() -> Any:
        req = rt.engine.submit(p, SamplingParams(max_tokens=5), n=3)
        rt.engine.cancel(req)
        return req

    req = rt.engine.call(submit_and_cancel)
    records = [req.events.get(timeout=30) for _ in range(3)]
    assert sorted(r.choice for r in records) == [0, 1, 2]
    assert {(r.finish_reason, len(r.tokens)) for r in records} == {("cancelled", 0)}
    assert idle(rt) and SamplerChain.live == chains
    assert len(choices(rt, tokens=p, max_tokens=3, n=3)) == 3


def test_every_choice_follows_its_grammar(make: Callable[..., Runtime]) -> None:
    rt = make()
    p = prompt(rt, 30)
    words = choices(rt, tokens=p, max_tokens=8, n=3, seed=4, **SAMPLED,
                    grammar='root ::= ("yes" | "no" | "maybe") "."')
    assert all(c.text in ("yes.", "no.", "maybe.") for c in words), [c.text for c in words]
    # (A schema that bounds the object: random weights write strings of any length.)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    objects = choices(rt, tokens=p, max_tokens=60, n=3, seed=5, **SAMPLED, json_schema=schema)
    for c in objects:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text)["ok"], bool), c.text


def test_choices_stream_their_own_tagged_events_and_logprobs(
        make: Callable[..., Runtime]) -> None:
    rt = make()
    p = prompt(rt, 30)
    events = list(rt.complete(tokens=p, max_tokens=10, n=2, seed=9, logprobs=True,
                              top_logprobs=2, stream=True, stop=["e"], **SAMPLED))  # type: ignore[arg-type]
    done = {e.choice: e for e in events if isinstance(e, Completion)}
    assert sorted(done) == [0, 1]
    for i, c in done.items():
        mine = [e for e in events if isinstance(e, TokenEvent) and e.choice == i]
        assert "".join(e.text for e in mine) == c.text
        assert [e.logprob.token for e in mine if e.logprob] == c.tokens
        assert [lp.token for lp in c.logprobs] == c.tokens


def test_the_prompt_is_saved_once_and_each_choice_s_finish_is_its_own(
        make: Callable[..., Runtime], tiny_model_no_eog: Path,
        tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "data").start()
    try:
        rt = make(tiny_model_no_eog, d.address, reuse_live=False)
        p = prompt(rt, 100)
        three = choices(rt, tokens=p, max_tokens=6, n=3, seed=2, **SAMPLED)
        flush(rt)
        stats = rt.stats()
        assert (stats["saves_queued_cold"], stats["saves_queued_prompt"],
                stats["saves_queued_finish"]) == (1, 1, 3)
        keys = [c.finish_key for c in three]
        assert all(keys) and len(set(keys)) == 3
        assert sum(s["reason"] == "prompt" for c in three for s in c.saves) == 1
        # Each choice's next turn is restored from that choice's own finish state.
        for c in three:
            turn = p + c.tokens[:-1] + prompt(rt, 8)[1:]
            again = rt.complete(tokens=turn, max_tokens=2)
            assert isinstance(again, Completion)
            assert again.cache_hit_kind == "partial"
            assert again.cache_delta["tokens_read"] >= len(p) + len(c.tokens) - 1, c.choice
        rt.close()
    finally:
        d.close()


def test_choices_that_end_at_their_first_token_and_the_sequences_they_leave(
        make: Callable[..., Runtime], tiny_model_no_eog: Path, tmp_path: Path) -> None:
    """Their state is the prompt's, copied to the other sequence by the next decode: it
    can be neither saved nor replaced by a restore before that decode. The next request
    on those sequences computes its prompt instead of restoring, and gets it right."""
    d = DaemonProcess(tmp_path / "data").start()
    try:
        rt = make(tiny_model_no_eog, d.address, n_seq_max=2, reuse_live=False)
        cold = make(tiny_model_no_eog, n_seq_max=1, reuse_live=False)
        p = prompt(rt, 45)
        reference = cold.complete(tokens=p, max_tokens=5)
        assert isinstance(reference, Completion)
        ones = choices(rt, tokens=p, max_tokens=1, n=2)
        assert [c.tokens for c in ones] == [reference.tokens[:1]] * 2
        assert [c.finish_key for c in ones] == ["", ""]
        assert rt.stats()["saves_skipped_copy_pending"] == 2
        flush(rt)  # (the prompt's cold save, at 32 tokens, is in the daemon)
        again = rt.complete(tokens=p, max_tokens=5)
        assert isinstance(again, Completion)
        assert rt.stats()["restores_skipped_copy_pending"] == 1
        assert (again.cache_hit_kind, again.tokens) == ("cold", reference.tokens)
        # The state found was kept: the next request restores it.
        flush(rt)
        last = rt.complete(tokens=p + [again.tokens[0]], max_tokens=4)
        assert isinstance(last, Completion) and last.cache_hit_kind != "cold"
        assert rt.stats()["rejected_states_deleted"] == 0
        rt.close()
    finally:
        d.close()


def test_a_request_of_n_ends_with_one_record_per_choice(make: Callable[..., Runtime]) -> None:
    # (No event is left behind in the queue once the last Completion was read.)
    rt = make()
    p = prompt(rt, 20)
    req = rt.submit(CompletionRequest.of(tokens=p, max_tokens=3, n=3))
    ends = 0
    while ends < 3:
        if isinstance(req.events.get(timeout=30), Completion):
            ends += 1
    with pytest.raises(queue.Empty):
        req.events.get(timeout=0.2)


def test_a_restored_sliding_window_prompt_copied_gives_the_cold_reply(
        make: Callable[..., Runtime], tiny_swa_model: Path, tmp_path: Path) -> None:
    # A restored sliding-window state holds only its last window of positions: copied
    # whole (never cut), each choice decodes past the window as a cold run does.
    d = DaemonProcess(tmp_path / "data").start()
    try:
        rt = make(tiny_swa_model, d.address, reuse_live=False)
        cold = make(tiny_swa_model, n_seq_max=1, reuse_live=False)
        p = prompt(rt, 80)
        reference = cold.complete(tokens=p, max_tokens=40)
        assert isinstance(reference, Completion)
        rt.complete(tokens=p, max_tokens=2)
        flush(rt)
        three = choices(rt, tokens=p, max_tokens=40, n=3)
        # The prompt's own state, stored with its end's scores: served whole, never cut.
        assert {c.cache_hit_kind for c in three} == {"exact"}
        assert three[0].cache_tier == "ram" and three[0].cache_delta["tokens_read"] >= 32
        assert all(c.tokens == reference.tokens for c in three)
        rt.close()
    finally:
        d.close()
