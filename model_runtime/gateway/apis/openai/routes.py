"""The OpenAI API's routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(through the pipeline: pipeline/run.py), ``GET /v1/models`` and ``/v1/models/{model}``,
and vLLM's render endpoints (``POST /v1/chat/completions/render``,
``/v1/completions/render``: a request checked as it would be served and its prompt's
token ids as the worker would prefill them, nothing computed; vllm-router's ``kv_aware``
asks every worker for them, hashes them into blocks and compares those with the blocks the
hosts' KV events announced).
A large body is parsed in the helper process (pipeline/offload.py), a small one on a
thread: the event loop keeps serving either way."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from ...errors import ApiError
from ...pipeline import run
from ...pipeline.contract import Endpoint
from ...pipeline.door import FLEET, OFFLOAD, expect_within_limit, label_model
from ...pipeline.request import GenRequest
from .adapter import SESSION_HEADER, OpenAICall, parse_request
from .formatter import OpenAIFormatter

__all__ = ["add_routes"]


async def _convert(request: web.Request, body: bytes, large: bool,
                   endpoint: str) -> OpenAICall:
    limits = request.app[FLEET].settings.limits
    session = request.headers.get(SESSION_HEADER)
    is_json, model, call = await (
        request.app[OFFLOAD].parse(parse_request, body, limits, endpoint, session) if large
        else asyncio.to_thread(parse_request, body, limits, endpoint, session))
    if is_json:  # labels only of served models: a caller must not grow the metrics
        label_model(request, model)
    if isinstance(call, ApiError):
        raise call
    return call


async def convert_chat(request: web.Request, body: bytes, large: bool) -> OpenAICall:
    return await _convert(request, body, large, "chat")


async def convert_text(request: web.Request, body: bytes, large: bool) -> OpenAICall:
    return await _convert(request, body, large, "text")


CHAT = Endpoint(convert_chat, OpenAIFormatter)
TEXT = Endpoint(convert_text, OpenAIFormatter)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await run.complete(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await run.complete(request, TEXT)


async def render_chat(request: web.Request) -> web.Response:
    call, ids = await run.prompt_tokens(request, CHAT)
    return web.json_response(generate_request(call, ids))


async def render_text(request: web.Request) -> web.Response:
    call, ids = await run.prompt_tokens(request, TEXT)
    return web.json_response(generate_request(call, ids))


def generate_request(call: OpenAICall, ids: list[int]) -> dict[str, Any]:
    """vLLM's GenerateRequest (what its render endpoints answer) for ``call``."""
    req: GenRequest = call.request
    return {"request_id": call.id, "token_ids": ids, "features": None,
            "sampling_params": {"n": req.n, "temperature": req.temperature,
                                "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
                                "stop": req.stop, "max_tokens": req.max_tokens,
                                "logprobs": req.top_logprobs if req.logprobs else None,
                                "ignore_eos": req.ignore_eos,
                                "skip_special_tokens": not req.special_tokens},
            "model": req.model, "stream": req.stream, "stream_options": None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": None}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[FLEET].models()})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for model in request.app[FLEET].models():
        if model["id"] == name:
            return web.json_response(model)
    raise ApiError(404, f"The model '{name}' does not exist.", param="model",
                   code="model_not_found")


def add_routes(app: web.Application) -> None:
    # Route names are the endpoint label of the request count.
    app.router.add_post("/v1/chat/completions", chat_completions, name="chat",
                        expect_handler=expect_within_limit)
    app.router.add_post("/v1/completions", completions, name="text",
                        expect_handler=expect_within_limit)
    app.router.add_post("/v1/chat/completions/render", render_chat, name="render_chat",
                        expect_handler=expect_within_limit)
    app.router.add_post("/v1/completions/render", render_text, name="render_text",
                        expect_handler=expect_within_limit)
    app.router.add_get("/v1/models", list_models, name="models")
    app.router.add_get("/v1/models/{model:.+}", get_model, name="model")
