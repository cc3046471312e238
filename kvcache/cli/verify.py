"""``kvcache verify``: check blobs' checksums, quarantining bad ones."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.progress import Progress

from .group import main
from .options import KEY, address_option, connect, resolve_keys, run
from .render import stderr_console


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
    from ..store import NO_SUCH_ENTRY

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
