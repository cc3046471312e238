"""``kvcache ram-tiers``: RAM-tier folders and their data directories; orphans removed."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from .group import main
from .options import path_given, yes_option
from .render import asks_first, confirm, human_bytes, print_plain, text_row

if TYPE_CHECKING:
    from ..store.ramtier import TierInfo


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
              callback=lambda ctx, param, values: [path_given(ctx, param, v) for v in values],
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
    from ..store.ramtier import SHM, find_tiers, remove_orphan

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
