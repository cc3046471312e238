"""How a request on a worker can end other than with its answer: the worker failed
(:class:`WorkerFailure`, never replayed), or its runtime refused the request
(:class:`RuntimeRefused`, the worker is fine)."""

from __future__ import annotations

import grpc

__all__ = ["RuntimeRefused", "WorkerFailure"]


class WorkerFailure(Exception):
    """A request ended by its worker's failure; ``reason`` is the short code clients see."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RuntimeRefused(Exception):
    """The runtime answered the request with an error of its own (a bad request, a busy
    session): the worker is fine. ``code`` is the runtime's (prompt_too_long, sticky_busy,
    invalid_argument, ...), ``param`` the request field it refused ("": none named), as
    its Refusal says them (runtime.proto)."""

    def __init__(self, status: grpc.StatusCode, code: str, message: str,
                 param: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
