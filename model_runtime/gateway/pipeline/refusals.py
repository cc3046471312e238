"""A request's end on its worker as the gateway's error (:class:`ApiError`), one place for
every API: the runtime's refusal (its code and the field it names, runtime.proto's
Refusal) and the worker's failure. Each API then writes the error in its own shape, its
fields named in its own terms (apis/<api>/)."""

from __future__ import annotations

import grpc

from ..errors import ApiError
from ..workers.errors import RuntimeRefused, WorkerFailure
from .request import GenRequest

__all__ = ["RUNTIME_PARAMS", "failure_error", "refusal_error"]

#: The runtime's request fields that the APIs name otherwise.
RUNTIME_PARAMS = {"penalty_last_n": "repeat_last_n"}


def refusal_error(exc: RuntimeRefused, req: GenRequest) -> ApiError:
    """The runtime's refusal of ``req`` as the client is told it."""
    if exc.code == "request_too_large":
        return ApiError(413, exc.message, code="request_too_large")
    if exc.code == "prompt_too_long":
        return ApiError(400, f"This model's maximum context length is exceeded: "
                             f"{exc.message}.", param="messages" if req.chat is not None
                        else "prompt", code="context_length_exceeded")
    if exc.status == grpc.StatusCode.FAILED_PRECONDITION:  # sticky_busy
        return ApiError(409, f"{exc.code}: {exc.message}", param="session_id",
                        code="session_busy")
    param = RUNTIME_PARAMS.get(exc.param, exc.param)
    chat = req.chat
    if param == "grammar" and chat is not None and chat.grammar is None:  # ours, not given
        param = "tool_choice" if chat.tools and chat.tool_choice.mode != "none" else \
            "response_format"
    return ApiError(400, exc.message, param=param or None, code="invalid_value")


def failure_error(exc: WorkerFailure) -> ApiError:
    return ApiError(503, f"The request failed: {exc.detail} ({exc.reason}; it was not "
                         "retried).", type="server_error", code=exc.reason)
