"""An agent loop over a raw completion endpoint, on models whose states cannot be cut
(sliding-window, hybrid, recurrent): each prompt is the previous prompt's text, the reply's
and a tool result, tokenized again. Where the reply's first characters merge with the
previous prompt's last token (a prompt ending in a space, the reply starting with a
word), the state at the previous prompt's end is no prefix of the next prompt; the
checkpoint taken ``checkpoint_before_end`` (4) tokens before that end is, as llama.cpp's
server keeps one 4 tokens before a prompt's end. Every warm answer is compared with a cold
run's, as in test_whole_states.py.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache.client import CacheClient
from model_runtime.request import Completion, common_prefix
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess
from tests.support.runtime_calls import flush
from tests.support.tiny_llama import saves_held
from tests.support.warm_cold import BLOCKS, WORDS, agree, ask, bitwise, kind

KINDS = ("swa", "hybrid", "recurrent")
BEFORE_END = 4  # RuntimeConfig.checkpoint_before_end's default
DAEMON_ARGS = BLOCKS  # each test's daemon's
# Ends with a space: a reply starting with a word takes it into its first token ("▁the").
TOOL_RESULT = "\nObservation: the tool returned {n} results.\nThought: "


@pytest.fixture(params=KINDS)
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_model")


def loop_text(seed: int) -> str:
    """A system text and a first tool result, ending where the model replies."""
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=60)) + TOOL_RESULT.format(n=1)


def next_text(text: str, reply: str, step: int) -> str:
    return text + reply + TOOL_RESULT.format(n=step + 1)


def reply_starting_with_a_word(done: Completion) -> str:
    """The tiny models' replies are random bytes: the reply an agent's model would write,
    starting with a word (so that it merges with the prompt's trailing space)."""
    return "the cat sat on the mat" + done.text.replace("\n", " ")


def checkpoint_scores(cache: CacheClient, key_hex: str) -> bytes:
    return cache.load(bytes.fromhex(key_hex)).meta.logits


def test_a_next_prompt_that_tokenizes_the_previous_end_otherwise_resumes_before_it(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    writer = runtimes(model, daemon.address)
    reader = runtimes(model, daemon.address)  # no live sequence: the daemon serves
    cold = runtimes(model, None, n_seq_max=1)
    text = loop_text(seed=1)
    first_prompt = writer.tokenize(text)
    first = ask(writer, first_prompt)
    saves = [(s["reason"], s["tokens"]) for s in first.saves]
    end = len(first_prompt)
    assert saves[-3:] == [("cold", end - BEFORE_END), ("prompt", end),
                          ("finish", end + len(first.tokens) - 1)]
    flush(writer)
    turn = writer.tokenize(next_text(text, reply_starting_with_a_word(first), 1))
    # The seam re-tokenizes: the prompt's last token (a space) is the reply's first now.
    assert common_prefix(first_prompt, turn) == end - 1
    warm = ask(reader, turn)
    assert kind(warm) == ("partial", end - BEFORE_END)
    assert warm.cache_tier in ("ram", "disk")
    agree(warm, ask(cold, turn), "after a re-tokenized seam", bitwise=bitwise(cold))
    # Taken for the prefill's sake, it keeps no scores (a prompt's own checkpoint does:
    # Gemma 3's are 1 MB).
    with daemon.client() as cache:
        by_reason = {s["reason"]: s["key"] for s in first.saves}
        assert checkpoint_scores(cache, by_reason["cold"]) == b""
        assert checkpoint_scores(cache, by_reason["prompt"]) != b""


def test_an_agent_loop_of_re_tokenized_replies_resumes_every_step_at_its_seam(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    """One runtime, one conversation, as an agent drives it: a hybrid or recurrent
    sequence cannot be cut back to the seam, so the checkpoint before it serves; a
    sliding-window one never restored is cut there in place."""
    rt = runtimes(model, daemon.address, reuse_live=True, n_seq_max=1)
    cold = runtimes(model, None, n_seq_max=1)
    text = loop_text(seed=2)
    previous: list[int] = []
    for step in range(4):
        prompt = rt.tokenize(text)
        warm = ask(rt, prompt)
        flush(rt)  # (the time a tool call takes)
        if previous:
            assert common_prefix(previous, prompt) == len(previous) - 1
            live = warm.cache_tier == "live"
            assert live == (not rt.engine.model.is_recurrent)
            assert warm.cache_delta["tokens_read"] == len(previous) - (1 if live else
                                                                       BEFORE_END)
        agree(warm, ask(cold, prompt), ("step", step), bitwise=bitwise(cold))
        previous = prompt
        text = next_text(text, reply_starting_with_a_word(warm), step + 1)


def test_a_checkpoint_before_the_end_leaves_the_backlog_room_for_the_prompt_s_own_saves(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    """With room for two saves only (the prompt's end, then its finish), the checkpoint
    before the end is dropped, before any copy of the state, and counted. (No aligned cold
    boundary before it: that save would take one of the two places.)"""
    rt = runtimes(model, daemon.address, max_pending_saves=2, save_block=4096)
    prompt = rt.tokenize(loop_text(seed=3))
    done = ask(rt, prompt)
    saves = [(s["reason"], s["tokens"]) for s in done.saves]
    assert ("cold", len(prompt) - BEFORE_END) not in saves
    assert saves[-2:] == [("prompt", len(prompt)), ("finish", len(prompt) + len(done.tokens) - 1)]
    stats = rt.stats()
    assert stats["saves_dropped_backlog"] == 1 == stats["saves_dropped"]


def open_once_waited(rt: Runtime, gate: threading.Event, done: threading.Event) -> None:
    """Let the held saves go once the runtime waits for them (or the request is done
    without waiting), so that they are still queued when it looks them up."""
    while not done.is_set() and rt.stats()["lookups_waited_own_save"] == 0:
        done.wait(0.005)
    gate.set()


def test_a_turn_sent_at_once_waits_for_the_checkpoints_its_previous_turn_still_has_queued(
        model: Path, daemon: DaemonProcess, runtimes: Callable[..., Runtime]) -> None:
    """No time between the turns (a tool that answers at once): the previous turn's
    checkpoints are still queued in this runtime when the next turn is resolved. A turn
    adds fewer than ``min_save_tokens`` tokens, which for a plain model are cheaper to
    prefill than to wait for; for a state that cannot be cut the alternative is the
    checkpoint a turn older, so the wait is taken. A sliding-window sequence never
    restored is cut in place instead (nothing to wait for)."""
    rt = runtimes(model, daemon.address, reuse_live=True, n_seq_max=1, min_save_tokens=64,
                  session_resume_wait_ms=10_000)
    cold = runtimes(model, None, n_seq_max=1)
    text = loop_text(seed=4)
    first_prompt = rt.tokenize(text)
    first = ask(rt, first_prompt)
    flush(rt)
    text = next_text(text, reply_starting_with_a_word(first), 1)
    second_prompt = rt.tokenize(text)
    with saves_held(rt.engine.saver) as gate:
        second = ask(rt, second_prompt)  # its saves stay queued
        text = next_text(text, reply_starting_with_a_word(second), 2)
        third_prompt = rt.tokenize(text)
        assert len(third_prompt) - len(second_prompt) < 64
        done = threading.Event()
        opener = threading.Thread(target=open_once_waited, args=(rt, gate, done))
        opener.start()
        try:
            third = ask(rt, third_prompt)
        finally:
            done.set()
            opener.join()
    assert common_prefix(second_prompt, third_prompt) == len(second_prompt) - 1
    if rt.engine.model.is_recurrent:
        assert kind(third) == ("partial", len(second_prompt) - BEFORE_END)
        assert rt.stats()["lookups_waited_own_save"] >= 1
    else:
        assert (kind(third), third.cache_tier) == (("partial", len(second_prompt) - 1), "live")
    agree(third, ask(cold, third_prompt), "a turn sent at once", bitwise=bitwise(cold))
