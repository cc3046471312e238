"""The remote tier's settings, and reading its secrets from files or the environment.

URLs (no secrets in them: a password in the URL would sit in the command line, visible
to every user of the host in ``ps``)::

    redis://HOST:PORT/DB                 one server (Redis or Valkey), database DB
    rediss://HOST:PORT/DB                the same over TLS
    redis+cluster://HOST:PORT[,HOST:PORT...]   a Redis Cluster: the listed nodes are
    rediss+cluster://...                 where the client learns the slot map (TLS)
    redis://USER@HOST:PORT/DB            an ACL user (a name, not a secret)

The password comes from ``password_file`` (its content, surrounding whitespace removed)
or from the environment variable named by ``password_env``, never from the URL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from ..secrets import SecretFileError, read_secret_file

SCHEMES = {"redis": (False, False), "rediss": (True, False),
           "redis+cluster": (False, True), "rediss+cluster": (True, True)}
MIN_SIGNING_KEY_BYTES = 16
MiB = 1 << 20


class RemoteConfigError(ValueError):
    """A remote setting is unusable (bad URL, a secret in the URL, an unsafe key file)."""


@dataclass(frozen=True)
class Endpoint:
    """What a URL says, parsed: the nodes, the database, TLS, cluster mode, ACL user."""

    nodes: tuple[tuple[str, int], ...]
    db: int
    tls: bool
    cluster: bool
    username: str | None


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # holds no secret (parse_url refuses a password in it): shown as is
    # The password: from this file, or from the environment variable of this name.
    password_file: Path | None = None
    password_env: str | None = None
    # ACL user when the URL names none.
    username: str | None = None
    # HMAC-SHA256 key: sign every value written, refuse unsigned or mis-signed ones read.
    signing_key: bytes | None = field(default=None, repr=False)
    # Encrypt every value (AES-256-GCM, key derived from signing_key), refuse plain ones.
    encrypt: bool = False
    # CA bundle for rediss:// (default: the system's).
    tls_ca_file: Path | None = None
    # Deadline of each remote call, connect included: well inside a runtime's 2 s cache
    # deadline, so a slow or gone remote costs a lookup at most this.
    op_timeout_s: float = 0.25
    # Total time one fetch of a chain's pieces may take; past it the verified prefix
    # fetched so far is returned.
    fetch_budget_s: float = 1.0
    # Uploads waiting at most; more are dropped (counted), never blocking a commit.
    queue_max: int = 64
    # Values are split into parts no larger than this (servers cap one value:
    # proto-max-bulk-len, 512 MiB by default; smaller parts also keep one slow reply short).
    chunk_bytes: int = 8 * MiB
    # Every key starts with it (several fleets may share one server under different ones).
    key_prefix: str = "kvc"
    # Reconnection back-off: from the first to the last delay, doubling.
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 5.0
    # How long another host's upload of the same entry may hold it before it is retaken.
    upload_lock_s: float = 60.0

    def __post_init__(self) -> None:
        endpoint = self.endpoint()  # raises on a bad URL
        if self.tls_ca_file is not None and not endpoint.tls:
            raise RemoteConfigError(f"a TLS CA file was given for {self.url}, which is not "
                                    "TLS: use rediss:// (or rediss+cluster://)")
        if self.password_file is not None and self.password_env is not None:
            raise RemoteConfigError("give the remote password from a file or from an "
                                    "environment variable, not both")
        if self.op_timeout_s <= 0 or self.fetch_budget_s <= 0:
            raise RemoteConfigError("remote op timeout and fetch budget must be positive")
        if self.queue_max < 1:
            raise RemoteConfigError("the remote upload queue must hold at least one item")
        if self.chunk_bytes < 4096:
            raise RemoteConfigError(f"remote chunk size {self.chunk_bytes} is below 4096 bytes")
        if not self.key_prefix or any(c in self.key_prefix for c in "{}*?[]\\ \n"):
            raise RemoteConfigError(f"remote key prefix {self.key_prefix!r} must be non-empty "
                                    "and free of braces, glob characters and spaces")
        if self.encrypt and self.signing_key is None:
            raise RemoteConfigError("encrypting the remote's values needs the signing key "
                                    "(the encryption key is derived from it)")
        if self.signing_key is not None and len(self.signing_key) < MIN_SIGNING_KEY_BYTES:
            raise RemoteConfigError(f"the remote signing key has {len(self.signing_key)} "
                                    f"bytes; at least {MIN_SIGNING_KEY_BYTES} are needed")

    def endpoint(self) -> Endpoint:
        return parse_url(self.url)

    def password(self) -> str | None:
        """Read the password now (a rotated file or variable is picked up on reconnect)."""
        if self.password_file is not None:
            try:
                text = read_secret_file(self.password_file, "remote password file").decode()
            except (SecretFileError, UnicodeDecodeError) as exc:
                raise RemoteConfigError(str(exc)) from None
            if not text.strip():
                raise RemoteConfigError(f"the remote password file {self.password_file} "
                                        "is empty")
            return text.strip()
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if not value:
                raise RemoteConfigError(f"the environment variable {self.password_env} "
                                        "(the remote password) is not set or empty")
            return value
        return None


def parse_url(url: str) -> Endpoint:
    """Parse a remote URL; refuse one that embeds a password."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise RemoteConfigError(f"remote URL {url!r}: the scheme must be one of "
                                f"{', '.join(s + '://' for s in SCHEMES)}")
    tls, cluster = SCHEMES[scheme]
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    query = parse_qs(parts.query)
    if ":" in userinfo or "password" in query:
        raise RemoteConfigError("the remote URL embeds a password: give it in a file "
                                "(--remote-password-file) or an environment variable "
                                "(--remote-password-env), never on the command line")
    if set(query) - {"db"}:
        raise RemoteConfigError(f"remote URL {url!r}: unknown options "
                                f"{', '.join(sorted(set(query) - {'db'}))}")
    nodes = []
    for item in hostlist.split(","):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RemoteConfigError(f"remote URL {url!r}: {item!r} is not HOST:PORT")
        nodes.append((host, int(port)))
    if len(nodes) > 1 and not cluster:
        raise RemoteConfigError(f"remote URL {url!r} lists several servers: use "
                                "redis+cluster:// for a cluster")
    db_text = query.get("db", [parts.path.strip("/") or "0"])[0]
    if not db_text.isdigit():
        raise RemoteConfigError(f"remote URL {url!r}: database {db_text!r} is not a number")
    db = int(db_text)
    if cluster and db:
        raise RemoteConfigError("a Redis Cluster has only database 0")
    return Endpoint(nodes=tuple(nodes), db=db, tls=tls, cluster=cluster,
                    username=unquote(userinfo) or None)


def load_signing_key(path: Path | str) -> bytes:
    """The signing key from a file: its bytes, trailing whitespace removed (so a key
    written with ``echo`` or ``base64`` works; every host reads it the same way).
    Refuses a file others may read or write, and an empty or short key."""
    path = Path(path)
    try:
        data = read_secret_file(path, "remote signing key file")
    except SecretFileError as exc:
        raise RemoteConfigError(str(exc)) from None
    key = data.rstrip()
    if not key:
        raise RemoteConfigError(f"the remote signing key file {path} is empty")
    if len(key) < MIN_SIGNING_KEY_BYTES:
        raise RemoteConfigError(f"the remote signing key in {path} has {len(key)} bytes; at "
                                f"least {MIN_SIGNING_KEY_BYTES} are needed (e.g. "
                                f"head -c 32 /dev/urandom | base64 > {path})")
    return key
