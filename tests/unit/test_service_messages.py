"""The runtime service's stream messages (model_runtime/service.py::event_messages): a
reader that fell behind gets the tokens that were ready in one message per choice, the
text whole and in order, stamped with when the first of them was decoded; logprobs,
prompt and final records go one message each. And a request read whole
(model_runtime/request.py::WholeAnswerEvents): its text waits for its end; and the queue
tells the model thread when a reader that was waiting came back for more (EventQueue)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from model_runtime.request import (
    Completion,
    EventQueue,
    PromptDone,
    RequestError,
    TokenEvent,
    WholeAnswerEvents,
)
from model_runtime.sampling import TokenLogprob
from model_runtime.service import event_messages


def piece(token: int) -> bytes:
    return f"<{token}>".encode()


def done(choice: int = 0) -> Completion:
    return Completion(text="", tokens=[], finish_reason="stop", finish_key="",
                      cache_hit_kind="cold", cache_delta={"tokens_read": 0, "tokens_saved": 0},
                      timings={}, prompt_tokens=3, choice=choice)


def kinds(batch: list[PromptDone | TokenEvent | Completion]) -> list[tuple[str, str, int]]:
    out = []
    for m in event_messages(batch, piece):
        kind = m.WhichOneof("event")
        out.append((kind, m.text if kind == "text" else "", m.decoded_ns))
    return out


def test_one_event_is_one_message_as_before() -> None:
    assert kinds([TokenEvent(7, "Hi", decoded_ns=100)]) == [("text", "Hi", 100)]


def test_tokens_ready_at_once_go_in_one_message_stamped_with_the_first() -> None:
    batch: list[PromptDone | TokenEvent | Completion] = [
        PromptDone(3, "cold", "", {"tokens_read": 0, "tokens_saved": 0}, []),
        TokenEvent(1, "He", decoded_ns=10), TokenEvent(2, "", decoded_ns=20),
        TokenEvent(3, "llo", decoded_ns=30), TokenEvent(-1, "!", decoded_ns=0), done()]
    assert kinds(batch) == [("prompt", "", 0), ("text", "Hello!", 10), ("done", "", 0)]


def test_choices_and_logprobs_are_not_merged() -> None:
    lp = TokenLogprob(5, -0.5, ((5, -0.5),))
    batch: list[PromptDone | TokenEvent | Completion] = [
        TokenEvent(1, "a", choice=0, decoded_ns=1), TokenEvent(2, "b", choice=1, decoded_ns=2),
        TokenEvent(3, "c", choice=1, decoded_ns=3), TokenEvent(5, "d", lp, decoded_ns=4),
        TokenEvent(6, "e", decoded_ns=5)]
    messages = list(event_messages(batch, piece))
    assert [(m.text, m.choice, m.decoded_ns) for m in messages] == [
        ("a", 0, 1), ("bc", 1, 2), ("d", 0, 4), ("e", 0, 5)]
    assert messages[2].logprob.piece == b"<5>"


def test_held_back_text_alone_sends_nothing() -> None:
    assert kinds([TokenEvent(4, "", decoded_ns=9)]) == []


def drained(events: queue.Queue[object]) -> list[object]:
    out = []
    with pytest.raises(queue.Empty):
        while True:
            out.append(events.get_nowait())
    return out


@pytest.mark.parametrize("end", [done(), RequestError("internal", "decode failed")],
                         ids=["final record", "error"])
def test_a_whole_answer_s_text_is_queued_with_its_end_in_order(end: object) -> None:
    """Its pieces wait, unseen, for the record or error that ends the request; then all
    of them are there at once, in order, before it (one wake-up for the reader)."""
    events = WholeAnswerEvents()
    prompt = PromptDone(3, "cold", "", {"tokens_read": 0, "tokens_saved": 0}, [])
    events.put(prompt)  # (not text: at once, as a streamed request's)
    assert drained(events) == [prompt]
    pieces = [TokenEvent(1, "He"), TokenEvent(2, "llo"), TokenEvent(-1, "!")]
    for event in pieces:
        events.put(event)
    assert drained(events) == []
    events.put(end)
    assert drained(events) == [*pieces, end]
    assert events.unfinished_tasks == 5


def test_an_event_queue_tells_when_a_reader_that_was_waiting_came_back_for_more() -> None:
    """put_watched gives a mark only when a reader waits (one that is behind is not
    waited for); wait_taken holds until that reader has taken the event and come back,
    and gives up after its timeout."""
    events = EventQueue()
    assert events.put_watched("nobody reads") is None
    assert events.get_nowait() == "nobody reads"
    taken: queue.Queue[object] = queue.Queue()
    release = threading.Event()

    def reader() -> None:
        while (item := events.get()) is not None:
            taken.put(item)
            release.wait()
            release.clear()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not events.reader_waiting():
            assert time.monotonic() < deadline, "the reader never waited"
            time.sleep(0.001)
        mark = events.put_watched("a token")
        assert mark is not None
        assert taken.get(timeout=10) == "a token"
        assert not events.wait_taken(mark, 0.05)  # taken, not sent yet: cut short
        release.set()
        assert events.wait_taken(mark, 10)
    finally:
        events.put(None)
        release.set()
        thread.join(timeout=10)
