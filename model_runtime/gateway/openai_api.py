"""The OpenAI API's shapes: requests parsed and checked, responses, chunks, error bodies.

Pure functions and small types, no I/O: the HTTP routes (``app``) call them. Unknown
request fields are ignored, as OpenAI-compatible servers do; a known field with a value
OpenAI would refuse is refused with OpenAI's error body and status.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ..v1 import runtime_pb2 as pb

MAX_STOP = 4  # OpenAI accepts up to 4 stop sequences
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 256


class ApiError(Exception):
    """An answer in OpenAI's error format: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    """One completion request, checked: what goes to a worker, and how to answer."""

    endpoint: str  # "chat" | "text"
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: until the context is full
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    session_id: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.endpoint == "chat" else "cmpl"
            self.id = f"{prefix}-{secrets.token_hex(12)}"

    def to_proto(self) -> pb.CompleteRequest:
        # A max_tokens given must fit with the prompt (the runtime refuses it otherwise, as
        # OpenAI does); none given: until the context is full.
        req = pb.CompleteRequest(
            session_id=self.session_id, max_tokens=self.max_tokens or 0,
            until_context_full=self.max_tokens is None, temperature=self.temperature,
            top_p=self.top_p, stop=self.stop)
        if self.seed is not None:
            req.seed = self.seed
        if self.messages is not None:
            req.chat.messages.extend(pb.ChatMessage(**m) for m in self.messages)
        elif self.tokens is not None:
            req.tokens.ids.extend(self.tokens)
        else:
            req.prompt = self.prompt or ""
        return req

    def routing_text(self, completion: str | None = None) -> str:
        """The request as one string whose prefixes match those of a later request that
        continues it: a chat's messages (plus the reply, as the next turn will carry it),
        or a raw prompt (plus its completion). Used only to route, never sent."""
        if self.messages is not None:
            turns = list(self.messages)
            if completion is not None:
                turns.append({"role": "assistant", "content": completion})
            return "\x00chat\x00" + "".join(f"{m['role']}\x1f{m['content']}\x1e"
                                            for m in turns)
        if self.tokens is not None:
            return "\x00tokens\x00" + "".join(f"{t}," for t in self.tokens)
        return "\x00text\x00" + (self.prompt or "") + (completion or "")


# --------------------------------------------------------------------------- parsing


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request ({exc}). The "
                            "body must be a JSON object.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return data


