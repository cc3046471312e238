"""The cache identity of a loaded model: derived from the model file and the context,
never left to the caller (a wrong identity would restore a state into the wrong model)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from pathlib import Path

import xxhash

from kvcache.client import Identity
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
            cache_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # remembering is an optimisation only
        return fingerprint


def runtime_identity(model_path: str | os.PathLike[str], kv_layout: dict[str, str],
                     tenant: str = "") -> Identity:
    return Identity(model_fingerprint=model_fingerprint(model_path), kv_layout=kv_layout,
                    tenant=tenant, model_name=Path(model_path).name)


class Identities:
    """The identity of each tenant one runtime serves: the model's identity salted with
    the tenant, and its namespace (hashed once per tenant, not per key). Any thread;
    the most recently used tenants are kept (a request may name any tenant)."""

    def __init__(self, base: Identity, max_tenants: int = 1024) -> None:
        self.base = base
        self._of = functools.lru_cache(maxsize=max_tenants)(self._identity)

    def _identity(self, tenant: str) -> tuple[Identity, bytes]:
        identity = dataclasses.replace(self.base, tenant=tenant)
        return identity, identity.namespace

    def of(self, tenant: str) -> Identity:
        return self._of(tenant)[0]

    def namespace(self, tenant: str) -> bytes:
        return self._of(tenant)[1]
