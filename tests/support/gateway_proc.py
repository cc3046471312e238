"""Helpers for the gateway tests (no tests here): ``model-runtime gateway`` as a real
process (tools/harness/procs.py), its workers real ``model-runtime serve`` processes."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from harness.procs import Gateway as GatewayProcess

__all__ = ["ALICE", "BOB", "OPERATOR", "SYSTEM", "GatewayProcess", "chat", "kill_leftovers",
           "metrics", "process_gone", "wait_gone"]


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
