"""The operator's RPCs: what is stored and how it is doing (Stats, List, Inspect, Verify)
and changes to what others rely on (Pin, Unpin, Prune). All but Stats are refused to
runtime tokens and, on TCP, to callers without --tcp-admin (OPERATOR_METHODS); Stats
answers a runtime token its own tenants' usage only."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc

from .. import __version__
from ..tenant_usage import usage_messages
from ..v1 import kvcache_pb2 as pb
from .base import ServiceBase, abort
from .filters import record_filter, within
from .messages import chain_message, check_key, entry_message
from .stats import free_bytes, recovery_message, remote_state, store_stats

# The RPCs of this module that see every tenant's entries or change what others rely on.
OPERATOR_RPCS = ("List", "Inspect", "Verify", "Prune", "Pin", "Unpin")


class AdminRPCs(ServiceBase):
    """Pin, Unpin, Stats, List, Inspect, Verify, Prune."""

    def Pin(self, request: pb.KeyRequest, context: Any) -> pb.PinResponse:
        if not math.isfinite(request.ttl_seconds) or request.ttl_seconds < 0:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  "invalid_argument: ttl_seconds must be a finite number >= 0")
        self._call(context, lambda: self.store.set_pinned(
            check_key(request.key), True, request.ttl_seconds,
            tenants=self.access.seen(context)))
        return pb.PinResponse(pinned=True)

    def Unpin(self, request: pb.KeyRequest, context: Any) -> pb.PinResponse:
        self._call(context, lambda: self.store.set_pinned(
            check_key(request.key), False, tenants=self.access.seen(context)))
        return pb.PinResponse(pinned=False)

    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        cfg = self.store.config
        scope = self.access.scope(context)
        if scope.tenants is not None:
            # A runtime token learns what a client needs (the block size) and its own
            # tenants' usage, nothing that moves with other tenants' traffic: counters,
            # sizes and latencies would tell it when another tenant's prompt hit the cache.
            return pb.StatsResponse(block_size=cfg.block_size, version=__version__,
                                    tenants=usage_messages(
                                        self.store, self.tenant_names,
                                        {self.salts.tenant_id(t) for t in scope.tenants}))
        s = store_stats(self.store)
        tiers = [
            pb.TierStats(tier=pb.TIER_RAM, entries=s["ram_entries"], bytes=s["ram_used"],
                         budget_bytes=cfg.ram_bytes, directory=str(self.store.ram_dir),
                         free_bytes=free_bytes(self.store.ram_dir)),
            pb.TierStats(tier=pb.TIER_DISK, entries=s["disk_entries"], bytes=s["disk_used"],
                         budget_bytes=cfg.disk_bytes, reserved_bytes=s["reserved_bytes"],
                         directory=str(self.store.root), free_bytes=free_bytes(self.store.root)),
        ]
        remote, remote_stats = None, remote_state(self.remote.tier if self.remote else None)
        counters = {**s["counters"], **remote_stats["counters"]}
        if self.remote is not None:
            r = remote_stats
            remote = pb.RemoteStats(url=str(r["url"]), connected=bool(r["connected"]),
                                    cluster=bool(r["cluster"]), signed=bool(r["signed"]),
                                    unsigned_by_choice=bool(r["unsigned_by_choice"]),
                                    encrypted=bool(r["encrypted"]),
                                    queue_depth=int(r["queue_depth"]),
                                    queue_max=int(r["queue_max"]),
                                    last_error=str(r["last_error"] or ""))
        return pb.StatsResponse(tiers=tiers, counters=counters, block_size=cfg.block_size,
                                remote=remote,
                                min_free_bytes=cfg.min_free_bytes,
                                logical_bytes=s["logical_bytes"],
                                version=__version__, uptime_seconds=s["uptime"],
                                in_flight=s["in_flight"], read_pins=s["read_pins"],
                                waiting_lookups=s["waiting_lookups"],
                                recovery=recovery_message(s["recovery"]),
                                tenants=usage_messages(self.store, self.tenant_names),
                                latencies={name: pb.LatencySummary(**vars(summary))
                                           for name, summary in
                                           self.latencies.summaries().items()})

    def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:
        if request.tier == pb.TIER_REMOTE:
            return pb.ListResponse(entries=self._remote_entries(request, context))
        # The key prefix is matched by the listing itself (one seek), not as a filter.
        predicate = record_filter(self.salts, request.model, request.tenant, request.reason,
                                  request.tier, request.min_tokens, now=time.time())
        size = request.page_size or request.limit
        if request.page_size and request.limit:
            size = min(request.page_size, request.limit)
        page = self._call(context, lambda: self.store.list(
            predicate, sort=request.sort or "used", token=request.page_token, limit=size,
            key_prefix=request.key_prefix))
        return pb.ListResponse(entries=[entry_message(r, self.store.children(r.key))
                                        for r in page.records],
                               next_page_token=page.next_token if request.page_size else b"")

    def _remote_entries(self, request: pb.ListRequest, context: Any) -> list[pb.Entry]:
        """What this host can reach in the shared tier, newest first (ls --tier remote)."""
        if self.remote is None:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                  "this daemon has no shared tier (kvcache serve --remote URL)")
        # The operator filters of ls, over remote records (they carry every field these
        # filters read: key, model, tenant, reason, tokens).
        predicate = record_filter(self.salts, request.model, request.tenant, request.reason,
                                  min_tokens=request.min_tokens,
                                  key_prefix=request.key_prefix)
        records = self.remote.tier.list_entries(
            predicate, limit=request.limit or 1000)  # type: ignore[arg-type]
        return [pb.Entry(key=r.key, model_name=r.model_name,
                         model_fingerprint=r.model_fingerprint, tenant_id=r.tenant_id,
                         n_tokens=r.n_tokens, size=r.size, tiers=[pb.TIER_REMOTE],
                         reason=r.reason, created=r.created, codec=r.codec,
                         namespace=r.namespace, parent=r.parent, base=r.base)
                for r in records]

    def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.EntryDetail:
        # With a tenant, another tenant's entry gets the answer of a missing key.
        tenants = self.access.seen(context)
        if request.tenant:
            label = self.salts.tenant_id(request.tenant)
            tenants = frozenset((label,)) if tenants is None or label in tenants else frozenset()
        record, header, meta, path = self._call(
            context, lambda: self.store.inspect(check_key(request.key), tenants))
        chain = self._call(context, lambda: self.store.chain(record))
        return pb.EntryDetail(
            entry=entry_message(record, self.store.children(record.key)),
            chain=chain_message(chain), kv_layout=dict(meta.kv_layout), tokens=list(meta.tokens),
            format_version=header.version, producer=meta.producer,
            payload_size=header.payload_len, raw_payload_size=header.raw_len, path=str(path))

    def Verify(self, request: pb.VerifyRequest, context: Any) -> Iterator[pb.VerifyResult]:
        for key in request.keys:
            self._call(context, partial(check_key, key))
        for key, error, done, total in self.store.verify(list(request.keys),
                                                         check_only=request.check_only):
            yield pb.VerifyResult(key=key, ok=error is None, error=error or "", done=done,
                                  total=total)

    def Prune(self, request: pb.PruneRequest, context: Any) -> pb.PruneResponse:
        # NaN or a negative age matched every entry: a bogus filter removed everything.
        for name in ("older_than_seconds", "unused_for_seconds"):
            value = getattr(request, name)
            if not (math.isfinite(value) and value >= 0):
                abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                      f"{name} must be a finite number >= 0, got {value}")
        def keys_of(field: str) -> frozenset[bytes]:
            return frozenset(self._call(
                context, lambda: [check_key(k) for k in getattr(request, field)]))

        filters = record_filter(self.salts, request.model, request.tenant, request.reason,
                                older_than=request.older_than_seconds,
                                unused_for=request.unused_for_seconds, now=time.time(),
                                only_keys=frozenset() if request.confirmed_plan
                                else keys_of("keys"))
        ram_filters = filters
        if request.confirmed_plan:
            filters, ram_filters = (within(keys_of("keys"), filters),
                                    within(keys_of("ram_drop_keys"), filters))
        if filters is None and not (request.max_disk_bytes or request.max_ram_bytes):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  "prune needs a filter or a byte target (refusing to remove everything)")
        result = self.store.prune(filters, max_disk_bytes=request.max_disk_bytes,
                                  max_ram_bytes=request.max_ram_bytes, dry_run=request.dry_run,
                                  ram_predicate=ram_filters)
        return pb.PruneResponse(removed=[entry_message(r) for r in result.removed],
                                bytes_freed=result.bytes_freed,
                                skipped_pinned=result.skipped_pinned,
                                skipped_in_use=result.skipped_in_use,
                                skipped_shared=result.skipped_shared,
                                ram_dropped=result.ram_dropped,
                                ram_bytes_freed=result.ram_bytes_freed,
                                ram_dropped_entries=[entry_message(r) for r in
                                                     result.ram_dropped_entries])


