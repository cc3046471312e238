"""Bounded buffers of recent lines: a worker's log and its restart history."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    at: float  # wall-clock time, seconds since the epoch
    text: str


class LogRing:
    """The last ``size`` lines; older ones are dropped, so memory stays bounded however
    long a worker runs or however much it logs."""

    MAX_LINE = 2000  # characters kept of one line

    def __init__(self, size: int) -> None:
        self._lines: deque[Line] = deque(maxlen=max(1, size))

    def add(self, text: str) -> None:
        self._lines.append(Line(time.time(), text[:self.MAX_LINE]))

    def lines(self) -> list[Line]:
        return list(self._lines)

    def tail(self, n: int) -> list[str]:
        return [line.text for line in list(self._lines)[-n:]]

    def __len__(self) -> int:
        return len(self._lines)

    def as_json(self) -> list[dict[str, object]]:
        return [{"at": round(line.at, 3), "text": line.text} for line in self._lines]
