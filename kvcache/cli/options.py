"""What the commands share: option types, the address and credentials of a daemon
and the connection to it, keys as operators type them, and the TCP listener's options
(``kvcache serve`` and the runtime's)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from .. import keys
from ..auth import (
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TLS_SERVER_NAME,
    ENV_TOKEN_FILE,
    AuthConfigError,
    ClientAuth,
    ServerAuth,
    refuse_unprotected_tcp,
)
from ..client import CacheClient, CacheError, CacheUnavailable
from ..config import default_address, parse_listen
from ..v1 import kvcache_pb2 as pb
from .render import entry_line, human_bytes

F = TypeVar("F", bound=Callable[..., Any])
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50,
          "e": 1 << 60}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Sizes travel as uint64 and the daemon adds them up in bytes: 4 EiB leaves room for that,
# and no disk or RAM tier comes near it.
MAX_SIZE = 1 << 62
U32_MAX = (1 << 32) - 1
# Keys are typed by operators: any unique prefix of at least this many hex digits.
MIN_KEY_PREFIX = 4
KEY_HEX_DIGITS = 2 * keys.KEY_BYTES
_HEX = frozenset("0123456789abcdef")
_CANDIDATES_SHOWN = 10  # an ambiguous prefix lists at most this many of its matches


def parse_bytes(text: str) -> int:
    """``1024``, ``512M``, ``2G``, ``1.5GiB`` -> bytes (at most MAX_SIZE)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = t[: len(t) - len(unit)].strip()
    try:
        # Whole numbers exactly (a float keeps only 53 bits), the rest as floats.
        value: float = int(number) if number.isdigit() else float(number)
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if not math.isfinite(value):  # float() takes "nan" and "inf"; int() then raised
        raise click.BadParameter(f"not a size: {text!r} (e.g. 512M, 2G)")
    if value < 0:
        raise click.BadParameter(f"a size cannot be negative: {text!r}")
    size = int(value * _UNITS[unit]) if isinstance(value, float) else value * _UNITS[unit]
    if size > MAX_SIZE:
        raise click.BadParameter(f"{text!r} is too large: a size is at most "
                                 f"{human_bytes(MAX_SIZE)} ({MAX_SIZE} bytes)")
    return size


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d`` -> seconds."""
    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in _SECONDS else "s"
    try:
        value = float(t.rstrip("smhdw"))
    except ValueError:
        raise click.BadParameter(f"not a duration: {text!r} (e.g. 90s, 15m, 2h, 7d)") from None
    # A NaN or negative age would match every entry (`prune --older-than nan`).
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"a duration is a finite number >= 0: {text!r}")
    return value * _SECONDS[unit]


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value <= MAX_SIZE:
                self.fail(f"must be from 0 to {MAX_SIZE} bytes, got {value}", param, ctx)
            return value
        return parse_bytes(str(value))


class DurationType(click.ParamType):
    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        return value if isinstance(value, float) else parse_duration(str(value))


class PeriodType(DurationType):
    """A timeout: a duration above zero (a NaN lease would never expire)."""

    name = "period"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        seconds = super().convert(value, param, ctx)
        if not 0 < seconds <= 7 * 86400:
            self.fail(f"must be above 0 and at most 7d, got {value!r}", param, ctx)
        return seconds


SIZE = SizeType()
DURATION = DurationType()
PERIOD = PeriodType()
# Counts that go on the wire as uint32: refused here rather than by protobuf (a traceback).
U32 = click.IntRange(0, U32_MAX)


class KeyPrefixType(click.ParamType):
    """A key as operators type it: 32 hex digits, or a unique prefix (lowercased)."""

    name = "key"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        text = str(value).strip().lower()
        if not (MIN_KEY_PREFIX <= len(text) <= KEY_HEX_DIGITS and set(text) <= _HEX):
            self.fail(f"not a key: {str(value)[:80]!r} ({KEY_HEX_DIGITS} hex digits, or a "
                      f"unique prefix of at least {MIN_KEY_PREFIX})", param, ctx)
        return text


KEY = KeyPrefixType()


# Client credentials for a daemon's TCP port; options or the environment, never a token
# on the command line (other users can read it in ps).
AUTH_OPTIONS = (
    ("token_file", ENV_TOKEN_FILE, "File holding the daemon's shared token."),
    ("tls_ca", ENV_TLS_CA, "CA certificate to trust for the daemon's TLS (PEM)."),
    ("tls_cert", ENV_TLS_CERT, "Client certificate for mutual TLS (PEM)."),
    ("tls_key", ENV_TLS_KEY, "The client certificate's private key (PEM)."),
    ("tls_server_name", ENV_TLS_SERVER_NAME, "Host name the daemon's certificate names, "
                                             "when it differs from the address."),
)


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is not None:
        ctx.meta[f"kvcache.{param.name}"] = value
    return value


def address_option(f: F) -> F:
    for name, env, text in reversed(AUTH_OPTIONS):
        f = click.option(f"--{name.replace('_', '-')}", name, envvar=env, default=None,
                         expose_value=False, callback=_remember, help=text)(f)
    return click.option("--address", "-a", default=None, envvar="KVCACHE_ADDRESS",
                        help="Daemon address: unix:/path, a socket path, or host:port "
                             f"(default: {default_address()}).")(f)


def yes_option(f: F) -> F:
    return click.option("--yes", "-y", is_flag=True,
                        help="Do not ask for confirmation (never asked when stdin is not "
                             "a terminal).")(f)


def client_auth() -> ClientAuth:
    meta = click.get_current_context().meta
    try:
        return ClientAuth.load(*(meta.get(f"kvcache.{name}") for name, _, _ in AUTH_OPTIONS))
    except AuthConfigError as exc:
        raise click.ClickException(str(exc)) from None


def connect(address: str | None) -> CacheClient:
    auth = client_auth()
    client = CacheClient(address, timeout=10.0, auth=auth)
    socket_path = Path(client.address.removeprefix("unix:"))
    if client.address.startswith("unix:") and not socket_path.exists():
        client.close()  # nothing to wait for
        raise click.ClickException(f"no kvcache daemon at {client.address} (no such socket; "
                                   "start one with: kvcache serve)")
    try:
        client.wait_ready(timeout=3.0)
    except CacheUnavailable:
        client.close()
        hint = (" or the TLS handshake failed (check --tls-ca, --tls-cert, --tls-key)"
                if auth.uses_tls else " (start one with: kvcache serve)")
        raise click.ClickException(f"no kvcache daemon at {client.address}{hint}") from None
    return client


def run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CacheError as exc:  # its message says the status in words
        raise click.ClickException(str(exc)) from None


# -- keys as operators type them -------------------------------------------------------------


def find_entries(client: CacheClient, prefix: str, tenant: str = "") -> list[pb.Entry]:
    """Entries whose key starts with ``prefix`` (an operator call: List)."""
    return run(lambda: client.list_entries(key_prefix=prefix, tenant=tenant,
                                           limit=_CANDIDATES_SHOWN + 1))


def resolve_key(client: CacheClient, text: str, tenant: str = "") -> bytes:
    """The key a full key or a unique prefix names. A full key is taken as it is (the
    daemon then answers for it); a prefix is looked up with the daemon's List."""
    if len(text) == KEY_HEX_DIGITS:
        return bytes.fromhex(text)
    found = find_entries(client, text, tenant)
    if not found:
        raise click.ClickException(f"not found: no entry's key starts with {text}")
    if len(found) > 1:
        more = " (and more)" if len(found) > _CANDIDATES_SHOWN else ""
        lines = "\n".join(f"  {entry_line(e)}" for e in found[:_CANDIDATES_SHOWN])
        raise click.UsageError(f"key prefix {text} is ambiguous; it starts these keys"
                               f"{more} (give more digits):\n{lines}")
    return found[0].key


