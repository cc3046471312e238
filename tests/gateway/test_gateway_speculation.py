"""Speculative decoding through the gateway, with the official SDKs: OpenAI's
``prediction`` (predicted outputs) drafts and changes no token, with the prediction's
tokens accepted and rejected in usage; the ``speculative`` extension of every API turns
it off or on per request; ``--speculative`` reaches the workers; drafted and accepted
tokens in the ``kvcache`` field and the token counter. A real gateway, worker processes
on the tiny model and a cache daemon.

The tiny model's text is random: a grammar (``root ::= [a-m ]+``) keeps it to letters a
prediction can spell, and a reply's own text is the prediction of the same request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import SYSTEM, GatewayProcess, Gateways, chat, model_entry

GRAMMAR = "root ::= [a-m ]+"
MESSAGES = chat(SYSTEM, "Spell something.")


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_model: Path) -> GatewayProcess:
    return gateways.start("speculation", args=["--speculative", "ngram"], models=[
        model_entry("tiny", tiny_model, "--n-ctx", "2048", "--n-seq-max", "2")])


def ask(gw: GatewayProcess, **kw: Any) -> Any:
    return gw.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"grammar": GRAMMAR, **kw.pop("extra_body", {})}, **kw)


def speculation(response: Any) -> dict[str, Any]:
    details: dict[str, Any] = response.model_extra["kvcache"]["speculation"]
    return details


def test_a_prediction_drafts_and_changes_no_token(gw: GatewayProcess) -> None:
    plain = ask(gw, extra_body={"speculative": False})
    text = plain.choices[0].message.content
    assert text and speculation(plain) == {"drafted": 0, "accepted": 0,
                                           "acceptance_rate": None}
    assert plain.usage.completion_tokens_details is None  # no prediction: no counts
    for prediction in ({"type": "content", "content": text},
                       {"type": "content", "content": [{"type": "text", "text": text[:9]},
                                                       {"type": "text", "text": text[9:]}]}):
        predicted = ask(gw, prediction=prediction)
        assert predicted.choices[0].message.content == text
        assert predicted.choices[0].finish_reason == plain.choices[0].finish_reason
        details = predicted.usage.completion_tokens_details
        spec = speculation(predicted)
        assert details.accepted_prediction_tokens > 0
        assert details.accepted_prediction_tokens <= spec["accepted"] <= spec["drafted"]
        assert spec["acceptance_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    # A prediction that is mostly wrong: its tokens rejected are counted, the text kept.
    wrong = ask(gw, prediction={"type": "content", "content": text[:5] + "zz" * 20})
    assert wrong.choices[0].message.content == text
    details = wrong.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0
    # speculative: false wins over a prediction: nothing drafted.
    off = ask(gw, prediction={"type": "content", "content": text},
              extra_body={"speculative": False})
    assert off.choices[0].message.content == text and speculation(off)["drafted"] == 0


def test_a_streamed_prediction_reports_its_tokens_in_the_usage_chunk(
        gw: GatewayProcess) -> None:
    text = ask(gw).choices[0].message.content
    stream = ask(gw, stream=True, stream_options={"include_usage": True},
                 prediction={"type": "content", "content": text})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.model_extra["kvcache"]["speculation"]["accepted"] > 0
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_drafted_and_accepted_tokens_are_counted(gw: GatewayProcess) -> None:
    def counted() -> dict[str, float]:
        status, _, body = gw.http("GET", "/metrics")
        assert status == 200
        return {s.labels["kind"]: s.value
                for family in text_string_to_metric_families(body.decode())
                for s in family.samples
                if s.name == "kvcache_gateway_tokens_total" and s.labels["model"] == "tiny"}

    text = ask(gw).choices[0].message.content
    before = counted()
    spec = speculation(ask(gw, prediction={"type": "content", "content": text}))
    after = counted()
    assert spec["accepted"] > 0
    assert after["drafted"] - before.get("drafted", 0) == spec["drafted"]
    assert after["accepted"] - before.get("accepted", 0) == spec["accepted"]


@pytest.mark.parametrize("body, param", [
    ({"prediction": {"type": "content", "content": 7}}, "prediction"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction"),
    ({"speculative": "yes"}, "speculative"),
])
def test_a_bad_prediction_or_speculative_is_refused_naming_it(
        gw: GatewayProcess, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gw.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                            extra_body=body)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_the_anthropic_and_responses_apis_take_speculative(gw: GatewayProcess) -> None:
    # (No prediction there: the extension turns prompt lookup off or on; the text is the
    # same either way.)
    client = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0, timeout=60)
    texts = []
    for speculative in (False, True):
        message = client.messages.create(
            model="tiny", max_tokens=24, messages=[
                {"role": "user", "content": "Spell something."}],
            extra_body={"speculative": speculative, "temperature": 0})
        texts.append(message.content[0].text)  # type: ignore[union-attr]
        spec = message.model_extra["kvcache"]["speculation"]  # type: ignore[index]
        assert spec["drafted"] >= spec["accepted"] >= 0
        if not speculative:
            assert spec["drafted"] == 0
    assert texts[0] == texts[1]
    with pytest.raises(anthropic.BadRequestError, match="speculative"):
        client.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}], extra_body={"speculative": 1})

    openai_client = gw.client()
    outputs = []
    for speculative in (False, True):
        response = openai_client.responses.create(
            model="tiny", input="Spell something.", max_output_tokens=24, temperature=0,
            store=False, extra_body={"speculative": speculative})
        outputs.append(response.output_text)
        spec = response.model_extra["kvcache"]["speculation"]  # type: ignore[index]
        if not speculative:
            assert spec["drafted"] == 0
    assert outputs[0] == outputs[1]
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model="tiny", input="Hi", max_output_tokens=4,
                                       extra_body={"speculative": "no"})
    assert caught.value.body["param"] == "speculative"  # type: ignore[index]
