"""OpenAI's chat fields read into the chat front end's types (model_runtime.chat):
messages (text parts, assistant ``tool_calls``, ``tool`` results, ``developer``), tools,
``tool_choice``, ``parallel_tool_calls`` and ``response_format``. Pure; a value that
cannot be served raises :class:`ChatInputError` naming where it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ....chat.messages import (
    ROLES,
    ChatInputError,
    ChatMessage,
    Tool,
    ToolCall,
    ToolChoice,
    tool_from_openai,
)

__all__ = ["parse_messages", "parse_response_format", "parse_tool_choice", "parse_tools"]

# Fields of a message clients send back as they got them (OpenAI's client dumps a reply
# with these set to null): accepted when null, refused otherwise, unless read here.
NULL_ONLY = ("audio", "function_call", "annotations", "refusal")
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                            "reasoning_content", *NULL_ONLY})
UNSERVED_PARTS = {"image_url": "images", "input_audio": "audio", "file": "files"}


def _text(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatInputError(where, "Message content must be a string or a list of text "
                                    "parts.")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in UNSERVED_PARTS:
            raise ChatInputError(f"{where}[{i}]", f"Content parts of type '{kind}' are not "
                                 f"supported: this server runs text models and cannot read "
                                 f"{UNSERVED_PARTS[kind]}. Send text parts.")
        if kind in ("text", "refusal") and isinstance(part.get(kind), str):
            texts.append(part[kind])
            continue
        raise ChatInputError(f"{where}[{i}]", "Each content part must be a text part "
                                              '({"type": "text", "text": "..."}).')
    return "".join(texts)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ChatInputError(where, "'tool_calls' must be a list.")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            raise ChatInputError(f"{at}.type", "Each tool call must be of type 'function'.")
        function = call.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatInputError(f"{at}.function", "A tool call needs a function with a name.")
        arguments = function.get("arguments", "")
        if isinstance(arguments, Mapping):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise ChatInputError(f"{at}.function.arguments", "must be a JSON string")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatInputError(f"{at}.id", "A tool call needs its 'id'.")
        calls.append(ToolCall(call_id, function["name"], arguments))
    return tuple(calls)


def parse_messages(value: Any) -> list[ChatMessage]:
    if not isinstance(value, list) or not value:
        raise ChatInputError("messages", "'messages' must be a non-empty list of messages.")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise ChatInputError(f"{where}.role", f"{where} needs a role, one of "
                                                  f"{', '.join(sorted(ROLES))}.")
        for key in m:
            if key not in MESSAGE_FIELDS or (key in NULL_ONLY and m[key] is not None and
                                             not (key == "annotations" and m[key] == [])):
                raise ChatInputError(f"{where}.{key}", f"Message field '{key}' is not "
                                                       "supported by this server.")
        role = m["role"]
        name = m.get("name") or ""
        if not isinstance(name, str):
            raise ChatInputError(f"{where}.name", "must be a string")
        calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
        if calls and role != "assistant":
            raise ChatInputError(f"{where}.tool_calls", "Only assistant messages carry "
                                                        "tool calls.")
        call_id = m.get("tool_call_id") or ""
        if not isinstance(call_id, str):
            raise ChatInputError(f"{where}.tool_call_id", "must be a string")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ChatInputError(f"{where}.reasoning_content", "must be a string")
        out.append(ChatMessage(role, _text(m.get("content"), f"{where}.content"), calls,
                               call_id, name, reasoning))
    return out


def parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ChatInputError("tools", "'tools' must be a list of function tools.")
    return [tool_from_openai(t, f"tools[{i}]") for i, t in enumerate(value)]


def parse_tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's default: ``auto`` with tools, ``none`` without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return ToolChoice("function", function["name"])
    raise ChatInputError("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                        '{"type": "function", "function": {"name": ...}}.')


def parse_response_format(value: Any) -> tuple[Mapping[str, Any] | None, str]:
    """The JSON schema the reply must follow (``{"type": "object"}`` for json_object),
    or None; and where it came from, for errors."""
    if value is None:
        return None, ""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None, ""
    if kind == "json_object":
        return {"type": "object"}, "response_format"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise ChatInputError("response_format.json_schema", "json_schema needs an object "
                                 "with a 'name' and a 'schema'.")
        schema = spec.get("schema", {})
        if not isinstance(schema, Mapping):
            raise ChatInputError("response_format.json_schema.schema", "must be a JSON "
                                                                       "schema object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ChatInputError("response_format.json_schema.strict", "must be a boolean")
        # strict or not, the reply is held to the schema (OpenAI's strict mode's promise)
        return schema, "response_format.json_schema.schema"
    raise ChatInputError("response_format", "'response_format' type must be 'text', "
                                            "'json_object' or 'json_schema'.")
