"""The Responses API's routes: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``.

A request runs as the chat completion it amounts to (``responses_api``) on a worker the
fleet admits, its output parsed as chat's is and answered as Responses items
(``responses_output``). A stored response keeps its conversation and ``finish_key``; a
request naming it as ``previous_response_id`` renders that conversation followed by its
new input and asks the runtime to resume from the finish state (``parent_key``): live on
the worker that still holds the sequence, else restored from the daemon, so only what
differs from the state is computed. A state the daemon no longer has costs a longer
prefill, never a wrong answer (the conversation is rendered whole either way); the
continuations are counted by how they were served
(``kvcache_gateway_responses_continued``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from ...app import (
    FLEET,
    LARGE_BODY,
    MODEL_LABEL,
    OUTCOME,
    account,
    check_finished,
    check_message_size,
    expect_within_limit,
    failure_error,
    one_at_a_time,
    read_body,
    refusal_error,
    render,
)
from ...errors import ApiError, bad_param
from ...fleet import Fleet
from ...limits import parse_json
from ...metrics import PREFIX
from ...pipeline.request import PROTO_FIELDS, GenRequest
from ...workers.errors import RuntimeRefused, WorkerFailure
from ..openai.adapter import SESSION_HEADER
from ..openai.formatter import Choice, kvcache_details
from .adapter import ResponsesRequest, parse_responses
from .formatter import ResponseBuilder, reply_messages, sse_event
from .store import ResponseStore, StoredResponse

__all__ = ["add_responses_routes"]

log = logging.getLogger("model_runtime.gateway")


class ResponsesService:
    """The store and the counters of the Responses API."""

    def __init__(self, fleet: Fleet) -> None:
        self.store = ResponseStore(fleet.settings.responses)
        registry = fleet.metrics.registry
        self.continued = Counter(
            f"{PREFIX}_responses_continued", "Responses continuing a stored one "
            "(previous_response_id), by how: state (its whole saved state was reused, live or "
            "restored), prefix (the earlier prompt and part of its reply), rendered (the "
            "state was gone: prefilled again from the stored conversation)", ["model", "tenant", "how"],
            registry=registry)
        self.stored = Counter(f"{PREFIX}_responses_stored", "Responses stored (stored), dropped to "
                              "keep the store within its bounds (evicted), or that could not be "
                              "stored (failed)",
                              ["event"], registry=registry)


SERVICE = web.AppKey("responses", ResponsesService)


def add_responses_routes(app: web.Application) -> None:
    service = ResponsesService(app[FLEET])
    app[SERVICE] = service

    async def close_store(_: web.Application) -> None:
        service.store.close()

    app.on_cleanup.append(close_store)
    app.router.add_post("/v1/responses", create_response, name="responses",
                        expect_handler=expect_within_limit)
    app.router.add_get("/v1/responses/{id}", get_response, name="response")
    app.router.add_delete("/v1/responses/{id}", delete_response, name="response_delete")


def not_found(response_id: str) -> ApiError:
    """One answer for unknown, expired, deleted and another tenant's ids: nothing tells
    them apart."""
    return ApiError(404, f"Response with id '{response_id}' not found.",
                    param="previous_response_id", code="response_not_found")


async def get_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    rid = request.match_info["id"]
    found = await asyncio.to_thread(service.store.get, request["tenant"], rid)
    if found is None:
        raise ApiError(404, f"Response with id '{rid}' not found.", param="id",
                       code="response_not_found")
    return web.json_response(found.body)


async def delete_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    rid = request.match_info["id"]
    if not await asyncio.to_thread(service.store.delete, request["tenant"], rid):
        raise ApiError(404, f"Response with id '{rid}' not found.", param="id",
                       code="response_not_found")
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def parse_request(request: web.Request, fleet: Fleet, body: bytes
                        ) -> ResponsesRequest:
    data = await asyncio.to_thread(parse_json, body, fleet.settings.limits)
    model = data.get("model")
    request[MODEL_LABEL] = model if isinstance(model, str) and \
        model in fleet.model_names() else "unknown"
    items = data.get("input")
    if isinstance(items, list) and len(items) > fleet.settings.limits.messages:
        raise bad_param("input", f"Invalid 'input': array too long. Expected an array with "
                                 f"maximum length {fleet.settings.limits.messages} "
                                 f"(--max-messages), but got {len(items)}.",
                        code="array_above_max_length")
    return await asyncio.to_thread(parse_responses, data)


async def create_response(request: web.Request) -> web.StreamResponse:
    fleet = request.app[FLEET]
    service = request.app[SERVICE]
    tenant = request["tenant"]
    arrived = time.monotonic()
    fleet.refuse_if_full(tenant)
    body = await read_body(request)
    large = len(body) > LARGE_BODY
    async with one_at_a_time(request, large):
        rreq = await parse_request(request, fleet, body)
        del body
        previous: StoredResponse | None = None
        if rreq.previous_response_id is not None:
            previous = await asyncio.to_thread(service.store.get, tenant,
                                               rreq.previous_response_id)
            if previous is None:
                raise not_found(rreq.previous_response_id)
            if previous.model != rreq.model:
                raise bad_param("previous_response_id", f"Response "
                                f"'{previous.id}' was made by model '{previous.model}', not "
                                f"'{rreq.model}': its state cannot be continued by another "
                                "model.")
        history = previous.messages if previous is not None else []
        req = await asyncio.to_thread(rreq.gen_request, history,
                                      request.headers.get(SESSION_HEADER))
    worker, flight = await fleet.admit(req.model, tenant, req.routing_text(),
                                       req.session_id, req.route_key, 1)
    outcome = "disconnected"
    served: str | None = None
    try:
        async with one_at_a_time(request, large):
            try:
                prompt = await render(request, req, worker, large)
            except ApiError as err:
                raise rreq.renamed(err, len(history)) from None
        assert prompt is not None
        proto = req.to_proto(prompt)
        if previous is not None and previous.finish_key:
            # Resume from the stored state: the runtime takes the state's own tokens for
            # the text they stand for, so the reply is never tokenized again.
            proto.parent_key = previous.finish_key
            if "continue_parent" in PROTO_FIELDS:
                proto.continue_parent = True
        check_message_size(proto)
        choice = Choice(0, prompt.parser())
        builder = ResponseBuilder(rreq)

        async def finished(done: Any, body: dict[str, Any]) -> None:
            """Count a continuation and store the response, before the client is told
            it is complete (a response that could not be stored is an error)."""
            if previous is not None:
                restored = done.cache_delta.tokens_read
                how = "state" if restored >= previous.state_tokens else \
                    "prefix" if restored >= previous.prompt_tokens else "rendered"
                service.continued.labels(req.model, tenant, how).inc()
            if rreq.store:
                try:
                    await asyncio.to_thread(keep, service, rreq, req, tenant, history, done,
                                            body)
                except (OSError, sqlite3.Error) as exc:
                    log.error("cannot store response %s: %s", rreq.id, exc)
                    service.stored.labels("failed").inc()
                    raise ApiError(500, f"The response was generated but could not be "
                                        f"stored ({exc}); send it with store false, or ask "
                                        "the operator about --responses-dir.",
                                   type="server_error", code="store_failed") from None

        events = worker.client.events(flight, proto)
        async with contextlib.aclosing(events):
            result = await run(request, rreq, req, worker, events, choice, builder, arrived,
                               finished)
        if result is None:  # streamed, and failed after its start: told in the stream
            outcome = request.get(OUTCOME) or "worker_failure"
            return request["responses_stream"]
        served = req.routing_text(choice.served())
        outcome = "ok"
        return result
    except ApiError as err:
        outcome = "bad_request" if err.status < 500 else "error"
        raise
    except RuntimeRefused as exc:
        outcome = "bad_request"
        raise refused(exc, req) from None
    except WorkerFailure as exc:
        outcome = "worker_failure"
        fleet.metrics.failures.labels(tenant, exc.reason).inc()
        raise failure_error(exc) from None
    finally:
        if outcome == "disconnected":
            served = req.routing_text()
        fleet.release(worker, flight, served)
        request[OUTCOME] = outcome


def refused(exc: RuntimeRefused, req: GenRequest) -> ApiError:
    err = refusal_error(exc, req)
    if err.param == "messages":
        err.param = "input"
    elif err.param == "response_format":
        err.param = "text.format"
    return err


def keep(service: ResponsesService, rreq: ResponsesRequest, req: GenRequest, tenant: str,
         history: list[dict[str, Any]], done: Any, body: dict[str, Any]) -> None:
    """Store the response with its conversation (the instructions apart) and reply."""
    evicted = service.store.evicted
    service.store.put(StoredResponse(
        id=rreq.id, tenant=tenant, model=req.model, created=time.time(), body=body,
        messages=history + rreq.input_messages + reply_messages(body["output"]),
        finish_key=done.finish_key, prompt_tokens=done.prompt_tokens,
        state_tokens=state_tokens(done)))
    service.stored.labels("stored").inc()
    if service.store.evicted > evicted:
        service.stored.labels("evicted").inc(service.store.evicted - evicted)


def state_tokens(done: Any) -> int:
    """Tokens of the state at ``finish_key``: the prompt and the reply as decoded (the
    last token sampled is not decoded unless generation went on)."""
    for save in done.saves:
        if save.key == done.finish_key:
            return int(save.tokens)
    return int(done.prompt_tokens) + max(0, len(done.tokens) - 1)


async def run(request: web.Request, rreq: ResponsesRequest, req: GenRequest, worker: Any,
              events: Any, choice: Choice, builder: ResponseBuilder, arrived: float,
              finished: Callable[[Any, dict[str, Any]], Awaitable[None]]
              ) -> web.StreamResponse | None:
    """Read the runtime's events into ``builder``; stream its events when asked. At the
    final record, ``finished(done, body)`` runs before the client is answered. Returns
    the HTTP response; None for a stream that failed after it started (the failure was
    its last event). Raises before the first event, so errors keep their status."""
    fleet = request.app[FLEET]
    tenant = request["tenant"]
    response: web.StreamResponse | None = None
    assert choice.parser is not None
    try:
        async for event in events:
            if event.HasField("prompt"):  # the prompt's side: the final record has it
                continue
            if rreq.stream and response is None:
                response = web.StreamResponse(headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no"})
                await response.prepare(request)
                request["responses_stream"] = response
                fleet.metrics.ttft.labels(req.model, tenant).observe(
                    time.monotonic() - arrived)
                for e in builder.start():
                    await response.write(sse_event(e))
            if event.HasField("done"):
                check_finished(event.done, fleet)
                out = builder.feed(choice.parser.close())
                done = event.done
                account(fleet, req, tenant, done, arrived, len(done.tokens))
                extra = kvcache_details(done, worker.name, request["tenant"])
                extra["state_tokens"] = state_tokens(done)  # what a continuation reuses
                body, closing = builder.finish(done, len(done.tokens), extra)
                await finished(done, body)
                if response is None:
                    return web.json_response(body)
                for e in out + closing:
                    await response.write(sse_event(e))
                await response.write_eof()
                return response
            choice.text += event.text
            deltas = choice.parser.feed(event.text)
            builder.count_token(deltas)
            out = builder.feed(deltas)
            if response is not None:
                for e in out:
                    await response.write(sse_event(e))
        raise WorkerFailure("worker_error", "the stream ended without a final record")
    except (RuntimeRefused, WorkerFailure, ApiError) as exc:
        if response is None:
            raise
        if isinstance(exc, WorkerFailure):
            fleet.metrics.failures.labels(tenant, exc.reason).inc()
            err = failure_error(exc)
            request[OUTCOME] = "worker_failure"
        elif isinstance(exc, ApiError):
            err = exc
            request[OUTCOME] = "error"
        else:
            err = refused(exc, req)
            request[OUTCOME] = "bad_request"
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await response.write(sse_event(builder.event(
                "error", code=err.code, message=err.message, param=err.param,
                error=err.body()["error"])))
            await response.write_eof()
        return None
    except ConnectionError:
        request[OUTCOME] = "disconnected"
        return None
