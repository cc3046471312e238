"""``kvcache stats``: a summary of the cache, every counter and latency percentiles."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from ..client import TIER_NAMES
from ..v1 import kvcache_pb2 as pb
from .group import main
from .options import address_option, connect, run
from .render import (
    echo_fields,
    human_age,
    human_bytes,
    human_count,
    plain_table,
    print_plain,
    text_row,
)


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
        "recovery": {"state": s.recovery.state or "none", "entries": s.recovery.entries,
                     "entries_checked": s.recovery.entries_checked,
                     "folders_checked": s.recovery.folders_checked,
                     "seconds": round(s.recovery.seconds, 3),
                     "checked_on_read": s.recovery.checked_on_read},
        "counters": dict(sorted(s.counters.items())),
        "latencies": {name: {"count": v.count, "window": v.window, "p50_ms": v.p50_ms,
                             "p90_ms": v.p90_ms, "p99_ms": v.p99_ms}
                      for name, v in sorted(s.latencies.items())},
    }


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


def recovery_text(r: dict[str, Any], counters: dict[str, int]) -> str | None:
    """The check after a crash in one line (None after a clean start)."""
    if r["state"] in ("none", ""):
        return None
    fixed = (f"{human_count(counters.get('reconcile_removed', 0))} rows dropped, "
             f"{human_count(counters.get('reconcile_added', 0))} blobs re-indexed")
    if r["state"] == "running":
        share = r["folders_checked"] / 256
        return (f"checking index and files after a crash: {100 * share:.0f}% "
                f"({human_count(r['entries_checked'])} of {human_count(r['entries'])} "
                f"entries, {r['folders_checked']} of 256 folders, {r['seconds']:.0f} s); "
                f"{fixed} so far; an entry read before its turn is checked first "
                f"({human_count(r['checked_on_read'])} so far)")
    if r["state"] == "failed":
        return (f"the check after a crash FAILED after {r['seconds']:.0f} s (see the "
                "daemon's log); entries not reached are checked as they are read")
    return (f"after a crash: {human_count(r['entries_checked'])} entries checked in "
            f"{r['seconds']:.1f} s while serving; {fixed}")


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
    recovery = recovery_text(d["recovery"], d["counters"])
    if recovery:
        rows.append(("recovery", recovery))
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
    from ..counters import REMOTE_SECTION, SECTIONS

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
