"""Template families: how a model writes tool calls and reasoning, read from its chat
template's source, and how an agent's history is handed to that template.

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5/3,
  SmolLM3, Hermes 2/3): tools in the system message.
* ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3);
  tools rendered in the system message (``tools_in_user_message`` false, as llama.cpp's
  server renders them).
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``; tools come
  just before the last user message, so no saved system prompt holds them.
* ``generic``: any other template, with or without tools of its own (SmolLM2): the tools
  are written into the system message by us, and the output is a JSON envelope,
  ``{"response": "..."}`` or ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``,
  always grammar-constrained (llama.cpp's server's generic format). Earlier turns are
  written back in the same envelope, byte for byte what the grammar made the model write,
  so a tool round trip reuses the previous turn's KV.

Reasoning markers (``<think>``/``</think>`` and a few others) are found in the template.
(tests/unit/test_chat_formats.py)
"""

from __future__ import annotations

import enum
import json
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .messages import ChatMessage, Tool, ToolCall

__all__ = ["REASONING_MARKERS", "ChatFormat", "Family", "detect_format", "envelope_calls",
           "envelope_response", "generic_tools_prompt", "template_messages"]


class Family(str, enum.Enum):
    GENERIC = "generic"
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


#: Reasoning markers, most common first: the first pair a template mentions is its own.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"), ("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"))

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ChatFormat:
    family: Family
    reasoning: tuple[str, str] | None = None  # (open, close) markers
    string_arguments: bool = False  # the template writes a string `arguments` as it is
    developer_role: bool = False  # the template knows `developer` (else it is `system`)
    template_tools: bool = False  # the template renders `tools` itself

    def new_call_id(self) -> str:
        """A tool call id in the form the template accepts (Mistral's: 9 letters and
        digits; else OpenAI's ``call_`` and 24 characters)."""
        if self.family is Family.MISTRAL:
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return "call_" + secrets.token_hex(12)


def detect_format(source: str) -> ChatFormat:
    """The family of a chat template, from its source."""
    reasoning = next(((o, c) for o, c in REASONING_MARKERS if o in source and c in source),
                     None)
    if HERMES_OPEN in source and "tools" in source:
        family = Family.HERMES
    elif "<|start_header_id|>" in source and "ipython" in source and "tools" in source:
        family = Family.LLAMA3
    elif MISTRAL_MARKER in source and "tools" in source:
        family = Family.MISTRAL
    else:
        family = Family.GENERIC
    return ChatFormat(family, reasoning,
                      string_arguments="arguments is string" in source,
                      developer_role="'developer'" in source or '"developer"' in source,
                      template_tools=family is not Family.GENERIC)


# --------------------------------------------------------------------------- generic


def envelope_response(content: str) -> str:
    """A reply as the generic grammar makes the model write it."""
    return '{"response": ' + json.dumps(content, ensure_ascii=False) + "}"


def envelope_calls(calls: Sequence[ToolCall]) -> str:
    """Tool calls as the generic grammar makes the model write them; the arguments as
    they were written (the client sends back what it was given)."""
    parts = [f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": '
             f'{c.arguments.strip() or "{}"}}}' for c in calls]
    return '{"tool_calls": [' + ", ".join(parts) + "]}"


def generic_tools_prompt(tools: Sequence[Tool]) -> str:
    """The tools and the answer format, for the system message. The same whatever the
    tool choice, so requests that differ only in it share the cached system prompt."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("You can call these tools (JSON schemas of their arguments):\n"
            f"{lines}\n\n"
            "Answer with one JSON object: either {\"response\": \"your reply\"} to reply, or "
            "{\"tool_calls\": [{\"name\": \"tool name\", \"arguments\": {...}}]} to call "
            "one or more tools. The results come back in the next message.")


def _generic_tool_result(message: ChatMessage, calls: Mapping[str, ToolCall]) -> str:
    call = calls.get(message.tool_call_id)
    return json.dumps({"tool_response": {"name": call.name if call else message.name,
                                         "content": message.content}}, ensure_ascii=False)


# --------------------------------------------------------------------------- history


def template_messages(fmt: ChatFormat, messages: Sequence[ChatMessage],
                      calls: Mapping[str, ToolCall], *, tools: Sequence[Tool] = (),
                      envelope: bool = False) -> list[dict[str, Any]]:
    """``messages`` as the template receives them. Native families get OpenAI's shapes
    (assistant ``tool_calls``, ``tool`` messages with ``tool_call_id``); the generic family
    gets text only: the tools in the system message (when given), tool calls and (with
    ``envelope``) replies in the JSON envelope, tool results as user messages."""
    generic = fmt.family is Family.GENERIC
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.role
        if role == "developer" and not fmt.developer_role:
            role = "system"
        item: dict[str, Any] = {"role": role, "content": message.content}
        if message.name and role in ("user", "assistant", "system"):
            item["name"] = message.name
        if role == "assistant":
            if message.reasoning and fmt.reasoning is not None:
                item["reasoning_content"] = message.reasoning
            if message.tool_calls and generic:
                item["content"] = envelope_calls(message.tool_calls)
            elif message.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments
                                  if fmt.string_arguments else c.arguments_object()}}
                    for c in message.tool_calls]
            elif envelope:
                item["content"] = envelope_response(message.content)
        elif role == "tool":
            if generic:
                text = _generic_tool_result(message, calls)
                if out and out[-1].get("tool_results"):  # consecutive results: one turn
                    out[-1]["content"] += "\n" + text
                    continue
                item = {"role": "user", "content": text, "tool_results": True}
            else:
                call = calls.get(message.tool_call_id)
                item["tool_call_id"] = message.tool_call_id
                item["name"] = call.name if call else message.name
        out.append(item)
    for item in out:
        item.pop("tool_results", None)
    if generic and tools:
        prompt = generic_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
