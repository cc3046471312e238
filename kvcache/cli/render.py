"""How the commands show things: humanized numbers, tables, fields, confirmation
and progress on a terminal."""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import click
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..client import TIER_NAMES
from ..v1 import kvcache_pb2 as pb


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


def asks_first(yes: bool) -> bool:
    """A destructive command shows its plan and asks only on a terminal without --yes."""
    return not yes and sys.stdin.isatty()


def entries_text(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


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
    text = io.StringIO()
    # (rich types its color_system property str | None; it returns one of the names
    # Console takes: "standard", "256" or "truecolor")
    buffer = Console(file=text, width=width or out.width, force_terminal=out.is_terminal,
                     color_system=out.color_system)  # type: ignore[arg-type]
    buffer.print(renderable)
    click.echo("\n".join(line.rstrip() for line in text.getvalue().splitlines()))


def text_row(table: Table, *cells: str) -> None:
    """Cells as text, never as rich markup (a model name or path may hold brackets)."""
    table.add_row(*(Text(c) for c in cells))


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
