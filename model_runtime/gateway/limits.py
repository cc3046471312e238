"""The work one request may ask for (:class:`Limits`) and a request body read as JSON
within them: every API's body is checked here before its adapter reads its fields. Pure."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import ApiError, bad_param

MAX_DEPTH = 64  # nesting of the JSON body (a tool's schema is the deepest part)


@dataclass(frozen=True)
class Limits:
    """The work one request may ask for; each bound is refused with a 4xx naming it.
    ``body_bytes`` is checked before the body is read (Content-Length) and while it is
    (a body sent without one); the others once it is parsed, before any rendering.
    (tests/gateway/test_gateway_limits.py)"""

    body_bytes: int = 4 << 20
    messages: int = 4096
    chars: int = 2_000_000  # characters of every string in the body together
    depth: int = MAX_DEPTH

    def __post_init__(self) -> None:
        for name in ("body_bytes", "messages", "chars", "depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be an integer >= 1, got {value!r}")


def too_large(limits: Limits, size: int | None = None) -> ApiError:
    given = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"The request body{given} is larger than this server's limit of "
                         f"{limits.body_bytes} bytes (--max-body-bytes).",
                    code="request_too_large")


def parse_json(body: bytes, limits: Limits | None = None) -> dict[str, Any]:
    """The body as a JSON object, held to ``limits``: nesting depth, valid Unicode in every
    string (a lone surrogate such as ``\\ud800`` cannot be encoded for the worker), the
    characters of all strings together, and the number of chat messages."""
    limits = limits or Limits()
    try:
        data = json.loads(body)
    except RecursionError:  # nested deeper than the parser's own stack allows
        raise _too_deep(limits) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request ({exc}). The "
                            "body must be a JSON object.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    chars = 0
    for name, value in data.items():
        chars += check_text(name, name)
        chars += _check_value(name, value, limits)
        if chars > limits.chars:
            raise ApiError(413, f"The request's text is longer than this server's limit of "
                                f"{limits.chars} characters (--max-chars).", param=name,
                           code="request_too_large")
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limits.messages:
        raise bad_param("messages", f"Invalid 'messages': array too long. Expected an array "
                                    f"with maximum length {limits.messages} (--max-messages), "
                                    f"but got an array with length {len(messages)} instead.",
                        code="array_above_max_length")
    return data


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(param: str, text: str) -> int:
    """``text``'s length; a 400 naming ``param`` if it holds a lone surrogate (JSON's
    ``\\ud800`` escapes, or a header's bytes that are not UTF-8)."""
    if _SURROGATE.search(text):
        raise bad_param(param, f"'{param}' holds a lone surrogate or bytes that are not "
                               "UTF-8: text must be valid Unicode.")
    return len(text)


def _too_deep(limits: Limits) -> ApiError:
    return ApiError(400, f"The request body is nested deeper than {limits.depth} levels.",
                    code="invalid_json")


def _check_value(param: str, value: Any, limits: Limits) -> int:
    """Characters of every string in ``value`` (keys included), checked by
    :func:`check_text`; a 400 if it nests deeper than ``limits.depth``. Iterative, linear
    in the value's size."""
    chars = 0
    stack: list[tuple[Any, int]] = [(value, 2)]  # the body's object is level 1
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            chars += check_text(param, item)
        elif isinstance(item, (list, dict)):
            if depth > limits.depth:
                raise _too_deep(limits)
            if isinstance(item, dict):
                for key, sub in item.items():
                    chars += check_text(param, key)
                    stack.append((sub, depth + 1))
            else:
                stack.extend((sub, depth + 1) for sub in item)
    return chars

