"""The HTTP routes: OpenAI's completions and models, health, metrics and status.

Every error is answered in OpenAI's format with the matching status. A streamed response
starts only with the first token, so a request the runtime refuses (a prompt longer than
the context) still gets its 400; a failure after that ends the stream with an error event
(which OpenAI's client raises) and no ``[DONE]``. Every request is counted once, by the
outermost middleware, with the status it was answered (refusals included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import HttpVersion11, StreamReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..chat.prompt import PromptPlan
from ..config import MAX_REQUEST_MESSAGE_BYTES
from .apis.anthropic.adapter import error_body as anthropic_error_body
from .apis.openai.adapter import SESSION_HEADER
from .apis.openai.formatter import (
    DONE,
    Choice,
    chunk,
    finish_reason,
    kvcache_details,
    response_body,
    sse,
    usage,
)
from .connections import ConnectionGate
from .errors import ApiError
from .fleet import Fleet
from .keys import Caller, is_loopback
from .limits import too_large
from .metrics import NO_TENANT, TenantView
from .pipeline.offload import Offload, parse_request, render_light
from .pipeline.request import PROTO_FIELDS, GenRequest
from .workers.errors import RuntimeRefused, WorkerFailure
from .workers.worker import Worker

log = logging.getLogger("model_runtime.gateway")
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
OPEN_PATHS = frozenset({"/health"})  # probed by load balancers without credentials
API_KEY_HEADER = "x-api-key"  # Anthropic's clients send their key so
ANTHROPIC_PATHS = "/v1/messages"  # answered in Anthropic's error shape

# What a handler leaves on its request for the count: the model label, and the outcome
# when the status alone does not tell it (a stream that failed after its 200).
MODEL_LABEL = "count_model"
OUTCOME = "count_outcome"
CLIENT_GONE = 499  # no answer: the client went away first (nginx counts it so)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    return {401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "too_large",
            408: "timeout", 429: "no_slot", 503: "not_ready", 529: "not_ready",
            CLIENT_GONE: "disconnected"}.get(status, "bad_request" if status < 500 else "error")


def endpoint_of(request: web.Request) -> str:
    """The route's name (its path pattern if unnamed): bounded, whatever paths callers
    make up; "unknown" for a path no route serves."""
    resource = request.match_info.route.resource  # None: no route (404, 405)
    if resource is None:
        return "unknown"
    return resource.name or resource.canonical


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every request once, by model, endpoint, outcome and the status answered.
    Outermost: it sees the answers the other middlewares make of refusals."""
    status = CLIENT_GONE  # unless an answer comes: the handler was cancelled
    connections = request.app.get(CONNECTIONS)
    if connections is not None:  # (its connection is not idle meanwhile)
        connections.busy(request.transport)
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # a redirect (errors are answered by openai_errors)
        status = exc.status
        raise
    finally:
        if connections is not None:
            connections.done(request.transport)
        outcome = request.get(OUTCOME) or outcome_of(status)
        request.app[FLEET].metrics.requests.labels(
            request.get(MODEL_LABEL, ""), request.get("tenant", NO_TENANT),
            endpoint_of(request), outcome, str(status)).inc()


def error_response(err: ApiError, path: str = "") -> web.Response:
    """OpenAI's error body, or Anthropic's on the Anthropic Messages API's paths."""
    if path.startswith(ANTHROPIC_PATHS):
        status, body = anthropic_error_body(err)
        return web.json_response(body, status=status, headers=err.headers)
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors in OpenAI's format (Anthropic's on its paths), aiohttp's own (unknown path,
    body too large) included."""
    try:
        return await handler(request)
    except ApiError as err:
        return await unread_body_or_close(request, error_response(err, request.path))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed",
                413: "request_too_large"}.get(exc.status)
        return await unread_body_or_close(request, error_response(ApiError(
            exc.status, exc.reason if exc.status != 404 else
            f"No route for {request.method} {request.path}.", code=code), request.path))
    except Exception:  # a bug: logged with its traceback, answered in the same format
        log.exception("error serving %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal error in the gateway (logged).",
                                       type="server_error", code="internal_error"),
                              request.path)


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


@web.middleware
async def api_keys(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who the caller is (:class:`Caller`): the tenant and role of its key; without a key
    file, the default tenant, an operator when it calls from loopback."""
    fleet = request.app[FLEET]
    if fleet.keys is None or request.path in OPEN_PATHS:
        caller: Caller | None = Caller(fleet.settings.default_tenant,
                                       admin=fleet.keys is None and peer_on_loopback(request))
    else:
        caller = fleet.keys.caller_of(authorization(request))
    if caller is None:
        given = "Authorization" in request.headers or API_KEY_HEADER in request.headers
        raise ApiError(401, "Incorrect API key provided." if given else
                       "You didn't provide an API key (Authorization: Bearer KEY, or "
                       "x-api-key: KEY).", code="invalid_api_key")
    request[CALLER] = caller
    request["tenant"] = caller.tenant
    return await handler(request)


