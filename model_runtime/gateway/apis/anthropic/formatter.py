"""Anthropic's Messages API answers: the message body, usage with its cache fields,
``stop_reason``, the streamed events (:class:`BlockStream` turns the chat front end's
parsed deltas into content blocks), its error shape, and :class:`MessagesFormatter`, a
request's answer from the worker's events. Pure: the pipeline writes what these make.
"""

from __future__ import annotations

import json
from typing import Any

from ....chat.parsing import ContentDelta, Delta, ParsedOutput, ReasoningDelta, ToolCallDelta
from ....chat.prompt import PromptPlan
from ....v1 import runtime_pb2 as pb
from ...errors import ApiError
from ...pipeline.contract import Formatter, kvcache_details
from ...pipeline.request import served_text
from .adapter import MessagesRequest, error_body

__all__ = ["BlockStream", "MessagesFormatter", "event", "input_usage", "message_body",
           "message_start", "stop_reason", "usage"]


def input_usage(record: pb.PromptDone | pb.Completion, breakpoints: bool) -> dict[str, int]:
    """The input side of Anthropic's usage, from the runtime's account of the prompt
    (its PromptDone, or the final record, which repeats it). ``cache_read_input_tokens``:
    prompt tokens served from a saved state or a live sequence;
    ``cache_creation_input_tokens``: with cache_control, the tokens up to the farthest
    breakpoint this request computed and saved (its ``cold`` saves, which with
    breakpoints are taken at them only, during the prefill); ``input_tokens``: the rest.
    The three add up to the prompt. ``breakpoints``: the prompt had a place for the
    request's cache_control breakpoints (they were sent as save boundaries)."""
    read = min(record.cache_delta.tokens_read, record.prompt_tokens)
    created = 0
    if breakpoints:
        saved = max((s.tokens for s in record.saves if s.reason == "cold"), default=0)
        created = max(0, min(saved, record.prompt_tokens) - read)
    return {"input_tokens": record.prompt_tokens - read - created,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read}


def usage(done: pb.Completion, breakpoints: bool) -> dict[str, Any]:
    """Anthropic's usage: the input side (:func:`input_usage`) and the output tokens."""
    return {**input_usage(done, breakpoints), "output_tokens": len(done.tokens),
            "service_tier": "standard"}


def stop_reason(done: pb.Completion, tool_calls: bool) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` (the string that ended the text, if one did)."""
    if done.finish_reason == "length":
        return "max_tokens", None
    if tool_calls:
        return "tool_use", None
    if done.stop_sequence:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is (grammar-constrained
    calls are JSON objects; anything else is kept under ``arguments``)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(out: ParsedOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not (out.tool_calls or out.reasoning):
        blocks.append({"type": "text", "text": out.content})
    for call in out.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": _tool_input(call.arguments)})
    return blocks


def message_body(mreq: MessagesRequest, out: ParsedOutput, done: pb.Completion,
                 extra: dict[str, Any], breakpoints: bool) -> dict[str, Any]:
    reason, sequence = stop_reason(done, bool(out.tool_calls))
    return {"id": mreq.id, "type": "message", "role": "assistant",
            "model": mreq.request.model, "content": content_blocks(out),
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(done, breakpoints), "kvcache": extra}


def message_start(mreq: MessagesRequest, prompt: pb.PromptDone | pb.Completion,
                  breakpoints: bool) -> dict[str, Any]:
    """The first event's message: no content yet, and usage's input side as Anthropic
    sends it there (``prompt``: the runtime's account of the prompt); message_delta
    repeats it with the output tokens."""
    return {"type": "message_start", "message": {
        "id": mreq.id, "type": "message", "role": "assistant", "model": mreq.request.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**input_usage(prompt, breakpoints), "output_tokens": 0,
                  "service_tier": "standard"}}}


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class BlockStream:
    """Parsed deltas in, Anthropic's content block events out: a block starts when the
    kind of output changes (thinking, text, a new tool call) and stops before the next."""

    def __init__(self) -> None:
        self.index = -1
        self.kind = ""  # the open block's type ("": none)
        self.tool_calls = 0

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self.stop()
        self.index += 1
        self.kind = block["type"]
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": self.index,
                                                  "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def feed(self, delta: Delta) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if isinstance(delta, ContentDelta):
            if not delta.text:
                return []
            if self.kind != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.text}))
        elif isinstance(delta, ReasoningDelta):
            if not delta.text:
                return []
            if self.kind != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.text}))
        else:
            assert isinstance(delta, ToolCallDelta)
            if delta.id:  # a call's first delta names it
                self.tool_calls += 1
                events += self._start({"type": "tool_use", "id": delta.id,
                                       "name": delta.name, "input": {}})
            if delta.arguments:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": delta.arguments}))
        return events

    def stop(self) -> list[tuple[str, dict[str, Any]]]:
        """The open block's end, if one is open."""
        if not self.kind:
            return []
        self.kind = ""
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """The last block's end; a reply with no output at all still gets its (empty)
        text block, as Anthropic's do."""
        if self.index < 0:
            return self._start({"type": "text", "text": ""}) + self.stop()
        return self.stop()


class MessagesFormatter(Formatter):
    """A message's answer: its text parsed into thinking, text and tool_use blocks as it
    comes; streamed, Anthropic's events: message_start (the input side of usage, held
    until the first token), ping, each content block's start, deltas and stop,
    message_delta (stop_reason, usage), message_stop."""

    def __init__(self, call: MessagesRequest, plan: PromptPlan | None, worker: str,
                 tenant: str) -> None:
        super().__init__(call.request.stream)
        assert plan is not None  # a chat, always
        self.call = call
        self.worker = worker
        self.tenant = tenant
        self.parser = plan.parser()
        self.blocks = BlockStream()
        self.breakpoints = bool(call.request.breakpoint_ttls and plan.boundaries)

    def opening(self, prompt: pb.PromptDone | pb.Completion) -> bytes:
        return event("message_start", message_start(self.call, prompt, self.breakpoints)) + \
            event("ping", {"type": "ping"})

    def text(self, item: pb.CompleteEvent) -> bytes:
        deltas = self.parser.feed(item.text)
        if not self.stream:
            return b""
        return b"".join(event(name, data) for delta in deltas
                        for name, data in self.blocks.feed(delta))

    def finish(self, finished: list[pb.Completion]) -> tuple[dict[str, Any], bytes]:
        (done,) = finished
        closing = self.parser.close()
        extra = kvcache_details(done, self.worker, self.tenant, self.gateway)
        if not self.stream:
            return message_body(self.call, self.parser.output, done, extra,
                                self.breakpoints), b""
        out = [e for d in closing for e in self.blocks.feed(d)] + self.blocks.finish()
        reason, sequence = stop_reason(done, bool(self.parser.output.tool_calls))
        out.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(done, self.breakpoints), "kvcache": extra}))
        out.append(("message_stop", {"type": "message_stop"}))
        return {}, b"".join(event(name, data) for name, data in out)

    def error(self, err: ApiError) -> bytes:
        return event("error", error_body(err)[1])

    def served(self) -> str:
        out = self.parser.output
        return served_text(out.content, [(c.name, c.arguments) for c in out.tool_calls])
