"""The chat an agent sends, in one shape whatever API it came through: messages with tool
calls and tool results, tool definitions, and the tool choice. Checked here, so a bad
tool definition or a tool result answering no call is refused with the place named.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatInputError", "ChatMessage", "Tool", "ToolCall", "ToolChoice",
           "check_tool_results", "tool_from_openai"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: OpenAI's rule for function names (a-z, A-Z, 0-9, underscores and dashes, at most 64).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


class ChatInputError(ValueError):
    """A message, tool or choice that cannot be served; ``param`` names where it is
    (``messages[2].tool_call_id``, ``tools[0].function.name``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as the model wrote it (or the client sent it)

    def arguments_object(self) -> Any:
        """The arguments parsed (templates that write them with ``tojson`` need them so);
        text that is not JSON is passed on as it is."""
        try:
            return json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            return self.arguments


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | developer | user | assistant | tool
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # assistant
    tool_call_id: str = ""  # tool: the call it answers
    name: str = ""  # a participant's name (user, assistant), passed to the template
    reasoning: str = ""  # assistant: its reasoning_content, when the client sends it back


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str = ""
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The definition as templates and prompts show it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``none``, ``auto`` (the model decides), ``required`` (at least one call), or
    ``function`` with ``name`` (exactly that tool)."""

    mode: str = "auto"
    name: str = ""

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def tool_from_openai(value: Any, where: str) -> Tool:
    """One entry of OpenAI's ``tools``: ``{"type": "function", "function": {name,
    description, parameters, strict}}``."""
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise ChatInputError(f"{where}.type", "Each tool must be an object with type "
                                              "'function' (the only tool type served).")
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise ChatInputError(f"{where}.function", "A function tool needs a 'function' object.")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ChatInputError(f"{where}.function.name", f"Invalid tool name {name!r}: it must "
                             "be 1 to 64 letters, digits, underscores or dashes.")
    description = function.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise ChatInputError(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ChatInputError(f"{where}.function.parameters", "A tool's parameters must be a "
                             "JSON schema of type 'object'.")
    strict = function.get("strict", False)
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        raise ChatInputError(f"{where}.function.strict", "must be a boolean")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ChatInputError(f"{where}.function.{sorted(unknown)[0]}",
                             "Unrecognized field of a function tool.")
    return Tool(name, dict(parameters), description, strict)


def check_tools(tools: Sequence[Tool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise ChatInputError(f"tools[{i}].function.name",
                                 f"Two tools are named {tool.name!r}.")
        seen.add(tool.name)


def check_tool_results(messages: Sequence[ChatMessage]) -> dict[str, ToolCall]:
    """Every tool message answers a call an earlier assistant message made (by id), and
    every call an assistant message makes is answered by the tool messages right after
    it (OpenAI's rule, and Anthropic's: the model would otherwise go on from a call it
    never saw answered). Returns the calls by id."""
    calls: dict[str, ToolCall] = {}
    for i, message in enumerate(messages):
        for call in message.tool_calls:
            calls[call.id] = call
        if message.role == "tool":
            if not message.tool_call_id:
                raise ChatInputError(f"messages[{i}].tool_call_id", "A tool message needs "
                                     "the 'tool_call_id' of the call it answers.")
            if message.tool_call_id not in calls:
                raise ChatInputError(f"messages[{i}].tool_call_id", f"No earlier assistant "
                                     f"message has a tool call with id "
                                     f"{message.tool_call_id!r}.")
    for i, message in enumerate(messages):
        if not message.tool_calls:
            continue
        answered = {m.tool_call_id for m in itertools.takewhile(
            lambda m: m.role == "tool", messages[i + 1:])}
        missing = [call.id for call in message.tool_calls if call.id not in answered]
        if missing:
            raise ChatInputError(f"messages[{i}].role", "An assistant message with "
                                 "'tool_calls' must be followed by tool messages responding "
                                 "to each 'tool_call_id'. The following tool_call_ids did "
                                 "not have response messages: " + ", ".join(missing))
    return calls