def _number(data: dict[str, Any], name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
        raise bad_param(name, f"Invalid value for '{name}': {value!r}; it must be a number "
                              f"{bound}.")
    return float(value)


def _int(data: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_param(name, f"Invalid value for '{name}': {value!r}; it must be an integer "
                              f"from {low} to {high}.")
    return value


def _bool(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_param(name, f"Invalid value for '{name}': {value!r}; it must be a boolean.",
                        code="invalid_type")
    return value


def _unsupported(data: dict[str, Any], name: str, allowed: tuple[Any, ...]) -> None:
    if name in data and data[name] not in allowed:
        raise bad_param(name, f"'{name}' is not supported by this server "
                              f"(accepted: {', '.join(map(json.dumps, allowed))}).",
                        code="unsupported_parameter")


def _common(data: dict[str, Any], endpoint: str, max_tokens_names: tuple[str, ...],
            session_header: str | None) -> dict[str, Any]:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "You must provide a model parameter.", code="missing_model")
    stream = _bool(data, "stream")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_param("stream_options", "The 'stream_options' parameter is only "
                                              "allowed when 'stream' is enabled.")
        if not isinstance(options, dict):
            raise bad_param("stream_options", "'stream_options' must be an object.",
                            code="invalid_type")
        include_usage = _bool(options, "include_usage")
    max_tokens = None
    for name in max_tokens_names:  # max_completion_tokens wins over max_tokens
        value = _int(data, name, 1, 2**31 - 1)
        if value is not None:
            max_tokens = value
            break
    n = _int(data, "n", 1, 128)
    if n not in (None, 1):
        raise bad_param("n", "Only n=1 is supported by this server.",
                        code="unsupported_parameter")
    stop = data.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    elif stop is not None:
        raise bad_param("stop", "'stop' must be a string or a list of strings.",
                        code="invalid_type")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise bad_param("stop", f"'stop' takes at most {MAX_STOP} non-empty sequences.")
    for name in ("frequency_penalty", "presence_penalty"):
        _number(data, name, 0.0, -2.0, 2.0)  # checked like OpenAI does; not applied
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", "'user' must be a string.", code="invalid_type")
    session = data.get("session_id") or session_header or ""
    if not isinstance(session, str) or len(session) > MAX_SESSION_ID:
        raise bad_param("session_id", f"'session_id' must be a string of at most "
                                      f"{MAX_SESSION_ID} characters.")
    return {
        "endpoint": endpoint, "model": model, "stream": stream,
        "include_usage": include_usage, "max_tokens": max_tokens,
        "temperature": _number(data, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "seed": _int(data, "seed", 0, 2**63 - 1), "stop": stops, "session_id": session,
    }


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise bad_param(f"messages[{index}].content", "Only text content parts are "
                                "supported by this server.", code="unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_param(f"messages[{index}].content", "Message content must be a string or a "
                                                  "list of text parts.", code="invalid_type")


def parse_chat(data: dict[str, Any], session_header: str | None = None) -> GenRequest:
    common = _common(data, "chat", ("max_completion_tokens", "max_tokens"), session_header)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "'messages' must be a non-empty list of messages.",
                        code="invalid_type" if messages is not None else "missing_required")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad_param(f"messages[{i}].role", f"messages[{i}] needs a role, one of "
                                                   f"{', '.join(sorted(CHAT_ROLES))}.")
        role = "system" if m["role"] == "developer" else m["role"]
        checked.append({"role": role, "content": _content(m, i)})
    _unsupported(data, "logprobs", (None, False))
    _unsupported(data, "tools", (None, []))
    _unsupported(data, "functions", (None, []))
    _unsupported(data, "response_format", (None, {"type": "text"}))
    return GenRequest(**common, messages=checked)


def parse_completion(data: dict[str, Any], session_header: str | None = None) -> GenRequest:
    common = _common(data, "text", ("max_tokens",), session_header)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    _unsupported(data, "echo", (None, False))
    _unsupported(data, "suffix", (None, ""))
    _unsupported(data, "logprobs", (None, 0))
    _unsupported(data, "best_of", (None, 1))
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "'prompt' must not be empty.")
        return GenRequest(**common, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt):
        return GenRequest(**common, tokens=list(prompt))
    raise bad_param("prompt", "'prompt' must be a non-empty string or list of token ids (a "
                              "batch of one; batches of several are not supported).",
                    code="invalid_type" if prompt is not None else "missing_required")


# --------------------------------------------------------------------------- responses


def usage(done: pb.Completion) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` is the prompt tokens not recomputed (as OpenAI,
    vLLM, SGLang and llama.cpp's server report it)."""
    completion_tokens = len(done.tokens)
    cached = min(done.cache_delta.tokens_read, done.prompt_tokens)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": done.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kvcache_details(done: pb.Completion, worker: str, tenant: str) -> dict[str, Any]:
    """kvcache's own account of the request, beside OpenAI's fields."""
    t = done.timings
    return {"hit_kind": done.cache_hit_kind, "tier": done.cache_tier,
            "tokens_restored": done.cache_delta.tokens_read,
            "tokens_saved": done.cache_delta.tokens_saved,
            "ttft_ms": round(t.ttft_ms, 3), "restore_ms": round(t.restore_ms, 3),
            "prefill_ms": round(t.prefill_ms, 3), "decode_ms": round(t.decode_ms, 3),
            "finish_key": done.finish_key, "session_id": done.session_id,
            "worker": worker, "tenant": tenant}


def finish_reason(done: pb.Completion) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def response_body(req: GenRequest, done: pb.Completion, extra: dict[str, Any]) -> dict[str, Any]:
    if req.endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": done.text,
                                    "refusal": None},
            "logprobs": None, "finish_reason": finish_reason(done)}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None,
                  "finish_reason": finish_reason(done)}
        kind = "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": req.model,
            "system_fingerprint": None, "choices": [choice], "usage": usage(done),
            "kvcache": extra}


def chunk(req: GenRequest, text: str | None = None, *, first: bool = False,
          finish: str | None = None, usage_body: dict[str, Any] | None = None,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: text, the closing chunk (``finish``), or the usage chunk
    (``usage_body``: no choices, as OpenAI sends it last when include_usage is set)."""
    choices: list[dict[str, Any]] = []
    if usage_body is None:
        if req.endpoint == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "logprobs": None,
                        "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None,
                        "finish_reason": finish}]
    body: dict[str, Any] = {
        "id": req.id, "object": "chat.completion.chunk" if req.endpoint == "chat"
        else "text_completion", "created": req.created, "model": req.model,
        "system_fingerprint": None, "choices": choices}
    if req.include_usage:
        body["usage"] = usage_body  # null on every chunk but the last, as OpenAI does
    if extra is not None:
        body["kvcache"] = extra
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
