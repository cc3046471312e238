"""The pipeline every API's completion goes through, written once: admission before the
body is read, the body converted at the door by the API's adapter, a slot on a worker,
the chat rendered with the worker's template, the worker's events written by the API's
formatter (:class:`Exchange`, the one place where each is written), accounting, and
however the request ends, its slot released with what the worker now holds.

Errors are answered with their status until the first token: a stream starts only with
it (or with the final record of a request that generated nothing), so a request the
runtime refuses (a prompt longer than the context) still gets its 400. A failure after
that ends the stream with the API's error event. A client that goes away cancels the
worker's call (the handler is cancelled, or its writes fail), which frees the runtime's
sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from ...chat.prompt import PromptPlan
from ...v1 import runtime_pb2 as pb
from ..errors import ApiError
from ..fleet import Fleet
from ..workers.errors import RuntimeRefused, WorkerFailure
from ..workers.slots import Flight
from ..workers.worker import Worker
from .contract import SSE_HEADERS, Call, Endpoint, Formatter
from .door import (
    FLEET,
    LARGE_BODY,
    OFFLOAD,
    OUTCOME,
    check_message_size,
    one_at_a_time,
    read_body,
)
from .prompt import render_light
from .refusals import failure_error, refusal_error
from .request import GenRequest
from .timeline import TokenPath

__all__ = ["complete", "count_tokens", "prompt_tokens"]

C = TypeVar("C", bound=Call)
# A stream's token ways go into the histogram this many at a time, and at its end.
TOKEN_PATH_BATCH = 64


async def complete(request: web.Request, endpoint: Endpoint[C]) -> web.StreamResponse:
    """One completion of any API: its whole answer, or its stream."""
    arrived = time.monotonic()
    call, large = await _converted(request, endpoint)
    req = call.request
    fleet = request.app[FLEET]
    tenant = request["tenant"]
    worker, flight = await fleet.admit(req.model, tenant, req.routing_text(), req.session_id,
                                       req.route_key, req.n)
    async with on_worker(request, call, worker, flight) as served:
        plan, proto = await _prepared(request, req, worker, large)
        formatter = endpoint.formatter(call, plan, worker.name, tenant)
        events = worker.client.events(flight, proto)
        formatter.gateway["before_worker_ms"] = round((time.monotonic() - arrived) * 1000, 3)
        async with contextlib.aclosing(events):
            return await Exchange(request, call, formatter, served, arrived).run(events)


async def count_tokens(request: web.Request, endpoint: Endpoint[C]) -> int:
    """The prompt of a request of any API in tokens, as its worker tokenizes it (nothing
    is computed: its text is not remembered for routing)."""
    return len((await prompt_tokens(request, endpoint))[1])


async def prompt_tokens(request: web.Request, endpoint: Endpoint[C]) -> tuple[C, list[int]]:
    """A request of any API and its prompt's token ids, as its worker tokenizes them
    (what a router's render call asks for; nothing is computed)."""
    call, large = await _converted(request, endpoint)
    req = call.request
    worker, flight = await request.app[FLEET].admit(
        req.model, request["tenant"], req.routing_text(), req.session_id, req.route_key,
        req.n)
    async with on_worker(request, call, worker, flight, computes=False) as served:
        _, proto = await _prepared(request, req, worker, large)
        ids = await worker.client.tokenize(flight, proto)
        served.outcome = "ok"
        return call, ids


async def _converted(request: web.Request, endpoint: Endpoint[C]) -> tuple[C, bool]:
    """The request's body read and converted by its API's adapter, and whether it was
    large (its work then waits its turn). A full server refuses before reading it."""
    request.app[FLEET].refuse_if_full(request["tenant"])
    body = await read_body(request)
    large = len(body) > LARGE_BODY
    async with one_at_a_time(request, large):
        return await endpoint.convert(request, body, large), large


async def _prepared(request: web.Request, req: GenRequest, worker: Worker,
                    large: bool) -> tuple[PromptPlan | None, pb.CompleteRequest]:
    """The chat rendered for ``worker`` (a raw prompt: None), and the runtime's request."""
    async with one_at_a_time(request, large):
        plan = await render(request, req, worker, large)
    proto = req.to_proto(plan)
    check_message_size(proto)
    return plan, proto


async def render(request: web.Request, req: GenRequest, worker: Worker,
                 large: bool) -> PromptPlan | None:
    """A chat rendered with the worker's template (prompt.render_plan), off the event
    loop: a large one, or one whose grammar is costly to build (its schemas' budget is
    checked first, prompt.render_light), in the helper process (offload.py), a small one
    on a thread. A caller that goes away (the handler is cancelled) stops it within a few
    hundred pieces of output."""
    if req.chat is None:
        return None
    info = worker.process.info
    offload = info.template_spec is not None
    if not large or not offload:
        gone = threading.Event()
        try:
            rendered, plan = await asyncio.to_thread(
                render_light, req, info.template, info.chat_format, gone.is_set,
                not offload)
        finally:
            gone.set()
        if rendered:
            return plan
    assert info.template_spec is not None
    return await request.app[OFFLOAD].render(info.template_spec, req)


@dataclass
class Served:
    """How a request on a worker ended: its outcome (``disconnected`` unless it ends
    otherwise: a cancelled handler says nothing) and the text it served (the worker's
    routing memory; None: nothing to remember)."""

    outcome: str = "disconnected"
    text: str | None = None


@contextlib.asynccontextmanager
async def on_worker(request: web.Request, call: Call, worker: Worker, flight: Flight, *,
                    computes: bool = True) -> AsyncIterator[Served]:
    """A request's time on its worker: the runtime's refusals and the worker's failures
    become the API's errors (failures counted), and however it ends its outcome is
    recorded and its slot released with the text it served. ``computes``: the request
    computes its prompt's KV, which stays on the worker even when the caller left (so
    its text is remembered for routing)."""
    fleet: Fleet = request.app[FLEET]
    served = Served()
    try:
        yield served
    except ApiError as err:
        served.outcome = "bad_request" if err.status < 500 else "error"
        raise call.rename(err) from None
    except RuntimeRefused as exc:
        served.outcome = "bad_request"
        raise call.rename(refusal_error(exc, call.request)) from None
    except WorkerFailure as exc:
        served.outcome = "worker_failure"
        fleet.metrics.failures.labels(request["tenant"], exc.reason).inc()
        raise failure_error(exc) from None
    finally:
        if served.outcome == "disconnected" and computes:
            served.text = call.request.routing_text()
        fleet.release(worker, flight, served.text)
        request[OUTCOME] = served.outcome


class Exchange:
    """One request's answer as the worker's events arrive: the prompt's account held, a
    stream started by the first token, each text event and final record handed to the
    formatter and what it makes written (:meth:`write`), the request accounted once its
    last choice is done."""

    def __init__(self, request: web.Request, call: Call, formatter: Formatter,
                 served: Served, arrived: float) -> None:
        self.request = request
        self.call = call
        self.formatter = formatter
        self.served = served
        self.arrived = arrived
        self.fleet: Fleet = request.app[FLEET]
        self.tenant: str = request["tenant"]
        self.response: web.StreamResponse | None = None  # a stream, once started
        self.prompt: pb.PromptDone | None = None  # the runtime's account of the prompt
        self.finished: list[pb.Completion] = []  # each choice's final record
        self.token_path = TokenPath()  # each streamed token's way from llama.cpp
        self._observed = 0  # of which the histogram has that many

    async def run(self, events: AsyncIterator[pb.CompleteEvent]) -> web.StreamResponse:
        """The answer. Raises before the stream starts (so errors keep their status),
        never after: a failure then is the stream's last event."""
        n = self.call.request.n
        try:
            async for event in events:
                kind = event.WhichOneof("event")
                if kind == "prompt":  # before the first token; the final record repeats it
                    self.prompt = event.prompt
                    continue
                choice = event.done.choice if kind == "done" else event.choice
                if not 0 <= choice < n:
                    raise WorkerFailure("worker_error", f"an event of choice {choice} of {n}")
                if self.response is None and self.formatter.stream:
                    await self.start(event)
                if kind == "done":
                    answer = await self.done(event.done)
                    if answer is not None:
                        return answer
                else:
                    await self.write(self.formatter.text(event))
                    if self.response is not None:
                        self.passed(event.decoded_ns)
            raise WorkerFailure("worker_error", "the stream ended without a final record")
        except (RuntimeRefused, WorkerFailure, ApiError) as exc:
            if self.response is None:
                raise
            return await self.fail(exc)
        except ConnectionError:  # the client went away while we wrote
            if self.response is None:
                raise
            self.served.outcome = "disconnected"
            return self.response
        finally:
            self.observe_token_path()

    async def write(self, data: bytes) -> None:
        """The one place where the stream is written."""
        if data and self.response is not None:
            await self.response.write(data)

    def passed(self, decoded_ns: int) -> None:
        """A streamed token's bytes are on their way to the client: its way from
        llama.cpp's scores to here, noted (timeline.py); the histogram takes the ways
        TOKEN_PATH_BATCH at a time, off the way of each token."""
        self.token_path.passed(decoded_ns, time.monotonic_ns())
        if len(self.token_path.ms) - self._observed >= TOKEN_PATH_BATCH:
            self.observe_token_path()

    def observe_token_path(self) -> None:
        """The ways noted since the last call, into the token path histogram."""
        new = self.token_path.ms[self._observed:]
        if new:
            histogram = self.fleet.metrics.token_path.labels(self.call.request.model)
            for ms in new:
                histogram.observe(ms / 1000)
            self._observed += len(new)

    async def start(self, first: pb.CompleteEvent) -> None:
        """The runtime accepted the request: from here on, errors are events."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(self.request)
        self.response = response
        self.fleet.metrics.ttft.labels(self.call.request.model, self.tenant).observe(
            time.monotonic() - self.arrived)
        # A request that ended before its first token has the prompt in its final record.
        await self.write(self.formatter.opening(
            self.prompt if self.prompt is not None else first.done))

    async def done(self, done: pb.Completion) -> web.StreamResponse | None:
        """A choice's final record; the answer once every choice's is in."""
        if done.finish_reason == "shutdown":  # cut short: the worker was being stopped
            reason = "gateway_stopping" if self.fleet.stopping else "worker_restarted"
            raise WorkerFailure(reason, "the worker was stopped during the request")
        self.finished.append(done)
        req = self.call.request
        if len(self.finished) < req.n:
            await self.write(self.formatter.choice_done(done))
            return None
        self.account()
        self.observe_token_path()
        token_path = self.token_path.summary()
        if token_path is not None:
            self.formatter.gateway["token_path_ms"] = token_path
        body, closing = self.formatter.finish(self.finished)
        await self.call.completed(self.finished[0], body)
        self.served.text = req.routing_text(self.formatter.served())
        self.served.outcome = "ok"
        if self.response is None:
            return web.json_response(body)
        await self.write(closing)
        await self.response.write_eof()
        return self.response

    def account(self) -> None:
        """Tokens by kind, and (not streamed: a stream's is observed at its first token)
        the time to the first token as the client saw it."""
        done, req = self.finished[0], self.call.request
        prompt = done.prompt_tokens
        tokens = self.fleet.metrics.tokens
        tokens.labels(req.model, self.tenant, "prompt").inc(prompt)
        tokens.labels(req.model, self.tenant, "cached").inc(
            min(done.cache_delta.tokens_read, prompt))
        tokens.labels(req.model, self.tenant, "completion").inc(
            sum(len(d.tokens) for d in self.finished))
        tokens.labels(req.model, self.tenant, "drafted").inc(
            sum(d.drafted_tokens for d in self.finished))
        tokens.labels(req.model, self.tenant, "accepted").inc(
            sum(d.accepted_tokens for d in self.finished))
        if self.response is None:
            self.fleet.metrics.ttft.labels(req.model, self.tenant).observe(
                time.monotonic() - self.arrived -
                (done.timings.total_ms - done.timings.ttft_ms) / 1000)

    async def fail(self, exc: Exception) -> web.StreamResponse:
        """A failure after the stream started: its last event, in the API's shape."""
        assert self.response is not None
        if isinstance(exc, WorkerFailure):
            self.fleet.metrics.failures.labels(self.tenant, exc.reason).inc()
            err, outcome = failure_error(exc), "worker_failure"
        elif isinstance(exc, RuntimeRefused):
            err, outcome = self.call.rename(refusal_error(exc, self.call.request)), \
                "bad_request"
        else:
            assert isinstance(exc, ApiError)
            err, outcome = exc, "bad_request" if exc.status < 500 else "error"
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await self.write(self.formatter.error(err))
            await self.response.write_eof()
        self.served.outcome = outcome
        return self.response
