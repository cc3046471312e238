"""``kvcache serve``: run the daemon."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..common import TIER_DISK, TIER_RAM
from ..config import default_dir
from .group import main
from .options import PERIOD, SIZE, parse_bytes, path_given, server_auth, tcp_listen_options

if TYPE_CHECKING:
    from ..kv_events import PublisherConfig


@main.command()
@click.option("--dir", "data_dir", callback=path_given, default=None,
              help=f"Data directory (default: {default_dir()}): a new or empty folder, or "
                   "one kvcache made (marked by its .kvcache file).")
@click.option("--socket", "socket_path", callback=path_given, default=None,
              help="Unix socket path (default: DIR/kvcache.sock).")
@tcp_listen_options
@click.option("--tcp-admin", is_flag=True,
              help="Let TCP callers make operator calls (ls, inspect, verify, prune, pin, "
                   "unpin), which see every tenant's entries; by default only the unix "
                   "socket may.")
@click.option("--ram-dir", callback=path_given, default=None,
              help="Folder on a memory filesystem to make the RAM tier's own subfolder in "
                   "(default: /dev/shm).")
@click.option("--ram-bytes", type=SIZE, default="2G", show_default=True)
@click.option("--disk-bytes", type=SIZE, default="50G", show_default=True)
@click.option("--min-free-bytes", type=SIZE, default="1G", show_default=True,
              help="Refuse saves that would leave less free space on the disk.")
@click.option("--reclaim-high", type=click.FloatRange(0, 1, min_open=True), default=0.95,
              show_default=True,
              help="Share of each tier's budget (the disk's: or of what --min-free-bytes "
                   "leaves) above which the reclaimer gives up entries in the background, "
                   "so that saves find room made; 1: no reclaimer, saves evict themselves.")
@click.option("--reclaim-low", type=click.FloatRange(0, 1, min_open=True), default=0.90,
              show_default=True,
              help="Share of each tier's budget the reclaimer brings it down to.")
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
@click.option("--max-tenant-pin-seconds", type=PERIOD, default="1h", show_default=True,
              help="The longest expiring pin the data path may make (PinTenantEntry: a "
                   "runtime's cache_control breakpoints); Pin is the operator's.")
@click.option("--max-pinned-bytes-per-tenant", type=SIZE, default=None,
              help="Bytes one tenant's expiring pins may hold, with the entries they are "
                   "built on (default: a quarter of --disk-bytes; never more than the "
                   "tenant's disk quota).")
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
@click.option("--kv-events", "kv_events", default=None, metavar="ENDPOINT",
              help="Publish the blocks the RAM and disk tiers hold as vLLM's KV events "
                   "(ZMQ, bound at tcp://HOST:PORT), for KV-aware routers; off by default. "
                   "Subscribers read the token ids of every cached block: bind it where "
                   "only your routers reach.")
@click.option("--kv-events-replay", default=None, metavar="ENDPOINT",
              help="Answer vLLM's replay requests (a ZMQ ROUTER bound at tcp://HOST:PORT).")
@click.option("--kv-events-layout", type=click.Choice(["map", "array"]), default="map",
              show_default=True,
              help="Events as tagged maps (vLLM 0.28 on; vllm-router reads only these) or "
                   "tagged arrays (vLLM's earlier layout); Dynamo reads both.")
@click.option("--log-level", default="INFO", show_default=True)
def serve(data_dir: Path | None, socket_path: Path | None, listen: str | None,
          token_file: Path | None, tls_cert: Path | None, tls_key: Path | None,
          tls_client_ca: Path | None, insecure_tcp: bool, tcp_admin: bool,
          ram_dir: Path | None,
          ram_bytes: int, disk_bytes: int, min_free_bytes: int, reclaim_high: float,
          reclaim_low: float, block_size: int,
          max_entry_bytes: int, max_saves_per_tenant: int,
          max_reserved_bytes_per_tenant: int | None, max_tenant_pin_seconds: float,
          max_pinned_bytes_per_tenant: int | None, tenant_disk_quota: tuple[str, ...],
          tenant_ram_quota: tuple[str, ...], lease_seconds: float, pin_seconds: float, metrics_port: int | None,
          remote_url: str | None, remote_password_file: Path | None,
          remote_password_env: str | None, remote_signing_key_file: Path | None,
          remote_unsigned: bool, remote_encrypt: bool, tenant_secret_file: Path | None,
          remote_tls_ca: Path | None, remote_timeout: float, kv_events: str | None,
          kv_events_replay: str | None, kv_events_layout: str, log_level: str) -> None:
    """Run the cache daemon until SIGTERM or SIGINT."""
    from ..errors import StoreError
    from ..remote import RemoteConfig, load_signing_key
    from ..server import Daemon
    from ..store import StoreConfig
    from ..tenancy import load_secret_file

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
    events = kv_events_config(kv_events, kv_events_replay, kv_events_layout)
    try:
        tenant_secret = load_secret_file(tenant_secret_file) if tenant_secret_file else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if reclaim_low > reclaim_high:
        raise click.BadParameter(f"{reclaim_low} is above --reclaim-high {reclaim_high}",
                                 param_hint="'--reclaim-low'")
    root = (data_dir or default_dir()).expanduser().resolve()
    config = StoreConfig(root=root, ram_dir=ram_dir, ram_bytes=ram_bytes, disk_bytes=disk_bytes,
                         min_free_bytes=min_free_bytes, reclaim_low=reclaim_low,
                         reclaim_high=reclaim_high, block_size=block_size,
                         lease_seconds=lease_seconds, pin_seconds=pin_seconds,
                         max_blob_bytes=max_entry_bytes,
                         max_saves_per_tenant=max_saves_per_tenant,
                         max_reserved_bytes_per_tenant=max_reserved_bytes_per_tenant or 0,
                         max_tenant_pin_seconds=max_tenant_pin_seconds,
                         max_pinned_bytes_per_tenant=max_pinned_bytes_per_tenant or 0)
    quotas = {TIER_DISK: tenant_quotas("--tenant-disk-quota", tenant_disk_quota),
              TIER_RAM: tenant_quotas("--tenant-ram-quota", tenant_ram_quota)}
    try:
        daemon = Daemon(config, socket_path=socket_path, listen=listen,
                        metrics_port=metrics_port, auth=auth, insecure_tcp=insecure_tcp,
                        tcp_admin=tcp_admin, remote=remote, tenant_secret=tenant_secret,
                        tenant_quotas=quotas, kv_events=events)
    except (ValueError, OSError, RuntimeError, StoreError) as exc:
        raise click.ClickException(str(exc)) from None
    daemon.serve_forever()


def tenant_quotas(option: str, given: Sequence[str]) -> dict[str, int]:
    """``TENANT=SIZE`` options -> tenant name (``*``: every tenant) -> bytes; a tenant given
    twice is refused (which one was meant?)."""
    from ..store.quotas import parse_quota

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


def kv_events_config(endpoint: str | None, replay: str | None, layout: str
                     ) -> PublisherConfig | None:
    """``--kv-events*`` -> the publisher's settings (None: off); a bad endpoint is a usage
    error, refused before anything starts."""
    from ..kv_events import PublisherConfig

    if endpoint is None:
        if replay is not None:
            raise click.UsageError("--kv-events-replay needs --kv-events")
        return None
    try:
        return PublisherConfig(endpoint, replay, layout)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--kv-events'") from None
