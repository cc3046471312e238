"""A small typed, synchronous client for the kvcache daemon.

Every call has a deadline, so nothing hangs on a daemon that is gone or stuck; the
channel reconnects by itself with a short exponential backoff when the daemon returns.
Callers that must never fail because of the cache (the model runtime) catch
:class:`CacheUnavailable` and carry on cold.

On a unix socket (same host) blobs move through files instead of gRPC messages: a save
writes the daemon's reserved temp file directly, a load reads the published file while
the daemon pins it. Over TCP both stream in chunks.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar

import grpc

from . import blob as blobfmt
from . import keys
from .auth import ClientAuth
from .client_errors import CacheError, CacheUnavailable, CorruptBlob, NotAPrefix, wrap
from .config import CHUNK_BYTES, MAX_MESSAGE_BYTES, default_address, is_local, normalize_address
from .v1 import kvcache_pb2 as pb
from .v1 import kvcache_pb2_grpc as pb_grpc

TIER_NAMES = {pb.TIER_RAM: "ram", pb.TIER_DISK: "disk", pb.TIER_REMOTE: "remote",
              pb.TIER_UNSPECIFIED: ""}


@dataclass(frozen=True)
class Identity:
    """What a state belongs to. ``tenant`` isolates entries; it is hashed, never stored."""

    model_fingerprint: str
    kv_layout: Mapping[str, str] = field(default_factory=dict)
    tenant: str = ""
    model_name: str = ""

    def message(self) -> pb.Identity:
        return pb.Identity(model_fingerprint=self.model_fingerprint,
                           kv_layout={str(k): str(v) for k, v in self.kv_layout.items()},
                           tenant=self.tenant, model_name=self.model_name)

    @property
    def namespace(self) -> bytes:
        """The namespace of an identity without a tenant. A tenant's is salted with the
        daemon's secret: ask the daemon (CacheClient.namespace_of)."""
        if self.tenant:
            raise ValueError("a tenant's namespace is the daemon's to derive: use "
                             "CacheClient.namespace_of")
        return keys.namespace(self.model_fingerprint, self.kv_layout, "")


@dataclass(frozen=True)
class Piece:
    """One blob of an entry's state: the cells of tokens ``[base, n_tokens)``. A piece
    a lookup opened (``open_min_tokens``) also says where its file is, and holds a read
    pin (``pin_id``) until it is loaded or released."""

    key: bytes
    base: int
    n_tokens: int
    size: int
    tier: str
    path: str = ""
    pin_id: str = ""


@dataclass(frozen=True)
class LookupResult:
    key: bytes
    matched_tokens: int
    tier: str
    size: int
    probes: int
    entry_tokens: int = 0  # the entry's own length (a common-prefix hit may be longer)
    chain: tuple[Piece, ...] = ()  # the blobs making up its state, root first
    block_size: int = 0  # the daemon's, when it opened pieces (their key check needs it)

    def pieces_for(self, n_tokens: int) -> tuple[Piece, ...]:
        """The pieces holding the first ``n_tokens`` tokens (those starting below it)."""
        return tuple(p for p in self.chain if p.base < n_tokens)

    def parent_for(self, n_tokens: int) -> Piece | None:
        """The piece whose own cells hold token ``n_tokens - 1``: the parent a save
        sharing the first ``n_tokens`` tokens is built on."""
        pieces = self.pieces_for(n_tokens)
        return pieces[-1] if pieces else None


@dataclass(frozen=True)
class SaveResult:
    status: str  # saved | already_present | in_flight
    key: bytes
    size: int = 0


@dataclass(frozen=True)
class LoadedBlob:
    meta: blobfmt.BlobMeta
    payload: memoryview  # decoded state bytes (a piece's: only its own cells)
    tier: str
    size: int  # bytes of the stored blob
    key: bytes = b""


