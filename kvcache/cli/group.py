"""The ``kvcache`` command group; each command family's module adds its commands to it."""

from __future__ import annotations

import click

from .. import __version__


@click.group()
@click.version_option(__version__, prog_name="kvcache")
def main() -> None:
    """kvcache: a prefix KV-cache daemon for llama.cpp models."""
