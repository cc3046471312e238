"""The runtime service's stream messages (model_runtime/service.py::event_messages): a
reader that fell behind gets the tokens that were ready in one message per choice, the
text whole and in order, stamped with when the first of them was decoded; logprobs,
prompt and final records go one message each."""

from __future__ import annotations

from model_runtime.request import Completion, PromptDone, TokenEvent
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
