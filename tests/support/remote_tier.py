"""The shared tier seen from its daemons and from Redis: connection, the upload queue,
an entry's remote keys, and the fleet's key files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis

from kvcache import keys
from kvcache.remote.layout import Names
from tests.support.daemon_proc import DaemonProcess, wait_for

B = 16  # the daemons' block size: short prompts span several blocks (block pointers)
Host = Callable[..., DaemonProcess]  # host("a", *daemon args): a daemon of the fleet
# The key file the fleet's hosts sign with (tests/remote/conftest.py::host), and the
# names its entries take on the server (keyed by it).
FLEET_KEY = "the-fleet-signing-key-of-this-test\n"
FLEET_NAMES = Names("kvc", FLEET_KEY.rstrip().encode())


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


def entry_keys(client: redis.Redis, key: bytes, names: Names) -> set[bytes]:
    """Every remote key of one entry (record, parts, upload claim) under ``names``."""
    tagged = names.record(key).decode().removesuffix(":rec")
    return set(client.scan_iter(match=f"{tagged}:*", count=1000))


def copy_entry(client: redis.Redis, key: bytes, namespace: bytes, tokens: list[int],
               src: Names, dst: Names, block_size: int = B) -> int:
    """Copy what ``src`` names of one entry (record, parts, its block pointers) to the
    names ``dst`` gives them, as someone with write access to the server could; how many
    values were copied."""
    copied = 0
    tag = src.record(key).decode().removesuffix(":rec")
    pairs = [(name, dst.record(key).decode().removesuffix(":rec") + name.decode()[len(tag):])
             for name in entry_keys(client, key, src)]
    pairs += [(src.block(h), dst.block(h)) for h in keys.block_hashes(
        namespace, keys.tokens_to_bytes(tokens), block_size)]
    for name, to in pairs:
        value = client.get(name)
        if value is not None:
            client.set(to, value)
            copied += 1
    return copied
