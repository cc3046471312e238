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
from ...chat.prompt import PromptPlan
from ...chat.templates import ChatTemplate
from ..errors import ApiError
from ..workers.process import TemplateSpec
from .prompt import render_plan
from .request import GenRequest

log = logging.getLogger("model_runtime.gateway")
PR_SET_PDEATHSIG = 1
CANCEL_FLAGS = 64  # jobs in flight at once, at most (one runs, the others queue)
T = TypeVar("T")


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

    async def parse(self, parse: Callable[..., T], *args: Any) -> T:
        """``parse(*args)`` in the helper: an API's parsing of a large body (a function
        of its module, so that the helper can import it)."""
        return await self._run(parse, *args)

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
