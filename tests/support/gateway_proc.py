"""Helpers for the gateway tests (no tests here): ``model-runtime gateway`` as a real
process (tools/harness/procs.py), its workers real ``model-runtime serve`` processes, and
:class:`Gateways`, the factory behind the ``gateways`` fixture (tests/gateway/conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness.procs import Gateway as GatewayProcess

from tests.support.daemon_proc import DaemonProcess

__all__ = ["ALICE", "BOB", "OPERATOR", "OWN_DAEMON", "SYSTEM", "GatewayProcess", "Gateways",
           "chat", "kill_leftovers", "metrics", "model_entry", "process_gone", "wait_gone"]


def process_gone(pid: int) -> bool:
    """Gone or a zombie (dead, waiting to be reaped by whoever adopted it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2:].split()[0] in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(process_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_leftovers(pids: list[int]) -> None:
    """Last resort in a failing test: no worker may outlive it."""
    for pid in pids:
        if not process_gone(pid):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


SYSTEM = ("You are the terse assistant of a hardware shop. Answer in one sentence, name the "
          "aisle, and never invent a product. ") * 6
# API keys of the key files the gateway tests write: two tenants and an operator.
ALICE = "alice-0123456789abcdef0123456789"
BOB = "bob-0123456789abcdef0123456789ab"
OPERATOR = "op-0123456789abcdef0123456789abc"


def metrics(gw: GatewayProcess, key: str) -> str:
    code, _, body = gw.http("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    assert code == 200
    return body.decode()


# --------------------------------------------------------------------------- the factory


OWN_DAEMON = "own"  # ``cache``: a daemon of the gateway's own (the default)


def model_entry(name: str, path: Path, *args: str, workers: int = 1) -> dict[str, Any]:
    """One model of a gateway's config file: ``args`` go to each of its workers."""
    return {"name": name, "path": str(path), "workers": workers, "args": list(args)}


@dataclass
class _Started:
    gateway: GatewayProcess
    folder: Path
    daemon: DaemonProcess | None  # its own, closed with it
    clean_stop: bool
    pids: list[int] = field(default_factory=list)


class Gateways:
    """Starts gateways for a module; :meth:`close` stops them all."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self._started: list[_Started] = []

    def start(self, name: str, *, models: Sequence[dict[str, Any]] = (),
              args: Sequence[str] = (), keys: str | None = None,
              cache: DaemonProcess | str = OWN_DAEMON, admin_key: str | None = None,
              env: dict[str, str] | None = None, clean_stop: bool = True,
              workers_ready: bool = True,
              supervision: dict[str, Any] | None = None) -> GatewayProcess:
        """A gateway serving ``models`` (config-file entries, :func:`model_entry`) and/or what
        ``args`` say (``--model``, ...). ``keys``: the text of its API key file.
        ``cache``: its own new daemon, a running daemon, an address, or "none".
        ``admin_key``: an operator's key of the key file (for /status). ``supervision``:
        the config file's section. Stored responses go to its own folder (:meth:`folder`).
        ``workers_ready`` False: returns once it listens (its workers' pids are then told
        with :meth:`worker_pids`)."""
        tmp = self.tmp_path_factory.mktemp(name)
        own = DaemonProcess(tmp / "data").start() if cache == OWN_DAEMON else None
        address = own.address if own is not None else \
            cache.address if isinstance(cache, DaemonProcess) else cache
        extra = ["--responses-dir", str(tmp / "responses")]
        if models:
            config = tmp / "gateway.json"
            config.write_text(json.dumps({"models": list(models),
                                          **({"supervision": supervision} if supervision
                                             else {})}))
            extra += ["--config", str(config)]
        if keys is not None:
            key_file = tmp / "api-keys"
            key_file.write_text(keys)
            key_file.chmod(0o600)
            extra += ["--api-keys", str(key_file)]
        gateway = GatewayProcess(tmp / "gateway.log", *extra, *args, cache=str(address),
                                 env=env, admin_key=admin_key)
        started = _Started(gateway, tmp, own, clean_stop)
        self._started.append(started)
        gateway.start(workers_ready=workers_ready)
        if workers_ready:
            started.pids = self._pids(started)
        return gateway

    def _of(self, gateway: GatewayProcess) -> _Started:
        (started,) = [s for s in self._started if s.gateway is gateway]
        return started

    def daemon(self, gateway: GatewayProcess) -> DaemonProcess:
        """The daemon a gateway of :meth:`start` was given of its own."""
        own = self._of(gateway).daemon
        assert own is not None, "this gateway was not given a daemon of its own"
        return own

    def folder(self, gateway: GatewayProcess) -> Path:
        """The gateway's own folder (its log, config, key file, ``responses``)."""
        return self._of(gateway).folder

    def worker_pids(self, gateway: GatewayProcess, pids: list[int]) -> None:
        """Worker processes a test learned of another way (over TLS, say), to be watched
        at the end as :meth:`start`'s are."""
        self._of(gateway).pids = list(pids)

    @staticmethod
    def _pids(started: _Started) -> list[int]:
        try:
            return [w["pid"] for w in started.gateway.status()["workers"] if w["pid"]]
        except (OSError, ValueError):
            return started.pids  # (it does not answer: those it had)

    def close(self) -> None:
        """Stop every gateway (the last started first), then their daemons. A gateway
        that should stop cleanly and did not fails the module's last test."""
        problems = []
        for started in reversed(self._started):
            gateway = started.gateway
            pids = self._pids(started) if gateway.running else started.pids
            try:
                if started.clean_stop and gateway.running:
                    code = gateway.stop()
                    if code != 0:
                        problems.append(f"gateway exited {code}: {gateway.log()[-3000:]}")
                    if not wait_gone(pids):
                        problems.append(f"workers {pids} outlived the gateway")
                gateway.close()
                wait_gone(pids)
            finally:
                kill_leftovers(pids)
                if started.daemon is not None:
                    started.daemon.close()
        self._started.clear()
        assert not problems, "\n".join(problems)
