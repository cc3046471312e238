"""vLLM's and SGLang's request fields, which vllm-router and sglang-router add to every body
they pass on, applied as those servers apply them: ``ignore_eos``,
``skip_special_tokens``, ``no_stop_trim``, ``continue_final_message``,
``separate_reasoning`` and ``stream_reasoning`` (the tiny generated models, real workers,
one thread)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway_proc import GatewayProcess, Gateways, model_entry

N_CTX = 512
IM_END = 4  # the tiny models' <|im_end|>: a control token, end of generation
END_OF_TURN = {str(IM_END): 100}  # the model's every token is then its end of turn


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_hermes_model: Path, tiny_think_model: Path) -> GatewayProcess:
    args = ("--n-ctx", str(N_CTX), "--n-seq-max", "2")
    return gateways.start("router-fields", models=[
        model_entry("hermes", tiny_hermes_model, *args),
        model_entry("think", tiny_think_model, *args)])


def ask(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": user}]


def post(gw: GatewayProcess, body: dict[str, Any],
         path: str = "/v1/chat/completions") -> tuple[int, dict[str, Any]]:
    status, _, raw = gw.http("POST", path, json.dumps(body).encode())
    return status, json.loads(raw)


def streamed(gw: GatewayProcess, **kwargs: Any) -> tuple[str, str | None]:
    """The content and finish_reason of a streamed chat answer."""
    content, finish = "", None
    for chunk in gw.client().chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return content, finish


def test_ignore_eos_goes_on_past_the_end_of_turn(gw: GatewayProcess) -> None:
    client = gw.client()
    base: dict[str, Any] = {"model": "hermes", "messages": ask("Hello?"), "max_tokens": 5,
                            "temperature": 0}
    ended = client.chat.completions.create(**base, logit_bias=END_OF_TURN)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 0
    # ignore_eos: the end of turn does not end the text; it goes on to max_tokens. The
    # end-of-turn tokens are control tokens, skipped in the text (skip_special_tokens).
    going = client.chat.completions.create(**base, logit_bias=END_OF_TURN,
                                           extra_body={"ignore_eos": True})
    assert going.choices[0].finish_reason == "length"
    assert going.usage.completion_tokens == 5 and going.choices[0].message.content == ""
    # Without max_tokens it goes on until the context is full, as vLLM does.
    full = client.chat.completions.create(**{**base, "max_tokens": None},
                                          logit_bias=END_OF_TURN,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.total_tokens >= N_CTX - 1
    # A stop string still ends it.
    free = client.chat.completions.create(**base, max_completion_tokens=40,
                                          extra_body={"ignore_eos": True})
    text = free.choices[0].message.content
    assert text and free.choices[0].finish_reason == "length", free
    stopped = client.chat.completions.create(**base, max_completion_tokens=40,
                                             stop=[text[len(text) // 2:][:3]],
                                             extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert len(stopped.choices[0].message.content) < len(text)


def test_skip_special_tokens_false_shows_control_tokens(gw: GatewayProcess) -> None:
    base: dict[str, Any] = {"model": "hermes", "messages": ask("Hello?"), "max_tokens": 3,
                            "temperature": 0, "logit_bias": END_OF_TURN}
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    reply = gw.client().chat.completions.create(**base, extra_body=extra)
    assert reply.choices[0].message.content == "<|im_end|>" * 3
    assert streamed(gw, **base, extra_body=extra) == ("<|im_end|>" * 3, "length")
    text = gw.client().completions.create(model="hermes", prompt="Hello", max_tokens=2,
                                          temperature=0, logit_bias=END_OF_TURN,
                                          extra_body=extra)
    assert text.choices[0].text == "<|im_end|>" * 2
    # The text the model wrote otherwise is the same (no control token among it).
    plain = {"model": "hermes", "messages": ask("Hi"), "max_tokens": 12, "temperature": 0}
    shown = gw.client().chat.completions.create(**plain,
                                                extra_body={"skip_special_tokens": False})
    skipped = gw.client().chat.completions.create(**plain)
    assert "<|im_end|>" not in (skipped.choices[0].message.content or "")
    assert (shown.choices[0].message.content or "").replace("<|im_end|>", "") == \
        skipped.choices[0].message.content


def test_no_stop_trim_keeps_the_stop_string(gw: GatewayProcess) -> None:
    client = gw.client()
    base: dict[str, Any] = {"model": "hermes", "messages": ask("Say more."), "temperature": 0}
    text = client.chat.completions.create(**base, max_tokens=16).choices[0].message.content
    assert text and len(text) > 6, text
    stop = text[3:6]
    head = text[:text.index(stop)]
    trimmed = client.chat.completions.create(**base, max_tokens=16, stop=[stop])
    assert trimmed.choices[0].message.content == head
    kept = client.chat.completions.create(**base, max_tokens=16, stop=[stop],
                                          extra_body={"no_stop_trim": True})
    assert kept.choices[0].message.content == head + stop
    assert kept.choices[0].finish_reason == "stop"
    assert streamed(gw, **base, max_tokens=16, stop=[stop],
                    extra_body={"no_stop_trim": True}) == (head + stop, "stop")
    prompt = {"model": "hermes", "prompt": "Say more.", "temperature": 0, "max_tokens": 16}
    raw = client.completions.create(**prompt).choices[0].text
    stop = raw[3:6]
    kept_text = client.completions.create(**prompt, stop=[stop],
                                          extra_body={"no_stop_trim": True})
    assert kept_text.choices[0].text == raw[:raw.index(stop)] + stop


def test_return_hidden_states_is_refused_clearly(gw: GatewayProcess) -> None:
    base = {"model": "hermes", "messages": ask("Hi"), "max_tokens": 2}
    assert post(gw, {**base, "return_hidden_states": False})[0] == 200
    status, answer = post(gw, {**base, "return_hidden_states": True})
    assert status == 400 and answer["error"]["param"] == "return_hidden_states", answer
    assert answer["error"]["code"] == "unsupported_parameter"


# The think model's reply held by a grammar to a reasoning block and an answer (its random
# weights would not close the block by themselves within a test's tokens).
THINKING = {"grammar": 'root ::= "<think>" [a-z ]{3,12} "</think>" [a-z]{2,8}'}


def reasoning_chunks(gw: GatewayProcess, extra: dict[str, Any]) -> tuple[list[str], str]:
    """The reasoning_content deltas of a streamed answer, in order, and its content; a
    reasoning delta after content fails."""
    pieces, content = [], ""
    for chunk in gw.client().chat.completions.create(
            model="think", messages=ask("Think first."), max_tokens=60, temperature=0,
            stream=True, extra_body={**THINKING, **extra}):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning = (delta.model_extra or {}).get("reasoning_content")
        if reasoning:
            assert not content, "reasoning after the content"
            pieces.append(reasoning)
        content += delta.content or ""
    return pieces, content


def test_separate_reasoning_false_leaves_the_reasoning_in_the_content(
        gw: GatewayProcess) -> None:
    client = gw.client()
    base: dict[str, Any] = {"model": "think", "messages": ask("Think first."),
                            "max_tokens": 60, "temperature": 0}
    apart = client.chat.completions.create(**base, extra_body=THINKING).choices[0].message
    reasoning = apart.model_extra["reasoning_content"]
    assert reasoning and apart.content
    together = client.chat.completions.create(
        **base, extra_body={**THINKING, "separate_reasoning": False}).choices[0].message
    # The text as the model wrote it, its markers too (SGLang's answer); only
    # reasoning_content has the block's spaces trimmed.
    text = together.content or ""
    assert text.startswith("<think>") and text.endswith(f"</think>{apart.content}"), text
    assert text[len("<think>"):-len(f"</think>{apart.content}")].strip() == reasoning
    assert "reasoning_content" not in (together.model_extra or {})
    assert streamed(gw, **base, extra_body={**THINKING, "separate_reasoning": False}) == \
        (together.content, "stop")


def test_stream_reasoning_false_streams_the_reasoning_in_one_piece_where_it_ends(
        gw: GatewayProcess) -> None:
    long = {"grammar": 'root ::= "<think>" [a-z ]{20,30} "</think>" [a-z]{2,8}'}
    # Streamed as it is generated: in several pieces, or in fewer when the reader fell
    # behind (tokens ready at once share one message), so their number is not asserted.
    pieces, content = reasoning_chunks(gw, long)
    assert pieces and content
    held, held_content = reasoning_chunks(gw, {**long, "stream_reasoning": False})
    assert held == ["".join(pieces)] and held_content == content
    # And a reply whose reasoning never ends (max_tokens inside it) still gives it whole.
    cut = {"grammar": 'root ::= "<think>" [a-z ]{30,40} "</think>" [a-z]{2,8}'}
    whole = gw.client().chat.completions.create(
        model="think", messages=ask("Think first."), max_tokens=8, temperature=0,
        extra_body=cut).choices[0].message.model_extra["reasoning_content"]
    chunks = [c for c in gw.client().chat.completions.create(
        model="think", messages=ask("Think first."), max_tokens=8, temperature=0,
        stream=True, extra_body={**cut, "stream_reasoning": False}) if c.choices]
    got = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks]
    assert [g for g in got if g] == [whole]


def test_continue_final_message_continues_the_last_assistant_message(
        gw: GatewayProcess) -> None:
    opened = "The parcel is"
    messages = [*ask("Where is my parcel?"), {"role": "assistant", "content": opened}]
    body = {"model": "hermes", "messages": messages, "max_tokens": 6, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False}
    # The prompt ends with the message's text, no end of turn after it (the tiny Hermes
    # template's rendering, cut there); the answer is what the model goes on with.
    prompt = ("<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\n"
              "Where is my parcel?<|im_end|>\n<|im_start|>assistant\n" + opened)
    status, rendered = post(gw, body, "/v1/chat/completions/render")
    assert status == 200, rendered
    status, as_text = post(gw, {"model": "hermes", "prompt": prompt},
                           "/v1/completions/render")
    assert status == 200 and rendered["token_ids"] == as_text["token_ids"], as_text
    status, reply = post(gw, body)
    assert status == 200, reply
    raw = gw.client().completions.create(model="hermes", prompt=prompt, max_tokens=6,
                                         temperature=0)
    assert reply["choices"][0]["message"]["content"] == raw.choices[0].text
    assert reply["usage"]["prompt_tokens"] == raw.usage.prompt_tokens
    # Without it the same messages end the assistant's turn and open a new one.
    status, closed = post(gw, {**body, "continue_final_message": False,
                               "add_generation_prompt": True},
                          "/v1/chat/completions/render")
    assert status == 200 and len(closed["token_ids"]) > len(rendered["token_ids"])
    # add_generation_prompt false alone: the chat without the assistant turn's opening.
    status, bare = post(gw, {"model": "hermes", "messages": ask("Where is my parcel?"),
                             "add_generation_prompt": False}, "/v1/chat/completions/render")
    status, opening = post(gw, {"model": "hermes", "messages": ask("Where is my parcel?")},
                           "/v1/chat/completions/render")
    assert opening["token_ids"][:len(bare["token_ids"])] == bare["token_ids"]
    assert len(opening["token_ids"]) > len(bare["token_ids"])


def test_continue_final_message_refusals(gw: GatewayProcess) -> None:
    messages = [*ask("Where is my parcel?"), {"role": "assistant", "content": "It is"}]
    base = {"model": "hermes", "max_tokens": 2}
    # As vLLM: not with add_generation_prompt true (its default).
    status, answer = post(gw, {**base, "messages": messages, "continue_final_message": True})
    assert status == 400 and answer["error"]["param"] == "continue_final_message", answer
    assert "add_generation_prompt" in answer["error"]["message"]
    # The last message must be an assistant's, with text.
    for last in (ask("Where is my parcel?"),
                 [*ask("Hi"), {"role": "assistant", "content": ""}]):
        status, answer = post(gw, {**base, "messages": last, "continue_final_message": True,
                                   "add_generation_prompt": False})
        assert status == 400 and answer["error"]["param"] == "continue_final_message", answer
        assert "assistant message" in answer["error"]["message"]
