"""The runtime's one request (model_runtime/completion_request.py): a CompleteRequest
message turned into it once, every field of the message landing in its part, and the
request made from fields' names as Python callers give them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from model_runtime.completion_request import (
    CacheHints,
    CompletionRequest,
    Constraints,
    Input,
    Speculation,
)
from model_runtime.config import SettingError
from model_runtime.sampling import DEFAULT_PENALTY_LAST_N, GrammarTrigger, Sampling
from model_runtime.service import input_from_message, request_from_message
from model_runtime.v1 import runtime_pb2 as pb

# The message's fields that are the request's input, by their name in Input. (Numbers
# below are exact in float32, the message's type.)
INPUT_FIELDS = {"prompt": "prompt", "tokens": "tokens", "chat": "messages",
                "system": "system"}


def every_field_set() -> pb.CompleteRequest:
    return pb.CompleteRequest(
        prompt="Hello", system="Be brief.", prefix_tokens=3, session_id="s1",
        parent_key="ab" * 16, max_tokens=9, temperature=0.5, top_p=0.875, top_k=40, seed=7,
        stop=["\n\n"], until_context_full=False, logprobs=True, top_logprobs=2, min_p=0.0625,
        repeat_penalty=1.25, presence_penalty=0.25, frequency_penalty=0.375,
        penalty_last_n=-1,
        logit_bias={5: -100.0, 2: 1.5}, grammar='root ::= "a"', json_schema="",
        json_object=False, grammar_triggers=[pb.GrammarTrigger(value="<a", pattern=True)],
        n=2, tenant="alice", prefix_chars=4, boundary_chars=[2, 5],
        boundary_ttl_seconds=[0, 60], continue_parent=True, speculative=True,
        prediction="Hello again", keep_stop=True, ignore_eos=True, special_tokens=True)


def test_a_message_becomes_one_request_with_every_field_in_its_part() -> None:
    request = request_from_message(every_field_set())
    assert request == CompletionRequest(
        Input(prompt="Hello", system="Be brief."),
        Sampling(temperature=0.5, top_k=40, top_p=0.875, min_p=0.0625, seed=7,
                 repeat_penalty=1.25, presence_penalty=0.25, frequency_penalty=0.375,
                 penalty_last_n=-1, logit_bias=((2, 1.5), (5, -100.0))),
        Constraints(max_tokens=9, stop=("\n\n",), keep_stop=True, ignore_eos=True,
                    special_tokens=True, grammar='root ::= "a"',
                    grammar_triggers=(GrammarTrigger("<a", pattern=True),)),
        CacheHints(prefix_tokens=3, prefix_chars=4, boundary_chars=(2, 5),
                   boundary_ttl_seconds=(0, 60), session_id="s1", parent_key="ab" * 16,
                   continue_parent=True),
        tenant="alice", n=2, logprobs=True, top_logprobs=2,
        speculation=Speculation(speculative=True, prediction="Hello again"))
    # No field of the message is left out: each is one of the request's (a field added
    # to the proto and not read here fails this test).
    names = {f.name for f in dataclasses.fields(CompletionRequest)}
    for part in (Input, Sampling, Constraints, CacheHints, Speculation):
        names |= {f.name for f in dataclasses.fields(part)}
    message_fields = {INPUT_FIELDS.get(f.name, f.name)
                      for f in pb.CompleteRequest.DESCRIPTOR.fields}
    # ... but where its events go, which the service reads (RuntimeService._channel_events)
    assert message_fields - names == {"channel_id"}


def test_fields_left_at_zero_are_the_defaults_where_zero_is_not_a_value() -> None:
    request = request_from_message(pb.CompleteRequest(tokens=pb.TokenList(ids=[1, 2, 3])))
    assert request.input == Input(tokens=(1, 2, 3))
    assert request.sampling == Sampling()  # top_p 1, seed None, penalty window 64
    assert request.sampling.penalty_last_n == DEFAULT_PENALTY_LAST_N
    assert request.constraints == Constraints()  # max_tokens None, json_schema None
    assert (request.n, request.tenant, request.speculation) == (1, None, Speculation())
    # Set to zero, the optional fields are values of their own.
    zeros = request_from_message(pb.CompleteRequest(prompt="x", seed=0, penalty_last_n=0,
                                                    tenant="", speculative=False))
    assert (zeros.sampling.seed, zeros.sampling.penalty_last_n) == (0, 0)
    assert (zeros.tenant, zeros.speculation.speculative) == ("", False)


def test_the_input_of_a_message() -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    assert input_from_message(pb.CompleteRequest(chat=chat)) == \
        Input(messages=({"role": "user", "content": "Hi"},))
    assert input_from_message(pb.CompleteRequest(prompt="x")) == Input(prompt="x")
    assert input_from_message(pb.CompleteRequest()) == Input()  # refused by the runtime


def test_a_sampling_setting_out_of_range_is_refused_when_the_request_is_made() -> None:
    with pytest.raises(SettingError) as err:
        request_from_message(pb.CompleteRequest(prompt="x", temperature=-1.0))
    assert err.value.setting == "temperature"
    with pytest.raises(SettingError) as err:
        request_from_message(pb.CompleteRequest(prompt="x", logit_bias={3: 101.0}))
    assert err.value.setting == "logit_bias"
    with pytest.raises(SettingError, match="top_p"):
        CompletionRequest.of(prompt="x", top_p=1.5)


def test_a_request_of_fields_puts_each_in_its_part() -> None:
    request = CompletionRequest.of(messages=[{"role": "user", "content": "Hi"}],
                                   temperature=0.7, seed=3, logit_bias={9: -math.inf, 1: 2},
                                   json_object=True, max_tokens=5, session_id="s",
                                   tenant="bob", n=2, prediction=[4, 5], speculative=False)
    assert request.input.messages == [{"role": "user", "content": "Hi"}]
    assert request.sampling == Sampling(temperature=0.7, seed=3,
                                        logit_bias=((1, 2), (9, -math.inf)))
    assert request.constraints == Constraints(max_tokens=5, json_object=True)
    assert request.cache == CacheHints(session_id="s")
    assert (request.tenant, request.n) == ("bob", 2)
    assert request.speculation == Speculation(speculative=False, prediction=[4, 5])
    with pytest.raises(TypeError, match="temprature"):
        CompletionRequest.of(prompt="x", temprature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.n = 3  # type: ignore[misc]
