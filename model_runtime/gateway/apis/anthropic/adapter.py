"""Anthropic's Messages API requests read into the gateway's one request
(:class:`GenRequest` with a chat front end :class:`ChatRequest`): ``system``, content
blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``), ``tools`` with
``input_schema``, ``tool_choice``, the sampling fields and ``cache_control``
breakpoints. Every field is applied or refused (:data:`MESSAGES_FIELDS` says which and
how), in Anthropic's error shape (:func:`error_body`). Pure: the routes are in
``routes``, the answers' shapes in ``formatter``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ....chat.messages import (
    ChatInputError,
    ChatMessage,
    Tool,
    ToolCall,
    ToolChoice,
    tool_from_openai,
)
from ....chat.prompt import ChatRequest
from ...errors import ApiError
from ...limits import check_text
from ...pipeline.contract import Call
from ...pipeline.request import GenRequest

__all__ = ["COUNT_FIELDS", "MESSAGES_FIELDS", "MessagesRequest", "error_body",
           "parse_count_tokens", "parse_messages_request"]

MAX_BREAKPOINTS = 4  # Anthropic's bound on blocks with cache_control
MAX_STOP_SEQUENCES = 16
MAX_USER_ID = 256

#: Every field /v1/messages reads, and how: applied, or refused (a 400 naming it).
MESSAGES_FIELDS: Mapping[str, str] = {
    "model": "the served model's name (GET /v1/models)",
    "messages": "user and assistant turns of text, tool_use, tool_result and thinking blocks",
    "max_tokens": "required: tokens to generate at most (with the prompt, must fit)",
    "system": "a string or text blocks (cache_control allowed)",
    "tools": "custom tools with input_schema (cache_control allowed); server tools refused",
    "tool_choice": "auto, any, tool (with name), none; disable_parallel_tool_use",
    "stop_sequences": f"up to {MAX_STOP_SEQUENCES} strings that end the text",
    "temperature": "0 to 1 (default 1)",
    "top_p": "nucleus sampling",
    "top_k": "keep the k most likely tokens",
    "metadata": "user_id: routes a user's requests to the worker holding their KV",
    "stream": "server-sent events in Anthropic's event types",
    "cache_control": "a breakpoint at the end of the last message (automatic caching)",
    "output_config": "format json_schema: the reply held to the schema; effort refused",
    "thinking": "refused: a reasoning model's template decides; its reasoning comes as "
                "thinking blocks",
    "service_tier": "refused unless 'auto' or 'standard_only' (there is one tier)",
    "container": "refused", "mcp_servers": "refused", "context_management": "refused",
    "speed": "refused unless 'standard'", "inference_geo": "refused (one place)",
    "diagnostics": "refused", "user_profile_id": "refused", "workspace_id": "refused",
    "speculative": "kvcache: false turns speculative decoding off for this request, true "
                   "on (it changes no token either way)",
}
#: Every field /v1/messages/count_tokens reads.
COUNT_FIELDS: Mapping[str, str] = {
    name: MESSAGES_FIELDS[name]
    for name in ("model", "messages", "system", "tools", "tool_choice", "thinking",
                 "cache_control", "output_config")}
_REFUSED: Mapping[str, tuple[Any, ...]] = {
    "thinking": (None,), "service_tier": (None, "auto", "standard_only"),
    "container": (None,), "mcp_servers": (None, []), "context_management": (None,),
    "speed": (None, "standard"), "inference_geo": (None,), "diagnostics": (None,),
    "user_profile_id": (None,), "workspace_id": (None,)}
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); statuses
# the OpenAI routes use that Anthropic does not are answered as Anthropic's nearest.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
_STATUS = {409: 400, 503: 529}


def error_body(err: ApiError) -> tuple[int, dict[str, Any]]:
    """An :class:`ApiError` as Anthropic answers it: its status and body."""
    status = _STATUS.get(err.status, err.status)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else
                            "invalid_request_error")
    param = anthropic_param(err.param) if err.param else ""
    message = f"{param}: {err.message}" if param and not err.message.startswith(param) \
        else err.message
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_param(param: str) -> str:
    """A place named as the chat front end names it (``tools[0].function.parameters``)
    as Anthropic names it (``tools.0.input_schema``); a duplicate tool is refused by its
    ``tools[i].function.name``."""
    param = param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    return re.sub(r"\[(\d+)\]", r".\1", param)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request_error")


@dataclass
class MessagesRequest(Call):
    """A checked /v1/messages request: the gateway's request (with each cache_control
    breakpoint's pin: ``request.breakpoint_ttls``), and the message's ``id``."""

    request: GenRequest
    id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")


class _Breakpoints:
    """cache_control marks as they are read: each becomes the end of a chat message."""

    def __init__(self, ttls: Mapping[str, int]) -> None:
        self.seconds = ttls
        self.at: dict[int, int] = {}  # chat message index -> pin seconds
        self.count = 0

    def mark(self, value: Any, where: str, message_index: int) -> None:
        if value is None:
            return
        if not isinstance(value, Mapping) or value.get("type") != "ephemeral" or \
                set(value) - {"type", "ttl"}:
            raise invalid(where, "cache_control must be {\"type\": \"ephemeral\"} with an "
                                 "optional \"ttl\" of '5m' or '1h'.")
        ttl = value.get("ttl") or "5m"
        if ttl not in self.seconds:
            raise invalid(f"{where}.ttl", f"ttl must be one of {', '.join(self.seconds)}.")
        self.count += 1
        if self.count > MAX_BREAKPOINTS:
            raise invalid(where, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control "
                                 "may be provided.")
        self.at[message_index] = max(self.at.get(message_index, 0), self.seconds[ttl])


def _number(data: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not low <= value <= high:
        raise invalid(name, f"{name} must be a number from {low:g} to {high:g}.")
    return float(value)


def _check_fields(data: Mapping[str, Any], known: Mapping[str, str]) -> None:
    for name in data:
        if name not in known:
            raise invalid(name, "Extra inputs are not permitted")
    for name, allowed in _REFUSED.items():
        if name in data and data[name] not in allowed:
            raise invalid(name, f"'{name}' is not supported by this server "
                                f"({known.get(name, 'refused')}).")


def _text_blocks(value: Any, where: str, marks: _Breakpoints | None,
                 message_index: int) -> str:
    """A string, or a list of text blocks (each may carry cache_control)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(where, "must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        at = f"{where}.{i}"
        if not isinstance(block, Mapping) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            raise invalid(at, "Each block must be a text block ({\"type\": \"text\", "
                              "\"text\": ...}): this server runs text models.")
        unknown = set(block) - {"type", "text", "cache_control", "citations"}
        if unknown or block.get("citations"):
            raise invalid(f"{at}.{sorted(unknown or {'citations'})[0]}",
                          "Extra inputs are not permitted")
        if marks is not None:
            marks.mark(block.get("cache_control"), f"{at}.cache_control", message_index)
        texts.append(block["text"])
    return "\n\n".join(texts) if where.startswith("system") else "".join(texts)


def _tool_result(block: Mapping[str, Any], where: str) -> ChatMessage:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id", "Field required")
    content = block.get("content", "")
    text = _text_blocks(content, f"{where}.content", None, 0) if content is not None else ""
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error", "must be a boolean")
    unknown = set(block) - {"type", "tool_use_id", "content", "is_error", "cache_control"}
    if unknown:
        raise invalid(f"{where}.{sorted(unknown)[0]}", "Extra inputs are not permitted")
    # The template has no place for a failed call: the result says so in its text.
    return ChatMessage("tool", f"Error: {text}" if is_error else text, tool_call_id=call_id)


def _tool_use(block: Mapping[str, Any], where: str) -> ToolCall:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.id", "Field required")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "Field required")
    if not isinstance(arguments, Mapping):
        raise invalid(f"{where}.input", "Input should be a valid dictionary")
    unknown = set(block) - {"type", "id", "name", "input", "cache_control"}
    if unknown:
        raise invalid(f"{where}.{sorted(unknown)[0]}", "Extra inputs are not permitted")
    return ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False))


