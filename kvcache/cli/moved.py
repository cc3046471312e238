"""Commands that need a model are ``model-runtime``'s; their old ``kvcache`` spellings
run the new ones."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from typing import NoReturn

import click

from .group import main
from .options import AUTH_OPTIONS

# -- commands that need a model -------------------------------------------------------------
# They are model-runtime's (`model-runtime warm`, `model-runtime inspect`): the daemon's package
# never imports the runtime (tests/unit/test_layering.py). The old spellings run the new commands.

RUNTIME_SCRIPT = "model-runtime"


def runtime_script() -> str | None:
    """The model-runtime command installed beside this interpreter's, or else on PATH."""
    return (shutil.which(RUNTIME_SCRIPT, path=sysconfig.get_path("scripts"))
            or shutil.which(RUNTIME_SCRIPT))


def connection_args(address: str | None) -> list[str]:
    """--address and the credentials given (options or environment), as arguments again."""
    meta = click.get_current_context().meta
    args = ["--address", address] if address else []
    for name, _, _ in AUTH_OPTIONS:
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
