"""Slots and cache-aware routing among the workers of one model.

Each worker's runtime keeps the KV of its recent sequences live and reuses it in place for
a prompt that extends one of them. The gateway cannot see those sequences, but it saw
every prompt and reply it sent there: it keeps, per worker, the recent ones (bounded) and
sends a request to the worker whose texts share the longest prefix with it, then to the
least loaded. A conversation thus stays where its state is. Elsewhere it would still be
warm from the shared daemon, so this is a preference, never a reason to wait.

Workers serve every tenant, and a runtime reuses a live sequence only for the tenant
whose request filled it: the texts tracked are each tenant's own (:func:`tenant_text`), so
one tenant's prompt never draws another's identical prompt to its worker.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol, TypeVar

# A shared prefix shorter than this (a role name, a chat template's opening) says nothing
# about where a conversation lives: it counts as none.
MIN_ROUTE_CHARS = 32
MAX_SESSIONS = 10_000


def tenant_text(tenant: str, text: str) -> str:
    """What routing tracks and compares of a request: its text, under its tenant (a
    tenant's name holds no NUL, so two tenants' texts share no prefix)."""
    return f"{tenant}\x00{text}"


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on slice comparisons (C speed
    on long texts)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTracker:
    """The recent texts one worker served, newest last, within a bound on count and size."""

    def __init__(self, max_entries: int = 16, max_chars: int = 256_000) -> None:
        self.max_chars = max_chars
        self._texts: deque[str] = deque(maxlen=max_entries)

    def add(self, text: str) -> None:
        self._texts.append(text[:self.max_chars])

    def longest(self, text: str) -> int:
        return max((common_prefix_len(t, text) for t in self._texts), default=0)

    def clear(self) -> None:
        self._texts.clear()


class Routable(Protocol):
    name: str
    tracker: PrefixTracker

    @property
    def ready(self) -> bool: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def served(self) -> int: ...


W = TypeVar("W", bound=Routable)


class NoFreeSlot(Exception):
    """Every ready worker of the model is busy."""


class NoReadyWorker(Exception):
    """No worker of the model is serving (starting, restarting, or given up)."""


class SessionMap:
    """Which worker a session id last ran on (its runtime pins the session's sequence
    there), least recently used dropped first beyond ``size``."""

    def __init__(self, size: int = MAX_SESSIONS) -> None:
        self.size = size
        self._owner: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        owner = self._owner.get(session)
        if owner is not None:
            self._owner.move_to_end(session)
        return owner

    def set(self, session: str, worker: str) -> None:
        self._owner[session] = worker
        self._owner.move_to_end(session)
        while len(self._owner) > self.size:
            self._owner.popitem(last=False)


def choose(workers: Sequence[W], text: str, session_owner: str | None = None,
           slots: int = 1) -> W:
    """The worker for a request (needing ``slots`` free slots: one per choice): its
    session's worker if that one has the slots free, else
    the longest tracked prefix, then the fewest requests in flight, then the fewest
    served (so that new conversations spread over the workers). Raises
    :class:`NoReadyWorker` or :class:`NoFreeSlot`."""
    ready = [w for w in workers if w.ready]
    if not ready:
        raise NoReadyWorker()
    free = [w for w in ready if w.free_slots >= slots]
    if not free:
        raise NoFreeSlot()
    for w in free:
        if w.name == session_owner:
            return w

    def score(w: W) -> tuple[int, int, int]:
        shared = w.tracker.longest(text)
        return (shared if shared >= MIN_ROUTE_CHARS else 0, -w.in_flight, -w.served)

    return max(free, key=score)  # the first of equals: stable for tests and operators
