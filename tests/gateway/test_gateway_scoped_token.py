"""Workers that reach the cache daemon over TCP with a runtime token bound to their
gateway's tenants (``tenants=alice,bob``, as README advises) lose nothing an operator's
connection gives them: a Responses continuation resumes from the whole saved state
(counted ``state``), and a cache_control ttl pins its entry in the daemon (``kvcache ls``
shows it). Both used to go through the operator's Inspect and Pin, refused to such a
token, so continuations fell back to prefix reuse and pins failed, silently.

A real daemon (TCP, a token file), a real gateway whose worker (the tiny model with a
Hermes-style template) is given the runtime token, the official ``openai`` and
``anthropic`` clients, and ``kvcache ls`` on the daemon's unix socket (the operator).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest

from kvcache.auth import ENV_TOKEN_FILE
from model_runtime.client import RuntimeClient
from tests.support.daemon_proc import DaemonProcess, tcp_address, wait_for, write_token
from tests.support.gateway_proc import (
    ALICE,
    BOB,
    OPERATOR,
    GatewayProcess,
    Gateways,
    metrics,
    model_entry,
)

INSTRUCTIONS = ("You are the dispatcher of a delivery company. Answer briefly; look things "
                "up with the tools rather than guessing. ") * 3


class Env:
    def __init__(self, gateway: GatewayProcess, daemon: DaemonProcess) -> None:
        self.gateway = gateway
        self.daemon = daemon

    def worker_counters(self) -> dict[str, int]:
        (worker,) = self.gateway.status()["workers"]
        with RuntimeClient(f"unix:{worker['socket']}", timeout=30) as runtime:
            return {k: int(v) for k, v in runtime.stats()["counters"].items()}


@pytest.fixture(scope="module")
def scoped(tmp_path_factory: pytest.TempPathFactory,
           module_daemon_factory: Callable[..., DaemonProcess]) -> tuple[DaemonProcess, Path]:
    """A daemon on TCP with tokens, and the file of the runtimes' token (scoped to the
    tenants alice and bob)."""
    tmp = tmp_path_factory.mktemp("scoped-token-daemon")
    runtime_token = secrets.token_hex(16)
    tokens = tmp / "daemon-tokens"
    tokens.write_text(f"{secrets.token_hex(16)} admin\n{runtime_token} tenants=alice,bob\n")
    tokens.chmod(0o600)
    daemon = module_daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(tokens))
    return daemon, write_token(tmp / "runtime-token", runtime_token)


@pytest.fixture(scope="module")
def env(scoped: tuple[DaemonProcess, Path], gateways: Gateways,
        tiny_hermes_model: Path) -> Env:
    daemon, token_file = scoped
    gateway = gateways.start(
        "scoped-token", models=[model_entry("hermes", tiny_hermes_model, "--n-ctx", "2048",
                                      "--n-seq-max", "2")],
        keys=f"{ALICE} alice\n{BOB} bob\n{OPERATOR} alice role=admin\n",
        cache=tcp_address(daemon), env={**os.environ, ENV_TOKEN_FILE: str(token_file)},
        admin_key=OPERATOR)
    return Env(gateway, daemon)


def test_a_continuation_resumes_from_the_whole_saved_state(env: Env) -> None:
    client = env.gateway.client(api_key=ALICE)
    first = client.responses.create(model="hermes", instructions=INSTRUCTIONS,
                                    input="Where is parcel 12?", temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model="hermes", instructions=INSTRUCTIONS,
                                     input="And parcel 13?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)
    state = first.model_extra["kvcache"]["state_tokens"]
    assert state == first.usage.input_tokens + first.usage.output_tokens - 1
    # Every token of the state is reused, exactly: its tokens were read from the daemon
    # by the worker's own token (EntryTokens), not tokenized again from the text.
    assert second.usage.input_tokens_details.cached_tokens == state
    assert 'responses_continued_total{how="state",model="hermes",tenant="alice"} 1.0' in \
        metrics(env.gateway, OPERATOR)


def cached_system(text: str, ttl: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text,
             "cache_control": {"type": "ephemeral", "ttl": ttl}}]


def listed(env: Env, tenant: str) -> list[dict[str, Any]]:
    """``kvcache ls --tenant T --json`` on the daemon's unix socket: the operator's view."""
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "ls", "--json", "--tenant",
                           tenant, "--address", env.daemon.address], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_a_cache_control_ttl_pins_its_entry(env: Env) -> None:
    before = env.worker_counters()
    client = anthropic.Anthropic(base_url=env.gateway.url, api_key=BOB, max_retries=0,
                                 timeout=60.0)
    asked = time.time()
    reply = client.messages.create(
        model="hermes", max_tokens=4, messages=[{"role": "user", "content": "Which one?"}],
        system=cached_system("You answer questions about lighthouses of Norway. " * 8, "1h"))
    held = reply.usage.cache_creation_input_tokens + reply.usage.cache_read_input_tokens
    assert reply.usage.cache_creation_input_tokens >= 64

    def pinned() -> list[dict[str, Any]]:
        return [e for e in listed(env, "bob") if e["pinned"] and e["tokens"] == held]

    wait_for(lambda: bool(pinned()), "the breakpoint's entry pinned, in kvcache ls")
    (entry,) = pinned()
    assert asked + 3600 - 5 <= entry["pin_expires"] <= time.time() + 3600  # 1h
    assert not any(e["pinned"] for e in listed(env, "alice"))  # bob's pin, not alice's
    after = env.worker_counters()
    assert after["pins_sent"] - before["pins_sent"] == 1
    assert after["pins_failed"] == before["pins_failed"] == 0
