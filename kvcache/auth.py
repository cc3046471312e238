"""Who may talk to the daemon over TCP: a shared bearer token, mutual TLS, or both.

The unix socket needs none of this: it is created with mode 0600 inside an owner-only
directory, so the kernel already limits it to the daemon's user. A TCP port has no such
gate, and a cached state holds the prompt it was computed from, so the daemon refuses to
listen on TCP unless it can authenticate callers (or is told explicitly to accept anyone).

Clients read their credentials from files named by options or environment variables
(``KVCACHE_TOKEN_FILE``, ``KVCACHE_TLS_CA``, ``KVCACHE_TLS_CERT``, ``KVCACHE_TLS_KEY``),
never from a token on the command line, where other users could read it in ``ps``.
"""

from __future__ import annotations

import collections
import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .secrets import SecretFileError, read_secret_file

ENV_TOKEN_FILE = "KVCACHE_TOKEN_FILE"
ENV_TLS_CA = "KVCACHE_TLS_CA"
ENV_TLS_CERT = "KVCACHE_TLS_CERT"
ENV_TLS_KEY = "KVCACHE_TLS_KEY"
ENV_TLS_SERVER_NAME = "KVCACHE_TLS_SERVER_NAME"

TOKEN_METADATA = "authorization"
MIN_TOKEN_CHARS = 16
# Load balancers and orchestrators probe health without credentials; it reveals nothing.
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check",
                                     "/grpc.health.v1.Health/Watch"})


class AuthConfigError(ValueError):
    """Credentials that cannot be used: missing, unreadable, too weak or exposed."""


def read_token(path: str | Path) -> str:
    """The token in ``path`` (a client's token file: one token), which must be readable by
    its owner only."""
    p = Path(path).expanduser()
    token = _secret_text(p).strip()
    _check_token(token, p)
    return token


def _secret_text(p: Path) -> str:
    try:
        return read_secret_file(p, "token file").decode("utf-8")
    except SecretFileError as exc:
        raise AuthConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise AuthConfigError(f"token file {p} is not UTF-8 text") from None


def _check_token(token: str, p: Path) -> None:
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise AuthConfigError(f"token in {p} must be at least {MIN_TOKEN_CHARS} characters "
                              "with no spaces (e.g. the output of: openssl rand -hex 32)")