def _blocks(role: str, content: Any, where: str, out: list[ChatMessage],
            marks: _Breakpoints) -> None:
    """One Anthropic message as chat messages: a user turn's tool results first (each a
    ``tool`` message), then its text; an assistant turn's thinking, text and tool calls
    as one message."""
    if isinstance(content, str):
        out.append(ChatMessage(role, content))
        return
    if not isinstance(content, list) or not content:
        raise invalid(f"{where}.content", "must be a string or a non-empty list of blocks")
    texts: list[str] = []
    results: list[tuple[ChatMessage, Any, str]] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    text_marks: list[tuple[Any, str]] = []
    for i, block in enumerate(content):
        at = f"{where}.content.{i}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        mark = (block.get("cache_control"), f"{at}.cache_control") \
            if isinstance(block, Mapping) else (None, at)
        if kind == "text":
            texts.append(_text_blocks([block], f"{where}.content", None, 0))
            text_marks.append(mark)
        elif kind == "tool_result" and role == "user":
            results.append((_tool_result(block, at), *mark))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
            text_marks.append(mark)
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{at}.thinking", "Field required")
            reasoning.append(block["thinking"])
            text_marks.append(mark)
        elif kind in ("image", "document", "search_result"):
            raise invalid(f"{at}.type", f"Blocks of type '{kind}' are not supported: this "
                                        "server runs text models.")
        else:
            allowed = "text, tool_result" if role == "user" else "text, tool_use, thinking"
            raise invalid(f"{at}.type", f"A {role} message takes blocks of type {allowed}; "
                                        f"got {kind!r}.")
    for message, cache_control, at in results:
        marks.mark(cache_control, at, len(out))
        out.append(message)
    if texts or calls or reasoning or not results:
        for cache_control, at in text_marks:
            marks.mark(cache_control, at, len(out))
        out.append(ChatMessage(role, "".join(texts), tuple(calls),
                               reasoning="".join(reasoning)))


