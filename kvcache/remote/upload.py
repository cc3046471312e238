"""Background uploads: a bounded queue and one thread writing committed entries (and the
ancestors the remote lacks) to the remote, each stored once across the fleet."""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import blob as blobfmt
from .. import keys
from .conn import FULL, Client, Pipeline
from .core import DISCONNECTED, Core, Failed
from .layout import ChainLink, RemoteRecord, ValueInvalid, check_chain, seal

log = logging.getLogger("kvcache.remote")
MiB = 1 << 20
# At most this many bytes of values per pipeline.
UPLOAD_BATCH_BYTES = 64 * MiB

BlobBytes = bytes | bytearray | memoryview | Sequence[bytes | memoryview]


@dataclass(frozen=True)
class _Upload:
    chain: tuple[ChainLink, ...]
    read_blob: Callable[[bytes], BlobBytes]


class Uploader:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.queue: queue.Queue[_Upload | None] = queue.Queue(core.config.queue_max)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def _count(self, name: str, n: int = 1) -> None:
        self.core.count(name, n)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvcache-remote-up",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._closed.set()
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)  # wakes the thread now rather than at its next poll

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def publish(self, chain: Sequence[ChainLink], read_blob: Callable[[bytes], BlobBytes]
                ) -> bool:
        links = tuple(chain)
        try:
            check_chain(links)
        except ValueInvalid as exc:
            raise ValueError(f"not a chain: {exc}") from None
        if self._closed.is_set() or self._thread is None:
            return False
        if not self.core.conn.connected:
            self._count("remote_dropped_disconnected")
            return False
        try:
            self.queue.put_nowait(_Upload(links, read_blob))
        except queue.Full:
            self._count("remote_dropped_queue_full")
            return False
        return True

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.queue.all_tasks_done.wait(left)
        return True

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                if item is not None and not self._closed.is_set():
                    self._upload(item)
            except Exception:  # a bug must not end the uploads
                log.exception("remote upload failed")
            finally:
                self.queue.task_done()
        while True:  # closed: what is still queued is dropped (drain() waiters wake)
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return
            self.queue.task_done()

    def _failed(self, kind: str) -> None:
        if kind == DISCONNECTED:
            self._count("remote_dropped_disconnected")
            return
        self._count("remote_put_errors")
        if kind == FULL:
            self._count("remote_full")

    def _upload(self, item: _Upload) -> None:
        core, chain = self.core, item.chain
        try:
            values = core.call(lambda c: core.mget(c, [core.names.record(x.key) for x in chain]))
        except Failed as failed:
            self._failed(failed.kind)
            return
        for i, link in enumerate(chain):
            last = i == len(chain) - 1
            if core.record(link.key, values[i]) is not None:
                if last:
                    self._count("remote_put_skipped_present")
                continue
            if not self._upload_link(chain[: i + 1], item.read_blob, last):
                return  # the pieces built on it could not be served: not uploaded either

    def _upload_link(self, chain: tuple[ChainLink, ...],
                     read_blob: Callable[[bytes], BlobBytes], last: bool) -> bool:
        """Upload ``chain[-1]``: claim it, write its parts, then its record, then its block
        pointers. True when the remote has it or another host is writing it."""
        core, link = self.core, chain[-1]
        parent = chain[-2].key if len(chain) > 1 else b""
        try:
            got = read_blob(link.key)
            data = bytes(got) if isinstance(got, (bytes, bytearray, memoryview)) \
                else b"".join(got)
            blob = blobfmt.decode_blob(data, verify=True)
            meta = blob.meta
            raw_tokens = keys.tokens_to_bytes(meta.tokens)
            if keys.entry_key(meta.namespace, raw_tokens, core.block_size).key != link.key \
                    or (meta.parent, meta.base) != (parent, link.base) \
                    or (len(data), len(meta.tokens)) != (link.size, link.n_tokens):
                raise blobfmt.BlobError("the blob does not match its chain link")
        except Exception as exc:  # gone locally, unreadable, corrupt: anything read_blob raises
            self._count("remote_put_unreadable")
            log.warning("remote upload of %s abandoned: %s", link.key.hex(), exc)
            return False
        chunk = core.config.chunk_bytes
        record = RemoteRecord(
            key=link.key, namespace=meta.namespace, tokens=raw_tokens, parent=parent,
            base=link.base, size=len(data), parts=max(1, -(-len(data) // chunk)), chain=chain,
            codec=blob.header.codec, reason=meta.reason, created=meta.created,
            model_name=meta.model_name, model_fingerprint=meta.model_fingerprint,
            tenant_id=meta.tenant_id)
        rec_name, lock_name = core.names.record(link.key), core.names.lock(link.key)
        token = secrets.token_hex(8)
        lock_ms = int(core.config.upload_lock_s * 1000)

        def claim(pipe: Pipeline) -> None:
            pipe.set(lock_name, token, nx=True, px=lock_ms)
            pipe.get(rec_name)

        try:
            acquired, existing = core.call(lambda c: core.pipeline(c, claim))
        except Failed as failed:
            self._failed(failed.kind)
            return False
        if core.record(link.key, existing) is not None:  # stored meanwhile
            if acquired:
                core.best_effort(lambda c: c.delete(lock_name))
            if last:
                self._count("remote_put_skipped_present")
            return True
        if not acquired:
            if last:
                self._count("remote_put_skipped_in_flight")
            return True
        # Parts, then (in the last batch, on the same node: in order) the record.
        view = memoryview(data)
        values = [(core.names.part(link.key, j), view[j * chunk : (j + 1) * chunk])
                  for j in range(record.parts)]
        values.append((rec_name, memoryview(record.pack())))
        sent = 0
        try:
            for batch in _batches(values, UPLOAD_BATCH_BYTES):
                sealed = [(name, seal(name, body, core.signing_key, core.encrypt))
                          for name, body in batch]
                core.call(_setting_all(core, sealed))
                sent += sum(len(v) for _, v in sealed)
            pointers = [(name, seal(name, link.key, core.signing_key, core.encrypt)) for name in (
                core.names.block(h) for h in keys.block_hashes(meta.namespace, raw_tokens,
                                                                 core.block_size))]
            core.call(_setting_all(core, pointers))
            sent += sum(len(v) for _, v in pointers)
        except Failed as failed:
            # Full or gone midway: what was written is removed (DEL works on a full
            # server), so no part lingers without its record.
            names = [name for name, _ in values] + [lock_name]
            core.best_effort(lambda c: c.delete(*names))  # one slot: one command
            self._count("remote_bytes_sent", sent)
            self._failed(failed.kind)
            return False
        core.best_effort(lambda c: c.delete(lock_name))
        self._count("remote_puts")
        self._count("remote_bytes_sent", sent)
        return True


def _setting_all(core: Core, values: list[tuple[bytes, bytes]]
                 ) -> Callable[[Client], list[Any]]:
    """A call that sets every one of ``values`` in one pipeline."""

    def set_all(pipe: Pipeline) -> None:
        for name, value in values:
            pipe.set(name, value)

    return lambda client: core.pipeline(client, set_all)


def _batches(values: list[tuple[bytes, memoryview]],
             max_bytes: int) -> list[list[tuple[bytes, memoryview]]]:
    batches: list[list[tuple[bytes, memoryview]]] = [[]]
    size = 0
    for item in values:
        if batches[-1] and size + len(item[1]) > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += len(item[1])
    return batches
