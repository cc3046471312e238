"""The Anthropic Messages API's routes: ``POST /v1/messages`` (whole or streamed with
Anthropic's events) and ``POST /v1/messages/count_tokens``, through the pipeline
(pipeline/run.py) as every API's; errors leave in Anthropic's shape
(:func:`error_response`, which the application picks by path)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from ...errors import ApiError
from ...limits import parse_json
from ...pipeline import run
from ...pipeline.contract import Endpoint
from ...pipeline.door import FLEET, expect_within_limit, label_model
from .adapter import MessagesRequest, error_body, parse_count_tokens, parse_messages_request
from .formatter import MessagesFormatter

__all__ = ["PATH_PREFIX", "add_routes", "error_response"]

PATH_PREFIX = "/v1/messages"


def error_response(err: ApiError) -> web.Response:
    """An error as Anthropic answers it (its status and body)."""
    status, body = error_body(err)
    return web.json_response(body, status=status, headers=err.headers)


def _converter(parse: Callable[[Mapping[str, Any], Mapping[str, int]], MessagesRequest]
               ) -> Callable[[web.Request, bytes, bool], Awaitable[MessagesRequest]]:
    async def convert(request: web.Request, body: bytes, large: bool) -> MessagesRequest:
        """The body parsed on a thread (the event loop keeps serving)."""
        settings = request.app[FLEET].settings
        data = await asyncio.to_thread(parse_json, body, settings.limits)
        del body
        label_model(request, data.get("model"))
        return await asyncio.to_thread(parse, data, settings.cache_ttls)
    return convert


MESSAGES = Endpoint(_converter(parse_messages_request), MessagesFormatter)
COUNT = Endpoint(_converter(parse_count_tokens), MessagesFormatter)


async def messages(request: web.Request) -> web.StreamResponse:
    return await run.complete(request, MESSAGES)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    return web.json_response({"input_tokens": await run.count_tokens(request, COUNT)})


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH_PREFIX, messages, name="messages",
                        expect_handler=expect_within_limit)
    app.router.add_post(f"{PATH_PREFIX}/count_tokens", count_tokens, name="count_tokens",
                        expect_handler=expect_within_limit)
