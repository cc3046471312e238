"""A shared tier on a Redis-protocol server (Redis, Valkey; one server or a cluster).

A fleet of daemons, one per host, shares one remote: after a local commit an entry is
uploaded in the background; a lookup that finds a longer prefix remotely than locally
fetches the pieces, verifies them and stores them locally.

Key layout (``P`` is ``RemoteConfig.key_prefix``, ``kvc`` by default; hex is lower case).
With the fleet's signing key (signed or encrypted tiers), names are keyed, layout 2::

    P:2:{<id>}:rec      the entry's record (msgpack, see layout.RemoteRecord): its key,
                        namespace, tokens (packed u32 LE), parent, base, blob size, part
                        count, its chain [[key, base, n_tokens, size], ...] root first,
                        and the operator fields (codec, reason, created, model, tenant id)
    P:2:{<id>}:p<i>     part i of the entry's blob (at most chunk_bytes each)
    P:2:{<id>}:up       upload claim (SET NX with an expiry): one host uploads an entry
    P:2:b:<id of h_k>   block pointer: the key of an entry whose first k*B tokens are the
                        ones block hash h_k covers (keys.block_hashes; h_0 is the
                        namespace). Last writer wins.

where an id is HMAC-SHA256 of the entry key (or block hash) under a key derived from the
signing key, cut to 16 bytes (layout.Names): a name tells nothing to whoever lacks the
key, also for entries without a tenant, whose keys anyone can compute from a model and a
guessed prompt. An unsigned tier (no key) uses layout 1: ``P:{<key hex>}:...`` and
``P:b:<h_k hex>``. Names of one layout are never read as the other's.

Every key of one entry carries the hash tag ``{<id>}``: on a cluster they live in one
slot, so an entry's record and parts are read or written on one node in one round trip.
Block pointers spread over the slots. A listing (``kvcache ls --tier remote``) learns
which entry a record name holds from the record itself, checked against its name.

Values: ``b"KVR1"``, a flag byte (0 unsigned, 1 signed, 2 encrypted), with a signing key
an HMAC-SHA256 over (the key name, the body), then the body, or the body encrypted
(layout.seal). A daemon with a
signing key refuses unsigned or mis-signed values; one without checks no signature.
Anything refused is counted and treated as absent, never raised.

Lookup (``RemoteTier.find``): the prompt's block hashes name its pointers, read in one
round trip (MGET; on a cluster the client pipelines one MGET per slot to every node at
once); the records of the (up to four) entries named by the deepest pointers are read in
a second; the best shares the most tokens with the prompt, counted token by token
(pointers keep only the last writer, so where entries diverge within a block the answer
may fall short of the best by less than a block). A
record's tokens must recompute to its key and its namespace must be the prompt's, so a
tenant (its own namespace) never sees another's entries.

Fetch (``RemoteTier.fetch``): the chain's records in one round trip, then the parts (one
round trip per 64 MiB), within ``fetch_budget_s``. Each blob must parse with every
checksum (blob.decode_blob), recompute to its key, and have its record's parent and
base. A piece missing or refused mid-chain ends the fetch: the verified prefix is
returned (the caller serves that shorter prefix).

Upload (``RemoteTier.publish``, a bounded queue and one thread): the records of the
chain are checked in one round trip; each link missing (or whose record is refused),
root first, is read from the local store, verified, claimed
(``:up``, which also re-checks its record), then its parts are written, then its record,
then its block pointers. An entry another host holds or is writing is skipped, so two
hosts saving the same prefix store it once. A failure midway (remote full with
``noeviction``) deletes what was written; parts left by a remote lost midway stay until
evicted or overwritten by the next upload of that entry.

Faults never block: every socket operation has ``op_timeout_s`` and no retry; a lookup
runs on an I/O thread and its caller waits ``op_timeout_s`` at most (a fetch
``fetch_budget_s``), whatever the client library does meanwhile. A lost or slow remote
is marked disconnected: lookups and fetches answer a miss at once and uploads are
dropped (counted) while a thread reconnects, backing off from 0.1 s to 5 s. Counter
names: ``counters.REMOTE_SECTION``.

Server settings for a fleet: ``maxmemory`` with an eviction policy (``allkeys-lru``:
parts and records of entries not read lately go first; a chain that lost a piece is
served up to it); persistence only if a warm restart of the remote is wanted.
"""

from .config import RemoteConfig, RemoteConfigError, load_signing_key, parse_url
from .layout import ChainLink, RemoteRecord
from .sync import RemoteSync
from .tier import RemoteMatch, RemoteTier

__all__ = [
    "ChainLink",
    "RemoteConfig",
    "RemoteConfigError",
    "RemoteMatch",
    "RemoteRecord",
    "RemoteSync",
    "RemoteTier",
    "load_signing_key",
    "parse_url",
]
