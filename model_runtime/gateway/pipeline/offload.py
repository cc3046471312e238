"""The CPU work of large requests in a helper process: parsing a body and rendering a
chat.

Both hold Python's GIL for tens to hundreds of milliseconds on a large request; on a
thread of the gateway's process that still stalls its event loop, and with it every other
request (tools/bench_gateway_abuse.py). The helper has a GIL of its own: the event loop
only waits on a pipe. One helper, one job at a time (the routes send it large requests
only, one at a time). It is started with ``spawn`` (the gateway's gRPC threads make
``fork`` unsafe) and dies with the gateway, even a SIGKILLed one
(``PR_SET_PDEATHSIG``).

A job whose caller went away is told so through a flag in shared memory, which the
rendering checks as it does in process (``plan_chat``'s ``cancelled``): a dropped chat
stops costing within a few hundred pieces of output.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from ...chat.formats import ChatFormat, detect_format
from ...chat.grammars import SchemaError
from ...chat.messages import ChatInputError
from ...chat.prompt import PromptPlan, grammar_cost, plan_chat
from ...chat.templates import ChatTemplate, TemplateError
from ..apis.openai.adapter import parse_chat, parse_completion
from ..errors import ApiError, bad_param
from ..limits import Limits, parse_json
from ..workers.process import TemplateSpec
from .request import GenRequest

log = logging.getLogger("model_runtime.gateway")
PR_SET_PDEATHSIG = 1
CANCEL_FLAGS = 64  # jobs in flight at once, at most (one runs, the others queue)
# A chat whose grammar's schemas hold more symbols than this (grammar_budget's count) is
# rendered in the helper: converting them takes the GIL for milliseconds (a schema at the
# budget's edge, tens of them), which on a thread would be the event loop's.
HEAVY_GRAMMAR = 20_000
T = TypeVar("T")


def render_plan(req: GenRequest, template: ChatTemplate | None, fmt: ChatFormat | None,
                cancelled: Callable[[], bool] | None = None) -> PromptPlan | None:
    """A chat rendered with its model's template: the prompt, its save boundary, the
    grammar and how to read the output. Refusals are 400s naming their place."""
    if req.chat is None:
        return None
    if template is None or fmt is None:
        raise bad_param("messages", f"The model '{req.model}' has no chat template: use "
                                    "/v1/completions with a prompt.")
    try:
        return plan_chat(template, fmt, req.chat, cancelled)
    except ChatInputError as exc:
        raise bad_param(exc.param, exc.message) from None
    except SchemaError as exc:  # (the message without its place: the API names it)
        raise bad_param(exc.param, exc.detail) from None
    except TemplateError as exc:
        raise bad_param("messages", f"The model's chat template refused these messages: "
                                    f"{exc}") from None


def render_light(req: GenRequest, template: ChatTemplate | None, fmt: ChatFormat | None,
                 cancelled: Callable[[], bool], heavy_too: bool) -> tuple[bool, PromptPlan | None]:
    """:func:`render_plan`, unless the grammar of ``req``'s schemas holds over
    :data:`HEAVY_GRAMMAR` symbols and not ``heavy_too``: (False, None) then, for the
    helper to render it. Its budget is checked first either way: a 400 naming the first
    bound or place over it, before anything is built."""
    if req.chat is not None and not heavy_too:
        try:
            if grammar_cost(req.chat) > HEAVY_GRAMMAR:
                return False, None
        except SchemaError as exc:
            raise bad_param(exc.param, exc.detail) from None
    return True, render_plan(req, template, fmt, cancelled)


Parsed = tuple[bool, Any, "GenRequest | ApiError"]


def parse_request(body: bytes, limits: Limits, endpoint: str,
                  session_header: str | None) -> Parsed:
    """Whether the body is a JSON object within the limits, its ``model`` (whatever it
    is: the request's label, refused or not), and the request or the :class:`ApiError`
    that refuses it."""
    try:
        data = parse_json(body, limits)
    except ApiError as err:
        return False, None, err
    parse = parse_chat if endpoint == "chat" else parse_completion
    try:
        return True, data.get("model"), parse(data, session_header)
    except ApiError as err:
        return True, data.get("model"), err


# --------------------------------------------------------------------------- in the helper

_flags: Any = None  # the shared cancel flags
_templates: dict[TemplateSpec, tuple[ChatTemplate, ChatFormat]] = {}


def _start_helper(flags: Any) -> None:
    global _flags
    _flags = flags
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _ping() -> bool:
    return True


def _render_job(spec: TemplateSpec, req: GenRequest, job: int) -> PromptPlan | None:
    known = _templates.get(spec)
    if known is None:
        if len(_templates) >= 16:  # models served: few; a changed template replaces one
            _templates.clear()
        known = (ChatTemplate(spec.source, bos_token=spec.bos, eos_token=spec.eos,
                              add_bos=spec.add_bos), detect_format(spec.source))
        _templates[spec] = known
    slot = job % CANCEL_FLAGS
    return render_plan(req, *known, cancelled=lambda: bool(_flags[slot]))


# --------------------------------------------------------------------------- in the gateway


class Offload:
    """The helper, restarted when it died (killed, out of memory): the job it was doing
    runs once more on the new one (parsing and rendering change nothing); if that one
    dies too, the request is a 503 ``helper_failed``."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._flags = self._context.Array("b", CANCEL_FLAGS, lock=False)
        self._pool = self._new_pool()
        self._jobs = itertools.count()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=1, mp_context=self._context,
                                   initializer=_start_helper, initargs=(self._flags,))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            pool = self._pool
            try:
                return await loop.run_in_executor(pool, fn, *args)
            except BrokenProcessPool:
                if self._pool is pool:  # (another job may have replaced it already)
                    log.warning("the gateway's helper process died; starting another")
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = self._new_pool()
                if attempt == 1:
                    raise ApiError(503, "The gateway's helper process died twice on this "
                                        "request (it was not retried again).",
                                   type="server_error", code="helper_failed") from None
        raise AssertionError("unreachable")

    async def start(self) -> None:
        """Start the helper now rather than at the first large request."""
        await self._run(_ping)

    async def parse(self, body: bytes, limits: Limits, endpoint: str,
                    session_header: str | None) -> Parsed:
        return await self._run(parse_request, body, limits, endpoint, session_header)

    async def render(self, spec: TemplateSpec, req: GenRequest) -> PromptPlan | None:
        job = next(self._jobs)
        slot = job % CANCEL_FLAGS
        self._flags[slot] = 0
        try:
            return await self._run(_render_job, spec, req, job)
        except asyncio.CancelledError:  # the caller went away: the helper stops rendering
            self._flags[slot] = 1
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
