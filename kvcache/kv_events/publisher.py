"""EventPublisher: a BlockTable's changes published over ZMQ as vLLM publishes its KV
events, with vLLM's replay protocol.

* Events: an XPUB socket bound at ``endpoint`` (SUB subscribers connect to it as to
  vLLM's PUB). One thread owns the sockets and the table: every ``flush_s`` it takes the
  source's changes and publishes one batch per topic that has events.
* Sequence numbers go up by one per batch and start, at each start-up, from the wall clock
  in nanoseconds: a restarted publisher continues above its last number (Dynamo's
  indexer ignores batches numbered below the last it applied, silently).
* Start-up: the first batch is a snapshot, ``AllBlocksCleared`` and then every block held
  (on ``TOPIC_ALL``), so a subscriber that knew this publisher before forgets what went
  while it was down.
* A new subscription (a router started or reconnected) gets a fresh snapshot, at most one
  a second: a router that restarts recovers through this re-announce, and through replay.
* Replay (``replay_endpoint``, a ROUTER socket): a request ``[identity, "", start]`` is
  answered with every buffered batch numbered ``start`` or later, each as ``[identity,
  "", seq, payload]``, then ``[identity, "", -1, ""]``. A start older than the buffer (the
  last ``replay_batches``) first gets a snapshot, numbered just below the oldest batch
  buffered: applied in order, the snapshot and the batches after it give the current
  state whatever the subscriber held.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import zmq

from .blocks import BlockTable
from .wire import LAYOUTS, TOPIC_ALL, Cleared, Event, encode_batch, frames

log = logging.getLogger("kvcache.kv_events")
REANNOUNCE_INTERVAL_S = 1.0


class Source(Protocol):
    """What a publisher publishes: a table's holders (the daemon's entries, a runtime's
    sequences). Both calls run on the publisher's thread."""

    def load(self, table: BlockTable) -> None:
        """Hold everything held now (start-up)."""

    def apply(self, table: BlockTable) -> None:
        """Apply the changes since the last call."""


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str  # tcp://HOST:PORT (or ipc://PATH) the event socket binds
    replay_endpoint: str | None = None  # the replay socket's, if any
    layout: str = "map"  # see wire: "map" (vLLM now, vllm-router) or "array"
    replay_batches: int = 10_000  # batches kept for replay (vLLM's default)
    flush_s: float = 0.02

    def __post_init__(self) -> None:
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None:
                check_endpoint(endpoint)
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("the KV events replay endpoint must differ from the events one")
        if self.layout not in LAYOUTS:
            raise ValueError(f"KV events layout must be one of {', '.join(LAYOUTS)}, got "
                             f"{self.layout!r}")
        if self.replay_batches < 1:
            raise ValueError("replay_batches must be at least 1")


def check_endpoint(endpoint: str) -> None:
    """A ZMQ endpoint a socket can bind: tcp://HOST:PORT or ipc://PATH."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc" and rest:
        return
    if scheme == "tcp":
        parts = urlsplit(endpoint)
        with contextlib.suppress(ValueError):
            if parts.hostname and (parts.port is not None or endpoint.endswith(":*")):
                return
    raise ValueError(f"not a ZMQ endpoint to bind: {endpoint!r} (tcp://HOST:PORT or "
                     "ipc://PATH)")


def is_loopback(endpoint: str) -> bool:
    """Whether only this host can connect (ipc, or TCP on a loopback address)."""
    if endpoint.startswith("ipc://"):
        return True
    host = (urlsplit(endpoint.replace(":*", ":0")).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


class EventPublisher:
    """Publishes ``source``'s blocks; thread-safe to close from any thread."""

    def __init__(self, config: PublisherConfig, source: Source, block_size: int) -> None:
        self.config = config
        self._source = source
        self.table = BlockTable(block_size)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only new topics
            self._pub.setsockopt(zmq.LINGER, 1000)  # the last batch leaves at close
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot bind the KV events socket: {exc}") from None
        self.next_seq = time.time_ns()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.replay_batches)
        self.batches = 0  # published (tests and stats read it)
        self.snapshots = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Whether the start-up snapshot is out (within ``timeout`` seconds)."""
        return self._ready.wait(timeout)

    def close(self) -> None:
        """Stop; the last batch says every block is gone (AllBlocksCleared)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._publish(TOPIC_ALL, [Cleared()])
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()

    # -- the publisher's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._source.load(self.table)
            self.table.flush()  # what load held is in the snapshot, not in change events
            self._publish(TOPIC_ALL, self.table.snapshot())
            self.snapshots += 1
            self._ready.set()
            self._loop()
        except Exception as exc:  # a bug here must not pass unseen, nor stop the daemon
            self._error = exc
            log.exception("KV events publisher stopped")
            self._ready.set()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        announce_due: float | None = None
        last_announce = time.monotonic()
        while not self._stop.is_set():
            ready = dict(poller.poll(int(self.config.flush_s * 1000)))
            if self._pub in ready and self._new_subscriber():
                announce_due = max(time.monotonic(), last_announce + REANNOUNCE_INTERVAL_S)
            if self._replay is not None and self._replay in ready:
                self._answer_replay()
            self._source.apply(self.table)
            for topic_, events in self.table.flush().items():
                self._publish(topic_, events)
            if announce_due is not None and time.monotonic() >= announce_due:
                self._publish(TOPIC_ALL, self.table.snapshot())
                self.snapshots += 1
                last_announce, announce_due = time.monotonic(), None

    def _new_subscriber(self) -> bool:
        """Read the XPUB's subscription messages; whether any subscribed."""
        subscribed = False
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return subscribed
            subscribed = subscribed or message[:1] == b"\x01"

    def _publish(self, topic_: str, events: list[Event]) -> None:
        payload = encode_batch(time.time(), events, self.config.layout)
        seq = self.next_seq
        self.next_seq += 1
        self._pub.send_multipart(frames(topic_, seq, payload))
        self._buffer.append((seq, topic_.encode(), payload))
        self.batches += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                request = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) not in (2, 3) or len(request[-1]) != 8:
                log.warning("KV events: a replay request of %d frames ignored", len(request))
                continue
            identity, start = request[0], int.from_bytes(request[-1], "big", signed=True)
            oldest = self._buffer[0][0] if self._buffer else self.next_seq
            if start < oldest:
                snapshot = encode_batch(time.time(), self.table.snapshot(), self.config.layout)
                self._replay.send_multipart(
                    [identity, b"", (oldest - 1).to_bytes(8, "big", signed=True), snapshot])
            for seq, _topic, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart(
                        [identity, b"", seq.to_bytes(8, "big", signed=True), payload])
            self._replay.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True),
                                         b""])