def authorization(request: web.Request) -> str | None:
    """The caller's key as a bearer credential: ``Authorization``, else Anthropic's
    ``x-api-key`` header."""
    header = request.headers.get("Authorization")
    if header is None and API_KEY_HEADER in request.headers:
        return f"Bearer {request.headers[API_KEY_HEADER]}"
    return header


def peer_on_loopback(request: web.Request) -> bool:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return isinstance(peer, tuple) and is_loopback(str(peer[0]))


def require_operator(request: web.Request) -> None:
    if not request[CALLER].admin:
        raise ApiError(403, "This view is for the gateway's operator: use a key marked "
                            "role=admin in the key file (without a key file: call from "
                            "loopback).", type="permission_error", code="operator_only")


def build_app(fleet: Fleet) -> web.Application:
    app = web.Application(middlewares=[count_requests, openai_errors, api_keys],
                          client_max_size=fleet.settings.limits.body_bytes)
    app[FLEET] = fleet
    app[LARGE_WORK] = asyncio.Semaphore(1)
    app[OFFLOAD] = Offload()
    app.on_startup.append(start_offload)
    app.on_cleanup.append(close_offload)
    # Route names are the endpoint label of the request count.
    app.router.add_post("/v1/chat/completions", chat_completions, name="chat",
                        expect_handler=expect_within_limit)
    app.router.add_post("/v1/completions", completions, name="text",
                        expect_handler=expect_within_limit)
    app.router.add_get("/v1/models", list_models, name="models")
    app.router.add_get("/v1/models/{model:.+}", get_model, name="model")
    from .apis.anthropic.routes import add_routes  # it builds on this module's handlers

    add_routes(app)
    app.router.add_get("/health", health, name="health")
    app.router.add_get("/metrics", metrics, name="metrics")
    app.router.add_get("/status", status, name="status")
    from .apis.responses.routes import add_responses_routes  # its handlers use this module's

    add_responses_routes(app)
    return app


async def start_offload(app: web.Application) -> None:
    await app[OFFLOAD].start()


async def close_offload(app: web.Application) -> None:
    await asyncio.to_thread(app[OFFLOAD].close)


# --------------------------------------------------------------------------- small routes


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[FLEET].models()})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for model in request.app[FLEET].models():
        if model["id"] == name:
            return web.json_response(model)
    raise ApiError(404, f"The model '{name}' does not exist.", param="model",
                   code="model_not_found")


