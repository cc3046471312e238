"""Process settings the ``kvcache`` commands make before gRPC is loaded.

gRPC's C core writes log lines of its own to stderr (TLS set-up, connection errors:
``E0000 ... ssl_transport_security.cc:1517] ...``), beside the command's own one-line
message. It reads its verbosity once, when ``grpc`` is imported, so ``kvcache.cli``
imports this module before anything that imports grpc.

Rules: a user who sets ``GRPC_VERBOSITY`` or ``GRPC_TRACE`` gets what they asked for; the
daemon (``serve``) keeps gRPC's logging, which belongs in its log.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

QUIET = "NONE"


def quiet_grpc_core(argv: Sequence[str]) -> None:
    if list(argv[1:2]) == ["serve"] or "GRPC_TRACE" in os.environ:
        return
    os.environ.setdefault("GRPC_VERBOSITY", QUIET)


quiet_grpc_core(sys.argv)
