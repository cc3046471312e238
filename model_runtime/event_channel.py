"""The event channel: a stream socket between the gateway and a worker it started, on
which the model thread writes a streamed request's events itself, framed with the
request's channel id, rather than hand them to a gRPC stream's thread.

Why: a token sent on a gRPC stream wakes a thread of the runtime's server to send it
(the GIL, the message, gRPC's completion queue), then gRPC's threads in the gateway, then
its event loop, each on two cores that llama.cpp's threads keep busy. Written here, it
wakes the gateway's event loop alone: one ``send`` on the model thread, no thread of the
runtime woken at all. The gRPC call still carries the request, its refusal or failure,
its cancellation, and its end (how many events went on the channel).

The gateway gives the socket to the worker it starts as an inherited descriptor named by
``MODEL_RUNTIME_EVENT_FD`` (as systemd's LISTEN_FDS names a listening socket), so no one
else can write to it. Frames: request id (u64), length (u32), a serialized
``CompleteEvent``; little-endian.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .request import Completion, EventQueue, PromptDone, RequestError, TokenEvent

log = logging.getLogger("model_runtime")

EVENT_FD_ENV = "MODEL_RUNTIME_EVENT_FD"
HEADER = struct.Struct("<QI")
# A backlog beyond this (the gateway stopped reading for good) closes the channel: its
# requests then end with the gateway's own failure of the worker, not with our memory.
MAX_BACKLOG = 64 << 20


def frame(channel_id: int, message: bytes) -> bytes:
    return HEADER.pack(channel_id, len(message)) + message


class FrameReader:
    """The frames in a byte stream fed in arbitrary pieces (pure: no I/O)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """(channel id, message) of every frame completed by ``data``."""
        buffer = self._buffer
        buffer += data
        at = 0
        while len(buffer) - at >= HEADER.size:
            channel_id, length = HEADER.unpack_from(buffer, at)
            end = at + HEADER.size + length
            if end > len(buffer):
                break
            yield channel_id, bytes(buffer[at + HEADER.size:end])
            at = end
        del buffer[:at]


class EventChannel:
    """The runtime's end. :meth:`send` never blocks its caller (the model thread): what the
    socket does not take at once waits in a backlog that a writer thread sends as the
    gateway reads, so frames stay in order. A broken channel drops what is sent to it."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()
        self._backlog_ready = threading.Condition(self._lock)
        self._backlog = bytearray()
        self.closed = False
        self._writer = threading.Thread(target=self._write_backlog, name="event-channel",
                                        daemon=True)
        self._writer.start()

    @classmethod
    def inherited(cls) -> EventChannel | None:
        """The channel the gateway gave this process (``MODEL_RUNTIME_EVENT_FD``), if any;
        the variable is removed so that no child of ours sees it."""
        fd = os.environ.pop(EVENT_FD_ENV, "")
        if not fd:
            return None
        try:
            return cls(socket.socket(fileno=int(fd)))
        except (ValueError, OSError) as exc:
            log.warning("%s=%s is not a socket (%s): events go on the gRPC stream",
                        EVENT_FD_ENV, fd, exc)
            return None

    def send(self, data: bytes) -> None:
        with self._lock:
            if self.closed:
                return
            if not self._backlog:
                try:
                    data = data[self._sock.send(data):]
                except BlockingIOError:
                    pass
                except OSError as exc:
                    self._break(exc)
                    return
                if not data:
                    return
            self._backlog += data
            if len(self._backlog) > MAX_BACKLOG:
                self._break(RuntimeError(f"{len(self._backlog)} bytes unread"))
                return
            self._backlog_ready.notify()

    def _break(self, exc: BaseException) -> None:
        """Lock held. The gateway sees the channel end: a request whose events were lost
        fails rather than waits for them; later requests go on their gRPC stream."""
        if not self.closed:
            log.warning("event channel closed: %s", exc)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self.closed = True
        self._backlog.clear()
        self._backlog_ready.notify()

    def _write_backlog(self) -> None:
        while True:
            with self._lock:
                while not self._backlog and not self.closed:
                    self._backlog_ready.wait()
                if self.closed:
                    return
                chunk = bytes(self._backlog[:1 << 16])
            try:
                select.select([], [self._sock], [], 1.0)
                sent = self._sock.send(chunk)
            except BlockingIOError:
                sent = 0
            except (OSError, ValueError) as exc:
                with self._lock:
                    self._break(exc)
                return
            with self._lock:
                del self._backlog[:sent]

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._backlog_ready.notify()
        self._writer.join(timeout=2)
        self._sock.close()


class ChannelEvents(EventQueue):
    """The events of a request whose reader takes them from the event channel: each is
    written there as it is put (``encode`` makes its messages), by whoever puts it. What
    its gRPC call still needs goes into the queue too: the final records (the call ends
    after the last choice's) and a failure (the call's refusal). ``sent``: messages
    written."""

    def __init__(self, channel: EventChannel, channel_id: int,
                 encode: Callable[[Any], list[bytes]]) -> None:
        super().__init__()
        self._channel = channel
        self._id = channel_id
        self._encode = encode
        self._sending = threading.Lock()  # one writer at a time keeps `sent` and order
        self.sent = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, (PromptDone, TokenEvent, Completion)):
            with self._sending:
                try:
                    messages = self._encode(item)
                except Exception as exc:
                    # Put by the model thread, often after the request was released: an
                    # event that cannot be encoded (a bug) must end the call with an
                    # error, not leave its caller waiting for an end that never comes.
                    log.exception("an event of channel request %d could not be encoded",
                                  self._id)
                    super().put(RequestError("internal", f"internal error: {exc!r}"))
                    return
                self._channel.send(b"".join(frame(self._id, m) for m in messages))
                self.sent += len(messages)
            if not isinstance(item, Completion):
                return
        super().put(item, block, timeout)

    def put_watched(self, item: Any) -> int | None:
        self.put(item)
        return None  # sent already: nothing to wait for after the step
