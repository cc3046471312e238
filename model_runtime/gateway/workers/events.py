"""The gateway's end of a worker's event channel (model_runtime/event_channel.py): the
frames its model thread writes, read by the event loop and handed to each streamed
request's :class:`EventSink` by channel id, with what the request's gRPC call says (its
end, its refusal, the worker's failure) in order after them."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections import deque

from ...event_channel import EVENT_FD_ENV, FrameReader
from ...v1 import runtime_pb2 as pb
from .errors import WorkerFailure

__all__ = ["EVENT_FD_ENV", "ChannelReader", "EventSink", "open_channel"]


def joinable(last: pb.CompleteEvent, event: pb.CompleteEvent) -> bool:
    """Whether ``event``'s text can join the text event before it, not yet read: the
    reader fell behind, and takes what is ready in one piece (as the runtime's stream
    sends it), with when the first was decoded."""
    return (last.WhichOneof("event") == event.WhichOneof("event") == "text"
            and last.choice == event.choice
            and not last.HasField("logprob") and not event.HasField("logprob"))


class EventSink:
    """One request's events: those of the channel as they come, then the end its call
    gives (how many the channel carried) or the call's error. Event loop only."""

    def __init__(self, reader: ChannelReader | None) -> None:
        self._reader = reader  # None: every event comes on the call
        self._events: deque[pb.CompleteEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.received = 0  # messages from the channel
        self.expected: int | None = None  # how many the channel carries, once told
        self.error: BaseException | None = None

    def put(self, event: pb.CompleteEvent, *, from_channel: bool = True) -> None:
        self.received += from_channel
        if self._events and joinable(self._events[-1], event):
            last = self._events[-1]
            last.text += event.text
            last.token = event.token
        else:
            self._events.append(event)
        self.wake()

    def end(self, expected: int) -> None:
        self.expected = expected
        self.wake()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.wake()

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> pb.CompleteEvent | None:
        """The next event; None at the end. Raises the call's error after the events
        before it."""
        while True:
            if self._events:
                return self._events.popleft()
            if self.error is not None:
                raise self.error
            if self.expected is not None:
                if self.received >= self.expected:
                    return None
                if self._reader is not None and self._reader.closed:
                    raise WorkerFailure("worker_error", "the worker's event channel closed "
                                                        "before the request's events came")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


class ChannelReader(asyncio.Protocol):
    """Frames from the worker's model thread, each to its request's sink (a request no
    longer read, e.g. cancelled, has none: its frames are dropped)."""

    def __init__(self) -> None:
        self._frames = FrameReader()
        self._sinks: dict[int, EventSink] = {}
        self._ids = itertools.count(1)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.requests = 0  # requests that asked for it
        self.messages = 0  # messages it carried

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for channel_id, message in self._frames.feed(data):
            self.messages += 1
            sink = self._sinks.get(channel_id)
            if sink is not None:
                sink.put(pb.CompleteEvent.FromString(message))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for sink in self._sinks.values():
            sink.wake()  # one told its end waits no longer; the others hear from their call

    def open(self) -> tuple[int, EventSink]:
        """A new request's channel id and sink."""
        channel_id = next(self._ids)
        self.requests += 1
        sink = self._sinks[channel_id] = EventSink(self)
        return channel_id, sink

    def forget(self, channel_id: int) -> None:
        self._sinks.pop(channel_id, None)

    def status(self) -> dict[str, object]:
        return {"open": not self.closed, "requests": self.requests, "messages": self.messages}

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


async def open_channel(sock: socket.socket) -> ChannelReader:
    """Read the gateway's end ``sock`` of a worker's event channel."""
    _, reader = await asyncio.get_running_loop().connect_accepted_socket(ChannelReader, sock)
    return reader
