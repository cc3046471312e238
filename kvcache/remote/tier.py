"""The remote tier's API: find a prompt's deepest shared entry, fetch a chain's pieces,
publish committed entries (uploaded in the background), list what is there, stats.

No public method raises on a remote problem: a lost, slow, full or lying remote is
counted and answered as a miss (or a dropped upload). ``find`` returns within
``op_timeout_s`` and ``fetch`` within ``fetch_budget_s``, whatever the remote does. See
the package docstring for the key layout.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import blob as blobfmt
from .. import keys
from .config import RemoteConfig
from .conn import Client
from .core import DISCONNECTED, Core, Failed, _Job
from .layout import MAX_CHAIN, ChainLink, RemoteRecord, ValueInvalid
from .upload import BlobBytes, Uploader

log = logging.getLogger("kvcache.remote")
MiB = 1 << 20
# A fetch reads at most this many bytes of parts per round trip, checking its budget
# between round trips.
FETCH_BATCH_BYTES = 64 * MiB
# A lookup reads the records of at most this many entries the deepest block pointers name
# (in one round trip): a pointer whose entry was evicted does not cost another.
MAX_CANDIDATES = 4
# list_entries reads at most this many record names (its namespace filter comes after).
MAX_SCAN = 100_000


@dataclass(frozen=True)
class RemoteMatch:
    """The remote entry sharing the most leading tokens with a prompt."""

    key: bytes
    n_tokens: int
    shared: int  # leading tokens it shares with the prompt (capped by max_tokens)
    chain: tuple[ChainLink, ...]  # root first, this entry last: what fetch() takes
    record: RemoteRecord

    @property
    def chain_keys(self) -> list[bytes]:
        return [link.key for link in self.chain]


class RemoteTier:
    """A Redis/Valkey tier shared by a fleet. Thread-safe."""

    def __init__(self, config: RemoteConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._core = Core(config, block_size)
        self._uploader = Uploader(self._core)
        self.names = self._core.names
        self._started = False
        self._closed = False

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> RemoteTier:
        """Connect (one try of at most the op deadline now, then in the background until
        it answers) and start the uploader. Never raises on a remote that is down."""
        if not self._started:
            self._started = True
            self._core.conn.start()
            self._uploader.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop the threads within about ``timeout`` (sockets in use are shut, so an
        upload in flight ends at once); uploads still queued are dropped."""
        if self._closed:
            return
        self._closed = True
        self._uploader.stop()  # first: it must not start another upload
        self._core.close(timeout)
        self._uploader.join(timeout)

    def __enter__(self) -> RemoteTier:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._core.conn.connected

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.connected:
            if time.monotonic() > deadline or self._closed:
                return False
            time.sleep(0.01)
        return True

    def stats(self) -> dict[str, object]:
        """State and counters (every name of counters.REMOTE_SECTION, zeros included)."""
        return {
            "connected": self.connected,
            "url": self.config.url,
            "cluster": self._core.conn.cluster,
            "signed": self.config.signing_key is not None,
            "unsigned_by_choice": self.config.signing_key is None,
            "encrypted": self.config.encrypt,
            "queue_depth": self._uploader.queue.qsize(),
            "queue_max": self.config.queue_max,
            "last_error": self._core.conn.last_error,
            "counters": self._core.counter_values(),
        }

    # -- publish ----------------------------------------------------------------------------

    def publish(self, chain: Sequence[ChainLink], read_blob: Callable[[bytes], BlobBytes]
                ) -> bool:
        """Queue the upload of ``chain[-1]`` after its local commit. ``chain`` is its
        chain as the local store has it, root first (``ChainLink.of(r) for r in
        store.chain(record)``); ancestors the remote lacks are uploaded first. Each blob
        is read with ``read_blob(key)`` when its turn comes (bytes or a list of byte
        strings; any exception abandons the upload, counted) and verified before it is
        sent. Never blocks: False, counted, when the remote is disconnected or the queue
        is full. Raises ValueError for a malformed chain."""
        return self._uploader.publish(chain, read_blob)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued upload is done (uploaded, skipped or failed)."""
        return self._uploader.drain(timeout)

    # -- find -------------------------------------------------------------------------------

    def find(self, ns: bytes, tokens: Sequence[int] | bytes, max_tokens: int = 0, *,
             whole_prefix: bool = False) -> RemoteMatch | None:
        """The remote entry of namespace ``ns`` sharing the most leading tokens with
        ``tokens`` (ids or packed u32 LE; it may be longer than them or diverge), shared
        at most ``max_tokens`` when given; None if none shares any. Two round trips: the
        prompt's block pointers, then the records of the deepest entries they name. Within
        ``op_timeout_s``: past it the remote is marked down and this answers None.

        With ``whole_prefix`` (states that cannot be cut), the entry whose chain holds the
        longest whole prefix of the tokens wins, and the entry of exactly the first
        ``max_tokens`` tokens (or all) is read with the records: a block pointer names the
        last entry through its block, so a longer state saved after that one (a ``finish``
        after its prompt's checkpoint) hides it from the pointers."""
        self.count("remote_lookups")
        match = None
        try:
            raw = tokens if isinstance(tokens, bytes) else keys.tokens_to_bytes(tokens)
            match = self._core.foreground(
                lambda job: self._find(ns, raw, max_tokens, whole_prefix),
                self.config.op_timeout_s)
        except Failed as failed:
            if failed.kind == DISCONNECTED:
                self.count("remote_skipped_disconnected")
        except Exception:  # a bug here must not fail the request: it goes on without us
            log.exception("remote lookup failed")
        self.count("remote_hits" if match else "remote_misses")
        return match

    def _find(self, ns: bytes, raw: bytes, max_tokens: int,
              whole_prefix: bool = False) -> RemoteMatch | None:
        core = self._core
        n_query = len(raw) // 4
        limit = min(n_query, max_tokens) if max_tokens else n_query
        if limit <= 0:
            return None
        hashes = keys.block_hashes(ns, raw, self.block_size)
        pointer_names = [self.names.block(h) for h in hashes]
        pointers = core.call(lambda c: core.mget(c, pointer_names))
        candidates: list[bytes] = []
        if whole_prefix:
            candidates.append(keys.entry_key(ns, raw[: limit * 4], self.block_size).key)
        for k in range(len(hashes) - 1, -1, -1):  # deepest first
            value = pointers[k]
            if value is None:
                continue
            try:
                body = bytes(core.open(pointer_names[k], value))
            except ValueInvalid:
                continue
            if len(body) != keys.KEY_BYTES:
                self.count("remote_verify_failures")
                continue
            if body not in candidates:
                candidates.append(body)
                if len(candidates) == MAX_CANDIDATES + whole_prefix:
                    break
        if not candidates:
            return None
        values = core.call(lambda c: core.mget(c, [self.names.record(k) for k in candidates]))
        best: RemoteMatch | None = None
        for key, value in zip(candidates, values, strict=True):
            record = core.record(key, value)
            if record is None:
                continue
            if record.namespace != ns:  # a pointer under our namespace names another's
                self.count("remote_verify_failures")
                continue
            shared = min(keys.common_prefix_tokens(record.tokens, raw), limit)
            found = RemoteMatch(key, record.n_tokens, shared, record.chain, record)
            serves = servable_tokens(found, whole_prefix)
            if serves > (servable_tokens(best, whole_prefix) if best else 0):
                best = found
        return best

    # -- fetch ------------------------------------------------------------------------------

    def fetch(self, chain_keys: Sequence[bytes], ns: bytes | None = None) -> list[bytes] | None:
        """The verified blobs of a chain (root first: ``RemoteMatch.chain_keys``, or the
        part of it after the links the caller holds already), or of the longest prefix of
        it that could be fetched and verified within ``fetch_budget_s``; None when not
        even the first could. With ``ns``, every piece must belong to that namespace.

        Each blob's parts are joined and parsed with every checksum checked, its tokens
        and namespace recompute to its key, and its parent and base are its record's and
        the chain's. Round trips: one for the records, one per 64 MiB of parts."""
        self.count("remote_fetches")
        blobs: list[bytes] = []
        budget = self.config.fetch_budget_s
        deadline = time.monotonic() + budget
        try:
            self._core.foreground(lambda job: self._fetch(list(chain_keys), ns, deadline, job,
                                                          blobs), budget, mark_down=False)
        except Failed as failed:
            if failed.kind == DISCONNECTED:
                self.count("remote_skipped_disconnected")
            elif time.monotonic() >= deadline:
                self.count("remote_fetch_budget_exceeded")
        except Exception:  # see find()
            log.exception("remote fetch failed")
        blobs = blobs[:]  # what was verified by now (the I/O thread stops at its next step)
        if not blobs:
            self.count("remote_fetch_failed")
            return None
        if len(blobs) < len(chain_keys):
            self.count("remote_fetch_short")
        return blobs

    def _fetch(self, chain_keys: list[bytes], ns: bytes | None, deadline: float, job: _Job,
               out: list[bytes]) -> None:
        core = self._core
        if not chain_keys or len(chain_keys) > MAX_CHAIN:
            return
        found = core.call(lambda c: core.mget(c, [self.names.record(k) for k in chain_keys]))
        records: list[RemoteRecord] = []
        for i, (key, value) in enumerate(zip(chain_keys, found, strict=True)):
            record = core.record(key, value)
            if record is None:
                break  # evicted (or refused): the prefix before it is still good
            want_ns = ns if ns is not None else (records[0].namespace if records else None)
            # (The first may be a piece: its caller then holds its ancestors.)
            if (i and record.parent != chain_keys[i - 1]) or \
                    (want_ns is not None and record.namespace != want_ns):
                self.count("remote_verify_failures")
                break
            records.append(record)
        # The parts, at most FETCH_BATCH_BYTES per round trip (a piece's parts may span
        # two): a server builds a whole reply before sending it, so one huge MGET would
        # keep the first byte past the op deadline.
        plan = [(record, j) for record in records for j in range(record.parts)]
        names: list[bytes] = []
        values: list[bytes | None] = []
        i = 0
        while i < len(plan):
            if job.abandoned:
                return
            if time.monotonic() > deadline:
                self.count("remote_fetch_budget_exceeded")
                return
            end, size = i, 0
            while end < len(plan) and (end == i or size <= FETCH_BATCH_BYTES):
                record = plan[end][0]
                size += -(-record.size // record.parts)
                end += 1
            batch = plan[i:end]
            batch_names = [self.names.part(r.key, j) for r, j in batch]
            got = core.call(functools.partial(core.mget, names=batch_names))
            for (record, j), name, value in zip(batch, batch_names, got, strict=True):
                names.append(name)
                values.append(value)
                if j < record.parts - 1:
                    continue
                data = self._assemble(record, names, values)
                names, values = [], []
                if data is None or job.abandoned:
                    return
                out.append(data)
                self.count("remote_fetch_pieces")
                self.count("remote_bytes_fetched", len(data))
            i = end

    def _assemble(self, record: RemoteRecord, names: list[bytes],
                  values: list[bytes | None]) -> bytes | None:
        """A piece's blob from its parts, checked; None (counted) if it is not sound."""
        present = [v for v in values if v is not None]
        if len(present) < len(values):
            return None  # evicted: fetch_short says so
        try:
            data = b"".join(self._core.open(n, v)
                            for n, v in zip(names, present, strict=True))
        except ValueInvalid:
            return None
        try:
            if len(data) != record.size:
                raise blobfmt.BlobError(f"{len(data)} bytes, the record says {record.size}")
            meta = blobfmt.decode_blob(data, verify=True).meta
            if meta.namespace != record.namespace or keys.entry_key(
                    meta.namespace, meta.tokens, self.block_size).key != record.key:
                raise blobfmt.BlobError("its tokens and namespace do not recompute to its key")
            if (meta.parent, meta.base) != (record.parent, record.base):
                raise blobfmt.BlobError("its parent and base differ from its record's")
        except blobfmt.BlobError as exc:
            self.count("remote_verify_failures")
            log.warning("remote blob %s refused: %s", record.key.hex(), exc)
            return None
        return data

    # -- operators --------------------------------------------------------------------------

    def list_entries(self, predicate: Callable[[RemoteRecord], bool] | None = None,
                     limit: int = 1000) -> list[RemoteRecord]:
        """The entries the remote holds that ``predicate`` accepts (all when None), newest
        first, at most ``limit``: SCAN over the record keys (every primary of a cluster),
        records checked like a lookup's. Reads at most MAX_SCAN record names. [] on any
        failure."""
        try:
            return self._list(predicate, limit)
        except Failed:
            return []
        except Exception:  # see find()
            log.exception("remote listing failed")
            return []

    def _list(self, predicate: Callable[[RemoteRecord], bool] | None,
              limit: int) -> list[RemoteRecord]:
        core = self._core

        def scan(client: Client) -> list[bytes]:
            found: list[bytes] = []
            for name in client.scan_iter(match=self.names.record_pattern, count=1000):
                found.append(name)
                if len(found) >= MAX_SCAN:
                    break
            return found

        names = core.call(scan)
        entries: list[RemoteRecord] = []
        for start in range(0, len(names), 500):
            batch = names[start : start + 500]
            values = core.call(functools.partial(core.mget, names=batch))
            for name, value in zip(batch, values, strict=True):
                record = core.record_named(name, value)
                if record is not None and (predicate is None or predicate(record)):
                    entries.append(record)
        entries.sort(key=lambda r: r.created, reverse=True)
        return entries[:limit]

    # -- counting ---------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """Count an outcome under one of counters.REMOTE_SECTION's names."""
        self._core.count(name, n)


def servable_tokens(match: RemoteMatch, whole_prefix: bool) -> int:
    """Tokens of the prompt a match serves: all it shares, or without cutting (a state
    that cannot be cut) the longest link of its chain within them."""
    if not whole_prefix:
        return match.shared
    return max((link.n_tokens for link in match.chain if link.n_tokens <= match.shared),
               default=0)
