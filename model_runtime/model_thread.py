"""The model thread: the one thread that touches the llama.cpp context. It takes the
messages other threads put in its inbox (submits, cache answers, cancels, calls,
shutdown), hands each to the engine's core, and runs a tick (one batched
``llama_decode``) whenever requests run; with none, it blocks on the inbox."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .request import Message, RequestError, Shutdown

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("model_runtime")

# The longest hold of a batch for a cache answer, in resolve_wait_ms (see answer_hold).
HOLD_MAX_WAITS = 5


def answer_hold(resolve_wait_ms: int, last_batch_s: float) -> float:
    """Seconds the next batch may be held for a new request's cache answer:
    ``resolve_wait_ms`` or, where batches take longer, a quarter of the last one's time,
    at most HOLD_MAX_WAITS x resolve_wait_ms. The longer a batch, the more a missed answer
    costs the new request; the hold costs the running ones a fraction of one, once."""
    wait = resolve_wait_ms / 1000
    return max(wait, min(last_batch_s / 4, HOLD_MAX_WAITS * wait))


class ModelThread:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.count = engine.count
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, msg: Message) -> None:
        self._inbox.put(msg)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        engine, scheduler = self.engine, self.engine.scheduler
        while True:
            if engine.on_sequences is not None:
                self._guarded(engine.on_sequences, engine.seqs, not scheduler.running)
            # Block only when there is no work; otherwise just pick up what arrived.
            if not self._take(self._next(block=not scheduler.running)):
                return
            # A new request's cache answer due in moments is waited for, so that the
            # request starts in the next batch rather than the one after it (a batch of
            # running requests takes 10-120 ms; the answer ~2, now and then 5-15 on two
            # busy cores): missed, its TTFT loses a batch; held, theirs wait a fraction of
            # one, once. As llama-server's loop, which matches a new prompt against its
            # cache before its next batch.
            while (wait := self._resolution_due()) > 0:
                msg = self._next(block=True, timeout=wait)
                if msg is None:
                    break
                if not self._take(msg):
                    return
            if scheduler.running:
                self._guarded(engine.core.tick)

    def _take(self, msg: Message | None) -> bool:
        """Handle ``msg`` and everything else that arrived (all of it before the next
        tick); False once a Shutdown is done."""
        core = self.engine.core
        while msg is not None:
            if isinstance(msg, Shutdown):
                core.shutdown()
                msg.done.set()
                return False
            self._guarded(core.handle, msg)
            msg = self._next(block=False)
        return True

    def _resolution_due(self) -> float:
        """Seconds left to hold the next batch for a cache answer: while requests run
        (else the loop blocks for messages anyway), :func:`answer_hold` after the latest
        request sent to the resolver; 0 for none."""
        scheduler = self.engine.scheduler
        if not scheduler.running or not scheduler.resolving:
            return 0.0
        sent = max(r.timings.admitted for r in scheduler.resolving)
        hold = answer_hold(self.engine.config.resolve_wait_ms, self.engine.core.step_s)
        return sent + hold - time.perf_counter()

    def _next(self, *, block: bool, timeout: float | None = None) -> Message | None:
        try:
            return self._inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return None

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """A bug in one step must not kill the model thread and strand every caller:
        fail the requests in flight and keep serving."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("model thread step failed")
            self.count("internal_errors")
            self.engine.core.fail_running(
                RequestError("internal", f"internal error: {exc!r}"))
