"""The Responses API's requests (``POST /v1/responses``): every field either applied or
refused with OpenAI's error body (:data:`RESPONSES_FIELDS` says which and how), none
accepted and ignored.

A request is translated into the chat completions request it amounts to (instructions as
the system message, input items as messages, the flat function tools into chat's, and
``text.format`` into ``response_format``) and checked by the same code
(the OpenAI adapter's ``parse_chat``), so both APIs render, constrain and parse alike.
Pure: the routes (``routes``) look up the previous response and run it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import ApiError, bad_param
from ...pipeline.contract import Call
from ...pipeline.request import GenRequest
from ..openai.adapter import parse_chat

__all__ = ["RESPONSES_FIELDS", "ResponsesCall", "ResponsesRequest", "chat_messages_of_input",
           "new_id", "parse_responses", "unanswered_call"]

#: Every field /v1/responses reads, and how: applied, or refused (a 400 naming it) for
#: any value but null and those noted.
RESPONSES_FIELDS: Mapping[str, str] = {
    "model": "the served model's name (GET /v1/models)",
    "input": "a string, or items: messages (user, assistant, system, developer; text "
             "parts), function_call, function_call_output, reasoning",
    "instructions": "the system message (not carried over by previous_response_id)",
    "previous_response_id": "continues a stored response from its saved state",
    "tools": "function tools (flat: type, name, description, parameters, strict)",
    "tool_choice": "none, auto, required, or {type: function, name}",
    "parallel_tool_calls": "false: at most one call",
    "text": "format: text, json_object, json_schema (held to the schema)",
    "max_output_tokens": "tokens to generate at most",
    "temperature": "0 to 2 (default 1)",
    "top_p": "nucleus sampling",
    "stream": "server-sent events (response.* events)",
    "store": "keep the response for GET and previous_response_id (default true)",
    "metadata": "up to 16 string pairs, returned with the response",
    "user": "routes a user's requests to the worker holding their KV",
    "prompt_cache_key": "routes requests with the same key to the same worker",
    "truncation": "refused unless 'disabled' (a prompt beyond the context is a 400)",
    "include": "refused unless empty",
    "reasoning": "refused unless empty (the model reasons as its template says)",
    "service_tier": "refused unless 'auto' or 'default' (there is one tier)",
    "background": "refused unless false",
    "stream_options": "include_obfuscation: false only",
    "top_logprobs": "refused unless 0",
    "max_tool_calls": "refused",
    "conversation": "refused (use previous_response_id)",
    "prompt": "refused (no stored prompt templates)",
    "safety_identifier": "refused",
    "speculative": "kvcache: false turns speculative decoding off for this request, true "
                   "on (it changes no token either way)",
}
# Refused fields: a value other than these is a 400.
_ONLY: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"), "include": (None, []), "reasoning": (None, {}),
    "service_tier": (None, "auto", "default"), "background": (None, False),
    "top_logprobs": (None, 0), "max_tool_calls": (None,), "conversation": (None,),
    "prompt": (None,), "safety_identifier": (None,)}
MAX_METADATA = 16
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSERVED_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}
_ROLES = ("user", "assistant", "system", "developer")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class ResponsesRequest:
    """A Responses request, checked; ``chat`` becomes the :class:`GenRequest` once the
    previous response's conversation is known (:meth:`gen_request`)."""

    model: str
    stream: bool
    store: bool
    instructions: str | None
    input_messages: list[dict[str, Any]]  # the new input, as chat messages
    previous_response_id: str | None
    metadata: dict[str, str]
    tools: list[dict[str, Any]]  # as the request gave them (echoed in the response)
    tool_choice: Any
    text_format: dict[str, Any]
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    parallel_tool_calls: bool
    user: str | None
    prompt_cache_key: str | None
    chat_body: dict[str, Any] = field(default_factory=dict)  # the rest, in chat's terms
    id: str = field(default_factory=lambda: new_id("resp"))

    def gen_request(self, history: list[dict[str, Any]],
                    session_header: str | None = None) -> GenRequest:
        """The chat completions request this amounts to, after ``history`` (the
        previous response's conversation, its reply included)."""
        system = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        unanswered = unanswered_call(history + self.input_messages)
        if unanswered is not None:  # OpenAI's answer, word for word
            raise ApiError(400, f"No tool output found for function call {unanswered}.",
                           param="input")
        messages = system + history + self.input_messages
        data = {**self.chat_body, "messages": messages}
        try:
            return parse_chat(data, session_header).request
        except ApiError as err:
            raise self.renamed(err, len(history)) from None

    def renamed(self, err: ApiError, n_history: int) -> ApiError:
        """A refusal of the chat request (parsed or rendered), named in the Responses
        API's terms."""
        return _renamed(err, 1 if self.instructions else 0, n_history)