def describe_key(client: CacheClient, key: bytes) -> str:
    """One line about an entry for a confirmation; the bare key if it cannot be listed
    (gone, or List is not allowed to this caller)."""
    try:
        found = client.list_entries(key_prefix=key.hex(), limit=1)
    except CacheError:
        found = []
    return entry_line(found[0]) if found else key.hex()


def resolve_keys(client: CacheClient, texts: Sequence[str]) -> list[bytes]:
    """Every key named (full or by unique prefix), each once, before anything is done:
    an ambiguous third prefix must not leave the first two acted on."""
    return list(dict.fromkeys(resolve_key(client, t) for t in texts))


KEYS_ARGUMENT = click.argument("key_texts", metavar="KEY...", nargs=-1, required=True, type=KEY)


MODEL_HELP = ("The model's file name or its beginning, or the first (4 or more) characters "
              "of its fingerprint.")


def path_given(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """A path option; an empty one is refused (it meant the current folder)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("must not be empty")
    return Path(value)


def _check_listen(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            parse_listen(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def tcp_listen_options(f: F) -> F:
    """``--listen`` and what protects it; shared by ``kvcache serve`` and the runtime's."""
    path = click.Path(dir_okay=False, path_type=Path)
    options = [
        click.option("--listen", default=None, metavar="HOST:PORT", callback=_check_listen,
                     help="Also listen on TCP ([::1]:PORT for IPv6, port 0: any free one); "
                          "needs --token-file or --tls-client-ca (or --insecure-tcp)."),
        click.option("--token-file", type=path, default=None,
                     help="TCP callers must send the token in this owner-only file."),
        click.option("--tls-cert", type=path, default=None,
                     help="Serve TCP over TLS with this certificate (PEM)."),
        click.option("--tls-key", type=path, default=None,
                     help="The TLS certificate's private key (PEM)."),
        click.option("--tls-client-ca", type=path, default=None,
                     help="Mutual TLS: TCP callers must present a certificate signed by "
                          "this CA."),
        click.option("--insecure-tcp", is_flag=True,
                     help="Allow TCP without authentication: anyone who can connect may "
                          "use the service (and read every cached prompt state)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def server_auth(listen: str | None, token_file: Path | None, tls_cert: Path | None,
                tls_key: Path | None, tls_client_ca: Path | None,
                insecure_tcp: bool) -> ServerAuth:
    """The TCP listener's protection, or a clear refusal."""
    try:
        auth = ServerAuth.load(token_file, tls_cert, tls_key, tls_client_ca)
        if (auth.tokens or auth.tls_cert) and not listen:
            raise AuthConfigError("--token-file and --tls-* protect a TCP listener: "
                                  "give --listen HOST:PORT too")
        refuse_unprotected_tcp(listen, auth, insecure_tcp)
    except AuthConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return auth
