"""What the KV events tests share: daemons publishing events, the real Dynamo indexer
subscribed to them, raw ZMQ subscribers, and opaque saves (the daemon never reads a
payload)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import zmq
from harness.routers import DynamoIndexer, free_port

from kvcache.client import CacheClient, Identity
from kvcache.kv_events.wire import Event, decode_batch
from tests.support.daemon_proc import DaemonProcess, wait_for

BLOCK = 16  # the daemons' and the indexer's block size
WIDTH = 64  # payload bytes per token
IDENT = Identity("fp-kv-events", {"type_k": "f16"}, model_name="tiny.gguf")


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def event_args(events: str, replay: str | None = None) -> list[str]:
    """``kvcache serve`` arguments that publish KV events at ``events``."""
    return ["--block-size", str(BLOCK), "--kv-events", events,
            *(["--kv-events-replay", replay] if replay else [])]


def save(client: CacheClient, tokens: list[int], *, parent: bytes = b"", base: int = 0,
         identity: Identity = IDENT) -> bytes:
    payload = random.Random(len(tokens)).randbytes(WIDTH * (len(tokens) - base))
    result = client.save(identity, tokens, payload, "finish", parent=parent, base=base)
    assert result.status == "saved", result
    return result.key


def matched(indexer: DynamoIndexer, tokens: list[int]) -> dict[str, dict[str, Any]]:
    return indexer.query(tokens)


def wait_match(indexer: DynamoIndexer, tokens: list[int],
               predicate: Callable[[dict[str, dict[str, Any]]], bool], what: str,
               timeout: float = 15.0) -> dict[str, dict[str, Any]]:
    """Query until ``predicate`` holds for the answer; the last answer."""
    answer: dict[str, dict[str, Any]] = {}

    def check() -> bool:
        nonlocal answer
        answer = indexer.query(tokens)
        return predicate(answer)

    wait_for(check, f"{what} (last answer: {answer})", timeout)
    return answer


def tier(answer: dict[str, dict[str, Any]], worker: int, name: str = "longest_matched") -> int:
    """Tokens worker ``worker`` matched (0 when it is not in the answer)."""
    return int(answer.get(str(worker), {}).get(name, 0))


class Subscriber:
    """A raw ZMQ SUB socket on a publisher: every message as (topic, seq, events)."""

    def __init__(self, endpoint_: str, prefix: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, prefix)
        self.sock.connect(endpoint_)

    def messages(self, timeout: float = 5.0, until: Callable[[list[Any]], bool] | None = None
                 ) -> list[tuple[str, int, list[Event], bytes]]:
        """Messages received within ``timeout`` (or until ``until`` holds for them)."""
        got: list[tuple[str, int, list[Event], bytes]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (until and until(got)):
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                got.append((topic.decode(), int.from_bytes(seq, "big", signed=True),
                            decode_batch(payload)[1], payload))
        return got

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


DaemonFactory = Callable[..., DaemonProcess]
IndexerFactory = Callable[..., DynamoIndexer]
