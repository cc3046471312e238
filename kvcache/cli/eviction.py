"""``kvcache prune``, ``evict``, ``pin`` and ``unpin``: what leaves the cache, and what
is kept from leaving."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import click

from ..blob import SAVE_REASONS
from ..client import CacheClient, CacheError
from ..v1 import kvcache_pb2 as pb
from .group import main
from .options import (
    DURATION,
    KEYS_ARGUMENT,
    MODEL_HELP,
    SIZE,
    address_option,
    connect,
    describe_key,
    resolve_keys,
    run,
    yes_option,
)
from .render import asks_first, confirm, entries_text, entry_dict, entry_line, human_bytes, spinner

_PREVIEW_ROWS = 20  # a confirmation lists at most this many entries


def prune_data(r: pb.PruneResponse, dry_run: bool, now: float) -> dict[str, Any]:
    return {"dry_run": dry_run, "removed": [entry_dict(e, now) for e in r.removed],
            "bytes_freed": r.bytes_freed, "skipped_pinned": r.skipped_pinned,
            "skipped_in_use": r.skipped_in_use, "skipped_shared": r.skipped_shared,
            "ram_dropped": r.ram_dropped,
            "ram_bytes_freed": r.ram_bytes_freed,
            "ram_dropped_keys": [e.key.hex() for e in r.ram_dropped_entries]}


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
                run(functools.partial(action, client, key))
                click.echo(f"{done} {key.hex()}")


_pin_command("pin", "Protect entries from eviction and pruning (KEY: a full key or a unique "
                    "prefix).", CacheClient.pin, "pinned")
_pin_command("unpin", "Make pinned entries evictable again (KEY: a full key or a unique "
                      "prefix).", CacheClient.unpin, "unpinned")
