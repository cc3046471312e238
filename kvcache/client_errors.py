"""The client's errors: what a failed call to the daemon raises (kvcache.client), with its
status said in words people read, never as a gRPC name."""

from __future__ import annotations

import re

import grpc


class CacheError(Exception):
    """A call the daemon answered with an error status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class CacheUnavailable(CacheError):
    """The daemon could not be reached (or did not answer in time)."""


class CorruptBlob(CacheError):
    """A blob failed its checksums; the daemon was told and quarantined it."""



class NotAPrefix(CacheError):
    """An entry whose first ``needed`` tokens are not the prompt's (its first ``shared``
    are): a key its caller chose that the prompt does not extend, or a wrong lookup."""

    def __init__(self, key: bytes, needed: int, n_tokens: int, shared: int) -> None:
        super().__init__(f"entry {key.hex()} does not hold the prompt's first {needed} "
                         f"tokens (of its {n_tokens}, the first {shared} are the prompt's)")
        self.needed, self.n_tokens, self.shared = needed, n_tokens, shared

# What an unreachable daemon's status means, said in words.
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE: "is unavailable",
                grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer in time",
                grpc.StatusCode.CANCELLED: "stopped answering (call cancelled)"}
# Messages are read by people: a status is said in words, never as its gRPC name.
_STATUS_WORDS = {
    grpc.StatusCode.NOT_FOUND: "not found",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid request",
    grpc.StatusCode.FAILED_PRECONDITION: "refused",
    grpc.StatusCode.PERMISSION_DENIED: "permission denied",
    grpc.StatusCode.UNAUTHENTICATED: "not authenticated",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "no room",
    grpc.StatusCode.OUT_OF_RANGE: "out of range",
    grpc.StatusCode.ALREADY_EXISTS: "already exists",
    grpc.StatusCode.ABORTED: "aborted",
    grpc.StatusCode.UNIMPLEMENTED: "not supported by this daemon",
    grpc.StatusCode.INTERNAL: "daemon error",
    grpc.StatusCode.UNKNOWN: "daemon error",
}
# gRPC's own texts name statuses too ("last error: UNAVAILABLE: ipv4:...").
_STATUS_NAME_IN_TEXT = re.compile(r"\b(?:" + "|".join(c.name for c in grpc.StatusCode)
                                  + r"): ")


def status_words(code: grpc.StatusCode | None) -> str:
    if code is None:
        return "error"
    return _STATUS_WORDS.get(code, code.name.lower().replace("_", " "))


def wrap(exc: grpc.RpcError, address: str) -> CacheError:
    """The CacheError a failed call to the daemon at ``address`` raises."""
    code = exc.code() if hasattr(exc, "code") else None
    details = _STATUS_NAME_IN_TEXT.sub("", exc.details() if hasattr(exc, "details")
                                       else str(exc)) or ""
    if code == grpc.StatusCode.DATA_LOSS:
        return CorruptBlob(details, code)
    if code is not None and code in _UNAVAILABLE:
        return CacheUnavailable(_unavailable_message(code, details, address), code)
    return CacheError(f"{status_words(code)}: {details}", code)


def _unavailable_message(code: grpc.StatusCode, details: str, address: str) -> str:
    said = f"kvcache daemon at {address} {_UNAVAILABLE[code]}"
    # gRPC's "Deadline Exceeded" and "Cancelled" only repeat what `said` says.
    if details.lower().replace(" ", "_") in ("", code.name.lower()):
        return said
    return f"{said} ({details})"
