"""What an API gives the pipeline, and what the pipeline asks of it.

An API's adapter converts each request at the door into a :class:`Call`: the gateway's
one request (:class:`GenRequest`) and what that API needs to answer it. Its formatter
(:class:`Formatter`) writes the answer from the worker's events, whole or streamed; an
:class:`Endpoint` pairs the two for a route. Everything between them (admission,
rendering, the worker's events, accounting, failures, cancellation) is the pipeline's
(run.py), written once for every API.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiohttp import web

from ...chat.prompt import PromptPlan
from ...v1 import runtime_pb2 as pb
from ..errors import ApiError
from .request import GenRequest

__all__ = ["SSE_HEADERS", "Call", "Endpoint", "Formatter", "kvcache_details"]

# A stream's headers, whatever the API: no cache, and no proxy buffering its events.
# The runtime's steps within its time to the first token, in order (pb.Timings).
TIMELINE = ("tokenize_ms", "queue_ms", "lookup_ms", "answer_wait_ms", "restore_ms", "prefill_ms",
            "sample_ms")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class Call:
    """One API request converted at the door: the gateway's request, and what its API
    answers with (its subclasses add their own)."""

    request: GenRequest

    def rename(self, err: ApiError) -> ApiError:
        """An error of the request, with the fields it names in this API's terms (the
        request's chat is named as OpenAI's chat completions name it)."""
        return err

    async def completed(self, done: pb.Completion, body: dict[str, Any]) -> None:
        """Before the client is told the request completed (``body``: the whole answer):
        an API's own work then (the Responses API stores the response). An
        :class:`ApiError` raised here is the request's answer."""


class Formatter(ABC):
    """One request's answer in its API's format, made from the worker's events: each
    method returns what a stream writes next (b"" when the request does not stream),
    while the formatter keeps what the whole answer needs."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        # The gateway's own account of the request (pipeline/timeline.py), filled in by
        # the pipeline before :meth:`finish` and given with kvcache_details.
        self.gateway: dict[str, Any] = {}

    @abstractmethod
    def opening(self, prompt: pb.PromptDone | pb.Completion) -> bytes:
        """A stream's first events, written when the first token (or the final record)
        arrives; ``prompt``: the runtime's account of the prompt."""

    @abstractmethod
    def text(self, event: pb.CompleteEvent) -> bytes:
        """A text event (one token's text, and its logprobs if asked for)."""

    def choice_done(self, done: pb.Completion) -> bytes:
        """A choice's final record, while others (n > 1) still run."""
        return b""

    @abstractmethod
    def finish(self, finished: list[pb.Completion]) -> tuple[dict[str, Any], bytes]:
        """The whole answer and a stream's closing events, once every choice's final
        record is in (``finished[-1]`` the last one's)."""

    @abstractmethod
    def error(self, err: ApiError) -> bytes:
        """A stream's error event: a failure after the stream started."""

    @abstractmethod
    def served(self) -> str:
        """The reply as the routing text of the conversation's next turn holds it
        (GenRequest.routing_text)."""


C = TypeVar("C", bound=Call)


@dataclass(frozen=True)
class Endpoint(Generic[C]):
    """A completion route of an API: ``convert`` reads a request's body (``large``: over
    the size that is parsed in the helper process) into its call, ``formatter`` makes
    the call's formatter once its prompt is rendered: (call, plan, worker, tenant)."""

    convert: Callable[[web.Request, bytes, bool], Awaitable[C]]
    formatter: Callable[[C, PromptPlan | None, str, str], Formatter]


def kvcache_details(done: pb.Completion, worker: str, tenant: str,
                    gateway: dict[str, Any],
                    finished: Sequence[pb.Completion] = ()) -> dict[str, Any]:
    """kvcache's own account of the request, beside each API's fields: its cache hit,
    where its time to the first token went in the runtime (``timeline``: tokenize,
    queue, cache lookup, restore, prefill, the first token's sampling; the runtime's
    ``ttft_ms`` counts from its receipt), the gateway's (``gateway``: the time before
    the worker had the request; streamed, each token's way from llama.cpp to the socket
    in ``token_path_ms``), and speculative decoding's drafted and accepted tokens over
    every choice of ``finished`` (else ``done``'s)."""
    records = finished or (done,)
    drafted = sum(d.drafted_tokens for d in records)
    accepted = sum(d.accepted_tokens for d in records)
    t = done.timings
    return {"hit_kind": done.cache_hit_kind, "tier": done.cache_tier,
            "tokens_restored": done.cache_delta.tokens_read,
            "tokens_saved": done.cache_delta.tokens_saved,
            "ttft_ms": round(t.ttft_ms, 3), "restore_ms": round(t.restore_ms, 3),
            "prefill_ms": round(t.prefill_ms, 3), "decode_ms": round(t.decode_ms, 3),
            "timeline": {name: round(getattr(t, name), 3) for name in TIMELINE},
            "gateway": dict(gateway),
            "finish_key": done.finish_key, "session_id": done.session_id,
            "worker": worker, "tenant": tenant,
            "speculation": {"drafted": drafted, "accepted": accepted,
                            "acceptance_rate": round(accepted / drafted, 4) if drafted
                            else None}}
