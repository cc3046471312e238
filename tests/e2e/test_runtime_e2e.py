"""End to end with the real SmolLM2-135M-Instruct and a real daemon (slow: ``-m slow``).

The headline use: a long system prompt shared by requests is prefilled once; a later
request with another user message restores it (also in a new runtime process) and
generates exactly what a cold prefill would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from harness.system_prompt import USER_MESSAGES, build_system_prompt

from model_runtime.config import RuntimeConfig
from model_runtime.runtime import Runtime, default_model_path
from tests.support.daemon_proc import DaemonProcess

pytestmark = pytest.mark.slow

# Defaults for the save points (block 256, trim 32): the system message's end is the
# explicit cold boundary of every chat request.
CONFIG = RuntimeConfig(n_ctx=1024, n_seq_max=2, n_threads=1, continued_interval=0)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    # tools/setup.sh installs the model: its absence is a failure, not a skip.
    return default_model_path()


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_shared_system_prompt_is_prefilled_once(daemon_factory: Callable[..., DaemonProcess],
                                                smollm2: Path) -> None:
    daemon = daemon_factory()
    system = build_system_prompt(250)  # ~570 SmolLM2 tokens
    with Runtime(smollm2, cache_address=daemon.address, config=CONFIG) as rt:
        tokens, boundary = rt.render_chat(chat(system, USER_MESSAGES[0]))
        assert 500 <= boundary < len(tokens)

        first = rt.complete(messages=chat(system, USER_MESSAGES[0]), max_tokens=16)
        assert first.cache_hit_kind == "cold"
        assert first.saves[0]["reason"] == "cold" and first.saves[0]["tokens"] == boundary
        assert rt.engine.saver.flush(60)

        # The first request's sequence still holds the system prompt: reused in place.
        second = rt.complete(messages=chat(system, USER_MESSAGES[1]), max_tokens=24)
        assert (second.cache_hit_kind, second.cache_tier) == ("partial", "live")
        assert second.cache_delta["tokens_read"] >= boundary
        assert rt.engine.saver.flush(60)

    # A new runtime (as after a restart) restores the system prompt, and the opening
    # tokens of the user turn that the earlier requests' finish states hold too.
    with Runtime(smollm2, cache_address=daemon.address, config=CONFIG) as again:
        third = again.complete(messages=chat(system, USER_MESSAGES[2]), max_tokens=8)
        assert (third.cache_hit_kind, third.cache_tier) in (("partial", "ram"),
                                                            ("partial", "disk"))
        assert boundary <= third.cache_delta["tokens_read"] < third.prompt_tokens

    # Greedy output after live reuse and after a warm restore equals a cold prefill.
    with Runtime(smollm2, cache_address=None, config=replace(CONFIG, reuse_live=False)) as plain:
        cold = plain.complete(messages=chat(system, USER_MESSAGES[1]), max_tokens=24)
        cold_third = plain.complete(messages=chat(system, USER_MESSAGES[2]), max_tokens=8)
    assert (cold.cache_hit_kind, cold_third.cache_hit_kind) == ("cold", "cold")
    assert second.tokens == cold.tokens
    assert second.text == cold.text
    assert third.tokens == cold_third.tokens
