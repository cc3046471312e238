"""KV events: what a host holds, published in vLLM's format so that the routers people run
(NVIDIA Dynamo's KV router and indexer, vllm-router's ``kv_aware``, llm-d) send each
request to the host holding the longest prefix of it.

* ``wire``          the format, pure functions: events, batches, topics, block ids, media
* ``blocks``        BlockTable: blocks held per tier, one event per change of a block
* ``publisher``     EventPublisher: ZMQ publisher and vLLM's replay protocol, snapshots
* ``store_source``  the daemon's entries as holdings (DISK, and CPU for RAM copies)

The runtime's live sequences (the device tier, ``GPU``) are published by
``model_runtime.kv_events`` with the same publisher.
"""

from .publisher import EventPublisher, PublisherConfig, check_endpoint, is_loopback

__all__ = ["EventPublisher", "PublisherConfig", "check_endpoint", "is_loopback"]
