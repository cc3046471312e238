"""The gateway's helper process for large requests (model_runtime/gateway/pipeline/offload.py), a
real spawned process: it parses and renders as the gateway's own process does, answers
refusals as the same errors, stops rendering for a caller gone, and is started again when
it died.

The scenario runs in a Python process of its own, as the gateway does: multiprocessing's
resource tracker, which a spawned pool starts, then ends with it (not with the test run).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from harness.make_tiny_gguf import CHATML_TEMPLATE
from harness.procs import pythonpath_env

from model_runtime.chat.formats import detect_format
from model_runtime.chat.templates import ChatTemplate
from model_runtime.gateway.apis.openai.adapter import OpenAICall, parse_chat, parse_request
from model_runtime.gateway.errors import ApiError
from model_runtime.gateway.limits import Limits
from model_runtime.gateway.pipeline.offload import Offload
from model_runtime.gateway.pipeline.prompt import render_plan
from model_runtime.gateway.pipeline.request import GenRequest
from model_runtime.gateway.workers.process import TemplateSpec

SPEC = TemplateSpec(CHATML_TEMPLATE, "", "<|im_end|>", False)


def chat_request(n: int) -> GenRequest:
    return parse_chat({"model": "m", "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
        for i in range(n)]}, None).request


def in_process(req: GenRequest) -> Any:
    return render_plan(req, ChatTemplate(SPEC.source, bos_token=SPEC.bos, eos_token=SPEC.eos,
                                         add_bos=SPEC.add_bos), detect_format(SPEC.source))


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (user and system)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def least_cpu(pid: int, job: Callable[[], Awaitable[Any]]) -> float:
    """The least CPU time the helper spends while ``job()`` runs, of three tries."""
    spent = []
    for _ in range(3):
        before = cpu_seconds(pid)
        await job()
        spent.append(cpu_seconds(pid) - before)
    return min(spent)


def received(req: GenRequest) -> bool:
    """A job that only receives a request (the helper imports it from this script)."""
    return True


async def scenario() -> None:
    offload = Offload()
    try:
        await offload.start()
        req = chat_request(40)
        assert (await offload.render(SPEC, req)).text == in_process(req).text
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 2}).encode()
        there = await offload.parse(parse_request, body, Limits(), "chat", "sid")
        here = parse_request(body, Limits(), "chat", "sid")
        assert there[:2] == here[:2] == (True, "m")
        assert isinstance(there[2], OpenAICall) and isinstance(here[2], OpenAICall)
        # (Each request gets its own id and creation time.)
        assert replace(there[2], id="x", created=0) == replace(here[2], id="x", created=0)
        # Refusals come back as the same errors, with whether the body was JSON at all.
        is_json, model, refused = await offload.parse(
            parse_request, b'{"model": "m", "messages": 3}', Limits(), "chat", None)
        assert is_json and model == "m" and isinstance(refused, ApiError)
        assert (refused.status, refused.param) == (400, "messages")
        is_json, _, refused = await offload.parse(parse_request, b'{"mod', Limits(), "chat",
                                                  None)
        assert not is_json and isinstance(refused, ApiError) and refused.status == 400

        # A long rendering whose caller goes away: the helper stops rendering it. Measured
        # in the helper's CPU time, which a loaded machine does not stretch as it does the
        # wall clock, less what receiving the request costs it (unpickling the messages,
        # about as much as rendering them); each the least of three tries, as the
        # helper's garbage collections come and go: the cancelled job renders less than
        # half of what a whole rendering does.
        (helper,) = multiprocessing.active_children()
        long = chat_request(100_000)

        async def cancelled_at_once() -> None:
            task = asyncio.create_task(offload.render(SPEC, long))
            await asyncio.sleep(0.01)
            task.cancel()
            await offload.start()  # a job queued behind the cancelled one

        receiving = await least_cpu(helper.pid, lambda: offload.parse(received, long))
        rendering = await least_cpu(helper.pid, lambda: offload.render(SPEC, long)) - receiving
        cancelled = await least_cpu(helper.pid, cancelled_at_once) - receiving
        assert cancelled < rendering / 2, (cancelled, rendering)

        # The helper killed (out of memory, say): the next job starts another and is done.
        os.kill(helper.pid, signal.SIGKILL)
        helper.join(10)
        assert (await offload.render(SPEC, req)).text == in_process(req).text
        (again,) = multiprocessing.active_children()
        assert again.pid != helper.pid
    finally:
        offload.close()


def test_the_helper_parses_and_renders_as_the_gateway_and_stops_for_a_caller_gone() -> None:
    done = subprocess.run([sys.executable, __file__], env=pythonpath_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


if __name__ == "__main__":
    asyncio.run(scenario())
