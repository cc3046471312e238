"""The gRPC service: a thin translation between protobuf messages and the Store."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from . import __version__, keys
from .auth import (
    ADMIN,
    OperatorGate,
    Scope,
    ServerAuth,
    add_tcp_port,
    presented_token,
    refuse_unprotected_tcp,
    tcp_security,
)
from .common import TIER_DISK, TIER_RAM, details, grpc_server
from .config import MAX_MESSAGE_BYTES, SOCKET_NAME, parse_listen
from .counters import COUNTERS, REMOTE_SECTION
from .errors import InvalidArgument, NotFound, StoreError
from .index import Record
from .metrics import LatencyWindows, Metrics
from .remote import RemoteConfig, RemoteSync, RemoteTier
from .store import Found, Store, StoreConfig
from .store.ownership import check_data_dir
from .store.quotas import TenantQuotas
from .tenancy import TenantSalts, data_dir_secret, secret_from_signing_key
from .tenant_usage import TenantNames, usage_messages
from .unix_socket import OwnedSocket
from .v1 import kvcache_pb2 as pb
from .v1 import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger("kvcache")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# Calls that see every tenant's entries or change what others rely on. The unix socket's
# owner is the operator; TCP callers get them only with --tcp-admin (see OperatorGate).
OPERATOR_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in
                             ("List", "Inspect", "Verify", "Prune", "Pin", "Unpin"))
T = TypeVar("T")

TIERS = {TIER_RAM: pb.TIER_RAM, TIER_DISK: pb.TIER_DISK}


class PermissionDenied(StoreError):
    code = grpc.StatusCode.PERMISSION_DENIED


def request_tokens(request: pb.LookupRequest | pb.ReserveRequest) -> bytes:
    """The request's tokens as packed u32 LE, from whichever field carries them."""
    if request.packed_tokens:
        if len(request.tokens):
            raise InvalidArgument("give tokens or packed_tokens, not both")
        if len(request.packed_tokens) % 4:
            raise InvalidArgument("packed_tokens is not a whole number of u32 values")
        return request.packed_tokens
    return keys.tokens_to_bytes(request.tokens)


def check_key(key: bytes) -> bytes:
    if len(key) != keys.KEY_BYTES:
        raise InvalidArgument(f"a key is {keys.KEY_BYTES} bytes, got {len(key)}")
    return key


def wait_budget_ms(wait_ms: int, context: Any) -> int:
    """``wait_ms`` cut to the call's deadline. A reader waiting for an in-flight key holds
    one of the server's threads: past its caller's deadline it waited on for nobody (until
    the key was published or aborted, which a trickling writer can put off indefinitely),
    and enough such readers stalled every other RPC."""
    remaining = context.time_remaining()  # without a deadline: None, or a huge number
    if remaining is None:
        return wait_ms
    return max(0, int(min(wait_ms, remaining * 1000)))


def remote_state(tier: RemoteTier | None) -> dict[str, object]:
    """RemoteTier.stats(), or, without a shared tier, its counters at zero (every
    declared name is reported)."""
    if tier is None:
        return {"counters": dict.fromkeys(REMOTE_SECTION, 0)}
    return tier.stats()


def tier_of(record: Record) -> int:
    """The fastest tier holding the entry."""
    return pb.TIER_RAM if record.in_ram else pb.TIER_DISK


def entry_message(record: Record, children: int = 0) -> pb.Entry:
    tiers = [pb.TIER_DISK] + ([pb.TIER_RAM] if record.in_ram else [])
    return pb.Entry(
        key=record.key, model_name=record.model_name, model_fingerprint=record.model_fingerprint,
        tenant_id=record.tenant_id, n_tokens=record.n_tokens, size=record.size, tiers=tiers,
        reason=record.reason, created=record.created, last_used=record.last_used,
        hits=record.hits, pinned=record.pinned, codec=record.codec, namespace=record.namespace,
        parent=record.parent, base=record.base, logical_size=record.logical_size,
        children=children, pin_expires=record.pin_expires,
    )


def chain_message(chain: list[Record]) -> list[pb.Piece]:
    return [pb.Piece(key=r.key, base=r.base, n_tokens=r.n_tokens, size=r.size, tier=tier_of(r))
            for r in chain]


