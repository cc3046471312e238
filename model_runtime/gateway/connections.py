"""The connections the gateway holds open: bounded in time while a request is read, and in
number, per client address and in total, below the file limit the process has.

Every open connection is a file. With the common limit of 1,024 files, 1,100 connections
that never finish their request used to take every file: the listener could accept no
one, whatever their key. Now:

* a request's headers must arrive within ``header_timeout_s`` of the connection's opening
  or of its previous answer (aiohttp's keep-alive timer, which also closes idle
  connections), and its body within ``body_timeout_s`` of its headers
  (:func:`model_runtime.gateway.app.read_body`: a 408). Answers are never timed: a
  streamed answer lasts as long as its generation;
* at most ``max_connections`` are open at once, and ``max_per_client`` from one address:
  one more from an address at its cap is answered ``503`` at once, without reading its
  request, and closed; one more past the total closes the connection idle longest to
  make room (a 503 only when every connection has a request in progress)
  (:class:`ConnectionGate`). The total is derived from ``RLIMIT_NOFILE`` by default (what
  the gateway's own files leave), and a larger one is refused at start-up.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

# Files the gateway keeps apart from connections: its listener, logs, the helper process,
# the workers' pipes and gRPC channels (a few per worker), the responses store, the
# daemon's socket, Python's own: 32 with two workers (idle), kept well above.
OWN_FILES = 64
FILES_PER_WORKER = 8
# Connections the listener accepts at once (its listen backlog, and how many asyncio
# accepts in one turn of the loop before any is answered: files in use meanwhile).
BACKLOG = 128
# A refused connection's input is read and dropped for up to LINGER_S after its 503
# (closing a socket with unread input resets it, and the client may lose the answer);
# at most MAX_LINGERING at once, beyond which one is closed at once.
LINGER_S = 1.0
MAX_LINGERING = 32


class ConnectionSettingsError(ValueError):
    """Connection limits that cannot be kept (the file limit leaves too little room)."""


@dataclass(frozen=True)
class ConnectionSettings:
    """``--header-timeout``, ``--body-timeout``, ``--max-connections`` and
    ``--max-connections-per-client`` (None: derived, see :func:`connection_caps`)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int | None = None
    max_per_client: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name.startswith("max"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConnectionSettingsError(f"{f.name} must be a number > 0, got {value!r}")


def file_limit() -> int:
    """The process's soft limit of open files (``ulimit -n``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_caps(settings: ConnectionSettings, workers: int,
                    files: int) -> tuple[int, int]:
    """(open connections at most, from one client address at most) for a gateway of
    ``workers`` workers whose file limit is ``files``. By default the total is what the
    limit leaves once the gateway's own files and lingering refusals are set apart, and
    one client a quarter of it; a total the limit cannot hold is an error."""
    room = files - OWN_FILES - FILES_PER_WORKER * workers - BACKLOG - MAX_LINGERING
    if room < 1:
        raise ConnectionSettingsError(
            f"the file limit of {files} open files (ulimit -n) leaves no room for "
            f"connections beside the gateway's own files; raise it")
    total = settings.max_connections or room
    if total > room:
        raise ConnectionSettingsError(
            f"--max-connections {total} is more than the file limit allows: {files} open "
            f"files (ulimit -n) leave room for {room} connections beside the gateway's own "
            f"files; raise the limit or lower --max-connections")
    per_client = min(settings.max_per_client or max(1, total // 4), total)
    return total, per_client


def refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error format, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "server_error",
                                 "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n")
    return head.encode() + body


class ConnectionGate:
    """The listener's protocol factory, and the count of open connections. Each new
    connection is counted, then served by a protocol of ``serve`` (aiohttp's request
    handler). Over the cap of its address it is answered 503 and closed; over the total,
    the connection idle longest (no request in progress: one that has not sent its
    headers yet, or a keep-alive one between requests) is closed to make room, and only
    when every connection has a request in progress is the new one answered 503. So
    connections that never finish a request, from however many addresses, cannot keep a
    client that sends its request out. The app says when a connection's request starts
    and ends (:meth:`busy`, :meth:`done`)."""

    def __init__(self, serve: Callable[[], asyncio.Protocol], total: int, per_client: int,
                 on_closed: Callable[[str], None]) -> None:
        self.serve = serve
        self.total = total
        self.per_client = per_client
        self.on_closed = on_closed  # why a connection was refused or closed: "per_client",
        # "total" (503s), "idle" (closed to make room)
        self.open = 0
        self.lingering = 0
        self.by_client: dict[str, int] = {}
        self.idle: dict[_Gated, None] = {}  # oldest first
        self.by_transport: dict[Any, _Gated] = {}

    def __call__(self) -> asyncio.Protocol:
        return _Gated(self)

    def admit(self, conn: _Gated) -> str | None:
        """Count ``conn``, or say why not ("total", "per_client")."""
        if self.by_client.get(conn.client, 0) >= self.per_client:
            return "per_client"
        if self.open >= self.total:
            if not self.idle:
                return "total"
            oldest = next(iter(self.idle))
            self.release(oldest)
            self.on_closed("idle")
            oldest.transport.close()
        self.open += 1
        self.by_client[conn.client] = self.by_client.get(conn.client, 0) + 1
        self.idle[conn] = None
        self.by_transport[conn.transport] = conn
        conn.counted = True
        return None

    def release(self, conn: _Gated) -> None:
        if not conn.counted:
            return
        conn.counted = False
        self.open -= 1
        left = self.by_client[conn.client] - 1
        if left:
            self.by_client[conn.client] = left
        else:
            del self.by_client[conn.client]
        self.idle.pop(conn, None)
        self.by_transport.pop(conn.transport, None)

    def busy(self, transport: Any) -> None:
        """A request on ``transport`` started: its connection is not idle."""
        conn = self.by_transport.get(transport)
        if conn is not None:
            self.idle.pop(conn, None)

    def done(self, transport: Any) -> None:
        """Its request ended: idle again, now the youngest."""
        conn = self.by_transport.get(transport)
        if conn is not None:
            self.idle[conn] = None


class _Gated(asyncio.Protocol):
    """One connection: passed through to the served protocol once admitted; refused
    otherwise (its input dropped until the client closes, ``LINGER_S`` at most)."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.client = ""
        self.transport: Any = None
        self.counted = False
        self.inner: asyncio.Protocol | None = None
        self.linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.transport = transport
        reason = self.gate.admit(self)
        if reason is None:
            self.inner = self.gate.serve()
            self.inner.connection_made(transport)
            return
        self.gate.on_closed(reason)
        whose = "this server's" if reason == "total" else "your address's"
        transport.write(refusal(503, "Service Unavailable",
                                f"Too many open connections ({whose} limit); retry later.",
                                "too_many_connections"))
        gate = self.gate
        if gate.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        gate.lingering += 1
        transport.write_eof()
        self.linger = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            return self.inner.eof_received()
        return None  # refused: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.gate.release(self)
            self.inner.connection_lost(exc)
        elif self.linger is not None:
            self.linger.cancel()
            self.gate.lingering -= 1

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