class ResponsesCall(Call):
    """A Responses request as the pipeline runs it: the checked request (``responses``),
    the chat request it amounts to after its history (``request``), and how many of that
    chat's messages came from the previous response (``n_history``: an error naming one
    is named as the Responses API names it)."""

    def __init__(self, responses: ResponsesRequest, request: GenRequest,
                 n_history: int) -> None:
        self.responses = responses
        self.request = request
        self.n_history = n_history

    def rename(self, err: ApiError) -> ApiError:
        return self.responses.renamed(err, self.n_history)


def unanswered_call(messages: list[dict[str, Any]]) -> str | None:
    """The ``call_id`` of the first function call of a conversation (chat messages: the
    stored ones, then the new input's) that no ``function_call_output`` answers, or None.
    A continuation of a response that ended in calls must send their outputs: the model
    would otherwise go on from a call it never saw answered."""
    answered = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    for message in messages:
        for call in message.get("tool_calls") or ():
            if call["id"] not in answered:
                return str(call["id"])
    return None


def _renamed(err: ApiError, n_system: int, n_history: int) -> ApiError:
    """A refusal of the chat request, named in the Responses API's terms."""
    param = err.param or ""
    names = {"max_completion_tokens": "max_output_tokens",
             "response_format.json_schema": "text.format", "response_format": "text.format"}
    for chat_name, ours in names.items():
        if param.startswith(chat_name):
            param = ours + param[len(chat_name):]
    if param.startswith("tools["):  # chat's tools nest the function; flat ones do not
        param = param.replace("].function.", "].", 1)
    if param.startswith("messages"):
        # Which message: the new input's items are numbered after the instructions and
        # the previous response's conversation.
        rest = param[len("messages"):]
        if rest.startswith("["):
            index, _, tail = rest[1:].partition("]")
            if index.isdigit() and int(index) >= n_system + n_history:
                param = f"input[{int(index) - n_system - n_history}]{tail}"
            elif index.isdigit() and int(index) >= n_system:
                param = "previous_response_id"
            else:
                param = "instructions"
        else:
            param = "input"
    return ApiError(err.status, err.message, type=err.type, param=param or None,
                    code=err.code, headers=err.headers)


def _text(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, f"'{where}' must be a string or a list of text parts.",
                        code="invalid_type")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _UNSERVED_PARTS:
            raise bad_param(f"{where}[{i}]", f"Content parts of type '{kind}' are not "
                                             f"supported: this server runs text models and "
                                             f"cannot read {_UNSERVED_PARTS[kind]}.",
                            code="unsupported_parameter")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise bad_param(f"{where}[{i}]", "Each content part must be a text part "
                                             '({"type": "input_text", "text": "..."}).')
    return "".join(texts)


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise bad_param(where, f"'{where}' must be a JSON string.", code="invalid_type")
    return value


