"""End to end on the real default model (SmolLM2-135M-Instruct): the gateway started with
no --model, OpenAI's client, a real daemon. Slow: run with ``pytest -m slow``."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.system_prompt import build_system_prompt

from model_runtime.client import RuntimeClient
from tests.support.daemon_proc import DaemonProcess
from tests.support.gateway_proc import GatewayProcess, chat, kill_leftovers

pytestmark = pytest.mark.slow


def test_smollm2_through_the_gateway(tmp_path: Path) -> None:
    # tools/setup.sh installs the model: its absence is a failure, not a skip (the
    # gateway, given no --model, says so when it starts).
    daemon = DaemonProcess(tmp_path / "data").start()
    gateway = GatewayProcess(tmp_path / "gateway.log", "--n-ctx", "2048", "--n-seq-max", "2",
                             cache=daemon.address)
    pids: list[int] = []
    try:
        gateway.start(timeout=300)
        pids = [w["pid"] for w in gateway.status()["workers"]]
        client = gateway.client(timeout=300)
        (model,) = [m.id for m in client.models.list()]
        assert model.startswith("SmolLM2")
        system = build_system_prompt(300)
        first = client.chat.completions.create(
            model=model, messages=chat(system, "What is the warranty of the Atlas Notebook?"),
            max_tokens=24, temperature=0)
        assert first.choices[0].message.content.strip()
        question = chat(system, "How do I get a refund?")
        second = client.chat.completions.create(model=model, messages=question,
                                                max_tokens=24, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 300
        streamed = client.chat.completions.create(model=model, messages=question,
                                                  max_tokens=24, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == second.choices[0].message.content
        socket = gateway.status()["workers"][0]["socket"]
        with RuntimeClient(f"unix:{socket}", timeout=300) as direct:
            own = direct.complete(messages=question, max_tokens=24, temperature=0)
        assert own["text"] == second.choices[0].message.content
    finally:
        gateway.close()
        kill_leftovers(pids)
        daemon.close()
