"""The ``kvcache`` command: run the daemon, and inspect and trim the cache while it serves."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import math
import os
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from rich.cells import cell_len
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

# cli_env first: it quiets gRPC's C core before anything imports grpc.
from . import __version__, cli_env, keys  # noqa: F401
from .auth import (
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
from .blob import SAVE_REASONS
from .client import TIER_NAMES, CacheClient, CacheError, CacheUnavailable
from .common import TIER_DISK, TIER_RAM
from .config import default_address, default_dir, parse_listen
from .v1 import kvcache_pb2 as pb

if TYPE_CHECKING:
    from .ramtier import TierInfo

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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def human_count(n: int) -> str:
    return f"{n:,}"


def local_time(epoch: float, now: float) -> str:
    """``2025-01-31 14:02:11+01:00 (2.0h ago)``: ISO 8601 in local time, with the age."""
    if not epoch:
        return "never"
    stamp = datetime.fromtimestamp(epoch).astimezone().isoformat(sep=" ", timespec="seconds")
    age = now - epoch
    return f"{stamp} ({human_age(age)} ago)" if age >= 0 else f"{stamp} (in the future)"


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
_AUTH_OPTIONS = (
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
    for name, env, text in reversed(_AUTH_OPTIONS):
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
        return ClientAuth.load(*(meta.get(f"kvcache.{name}") for name, _, _ in _AUTH_OPTIONS))
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


def stderr_console() -> Console:
    return Console(stderr=True)


@contextlib.contextmanager
def spinner(text: str, enabled: bool = True) -> Iterator[None]:
    """A spinner on stderr while a long call runs: only on a terminal (never in a pipe,
    a log or --json output)."""
    console = stderr_console()
    if not (enabled and console.is_terminal):
        yield
        return
    with console.status(text):
        yield


def confirm(question: str, yes: bool) -> None:
    """Destructive commands ask first on a terminal. With --yes, or when stdin is not a
    terminal (a script, a pipe, cron), they proceed, as scripts expect."""
    if yes or not sys.stdin.isatty():
        return
    if not click.confirm(question, default=False, err=True):
        raise click.ClickException("cancelled; nothing was changed")


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


def entry_line(e: pb.Entry) -> str:
    """An entry in one line: full key first (never cut), then what tells it apart."""
    return (f"{e.key.hex()}  {e.n_tokens} tokens  {human_bytes(e.size)}  {e.reason}  "
            f"{e.model_name or e.model_fingerprint}"
            + (f"  tenant {e.tenant_id}" if e.tenant_id else "")
            + (("  pinned until " + time.strftime("%Y-%m-%d %H:%M:%S",
                                                  time.localtime(e.pin_expires))
                if e.pin_expires else "  pinned") if e.pinned else "")
            + (f"  {e.children} built on it" if e.children else ""))


def entry_dict(e: pb.Entry, now: float) -> dict[str, Any]:
    return {
        "key": e.key.hex(), "model": e.model_name, "model_fingerprint": e.model_fingerprint,
        "tenant_id": e.tenant_id, "tokens": e.n_tokens, "bytes": e.size,
        "tiers": [TIER_NAMES[t] for t in e.tiers], "reason": e.reason, "codec": e.codec,
        "created": e.created, "age_seconds": round(now - e.created, 3),
        "last_used": e.last_used, "hits": e.hits, "pinned": e.pinned,
        "pin_expires": e.pin_expires or None,  # an expiring pin's end (unix time)
        # A piece: its first `base` tokens are the chain of `parent`; `bytes` are its own,
        # `shared_bytes` (estimated) what it uses of that chain.
        "parent": e.parent.hex(), "base": e.base,
        "shared_bytes": max(0, e.logical_size - e.size), "children": e.children,
    }


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


@click.group()
@click.version_option(__version__, prog_name="kvcache")
def main() -> None:
    """kvcache: a prefix KV-cache daemon for llama.cpp models."""


def _path_given(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """A path option; an empty one is refused (it meant the current folder)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("must not be empty")
    return Path(value)


@main.command()
@click.option("--dir", "data_dir", callback=_path_given, default=None,
              help=f"Data directory (default: {default_dir()}): a new or empty folder, or "
                   "one kvcache made (marked by its .kvcache file).")
@click.option("--socket", "socket_path", callback=_path_given, default=None,
              help="Unix socket path (default: DIR/kvcache.sock).")
@tcp_listen_options
@click.option("--tcp-admin", is_flag=True,
              help="Let TCP callers make operator calls (ls, inspect, verify, prune, pin, "
                   "unpin), which see every tenant's entries; by default only the unix "
                   "socket may.")
@click.option("--ram-dir", callback=_path_given, default=None,
              help="Folder on a memory filesystem to make the RAM tier's own subfolder in "
                   "(default: /dev/shm).")
@click.option("--ram-bytes", type=SIZE, default="2G", show_default=True)
@click.option("--disk-bytes", type=SIZE, default="50G", show_default=True)
@click.option("--min-free-bytes", type=SIZE, default="1G", show_default=True,
              help="Refuse saves that would leave less free space on the disk.")
@click.option("--block-size", type=click.IntRange(1, 65536), default=256, show_default=True,
              help="Tokens per hashed block.")
@click.option("--max-entry-bytes", type=SIZE, default="16G", show_default=True,
              help="The largest entry a save may reserve.")
@click.option("--max-saves-per-tenant", type=click.IntRange(1), default=64, show_default=True,
              help="Saves one tenant may have in flight at once (entries without a tenant "
                   "count as one tenant).")
@click.option("--max-reserved-bytes-per-tenant", type=SIZE, default=None,
              help="Bytes one tenant's saves in flight may have reserved at once "
                   "(default: 4 x --max-entry-bytes).")
@click.option("--tenant-disk-quota", "tenant_disk_quota", multiple=True, metavar="TENANT=SIZE",
              help="Most bytes TENANT's entries may hold on the disk tier; '*=SIZE' for "
                   "every tenant not named (entries without a tenant count as one). A "
                   "tenant at its quota evicts its own entries first; a larger entry is "
                   "refused. Repeatable.")
@click.option("--tenant-ram-quota", "tenant_ram_quota", multiple=True, metavar="TENANT=SIZE",
              help="Most bytes of TENANT's entries the RAM tier may hold; '*=SIZE' for "
                   "every tenant not named. A tenant at its quota drops its own RAM copies "
                   "first; a larger entry stays on disk only. Repeatable.")
@click.option("--lease-seconds", type=PERIOD, default=30.0, show_default=True,
              help="A reservation with no traffic for this long is aborted.")
@click.option("--pin-seconds", type=PERIOD, default=60.0,
              show_default=True,
              help="A same-host read pin not released within this long is dropped.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: any free port).")