def chat_messages_of_input(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls (and a reasoning item
    before them) join the assistant turn they belong to."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_param("input", "'input' must be a string or a non-empty list of items.",
                        code="missing_required" if value is None else "invalid_type")
    out: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item waits for the assistant turn it precedes
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad_param(where, f"'{where}' must be an object.", code="invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_param(f"{where}.role", f"'{where}.role' must be one of "
                                                 f"{', '.join(_ROLES)}.")
            message: dict[str, Any] = {"role": role,
                                       "content": _text(item.get("content"),
                                                        f"{where}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id:
                raise bad_param(f"{where}.call_id", "A function_call needs its 'call_id'.")
            if not isinstance(name, str) or not name:
                raise bad_param(f"{where}.name", "A function_call needs its 'name'.")
            call = {"id": call_id, "type": "function", "function": {
                "name": name, "arguments": _arguments(item.get("arguments", ""),
                                                      f"{where}.arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                turn: dict[str, Any] = {"role": "assistant", "content": "",
                                        "tool_calls": [call]}
                if reasoning:
                    turn["reasoning_content"], reasoning = reasoning, ""
                out.append(turn)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_param(f"{where}.call_id", "A function_call_output needs the "
                                                    "'call_id' of the call it answers.")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            summary = item.get("summary") or []
            if not isinstance(parts, list) or not isinstance(summary, list):
                raise bad_param(where, "A reasoning item's content and summary must be "
                                       "lists of text parts.", code="invalid_type")
            texts = [p.get("text") for p in parts or summary if isinstance(p, Mapping)]
            reasoning += "".join(t for t in texts if isinstance(t, str))
        else:
            raise bad_param(f"{where}.type", f"Input items of type {kind!r} are not "
                                             "supported: send message, function_call, "
                                             "function_call_output or reasoning items.",
                            code="unsupported_parameter")
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    """The flat function tools as chat's (``{"type": "function", "function": {...}}``)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_param("tools", "'tools' must be a list of function tools.",
                        code="invalid_type")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise bad_param(f"tools[{i}].type", f"Tools of type {kind!r} are not supported: "
                                                "this server runs function tools only.",
                            code="unsupported_parameter")
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise bad_param(f"tools[{i}].{sorted(unknown)[0]}",
                            "Unrecognized field of a function tool.",
                            code="unknown_parameter")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict")
            if k in tool}})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and \
            isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_param("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                   '{"type": "function", "name": ...}.')


def _text_format(value: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text``: the format as echoed back, and chat's ``response_format``."""
    if value is None:
        return {"type": "text"}, None
    if not isinstance(value, Mapping) or set(value) - {"format", "verbosity"}:
        raise bad_param("text", "'text' takes a 'format'.", code="invalid_type")
    if value.get("verbosity") not in (None, "medium"):
        raise bad_param("text.verbosity", "'text.verbosity' is not supported by this server.",
                        code="unsupported_parameter")
    fmt = value.get("format")
    if fmt is None:
        return {"type": "text"}, None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, {"type": "json_object"}
    if kind == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise bad_param("text.format.name", "A json_schema format needs a 'name'.",
                            code="missing_required")
        schema = fmt.get("schema")
        if not isinstance(schema, Mapping):
            raise bad_param("text.format.schema", "A json_schema format needs a 'schema' "
                                                  "object.", code="missing_required")
        spec = {"name": name, "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        echoed = {"type": "json_schema", "name": name, "schema": schema,
                  "strict": fmt.get("strict"), "description": fmt.get("description")}
        return echoed, {"type": "json_schema", "json_schema": spec}
    raise bad_param("text.format", "'text.format' type must be 'text', 'json_object' or "
                                   "'json_schema'.")


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()):
        raise bad_param("metadata", f"'metadata' takes at most {MAX_METADATA} pairs of "
                                    "strings (keys up to 64, values up to 512 characters).",
                        code="invalid_type")
    return dict(value)


def parse_responses(data: dict[str, Any]) -> ResponsesRequest:
    for name in data:
        if name not in RESPONSES_FIELDS:
            raise bad_param(name, f"Unrecognized request argument supplied: {name}",
                            code="unknown_parameter")
    for name, allowed in _ONLY.items():
        if name in data and data[name] not in allowed:
            raise bad_param(name, f"'{name}' is not supported by this server "
                                  f"({RESPONSES_FIELDS[name]}).",
                            code="unsupported_parameter")
    options = data.get("stream_options")
    if options not in (None, {}, {"include_obfuscation": False}):
        raise bad_param("stream_options", "'stream_options' takes include_obfuscation "
                                          "false only.", code="unsupported_parameter")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "You must provide a model parameter.", code="missing_model")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_param("instructions", "'instructions' must be a string.",
                        code="invalid_type")
    previous = data.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_param("previous_response_id", "'previous_response_id' must be a "
                                                "response's id.", code="invalid_type")
    for name in ("stream", "store", "parallel_tool_calls"):
        if data.get(name) is not None and not isinstance(data[name], bool):
            raise bad_param(name, f"Invalid value for '{name}': {data[name]!r}; it must be "
                                  "a boolean.", code="invalid_type")
    echoed, response_format = _text_format(data.get("text"))
    tools = data.get("tools") or []
    chat_body: dict[str, Any] = {
        "model": model, "stream": data.get("stream"), "tools": _tools(data.get("tools")) or
        None, "tool_choice": _tool_choice(data.get("tool_choice")),
        "parallel_tool_calls": data.get("parallel_tool_calls"),
        "response_format": response_format,
        "max_completion_tokens": data.get("max_output_tokens"),
        "temperature": data.get("temperature"), "top_p": data.get("top_p"),
        "user": data.get("user"), "prompt_cache_key": data.get("prompt_cache_key"),
        "speculative": data.get("speculative")}
    request = ResponsesRequest(
        model=model, stream=bool(data.get("stream")), store=data.get("store") is not False,
        instructions=instructions, input_messages=chat_messages_of_input(data.get("input")),
        previous_response_id=previous, metadata=_metadata(data.get("metadata")),
        tools=list(tools), tool_choice=data.get("tool_choice") or
        ("auto" if tools else "none"), text_format=echoed,
        max_output_tokens=data.get("max_output_tokens"),
        temperature=data.get("temperature"), top_p=data.get("top_p"),
        parallel_tool_calls=data.get("parallel_tool_calls") is not False,
        user=data.get("user"), prompt_cache_key=data.get("prompt_cache_key"),
        chat_body={k: v for k, v in chat_body.items() if v is not None})
    return request
