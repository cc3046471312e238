from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start real daemons: ``daemon_factory("--ram-bytes", "10M")``. All are killed after."""
    started: list[DaemonProcess] = []

    def start(*args: str, name: str = "data") -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, *args)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.close()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory()
