"""The ``kvcache`` command: run the daemon, and inspect and trim the cache while it serves.

``main`` is the command group (``group``); each command family's module adds its commands
to it when imported here. What they share: ``options`` (option types, a daemon's address,
credentials and connection, keys as operators type them) and ``render`` (humanized numbers,
tables, confirmation, progress). ``model_runtime.cli`` uses the same toolkit.
"""

from __future__ import annotations

# cli_env first: it quiets gRPC's C core before anything imports grpc.
from .. import cli_env  # noqa: F401

# isort: split
from . import entries, eviction, moved, ram_tiers, serve, stats, verify  # noqa: F401
from .group import main

__all__ = ["main"]