@dataclass(frozen=True)
class Scope:
    """What a token may do on the daemon. ``tenants`` None: an admin token (every tenant,
    and operator calls where the listener allows them); else a runtime token, bound to
    these tenants: any other tenant's entries are, to it, entries that do not exist."""

    tenants: frozenset[str] | None = None

    @property
    def admin(self) -> bool:
        return self.tenants is None

    def may_use(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


ADMIN = Scope()
TENANTS_PREFIX = "tenants="


def parse_token_lines(text: str, p: Path) -> dict[str, Scope]:
    """The tokens of a daemon's token file and their scopes. One token a line, then its
    scope: nothing or ``admin`` (an admin token; a file of one bare token, the original
    format, is one), or ``tenants=NAME[,NAME...]`` (a runtime token). Blank lines and
    lines starting with ``#`` are skipped. Pure: tests/daemon/test_scoped_tokens.py."""
    tokens: dict[str, Scope] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        token, rest = fields[0], fields[1:]
        _check_token(token, p)
        if token in tokens:
            raise AuthConfigError(f"token file {p}, line {number}: a token given twice")
        if not rest or rest == ["admin"]:
            tokens[token] = ADMIN
        elif len(rest) == 1 and rest[0].startswith(TENANTS_PREFIX):
            names = rest[0][len(TENANTS_PREFIX):].split(",")
            if not all(names):
                raise AuthConfigError(f"token file {p}, line {number}: an empty tenant "
                                      "name in tenants=")
            tokens[token] = Scope(frozenset(names))
        else:
            raise AuthConfigError(f"token file {p}, line {number}: the scope after a "
                                  "token is 'admin' or 'tenants=NAME[,NAME...]', got "
                                  f"{' '.join(rest)!r}")
    if not tokens:
        _check_token("", p)
    return tokens


def read_token_table(path: str | Path) -> dict[str, Scope]:
    """A daemon's token file: every token it admits, with its scope."""
    p = Path(path).expanduser()
    return parse_token_lines(_secret_text(p), p)


def presented_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The bearer token a call carries ("" when none)."""
    given = dict(metadata or ()).get(TOKEN_METADATA, "")
    text = given if isinstance(given, str) else bytes(given).decode(errors="replace")
    return text[len("Bearer "):] if text.startswith("Bearer ") else ""


def _read_pem(path: str | Path | None, what: str) -> bytes | None:
    if not path:
        return None
    p = Path(path).expanduser()
    try:
        return p.read_bytes()
    except OSError as exc:
        raise AuthConfigError(f"cannot read {what} {p}: {exc.strerror}") from None


def bearer(token: str) -> str:
    return f"Bearer {token}"


# -- server side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerAuth:
    """How the TCP listener authenticates callers."""

    tokens: Mapping[str, Scope] = field(default_factory=dict)  # empty: no token needed
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    client_ca: bytes | None = None  # set: clients must present a certificate it signed

    @classmethod
    def load(cls, token_file: str | Path | None = None, tls_cert: str | Path | None = None,
             tls_key: str | Path | None = None,
             client_ca: str | Path | None = None) -> ServerAuth:
        if bool(tls_cert) != bool(tls_key):
            raise AuthConfigError("--tls-cert and --tls-key go together")
        if client_ca and not tls_cert:
            raise AuthConfigError("--tls-client-ca needs --tls-cert and --tls-key: client "
                                  "certificates are checked during the TLS handshake")
        return cls(tokens=read_token_table(token_file) if token_file else {},
                   tls_cert=_read_pem(tls_cert, "TLS certificate"),
                   tls_key=_read_pem(tls_key, "TLS key"),
                   client_ca=_read_pem(client_ca, "client CA certificate"))

    @property
    def authenticates(self) -> bool:
        """Whether a caller must prove who it is (a token or a client certificate)."""
        return bool(self.tokens or self.client_ca)

    @property
    def encrypts(self) -> bool:
        return self.tls_cert is not None

    def describe(self) -> str:
        parts = (["token"] if self.tokens else []) + \
                (["mutual TLS"] if self.client_ca else ["TLS"] if self.tls_cert else [])
        return " + ".join(parts) or "no authentication"

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.tokens)] if self.tokens else []


def refuse_unprotected_tcp(listen: str | None, auth: ServerAuth, insecure_tcp: bool) -> None:
    if listen and not (auth.authenticates or insecure_tcp):
        raise AuthConfigError(
            f"refusing to listen on TCP {listen} without authentication: give a shared "
            "token (--token-file) or client certificates (--tls-client-ca), or pass "
            "--insecure-tcp to accept that anyone who can connect may use this service")


def add_tcp_port(server: grpc.Server, listen: str, auth: ServerAuth) -> str:
    """Bind ``listen`` with ``auth``'s TLS credentials (if any); returns ``host:port``."""
    credentials = auth.credentials()
    try:
        port = (server.add_secure_port(listen, credentials) if credentials
                else server.add_insecure_port(listen))
    except RuntimeError as exc:
        raise AuthConfigError(f"cannot listen on {listen}: {exc}") from None
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def tcp_security(auth: ServerAuth) -> tuple[bool, str]:
    """``(safe, description)`` of a TCP listener protected by ``auth``, for the log."""
    if not auth.authenticates:
        return False, "INSECURE: anyone who can connect may use it"
    if not auth.encrypts:
        return False, (f"{auth.describe()}; without TLS the token and the data cross the "
                       "network in clear text (add --tls-cert/--tls-key)")
    return True, auth.describe()


class TokenInterceptor(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED to any call without the right bearer token."""

    def __init__(self, tokens: Mapping[str, Scope]) -> None:
        self._expected = [bearer(token).encode() for token in tokens]

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method in UNAUTHENTICATED_METHODS:
            return handler
        given = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        # Constant-time, and every token compared: the comparison must not tell an
        # attacker how much of a guess fits, nor which token it came close to.
        if sum(hmac.compare_digest(given_bytes, t) for t in self._expected):
            return handler
        reason = "missing bearer token" if not given else "wrong bearer token"
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"{reason} (this daemon's TCP port needs the shared token; give the "
                        f"client {ENV_TOKEN_FILE} or --token-file)")


class OperatorGate(grpc.ServerInterceptor):
    """Answers PERMISSION_DENIED to operator calls (``methods``) on a listener whose callers
    are clients, not operators: a runtime's credentials must not list, inspect or prune
    every tenant's entries. With ``admins_allowed`` (--tcp-admin) an admin token (or, with
    no token file, any authenticated caller) may make them; a runtime token never may."""

    def __init__(self, methods: frozenset[str], tokens: Mapping[str, Scope] | None = None,
                 admins_allowed: bool = False) -> None:
        self.methods = methods
        self.tokens = tokens or {}
        self.admins_allowed = admins_allowed

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method not in self.methods:
            return handler
        scope = self.tokens.get(presented_token(details.invocation_metadata), ADMIN)
        if self.admins_allowed and scope.admin:
            return handler
        name = details.method.rsplit("/", 1)[-1]
        if not scope.admin:
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            f"{name} is an operator call: a runtime token (bound to tenants) "
                            "may not make it")
        return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                        f"{name} is an operator call: use the unix socket, or start the daemon "
                        "with --tcp-admin if every TCP client is an operator")


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
             message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call."""

    def refuse(request: object, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


# -- client side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientAuth:
    """Credentials a client presents: a token, a CA to trust, a client certificate."""

    token: str | None = None
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    server_name: str | None = None  # when the certificate names another host

    @classmethod
    def load(cls, token_file: str | Path | None = None, tls_ca: str | Path | None = None,
             tls_cert: str | Path | None = None, tls_key: str | Path | None = None,
             server_name: str | None = None) -> ClientAuth:
        if bool(tls_cert) != bool(tls_key):
            raise AuthConfigError("a client certificate needs its key (--tls-cert and "
                                  "--tls-key go together)")
        return cls(token=read_token(token_file) if token_file else None,
                   tls_ca=_read_pem(tls_ca, "TLS CA certificate"),
                   tls_cert=_read_pem(tls_cert, "TLS client certificate"),
                   tls_key=_read_pem(tls_key, "TLS client key"),
                   server_name=server_name or None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientAuth:
        e = os.environ if env is None else env
        return cls.load(e.get(ENV_TOKEN_FILE), e.get(ENV_TLS_CA), e.get(ENV_TLS_CERT),
                        e.get(ENV_TLS_KEY), e.get(ENV_TLS_SERVER_NAME))

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A channel to ``address`` presenting these credentials on every call.

        TLS applies to TCP addresses only: a unix socket is already private to its owner.
        """
        opts = list(options)
        if self.uses_tls and not address.startswith("unix"):
            if self.server_name:
                opts.append(("grpc.ssl_target_name_override", self.server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=self.tls_ca,
                                                 private_key=self.tls_key,
                                                 certificate_chain=self.tls_cert)
            channel = grpc.secure_channel(address, creds, options=opts)
        else:
            channel = grpc.insecure_channel(address, options=opts)
        if self.token:
            # Per-call metadata rather than call credentials: gRPC only attaches those to
            # secure channels, and a token-only deployment may run without TLS.
            channel = grpc.intercept_channel(channel, _MetadataAdder(
                ((TOKEN_METADATA, bearer(self.token)),)))
        return channel


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _MetadataAdder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata,
                            d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