@click.option("--remote", "remote_url", default=None, metavar="URL",
              help="Shared tier on a Redis/Valkey server: redis://HOST:PORT/DB, "
                   "rediss://... for TLS, redis+cluster://HOST:PORT,HOST:PORT for a "
                   "cluster; an ACL user as redis://USER@HOST:PORT. Never a password: see "
                   "--remote-password-file and --remote-password-env.")
@click.option("--remote-password-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="File holding the remote's password.")
@click.option("--remote-password-env", default=None, metavar="NAME",
              help="Environment variable holding the remote's password.")
@click.option("--remote-signing-key-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None,
              help="Sign every value written to the remote (HMAC-SHA256) and refuse unsigned "
                   "or mis-signed ones; the file (at least 16 bytes, readable by its owner "
                   "only) is shared by the fleet.")
@click.option("--remote-unsigned", is_flag=True,
              help="Run the shared tier without a signing key: anyone who can write to the "
                   "remote can hand this host altered states (logged, and shown in stats). "
                   "Without it, --remote needs --remote-signing-key-file.")
@click.option("--remote-encrypt", is_flag=True,
              help="Also encrypt every value written to the remote (AES-256-GCM, with a key "
                   "derived from the signing key), so that reading the remote reveals no "
                   "prompt.")
@click.option("--tenant-secret-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None,
              help="Owner-only file whose secret salts tenant namespaces (give every host "
                   "of a fleet the same one). Default: derived from "
                   "--remote-signing-key-file, else a secret made once in DIR.")
@click.option("--remote-tls-ca", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="CA certificates (PEM) that verify a rediss:// server "
                                 "(default: the system's).")
@click.option("--remote-timeout", type=PERIOD, default=0.25, show_default=True,
              help="Deadline of each remote call; a slower remote is a miss.")
@click.option("--log-level", default="INFO", show_default=True)
def serve(data_dir: Path | None, socket_path: Path | None, listen: str | None,
          token_file: Path | None, tls_cert: Path | None, tls_key: Path | None,
          tls_client_ca: Path | None, insecure_tcp: bool, tcp_admin: bool,
          ram_dir: Path | None,
          ram_bytes: int, disk_bytes: int, min_free_bytes: int, block_size: int,
          max_entry_bytes: int, max_saves_per_tenant: int,
          max_reserved_bytes_per_tenant: int | None, tenant_disk_quota: tuple[str, ...],
          tenant_ram_quota: tuple[str, ...], lease_seconds: float, pin_seconds: float, metrics_port: int | None,
          remote_url: str | None, remote_password_file: Path | None,
          remote_password_env: str | None, remote_signing_key_file: Path | None,
          remote_unsigned: bool, remote_encrypt: bool, tenant_secret_file: Path | None,
          remote_tls_ca: Path | None, remote_timeout: float, log_level: str) -> None:
    """Run the cache daemon until SIGTERM or SIGINT."""
    from .errors import StoreError
    from .remote import RemoteConfig, load_signing_key
    from .server import Daemon
    from .store import StoreConfig
    from .tenancy import load_secret_file

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Checked before the data directory is created.
    auth = server_auth(listen, token_file, tls_cert, tls_key, tls_client_ca, insecure_tcp)
    remote = None
    if remote_url or remote_password_file or remote_password_env or remote_signing_key_file \
            or remote_tls_ca or remote_unsigned or remote_encrypt:
        if not remote_url:
            raise click.UsageError("the --remote-* options need --remote URL")
        if remote_signing_key_file and remote_unsigned:
            raise click.UsageError("--remote-unsigned and --remote-signing-key-file contradict "
                                   "each other")
        if not remote_signing_key_file and not remote_unsigned:
            raise click.UsageError(
                "--remote needs --remote-signing-key-file (an owner-only file holding the "
                "fleet's key): without one, anyone who can write to the remote can hand this "
                "host altered states. Pass --remote-unsigned to accept that.")
        if remote_encrypt and not remote_signing_key_file:
            raise click.UsageError("--remote-encrypt needs --remote-signing-key-file (the "
                                   "encryption key is derived from it)")
        try:
            remote = RemoteConfig(
                remote_url, password_file=remote_password_file,
                password_env=remote_password_env, op_timeout_s=remote_timeout,
                signing_key=load_signing_key(remote_signing_key_file)
                if remote_signing_key_file else None, tls_ca_file=remote_tls_ca,
                encrypt=remote_encrypt)
            remote.password()  # a missing file or variable is refused now, not later
        except (ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
    try:
        tenant_secret = load_secret_file(tenant_secret_file) if tenant_secret_file else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    root = (data_dir or default_dir()).expanduser().resolve()
    config = StoreConfig(root=root, ram_dir=ram_dir, ram_bytes=ram_bytes, disk_bytes=disk_bytes,
                         min_free_bytes=min_free_bytes, block_size=block_size,
                         lease_seconds=lease_seconds, pin_seconds=pin_seconds,
                         max_blob_bytes=max_entry_bytes,
                         max_saves_per_tenant=max_saves_per_tenant,
                         max_reserved_bytes_per_tenant=max_reserved_bytes_per_tenant or 0)
    quotas = {TIER_DISK: tenant_quotas("--tenant-disk-quota", tenant_disk_quota),
              TIER_RAM: tenant_quotas("--tenant-ram-quota", tenant_ram_quota)}
    try:
        daemon = Daemon(config, socket_path=socket_path, listen=listen,
                        metrics_port=metrics_port, auth=auth, insecure_tcp=insecure_tcp,
                        tcp_admin=tcp_admin, remote=remote, tenant_secret=tenant_secret,
                        tenant_quotas=quotas)
    except (ValueError, OSError, RuntimeError, StoreError) as exc:
        raise click.ClickException(str(exc)) from None
    daemon.serve_forever()


def tenant_quotas(option: str, given: Sequence[str]) -> dict[str, int]:
    """``TENANT=SIZE`` options -> tenant name (``*``: every tenant) -> bytes; a tenant given
    twice is refused (which one was meant?)."""
    from .store.quotas import parse_quota

    out: dict[str, int] = {}
    for text in given:
        try:
            name, size = parse_quota(text, parse_bytes)
        except (ValueError, click.BadParameter) as exc:
            message = exc.message if isinstance(exc, click.BadParameter) else str(exc)
            raise click.BadParameter(message, param_hint=f"'{option}'") from None
        if name in out:
            raise click.BadParameter(f"tenant {name!r} is given twice",
                                     param_hint=f"'{option}'")
        out[name] = size
    return out


# -- stats -----------------------------------------------------------------------------------


def stats_data(s: pb.StatsResponse) -> dict[str, Any]:
    """Everything Stats answered, with exact numbers (the --json document)."""
    return {
        "version": s.version, "uptime_seconds": round(s.uptime_seconds, 3),
        "block_size": s.block_size, "in_flight": s.in_flight, "read_pins": s.read_pins,
        "min_free_bytes": s.min_free_bytes, "logical_bytes": s.logical_bytes,
        "tiers": {TIER_NAMES[t.tier]: {"entries": t.entries, "bytes": t.bytes,
                                       "budget_bytes": t.budget_bytes,
                                       "reserved_bytes": t.reserved_bytes,
                                       "free_bytes": t.free_bytes,
                                       "directory": t.directory} for t in s.tiers},
        "remote": ({"url": s.remote.url, "connected": s.remote.connected,
                    "cluster": s.remote.cluster, "signed": s.remote.signed,
                    "unsigned_by_choice": s.remote.unsigned_by_choice,
                    "encrypted": s.remote.encrypted,
                    "queue_depth": s.remote.queue_depth, "queue_max": s.remote.queue_max,
                    "last_error": s.remote.last_error}
                   if s.HasField("remote") else None),
        "tenants": [{"tenant": t.tenant, "tenant_id": t.tenant_id,
                     "disk_bytes": t.disk_bytes, "disk_entries": t.disk_entries,
                     "disk_quota_bytes": t.disk_quota_bytes
                     if t.HasField("disk_quota_bytes") else None,
                     "ram_bytes": t.ram_bytes, "ram_entries": t.ram_entries,
                     "ram_quota_bytes": t.ram_quota_bytes
                     if t.HasField("ram_quota_bytes") else None,
                     "open_saves": t.open_saves, "reserved_bytes": t.reserved_bytes}
                    for t in s.tenants],
        "counters": dict(sorted(s.counters.items())),
        "latencies": {name: {"count": v.count, "window": v.window, "p50_ms": v.p50_ms,
                             "p90_ms": v.p90_ms, "p99_ms": v.p99_ms}
                      for name, v in sorted(s.latencies.items())},
    }


def plain_table(*columns: str, right: Sequence[str] = ()) -> Table:
    """A borderless table (like ``docker ps``); cells are added as plain text."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left", no_wrap=True)
    return table


def print_plain(renderable: Any, width: int | None = None) -> None:
    """Print through rich (styles on a terminal only), without the trailing spaces it
    pads cells with. ``width``: lay out for this many columns (default: the terminal's)."""
    out = Console()
    buffer = Console(file=io.StringIO(), width=width or out.width,
                     force_terminal=out.is_terminal, color_system=out.color_system)
    buffer.print(renderable)
    click.echo("\n".join(line.rstrip() for line in buffer.file.getvalue().splitlines()))


def text_row(table: Table, *cells: str) -> None:
    """Cells as text, never as rich markup (a model name or path may hold brackets)."""
    table.add_row(*(Text(c) for c in cells))


def disk_space_facts(disk: dict[str, Any], min_free: int) -> list[tuple[str, str]]:
    """Free space against the watermark, and how much more the tier can take before
    saves evict (or, below the watermark, are refused)."""
    free, reserved = disk["free_bytes"], disk["reserved_bytes"]
    if free < min_free:
        space = (f"{human_bytes(free)}, below the {human_bytes(min_free)} watermark: saves "
                 "evict entries first, or are refused")
    else:
        space = f"{human_bytes(free)} (saves keep {human_bytes(min_free)} free)"
    room = max(0, min(disk["budget_bytes"] - disk["bytes"] - reserved,
                      free - reserved - min_free))
    return [("free disk space", space),
            ("room for saves", f"{human_bytes(room)} before eviction starts")]


def hit_ratio_text(counters: dict[str, int]) -> str:
    lookups = counters.get("lookups", 0)
    if not lookups:
        return "none yet"
    hits = counters.get("lookup_hits", 0)
    return (f"{human_count(lookups)}, {100 * hits / lookups:.1f}% hits "
            f"({human_count(counters.get('lookup_hits_exact', 0))} exact, "
            f"{human_count(counters.get('lookup_hits_partial', 0))} partial)")


def quota_text(used: int, quota: int | None) -> str:
    """A quota and how much of it is used ("-": none)."""
    if quota is None:
        return "-"
    return f"{human_bytes(quota)} ({100 * used / quota:.0f}%)" if quota else "0 B"


def print_tenants(tenants: list[dict[str, Any]]) -> None:
    """One row per tenant: its entries on each tier against its quotas, its saves in
    flight."""
    table = plain_table("TENANT", "ENTRIES", "DISK", "DISK QUOTA", "RAM", "RAM QUOTA",
                        "SAVING", right=("ENTRIES", "DISK", "DISK QUOTA", "RAM",
                                         "RAM QUOTA", "SAVING"))
    for t in tenants:
        name = t["tenant"] or (f"({t['tenant_id']})" if t["tenant_id"] else "(none)")
        saving = f"{t['open_saves']} ({human_bytes(t['reserved_bytes'])})" \
            if t["open_saves"] else "-"
        text_row(table, name, human_count(t["disk_entries"]), human_bytes(t["disk_bytes"]),
                 quota_text(t["disk_bytes"], t["disk_quota_bytes"]),
                 human_bytes(t["ram_bytes"]), quota_text(t["ram_bytes"], t["ram_quota_bytes"]),
                 saving)
    print_plain(table)


def print_stats_summary(d: dict[str, Any]) -> None:
    click.echo(f"kvcache {d['version']}, up {human_age(d['uptime_seconds'])}, "
               f"block size {d['block_size']} tokens")
    if not d["tiers"]:  # a token bound to tenants: its own tenants' usage only
        click.echo()
        print_tenants(d["tenants"])
        return
    tiers = plain_table("TIER", "ENTRIES", "USED", "BUDGET", "USE",
                        right=("ENTRIES", "USED", "BUDGET", "USE"))
    for name, t in d["tiers"].items():
        use = f"{100 * t['bytes'] / t['budget_bytes']:.0f}%" if t["budget_bytes"] else "-"
        text_row(tiers, name, human_count(t["entries"]), human_bytes(t["bytes"]),
                 human_bytes(t["budget_bytes"]), use)
    print_plain(tiers)
    disk, ram = d["tiers"].get("disk"), d["tiers"].get("ram")
    rows: list[tuple[str, str]] = []
    if disk:
        rows += disk_space_facts(disk, d["min_free_bytes"])
        rows.append(("data directory", disk["directory"]))
    if disk and d["logical_bytes"]:
        ratio = d["logical_bytes"] / disk["bytes"] if disk["bytes"] else 1.0
        rows.append(("shared prefixes", f"{human_bytes(d['logical_bytes'])} of states stored "
                                        f"in {human_bytes(disk['bytes'])} ({ratio:.1f}x)"))
    if ram:
        rows.append(("RAM tier", f"{ram['directory']} ({human_bytes(ram['free_bytes'])} free "
                                 "there)"))
    rows.append(("lookups", hit_ratio_text(d["counters"])))
    if d["remote"]:
        rows.append(("remote", remote_text(d["remote"], d["counters"])))
    reserved = disk["reserved_bytes"] if disk else 0
    rows.append(("saves in flight", f"{d['in_flight']} ({human_bytes(reserved)} reserved); "
                                    f"{d['read_pins']} read pins"))
    click.echo()
    echo_fields(rows, align="left")
    if d["tenants"]:
        click.echo()
        print_tenants(d["tenants"])


def remote_text(remote: dict[str, Any], counters: dict[str, int]) -> str:
    """The shared tier in one line: where, whether reachable, what moved."""
    state = "connected" if remote["connected"] else \
        f"DISCONNECTED ({remote['last_error'] or 'reconnecting'})"
    errors = sum(v for k, v in counters.items() if k.startswith("remote_errors_"))
    return (f"{remote['url']}{' (cluster)' if remote['cluster'] else ''}, {state}"
            f"{', signed' if remote['signed'] else ', UNSIGNED (--remote-unsigned)'}"
            f"{', encrypted' if remote['encrypted'] else ''}; "
            f"{human_count(counters.get('remote_hits', 0))} hits, "
            f"{human_bytes(counters.get('remote_bytes_fetched', 0))} fetched, "
            f"{human_bytes(counters.get('remote_bytes_sent', 0))} sent, "
            f"queue {remote['queue_depth']}/{remote['queue_max']}, {human_count(errors)} errors")


def counter_value(name: str, value: int) -> str:
    return human_bytes(value) if "bytes" in name else human_count(value)


def print_counters(counters: dict[str, int]) -> None:
    """Counters by topic, in declaration order; a newer daemon's extra ones come last."""
    from .counters import REMOTE_SECTION, SECTIONS

    table = Table(title="counters", box=None, pad_edge=False, header_style="bold",
                  title_justify="left")
    table.add_column("COUNTER", no_wrap=True)
    table.add_column("VALUE", justify="right", no_wrap=True)
    table.add_column("MEANING")  # wraps at word boundaries on a narrow terminal
    sections = {**SECTIONS, "remote": REMOTE_SECTION}
    known = {name for section in sections.values() for name in section}
    other = {n: "" for n in counters if n not in known}
    for title, section in [*sections.items(), ("other", other)]:
        names = [n for n in section if n in counters]
        if not names:
            continue
        table.add_row(Text(title, style="bold"), "", "")
        for name in names:
            text_row(table, f"  {name}", counter_value(name, counters[name]), section[name])
    click.echo()
    print_plain(table)


def print_latencies(latencies: dict[str, dict[str, Any]]) -> None:
    table = plain_table("SERIES", "COUNT", "WINDOW", "P50 MS", "P90 MS", "P99 MS",
                        right=("COUNT", "WINDOW", "P50 MS", "P90 MS", "P99 MS"))
    table.title = "latencies (over the most recent samples)"
    table.title_justify = "left"
    for name, v in latencies.items():
        text_row(table, name, human_count(v["count"]), human_count(v["window"]),
                 f"{v['p50_ms']:.3f}", f"{v['p90_ms']:.3f}", f"{v['p99_ms']:.3f}")
    if not latencies:
        text_row(table, "(none observed yet)", "", "", "", "", "")
    click.echo()
    print_plain(table)


@main.command()
@address_option
@click.option("--all", "-v", "show_all", is_flag=True,
              help="Also every counter and the latency percentiles.")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: everything, exact numbers.")
def stats(address: str | None, show_all: bool, as_json: bool) -> None:
    """A summary: entries and space per tier, free disk space against the watermark, hit
    ratio, where the tiers are. --all adds every counter and latency percentiles."""
    with connect(address) as client:
        s = run(client.stats)
    data = stats_data(s)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    print_stats_summary(data)
    if show_all:
        print_counters(data["counters"])
        print_latencies(data["latencies"])
    else:
        click.echo("\nevery counter and latency percentiles: kvcache stats --all")


# -- ls --------------------------------------------------------------------------------------

MODEL_HELP = ("The model's file name or its beginning, or the first (4 or more) characters "
              "of its fingerprint.")
# ls columns, most useful first: on a terminal too narrow for all, the last ones are left
# out (a pipe or a file always gets every column). The key is never cut.
_LS_PRIORITY = ("KEY", "TOKENS", "SIZE", "SHARED", "TIERS", "REASON", "USED", "MODEL",
                "TENANT", "HITS", "PINNED", "AGE")
_LS_RIGHT = ("TOKENS", "SIZE", "SHARED", "HITS")


def ls_row(r: dict[str, Any], now: float) -> dict[str, str]:
    return {
        "KEY": r["key"], "MODEL": r["model"] or r["model_fingerprint"],
        "TENANT": r["tenant_id"] or "-", "TOKENS": human_count(r["tokens"]),
        "SIZE": human_bytes(r["bytes"]), "TIERS": ", ".join(r["tiers"]),
        "SHARED": human_bytes(r["shared_bytes"]) if r["shared_bytes"] else "-",
        "REASON": r["reason"], "AGE": human_age(r["age_seconds"]),
        "USED": f"{human_age(max(0.0, now - r['last_used']))} ago" if r["last_used"] else "never",
        "HITS": human_count(r["hits"]),
        "PINNED": ("" if not r["pinned"] else
                   f"{human_age(max(0.0, r['pin_expires'] - now))} left"
                   if r.get("pin_expires") else "yes"),
    }


class ColumnStream:
    """Rows printed page by page, cells never cut or wrapped. The columns shown and their
    widths are those of the first page (a wider cell later is printed whole), so the first
    page is on screen before the next is asked for. On a terminal, columns that do not fit
    its width are left out, least useful first (``hidden``); anywhere else (a pipe, a
    file) every column is printed, however wide the lines get."""

    def __init__(self, headers: Sequence[str], first: Sequence[dict[str, str]], *,
                 priority: Sequence[str], right: Sequence[str]) -> None:
        self.widths = {h: max([cell_len(h), *(cell_len(r[h]) for r in first)])
                       for h in headers}
        terminal = Console()
        shown = list(headers)
        if terminal.is_terminal:
            shown = []
            for name in priority:
                if name not in headers:
                    continue
                need = sum(self.widths[h] + 2 for h in shown) + self.widths[name]
                if need <= terminal.width or not shown:
                    shown.append(name)
            shown = [h for h in headers if h in shown]
        self.shown = shown
        self.hidden = [h for h in headers if h not in shown]
        self.right = set(right)
        self._line(dict(zip(headers, headers, strict=True)), bold=terminal.is_terminal)
        self.rows(first)

    def _line(self, row: dict[str, str], bold: bool = False) -> None:
        cells = []
        for h in self.shown:
            pad = self.widths[h] - cell_len(row[h])
            cells.append(" " * pad + row[h] if h in self.right else row[h] + " " * pad)
        line = "  ".join(cells).rstrip()
        click.echo(click.style(line, bold=True) if bold else line)

    def rows(self, rows: Sequence[dict[str, str]]) -> None:
        for row in rows:
            self._line(row)


# Entries per List answer: the first page is on screen in well under a second.
LS_PAGE = 500
_LS_SORTS: dict[str, Callable[[pb.Entry], float]] = {
    "used": lambda e: -max(e.last_used, e.created), "age": lambda e: e.created,
    "size": lambda e: -e.size, "tokens": lambda e: -e.n_tokens, "hits": lambda e: -e.hits,
}


@main.command("ls")
@address_option
@click.option("--model", default="", help=MODEL_HELP)
@click.option("--tenant", default="", help="Tenant salt (only its entries are listed).")
@click.option("--reason", type=click.Choice(["", *SAVE_REASONS]), default="")
@click.option("--tier", type=click.Choice(["", "ram", "disk", "remote"]), default="",
              help="ram: entries with a RAM copy; disk: all (every entry is on disk); "
                   "remote: what this host can reach in the shared tier (--remote).")
@click.option("--min-tokens", type=U32, default=0)
@click.option("--sort", "sort_by", type=click.Choice(list(_LS_SORTS)),
              default="used", show_default=True,
              help="used: most recently used first; age: oldest first; size, tokens, "
                   "hits: largest first. Orders other than used read every entry for "
                   "each page (slow on a large cache: add --limit).")
@click.option("--limit", type=U32, default=0, help="At most this many rows (0: all).")
@click.option("--json", "as_json", is_flag=True)
def ls(address: str | None, model: str, tenant: str, reason: str, tier: str, min_tokens: int,
       sort_by: str, limit: int, as_json: bool) -> None:
    """List entries, with full keys (inspect, pin, evict... take any unique prefix).
    Rows are printed page by page as the daemon sends them."""
    now = time.time()
    with connect(address) as client:
        if tier == "remote":  # at most a thousand, in one answer: ordered here
            found = run(lambda: client.list_entries(model=model, tenant=tenant,
                                                    reason=reason, tier=tier,
                                                    min_tokens=min_tokens))
            found.sort(key=_LS_SORTS[sort_by])
            pages: Iterator[list[pb.Entry]] = iter([found[:limit] if limit else found])
        else:
            pages = client.iter_entries(model=model, tenant=tenant, reason=reason, tier=tier,
                                        min_tokens=min_tokens, limit=limit, sort=sort_by,
                                        page_size=LS_PAGE)
        first = [entry_dict(e, now) for e in run(lambda: next(pages, []))]

        def rest() -> Iterator[list[dict[str, Any]]]:
            while (page := run(lambda: next(pages, None))) is not None:
                yield [entry_dict(e, now) for e in page]

        if as_json:
            count = 0
            click.echo("[", nl=False)
            for rows in itertools.chain([first], rest()):
                for row in rows:
                    text = textwrap.indent(json.dumps(row, indent=2), "  ")
                    click.echo(("," if count else "") + "\n" + text, nl=False)
                    count += 1
            click.echo("\n]" if count else "]")
            return
        # SIZE: the entry's own bytes; SHARED: what it uses of the entries it is built on.
        headers = ["KEY", "MODEL", "TENANT", "TOKENS", "SIZE", "SHARED", "TIERS", "REASON",
                   "AGE", "USED", "HITS", "PINNED"]
        if not any(r["tenant_id"] for r in first):
            headers.remove("TENANT")
        table = ColumnStream(headers, [ls_row(r, now) for r in first], priority=_LS_PRIORITY,
                             right=_LS_RIGHT)
        count = len(first)
        for rows in rest():
            table.rows([ls_row(r, now) for r in rows])
            count += len(rows)
    click.echo(entries_text(count))
    if table.hidden and count:
        click.echo(f"(not shown at this width: {', '.join(table.hidden).lower()}; "
                   "see --json)")


# -- inspect ---------------------------------------------------------------------------------


def inspect_lines(data: dict[str, Any], now: float, every_token: list[int] | None,
                  whole_text: str | None) -> list[tuple[str, str]]:
    """The human view. ``every_token``: the entry's tokens, when the two ends shown cover
    them all (then shown once, whole)."""
    kv_layout = ", ".join(f"{k}={v}" for k, v in sorted(data["kv_layout"].items()))
    lines = [
        ("key", data["key"]),
        ("model", data["model"] or "-"),
        ("model fingerprint", data["model_fingerprint"]),
        ("tenant id", data["tenant_id"] or "- (no tenant)"),
        ("tokens", human_count(data["tokens"])),
        ("size", f"{human_bytes(data['bytes'])} ({human_count(data['bytes'])} bytes)"),
        ("payload", f"{human_bytes(data['payload_bytes'])} stored, "
                    f"{human_bytes(data['raw_payload_bytes'])} raw, codec {data['codec']}"),
        ("tiers", ", ".join(data["tiers"])),
        ("made of", made_of(data)),
        ("reason", data["reason"]),
        ("created", local_time(data["created"], now)),
        ("last used", local_time(data["last_used"], now)),
        ("hits", human_count(data["hits"])),
        ("pinned", ("no" if not data["pinned"] else
                    f"until {local_time(data['pin_expires'], now)}"
                    if data.get("pin_expires") else "yes")),
        ("kv layout", kv_layout or "-"),
        ("format version", str(data["format_version"])),
        ("producer", data["producer"] or "-"),
        ("path", data["path"]),
    ]
    first, last = data["first_tokens"], data["last_tokens"]
    if every_token is not None:
        lines.append(("token ids", " ".join(map(str, every_token))))
        if whole_text is not None:
            lines.append(("text", json.dumps(whole_text, ensure_ascii=False)))
        return lines
    lines += [(f"first {len(first)} tokens", " ".join(map(str, first))),
              (f"last {len(last)} tokens", " ".join(map(str, last)))]
    if "first_text" in data:
        lines += [("first text", json.dumps(data["first_text"], ensure_ascii=False)),
                  ("last text", json.dumps(data["last_text"], ensure_ascii=False))]
    return lines


def made_of(data: dict[str, Any]) -> str:
    """What an entry's state is stored as: one blob, or the chain of pieces it joins."""
    chain = data["chain"]
    built_on = (f"; {data['children']} entr{'y is' if data['children'] == 1 else 'ies are'} "
                "built on it" if data["children"] else "")
    if len(chain) <= 1:
        return f"its own blob (tokens 0-{data['tokens']}){built_on}"
    parts = ", ".join(f"{p['key'][:12]} (tokens {p['base']}-{p['end']})" for p in chain)
    return (f"{len(chain)} pieces: {parts}; its own holds tokens {data['base']}-"
            f"{data['tokens']}, {human_bytes(data['shared_bytes'])} shared{built_on}")


def echo_fields(lines: list[tuple[str, str]], align: str = "right") -> None:
    """``label: value`` lines (``label  value`` when left-aligned); long values wrap at
    spaces under their start, and a key, a path or a token id is never broken."""
    label_width = max(len(label) for label, _ in lines)
    width = max(shutil.get_terminal_size().columns, label_width + 40)
    for label, value in lines:
        head = f"{label:>{label_width}}: " if align == "right" else f"{label:<{label_width}}  "
        click.echo(textwrap.fill(value, width, initial_indent=head,
                                 subsequent_indent=" " * len(head), break_long_words=False,
                                 break_on_hyphens=False) if value else head.rstrip())


def inspect_options(f: F) -> F:
    """KEY and the options that choose what ``inspect`` shows; shared with
    ``model-runtime inspect``, which takes the same ones and a model."""
    options = [
        address_option,
        click.argument("key", type=KEY),
        click.option("--tenant", default="", help="Only show the entry if it is this tenant's."),
        click.option("--tokens", "show_tokens", type=click.IntRange(min=0), default=32,
                     show_default=True, help="How many tokens to show at each end (0: all)."),
        click.option("--json", "as_json", is_flag=True),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def entry_details(address: str | None, key: str, tenant: str, show_tokens: int
                  ) -> tuple[pb.EntryDetail, dict[str, Any], float]:
    """The entry KEY names (a full key or a unique prefix), the document inspect shows of
    it (--json), and the time it was read at."""
    with connect(address) as client:
        k = resolve_key(client, key, tenant)
        d = run(lambda: client.inspect(k, tenant=tenant))
    tokens = list(d.tokens)
    shown = len(tokens) if show_tokens == 0 else min(show_tokens, len(tokens))
    now = time.time()
    data = entry_dict(d.entry, now)
    data.update(kv_layout=dict(d.kv_layout), format_version=d.format_version,
                producer=d.producer, payload_bytes=d.payload_size,
                raw_payload_bytes=d.raw_payload_size, path=d.path,
                # Each piece holds the cells of tokens [base, end): up to where the next
                # one takes over (the entry's own, to its end).
                chain=[{"key": p.key.hex(), "base": p.base,
                        "end": d.chain[i + 1].base if i + 1 < len(d.chain) else p.n_tokens,
                        "bytes": p.size, "tier": TIER_NAMES[p.tier]}
                       for i, p in enumerate(d.chain)],
                first_tokens=tokens[:shown], last_tokens=tokens[len(tokens) - shown:])
    return d, data, now


def print_entry(data: dict[str, Any], tokens: list[int], now: float, as_json: bool,
                whole_text: str | None = None) -> None:
    """What entry_details found, as JSON or as ``label: value`` lines (``whole_text``: all
    its tokens decoded, shown when both ends cover them)."""
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    # Both ends together cover every token: shown once, whole.
    covered = 2 * len(data["first_tokens"]) >= len(tokens)
    echo_fields(inspect_lines(data, now, tokens if covered else None, whole_text))


@main.command()
@inspect_options
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Decode the tokens to text with the entry's GGUF file: runs "
                   "model-runtime inspect (the same options).")
def inspect(address: str | None, key: str, tenant: str, show_tokens: int, as_json: bool,
            model_path: str | None) -> None:
    """Everything about one entry. KEY: the full key or a unique prefix of it."""
    if model_path:
        hand_over("inspect --model", "inspect", [
            key, "--model", model_path, "--tenant", tenant, "--tokens", str(show_tokens),
            *(["--json"] if as_json else []), *connection_args(address)])
    d, data, now = entry_details(address, key, tenant, show_tokens)
    print_entry(data, list(d.tokens), now, as_json)


# -- verify ----------------------------------------------------------------------------------


def resolve_keys(client: CacheClient, texts: Sequence[str]) -> list[bytes]:
    """Every key named (full or by unique prefix), each once, before anything is done:
    an ambiguous third prefix must not leave the first two acted on."""
    return list(dict.fromkeys(resolve_key(client, t) for t in texts))


@main.command()
@address_option
@click.argument("key_texts", metavar="[KEY]...", nargs=-1, type=KEY)
@click.option("--check-only", is_flag=True,
              help="Only report bad blobs; quarantine nothing.")
@click.option("--json", "as_json", is_flag=True)
def verify(address: str | None, key_texts: tuple[str, ...], check_only: bool,
           as_json: bool) -> None:
    """Check blobs' checksums: every entry, or the KEYs given (full keys or unique
    prefixes). Bad ones are moved to quarantine unless --check-only. Exit 1 if any was
    bad."""
    from .store import NO_SUCH_ENTRY

    bad: list[dict[str, Any]] = []
    checked = 0
    console = stderr_console()
    with connect(address) as client:
        wanted = resolve_keys(client, key_texts)
        with Progress(console=console, transient=True,
                      disable=as_json or not console.is_terminal) as progress:
            task = progress.add_task("verifying", total=len(wanted) or None)

            def go() -> None:
                nonlocal checked
                for result in client.verify(wanted, check_only=check_only):
                    checked += 1
                    progress.update(task, completed=result.done, total=result.total)
                    if not result.ok:
                        found = result.error != NO_SUCH_ENTRY
                        bad.append({"key": result.key.hex(), "error": result.error,
                                    "quarantined": found and not check_only})

            run(go)
    if as_json:
        click.echo(json.dumps({"checked": checked, "bad": bad}, indent=2))
    else:
        for b in bad:
            if b["error"] == NO_SUCH_ENTRY:
                click.echo(f"NOT FOUND {b['key']}: {b['error']}")
            else:
                fate = "quarantined" if b["quarantined"] else "left in place: --check-only"
                click.echo(f"BAD {b['key']}: {b['error']} ({fate})")
        click.echo(f"{checked} checked, {len(bad)} bad")
    sys.exit(1 if bad else 0)


# -- prune -----------------------------------------------------------------------------------

_PREVIEW_ROWS = 20  # a confirmation lists at most this many entries


def asks_first(yes: bool) -> bool:
    """A destructive command shows its plan and asks only on a terminal without --yes."""
    return not yes and sys.stdin.isatty()


def prune_data(r: pb.PruneResponse, dry_run: bool, now: float) -> dict[str, Any]:
    return {"dry_run": dry_run, "removed": [entry_dict(e, now) for e in r.removed],
            "bytes_freed": r.bytes_freed, "skipped_pinned": r.skipped_pinned,
            "skipped_in_use": r.skipped_in_use, "skipped_shared": r.skipped_shared,
            "ram_dropped": r.ram_dropped,
            "ram_bytes_freed": r.ram_bytes_freed,
            "ram_dropped_keys": [e.key.hex() for e in r.ram_dropped_entries]}


def entries_text(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def show_prune_plan(plan: pb.PruneResponse) -> None:
    """What a prune will do, on stderr (stdout stays the command's result)."""
    lines = [f"  remove {entry_line(e)}" for e in plan.removed]
    lines += [f"  drop the RAM copy of {entry_line(e)}" for e in plan.ram_dropped_entries]
    actions = []
    if plan.removed:
        actions.append(f"remove {entries_text(len(plan.removed))} "
                       f"({human_bytes(plan.bytes_freed)})")
    if plan.ram_dropped_entries:
        actions.append(f"drop {plan.ram_dropped} RAM copies "
                       f"({human_bytes(plan.ram_bytes_freed)}; the entries stay on disk)")
    click.echo(f"prune will {' and '.join(actions)}:", err=True)
    for line in lines[:_PREVIEW_ROWS]:
        click.echo(line, err=True)
    if len(lines) > _PREVIEW_ROWS:
        click.echo(f"  ... and {len(lines) - _PREVIEW_ROWS} more (--dry-run lists them all)",
                   err=True)
    click.echo(f"kept: {kept_text(plan)}", err=True)


def kept_text(r: pb.PruneResponse) -> str:
    text = f"{r.skipped_pinned} pinned, {r.skipped_in_use} in use"
    if r.skipped_shared:
        text += (f", {r.skipped_shared} that other entries are built on (they go once "
                 "those do)")
    return text


def print_prune(r: pb.PruneResponse, dry_run: bool, ram_target: bool) -> None:
    verb, drop = ("would remove", "would drop") if dry_run else ("removed", "dropped")
    for e in r.removed:
        click.echo(f"{verb} {entry_line(e)}")
    for e in r.ram_dropped_entries:
        click.echo(f"{drop} the RAM copy of {e.key.hex()}")
    click.echo(f"{verb} {entries_text(len(r.removed))}, {human_bytes(r.bytes_freed)}; kept "
               f"{kept_text(r)}")
    if ram_target:
        click.echo(f"{drop} {r.ram_dropped} RAM copies, {human_bytes(r.ram_bytes_freed)} "
                   "(their entries stay on disk)")


@main.command()
@address_option
@click.option("--max-bytes", type=SIZE, default=None,
              help="Remove entries (of those the filters select, least recently used "
                   "first) until the disk tier holds at most this.")
@click.option("--max-ram-bytes", type=SIZE, default=None,
              help="Drop RAM copies (of those entries, least recently used first) until "
                   "the RAM tier holds at most this; the entries stay on disk.")
@click.option("--older-than", type=DURATION, default=None, help="Created longer ago than this.")
@click.option("--unused-for", type=DURATION, default=None, help="Not read for this long.")
@click.option("--model", default="", help=MODEL_HELP)
@click.option("--tenant", default="", help="Tenant salt (only its entries).")
@click.option("--reason", type=click.Choice(["", *SAVE_REASONS]), default="")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@yes_option
@click.option("--json", "as_json", is_flag=True)
def prune(address: str | None, max_bytes: int | None, max_ram_bytes: int | None,
          older_than: float | None, unused_for: float | None, model: str, tenant: str,
          reason: str, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Remove entries by age, use, model, tenant or reason, or trim a tier to a size.

    Every filter narrows what may go. Without a byte target, every entry the filters
    select is removed; with one, they go least recently used first until the tier fits
    (--max-ram-bytes only ever drops RAM copies). Pinned entries and entries being read
    stay. On a terminal it shows the plan and asks first (--yes: don't ask)."""
    # 0 on the wire means "no byte target" (and alone the daemon refuses the prune), but
    # `--max-bytes 0` asks to trim to nothing: a 1-byte target removes every entry that
    # may go, as every blob is larger.
    def target(value: int | None) -> int:
        return 0 if value is None else max(value, 1)

    criteria: dict[str, Any] = dict(
        max_disk_bytes=target(max_bytes), max_ram_bytes=target(max_ram_bytes),
        older_than_seconds=older_than or 0.0, unused_for_seconds=unused_for or 0.0,
        model=model, tenant=tenant, reason=reason)
    with connect(address) as client:
        r = None
        if not dry_run and asks_first(yes):
            plan = run(lambda: client.prune(**criteria, dry_run=True))
            if not (plan.removed or plan.ram_dropped_entries):
                r = plan  # nothing to do: nothing to ask
            else:
                show_prune_plan(plan)
                confirm("Go ahead?", yes)
                # Only what was shown may go, as it was shown, whatever changed since.
                criteria.update(confirmed_plan=True, keys=[e.key for e in plan.removed],
                                ram_drop_keys=[e.key for e in plan.ram_dropped_entries])
        if r is None:
            with spinner("pruning", enabled=not as_json):
                r = run(lambda: client.prune(**criteria, dry_run=dry_run))
    if as_json:
        click.echo(json.dumps(prune_data(r, dry_run, time.time()), indent=2))
        return
    print_prune(r, dry_run, max_ram_bytes is not None)


# -- commands that need a model -------------------------------------------------------------
# They are model-runtime's (`model-runtime warm`, `model-runtime inspect`): the daemon's package
# never imports the runtime (tests/test_layering.py). The old spellings run the new commands.

RUNTIME_SCRIPT = "model-runtime"


def runtime_script() -> str | None:
    """The model-runtime command installed beside this interpreter's, or else on PATH."""
    return (shutil.which(RUNTIME_SCRIPT, path=sysconfig.get_path("scripts"))
            or shutil.which(RUNTIME_SCRIPT))


def connection_args(address: str | None) -> list[str]:
    """--address and the credentials given (options or environment), as arguments again."""
    meta = click.get_current_context().meta
    args = ["--address", address] if address else []
    for name, _, _ in _AUTH_OPTIONS:
        value = meta.get(f"kvcache.{name}")
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def hand_over(old: str, command: str, args: Sequence[str]) -> NoReturn:
    """Run ``model-runtime COMMAND ARGS`` in this process's place (its output and exit code
    are the command's), or say where the command went if model-runtime is not installed."""
    new = f"{RUNTIME_SCRIPT} {command}"
    script = runtime_script()
    if script is None:
        raise click.ClickException(
            f"`kvcache {old}` is now `{new}`, and no {RUNTIME_SCRIPT} command was found "
            f"(in {sysconfig.get_path('scripts')} or on PATH)")
    click.echo(f"note: `kvcache {old}` is now `{new}`; running that", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(script, [script, command, *args])


@main.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def warm(args: tuple[str, ...]) -> None:
    """Moved to model-runtime warm (the same options), which this runs."""
    hand_over("warm", "warm", args)


# -- evict, pin, unpin -----------------------------------------------------------------------

KEYS_ARGUMENT = click.argument("key_texts", metavar="KEY...", nargs=-1, required=True, type=KEY)


@main.command()
@address_option
@KEYS_ARGUMENT
@yes_option
def evict(address: str | None, key_texts: tuple[str, ...], yes: bool) -> None:
    """Remove entries (KEY: a full key or a unique prefix), each with the entries built on
    it (they cannot be restored without it); refused for one that is pinned or being
    read by a client, or that a pinned entry is built on (the daemon's own work on it,
    such as its RAM copy right after a save, is waited for, up to 5 s). On a terminal it
    shows them and asks first (--yes: don't ask)."""
    with connect(address) as client:
        wanted = resolve_keys(client, key_texts)
        if asks_first(yes):
            click.echo(f"evict will remove {entries_text(len(wanted))}:", err=True)
            for key in wanted:
                click.echo(f"  {describe_key(client, key)}", err=True)
            confirm("Go ahead?", yes)
        cascaded = False
        for key in wanted:
            try:
                dependents = client.delete(key)
            except CacheError as exc:
                if cascaded and exc.code is not None and exc.code.name == "NOT_FOUND":
                    click.echo(f"evicted {key.hex()} (with an entry it was built on)")
                    continue
                raise click.ClickException(str(exc)) from None
            cascaded = cascaded or bool(dependents)
            click.echo(f"evicted {key.hex()}" + (
                f" and {entries_text(dependents)} built on it" if dependents else ""))


def _pin_command(name: str, doc: str, action: Callable[[CacheClient, bytes], None],
                 done: str) -> None:
    @main.command(name, help=doc)
    @address_option
    @KEYS_ARGUMENT
    def command(address: str | None, key_texts: tuple[str, ...]) -> None:
        with connect(address) as client:
            for key in resolve_keys(client, key_texts):
                run(lambda k=key: action(client, k))
                click.echo(f"{done} {key.hex()}")


_pin_command("pin", "Protect entries from eviction and pruning (KEY: a full key or a unique "
                    "prefix).", CacheClient.pin, "pinned")
_pin_command("unpin", "Make pinned entries evictable again (KEY: a full key or a unique "
                      "prefix).", CacheClient.unpin, "unpinned")


def tier_table(tiers: Sequence[TierInfo], removed: Sequence[str]) -> None:
    """The tiers, one row each. A tier's path is what --remove takes: never cut, whatever
    the width; the data directory folds onto more lines instead (nothing dropped)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    width = max([cell_len("RAM TIER"), *(cell_len(t.path) for t in tiers)])
    table.add_column("RAM TIER", no_wrap=True, min_width=width)
    table.add_column("SIZE", justify="right", no_wrap=True)
    table.add_column("STATE", no_wrap=True)
    table.add_column("DATA DIRECTORY", overflow="fold", min_width=12)
    rows = []
    for t in tiers:
        state = "removed" if t.path in removed else t.state
        rows.append((t.path, human_bytes(t.bytes),
                     state + (f", {t.foreign_names} foreign" if t.foreign_names else ""),
                     t.data_dir or "(no kvcache marker)"))
        text_row(table, *rows[-1])
    # Room for the columns that are not cut and 12 of the data directory's characters.
    needed = sum(max([cell_len(h), *(cell_len(r[i]) for r in rows)]) + 2
                 for i, h in enumerate(("RAM TIER", "SIZE", "STATE"))) + 12
    print_plain(table, width=max(needed, Console().width))


def tiers_to_remove(tiers: Sequence[TierInfo], names: Sequence[str],
                    parents: Sequence[Path]) -> list[TierInfo]:
    """The tiers ``names`` name (a path as listed, or a folder name), each an orphan, or a
    usage error saying which is not and why (before anything is removed)."""
    plan: list[TierInfo] = []
    for name in names:
        found = [t for t in tiers if name in (t.path, Path(t.path).name)
                 or Path(name).resolve() == Path(t.path).resolve()]
        if not found:
            where = ", ".join(map(str, parents))
            raise click.UsageError(f"no RAM tier {name} in {where} (kvcache ram-tiers lists "
                                   "them; --parent for another --ram-dir)")
        if len(found) > 1:
            raise click.UsageError(f"{name} names {len(found)} tiers; give its path: "
                                   f"{', '.join(t.path for t in found)}")
        tier = found[0]
        if tier.state != "orphan":
            why = {"in_use": "a kvcache daemon is using it",
                   "idle": f"its data directory {tier.data_dir} exists",
                   "unmarked": "it has no marker saying kvcache made it"}[tier.state]
            raise click.UsageError(f"{tier.path} is not an orphan ({why}); only a tier whose "
                                   "data directory is gone is removed")
        if tier not in plan:
            plan.append(tier)
    return plan


@main.command("ram-tiers")
@click.option("--parent", "parents", multiple=True,
              callback=lambda ctx, param, values: [_path_given(ctx, param, v) for v in values],
              help="Folder to look in (repeatable; default: /dev/shm): the --ram-dir the "
                   "daemons were given.")
@click.option("--remove", "names", multiple=True, metavar="TIER",
              help="Remove this orphaned tier (its path as listed, or its name; repeatable).")
@click.option("--remove-orphans", is_flag=True,
              help="Remove every tier whose data directory is gone (other projects' of this "
                   "user too: check the list it shows).")
@yes_option
@click.option("--json", "as_json", is_flag=True)
def ram_tiers(parents: list[Path], names: tuple[str, ...], remove_orphans: bool, yes: bool,
              as_json: bool) -> None:
    """List RAM-tier folders with their data directory, and remove orphaned ones: those
    whose data directory is gone. Only kvcache's own files go, and only from a folder whose
    marker says kvcache made it; one holding anything else is kept. On a terminal it lists
    what will go and asks first (--yes: don't ask).

    Exit 1 when an orphan had to be kept (the reason is printed)."""
    from .ramtier import SHM, find_tiers, remove_orphan

    if names and remove_orphans:
        raise click.UsageError("give --remove TIER or --remove-orphans, not both")
    parents = parents or [SHM]
    tiers = find_tiers(parents)
    orphans = [t for t in tiers if t.state == "orphan"]
    plan = orphans if remove_orphans else tiers_to_remove(tiers, names, parents)
    removing = remove_orphans or bool(names)
    if plan and asks_first(yes):
        click.echo(f"ram-tiers will remove {len(plan)} RAM tier(s), "
                   f"{human_bytes(sum(t.bytes for t in plan))}:", err=True)
        for t in plan:
            click.echo(f"  {t.path} ({human_bytes(t.bytes)}; its data directory "
                       f"{t.data_dir} is gone)", err=True)
        confirm("Go ahead?", yes)
    removed: list[str] = []
    kept: dict[str, str] = {}
    for tier in plan:  # each checked again, under the tier's lock
        why = remove_orphan(Path(tier.path))
        if why is None:
            removed.append(tier.path)
        else:
            kept[tier.path] = why
    if as_json:
        data: dict[str, Any] = {"tiers": [t.as_dict() for t in tiers]}
        if removing:
            data.update(removed=removed, kept=kept)
        click.echo(json.dumps(data, indent=2))
        sys.exit(1 if kept else 0)
    tier_table(tiers, removed)
    for path, why in kept.items():
        click.echo(f"kept {path}: {why}")
    if removing:
        click.echo(f"removed {len(removed)} orphaned RAM tier(s)")
        sys.exit(1 if kept else 0)
    if orphans:
        click.echo(f"{len(orphans)} orphaned (remove one with: kvcache ram-tiers --remove "
                   "TIER; all: kvcache ram-tiers --remove-orphans)")


if __name__ == "__main__":
    main()
