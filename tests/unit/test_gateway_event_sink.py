"""The gateway's end of a worker's event channel (gateway/workers/events.py) on a real
socket pair: frames to each request's sink, text that waits joined, the call's end and
errors after the events, a channel that closes too early."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from model_runtime.event_channel import frame
from model_runtime.gateway.workers.errors import WorkerFailure
from model_runtime.gateway.workers.events import ChannelReader, EventSink, open_channel
from model_runtime.v1 import runtime_pb2 as pb


def text(piece: str, token: int, decoded_ns: int, choice: int = 0) -> bytes:
    return pb.CompleteEvent(text=piece, token=token, decoded_ns=decoded_ns,
                            choice=choice).SerializeToString()


@contextlib.asynccontextmanager
async def channel() -> AsyncIterator[tuple[ChannelReader, socket.socket]]:
    """The gateway's reader of a socket pair, and the worker's end to write."""
    ours, theirs = socket.socketpair()
    reader = await open_channel(ours)
    try:
        yield reader, theirs
    finally:
        reader.close()
        theirs.close()


async def received(reader: ChannelReader, count: int) -> None:
    while reader.messages < count:
        await asyncio.sleep(0.01)


async def drain(sink: EventSink) -> list[pb.CompleteEvent]:
    events = []
    while (event := await asyncio.wait_for(sink.get(), 10)) is not None:
        events.append(event)
    return events


def test_frames_reach_their_sinks_and_text_that_waits_is_joined() -> None:
    async def run() -> None:
        async with channel() as (reader, theirs):
            (a_id, a), (b_id, b) = reader.open(), reader.open()
            logprob = pb.CompleteEvent(text="!", token=9, logprob=pb.TokenLogprob(logprob=-1))
            theirs.sendall(b"".join([
                frame(a_id, text("Hel", 1, 100)), frame(b_id, text("x", 5, 7)),
                frame(a_id, text("lo", 2, 200)), frame(a_id, logprob.SerializeToString()),
                frame(a_id, text(" you", 3, 300)), frame(999, text("gone", 4, 1))]))
            await received(reader, 6)
            a.end(4)
            b.end(1)
            first, with_logprob, last = await drain(a)
            # Ready at once: one event, the first token's decode time (its way's start).
            assert (first.text, first.token, first.decoded_ns) == ("Hello", 2, 100)
            assert with_logprob.HasField("logprob")  # never joined: its own logprob
            assert (last.text, last.decoded_ns) == (" you", 300)
            assert [e.text for e in await drain(b)] == ["x"]
            assert reader.status() == {"open": True, "requests": 2, "messages": 6}

    asyncio.run(run())


def test_the_calls_error_comes_after_the_events_before_it() -> None:
    async def run() -> None:
        async with channel() as (reader, theirs):
            channel_id, sink = reader.open()
            theirs.sendall(frame(channel_id, text("a", 1, 1)))
            await received(reader, 1)
            sink.fail(WorkerFailure("worker_died", "exited with status -9"))
            assert (await sink.get()).text == "a"  # type: ignore[union-attr]
            with pytest.raises(WorkerFailure, match="worker_died"):
                await sink.get()

    asyncio.run(run())


def test_a_channel_that_closes_before_the_events_its_call_counted_fails_the_request() -> None:
    async def run() -> None:
        async with channel() as (reader, theirs):
            channel_id, sink = reader.open()
            theirs.sendall(frame(channel_id, text("a", 1, 1)))
            theirs.close()
            while not reader.closed:
                await asyncio.sleep(0.01)
            sink.end(3)  # the call says 3 went on the channel; 1 came
            assert (await sink.get()).text == "a"  # type: ignore[union-attr]
            with pytest.raises(WorkerFailure, match="event channel closed"):
                await asyncio.wait_for(sink.get(), 10)

    asyncio.run(run())


def test_a_sink_without_a_channel_ends_with_its_call() -> None:
    async def run() -> None:
        sink = EventSink(None)
        sink.put(pb.CompleteEvent(text="a"), from_channel=False)
        sink.put(pb.CompleteEvent(text="b"), from_channel=False)
        sink.end(sink.received)  # the call's EOF
        assert [e.text for e in await drain(sink)] == ["ab"]

    asyncio.run(run())
