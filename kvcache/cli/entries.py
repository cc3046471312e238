"""``kvcache ls`` and ``kvcache inspect``: the entries, and one entry in full."""

from __future__ import annotations

import itertools
import json
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from ..blob import SAVE_REASONS
from ..client import TIER_NAMES
from ..v1 import kvcache_pb2 as pb
from .group import main
from .moved import connection_args, hand_over
from .options import KEY, MODEL_HELP, U32, F, address_option, connect, resolve_key, run
from .render import (
    ColumnStream,
    echo_fields,
    entries_text,
    entry_dict,
    human_age,
    human_bytes,
    human_count,
    local_time,
)

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
