"""The OpenAI API's requests: every field of chat completions and completions either
applied or refused with OpenAI's error body and status (:data:`CHAT_FIELDS`,
:data:`COMPLETION_FIELDS` say which and how), none accepted and ignored; a field this
server does not know is refused as OpenAI refuses it. A request becomes the gateway's
request (:class:`GenRequest`) in an :class:`OpenAICall` with OpenAI's own answer
settings. Pure functions and small types, no I/O: the routes (``routes``) call them; the
answers' shapes are in ``formatter``.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ....chat.messages import ChatInputError
from ....chat.prompt import ChatRequest
from ...errors import ApiError, bad_param
from ...limits import Limits, check_text, parse_json
from ...pipeline.contract import Call
from ...pipeline.request import GenRequest
from .chat import parse_messages, parse_response_format, parse_tool_choice, parse_tools

MAX_STOP = 4  # OpenAI accepts up to 4 stop sequences
MAX_N = 128
MAX_TOP_LOGPROBS = 20  # chat (OpenAI's bound)
MAX_TEXT_LOGPROBS = 5  # completions' integer logprobs (OpenAI's bound)
SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 256
MAX_TOKEN_ID = 2**31 - 1  # llama.cpp's llama_token is an int32
_TOKEN_ID = re.compile(r"[0-9]{1,10}")

_COMMON_FIELDS = {
    "model": "the served model's name (GET /v1/models)",
    "stream": "server-sent events",
    "stream_options": "include_usage: a last chunk with usage; include_obfuscation: false only",
    "max_tokens": "tokens to generate at most (with the prompt, must fit the context)",
    "n": "choices: the prompt computed once, copied to n slots of one worker",
    "stop": "up to 4 strings that end the text",
    "temperature": "0 to 2 (default 1)",
    "top_p": "nucleus sampling",
    "seed": "the sampler's seed (same seed, same settings: same output)",
    "frequency_penalty": "llama.cpp's penalties sampler",
    "presence_penalty": "llama.cpp's penalties sampler",
    "logit_bias": "token id -> bias (-100 to 100)",
    "user": "routes a user's requests to the worker holding their KV",
    # llama.cpp's server's names
    "top_k": "llama.cpp: keep the k most likely tokens",
    "min_p": "llama.cpp: drop tokens below min_p times the most likely's probability",
    "repeat_penalty": "llama.cpp: penalty of repeated tokens",
    "repeat_last_n": "llama.cpp: tokens the penalties look back on (-1: the context)",
    "grammar": "llama.cpp: a GBNF grammar the output must follow",
    # kvcache's own
    "session_id": "the runtime's sticky session (or the X-Session-Id header)",
    "speculative": "false: no speculative decoding for this request, true: on (it "
                   "changes no token either way)",
    # vLLM's and SGLang's, which vllm-router and sglang-router add to every body they pass
    # on (at the neutral values, which are what OpenAI does)
    "no_stop_trim": "SGLang: true: the stop string that ended the text stays at its end",
    "ignore_eos": "vLLM/SGLang: true: the model's end of turn does not end the text; it "
                  "goes on to max_tokens, a stop string or the context's end",
    "skip_special_tokens": "vLLM/SGLang: false: control tokens (<|im_end|>, ...) show in "
                           "the text",
    "return_hidden_states": "refused unless false",
}
#: Every field /v1/chat/completions reads, and how: applied, or "refused" (a 400 naming
#: it) for any value but null and those noted.
CHAT_FIELDS: Mapping[str, str] = {
    **_COMMON_FIELDS,
    "messages": "text parts, assistant tool_calls, tool results, developer",
    "max_completion_tokens": "as max_tokens (wins over it)",
    "tools": "function tools; calls in the model's own syntax, or a JSON envelope",
    "tool_choice": "none, auto, required, or a named function (grammar-constrained)",
    "parallel_tool_calls": "false: at most one call",
    "response_format": "text, json_object, json_schema (held to the schema)",
    "logprobs": "each token's log probability",
    "top_logprobs": "0 to 20 most likely tokens at each place",
    "prompt_cache_key": "routes requests with the same key to the same worker",
    "service_tier": "refused unless 'auto' or 'default' (there is one tier)",
    "store": "refused unless false (nothing is stored)",
    "metadata": "refused (only kept with store)",
    "modalities": "refused unless ['text']",
    "audio": "refused",
    "prediction": "content (a string or text parts): drafted first, verified token by "
                  "token (the output is what it would be without it)",
    "reasoning_effort": "refused (use chat_template_kwargs, e.g. enable_thinking)",
    "verbosity": "refused",
    "web_search_options": "refused",
    "safety_identifier": "refused",
    "functions": "refused (deprecated; use tools)",
    "function_call": "refused (deprecated; use tool_choice)",
    "chat_template_kwargs": "llama.cpp/vLLM: variables for the chat template",
    "add_generation_prompt": "vLLM: false: the chat is rendered without the assistant "
                             "turn's opening (the model writes it)",
    "continue_final_message": "vLLM: true (with add_generation_prompt false): the last "
                              "message, an assistant's, is left open and the reply "
                              "continues it",
    "include_reasoning": "false: a thinking model's reasoning is left out of the answer "
                         "(true: in reasoning_content)",
    "separate_reasoning": "SGLang: false: a thinking model's reasoning stays in content, as "
                          "the model wrote it (true: in reasoning_content)",
    "stream_reasoning": "SGLang: false: streamed reasoning comes in one delta where it ends "
                        "(true: as it is generated)",
}
#: Every field /v1/completions reads, and how.
COMPLETION_FIELDS: Mapping[str, str] = {
    **_COMMON_FIELDS,
    "prompt": "a string or token ids (a batch of one)",
    "logprobs": "0 to 5: each token's log probability and that many most likely",
    "echo": "refused unless false",
    "suffix": "refused (no fill-in-the-middle)",
    "best_of": "refused above 1",
}
# Refused fields: a value other than these is a 400.
_ONLY = {"metadata": (None,), "audio": (None,),
         "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
         "safety_identifier": (None,), "functions": (None, []), "function_call": (None,),
         "store": (None, False), "service_tier": (None, "auto", "default"),
         "modalities": (None, ["text"]), "echo": (None, False), "suffix": (None, ""),
         "best_of": (None, 1),
         # the routers' fields this server cannot honour: their neutral values only
         "return_hidden_states": (None, False)}


@dataclass
class OpenAICall(Call):
    """A chat completions (``endpoint`` "chat") or completions ("text") request: the
    gateway's request and how OpenAI answers it (``include_usage``: a last chunk with
    usage; ``include_reasoning``: a thinking model's reasoning in the answer, and SGLang's
    ``separate_reasoning`` and ``stream_reasoning``; the answer's ``id`` and
    ``created``)."""

    request: GenRequest
    endpoint: str
    include_usage: bool = False
    include_reasoning: bool = True
    separate_reasoning: bool = True  # False: the reasoning stays in the content
    stream_reasoning: bool = True  # False: the reasoning streamed in one delta at its end
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.endpoint == "chat" else "cmpl"
            self.id = f"{prefix}-{secrets.token_hex(12)}"

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"


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


def _bool(data: dict[str, Any], name: str, default: bool = False) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_param(name, f"Invalid value for '{name}': {value!r}; it must be a boolean.",
                        code="invalid_type")
    return value


def _string(data: dict[str, Any], name: str, limit: int = MAX_SESSION_ID) -> str:
    value = data.get(name)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise bad_param(name, f"'{name}' must be a string of at most {limit} characters.",
                        code="invalid_type")
    return value


def _check_fields(data: dict[str, Any], known: Mapping[str, str]) -> None:
    """OpenAI's answer to a field it does not know; and refused fields' values."""
    for name in data:
        if name not in known:
            raise bad_param(name, f"Unrecognized request argument supplied: {name}",
                            code="unknown_parameter")
    for name, allowed in _ONLY.items():
        if name in known and name in data and data[name] not in allowed:
            raise bad_param(name, f"'{name}' is not supported by this server "
                                  f"({known[name]}).", code="unsupported_parameter")


def _logit_bias(data: dict[str, Any]) -> dict[int, float]:
    value = data.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_param("logit_bias", "'logit_bias' must map token ids to biases.",
                        code="invalid_type")
    out: dict[int, float] = {}
    for key, bias in value.items():
        # Token ids as JSON writes integers: ASCII digits (int() would also take "+5",
        # " 5", "5_0" and other scripts' digits), below llama.cpp's int32 token type.
        if not _TOKEN_ID.fullmatch(key) or int(key) > MAX_TOKEN_ID:
            raise bad_param("logit_bias", f"Invalid 'logit_bias': key {key[:40]!r} is not a "
                                          f"token id (an integer from 0 to {MAX_TOKEN_ID}).")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                not math.isfinite(bias) or not -100 <= bias <= 100:
            raise bad_param("logit_bias", f"Invalid 'logit_bias': the bias of token {key} is "
                                          f"{bias!r}; it must be a number from -100 to 100.")
        out[int(key)] = float(bias)
    return out


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
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                            "include_obfuscation"}:
            raise bad_param("stream_options", "'stream_options' takes include_usage (and "
                                              "include_obfuscation false).",
                            code="invalid_type")
        include_usage = _bool(options, "include_usage")
        if _bool(options, "include_obfuscation"):
            raise bad_param("stream_options", "include_obfuscation is not supported by this "
                                              "server.", code="unsupported_parameter")
    max_tokens = None
    for name in max_tokens_names:  # max_completion_tokens wins over max_tokens
        value = _int(data, name, 1, 2**31 - 1)
        if value is not None:
            max_tokens = value
            break
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
    session = data.get("session_id") or session_header or ""
    if not isinstance(session, str) or len(session) > MAX_SESSION_ID:
        raise bad_param("session_id", f"'session_id' must be a string of at most "
                                      f"{MAX_SESSION_ID} characters.")
    check_text("session_id", session)  # the header's bytes may not be UTF-8
    if session and (data.get("n") or 1) != 1:
        raise bad_param("n", "n > 1 cannot run in a sticky session (a session holds one "
                             "sequence).")
    grammar = data.get("grammar")
    if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
        raise bad_param("grammar", "'grammar' must be a GBNF grammar (a non-empty string).",
                        code="invalid_type")
    repeat_last_n = _int(data, "repeat_last_n", -1, 2**31 - 1)
    return {
        "endpoint": endpoint, "model": model, "stream": stream,
        "include_usage": include_usage, "max_tokens": max_tokens,
        "temperature": _number(data, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "seed": _int(data, "seed", 0, 2**63 - 1), "stop": stops, "session_id": session,
        "n": _int(data, "n", 1, MAX_N) or 1,
        "route_key": _string(data, "user"),
        "top_k": _int(data, "top_k", 0, 2**31 - 1) or 0,
        "min_p": _number(data, "min_p", 0.0, 0.0, 1.0) if data.get("min_p") is not None
        else None,
        "presence_penalty": _number(data, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        "repeat_penalty": _number(data, "repeat_penalty", 1.0, 0.0, 10.0, low_open=True)
        if data.get("repeat_penalty") is not None else None,
        "repeat_last_n": repeat_last_n,
        "logit_bias": _logit_bias(data), "grammar": grammar,
        "keep_stop": _bool(data, "no_stop_trim"), "ignore_eos": _bool(data, "ignore_eos"),
        "special_tokens": not _bool(data, "skip_special_tokens", True),
        "speculative": None if data.get("speculative") is None
        else _bool(data, "speculative"),
    }


def _chat_input(exc: ChatInputError) -> ApiError:
    return bad_param(exc.param, exc.message)


def parse_chat(data: dict[str, Any], session_header: str | None = None) -> OpenAICall:
    _check_fields(data, CHAT_FIELDS)
    common = _common(data, "chat", ("max_completion_tokens", "max_tokens"), session_header)
    answer = _answer(common)
    grammar = common.pop("grammar")
    route = _string(data, "prompt_cache_key", 1024) or common["route_key"]
    logprobs = _bool(data, "logprobs")
    top = _int(data, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_param("top_logprobs", "'top_logprobs' needs 'logprobs' set to true.")
    variables = data.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise bad_param("chat_template_kwargs", "'chat_template_kwargs' must be an object.",
                        code="invalid_type")
    try:
        messages = parse_messages(data.get("messages"))
        tools = parse_tools(data.get("tools"))
        choice = parse_tool_choice(data.get("tool_choice"), tools)
        schema, schema_param = parse_response_format(data.get("response_format"))
    except ChatInputError as exc:
        code = "missing_required" if exc.param == "messages" and data.get("messages") is None \
            else "invalid_value"
        raise bad_param(exc.param, exc.message, code=code) from None
    chat = ChatRequest(messages, tools, choice, _bool(data, "parallel_tool_calls", True),
                       schema, schema_param, grammar, variables,
                       add_generation_prompt=_bool(data, "add_generation_prompt", True),
                       continue_final_message=_bool(data, "continue_final_message"))
    return OpenAICall(GenRequest(**{**common, "route_key": route}, logprobs=logprobs,
                                 top_logprobs=top, chat=chat,
                                 prediction=_prediction(data.get("prediction"))), **answer,
                      include_reasoning=_bool(data, "include_reasoning", True),
                      separate_reasoning=_bool(data, "separate_reasoning", True),
                      stream_reasoning=_bool(data, "stream_reasoning", True))


def _prediction(value: Any) -> str:
    """``prediction``'s content: ``{"type": "content", "content": text or text parts}``."""
    if value is None:
        return ""
    content = value.get("content") if isinstance(value, dict) else None
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(value, dict) or value.get("type") != "content" or \
            set(value) != {"type", "content"} or not isinstance(content, str):
        raise bad_param("prediction", "'prediction' must be {\"type\": \"content\", "
                                      "\"content\": ...} with a string or a list of text "
                                      "parts as its content.", code="invalid_type")
    return content


