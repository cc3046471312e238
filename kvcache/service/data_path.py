"""The data path: the RPCs a model runtime makes to find, save and load states (lookup,
reserve, write, commit, read, delete), and what it reads and keeps of its own tenant's
entries (their tokens, an expiring pin). Each checks its arguments and the caller's
access first (kvcache.service.access) and answers another tenant's entry as a missing
one."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import grpc

from .. import keys
from ..common import details
from ..config import MAX_MESSAGE_BYTES
from ..errors import InvalidArgument, NotFound, StoreError
from ..v1 import kvcache_pb2 as pb
from .base import ServiceBase, abort, wait_budget_ms
from .messages import TIERS, chain_message, check_key, request_tokens, tier_of


class DataPathRPCs(ServiceBase):
    """Lookup, Reserve, Resolve, Write, Commit, Abort, Read, OpenRead, ReleaseRead,
    Delete, EntryTokens, PinTenantEntry."""

    def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        def run() -> pb.LookupResponse:
            ns = self.access.namespace(request.identity, context)
            raw = request_tokens(request)
            t0 = time.perf_counter()
            answer = self.lookup(ns, raw, request.max_tokens, request.common_prefix)
            in_flight = 0
            wait_ms = wait_budget_ms(request.wait_in_flight_ms, context)
            if request.common_prefix and wait_ms:
                in_flight = self.store.wait_in_flight(ns, raw, answer.shared, wait_ms / 1000)
                if not in_flight:  # published or dropped here meanwhile: look again, here
                    answer = self.store.find(ns, raw, request.max_tokens, common_prefix=True,
                                             count=False)
            record, matched, probes = answer.record, answer.shared, answer.probes
            self._observe(self.lookup_seconds.labels("hit" if record else "miss"), "lookup", t0)
            try:
                chain = self.store.chain(record) if record is not None else None
            except NotFound:  # a link removed since the lookup: as good as a miss
                chain = None
            if record is None or chain is None:
                return pb.LookupResponse(found=False, probes=probes, in_flight_tokens=in_flight)
            resp = pb.LookupResponse(
                found=True, key=record.key, matched_tokens=matched,
                tier=pb.TIER_REMOTE if answer.from_remote else tier_of(record),
                size=record.size, probes=probes, entry_tokens=record.n_tokens,
                chain=chain_message(chain), in_flight_tokens=in_flight)
            if request.open_min_tokens and matched >= request.open_min_tokens:
                self._open_pieces(resp)
            return resp
        return self._call(context, run)

    def _open_pieces(self, resp: pb.LookupResponse) -> None:
        """Open the pieces holding the matched tokens as OpenRead would (pinned, the path
        of their fastest copy), so a local restore needs no call per piece. When one is
        gone since the lookup none is opened: the caller opens them one by one and learns
        why."""
        t0 = time.perf_counter()
        pins = []
        try:
            for piece in resp.chain:
                if piece.base >= resp.matched_tokens:
                    break
                pins.append(self.store.open_read(piece.key))
        except StoreError:
            for pin in pins:
                with contextlib.suppress(StoreError):
                    self.store.release_read(pin.pin_id)
            return
        for piece, pin in zip(resp.chain, pins, strict=False):
            piece.path, piece.pin_id, piece.tier = str(pin.path), pin.pin_id, TIERS[pin.tier]
            self._observe(self.read_seconds.labels(pin.tier, "local"),
                          f"read_{pin.tier}_local", t0)
        resp.pin_seconds = self.store.config.pin_seconds
        resp.block_size = self.store.config.block_size

    def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        def run() -> pb.ReserveResponse:
            ns = self.access.namespace(request.identity, context)
            raw = request_tokens(request)
            self.tenant_names.learn(request.identity.tenant)
            # Another tenant's parent is, to a caller bound to tenants, a parent that is
            # gone, told only once every argument is found valid (the store's order).
            result = self.store.reserve(ns, raw, request.size, request.reason,
                                        request.identity.model_fingerprint,
                                        tenant_id=self.salts.tenant_id(request.identity.tenant),
                                        parent=request.parent, base=request.base,
                                        tenants=self.access.seen(context))
            status = {"granted": pb.ReserveResponse.GRANTED,
                      "already_present": pb.ReserveResponse.ALREADY_PRESENT,
                      "in_flight": pb.ReserveResponse.IN_FLIGHT}[result.status]
            return pb.ReserveResponse(status=status, key=result.key, lease_id=result.lease_id,
                                      lease_seconds=self.store.config.lease_seconds,
                                      local_path=result.local_path)
        return self._call(context, run)

    def Resolve(self, request: pb.Identity, context: Any) -> pb.ResolveResponse:
        return self._call(context, lambda: pb.ResolveResponse(
            namespace=self.access.namespace(request, context),
            tenant_id=self.salts.tenant_id(request.tenant)))

    def Write(self, request_iterator: Iterator[pb.WriteChunk], context: Any) -> pb.WriteResponse:
        lease_id = ""
        written = 0
        t0 = time.perf_counter()
        try:
            for chunk in request_iterator:
                if not lease_id:
                    if not chunk.lease_id:
                        raise InvalidArgument("the first chunk must carry the lease_id")
                    lease_id = chunk.lease_id
                elif chunk.lease_id and chunk.lease_id != lease_id:
                    raise InvalidArgument("a write stream carries chunks of one lease only")
                written = self.store.write(lease_id, chunk.offset, chunk.data)
        except StoreError as exc:
            abort(context, exc.code, details(exc))
        except grpc.RpcError:
            # The writer went away mid-stream: its save cannot complete.
            if lease_id:
                self._abort_quietly(lease_id, "saves_disconnected")
            raise
        if not lease_id:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty write stream")
        # A writer that cancels or dies mid-stream does not always surface as an RpcError:
        # depending on which of gRPC's two completion events lands first, the request
        # iterator may just stop. A stream must carry the whole blob, so one that ends short
        # is a lost writer: abort now instead of holding the key in flight (and its temp
        # file) until the lease expires.
        with contextlib.suppress(StoreError):  # LeaseLost: committed or aborted meanwhile
            written, size = self.store.lease_progress(lease_id)
            if written < size:
                self._abort_quietly(lease_id, "saves_disconnected")
                abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                      f"write stream ended after {written} of {size} reserved bytes "
                      "(save aborted)")
        self._observe(self.write_seconds, "write_stream", t0)
        return pb.WriteResponse(bytes_written=written)

    def _abort_quietly(self, lease_id: str, counter: str) -> None:
        with contextlib.suppress(StoreError):
            self.store.abort(lease_id, counter=counter)

    def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        t0 = time.perf_counter()
        record = self._call(context,
                            lambda: self.store.commit(request.lease_id, request.local_write))
        self._observe(self.commit_seconds.labels(record.reason), "commit", t0)
        if self.remote is not None:
            self.remote.published(record)
        return pb.CommitResponse(key=record.key, size=record.size)

    def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        self._call(context, lambda: self.store.abort(request.lease_id))
        return pb.AbortResponse()

    def Read(self, request: pb.ReadRequest, context: Any) -> Iterator[pb.ReadChunk]:
        chunk_bytes = min(request.chunk_bytes or (1 << 20), MAX_MESSAGE_BYTES // 2)
        t0 = time.perf_counter()
        pin, chunks = self._call(context, lambda: self.store.iter_read(
            check_key(request.key), wait_budget_ms(request.wait_ms, context), chunk_bytes,
            tenants=self.access.seen(context)))
        offset = 0
        try:
            for data in chunks:
                msg = pb.ReadChunk(offset=offset, data=bytes(data))
                if offset == 0:
                    msg.total_size = pin.size
                    msg.tier = TIERS[pin.tier]
                offset += len(data)
                yield msg
            self._observe(self.read_seconds.labels(pin.tier, "stream"), f"read_{pin.tier}_stream",
                          t0)
        except StoreError as exc:
            abort(context, exc.code, details(exc))
        finally:
            chunks.close()  # type: ignore[attr-defined]

    def OpenRead(self, request: pb.OpenReadRequest, context: Any) -> pb.OpenReadResponse:
        t0 = time.perf_counter()
        pin = self._call(context, lambda: self.store.open_read(
            check_key(request.key), wait_budget_ms(request.wait_ms, context),
            tenants=self.access.seen(context)))
        self._observe(self.read_seconds.labels(pin.tier, "local"), f"read_{pin.tier}_local", t0)
        return pb.OpenReadResponse(path=str(pin.path), size=pin.size, tier=TIERS[pin.tier],
                                   pin_id=pin.pin_id, pin_seconds=self.store.config.pin_seconds,
                                   block_size=self.store.config.block_size)

    def ReleaseRead(self, request: pb.ReleaseReadRequest, context: Any) -> pb.ReleaseReadResponse:
        quarantined = self._call(context, lambda: self.store.release_read(request.pin_id,
                                                                          request.corrupt))
        return pb.ReleaseReadResponse(quarantined=quarantined)

    def Delete(self, request: pb.KeyRequest, context: Any) -> pb.DeleteResponse:
        removed = self._call(context, lambda: self.store.delete(
            check_key(request.key), tenants=self.access.seen(context)))
        return pb.DeleteResponse(deleted=True, dependents_removed=len(removed) - 1)

    def EntryTokens(self, request: pb.EntryTokensRequest,
                    context: Any) -> pb.EntryTokensResponse:
        """The tokens of an entry of the named tenant (a runtime continuing a state it
        saved): what a runtime token may read of an entry, where Inspect is the
        operator's."""
        def run() -> pb.EntryTokensResponse:
            key = check_key(request.key)
            _, _, meta, _ = self.store.inspect(
                key, self.access.tenant_seen(request.tenant, context))
            return pb.EntryTokensResponse(n_tokens=len(meta.tokens),
                                          packed_tokens=keys.tokens_to_bytes(meta.tokens))
        return self._call(context, run)

    def PinTenantEntry(self, request: pb.PinTenantEntryRequest,
                       context: Any) -> pb.PinTenantEntryResponse:
        """An expiring pin on an entry of the named tenant (a runtime keeping a
        cache_control breakpoint's entry), bounded in time and in what the tenant's
        expiring pins hold; Pin, unbounded, is the operator's."""
        def run() -> pb.PinTenantEntryResponse:
            key = check_key(request.key)
            longest = self.store.config.max_tenant_pin_seconds
            ttl = request.ttl_seconds
            if not (math.isfinite(ttl) and 0 < ttl <= longest):
                raise InvalidArgument(f"ttl_seconds must be above 0 and at most {longest:g} "
                                      f"(the daemon's --max-tenant-pin-seconds), got {ttl}")
            pin = self.store.pin_for_tenant(
                key, ttl, self.access.tenant_seen(request.tenant, context))
            return pb.PinTenantEntryResponse(pin_expires=pin.record.pin_expires,
                                             pinned_bytes=pin.held_bytes,
                                             pinned_bytes_limit=pin.bound)
        return self._call(context, run)