async def health(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    ready = sum(w.ready for w in fleet.workers)
    body = {"status": "ok" if ready else "unavailable", "workers_ready": ready,
            "workers": len(fleet.workers)}
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    """Every tenant's numbers for the operator; a tenant's key, its own tenant's only (a
    tenant must not watch another's requests, tokens or cache hits). Without a key file
    there is no tenant's credential: the operator's (loopback) only."""
    caller: Caller = request[CALLER]
    if request.app[FLEET].keys is None:
        require_operator(request)
    registry = request.app[FLEET].metrics.registry
    data = generate_latest(registry if caller.admin else TenantView(registry, caller.tenant))
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status(request: web.Request) -> web.Response:
    require_operator(request)  # every worker's tenant, pid, socket, counters and logs
    return web.json_response(request.app[FLEET].status())


# --------------------------------------------------------------------------- completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await complete(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await complete(request, "text")


def refusal_error(exc: RuntimeRefused, req: GenRequest) -> ApiError:
    if exc.code == "request_too_large":
        return ApiError(413, exc.message, code="request_too_large")
    if exc.code == "prompt_too_long":
        return ApiError(400, f"This model's maximum context length is exceeded: "
                             f"{exc.message}.", param="messages" if req.endpoint == "chat"
                        else "prompt", code="context_length_exceeded")
    if exc.status == grpc.StatusCode.FAILED_PRECONDITION:  # sticky_busy
        return ApiError(409, f"{exc.code}: {exc.message}", param="session_id",
                        code="session_busy")
    # The runtime names the setting it refused first ("grammar is not valid GBNF: ...",
    # "n 4 needs 4 sequences at once ...").
    setting = exc.message.replace(":", " ").replace(",", " ").split(" ", 1)[0]
    param = {"penalty_last_n": "repeat_last_n"}.get(setting, setting)
    chat = req.chat
    if setting == "grammar" and chat is not None and chat.grammar is None:  # ours
        param = "tool_choice" if chat.tools and chat.tool_choice.mode != "none" else \
            "response_format"
    return ApiError(400, exc.message, param=param if setting in PROTO_FIELDS else None,
                    code="invalid_value")


def failure_error(exc: WorkerFailure) -> ApiError:
    return ApiError(503, f"The request failed: {exc.detail} ({exc.reason}; it was not "
                         "retried).", type="server_error", code=exc.reason)


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


async def render(request: web.Request, req: GenRequest, worker: Worker,
                 large: bool) -> PromptPlan | None:
    """A chat rendered with the worker's template (:func:`render_plan`), off the event
    loop: a large one, or one whose grammar is costly to build (its schemas' budget is
    checked first, :func:`render_light`), in the helper process (:mod:`.offload`), a
    small one on a thread. A caller that goes away (the handler is cancelled) stops it
    within a few hundred pieces of output."""
    if req.chat is None:
        return None
    offload = worker.process.info.template_spec is not None
    if not large or not offload:
        gone = threading.Event()
        try:
            rendered, plan = await asyncio.to_thread(
                render_light, req, worker.process.info.template, worker.process.info.chat_format, gone.is_set,
                not offload)
        finally:
            gone.set()
        if rendered:
            return plan
    assert worker.process.info.template_spec is not None
    return await request.app[OFFLOAD].render(worker.process.info.template_spec, req)


@dataclass
class Served:
    """How a request on a worker ended: its outcome (``disconnected`` unless it ends
    otherwise: a cancelled handler says nothing) and the text it served (the worker's
    routing memory; None: nothing to remember)."""

    outcome: str = "disconnected"
    text: str | None = None


@contextlib.asynccontextmanager
async def on_worker(request: web.Request, req: GenRequest, worker: Worker, flight: Any, *,
                    computes: bool = True) -> AsyncIterator[Served]:
    """A request's time on its worker, for every route: the runtime's refusals and the
    worker's failures become API errors (failures counted), and however it ends its
    outcome is recorded and its slot released with the text it served. ``computes``: the
    request computes its prompt's KV, which stays on the worker even when the caller
    left (so its text is remembered for routing)."""
    served = Served()
    try:
        yield served
    except ApiError:
        served.outcome = "bad_request"
        raise
    except RuntimeRefused as exc:
        served.outcome = "bad_request"
        raise refusal_error(exc, req) from None
    except WorkerFailure as exc:
        served.outcome = "worker_failure"
        request.app[FLEET].metrics.failures.labels(request["tenant"], exc.reason).inc()
        raise failure_error(exc) from None
    finally:
        if served.outcome == "disconnected" and computes:
            served.text = req.routing_text()
        request.app[FLEET].release(worker, flight, served.text)
        request[OUTCOME] = served.outcome


async def complete(request: web.Request, endpoint: str) -> web.StreamResponse:
    fleet = request.app[FLEET]
    arrived = time.monotonic()
    fleet.refuse_if_full(request["tenant"])  # before reading: a full server reads nothing
    body = await read_body(request)
    large = len(body) > LARGE_BODY
    # Parsed off the event loop (bounded by the body limit): a large body in the helper
    # process, whose GIL is not the event loop's; a small one on a thread.
    async with one_at_a_time(request, large):
        session = request.headers.get(SESSION_HEADER)
        is_json, model, req = await (request.app[OFFLOAD].parse(body, fleet.settings.limits,
                                                       endpoint, session) if large else
                            asyncio.to_thread(parse_request, body, fleet.settings.limits,
                                              endpoint, session))
    del body
    if is_json:  # labels only of served models: a caller must not grow the metrics
        request[MODEL_LABEL] = model if isinstance(model, str) and \
            model in fleet.model_names() else "unknown"
    if isinstance(req, ApiError):
        raise req
    worker, flight = await fleet.admit(req.model, request["tenant"], req.routing_text(),
                                       req.session_id, req.route_key, req.n)
    async with on_worker(request, req, worker, flight) as served:
        async with one_at_a_time(request, large):
            prompt = await render(request, req, worker, large)
        proto = req.to_proto(prompt)
        check_message_size(proto)
        choices = [Choice(i, prompt.parser() if prompt is not None else None)
                   for i in range(req.n)]
        events = worker.client.events(flight, proto)
        async with contextlib.aclosing(events):
            if req.stream:
                response, served.text, served.outcome = await stream(
                    request, req, worker, events, choices, arrived)
                return response
            finished: list[Any] = []
            async for event in events:  # text pieces, then a final record per choice
                if event.HasField("prompt"):  # the prompt's side: the final record has it
                    continue
                choice = choices[choice_of(event, len(choices))]
                if event.HasField("done"):
                    check_finished(event.done, fleet)
                    choice.close()
                    finished.append(event.done)
                    if len(finished) < len(choices):
                        continue
                    done = finished[0]
                    generated = sum(len(d.tokens) for d in finished)
                    account(fleet, req, request["tenant"], done, arrived, generated)
                    served.text = req.routing_text(choices[0].served())
                    served.outcome = "ok"
                    return web.json_response(response_body(
                        req, choices, finished, kvcache_details(done, worker.name,
                                                                request["tenant"]), generated))
                choice.feed(event.text)
                if event.HasField("logprob"):
                    choice.logprobs.append(event.logprob)
            raise WorkerFailure("worker_error", "the stream ended without a final record")


def choice_of(event: Any, n: int) -> int:
    """The choice an event belongs to (the runtime numbers them from 0)."""
    index = int(getattr(event.done if event.HasField("done") else event, "choice", 0))
    if not 0 <= index < n:
        raise WorkerFailure("worker_error", f"an event of choice {index} of {n}")
    return index


def check_finished(done: Any, fleet: Fleet) -> None:
    """A final record cut short because the worker was being stopped is a failure."""
    if done.finish_reason == "shutdown":
        reason = "gateway_stopping" if fleet.stopping else "worker_restarted"
        raise WorkerFailure(reason, "the worker was stopped during the request")


def account(fleet: Fleet, req: GenRequest, tenant: str, done: Any, arrived: float,
            completion_tokens: int) -> None:
    u = usage(done, completion_tokens)
    tokens = fleet.metrics.tokens
    tokens.labels(req.model, tenant, "prompt").inc(u["prompt_tokens"])
    tokens.labels(req.model, tenant, "cached").inc(
        u["prompt_tokens_details"]["cached_tokens"])
    tokens.labels(req.model, tenant, "completion").inc(u["completion_tokens"])
    if not req.stream:  # streamed: observed at the first token itself
        fleet.metrics.ttft.labels(req.model, tenant).observe(
            time.monotonic() - arrived - (done.timings.total_ms - done.timings.ttft_ms) / 1000)


async def stream(request: web.Request, req: GenRequest, worker: Worker, events: Any,
                 choices: list[Choice], arrived: float
                 ) -> tuple[web.StreamResponse, str | None, str]:
    """Server-sent events. Returns the response, the text served (for routing) and the
    outcome. Raises before the first event (so errors keep their status), never after."""
    fleet = request.app[FLEET]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    chat = req.endpoint == "chat"
    first = True
    finished: list[Any] = []
    try:
        async for event in events:
            if event.HasField("prompt"):  # the prompt's side: the final record has it
                continue
            if first:  # the runtime accepted the request: from here on, errors are events
                await response.prepare(request)
                fleet.metrics.ttft.labels(req.model, request["tenant"]).observe(
                    time.monotonic() - arrived)
                if chat:  # OpenAI's first chunk names the role
                    for choice in choices:
                        await response.write(sse(chunk(req, "", first=True,
                                                       index=choice.index)))
                first = False
            choice = choices[choice_of(event, len(choices))]
            if event.HasField("done"):
                check_finished(event.done, fleet)
                for delta in choice.close():
                    await response.write(sse(chunk(req, delta=delta, index=choice.index)))
                finished.append(event.done)
                last = len(finished) == len(choices)
                done = finished[0]
                generated = sum(len(d.tokens) for d in finished)
                # kvcache's details ride on the last chunk: the usage chunk when asked for
                # (where clients read usage), else the last finish_reason chunk.
                extra = kvcache_details(done, worker.name, request["tenant"])
                await response.write(sse(chunk(
                    req, finish=finish_reason(event.done, choice.has_tool_calls),
                    index=choice.index, extra=extra if last and not req.include_usage
                    else None)))
                if not last:
                    continue
                account(fleet, req, request["tenant"], done, arrived, generated)
                if req.include_usage:
                    await response.write(sse(chunk(req, usage_body=usage(done, generated),
                                                   extra=extra)))
                await response.write(DONE)
                await response.write_eof()
                return response, req.routing_text(choices[0].served()), "ok"
            logprobs = choice.logprobs_body([event.logprob], chat) \
                if event.HasField("logprob") else None
            pieces = choice.feed(event.text)
            if not pieces and logprobs is not None:
                pieces = [{}] if chat else [{"text": ""}]
            for piece in pieces:
                if chat:
                    body = chunk(req, delta=piece, index=choice.index, logprobs=logprobs)
                else:
                    body = chunk(req, piece["text"], index=choice.index, logprobs=logprobs)
                logprobs = None  # the token's logprobs ride on its first chunk
                await response.write(sse(body))
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
            await response.write(sse(err.body()))
            await response.write_eof()
        outcome = "worker_failure" if isinstance(exc, WorkerFailure) else "bad_request"
        return response, None, outcome
    except ConnectionError:  # the client went away while we wrote
        return response, None, "disconnected"
