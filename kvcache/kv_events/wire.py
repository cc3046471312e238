"""vLLM's KV event wire format, as pure functions (no sockets, no state).

A publisher sends multipart messages ``[topic, sequence, payload]``: the topic (bytes; a
subscriber filters on its prefix), the batch's sequence number (8 bytes, big-endian,
signed: -1 ends a replay) and an ``EventBatch`` packed with msgpack, ``[ts, events,
data_parallel_rank]``. Events are ``BlockStored`` (block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name), ``BlockRemoved`` (block_hashes,
medium) and ``AllBlocksCleared``, in one of two layouts:

* ``map`` (vLLM since 0.28, the default): ``{"type": "BlockStored", "block_hashes":
  ..., ...}``. vllm-router reads only this one ("KV event must be a tagged map").
* ``array`` (vLLM's earlier layout): ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium]``.

NVIDIA Dynamo's indexer reads both. ``medium`` names the tier with the words Dynamo maps
(checked with its ``/dump``): ``GPU`` -> device, ``CPU`` -> host_pinned, ``DISK`` ->
disk; any other word and the block is dropped.

Block hashes are unsigned 64-bit integers derived from kvcache's chain hashes (which hold
the namespace: model, KV layout, tenant salt) by a keyed BLAKE2b, so the same block has
the same id on every host of a fleet, ids of different namespaces differ, and an id
gives away neither the namespace nor a chain hash. The topic names the model and a tag of
the namespace (a BLAKE2b of it, never the tenant's name).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"  # a runtime's live sequences
MEDIUM_CPU = "CPU"  # the daemon's RAM tier
MEDIUM_DISK = "DISK"  # the daemon's disk tier
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)  # fastest first
LAYOUTS = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay answer
TOPIC_PREFIX = "kvcache"
# Batches that concern every namespace (AllBlocksCleared, a whole snapshot): a subscriber
# filtering on one namespace's topic subscribes to this one too.
TOPIC_ALL = f"{TOPIC_PREFIX}/*"
_BLOCK_PERSON = b"kvc.kv-block"
_TOPIC_PERSON = b"kvc.kv-topic"


def block_id(chain_hash: bytes) -> int:
    """The published id of the block whose chain hash is ``chain_hash``."""
    digest = hashlib.blake2b(chain_hash, digest_size=8, person=_BLOCK_PERSON).digest()
    return int.from_bytes(digest, "big")


def namespace_tag(namespace: bytes) -> str:
    """16 hex digits naming a namespace in topics: the same on every host, and no way back
    to the namespace (nor to a tenant's name, which the namespace is salted with)."""
    return hashlib.blake2b(namespace, digest_size=8, person=_TOPIC_PERSON).hexdigest()


def topic(model: str, namespace: bytes) -> str:
    """``kvcache/<model>/<namespace tag>``: a subscriber filters a model, or one namespace
    of it, by prefix."""
    return f"{TOPIC_PREFIX}/{model.replace('/', '_')}/{namespace_tag(namespace)}"


@dataclass(frozen=True)
class Stored:
    """Blocks stored on ``medium``, each the parent of the next; ``parent`` is the first
    one's (None: the first is a sequence's first block)."""

    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True)
class Cleared:
    """Every block of this publisher is gone (start-up, a snapshot's first event)."""


Event = Stored | Removed | Cleared


def encode_event(event: Event, layout: str = "map") -> Any:
    """One event as msgpack values, in ``layout``."""
    if isinstance(event, Stored):
        fields: list[tuple[str, Any]] = [
            ("block_hashes", list(event.hashes)), ("parent_block_hash", event.parent),
            ("token_ids", list(event.token_ids)), ("block_size", event.block_size),
            ("lora_id", None), ("medium", event.medium)]
        name = "BlockStored"
    elif isinstance(event, Removed):
        fields = [("block_hashes", list(event.hashes)), ("medium", event.medium)]
        name = "BlockRemoved"
    else:
        fields, name = [], "AllBlocksCleared"
    if layout == "array":
        return [name, *(value for _, value in fields)]
    if layout != "map":
        raise ValueError(f"unknown KV event layout {layout!r} (one of {', '.join(LAYOUTS)})")
    body: dict[str, Any] = {"type": name, **dict(fields)}
    if name == "BlockStored":
        body["lora_name"] = None  # a field without a default in vLLM's struct
    return body


def encode_batch(ts: float, events: Sequence[Event], layout: str = "map") -> bytes:
    """An ``EventBatch``: ``[ts, events, data_parallel_rank]`` (the rank left to the
    subscriber's configuration: None)."""
    return msgpack.packb([ts, [encode_event(e, layout) for e in events], None],
                         use_bin_type=True)


def frames(topic_: str, seq: int, payload: bytes) -> list[bytes]:
    """A published message: ``[topic, sequence, payload]``."""
    return [topic_.encode(), seq.to_bytes(8, "big", signed=True), payload]


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """A batch as :func:`encode_batch` writes it, in either layout (tests and tools read
    what was published with it)."""
    ts, raw_events, *_ = msgpack.unpackb(payload, raw=False)
    events: list[Event] = []
    for raw in raw_events:
        if isinstance(raw, dict):
            name, values = raw["type"], raw
        else:
            name = raw[0]
            keys = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids",
                                    "block_size", "lora_id", "medium"),
                    "BlockRemoved": ("block_hashes", "medium")}.get(name, ())
            values = dict(zip(keys, raw[1:], strict=False))
        if name == "BlockStored":
            events.append(Stored(tuple(values["block_hashes"]), values["parent_block_hash"],
                                 tuple(values["token_ids"]), values["block_size"],
                                 values["medium"]))
        elif name == "BlockRemoved":
            events.append(Removed(tuple(values["block_hashes"]), values["medium"]))
        elif name == "AllBlocksCleared":
            events.append(Cleared())
        else:
            raise ValueError(f"unknown KV event {name!r}")
    return float(ts), events