# A fingerprint prefix shorter than this would match models by chance (one in 16 for a
# single hex digit): shorter text matches model names only.
MIN_FINGERPRINT_PREFIX = 4


def model_matches(record: Record, model: str) -> bool:
    """The model filter of ls and prune: the model's file name or its beginning, or at
    least MIN_FINGERPRINT_PREFIX leading characters of its fingerprint (any case)."""
    if record.model_name.startswith(model):
        return True
    return len(model) >= MIN_FINGERPRINT_PREFIX and \
        record.model_fingerprint.lower().startswith(model.lower())


def record_filter(salts: TenantSalts, model: str = "", tenant: str = "", reason: str = "",
                  tier: int = 0, min_tokens: int = 0, older_than: float = 0.0,
                  unused_for: float = 0.0, now: float = 0.0, key_prefix: str = "",
                  only_keys: frozenset[bytes] = frozenset()
                  ) -> Callable[[Record], bool] | None:
    """A predicate over records from operator filters (None when no filter is set); an
    entry must pass every filter given. Filters are text and taken as text: one that
    cannot match (a key prefix that is not hex digits) matches nothing."""
    tenant_id = salts.tenant_id(tenant)
    prefix = key_prefix.lower()  # keys are shown in lowercase hex; typed in any case
    if not any((model, tenant, reason, tier, min_tokens, older_than, unused_for, prefix,
                only_keys)):
        return None

    def match(r: Record) -> bool:
        if only_keys and r.key not in only_keys:
            return False
        if prefix and not r.key.hex().startswith(prefix):
            return False
        if model and not model_matches(r, model):
            return False
        if tenant and r.tenant_id != tenant_id:
            return False
        if reason and r.reason != reason:
            return False
        if tier == pb.TIER_RAM and not r.in_ram:
            return False
        if min_tokens and r.n_tokens < min_tokens:
            return False
        if older_than and now - r.created < older_than:
            return False
        return not (unused_for and now - r.last_touch < unused_for)

    return match


def within(keys_: frozenset[bytes], predicate: Callable[[Record], bool] | None
           ) -> Callable[[Record], bool]:
    """Only these keys (none when empty), and what ``predicate`` also accepts."""
    return lambda r: r.key in keys_ and (predicate is None or predicate(r))


def free_bytes(path: Path) -> int:
    """Free space for the daemon on the file system holding ``path`` (0 if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def store_gauges(store: Store) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    s = store.stats()
    cfg = store.config
    return {
        ("tier_entries", (("tier", TIER_RAM),)): s["ram_entries"],
        ("tier_entries", (("tier", TIER_DISK),)): s["disk_entries"],
        ("tier_bytes", (("tier", TIER_RAM),)): s["ram_used"],
        ("tier_bytes", (("tier", TIER_DISK),)): s["disk_used"],
        ("tier_budget_bytes", (("tier", TIER_RAM),)): cfg.ram_bytes,
        ("tier_budget_bytes", (("tier", TIER_DISK),)): cfg.disk_bytes,
        ("reserved_bytes", ()): s["reserved_bytes"],
        ("in_flight", ()): s["in_flight"],
        ("waiting_lookups", ()): s["waiting_lookups"],
        ("read_pins", ()): s["read_pins"],
    }


def remote_gauges(state: dict[str, object]) -> dict[tuple[str, tuple[tuple[str, str], ...]],
                                                   float]:
    """The shared tier's gauges, from remote_state (none without a shared tier)."""
    if "connected" not in state:
        return {}
    return {("remote_connected", ()): float(bool(state["connected"])),
            ("remote_queue_depth", ()): float(state["queue_depth"])}  # type: ignore[arg-type]


