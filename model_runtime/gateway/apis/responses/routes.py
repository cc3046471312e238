"""The Responses API's routes: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``.

A request runs through the pipeline (pipeline/run.py) as the chat completion it amounts
to (``adapter``), its output parsed as chat's is and answered as Responses items
(``formatter``). A stored response keeps its conversation and ``finish_key``; a
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
import logging
import sqlite3
import time
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from ....v1 import runtime_pb2 as pb
from ...errors import ApiError, bad_param
from ...fleet import Fleet
from ...limits import parse_json
from ...metrics import PREFIX
from ...pipeline import run
from ...pipeline.contract import Endpoint
from ...pipeline.door import FLEET, expect_within_limit, label_model
from ...pipeline.request import GenRequest
from ..openai.adapter import SESSION_HEADER
from .adapter import ResponsesCall, ResponsesRequest, parse_responses
from .formatter import ResponsesFormatter, reply_messages, state_tokens
from .store import ResponseStore, StoredResponse

__all__ = ["add_routes"]

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
            "state was gone: prefilled again from the stored conversation)",
            ["model", "tenant", "how"], registry=registry)
        self.stored = Counter(
            f"{PREFIX}_responses_stored", "Responses stored (stored), dropped to keep the "
            "store within its bounds (evicted), or that could not be stored (failed)",
            ["event"], registry=registry)


SERVICE = web.AppKey("responses", ResponsesService)


def add_routes(app: web.Application) -> None:
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
    label_model(request, data.get("model"))
    items = data.get("input")
    if isinstance(items, list) and len(items) > fleet.settings.limits.messages:
        raise bad_param("input", f"Invalid 'input': array too long. Expected an array with "
                                 f"maximum length {fleet.settings.limits.messages} "
                                 f"(--max-messages), but got {len(items)}.",
                        code="array_above_max_length")
    return await asyncio.to_thread(parse_responses, data)


class StoringCall(ResponsesCall):
    """A Responses request that may continue a stored response (``previous``), and is
    stored once answered (unless ``store`` false)."""

    def __init__(self, responses: ResponsesRequest, request: GenRequest,
                 history: list[dict[str, Any]], previous: StoredResponse | None,
                 service: ResponsesService, tenant: str) -> None:
        super().__init__(responses, request, len(history))
        self.history = history
        self.previous = previous
        self.service = service
        self.tenant = tenant

    async def completed(self, done: pb.Completion, body: dict[str, Any]) -> None:
        """Count a continuation and store the response, before the client is told it is
        complete (a response that could not be stored is an error)."""
        service, rreq = self.service, self.responses
        if self.previous is not None:
            restored = done.cache_delta.tokens_read
            how = "state" if restored >= self.previous.state_tokens else \
                "prefix" if restored >= self.previous.prompt_tokens else "rendered"
            service.continued.labels(self.request.model, self.tenant, how).inc()
        if not rreq.store:
            return
        try:
            await asyncio.to_thread(self.keep, done, body)
        except (OSError, sqlite3.Error) as exc:
            log.error("cannot store response %s: %s", rreq.id, exc)
            service.stored.labels("failed").inc()
            raise ApiError(500, f"The response was generated but could not be stored "
                                f"({exc}); send it with store false, or ask the operator "
                                "about --responses-dir.", type="server_error",
                           code="store_failed") from None

    def keep(self, done: pb.Completion, body: dict[str, Any]) -> None:
        """Store the response with its conversation (the instructions apart) and reply."""
        store, rreq = self.service.store, self.responses
        evicted = store.evicted
        store.put(StoredResponse(
            id=rreq.id, tenant=self.tenant, model=self.request.model, created=time.time(),
            body=body, messages=self.history + rreq.input_messages +
            reply_messages(body["output"]), finish_key=done.finish_key,
            prompt_tokens=done.prompt_tokens, state_tokens=state_tokens(done)))
        self.service.stored.labels("stored").inc()
        if store.evicted > evicted:
            self.service.stored.labels("evicted").inc(store.evicted - evicted)


async def convert(request: web.Request, body: bytes, large: bool) -> StoringCall:
    """The body parsed, the previous response (if named) looked up, and the chat request
    the two amount to, each on a thread."""
    fleet = request.app[FLEET]
    service = request.app[SERVICE]
    tenant = request["tenant"]
    rreq = await parse_request(request, fleet, body)
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
    if previous is not None and previous.finish_key:
        # Resume from the stored state: the runtime takes the state's own tokens for the
        # text they stand for, so the reply is never tokenized again.
        req.parent_key = previous.finish_key
        req.continue_parent = True
    return StoringCall(rreq, req, history, previous, service, tenant)


RESPONSES = Endpoint(convert, ResponsesFormatter)


async def create_response(request: web.Request) -> web.StreamResponse:
    return await run.complete(request, RESPONSES)
