"""``continue_parent``: a prompt that renders a conversation again after a reply is
continued from the reply's saved state with the state's own tokens (the model's output
is never tokenized again), so its reuse covers the whole state; a prompt that does not
begin with the state's text, or a state the cache does not have, is tokenized as usual.
Real daemon, real llama.cpp (the tiny model, one thread)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache.client import CacheClient
from model_runtime.completion_request import CompletionRequest
from model_runtime.config import RuntimeConfig
from model_runtime.request import RequestError
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess

CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, prefill_chunk=128,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       reuse_live=True, tenant="house")
PROMPT = ("<|im_start|>system\nYou answer in one line.<|im_end|>\n<|im_start|>user\nWhere is "
          "the parcel?<|im_end|>\n<|im_start|>assistant\n")
TURN = "<|im_end|>\n<|im_start|>user\nAnd the next one?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def runtime(module_daemon: DaemonProcess, tiny_model: Path) -> Iterator[Runtime]:
    rt = Runtime(tiny_model, cache_address=module_daemon.address, config=CONFIG)
    yield rt
    rt.close()


def state_of(runtime: Runtime, daemon: DaemonProcess, key: str) -> list[int]:
    """The saved state's tokens, once its save (sent in the background) is published."""
    event = runtime.engine.saver.in_flight(bytes.fromhex(key))
    if event is not None:
        assert event.wait(10)
    with CacheClient(daemon.address) as cache:
        return list(cache.inspect(bytes.fromhex(key), tenant="house").tokens)


def test_the_state_is_continued_with_its_own_tokens(runtime: Runtime,
                                                    module_daemon: DaemonProcess) -> None:
    first = runtime.complete(prompt=PROMPT, max_tokens=12, temperature=0)
    state = state_of(runtime, module_daemon, first.finish_key)
    assert state[-1] == first.tokens[-2]  # the last token sampled was not decoded
    again = runtime.submit(CompletionRequest.of(
        prompt=PROMPT + first.text + TURN, parent_key=first.finish_key, continue_parent=True,
        max_tokens=4, temperature=0))
    assert again.tokens[:len(state)] == state
    done = next(e for e in runtime.events(again) if hasattr(e, "finish_key"))
    assert done.cache_delta["tokens_read"] == len(state)
    # Tokenized whole, the same text need not give the model's tokens (the tiny model's
    # random weights pick splits the tokenizer would not), but it keeps the text.
    whole = runtime.tokenize(PROMPT + first.text + TURN)
    assert runtime.model.detokenize(whole, render_special=True) == \
        runtime.model.detokenize(again.tokens, render_special=True)


def test_a_prompt_that_does_not_continue_the_state_is_tokenized_as_usual(
        runtime: Runtime) -> None:
    first = runtime.complete(prompt=PROMPT, max_tokens=6, temperature=0)
    other = PROMPT.replace("parcel", "letter") + TURN
    req = runtime.submit(CompletionRequest.of(
        prompt=other, parent_key=first.finish_key, continue_parent=True, max_tokens=2,
        temperature=0))
    assert req.tokens == runtime.tokenize(other)
    runtime.cancel(req)


def test_a_state_the_cache_does_not_have_is_no_error(runtime: Runtime) -> None:
    req = runtime.submit(CompletionRequest.of(
        prompt=PROMPT + "Hi" + TURN, parent_key="ab" * 16, continue_parent=True, max_tokens=2,
        temperature=0))
    assert req.tokens == runtime.tokenize(PROMPT + "Hi" + TURN)
    runtime.cancel(req)


def test_another_tenants_state_is_not_read(runtime: Runtime) -> None:
    first = runtime.complete(prompt=PROMPT, max_tokens=6, temperature=0, tenant="alice")
    prompt = PROMPT + first.text + TURN
    req = runtime.submit(CompletionRequest.of(
        prompt=prompt, parent_key=first.finish_key, continue_parent=True, max_tokens=2,
        temperature=0, tenant="bob"))
    assert req.tokens == runtime.tokenize(prompt)
    runtime.cancel(req)


def test_continue_parent_needs_a_parent_and_a_prompt(runtime: Runtime) -> None:
    with pytest.raises(RequestError, match="continue_parent"):
        runtime.submit(CompletionRequest.of(prompt=PROMPT, continue_parent=True, max_tokens=2))
    with pytest.raises(RequestError, match="continue_parent"):
        runtime.submit(CompletionRequest.of(tokens=[1, 2, 3], parent_key="ab" * 16,
                                            continue_parent=True, max_tokens=2))