class KVCacheService(pb_grpc.KVCacheServicer):
    """The RPCs. A caller's scope is its token's (kvcache.auth.Scope; no token: an admin,
    as on the owner-only unix socket). A runtime token names only its own tenants; every
    call by key answers an entry of another tenant exactly as a key that does not exist
    (tests/test_scoped_tokens.py)."""

    def __init__(self, store: Store, metrics: Metrics | None = None,
                 remote: RemoteSync | None = None, salts: TenantSalts | None = None,
                 tokens: Mapping[str, Scope] | None = None) -> None:
        self.store = store
        self.remote = remote
        self.salts = salts or TenantSalts(data_dir_secret(store.root))
        self.tokens = tokens or {}
        self.tenant_names = TenantNames(self.salts, (
            name for scope in self.tokens.values() for name in scope.tenants or ()))
        self.metrics = metrics or Metrics("kvcache")
        self.metrics.describe_counters({**COUNTERS, **REMOTE_SECTION})
        # Recent samples per series, for the percentiles of `kvcache stats`.
        self.latencies = LatencyWindows()
        self.lookup_seconds = self.metrics.histogram(
            "lookup_seconds", "Longest-prefix lookup latency", ("result",))
        self.read_seconds = self.metrics.histogram(
            "read_seconds", "Time to open (same host) or stream a blob", ("tier", "path"))
        self.commit_seconds = self.metrics.histogram(
            "commit_seconds", "Commit latency: verify, fsync, rename, publish", ("reason",))
        self.write_seconds = self.metrics.histogram(
            "write_stream_seconds", "Duration of a streamed write")

    def _observe(self, histogram: Any, series: str, t0: float) -> None:
        """Record the time since ``t0`` in a histogram (Prometheus) and a window (stats)."""
        elapsed = time.perf_counter() - t0
        histogram.observe(elapsed)
        self.latencies.observe(series, elapsed)

    def scope(self, context: Any) -> Scope:
        return self.tokens.get(presented_token(context.invocation_metadata()), ADMIN)

    def namespace(self, identity: pb.Identity, context: Any) -> bytes:
        """The namespace of ``identity``, for a caller whose scope covers its tenant."""
        if not identity.model_fingerprint:
            raise InvalidArgument("identity.model_fingerprint is required")
        self.check_tenant(identity.tenant, context)
        return self.salts.namespace(identity.model_fingerprint, dict(identity.kv_layout),
                                    identity.tenant)

    def check_tenant(self, tenant: str, context: Any) -> None:
        if not self.scope(context).may_use(tenant):
            # About the caller's own token, not about any entry: it reveals nothing.
            raise PermissionDenied(f"this token may not use tenant {tenant!r}" if tenant else
                                   "this token is bound to tenants: name one")

    def may_see(self, key: bytes, context: Any) -> bool:
        """Whether the caller's scope covers the entry ``key`` (one that does not exist
        included: it answers as such)."""
        scope = self.scope(context)
        if scope.tenants is None:
            return True
        owner = self.store.tenant_of(key)
        return owner is None or owner in {self.salts.tenant_id(t) for t in scope.tenants}

    def check_key_scope(self, key: bytes, context: Any) -> bytes:
        """``key``, when the caller may see it; else NotFound, worded as for a key that
        does not exist, and answered before any wait (no timing tells them apart)."""
        if not self.may_see(check_key(key), context):
            raise NotFound(f"no entry {key.hex()}")
        return key

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StoreError as exc:
            context.abort(exc.code, details(exc))
        except (ValueError, OverflowError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(exc))
        raise AssertionError("unreachable")  # context.abort raises

    def lookup(self, ns: bytes, raw: bytes, max_tokens: int, common_prefix: bool, *,
               count: bool = True) -> Found:
        """The local tiers' answer, or the shared tier's when it holds more."""
        if self.remote is not None:
            return self.remote.lookup(ns, raw, max_tokens, common_prefix=common_prefix,
                                      count=count)
        return self.store.find(ns, raw, max_tokens, common_prefix=common_prefix, count=count)

    def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        def run() -> pb.LookupResponse:
            ns = self.namespace(request.identity, context)
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
            ns = self.namespace(request.identity, context)
            raw = request_tokens(request)
            if request.parent and not self.may_see(request.parent, context):
                # Worded as for a parent that is gone: not "another tenant's".
                raise NotFound(f"parent entry {request.parent.hex()} is gone (evicted or "
                               "deleted); save the whole state or look again")
            self.tenant_names.learn(request.identity.tenant)
            result = self.store.reserve(ns, raw, request.size, request.reason,
                                        request.identity.model_fingerprint,
                                        tenant_id=self.salts.tenant_id(request.identity.tenant),
                                        parent=request.parent, base=request.base)
            status = {"granted": pb.ReserveResponse.GRANTED,
                      "already_present": pb.ReserveResponse.ALREADY_PRESENT,
                      "in_flight": pb.ReserveResponse.IN_FLIGHT}[result.status]
            return pb.ReserveResponse(status=status, key=result.key, lease_id=result.lease_id,
                                      lease_seconds=self.store.config.lease_seconds,
                                      local_path=result.local_path)
        return self._call(context, run)

    def Resolve(self, request: pb.Identity, context: Any) -> pb.ResolveResponse:
        return self._call(context, lambda: pb.ResolveResponse(
            namespace=self.namespace(request, context),
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
            context.abort(exc.code, details(exc))
        except grpc.RpcError:
            # The writer went away mid-stream: its save cannot complete.
            if lease_id:
                self._abort_quietly(lease_id, "saves_disconnected")
            raise
        if not lease_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty write stream")
        # A writer that cancels or dies mid-stream does not always surface as an RpcError:
        # depending on which of gRPC's two completion events lands first, the request
        # iterator may just stop. A stream must carry the whole blob, so one that ends short
        # is a lost writer: abort now instead of holding the key in flight (and its temp
        # file) until the lease expires.
        with contextlib.suppress(StoreError):  # LeaseLost: committed or aborted meanwhile
            written, size = self.store.lease_progress(lease_id)
            if written < size:
                self._abort_quietly(lease_id, "saves_disconnected")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
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
            self.check_key_scope(request.key, context), wait_budget_ms(request.wait_ms, context),
            chunk_bytes))
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
            context.abort(exc.code, details(exc))
        finally:
            chunks.close()  # type: ignore[attr-defined]

    def OpenRead(self, request: pb.OpenReadRequest, context: Any) -> pb.OpenReadResponse:
        t0 = time.perf_counter()
        pin = self._call(context, lambda: self.store.open_read(
            self.check_key_scope(request.key, context),
            wait_budget_ms(request.wait_ms, context)))
        self._observe(self.read_seconds.labels(pin.tier, "local"), f"read_{pin.tier}_local", t0)
        return pb.OpenReadResponse(path=str(pin.path), size=pin.size, tier=TIERS[pin.tier],
                                   pin_id=pin.pin_id, pin_seconds=self.store.config.pin_seconds,
                                   block_size=self.store.config.block_size)

    def ReleaseRead(self, request: pb.ReleaseReadRequest, context: Any) -> pb.ReleaseReadResponse:
        quarantined = self._call(context, lambda: self.store.release_read(request.pin_id,
                                                                          request.corrupt))
        return pb.ReleaseReadResponse(quarantined=quarantined)

    def Pin(self, request: pb.KeyRequest, context: Any) -> pb.PinResponse:
        if not math.isfinite(request.ttl_seconds) or request.ttl_seconds < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "invalid_argument: ttl_seconds must be a finite number >= 0")
        self._call(context, lambda: self.store.set_pinned(
            self.check_key_scope(request.key, context), True, request.ttl_seconds))
        return pb.PinResponse(pinned=True)

    def Unpin(self, request: pb.KeyRequest, context: Any) -> pb.PinResponse:
        self._call(context, lambda: self.store.set_pinned(
            self.check_key_scope(request.key, context), False))
        return pb.PinResponse(pinned=False)

    def Delete(self, request: pb.KeyRequest, context: Any) -> pb.DeleteResponse:
        removed = self._call(context, lambda: self.store.delete(
            self.check_key_scope(request.key, context)))
        return pb.DeleteResponse(deleted=True, dependents_removed=len(removed) - 1)

    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        cfg = self.store.config
        scope = self.scope(context)
        if scope.tenants is not None:
            # A runtime token learns what a client needs (the block size) and its own
            # tenants' usage, nothing that moves with other tenants' traffic: counters,
            # sizes and latencies would tell it when another tenant's prompt hit the cache.
            return pb.StatsResponse(block_size=cfg.block_size, version=__version__,
                                    tenants=usage_messages(
                                        self.store, self.tenant_names,
                                        {self.salts.tenant_id(t) for t in scope.tenants}))
        s = self.store.stats()
        tiers = [
            pb.TierStats(tier=pb.TIER_RAM, entries=s["ram_entries"], bytes=s["ram_used"],
                         budget_bytes=cfg.ram_bytes, directory=str(self.store.ram_dir),
                         free_bytes=free_bytes(self.store.ram_dir)),
            pb.TierStats(tier=pb.TIER_DISK, entries=s["disk_entries"], bytes=s["disk_used"],
                         budget_bytes=cfg.disk_bytes, reserved_bytes=s["reserved_bytes"],
                         directory=str(self.store.root), free_bytes=free_bytes(self.store.root)),
        ]
        remote, remote_stats = None, remote_state(self.remote.tier if self.remote else None)
        counters = {**s["counters"], **remote_stats["counters"]}  # type: ignore[dict-item]
        if self.remote is not None:
            r = remote_stats
            remote = pb.RemoteStats(url=str(r["url"]), connected=bool(r["connected"]),
                                    cluster=bool(r["cluster"]), signed=bool(r["signed"]),
                                    unsigned_by_choice=bool(r["unsigned_by_choice"]),
                                    encrypted=bool(r["encrypted"]),
                                    queue_depth=int(r["queue_depth"]),  # type: ignore[call-overload]
                                    queue_max=int(r["queue_max"]),  # type: ignore[call-overload]
                                    last_error=str(r["last_error"] or ""))
        return pb.StatsResponse(tiers=tiers, counters=counters, block_size=cfg.block_size,
                                remote=remote,
                                min_free_bytes=cfg.min_free_bytes,
                                logical_bytes=s["logical_bytes"],
                                version=__version__, uptime_seconds=s["uptime"],
                                in_flight=s["in_flight"], read_pins=s["read_pins"],
                                waiting_lookups=s["waiting_lookups"],
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
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
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
        tenant_id = self.salts.tenant_id(request.tenant) if request.tenant else None
        record, header, meta, path = self._call(
            context, lambda: self.store.inspect(self.check_key_scope(request.key, context),
                                                tenant_id))
        chain = self._call(context, lambda: self.store.chain(record))
        return pb.EntryDetail(
            entry=entry_message(record, self.store.children(record.key)),
            chain=chain_message(chain), kv_layout=dict(meta.kv_layout), tokens=list(meta.tokens),
            format_version=header.version, producer=meta.producer,
            payload_size=header.payload_len, raw_payload_size=header.raw_len, path=str(path))

    def Verify(self, request: pb.VerifyRequest, context: Any) -> Iterator[pb.VerifyResult]:
        for key in request.keys:
            self._call(context, lambda k=key: check_key(k))
        for key, error, done, total in self.store.verify(list(request.keys),
                                                         check_only=request.check_only):
            yield pb.VerifyResult(key=key, ok=error is None, error=error or "", done=done,
                                  total=total)

    def Prune(self, request: pb.PruneRequest, context: Any) -> pb.PruneResponse:
        # NaN or a negative age matched every entry: a bogus filter removed everything.
        for name in ("older_than_seconds", "unused_for_seconds"):
            value = getattr(request, name)
            if not (math.isfinite(value) and value >= 0):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{name} must be a finite number >= 0, got {value}")
        keys_of = lambda field: frozenset(  # noqa: E731
            self._call(context, lambda: [check_key(k) for k in getattr(request, field)]))
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
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
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


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


class Daemon:
    """A Store served over gRPC on a unix socket, and on TCP when asked.

    The two listeners are separate gRPC servers over one service: the unix socket is
    private to its owner by file permissions, while the TCP one checks ``auth`` on every
    call (a token interceptor, TLS credentials) and refuses operator calls unless
    ``tcp_admin``.
    """

    def __init__(self, config: StoreConfig, socket_path: Path | None = None,
                 listen: str | None = None, workers: int = 32,
                 metrics_port: int | None = None, auth: ServerAuth | None = None,
                 insecure_tcp: bool = False, tcp_admin: bool = False,
                 remote: RemoteConfig | None = None,
                 tenant_secret: bytes | None = None,
                 tenant_quotas: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """``tenant_quotas``: tier -> tenant name (``*``: every tenant) -> bytes."""
        self.auth = auth or ServerAuth()
        if listen:
            parse_listen(listen)  # ValueError for a bad HOST:PORT
        refuse_unprotected_tcp(listen, self.auth, insecure_tcp)
        self.socket = OwnedSocket(socket_path or (config.root / SOCKET_NAME))
        self.socket_path = self.socket.path
        # Checked before the data directory is touched (a refusal changes nothing), and
        # claimed once the directory's lock is held. The directory first: a foreign one
        # (where the default socket would go) is refused as such.
        check_data_dir(config.root)
        self.socket.check()
        self.store = Store(config)
        self.remote_tier: RemoteTier | None = None
        try:
            if tenant_secret is None and remote is not None and remote.signing_key:
                tenant_secret = secret_from_signing_key(remote.signing_key)
            self.salts = TenantSalts(tenant_secret or data_dir_secret(config.root))
            quotas = tenant_quotas or {}
            self.store.set_tenant_quotas(TenantQuotas.by_name(
                quotas.get(TIER_DISK, {}), quotas.get(TIER_RAM, {}), self.salts.tenant_id))
            self._quota_names = {n for q in quotas.values() for n in q if n != "*"}
            if remote is not None:
                # Connecting is tried once here and then in the background: a remote that
                # is down does not keep the daemon from serving its local tiers.
                self.remote_tier = RemoteTier(remote, config.block_size).start()
                if remote.signing_key is None:
                    log.warning("SHARED TIER UNSIGNED (--remote-unsigned): anyone who can "
                                "write to %s can hand this host altered states, and anyone "
                                "who can read it reads the prompts", remote.url)
            self._listen(listen, workers, metrics_port, tcp_admin)
        except BaseException:
            if self.remote_tier is not None:
                self.remote_tier.close()
            self.store.close()  # releases the data directory for the next attempt
            self.socket.remove()
            raise
        self._stopped = threading.Event()

    def _listen(self, listen: str | None, workers: int, metrics_port: int | None,
                tcp_admin: bool) -> None:
        self.metrics = Metrics("kvcache")
        sync = RemoteSync(self.store, self.remote_tier) if self.remote_tier else None
        self.metrics.add_snapshot(
            lambda: {**self.store.stats()["counters"],  # type: ignore[dict-item]
                     **remote_state(self.remote_tier)["counters"]},  # type: ignore[dict-item]
            lambda: {**store_gauges(self.store),
                     **remote_gauges(remote_state(self.remote_tier))})
        self.metrics_port = metrics_port
        self.service = KVCacheService(self.store, self.metrics, sync, self.salts,
                                      self.auth.tokens)
        for name in self._quota_names:
            self.service.tenant_names.learn(name)
        self.health = health.HealthServicer()
        self.servers = [self._server(workers, [])]
        self.socket.bind(self.servers[0])
        self.addresses = [self.socket.address]
        if listen:
            gate = OperatorGate(OPERATOR_METHODS, self.auth.tokens, admins_allowed=tcp_admin)
            tcp = self._server(workers, [*self.auth.interceptors(), gate])
            self.addresses.append(add_tcp_port(tcp, listen, self.auth))
            self.servers.append(tcp)

    def _server(self, workers: int, interceptors: list[grpc.ServerInterceptor]) -> grpc.Server:
        return grpc_server(
            lambda server: pb_grpc.add_KVCacheServicer_to_server(self.service, server),
            SERVICE_NAME, self.health, workers, server_options(), interceptors,
            thread_name_prefix="kvcache-rpc")

    def start(self) -> None:
        for server in self.servers:
            server.start()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.metrics_port)
            self.addresses.append(f"metrics http://127.0.0.1:{self.metrics_port}/metrics")
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        stopping = [server.stop(grace) for server in self.servers]
        for event in stopping:
            event.wait()
        if self.remote_tier is not None:
            self.remote_tier.close()  # uploads still queued are dropped
        self.store.close()
        self.socket.remove()

    def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down cleanly."""
        done = threading.Event()

        def on_signal(signum: int, frame: object) -> None:
            log.info("signal %d: shutting down", signum)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        log.info("kvcache %s listening on %s (data %s, ram tier %s)", __version__,
                 " and ".join(self.addresses), self.store.root, self.store.ram_dir)
        if len(self.servers) > 1:
            safe, how = tcp_security(self.auth)
            log.log(logging.INFO if safe else logging.WARNING, "TCP %s: %s",
                    self.addresses[1], how)
        # Wake up regularly: a signal delivered to another thread (llama.cpp's, gRPC's)
        # only runs its Python handler once the main thread executes bytecode again.
        while not done.wait(0.2):
            pass
        self.stop()
        log.info("kvcache stopped")
