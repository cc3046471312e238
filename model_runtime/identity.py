"""The cache identity of a loaded model: derived from the model file and the context,
never left to the caller (a wrong identity would restore a state into the wrong model)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from kvcache import keys
from kvcache.client import Identity
from kvcache.common import create_private_file, make_private_dirs
from kvcache.config import default_dir

FINGERPRINTS_FILE = "fingerprints.json"
_lock = threading.Lock()


def hash_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def model_fingerprint(path: str | os.PathLike[str], cache_file: Path | None = None) -> str:
    """xxh3-128 of the file's bytes, remembered by (path, size, mtime) so that a restart
    does not re-read a multi-gigabyte model. The memo lives in the kvcache directory
    (KVCACHE_DIR when set), looked up at each call."""
    cache_file = cache_file or default_dir() / FINGERPRINTS_FILE
    p = Path(path).resolve()
    st = p.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    with _lock:
        try:
            known = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            known = {}
        entry = known.get(str(p))
        if isinstance(entry, dict) and entry.get("stamp") == stamp:
            return str(entry["fingerprint"])
        fingerprint = hash_file(p)
        known[str(p)] = {"stamp": stamp, "fingerprint": fingerprint}
        try:
            # Owner-only, as kvcache's folders are: it may become the sockets' folder.
            make_private_dirs(cache_file.parent)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            with os.fdopen(create_private_file(tmp), "w") as f:
                f.write(json.dumps(known))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # remembering is an optimisation only
        return fingerprint


def runtime_identity(model_path: str | os.PathLike[str], kv_layout: dict[str, str],
                     tenant: str = "") -> Identity:
    return Identity(model_fingerprint=model_fingerprint(model_path), kv_layout=kv_layout,
                    tenant=tenant, model_name=Path(model_path).name)


class Identities:
    """The identity of each tenant one runtime serves: the model's identity with the
    tenant, and its namespace, kept per tenant (a request may name any tenant). Any
    thread.

    A tenant's namespace is the daemon's to derive (salted with its secret): ``resolve``
    asks it (CacheClient.namespace_of), once per tenant. Without a daemon, or while it
    cannot answer, a local stand-in is used and not kept: it equals no namespace the
    daemon gives, so nothing restored can match it (a blob of another namespace is
    refused) and nothing is saved under it (saves need the daemon)."""

    def __init__(self, base: Identity,
                 resolve: Callable[[Identity], bytes] | None = None) -> None:
        self.base = base
        self._resolve = resolve
        self._lock = threading.Lock()
        self._known: dict[str, tuple[Identity, bytes]] = {}
        self._failed_at: dict[str, float] = {}

    def of(self, tenant: str) -> Identity:
        return self._entry(tenant)[0]

    def namespace(self, tenant: str) -> bytes:
        return self._entry(tenant)[1]

    def _entry(self, tenant: str) -> tuple[Identity, bytes]:
        with self._lock:
            known = self._known.get(tenant)
        if known is not None:
            return known
        identity = dataclasses.replace(self.base, tenant=tenant)
        if not tenant:
            entry = (identity, identity.namespace)
        else:
            unresolved = (identity, keys.namespace(identity.model_fingerprint,
                                                   identity.kv_layout,
                                                   "\x00unresolved\x00" + tenant))
            with self._lock:  # a daemon that just failed is not asked again at once:
                failed = self._failed_at.get(tenant)  # callers include the model thread
            if self._resolve is None or (failed is not None and
                                         time.monotonic() - failed < RETRY_RESOLVE_S):
                return unresolved
            try:
                entry = (identity, self._resolve(identity))
            except Exception:  # the daemon is down or refuses: ask again later
                with self._lock:
                    self._failed_at[tenant] = time.monotonic()
                return unresolved
        with self._lock:
            if len(self._known) >= MAX_TENANTS_KEPT:
                self._known.clear()  # rare: a runtime serving that many tenants asks again
            self._known[tenant] = entry
        return entry


MAX_TENANTS_KEPT = 4096
RETRY_RESOLVE_S = 2.0
