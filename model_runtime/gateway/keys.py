"""Who may call the gateway, and what tenant each caller is.

The rules of the cache daemon's TCP listener (``kvcache/auth.py``), and TLS as well: on
loopback no credential is needed (a key file, if given, is still enforced); beyond loopback
the gateway refuses to start unless callers must authenticate (an API key, or a client
certificate with ``--tls-client-ca``) and the traffic is encrypted (TLS), or
``--insecure-tcp`` says that anyone who can connect may use it.

The key file holds one key per line, optionally followed by the tenant its requests run
as and ``role=admin`` (``KEY [TENANT] [role=admin]``; ``#`` starts a comment). It must be
owner-only, like the daemon's token file. The tenant salts the cache keys of the key's
requests (the workers serve every tenant; each request carries its tenant), so it comes
from this file, never from the request.

Operator views (``/status``, and ``/metrics`` unfiltered) need an operator: a key marked
``role=admin``, or, on a gateway without a key file, a caller on loopback. A tenant's key
reads ``/metrics`` of its own tenant only and is refused ``/status``
(``app.require_operator``; tests/gateway/test_gateway_limits.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from kvcache.auth import MIN_TOKEN_CHARS

TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class KeyConfigError(ValueError):
    """An unusable key file, TLS file, or listener without the protection it needs."""


ADMIN_ROLE = "role=admin"


@dataclass(frozen=True)
class Caller:
    """Who made a request: its tenant, and whether it may read the operator views."""

    tenant: str
    admin: bool = False


@dataclass(frozen=True)
class ApiKeys:
    entries: tuple[tuple[bytes, Caller], ...]

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        p = path.expanduser()
        try:
            mode = p.stat().st_mode
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyConfigError(f"cannot read API key file {p}: {exc}") from None
        if stat.S_IMODE(mode) & 0o077:
            raise KeyConfigError(f"API key file {p} is accessible to other users "
                                 f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
        entries: list[tuple[bytes, Caller]] = []
        for number, raw in enumerate(text.splitlines(), 1):
            words = raw.split("#", 1)[0].split()
            if not words:
                continue
            admin = words[-1] == ADMIN_ROLE and len(words) > 1
            if admin:
                words.pop()
            if len(words) > 2 or any("=" in w for w in words):
                raise KeyConfigError(f"{p}:{number}: expected KEY [TENANT] [{ADMIN_ROLE}]")
            key, tenant = words[0], words[1] if len(words) == 2 else ""
            if len(key) < MIN_TOKEN_CHARS:
                raise KeyConfigError(f"{p}:{number}: a key must be at least "
                                     f"{MIN_TOKEN_CHARS} characters (e.g. the output of: "
                                     "openssl rand -hex 32)")
            if not set(tenant) <= TENANT_CHARS:
                raise KeyConfigError(f"{p}:{number}: a tenant is letters, digits and . _ -")
            if any(hmac.compare_digest(key.encode(), k) for k, _ in entries):
                raise KeyConfigError(f"{p}:{number}: this key is already listed")
            entries.append((key.encode(), Caller(tenant, admin)))
        if not entries:
            raise KeyConfigError(f"API key file {p} holds no key")
        return cls(tuple(entries))

    @property
    def tenants(self) -> list[str]:
        return sorted({caller.tenant for _, caller in self.entries})

    def caller_of(self, authorization: str | None) -> Caller | None:
        """The caller of the key in an ``Authorization: Bearer KEY`` header; None when the
        key is missing or unknown. Every key is compared, in constant time, whatever
        matched: neither the answer time nor an early exit tells how much of a guess fits
        or which key came close. A header's bytes that are not UTF-8 (the HTTP server
        hands them over as surrogate escapes) match no key: keys are UTF-8 text."""
        given = b""
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                given = value.strip().encode("utf-8", "surrogatepass")
        found: Caller | None = None
        for key, caller in self.entries:
            if hmac.compare_digest(given, key) and found is None:
                found = caller
        return found

    def tenant_of(self, authorization: str | None) -> str | None:
        caller = self.caller_of(authorization)
        return caller.tenant if caller is not None else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_listener(host: str, keys: ApiKeys | None, tls: ssl.SSLContext | None,
                   insecure_tcp: bool) -> None:
    """Refuse a listener beyond loopback unless callers must authenticate (API keys or
    client certificates) and the traffic is encrypted (TLS), or ``insecure_tcp``."""
    if is_loopback(host) or insecure_tcp:
        return
    client_certs = tls is not None and tls.verify_mode == ssl.CERT_REQUIRED
    missing = ([] if keys or client_certs else
               ["API keys (--api-keys FILE) or client certificates (--tls-client-ca)"]) + \
              ([] if tls else ["TLS (--tls-cert and --tls-key)"])
    if missing:
        raise KeyConfigError(
            f"refusing to listen on {host} beyond loopback without {' and '.join(missing)}; "
            "or pass --insecure-tcp to accept that anyone who can connect may use the "
            "gateway and read its traffic")


def tls_context(cert: Path | None, key: Path | None,
                client_ca: Path | None = None) -> ssl.SSLContext | None:
    """The HTTPS context; with ``client_ca``, mutual TLS: a caller must present a
    certificate that CA signed (checked in the handshake, before any request)."""
    if not cert and not key:
        if client_ca:
            raise KeyConfigError("--tls-client-ca needs --tls-cert and --tls-key: client "
                                 "certificates are checked during the TLS handshake")
        return None
    if not (cert and key):
        raise KeyConfigError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
        if client_ca:
            context.load_verify_locations(cafile=str(client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise KeyConfigError(f"cannot load the TLS files ({cert}, {key}"
                             f"{', ' + str(client_ca) if client_ca else ''}): {exc}") from None
    return context
