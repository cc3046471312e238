"""The event channel (model_runtime/event_channel.py): a real ``model-runtime serve``
process given a socket as the gateway gives its workers one, whose model thread writes a
streamed request's events there; its framing and its backlog on real sockets."""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness.routers import free_port

from model_runtime import event_channel
from model_runtime.event_channel import EventChannel, FrameReader, frame
from model_runtime.llama_backend import LlamaModel
from model_runtime.v1 import runtime_pb2 as pb
from model_runtime.v1 import runtime_pb2_grpc as pb_grpc
from tests.support.daemon_proc import DaemonProcess
from tests.support.runtime_proc import RuntimeProcess
from tests.support.tiny_llama import sample_prompt


def read_frames(sock: socket.socket, count: int, timeout: float = 30.0
                ) -> list[tuple[int, pb.CompleteEvent]]:
    """``count`` frames from ``sock``: (channel id, event)."""
    reader, frames = FrameReader(), []
    deadline = time.monotonic() + timeout
    while len(frames) < count:
        assert select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0], \
            f"{len(frames)} of {count} frames by the deadline"
        data = sock.recv(1 << 16)
        assert data, "the channel closed"
        frames += [(cid, pb.CompleteEvent.FromString(m)) for cid, m in reader.feed(data)]
    assert len(frames) == count
    return frames


def nothing_more(sock: socket.socket, wait: float = 0.3) -> bool:
    return not select.select([sock], [], [], wait)[0]


@dataclass
class Served:
    stub: pb_grpc.ModelRuntimeStub  # on the unix socket
    tcp: pb_grpc.ModelRuntimeStub  # on its TCP listener
    ours: socket.socket  # our end of its event channel


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
           module_daemon: DaemonProcess) -> Iterator[Served]:
    """A runtime with an event channel, on a unix socket and on TCP."""
    ours, theirs = socket.socketpair()
    port = free_port()
    runtime = RuntimeProcess(tiny_model, module_daemon.address,
                             tmp_path_factory.mktemp("channel") / "runtime.log",
                             "--continued-interval", "0", "--listen", f"127.0.0.1:{port}",
                             "--insecure-tcp", event_fd=theirs.fileno())
    try:
        runtime.start()
        theirs.close()
        with grpc.insecure_channel(runtime.address) as channel, \
                grpc.insecure_channel(f"127.0.0.1:{port}") as tcp:
            yield Served(pb_grpc.ModelRuntimeStub(channel), pb_grpc.ModelRuntimeStub(tcp), ours)
    finally:
        theirs.close()
        runtime.close()
        ours.close()


@pytest.fixture(scope="module")
def prompt(tiny_model: Path) -> list[int]:
    with LlamaModel(tiny_model) as model:
        return sample_prompt(model.tokenize, 60)


def complete(tokens: list[int], **options: object) -> pb.CompleteRequest:
    request = pb.CompleteRequest(max_tokens=10, **options)  # type: ignore[arg-type]
    request.tokens.ids.extend(tokens)
    return request


def test_a_request_that_asks_has_its_events_on_the_channel_and_its_end_on_the_call(
        served: Served, prompt: list[int]) -> None:
    stub, ours = served.stub, served.ours
    on_stream = list(stub.Complete(complete(prompt), timeout=60))
    assert nothing_more(ours)  # a request that does not ask: every event on its call
    (end,) = stub.Complete(complete(prompt, channel_id=7), timeout=60)
    assert end.WhichOneof("event") == "channel_end"
    frames = read_frames(ours, end.channel_end)
    assert {cid for cid, _ in frames} == {7}
    events = [event for _, event in frames]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "prompt" and kinds[-1] == "done" and set(kinds[1:-1]) == {"text"}
    assert events[1].decoded_ns > 0  # (text held back and flushed at the end has none)
    done, before = events[-1].done, on_stream[-1].done
    assert done.text == before.text == "".join(e.text for e in events[1:-1])
    assert list(done.tokens) == list(before.tokens)
    assert done.cache_hit_kind != "cold"  # the same prompt again
    assert nothing_more(ours)


def test_every_choice_and_its_end_come_on_the_channel(
        served: Served, prompt: list[int]) -> None:
    stub, ours = served.stub, served.ours
    (end,) = stub.Complete(complete(prompt[:40], channel_id=8, n=2, temperature=0.9, seed=3),
                           timeout=60)
    events = [event for _, event in read_frames(ours, end.channel_end)]
    done = {e.done.choice: e.done for e in events if e.WhichOneof("event") == "done"}
    assert sorted(done) == [0, 1]
    for choice, record in done.items():
        assert record.text == "".join(e.text for e in events
                                      if e.WhichOneof("event") == "text" and e.choice == choice)


