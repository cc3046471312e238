"""The calls to one worker's runtime: a request's events, a prompt's tokens, and what
a call's error means (:func:`WorkerClient.classify`): the runtime refused the request
(:class:`RuntimeRefused`), or the worker failed (:class:`WorkerFailure`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import grpc
import grpc.aio

from ...config import REFUSAL_METADATA_KEY
from ...v1 import runtime_pb2 as pb
from ...v1 import runtime_pb2_grpc as pb_grpc
from .errors import RuntimeRefused, WorkerFailure
from .events import EventSink
from .process import RuntimeProcess
from .slots import Flight

__all__ = ["WorkerClient", "refusal_of"]


def refusal_of(exc: grpc.aio.AioRpcError) -> pb.Refusal:
    """The runtime's Refusal of a call (its trailing metadata); an empty one when the
    status came without it."""
    for key, value in exc.trailing_metadata() or ():
        if key == REFUSAL_METADATA_KEY and isinstance(value, bytes):
            return pb.Refusal.FromString(value)
    return pb.Refusal()


class WorkerClient:
    """Calls to the runtime ``process`` serves, on its current channel."""

    def __init__(self, process: RuntimeProcess) -> None:
        self.process = process
        self._stub: tuple[grpc.aio.Channel, pb_grpc.ModelRuntimeStub] | None = None

    def _serving_stub(self) -> pb_grpc.ModelRuntimeStub:
        """A stub on the channel of the process serving now; a failure when none is."""
        process = self.process
        channel = process.channel
        if channel is None or not process.ready:
            raise WorkerFailure("worker_restarted", f"worker {process.name} is not serving")
        if self._stub is None or self._stub[0] is not channel:  # a new process's channel
            self._stub = (channel, pb_grpc.ModelRuntimeStub(channel))
        return self._stub[1]

    async def events(self, flight: Flight,
                     request: pb.CompleteRequest) -> AsyncGenerator[pb.CompleteEvent, None]:
        """The runtime's events for ``request``. Raises :class:`WorkerFailure` when the
        worker fails meanwhile, :class:`RuntimeRefused` when the runtime refuses it.
        Closing the iterator early (a client gone) cancels the call, which frees the
        runtime's sequence. A streamed request's events come on the worker's event
        channel (events.py), its end and errors on its call."""
        stub = self._serving_stub()
        # Every call carries the tenant of the flight's API key, set here, on the one way
        # to a worker, so no route can forget it: workers serve every tenant, and a
        # caller cannot name one (a "tenant" field of a body is refused as unknown).
        request.tenant = flight.tenant
        channel = self.process.event_channel
        if channel is None or channel.closed or request.whole:
            channel_id, sink = 0, EventSink(None)
        else:
            channel_id, sink = channel.open()
            request.channel_id = channel_id
        call = stub.Complete(request)
        flight.call = call
        reading = asyncio.ensure_future(self._read_call(flight, call, sink))
        try:
            while True:
                flight.wait_since = time.monotonic()
                try:
                    event = await sink.get()
                finally:
                    flight.wait_since = None
                if event is None:
                    return
                yield event
        finally:
            if channel is not None and channel_id:
                channel.forget(channel_id)
            reading.cancel()
            call.cancel()

    async def _read_call(self, flight: Flight, call: grpc.aio.UnaryStreamCall,
                         sink: EventSink) -> None:
        """What the call says, to ``sink``: its events (a request not on the channel),
        its end, or its error."""
        try:
            while True:
                event = await call.read()
                if event is grpc.aio.EOF:
                    if sink.expected is None:
                        sink.end(sink.received)
                    return
                if event.WhichOneof("event") == "channel_end":
                    sink.end(event.channel_end)
                else:
                    sink.put(event, from_channel=False)
        except asyncio.CancelledError:
            if flight.failure is None:  # we closed the request
                raise
            sink.fail(flight.failure)  # cancelled by supervision
        except grpc.aio.AioRpcError as exc:
            sink.fail(await self.classify(flight, exc))
        except Exception as exc:  # (a bug) its reader hears of it rather than waits forever
            sink.fail(exc)

    async def tokenize(self, flight: Flight, request: pb.CompleteRequest) -> list[int]:
        """The request's prompt tokens, as the runtime tokenizes it."""
        stub = self._serving_stub()
        request.tenant = flight.tenant  # as in events()
        try:
            answer = await stub.CountTokens(request, timeout=self.process.sup.stall_window_s)
        except grpc.aio.AioRpcError as exc:
            raise await self.classify(flight, exc) from None
        return list(answer.ids)

    async def classify(self, flight: Flight, exc: grpc.aio.AioRpcError) -> Exception:
        """What a call's error means: the request's failure when supervision failed it
        first, the runtime's refusal, or the worker's failure (did its process die?)."""
        if flight.failure is not None:
            return flight.failure
        code, details = exc.code(), exc.details() or ""
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            refusal = refusal_of(exc)
            return RuntimeRefused(code, refusal.code, refusal.message or details,
                                  refusal.param)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            # gRPC's own limit on a message's size: the request's fault, not the worker's
            return RuntimeRefused(code, "request_too_large", f"The request is larger than "
                                                             f"a worker accepts ({details}).")
        # The connection broke or the runtime is going away: did the process die? The
        # supervisor learns it within a tick; wait that long for the verdict.
        name = self.process.name
        status = await self.process.exited_within(1.0)
        if status is not None:
            return WorkerFailure("worker_died", f"worker {name} exited with status {status}")
        if flight.failure is not None:
            return flight.failure
        return WorkerFailure("worker_error", f"worker {name}: {code.name}: {details}")
