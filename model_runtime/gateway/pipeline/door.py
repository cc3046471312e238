"""The HTTP door every route shares: what the application holds (the fleet, the helper
process, the turn of large requests), what a handler leaves on its request for the
request count, and a request body read within the limits (``Expect: 100-continue``
answered by them, a refused body dropped or the connection closed)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import HttpVersion11, StreamReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from ...config import MAX_REQUEST_MESSAGE_BYTES
from ..connections import ConnectionGate
from ..errors import ApiError
from ..fleet import Fleet
from ..limits import too_large
from .offload import Offload

__all__ = ["CALLER", "CONNECTIONS", "FLEET", "LARGE_BODY", "LARGE_WORK", "MODEL_LABEL",
           "OFFLOAD", "OUTCOME", "check_message_size", "expect_within_limit", "label_model",
           "one_at_a_time", "read_body", "unread_body_or_close"]

FLEET = web.AppKey("fleet", Fleet)
CONNECTIONS = web.AppKey("connections", ConnectionGate)  # set by the server, if any
CALLER = "caller"  # the request's Caller, set by the api_keys middleware
# Bodies larger than this are parsed and their chats rendered in a helper process, one at a
# time (on the event loop's process, even on threads, the work holds its GIL).
LARGE_BODY = 256 << 10
LARGE_WORK = web.AppKey("large_work", asyncio.Semaphore)
OFFLOAD = web.AppKey("offload", Offload)
# A refused request's unread body up to this size is read and dropped (the connection is
# kept); a larger one closes the connection unread.
DRAIN_BYTES = 64 << 10
DRAIN_WAIT_S = 1.0

# What a handler leaves on its request for the count: the model label, and the outcome
# when the status alone does not tell it (a stream that failed after its 200).
MODEL_LABEL = "count_model"
OUTCOME = "count_outcome"


def label_model(request: web.Request, model: Any) -> None:
    """The request's model label: a served model's name, else "unknown" (a caller must
    not grow the metrics with names of its own)."""
    fleet = request.app[FLEET]
    request[MODEL_LABEL] = model if isinstance(model, str) and \
        model in fleet.model_names() else "unknown"


async def _drop_rest(content: StreamReader) -> None:
    """Read what is left of a request's body, keeping none of it."""
    while await content.readany():
        pass


async def unread_body_or_close(request: web.Request,
                               response: web.Response) -> web.Response:
    """A refusal before its body was read (or all of it): a small rest is read and
    dropped, so that the connection stays open for the client's next request; a large
    or unknown one is not read at all: the answer says ``Connection: close`` and the
    connection is closed once it is written (the server lingers for no body, see
    :func:`serve`). Reading refused bodies of megabytes only to drop them took the event
    loop from every other request (tools/bench_gateway_abuse.py)."""
    if request.content.is_eof():
        return response
    length = request.content_length
    if response.status == 408:  # a client that sends too slowly: no more waiting
        length = None
    if length is not None and length <= DRAIN_BYTES:
        try:
            # (wait_for: asyncio.timeout is Python 3.11's, and 3.10 is supported)
            await asyncio.wait_for(_drop_rest(request.content), DRAIN_WAIT_S)
            return response
        except (asyncio.TimeoutError, ConnectionError, HttpProcessingError):
            pass  # slow, gone or malformed: not worth keeping
    response.force_close()
    return response


async def expect_within_limit(request: web.Request) -> None:
    """``Expect: 100-continue`` (the client waits before it sends its body) is answered
    ``100 Continue`` only when the body may be read: one over the body limit by its
    Content-Length is not, and its route answers 413 without waiting for it (aiohttp's
    own handler invited every body)."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    limit = request.app[FLEET].settings.limits.body_bytes
    if request.content_length is not None and request.content_length > limit:
        return
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # (as aiohttp's: the answer has not started)


async def read_body(request: web.Request) -> bytes:
    """The body, at most the body limit: refused by its Content-Length before a byte is
    read, or as soon as a body sent without one (chunked) passes the limit; a 408 (the
    connection closed) when it has not all come within ``--body-timeout``."""
    settings = request.app[FLEET].settings
    limit = settings.limits
    if request.content_length is not None and request.content_length > limit.body_bytes:
        raise too_large(limit, request.content_length)

    async def whole() -> bytes:
        body = bytearray()
        async for piece in request.content.iter_any():
            body += piece
            if len(body) > limit.body_bytes:
                raise too_large(limit)
        return bytes(body)

    timeout = settings.connections.body_timeout_s
    try:
        # (wait_for: asyncio.timeout is Python 3.11's, and 3.10 is supported)
        return await asyncio.wait_for(whole(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout:g} s of its "
                            "headers (--body-timeout).", code="request_timeout") from None


def check_message_size(proto: Any) -> None:
    """A request larger than a worker accepts (the rendered prompt can outgrow the body)
    is the caller's: a 413, never the worker's failure."""
    size = proto.ByteSize()
    if size > MAX_REQUEST_MESSAGE_BYTES:
        raise ApiError(413, f"The request is {size} bytes as the worker receives it (its "
                            f"rendered prompt included); a worker takes at most "
                            f"{MAX_REQUEST_MESSAGE_BYTES}.", code="request_too_large")


def one_at_a_time(request: web.Request, large: bool
                  ) -> contextlib.AbstractAsyncContextManager[Any]:
    """A large request's turn (:data:`LARGE_BODY`); a small one goes at once."""
    if large:
        turns: asyncio.Semaphore = request.app[LARGE_WORK]
        return turns
    return contextlib.nullcontext()
