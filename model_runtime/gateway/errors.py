"""The gateway's errors: :class:`ApiError`, an answer with its status in OpenAI's error
format (``{"error": {message, type, param, code}}``), which each API's error shape is made
from (apis/)."""

from __future__ import annotations

from typing import Any


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

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (it comes from the helper)
        return (_api_error, (self.status, self.message, self.type, self.param, self.code,
                             self.headers))


def _api_error(status: int, message: str, type: str, param: str | None, code: str | None,
               headers: dict[str, str]) -> ApiError:
    return ApiError(status, message, type=type, param=param, code=code, headers=headers)


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)

