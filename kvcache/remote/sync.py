"""The shared tier wired to the local store: what a commit uploads, what a lookup fetches.

After a local commit the entry's chain is handed to the uploader (a background queue;
see tier.RemoteTier.publish). A lookup that finds a longer prefix remotely than locally
fetches the pieces it lacks, stores them through the store's own reserve -> write ->
commit (so they are checked again, counted in the byte budgets and evicted like any
other entry, and the next hit is local) and then answers from the local store. Nothing
here raises on a remote fault: the local answer stands.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from .. import blob as blobfmt
from .. import keys
from ..errors import StoreError
from ..record import Record
from ..store import Found, Store
from .layout import ChainLink
from .tier import RemoteTier, servable_tokens

log = logging.getLogger("kvcache.remote")


class RemoteSync:
    """Thread-safe: the store and the tier are; this class keeps no state of its own."""

    def __init__(self, store: Store, tier: RemoteTier) -> None:
        self.store = store
        self.tier = tier

    def published(self, record: Record) -> None:
        """Queue the upload of a committed entry (and of any ancestor the remote lacks)."""
        try:
            chain = self.store.chain(record)
            self.tier.publish([ChainLink.of(r) for r in chain], self._read_blob)
        except StoreError:  # removed since the commit: nothing to share
            pass
        except ValueError:  # the commit stands, whatever the upload makes of the chain
            log.exception("entry %s not queued for the shared tier", record.key.hex())

    def _read_blob(self, key: bytes) -> bytes:
        # Evicted meanwhile: FileNotFoundError, counted by the uploader as unreadable.
        return self.store.blob_path(key).read_bytes()

    def lookup(self, ns: bytes, raw_tokens: bytes, max_tokens: int = 0, *,
               common_prefix: bool = False, count: bool = True) -> Found:
        """The store's lookup (Store.find), extended by the remote when it holds more of
        the prompt: then the pieces the local store lacks are fetched and stored, and the
        answer is the local store's again, marked ``from_remote``. The lookup counters
        count the final answer."""
        local = self.store.find(ns, raw_tokens, max_tokens, common_prefix=common_prefix,
                                count=False)
        answer = self._extended(ns, raw_tokens, max_tokens, common_prefix, local)
        if count:
            self.store.count_lookup(answer.record, answer.shared, raw_tokens, max_tokens)
        return answer

    def _extended(self, ns: bytes, raw_tokens: bytes, max_tokens: int, common_prefix: bool,
                  local: Found) -> Found:
        n = len(raw_tokens) // 4
        if local.shared >= (min(n, max_tokens) if max_tokens else n):
            return local  # the remote cannot hold more of the prompt
        match = self.tier.find(ns, raw_tokens, max_tokens, whole_prefix=not common_prefix)
        if match is None:
            return local
        # Without common_prefix only an entry that is a whole prefix of the prompt serves:
        # the match, or a link of its chain (the prompt may diverge after a stored root).
        usable = servable_tokens(match, not common_prefix)
        if usable <= local.shared:
            return local
        links = [link for link in match.chain if link.base < usable]
        held = 0
        while held < len(links) and self.store.index.get(links[held].key) is not None:
            held += 1
        if held < len(links) and not self._store_locally(
                self.tier.fetch([link.key for link in links[held:]], ns) or []):
            return local
        again = self.store.find(ns, raw_tokens, max_tokens, common_prefix=common_prefix,
                                count=False)
        if again.record is None or again.shared <= local.shared:
            return local
        return replace(again, from_remote=True)

    def _count(self, name: str) -> None:
        self.tier.count(name)

    def _store_locally(self, blobs: list[bytes]) -> int:
        """Commit fetched blobs (root first) into the local store; stops at the first
        that cannot be stored (its children would lack their parent). Returns how many
        are now held locally."""
        held = 0
        for data in blobs:
            lease = ""
            try:
                meta = blobfmt.decode_blob(data, verify=False).meta
                result = self.store.reserve(
                    meta.namespace, keys.tokens_to_bytes(meta.tokens), len(data), meta.reason,
                    meta.model_fingerprint, tenant_id=meta.tenant_id, parent=meta.parent,
                    base=meta.base)
                if result.status == "in_flight":
                    break  # another fetch is storing it: its children wait for that one
                if result.status == "granted":
                    lease = result.lease_id
                    self.store.write(lease, 0, data)
                    self.store.commit(lease)
                    self._count("remote_fetched_stored")
            except Exception as exc:  # a refusal (full, parent gone) or a fault: never
                if lease:               # the request's failure, the local answer stands
                    with contextlib.suppress(StoreError):
                        self.store.abort(lease)
                log.info("fetched piece not stored locally: %s", exc,
                         exc_info=not isinstance(exc, (StoreError, blobfmt.BlobError)))
                self._count("remote_fetched_not_stored")
                break
            held += 1
        return held
