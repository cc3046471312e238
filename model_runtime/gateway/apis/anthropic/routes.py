"""The Anthropic Messages API's routes: ``POST /v1/messages`` (whole or streamed with
Anthropic's events) and ``POST /v1/messages/count_tokens``. They run as the OpenAI routes
do (``app``): the same admission, rendering, worker events, accounting and failure
handling; errors leave in Anthropic's shape (``app.openai_errors`` picks it by path).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from ....chat.parsing import OutputParser
from ...app import (
    FLEET,
    LARGE_BODY,
    MODEL_LABEL,
    account,
    check_finished,
    check_message_size,
    expect_within_limit,
    failure_error,
    on_worker,
    one_at_a_time,
    read_body,
    refusal_error,
    render,
)
from ...limits import parse_json
from ...pipeline.request import served_text
from ...workers.errors import RuntimeRefused, WorkerFailure
from ...workers.worker import Worker
from ..openai.formatter import kvcache_details
from .adapter import MessagesRequest, error_body, parse_count_tokens, parse_messages_request
from .formatter import BlockStream, event, message_body, message_start, stop_reason, usage

__all__ = ["PATH_PREFIX", "add_routes"]

PATH_PREFIX = "/v1/messages"


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH_PREFIX, messages, name="messages",
                        expect_handler=expect_within_limit)
    app.router.add_post(f"{PATH_PREFIX}/count_tokens", count_tokens, name="count_tokens",
                        expect_handler=expect_within_limit)


async def _read(request: web.Request, parse: Any) -> tuple[MessagesRequest, bool]:
    """The body parsed by ``parse`` (on a thread: the event loop keeps serving), and
    whether it was large (its rendering then waits its turn)."""
    fleet = request.app[FLEET]
    fleet.refuse_if_full(request["tenant"])  # before reading: a full server reads nothing
    body = await read_body(request)
    large = len(body) > LARGE_BODY
    async with one_at_a_time(request, large):
        data = await asyncio.to_thread(parse_json, body, fleet.settings.limits)
        del body
        model = data.get("model")
        request[MODEL_LABEL] = model if isinstance(model, str) and \
            model in fleet.model_names() else "unknown"
        mreq = await asyncio.to_thread(parse, data, fleet.settings.cache_ttls)
    return mreq, large


def _served(parser: OutputParser) -> str:
    out = parser.output
    return served_text(out.content, [(c.name, c.arguments) for c in out.tool_calls])


async def count_tokens(request: web.Request) -> web.StreamResponse:
    fleet = request.app[FLEET]
    mreq, large = await _read(request, parse_count_tokens)
    req = mreq.gen
    worker, flight = await fleet.admit(req.model, request["tenant"], req.routing_text(), "",
                                       req.route_key)
    async with on_worker(request, req, worker, flight, computes=False) as served:
        async with one_at_a_time(request, large):
            plan = await render(request, req, worker, large)
        assert plan is not None  # a chat, always
        proto = req.to_proto(plan)
        check_message_size(proto)
        tokens = await worker.client.count_tokens(flight, proto)
        served.outcome = "ok"
        return web.json_response({"input_tokens": tokens})


async def messages(request: web.Request) -> web.StreamResponse:
    fleet = request.app[FLEET]
    arrived = time.monotonic()
    mreq, large = await _read(request, parse_messages_request)
    req = mreq.gen
    worker, flight = await fleet.admit(req.model, request["tenant"], req.routing_text(), "",
                                       req.route_key)
    async with on_worker(request, req, worker, flight) as served:
        async with one_at_a_time(request, large):
            plan = await render(request, req, worker, large)
        assert plan is not None
        proto = mreq.to_proto(plan)
        check_message_size(proto)
        parser = plan.parser()
        events = worker.client.events(flight, proto)
        async with contextlib.aclosing(events):
            if req.stream:
                response, served.text, served.outcome = await _stream(
                    request, mreq, worker, events, parser, arrived)
                return response
            async for item in events:
                if item.HasField("done"):
                    check_finished(item.done, fleet)
                    parser.close()
                    done = item.done
                    account(fleet, req, request["tenant"], done, arrived, len(done.tokens))
                    served.text = req.routing_text(_served(parser))
                    served.outcome = "ok"
                    return web.json_response(message_body(
                        mreq, parser.output, done,
                        kvcache_details(done, worker.name, request["tenant"])))
                if item.HasField("text"):
                    parser.feed(item.text)
            raise WorkerFailure("worker_error", "the stream ended without a final record")


async def _stream(request: web.Request, mreq: MessagesRequest, worker: Worker, events: Any,
                  parser: OutputParser, arrived: float
                  ) -> tuple[web.StreamResponse, str | None, str]:
    """Anthropic's events: message_start (the input side of usage), ping, each content
    block's start, deltas and stop, message_delta (stop_reason, usage), message_stop.
    Returns the response, the text served (for routing) and the outcome. Raises before
    the first event (so errors keep their status), never after: a failure then is an
    ``error`` event."""
    fleet = request.app[FLEET]
    req = mreq.gen
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    blocks = BlockStream()
    first = True
    prompt: Any = None  # the runtime's account of the prompt, told before its first token
    try:
        async for item in events:
            if item.HasField("prompt"):
                prompt = item.prompt
                continue
            if first:  # the runtime accepted the request: from here on, errors are events
                await response.prepare(request)
                fleet.metrics.ttft.labels(req.model, request["tenant"]).observe(
                    time.monotonic() - arrived)
                # message_start carries the prompt's side, as Anthropic's does (a request
                # that ended before its first token has it in its final record).
                start = prompt if prompt is not None else item.done
                await response.write(event("message_start", message_start(mreq, start)))
                await response.write(event("ping", {"type": "ping"}))
                first = False
            if item.HasField("done"):
                check_finished(item.done, fleet)
                done = item.done
                out = [e for d in parser.close() for e in blocks.feed(d)] + blocks.finish()
                for name, data in out:
                    await response.write(event(name, data))
                reason, sequence = stop_reason(done, bool(parser.output.tool_calls))
                await response.write(event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(done, mreq),
                    "kvcache": kvcache_details(done, worker.name, request["tenant"])}))
                await response.write(event("message_stop", {"type": "message_stop"}))
                await response.write_eof()
                account(fleet, req, request["tenant"], done, arrived, len(done.tokens))
                return response, req.routing_text(_served(parser)), "ok"
            for delta in parser.feed(item.text):
                for name, data in blocks.feed(delta):
                    await response.write(event(name, data))
        raise WorkerFailure("worker_error", "the stream ended without a final record")
    except (RuntimeRefused, WorkerFailure) as exc:
        if first:
            raise
        if isinstance(exc, WorkerFailure):
            fleet.metrics.failures.labels(request["tenant"], exc.reason).inc()
            err = failure_error(exc)
        else:
            err = refusal_error(exc, req)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await response.write(event("error", error_body(err)[1]))
            await response.write_eof()
        outcome = "worker_failure" if isinstance(exc, WorkerFailure) else "bad_request"
        return response, None, outcome
    except ConnectionError:  # the client went away while we wrote
        return response, None, "disconnected"
