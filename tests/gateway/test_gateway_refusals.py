"""A runtime's refusals cross the process boundary as data: the runtime ends a refused
call with a Refusal (code, the field it refuses, message) in its trailing metadata, and
the gateway names that field in each API's own terms and shape, streamed or not (the
stream has not started: the status is the refusal's). Against a real runtime process and
a real gateway (the tiny model with a Hermes-style template, one thread)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from model_runtime.config import REFUSAL_METADATA_KEY
from model_runtime.v1 import runtime_pb2 as pb
from model_runtime.v1 import runtime_pb2_grpc as pb_grpc
from tests.support.gateway_proc import GatewayProcess, Gateways, model_entry
from tests.support.runtime_proc import RuntimeProcess

N_CTX = 1024
LONG = "word " * 3000  # far beyond the context


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory,
            tiny_hermes_model: Path) -> Iterator[pb_grpc.ModelRuntimeStub]:
    process = RuntimeProcess(tiny_hermes_model, "none",
                             tmp_path_factory.mktemp("refusals") / "runtime.log")
    try:
        process.start()
        with grpc.insecure_channel(process.address) as channel:
            yield pb_grpc.ModelRuntimeStub(channel)
    finally:
        process.close()


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_hermes_model: Path) -> GatewayProcess:
    return gateways.start("refusals", models=[
        model_entry("hermes", tiny_hermes_model, "--n-ctx", str(N_CTX), "--n-seq-max", "2")],
        cache="none")


def refusal(err: grpc.RpcError) -> pb.Refusal:
    (value,) = [v for k, v in err.trailing_metadata() or () if k == REFUSAL_METADATA_KEY]
    return pb.Refusal.FromString(value)


@pytest.mark.parametrize("request_, code, param, message", [
    (pb.CompleteRequest(prompt="hi", top_p=2.0), "invalid_argument", "top_p",
     "top_p must be a finite number > 0 and <= 1, got 2.0"),
    (pb.CompleteRequest(prompt="hi", logit_bias={10**6: 1.0}), "invalid_argument",
     "logit_bias", "logit_bias token ids must be below"),
    (pb.CompleteRequest(prompt="hi", grammar="root ::= ("), "invalid_argument", "grammar",
     "grammar is not valid GBNF"),
    (pb.CompleteRequest(prompt=LONG, max_tokens=4), "prompt_too_long", "",
     "the context holds 1024 per sequence"),
    (pb.CompleteRequest(tokens=pb.TokenList(ids=[1, 5, 10**6])), "invalid_argument", "",
     "token ids out of range"),
])
def test_the_runtime_sends_code_field_and_message_as_data(
        runtime: pb_grpc.ModelRuntimeStub, request_: pb.CompleteRequest, code: str,
        param: str, message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(runtime.Complete(request_, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got = refusal(err.value)
    assert (got.code, got.param) == (code, param), got
    assert message in got.message, got.message
    # People still read it in the status's details.
    assert err.value.details().startswith(f"{code}: ")


def test_count_tokens_refuses_the_same_way(runtime: pb_grpc.ModelRuntimeStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        runtime.CountTokens(pb.CompleteRequest(tokens=pb.TokenList(ids=[10**6])), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got = refusal(err.value)
    assert got.code == "invalid_argument" and "out of range" in got.message


def post(gw: GatewayProcess, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = gw.http("POST", path, json.dumps(body).encode())
    return status, json.loads(raw)


CHAT = [{"role": "user", "content": LONG}]


@pytest.mark.parametrize("stream", [False, True])
def test_each_api_names_the_refused_field_in_its_own_terms(gw: GatewayProcess,
                                                           stream: bool) -> None:
    """One refusal (a prompt beyond the context), four APIs: OpenAI's chat names its
    messages, completions its prompt, the Responses API its input, and Anthropic's says
    it in its message (its errors have no field of their own)."""
    for path, body, param in [
            ("/v1/chat/completions", {"messages": CHAT}, "messages"),
            ("/v1/completions", {"prompt": LONG}, "prompt"),
            ("/v1/responses", {"input": LONG}, "input")]:
        status, answer = post(gw, path, {"model": "hermes", "stream": stream, **body})
        assert status == 400, (path, answer)
        error = answer["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param), path
        assert "maximum context length" in error["message"]
    status, answer = post(gw, "/v1/messages", {"model": "hermes", "max_tokens": 4,
                                               "stream": stream, "messages": CHAT})
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith("messages: This model's maximum context")


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logit_bias": {"999999": 5}},
     "logit_bias", "logit_bias token ids must be below"),
    ("/v1/completions", {"prompt": "hi", "grammar": "root ::= ("},
     "grammar", "grammar is not valid GBNF"),
])
def test_a_setting_the_runtime_refuses_is_named_as_the_request_named_it(
        gw: GatewayProcess, path: str, body: dict[str, Any], param: str,
        message: str) -> None:
    """Settings the gateway passes on and only the runtime can check (a token id beyond
    the vocabulary, GBNF llama.cpp cannot parse), streamed or not."""
    for stream in (False, True):
        status, answer = post(gw, path, {"model": "hermes", "stream": stream, **body})
        assert status == 400, answer
        error = answer["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value"), error
        assert error["message"].startswith(message), error
