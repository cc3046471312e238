"""The workloads of tools/bench_whole_states.py: what each prompt shares with the one before
(the property the benchmark measures caches against), and the report's arithmetic."""

from __future__ import annotations

import argparse
from pathlib import Path

from whole_state_workloads import (
    OBSERVATION,
    SEAM_OBSERVATION,
    AgentLoop,
    SeamLoop,
    ThinkingChat,
    ratio,
    repeat_to_tokens,
    step_columns,
    think_reply,
)


def test_agent_loop_prompt_extends_the_previous_prompt_and_its_reply() -> None:
    loop = AgentLoop("System. ")
    first, head = loop.prompt()
    assert head == ""  # raw text: no system message to declare
    loop.advance("search(cats)", 0)
    second, _ = loop.prompt()
    assert second == first + "search(cats)" + OBSERVATION.format(n=1)


def test_seam_loop_prompts_end_in_a_space_the_reply_follows() -> None:
    loop = SeamLoop("System. ")
    first, head = loop.prompt()
    assert head == "" and first == "System. " + SEAM_OBSERVATION.format(n=0)
    assert first.endswith("Thought: ")
    loop.advance("search(cats)", 0)
    second, _ = loop.prompt()
    assert second == first + "search(cats)" + SEAM_OBSERVATION.format(n=1)
    assert second.endswith("Thought: ")


def test_thinking_chat_drops_the_reasoning_of_earlier_turns() -> None:
    chat = ThinkingChat("Be brief.", questions=["Q one?", "Q two?", "Q three?"])
    first, head = chat.prompt()
    assert first.startswith(head) and head.endswith("Be brief.<|im_end|>\n")
    assert first.endswith("<|im_start|>user\nQ one?<|im_end|>\n<|im_start|>assistant\n")
    reply = "cats sleep a lot; dogs need walks"
    chat.advance(reply, 0)
    second, second_head = chat.prompt()
    assert second_head == head
    # The next prompt extends the previous prompt ...
    assert second.startswith(first)
    # ... but not the previous prompt and the reply: the reasoning is gone, only the
    # answer (the reply's second half) is rendered.
    assert not second.startswith(first + reply)
    assert "<think>" not in second
    assert second[len(first):].startswith(reply[len(reply) // 2:].strip() + "<|im_end|>")
    assert second.endswith("Q two?<|im_end|>\n<|im_start|>assistant\n")


def test_think_reply_splits_reasoning_and_answer() -> None:
    assert think_reply("abcdef") == "<think>\nabc\n</think>\n\ndef"


def test_repeat_to_tokens_reaches_the_count() -> None:
    text = repeat_to_tokens("ab ", lambda t: len(t.split()), 5)
    assert text == "ab " * 5


def test_step_columns_and_ratio() -> None:
    rows = [{"prompt": 10, "read": 0, "prefilled": 10, "hit": "cold"},
            {"prompt": 14, "read": 10, "prefilled": 4, "hit": "partial"},
            {"prompt": 20, "read": 14, "prefilled": 6, "hit": "partial"}]
    doc = step_columns(rows)
    assert doc["prefilled"] == [10, 4, 6] and doc["hit"] == ["cold", "partial", "partial"]
    assert doc["prefilled_after_first_step"] == 10
    assert doc["mean_per_step_after_first"] == 5.0
    server_rows = [{"prompt": 10, "read": 0, "prefilled": 10}]
    assert "hit" not in step_columns(server_rows)
    assert step_columns(server_rows)["mean_per_step_after_first"] is None
    assert ratio(3, 4) == 0.75
    assert ratio(3, 0) is None and ratio(None, 4) is None


def test_llama_server_arm_that_cannot_start_is_reported(tmp_path: Path) -> None:
    from bench_whole_states import Sent, server_arm

    args = argparse.Namespace(threads=1, max_tokens=4)
    sent = [Sent("abc", [1, 2, 3], 0, "reply")]
    doc = server_arm(tmp_path / "no-llama-server", tmp_path / "model.gguf", sent,
                     Sent("abcd", [1, 2, 3, 4], 0, ""), args, tmp_path / "server.log")
    assert "llama-server binary not found" in doc["error"]
    assert "in_process" not in doc  # no figures made up for an arm that did not run