def map_file(f: BinaryIO, size: int) -> memoryview:
    """A read-only view of a published blob file, without copying it.

    The RAM tier lives on a memory filesystem, so this maps its pages directly; disk-tier
    files map their page cache. Published blobs are never modified or truncated (only
    renamed or unlinked, which leaves a mapping valid), so the view stays good after the
    daemon's pin is released. Pages are faulted in by the checksum pass that follows, 16
    at a time (the kernel's fault-around): for a 47 MB blob in the RAM tier, 0.4 ms less
    than MAP_POPULATE's page-by-page mapping up front.
    """
    return memoryview(mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ))


@dataclass(frozen=True)
class _Opened:
    """A blob the daemon pinned for this client's read (OpenRead, or a lookup that
    opened its pieces): where it is, and the block size its key is checked with."""

    path: str
    size: int
    pin_id: str
    tier: str
    block_size: int


_Reply = TypeVar("_Reply")


class CacheClient:
    def __init__(self, address: str | None = None, *, timeout: float = 10.0,
                 fast_path: bool | None = None, auth: ClientAuth | None = None) -> None:
        """``auth`` defaults to the credentials named by ``KVCACHE_TOKEN_FILE`` and
        ``KVCACHE_TLS_*`` (none when they are unset)."""
        self.address = normalize_address(address or default_address())
        self.timeout = timeout
        self.fast_path = is_local(self.address) if fast_path is None else fast_path
        self.auth = ClientAuth.from_env() if auth is None else auth
        self.channel = self.auth.channel(self.address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            # Not grpc.min_reconnect_backoff_ms: gRPC core uses it as the minimum *connect
            # timeout*, so at 100 ms every connection attempt to a daemon that is briefly
            # busy (a loaded machine, a start-up) failed at once with UNAVAILABLE.
            ("grpc.max_reconnect_backoff_ms", 2000),
        ])
        self.stub = pb_grpc.KVCacheStub(self.channel)
        # Identity -> (namespace, tenant label), as the daemon derives them (Resolve).
        self._resolved: dict[tuple[object, ...], tuple[bytes, str]] = {}
        # Read pins released without waiting for the answer (see _release_later).
        self._releases: list[grpc.Future] = []
        self._releases_lock = threading.Lock()

    def close(self) -> None:
        self._settle_releases()
        self.channel.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rpc(self, method: str, request: object, reply: type[_Reply],
             timeout: float | None = None) -> _Reply:
        """``method``'s answer to ``request``, a ``reply`` (the generated stub has no type
        hints: ``reply`` names what the method answers, for the type checker)."""
        if self._releases:
            self._settle_releases()  # this client's later calls see its reads released
        try:
            answer: _Reply = getattr(self.stub, method)(request, timeout=timeout or self.timeout)
            return answer
        except grpc.RpcError as exc:
            raise wrap(exc, self.address) from None

    def resolve(self, identity: Identity) -> tuple[bytes, str]:
        """``(namespace, tenant_id)`` of ``identity`` on this daemon: computed here without
        a tenant, else asked once (a tenant's salt comes from the daemon's secret)."""
        if not identity.tenant:
            return identity.namespace, ""
        name = (identity.model_fingerprint, tuple(sorted(identity.kv_layout.items())),
                identity.tenant)
        known = self._resolved.get(name)
        if known is None:
            resp = self._rpc("Resolve", identity.message(), pb.ResolveResponse)
            known = self._resolved[name] = (resp.namespace, resp.tenant_id)
        return known

    def namespace_of(self, identity: Identity) -> bytes:
        return self.resolve(identity)[0]

    def _release_later(self, pin_id: str) -> None:
        """Release a read pin of a blob read well, without waiting for the answer: it is
        off a restore's path (a round trip of ~0.5 ms). The client's next call, or its
        close, waits for it first; a release that fails leaves the pin to expire."""
        try:
            future = self.stub.ReleaseRead.future(pb.ReleaseReadRequest(pin_id=pin_id),
                                                  timeout=5.0)
        except (ValueError, grpc.RpcError):  # the channel is closed: the pin will expire
            return
        with self._releases_lock:
            self._releases.append(future)

    def _settle_releases(self) -> None:
        with self._releases_lock:
            pending, self._releases = self._releases, []
        for future in pending:
            with contextlib.suppress(grpc.RpcError):
                future.result()

    def release(self, hit: LookupResult) -> None:
        """Release the pins of the pieces a lookup opened that will not be loaded."""
        for piece in hit.chain:
            if piece.pin_id:
                self._release_later(piece.pin_id)

    # -- cache use --------------------------------------------------------------------------

    def lookup(self, identity: Identity, tokens: Sequence[int], *, max_tokens: int = 0,
               common_prefix: bool = False, open_min_tokens: int = 0,
               timeout: float | None = None) -> LookupResult | None:
        """The longest saved prefix of ``tokens``, or None. With ``common_prefix``, the
        entry sharing the most leading tokens, also one longer than ``tokens`` or
        diverging from them (``entry_tokens`` > ``matched_tokens``: cut it there). When at
        least ``open_min_tokens`` tokens match (and the daemon is on this host), the
        pieces holding them are opened in the same call: pass them to :meth:`load_chain`,
        or :meth:`release` the hit."""
        resp = self._rpc("Lookup", pb.LookupRequest(
            identity=identity.message(), packed_tokens=keys.tokens_to_bytes(tokens),
            max_tokens=max_tokens, common_prefix=common_prefix,
            open_min_tokens=open_min_tokens if self.fast_path else 0), pb.LookupResponse, timeout)
        return self._lookup_result(resp)

    def lookup_before_save(self, identity: Identity, tokens: Sequence[int], *,
                           wait_in_flight_ms: int = 0, timeout: float | None = None
                           ) -> tuple[LookupResult | None, int]:
        """The stored entry sharing the most leading tokens with ``tokens`` (as
        ``lookup(common_prefix=True)``), waiting up to ``wait_in_flight_ms`` for a save
        in flight that shares more; and how many tokens a save still in flight after
        that wait shares with them (0: none sharing more than the entry found)."""
        wait_s = wait_in_flight_ms / 1000
        resp = self._rpc("Lookup", pb.LookupRequest(
            identity=identity.message(), packed_tokens=keys.tokens_to_bytes(tokens),
            common_prefix=True, wait_in_flight_ms=wait_in_flight_ms), pb.LookupResponse,
            (timeout or self.timeout) + wait_s)
        return self._lookup_result(resp), resp.in_flight_tokens

    @staticmethod
    def _lookup_result(resp: pb.LookupResponse) -> LookupResult | None:
        if not resp.found:
            return None
        chain = tuple(Piece(p.key, p.base, p.n_tokens, p.size, TIER_NAMES[p.tier],
                            p.path, p.pin_id) for p in resp.chain)
        return LookupResult(resp.key, resp.matched_tokens, TIER_NAMES[resp.tier], resp.size,
                            resp.probes, resp.entry_tokens or resp.matched_tokens, chain,
                            resp.block_size)

    def save(self, identity: Identity, tokens: Sequence[int], payload: bytes | memoryview,
             reason: str, *, codec: str = "none", timeout: float | None = None,
             parent: bytes = b"", base: int = 0, cell_layout: bytes = b"",
             logits: bytes = b"") -> SaveResult:
        """Reserve, write and commit one state. Duplicates are dropped by the daemon.

        With ``parent``, a piece: ``payload`` holds only what follows the first ``base``
        tokens, which entry ``parent``'s chain holds (see LookupResult.parent_for); a
        parent gone meanwhile raises CacheError with code NOT_FOUND. ``cell_layout``
        describes the payload for whoever joins pieces, ``logits`` the scores of the token
        after the last one (both stored, never read here)."""
        namespace, tenant_id = self.resolve(identity)
        meta = blobfmt.BlobMeta(
            namespace=namespace, model_fingerprint=identity.model_fingerprint,
            kv_layout=dict(identity.kv_layout), tokens=list(tokens), reason=reason,
            model_name=identity.model_name, tenant_id=tenant_id,
            parent=parent, base=base, cell_layout=cell_layout, logits=logits)
        parts = blobfmt.encode_blob(meta, payload, codec)
        size = blobfmt.blob_size(parts)
        deadline = time.monotonic() + (timeout or max(self.timeout, 30.0))
        resp = self._rpc("Reserve", pb.ReserveRequest(identity=identity.message(),
                                                      packed_tokens=keys.tokens_to_bytes(tokens),
                                                      size=size, reason=reason,
                                                      parent=parent, base=base),
                         pb.ReserveResponse, self._left(deadline))
        if resp.status == pb.ReserveResponse.ALREADY_PRESENT:
            return SaveResult("already_present", resp.key)
        if resp.status == pb.ReserveResponse.IN_FLIGHT:
            return SaveResult("in_flight", resp.key)
        lease = resp.lease_id
        try:
            local = self.fast_path and resp.local_path and os.path.exists(resp.local_path)
            if local:
                self._write_local(resp.local_path, parts)
            else:
                self._rpc_stream_write(lease, parts, self._left(deadline))
            done = self._rpc("Commit", pb.CommitRequest(lease_id=lease, local_write=bool(local)),
                             pb.CommitResponse, self._left(deadline))
        except BaseException:
            with contextlib.suppress(CacheError):  # else the lease expires on its own
                self._rpc("Abort", pb.AbortRequest(lease_id=lease), pb.AbortResponse, 2.0)
            raise
        return SaveResult("saved", done.key, done.size)

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.05, deadline - time.monotonic())

    @staticmethod
    def _write_local(path: str, parts: list[bytes | memoryview]) -> None:
        """Write the blob into the daemon's reserved temp file (same host)."""
        try:
            with open(path, "r+b", buffering=0) as f:
                for part in parts:
                    view = memoryview(part)
                    while view:
                        # A raw write is short when the disk fills: unchecked, it left a
                        # truncated file that the commit then blamed on the blob.
                        n = f.write(view)
                        if not n:
                            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                        view = view[n:]
        except OSError as exc:
            # Raised as is, an OSError escaped callers that expect CacheError (the
            # runtime's saver thread died of it). The caller aborts the lease.
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise CacheError(
                f"writing the reserved file {path} failed: {exc.strerror or exc} "
                "(save aborted)",
                grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.INTERNAL,
            ) from None

    def _rpc_stream_write(self, lease: str, parts: list[bytes | memoryview],
                          timeout: float) -> None:
        def chunks() -> Iterator[pb.WriteChunk]:
            offset = 0
            for part in parts:
                view = memoryview(part)
                for start in range(0, len(view), CHUNK_BYTES):
                    piece = bytes(view[start : start + CHUNK_BYTES])
                    yield pb.WriteChunk(lease_id=lease, offset=offset, data=piece)
                    offset += len(piece)

        try:
            self.stub.Write(chunks(), timeout=timeout)
        except grpc.RpcError as exc:
            raise wrap(exc, self.address) from None

    def load(self, key: bytes, *, prefix_of: Sequence[int] | None = None, shares: int = 0,
             wait_ms: int = 0, timeout: float | None = None) -> LoadedBlob:
        """Fetch and verify a blob. With ``prefix_of``, also prove that its tokens are a
        prefix of that prompt (the hash is not the proof); with ``shares`` N as well, only
        that its first N tokens are the prompt's (a common-prefix hit)."""
        return self._load(key, prefix_of, shares, wait_ms, timeout)

    def _load(self, key: bytes, prefix_of: Sequence[int] | None, shares: int, wait_ms: int,
              timeout: float | None, opened: _Opened | None = None) -> LoadedBlob:
        t = timeout or max(self.timeout, wait_ms / 1000 + 5)
        if opened is not None:
            blob, tier = self._read_opened(key, opened, wait_ms, t)
        else:
            load = self._load_local if self.fast_path else self._load_stream
            blob, tier = load(key, wait_ms, t)
        tokens = blob.meta.tokens
        if prefix_of is not None:
            n = shares or len(tokens)
            if n > len(tokens) or n > len(prefix_of) or \
                    list(prefix_of[:n]) != list(tokens[:n]):
                shared = keys.common_prefix_tokens(keys.tokens_to_bytes(tokens),
                                                   keys.tokens_to_bytes(prefix_of))
                raise NotAPrefix(key, n, len(tokens), shared)
        return LoadedBlob(blob.meta, memoryview(blob.payload), tier, blob.header.total_size,
                          key)

    def load_chain(self, key: bytes, *, prefix_of: Sequence[int], shares: int = 0,
                   pieces: Sequence[Piece] = (), block_size: int = 0, wait_ms: int = 0,
                   timeout: float | None = None) -> list[LoadedBlob]:
        """The blobs holding entry ``key``'s first ``shares`` tokens (default: all of
        them), root first, each proven to hold the prompt's tokens it covers. ``pieces``
        (a lookup's chain) names them, and those the lookup opened are read where it
        said (``block_size``: the lookup's) and their pins released, also on a failure;
        without ``pieces`` they are found by following each blob's parent. A missing or
        corrupt link raises as :meth:`load` does."""
        blobs: list[LoadedBlob] = []
        if pieces:
            try:
                for i, piece in enumerate(pieces):
                    # A parent is proven only up to where its child takes over: past that
                    # it may well diverge from the prompt.
                    end = pieces[i + 1].base if i + 1 < len(pieces) else piece.n_tokens
                    need = min(shares, end) if shares else end
                    opened = _Opened(piece.path, piece.size, piece.pin_id, piece.tier,
                                     block_size) if piece.pin_id else None
                    blobs.append(self._load(piece.key, prefix_of, need, wait_ms, timeout,
                                            opened))
            finally:
                for piece in pieces[len(blobs) + 1:]:  # (the one that failed released its own)
                    if piece.pin_id:
                        self._release_later(piece.pin_id)
        else:
            blob = self.load(key, prefix_of=prefix_of, shares=shares, wait_ms=wait_ms,
                             timeout=timeout)
            n = shares or len(blob.meta.tokens)
            blobs.append(blob)
            while blobs[0].meta.parent:
                meta = blobs[0].meta
                blobs.insert(0, self.load(meta.parent, prefix_of=prefix_of,
                                          shares=min(n, meta.base), timeout=timeout))
            while len(blobs) > 1 and blobs[-1].meta.base >= n:  # holds none of them
                blobs.pop()
        for parent, child in itertools.pairwise(blobs):
            if child.meta.parent != parent.key or not (
                    parent.meta.base < child.meta.base <= len(parent.meta.tokens)):
                raise CacheError(f"entry {child.key.hex()} is not built on "
                                 f"{parent.key.hex()} (a broken chain)")
        if blobs and blobs[0].meta.parent:
            raise CacheError(f"entry {blobs[0].key.hex()} misses its parent "
                             f"{blobs[0].meta.parent.hex()}")
        return blobs

    def _load_local(self, key: bytes, wait_ms: int, timeout: float) -> tuple[blobfmt.Blob, str]:
        resp = self._rpc("OpenRead", pb.OpenReadRequest(key=key, wait_ms=wait_ms),
                         pb.OpenReadResponse, timeout)
        return self._read_opened(key, _Opened(resp.path, resp.size, resp.pin_id,
                                              TIER_NAMES[resp.tier], resp.block_size),
                                 wait_ms, timeout)

    def _read_opened(self, key: bytes, opened: _Opened, wait_ms: int, timeout: float
                     ) -> tuple[blobfmt.Blob, str]:
        """Map and verify a blob the daemon opened (pinned) for this client, and release
        its pin: at once and reported for quarantine when the blob is bad, in the
        background when it is good."""
        blob: blobfmt.Blob | None = None
        unreadable = False
        try:
            with open(opened.path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size == opened.size:
                    blob = blobfmt.decode_blob(map_file(f, opened.size))
            # Checksums pass any valid blob, and one of another entry (same size: same
            # prompt length and model shape) would restore another prompt's, tenant's or
            # model's state. The blob's own namespace and tokens must give the key asked
            # for. (The streamed path is checked by the daemon.)
            if blob is not None and opened.block_size and keys.entry_key(
                    blob.meta.namespace, blob.meta.tokens, opened.block_size).key != key:
                blob = None  # a swapped or misplaced file
        except FileNotFoundError:
            blob = None  # the daemon vouched for a file that is gone: let it check
        except PermissionError:
            # Another user's daemon: its files will never be ours to read, so stream from
            # now on (for saves too).
            self.fast_path = False
            unreadable = True
        except OSError:
            unreadable = True  # a passing failure (EMFILE, ENOMEM from mmap): stream this one
        except blobfmt.BlobError:
            blob = None
        finally:
            if blob is not None:
                self._release_later(opened.pin_id)
            else:  # a bad blob is reported so the daemon verifies and quarantines it
                with contextlib.suppress(CacheError):
                    self._rpc("ReleaseRead", pb.ReleaseReadRequest(
                        pin_id=opened.pin_id, corrupt=not unreadable), pb.ReleaseReadResponse, 5.0)
        if unreadable:
            return self._load_stream(key, wait_ms, timeout)
        if blob is None:
            raise CorruptBlob(f"entry {key.hex()} failed verification; reported for quarantine")
        return blob, opened.tier

    def _load_stream(self, key: bytes, wait_ms: int, timeout: float) -> tuple[blobfmt.Blob, str]:
        buf = bytearray()
        tier = ""
        try:
            for chunk in self.stub.Read(pb.ReadRequest(key=key, wait_ms=wait_ms),
                                        timeout=timeout):
                if chunk.offset == 0 and chunk.total_size:
                    buf = bytearray(chunk.total_size)
                    tier = TIER_NAMES[chunk.tier]
                end = chunk.offset + len(chunk.data)
                if end > len(buf):
                    raise CacheError(f"daemon sent bytes past the end of {key.hex()}")
                buf[chunk.offset : end] = chunk.data
        except grpc.RpcError as exc:
            raise wrap(exc, self.address) from None
        try:
            return blobfmt.decode_blob(buf), tier
        except blobfmt.BlobError as exc:
            raise CorruptBlob(f"entry {key.hex()} arrived corrupt ({exc})") from None

    # -- administration ---------------------------------------------------------------------

    def stats(self) -> pb.StatsResponse:
        return self._rpc("Stats", pb.StatsRequest(), pb.StatsResponse)

    def list_entries(self, *, model: str = "", tenant: str = "", reason: str = "",
                     tier: str = "", min_tokens: int = 0, limit: int = 0,
                     key_prefix: str = "", sort: str = "") -> list[pb.Entry]:
        """Entries passing every filter given, most recently used first (or in ``sort``'s
        order: age, size, tokens, hits), in one answer. ``model``: the model's file name or
        its beginning, or a fingerprint prefix; ``key_prefix``: leading hex digits of the
        key. For listings of any size, :meth:`iter_entries` pages."""
        return [e for page in self.iter_entries(
            model=model, tenant=tenant, reason=reason, tier=tier, min_tokens=min_tokens,
            limit=limit, key_prefix=key_prefix, sort=sort, page_size=0) for e in page]

    def iter_entries(self, *, model: str = "", tenant: str = "", reason: str = "",
                     tier: str = "", min_tokens: int = 0, limit: int = 0,
                     key_prefix: str = "", sort: str = "", page_size: int = 500
                     ) -> Iterator[list[pb.Entry]]:
        """:meth:`list_entries`, a page of at most ``page_size`` entries at a time (0: all
        in one), up to ``limit`` in all (0: every entry)."""
        tier_value = {"": pb.TIER_UNSPECIFIED, "ram": pb.TIER_RAM, "disk": pb.TIER_DISK,
                      "remote": pb.TIER_REMOTE}[tier]
        token, shown = b"", 0
        while True:
            size = min(page_size, limit - shown) if page_size and limit else page_size
            resp = self._rpc("List", pb.ListRequest(
                model=model, tenant=tenant, reason=reason, tier=tier_value,
                min_tokens=min_tokens, limit=limit - shown if limit else 0,
                key_prefix=key_prefix, sort=sort, page_size=size, page_token=token),
                pb.ListResponse)
            shown += len(resp.entries)
            yield list(resp.entries)
            token = resp.next_page_token
            if not token or (limit and shown >= limit):
                return

    def inspect(self, key: bytes, *, tenant: str = "") -> pb.EntryDetail:
        return self._rpc("Inspect", pb.InspectRequest(key=key, tenant=tenant), pb.EntryDetail)

    def verify(self, keys_: Sequence[bytes] = (), timeout: float = 3600.0, *,
               check_only: bool = False) -> Iterator[pb.VerifyResult]:
        """Check the given entries (every one when none is given); bad ones are
        quarantined unless ``check_only``."""
        try:
            yield from self.stub.Verify(pb.VerifyRequest(keys=list(keys_), check_only=check_only),
                                        timeout=timeout)
        except grpc.RpcError as exc:
            raise wrap(exc, self.address) from None

    def prune(self, **criteria: Any) -> pb.PruneResponse:
        """Criteria are :class:`pb.PruneRequest`'s fields: the filters choose what may go,
        the byte targets say how much (see the message's comment)."""
        return self._rpc("Prune", pb.PruneRequest(**criteria), pb.PruneResponse, 300.0)

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> None:
        """Pin an entry against eviction: until :meth:`unpin`, or with ``ttl_seconds``
        until then (a later pin extends an expiring pin, never shortens one)."""
        self._rpc("Pin", pb.KeyRequest(key=key, ttl_seconds=ttl_seconds), pb.PinResponse)

    def unpin(self, key: bytes) -> None:
        self._rpc("Unpin", pb.KeyRequest(key=key), pb.PinResponse)

    def entry_tokens(self, key: bytes, *, tenant: str = "") -> list[int]:
        """The tokens of ``tenant``'s entry ``key`` (the data path's read: a runtime
        token bound to ``tenant`` may make it; NOT_FOUND for any other entry)."""
        reply = self._rpc("EntryTokens", pb.EntryTokensRequest(key=key, tenant=tenant),
                          pb.EntryTokensResponse)
        return keys.bytes_to_tokens(reply.packed_tokens)

    def pin_tenant_entry(self, key: bytes, ttl_seconds: float, *,
                         tenant: str = "") -> pb.PinTenantEntryResponse:
        """Pin ``tenant``'s entry ``key`` for ``ttl_seconds`` (the data path's expiring pin,
        bounded by the daemon; RESOURCE_EXHAUSTED past what the tenant's pins may hold)."""
        return self._rpc("PinTenantEntry", pb.PinTenantEntryRequest(
            key=key, tenant=tenant, ttl_seconds=ttl_seconds), pb.PinTenantEntryResponse)

    def delete(self, key: bytes) -> int:
        """Remove an entry and the entries built on it; returns how many of those went.
        Refused (FAILED_PRECONDITION) while one is pinned or read by a client; the daemon's
        own work on them (a RAM copy being made, a piece being saved on one) is waited for,
        up to its ``delete_wait_seconds``."""
        return self._rpc("Delete", pb.KeyRequest(key=key), pb.DeleteResponse).dependents_removed

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the daemon answers (raises CacheUnavailable after ``timeout``)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CacheUnavailable(f"no kvcache daemon answered at {self.address} "
                                   f"within {timeout:.0f} s") from None
