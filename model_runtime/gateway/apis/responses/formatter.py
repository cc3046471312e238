"""The Responses API's answers: the response object, its output items (``reasoning``,
``message``, ``function_call``), usage, and the streamed events, each numbered
(``sequence_number``). One builder serves both: it turns the parsed output's deltas into
items and the events that announce them, and a request that does not stream drops the
events. :class:`ResponsesFormatter` is a request's answer from the worker's events. Pure:
the pipeline writes what these make.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ....chat.parsing import ContentDelta, Delta, ReasoningDelta, ToolCallDelta
from ....chat.prompt import PromptPlan
from ....v1 import runtime_pb2 as pb
from ...errors import ApiError
from ...pipeline.contract import Formatter, kvcache_details
from ...pipeline.request import served_text
from .adapter import ResponsesCall, ResponsesRequest, new_id

__all__ = ["ResponseBuilder", "ResponsesFormatter", "reply_messages",
           "responses_usage", "sse_event", "state_tokens"]


def responses_usage(done: pb.Completion, output_tokens: int,
                    reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's usage: ``cached_tokens`` are the prompt's tokens not computed
    again (restored from the cache or reused live)."""
    cached = min(done.cache_delta.tokens_read, done.prompt_tokens)
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": done.prompt_tokens + output_tokens}


def sse_event(event: dict[str, Any]) -> bytes:
    return (f"event: {event['type']}\n"
            f"data: {json.dumps(event, ensure_ascii=False)}\n\n").encode()


def reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation renders: one
    assistant turn (its reasoning, text and calls)."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            turn["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [turn]


class ResponseBuilder:
    """One response as it is answered: deltas in, items and events out."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> item
        self.reasoning_tokens = 0

    # -- the response object ----------------------------------------------------------------

    def body(self, status: str, usage: dict[str, Any] | None = None,
             incomplete: str | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": req.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": req.model, "output": list(self.output),
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": None,
            "service_tier": "default", "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": req.text_format, "verbosity": "medium"},
            "tool_choice": req.tool_choice, "tools": req.tools, "top_logprobs": 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        body = self.body("in_progress")
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]

    # -- items ------------------------------------------------------------------------------

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if isinstance(delta, ReasoningDelta):
                events += self._text("reasoning", delta.text)
            elif isinstance(delta, ContentDelta):
                events += self._text("message", delta.text)
            elif isinstance(delta, ToolCallDelta):
                events += self._call(delta)
        return events

    def count_token(self, deltas: list[Delta]) -> None:
        """A generated token whose text was reasoning counts as a reasoning token."""
        held = not deltas and self._open is not None and self._open["type"] == "reasoning"
        if held or (deltas and all(isinstance(d, ReasoningDelta) for d in deltas)):
            self.reasoning_tokens += 1

    def _index(self, item: dict[str, Any]) -> int:
        return self.output.index(item)

    def _begin(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._end()
        self.output.append(item)
        self._open = item
        events.append(self.event("response.output_item.added",
                                 output_index=self._index(item), item=dict(item)))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != kind:
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                        "content": [], "status": "in_progress"}
            else:
                item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}
            events += self._begin(item)
            part: dict[str, Any] = {
                "type": "reasoning_text" if kind == "reasoning" else "output_text", "text": ""}
            if kind == "message":
                part["annotations"] = []
                part["logprobs"] = []
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self._index(item), content_index=0,
                                     part=dict(part)))
        part = item["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(name, item_id=item["id"], output_index=self._index(item),
                                 content_index=0, delta=text, **extra))
        return events

    def _call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._calls.get(delta.index)
        if item is None:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": delta.id,
                    "name": delta.name, "arguments": "", "status": "in_progress"}
            self._calls[delta.index] = item
            events += self._begin(item)
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=self._index(item),
                                     delta=delta.arguments))
        return events

    def _end(self) -> list[dict[str, Any]]:
        """Close the item being written: its ``.done`` events."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index(item)
        events: list[dict[str, Any]] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", item_id=item["id"],
                                         output_index=index, content_index=0,
                                         text=part["text"], logprobs=[]))
            else:
                events.append(self.event("response.reasoning_text.done",
                                         item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", item_id=item["id"],
                                     output_index=index, content_index=0, part=dict(part)))
        else:
            events.append(self.event("response.function_call_arguments.done",
                                     item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=index,
                                 item=dict(item)))
        return events

    def finish(self, done: pb.Completion, output_tokens: int,
               kvcache: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The finished response and its closing events."""
        events = self._end()
        incomplete = "max_output_tokens" if done.finish_reason == "length" else None
        if incomplete:  # items cut short stay incomplete, as OpenAI marks them
            for item in self.output:
                item["status"] = "incomplete"
        body = self.body("incomplete" if incomplete else "completed",
                         responses_usage(done, output_tokens, self.reasoning_tokens),
                         incomplete)
        body["kvcache"] = kvcache
        events.append(self.event("response.incomplete" if incomplete
                                 else "response.completed", response=body))
        return body, events


def state_tokens(done: pb.Completion) -> int:
    """Tokens of the state at ``finish_key``: the prompt and the reply as decoded (the
    last token sampled is not decoded unless generation went on)."""
    for save in done.saves:
        if save.key == done.finish_key:
            return int(save.tokens)
    return int(done.prompt_tokens) + max(0, len(done.tokens) - 1)


class ResponsesFormatter(Formatter):
    """A response's answer: its items built from the parsed output as it comes;
    streamed, the response.* events, each numbered."""

    def __init__(self, call: ResponsesCall, plan: PromptPlan | None, worker: str,
                 tenant: str) -> None:
        super().__init__(call.responses.stream)
        assert plan is not None  # a chat, always
        self.worker = worker
        self.tenant = tenant
        self.parser = plan.parser()
        self.builder = ResponseBuilder(call.responses)

    def _events(self, events: list[dict[str, Any]]) -> bytes:
        return b"".join(sse_event(e) for e in events) if self.stream else b""

    def opening(self, prompt: pb.PromptDone | pb.Completion) -> bytes:
        return self._events(self.builder.start())

    def text(self, event: pb.CompleteEvent) -> bytes:
        deltas = self.parser.feed(event.text)
        self.builder.count_token(deltas)
        return self._events(self.builder.feed(deltas))

    def finish(self, finished: list[pb.Completion]) -> tuple[dict[str, Any], bytes]:
        (done,) = finished
        out = self.builder.feed(self.parser.close())
        extra = kvcache_details(done, self.worker, self.tenant, self.gateway)
        extra["state_tokens"] = state_tokens(done)  # what a continuation reuses
        body, closing = self.builder.finish(done, len(done.tokens), extra)
        return body, self._events(out + closing)

    def error(self, err: ApiError) -> bytes:
        return sse_event(self.builder.event(
            "error", code=err.code, message=err.message, param=err.param,
            error=err.body()["error"]))

    def served(self) -> str:
        out = self.parser.output
        return served_text(out.content, [(c.name, c.arguments) for c in out.tool_calls])