def parse_completion(data: dict[str, Any], session_header: str | None = None) -> OpenAICall:
    _check_fields(data, COMPLETION_FIELDS)
    common = _common(data, "text", ("max_tokens",), session_header)
    answer = _answer(common)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    top = _int(data, "logprobs", 0, MAX_TEXT_LOGPROBS)
    logprobs, top_logprobs = top is not None, top or 0
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "'prompt' must not be empty.")
        return OpenAICall(GenRequest(**common, logprobs=logprobs, top_logprobs=top_logprobs,
                                     prompt=prompt), **answer)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt):
        return OpenAICall(GenRequest(**common, logprobs=logprobs, top_logprobs=top_logprobs,
                                     tokens=list(prompt)), **answer)
    raise bad_param("prompt", "'prompt' must be a non-empty string or list of token ids (a "
                              "batch of one; batches of several are not supported).",
                    code="invalid_type" if prompt is not None else "missing_required")


def _answer(common: dict[str, Any]) -> dict[str, Any]:
    """The fields of :func:`_common` that say how OpenAI answers, taken out of it."""
    return {"endpoint": common.pop("endpoint"), "include_usage": common.pop("include_usage")}


Parsed = tuple[bool, Any, "OpenAICall | ApiError"]


def parse_request(body: bytes, limits: Limits, endpoint: str,
                  session_header: str | None) -> Parsed:
    """Whether the body is a JSON object within the limits, its ``model`` (whatever it
    is: the request's label, refused or not), and the call or the :class:`ApiError`
    that refuses it. Runs on a thread, or in the helper process for a large body."""
    try:
        data = parse_json(body, limits)
    except ApiError as err:
        return False, None, err
    parse = parse_chat if endpoint == "chat" else parse_completion
    try:
        return True, data.get("model"), parse(data, session_header)
    except ApiError as err:
        return True, data.get("model"), err


__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "SESSION_HEADER", "OpenAICall", "parse_chat",
           "parse_completion", "parse_request"]