def _messages(value: Any, marks: _Breakpoints, out: list[ChatMessage]) -> None:
    """The turns, appended to ``out`` (after the system message: a mark's index is its
    chat message's place in the whole chat)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "Field required: a non-empty list of messages")
    for i, m in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{where}.role", "Input should be 'user' or 'assistant'")
        unknown = set(m) - {"role", "content"}
        if unknown:
            raise invalid(f"{where}.{sorted(unknown)[0]}", "Extra inputs are not permitted")
        _blocks(m["role"], m.get("content"), where, out, marks)
    if value[-1]["role"] == "assistant":
        raise invalid(f"messages.{len(value) - 1}.role", "The last message must be the "
                      "user's: continuing a partial assistant turn (prefill) is not "
                      "supported by this server.")
    _check_tool_pairs(value)


def _block_ids(turn: Mapping[str, Any], kind: str, key: str) -> list[tuple[int, Any]]:
    """Where each block of ``kind`` sits in a turn (checked already), and its ``key``."""
    content = turn["content"]
    return [(j, block[key]) for j, block in enumerate(content)
            if block["type"] == kind] if isinstance(content, list) else []


def _check_tool_pairs(turns: list[Mapping[str, Any]]) -> None:
    """Anthropic's rule, refused in its words: the user turn right after an assistant's
    ``tool_use`` blocks answers each of them with a ``tool_result``, and a ``tool_result``
    answers a ``tool_use`` of the turn right before it (the model would otherwise go on
    from a call it never saw answered, or see an answer to nothing)."""
    for i, turn in enumerate(turns):
        if turn["role"] == "assistant":
            used = [call for _, call in _block_ids(turn, "tool_use", "id")]
            answered = {result for _, result in
                        _block_ids(turns[i + 1], "tool_result", "tool_use_id")}
            missing = [call for call in used if call not in answered]
            if missing:
                raise invalid(f"messages.{i}", "`tool_use` ids were found without "
                              "`tool_result` blocks immediately after: " + ", ".join(missing)
                              + ". Each `tool_use` block must have a corresponding "
                              "`tool_result` block in the next message.")
            continue
        asked = {call for _, call in _block_ids(turns[i - 1], "tool_use", "id")} if i else set()
        for j, result in _block_ids(turn, "tool_result", "tool_use_id"):
            if result not in asked:
                raise invalid(f"messages.{i}.content.{j}", "unexpected `tool_use_id` found "
                              f"in `tool_result` blocks: {result}. Each `tool_result` block "
                              "must have a corresponding `tool_use` block in the previous "
                              "message.")


def _tools(value: Any, marks: _Breakpoints) -> tuple[list[Tool], list[tuple[Any, str]]]:
    """The tools, and their cache_control marks (placed once the messages are known)."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise invalid("tools", "must be a list of tools")
    tools, tool_marks = [], []
    for i, tool in enumerate(value):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise invalid(where, "must be an object")
        if tool.get("type", "custom") != "custom":
            raise invalid(f"{where}.type", f"Server tools ({tool.get('type')}) are not "
                                           "supported: give custom tools with an input_schema.")
        unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if unknown:
            raise invalid(f"{where}.{sorted(unknown)[0]}", "Extra inputs are not permitted")
        if "input_schema" not in tool:
            raise invalid(f"{where}.input_schema", "Field required")
        try:
            tools.append(tool_from_openai({"type": "function", "function": {
                "name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool["input_schema"]}}, where))
        except ChatInputError as exc:
            raise invalid(exc.param.replace(".function.parameters", ".input_schema")
                          .replace(".function.", "."), exc.message) from None
        tool_marks.append((tool.get("cache_control"), f"{where}.cache_control"))
    return tools, tool_marks


def _tool_choice(value: Any, tools: list[Tool]) -> tuple[ToolChoice, bool]:
    """The choice and whether several calls may come (Anthropic's default: auto)."""
    if value is None:
        return ToolChoice("auto" if tools else "none"), True
    kind = value.get("type") if isinstance(value, Mapping) else None
    if not isinstance(kind, str) or kind not in ("auto", "any", "tool", "none") or \
            set(value) - {"type", "name", "disable_parallel_tool_use"}:
        raise invalid("tool_choice", "tool_choice must be {\"type\": \"auto\" | \"any\" | "
                                     "\"tool\" | \"none\"} (with \"name\" for tool).")
    parallel = value.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", "must be a boolean")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise invalid("tool_choice.name", f"tool_choice names {name!r}, which is not "
                                              "among the tools.")
        return ToolChoice("function", name), not parallel
    if kind in ("any",) and not tools:
        raise invalid("tool_choice", "tool_choice 'any' needs tools.")
    return ToolChoice({"any": "required"}.get(kind, kind)), not parallel


def _chat(data: Mapping[str, Any], ttls: Mapping[str, int]
          ) -> tuple[ChatRequest, dict[int, int]]:
    marks = _Breakpoints(ttls)
    messages: list[ChatMessage] = []
    system = data.get("system")
    if system is not None:
        text = _text_blocks(system, "system", marks, 0)
        messages.append(ChatMessage("system", text))
    tools, tool_marks = _tools(data.get("tools"), marks)
    choice, parallel = _tool_choice(data.get("tool_choice"), tools)
    _messages(data.get("messages"), marks, messages)
    marks.mark(data.get("cache_control"), "cache_control", len(messages) - 1)
    # Tools come before the system prompt in Anthropic's order, and templates render them
    # in or before the system message: a mark on a tool is the end of that message (of the
    # first message when there is no system prompt).
    for cache_control, where in tool_marks:
        marks.mark(cache_control, where, 0)
    schema = _output_format(data.get("output_config"))
    return ChatRequest(messages, tools, choice, parallel, json_schema=schema,
                       schema_param="output_config.format.schema",
                       breakpoints=tuple(sorted(marks.at))), marks.at


def _output_format(value: Any) -> Mapping[str, Any] | None:
    """``output_config.format``'s JSON schema (the reply is held to it), or None."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - {"format", "effort"}:
        raise invalid("output_config", "output_config takes format (and effort null).")
    if value.get("effort") is not None:
        raise invalid("output_config.effort", "effort is not supported by this server.")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), Mapping) or set(fmt) - {"type", "schema"}:
        raise invalid("output_config.format", "format must be {\"type\": \"json_schema\", "
                                              "\"schema\": {...}}.")
    return fmt["schema"]


def parse_messages_request(data: Mapping[str, Any], ttls: Mapping[str, int]
                           ) -> MessagesRequest:
    """A /v1/messages body as the request a worker runs; ``ttls``: seconds of each
    cache_control ttl (the gateway's --cache-ttl)."""
    _check_fields(data, MESSAGES_FIELDS)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "Field required")
    max_tokens = data.get("max_tokens")
    if max_tokens is None:
        raise invalid("max_tokens", "Field required")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or \
            not 1 <= max_tokens < 2**31:
        raise invalid("max_tokens", "max_tokens must be an integer >= 1.")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", "Input should be a valid boolean")
    stops = data.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or \
            len(stops) > MAX_STOP_SEQUENCES:
        raise invalid("stop_sequences", f"stop_sequences must be a list of at most "
                                        f"{MAX_STOP_SEQUENCES} non-empty strings.")
    top_k = data.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or
                              top_k < 0):
        raise invalid("top_k", "top_k must be an integer >= 0.")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, Mapping) or set(metadata) - {"user_id"}:
        raise invalid("metadata", "metadata takes only user_id.")
    user = metadata.get("user_id") or ""
    if not isinstance(user, str) or len(user) > MAX_USER_ID:
        raise invalid("metadata.user_id", f"must be a string of at most {MAX_USER_ID} "
                                          "characters")
    check_text("metadata.user_id", user)
    temperature = _number(data, "temperature", 0.0, 1.0)
    top_p = _number(data, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise invalid("top_p", "top_p must be > 0 and <= 1.")
    speculative = data.get("speculative")
    if speculative is not None and not isinstance(speculative, bool):
        raise invalid("speculative", "Input should be a valid boolean")
    chat, at = _chat(data, ttls)
    return MessagesRequest(GenRequest(
        model=model, stream=stream, max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p, seed=None, stop=list(stops), session_id="",
        route_key=user, top_k=top_k or 0, chat=chat, breakpoint_ttls=at,
        speculative=speculative))


def parse_count_tokens(data: Mapping[str, Any], ttls: Mapping[str, int]) -> MessagesRequest:
    """A /v1/messages/count_tokens body: the prompt of the same request."""
    _check_fields(data, COUNT_FIELDS)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "Field required")
    chat, at = _chat(data, ttls)
    return MessagesRequest(GenRequest(
        model=model, stream=False, max_tokens=1, temperature=1.0, top_p=1.0, seed=None,
        stop=[], session_id="", chat=chat, breakpoint_ttls=at))
