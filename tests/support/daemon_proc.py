"""The daemon harness under the name the tests use (tools/harness/procs.py), and ``wait_for``."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from harness.procs import Daemon as DaemonProcess

__all__ = ["DaemonProcess", "wait_for"]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``predicate`` until it holds; fail the test saying what did not happen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(0.02)