def test_a_refusal_comes_on_the_call_and_nothing_on_the_channel(
        served: Served, prompt: list[int]) -> None:
    stub, ours = served.stub, served.ours
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Complete(complete(prompt * 40, channel_id=9), timeout=60))  # > n_ctx
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_too_long" in (refused.value.details() or "")
    assert nothing_more(ours)


def test_a_tcp_caller_cannot_have_events_written_to_the_gateways_channel(
        served: Served, prompt: list[int]) -> None:
    """Only the unix socket's callers (its owner) may: a TCP caller's channel_id is
    ignored, or it could put text into the gateway's streams of other tenants."""
    events = list(served.tcp.Complete(complete(prompt, channel_id=1), timeout=60))
    assert events[-1].WhichOneof("event") == "done" and events[-1].done.text
    assert "channel_end" not in {e.WhichOneof("event") for e in events}
    assert nothing_more(served.ours)


def test_an_answer_read_whole_comes_on_its_call(
        served: Served, prompt: list[int]) -> None:
    stub, ours = served.stub, served.ours
    events = list(stub.Complete(complete(prompt, channel_id=10, whole=True), timeout=60))
    assert events[-1].WhichOneof("event") == "done" and events[-1].done.text
    assert nothing_more(ours)


def test_a_runtime_whose_channel_broke_sends_later_events_on_the_stream(
        tmp_path: Path, tiny_model: Path, module_daemon: DaemonProcess,
        prompt: list[int]) -> None:
    """The gateway's end gone: the request that found the channel broken has lost its
    events (its call still says how many went: the gateway fails it); the next ones
    asking for the channel have theirs on their stream."""
    ours, theirs = socket.socketpair()
    runtime = RuntimeProcess(tiny_model, module_daemon.address, tmp_path / "runtime.log",
                             event_fd=theirs.fileno())
    try:
        runtime.start()
        theirs.close()
        ours.close()
        with grpc.insecure_channel(runtime.address) as channel:
            stub = pb_grpc.ModelRuntimeStub(channel)
            (end,) = stub.Complete(complete(prompt, channel_id=1), timeout=60)
            assert end.channel_end >= 3
            events = list(stub.Complete(complete(prompt, channel_id=2), timeout=60))
            assert events[-1].WhichOneof("event") == "done" and events[-1].done.text
        assert "event channel closed" in runtime.log()
    finally:
        theirs.close()
        ours.close()
        runtime.close()


# --------------------------------------------------------------------------- framing


def test_frames_are_read_whatever_pieces_the_bytes_come_in() -> None:
    frames = [(1, b"\x01"), (1 << 40, b"ab" * 150), (0, b""), (5, b"\x05" * 5)]
    data = b"".join(frame(cid, message) for cid, message in frames)
    for size in (1, 3, 13, len(data)):
        reader = FrameReader()
        got = [f for at in range(0, len(data), size) for f in reader.feed(data[at:at + size])]
        assert got == frames


def test_a_reader_that_falls_behind_never_blocks_the_sender_and_loses_nothing() -> None:
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    channel = EventChannel(theirs)
    try:
        messages = [bytes([i % 251]) * 1000 for i in range(400)]  # ~400 KB, never read yet
        started = time.monotonic()
        for i, message in enumerate(messages):
            channel.send(frame(i, message))
        assert time.monotonic() - started < 5  # (it would block for good otherwise)
        reader, got = FrameReader(), []
        while len(got) < len(messages):
            assert select.select([ours], [], [], 10)[0]
            got += reader.feed(ours.recv(1 << 16))
        assert got == list(enumerate(messages))  # in order, all of them
        assert not channel.closed
    finally:
        channel.close()
        ours.close()


def test_a_channel_whose_reader_is_gone_drops_what_is_sent() -> None:
    ours, theirs = socket.socketpair()
    channel = EventChannel(theirs)
    ours.close()
    try:
        channel.send(frame(1, b"x"))
        channel.send(frame(2, b"y"))  # no error reaches the model thread
        assert channel.closed
    finally:
        channel.close()


def test_a_channel_never_read_is_closed_at_its_backlogs_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_channel, "MAX_BACKLOG", 1 << 16)
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    channel = EventChannel(theirs)
    try:
        for i in range(1000):
            channel.send(frame(i, b"z" * 1000))
        assert channel.closed
        ours.settimeout(10)
        while ours.recv(1 << 16):  # what was sent, then the end: the reader is told
            pass
    finally:
        channel.close()
        ours.close()


def test_a_process_without_a_channel_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_channel.EVENT_FD_ENV, raising=False)
    assert EventChannel.inherited() is None
    monkeypatch.setenv(event_channel.EVENT_FD_ENV, "not a number")
    assert EventChannel.inherited() is None
    assert event_channel.EVENT_FD_ENV not in os.environ

