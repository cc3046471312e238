"""The daemon harness under the name the tests use (tools/harness/procs.py), the daemons a
fixture starts (``started_daemons``), ``wait_for``, and a daemon's TCP listener: its
logged address and token files."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harness.procs import Daemon as DaemonProcess

__all__ = ["TOKEN", "DaemonProcess", "started_daemons", "tcp_address", "wait_for",
           "write_token"]


@contextmanager
def started_daemons(root: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """A function starting real daemons under ``root`` (``start(*serve_args, name="data")``,
    its data folder ``root / name``); every one is closed when the block ends."""
    started: list[DaemonProcess] = []

    def start(*args: str, name: str = "data") -> DaemonProcess:
        # Two daemons on one data folder would share (or fight over) one store.
        assert all(d.data_dir != root / name for d in started), f"a second daemon in {name}"
        d = DaemonProcess(root / name, *args)
        started.append(d)
        return d.start()

    try:
        yield start
    finally:
        for d in started:
            d.close()


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``predicate`` until it holds; fail the test saying what did not happen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(0.02)


TOKEN = "3f9c2a7e5b1d4c8a9e0f6b2d7a1c5e3b"
TCP_IN_LOG = re.compile(r"listening on unix:\S+ and (127\.0\.0\.1:\d+)")


def write_token(path: Path, token: str = TOKEN, mode: int = 0o600) -> Path:
    path.write_text(token + "\n")
    os.chmod(path, mode)
    return path


def tcp_address(d: DaemonProcess | Any) -> str:
    """The TCP address a daemon or runtime process logged (it may log it just after it
    starts answering health checks)."""
    wait_for(lambda: TCP_IN_LOG.search(d.log()) is not None, "the TCP address in the log")
    match = TCP_IN_LOG.search(d.log())
    assert match is not None
    return match.group(1)
