"""The fleet's fixtures for the shared tier's tests: a real redis-server of the test's own,
and daemons on it, each with its own data directory, signed with the fleet's key."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.daemon_proc import DaemonProcess
from tests.support.redis_proc import RedisServer, redis_server
from tests.support.remote_tier import FLEET_KEY, B, Host, key_file, wait_connected


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.fixture
def host(daemon_factory: Callable[..., DaemonProcess], server: RedisServer,
         tmp_path: Path) -> Host:
    """``host("a", *extra_args, url=...)``: a daemon (its own data dir) on the shared
    remote (this test's redis-server unless ``url``), connected to it; signed with the
    fleet's key unless ``extra_args`` say how (a key of their own, --remote-unsigned)."""
    fleet_key = key_file(tmp_path / "fleet-key", FLEET_KEY)

    def start(name: str, *extra: str, url: str | None = None,
              connected: bool = True) -> DaemonProcess:
        signing = [] if {"--remote-signing-key-file", "--remote-unsigned"} & set(extra) \
            else ["--remote-signing-key-file", str(fleet_key)]
        d = daemon_factory("--remote", url or server.url, "--block-size", str(B), *signing,
                           *extra, name=name)
        if connected:
            wait_connected(d)
        return d

    return start
