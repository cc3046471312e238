"""Where a request's time went, as the gateway sees it: before its worker got it (the
body read, converted, admitted and rendered), and each streamed token's way from
llama.cpp to the client's socket.

A token's way starts when ``llama_decode`` returned the scores it was sampled from (the
runtime stamps each text event with it: ``decoded_ns``, CLOCK_MONOTONIC, a clock every
process on the host shares) and ends when the gateway has handed its bytes to the
client's connection. That is the runtime's sampling and detokenizing, its gRPC message,
the gateway's parsing and formatting, and the write: everything this project adds to
llama.cpp per token.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvcache.metrics import percentile

__all__ = ["TokenPath"]

# A stamp further back than this is not this host's clock (a worker elsewhere): ignored.
MAX_PLAUSIBLE_NS = 60 * 10**9


class TokenPath:
    """The milliseconds each streamed token took from llama.cpp to the socket."""

    def __init__(self) -> None:
        self.ms: list[float] = []

    def passed(self, decoded_ns: int, written_ns: int) -> None:
        """Record a token written at ``written_ns`` whose scores were ready at
        ``decoded_ns`` (nothing when it carries no usable stamp)."""
        way = written_ns - decoded_ns
        if decoded_ns > 0 and 0 <= way < MAX_PLAUSIBLE_NS:
            self.ms.append(way / 1e6)

    def summary(self) -> dict[str, Any] | None:
        """Median, p99 and largest way in ms and how many messages were measured (one
        message may carry several tokens that were ready at once); None: none was."""
        if not self.ms:
            return None
        return {"p50": round(statistics.median(self.ms), 3),
                "p99": round(percentile(sorted(self.ms), 99), 3),
                "max": round(max(self.ms), 3), "messages": len(self.ms)}
