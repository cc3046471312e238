"""The shared tier seen from its daemons and from Redis: connection, the upload queue,
an entry's remote keys, and the fleet's key files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis

from tests.support.daemon_proc import DaemonProcess, wait_for

B = 16  # the daemons' block size: short prompts span several blocks (block pointers)
Host = Callable[..., DaemonProcess]  # host("a", *daemon args): a daemon of the fleet


def counters(d: DaemonProcess) -> dict[str, int]:
    with d.client() as c:
        return dict(c.stats().counters)


def remote_state(d: DaemonProcess) -> tuple[bool, int]:
    """(connected, upload queue depth) as the daemon's Stats reports them."""
    with d.client() as c:
        s = c.stats()
    assert s.HasField("remote")
    return s.remote.connected, s.remote.queue_depth


def wait_connected(d: DaemonProcess, timeout: float = 15.0) -> None:
    wait_for(lambda: remote_state(d)[0], "the daemon connected to the remote", timeout)


def wait_uploads(d: DaemonProcess, outcomes: int, timeout: float = 15.0) -> dict[str, int]:
    """Wait until ``outcomes`` uploads of the daemon are done (stored or skipped) and its
    queue is empty; its counters then."""
    def done() -> bool:
        c = counters(d)
        ended = c["remote_puts"] + c["remote_put_skipped_present"] + \
            c["remote_put_skipped_in_flight"]
        return ended >= outcomes and remote_state(d)[1] == 0
    wait_for(done, f"{outcomes} uploads done", timeout)
    return counters(d)


def key_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def entry_keys(client: redis.Redis, key: bytes) -> set[bytes]:
    """Every remote key of one entry (record, parts, upload claim)."""
    return set(client.scan_iter(match=f"kvc:{{{key.hex()}}}:*", count=1000))
