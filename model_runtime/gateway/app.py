"""The gateway's web application: its middlewares, each API's routes (apis/: SGLang's
probes among them), and the gateway's own: health (also as SGLang's /health_generate),
metrics and status.

Every error is answered in the shape of the API its path belongs to (OpenAI's, Anthropic's
on /v1/messages) with the matching status, aiohttp's own (unknown path, body too large)
included. Every request is counted once, by the outermost middleware, with the status it
was answered (refusals included).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .apis.anthropic import routes as anthropic
from .apis.openai import routes as openai
from .apis.responses import routes as responses
from .apis.sglang import routes as sglang
from .errors import ApiError
from .fleet import Fleet
from .keys import Caller, is_loopback
from .metrics import NO_TENANT, TenantView
from .pipeline.door import (
    CALLER,
    CONNECTIONS,
    FLEET,
    LARGE_WORK,
    MODEL_LABEL,
    OFFLOAD,
    OUTCOME,
    unread_body_or_close,
)
from .pipeline.offload import Offload

__all__ = ["CONNECTIONS", "build_app"]

log = logging.getLogger("model_runtime.gateway")
OPEN_PATHS = frozenset({"/health"})  # probed by load balancers without credentials
API_KEY_HEADER = "x-api-key"  # Anthropic's clients send their key so
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
    if path.startswith(anthropic.PATH_PREFIX):
        return anthropic.error_response(err)
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
    openai.add_routes(app)
    anthropic.add_routes(app)
    app.router.add_get("/health", health, name="health")
    app.router.add_get("/health_generate", health, name="health_generate")  # SGLang's
    app.router.add_get("/metrics", metrics, name="metrics")
    app.router.add_get("/status", status, name="status")
    responses.add_routes(app)
    sglang.add_routes(app)
    return app


async def start_offload(app: web.Application) -> None:
    await app[OFFLOAD].start()


async def close_offload(app: web.Application) -> None:
    await asyncio.to_thread(app[OFFLOAD].close)


# --------------------------------------------------------------------------- the gateway's own


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
