"""One output parsed as it streams: the reasoning block, if the template has one, then
the body of the output's family."""

from __future__ import annotations

from collections.abc import Callable

from ..formats import ChatFormat, Family
from .body import Body, Calls, held_prefix
from .deltas import ContentDelta, Delta, ParsedOutput, ReasoningDelta
from .generic import Envelope
from .hermes_mistral import MarkedCalls
from .llama3 import BareCalls

__all__ = ["OutputParser"]


class OutputParser:
    """One output of one request, parsed as it streams.

    ``tools``: tool calls are read (in the family's syntax, or ``envelope`` for the
    generic family's JSON envelope); else everything after the reasoning is content.
    ``inside_reasoning``: the prompt opened the reasoning block (the output starts in it).
    """

    def __init__(self, fmt: ChatFormat, *, tools: bool = False, envelope: bool = False,
                 inside_reasoning: bool = False,
                 new_id: Callable[[], str] | None = None) -> None:
        self.calls = Calls(new_id or fmt.new_call_id)
        body: Body
        if envelope:
            body = Envelope(self.calls)
        elif tools and fmt.family in (Family.HERMES, Family.MISTRAL):
            body = MarkedCalls(self.calls, fmt.family)
        elif tools and fmt.family is Family.LLAMA3:
            body = BareCalls(self.calls)
        else:
            body = Body(self.calls)
        self._body = body
        self._markers = fmt.reasoning
        self._state = "reasoning" if inside_reasoning and fmt.reasoning else \
            "maybe" if fmt.reasoning else "body"
        self._buf = ""
        self._reasoned = False  # reasoning text given out (its leading space is dropped)
        self._after_reasoning = False  # the body's leading whitespace is dropped
        self.output = ParsedOutput()

    @property
    def past_reasoning(self) -> bool:
        """The reasoning block, if any, is over: what follows is the body."""
        return self._state == "body"

    def feed(self, text: str) -> list[Delta]:
        return self._record(self._feed(text))

    def close(self) -> list[Delta]:
        out: list[Delta] = []
        if self._state == "maybe":
            out += self._to_body(self._buf)
        elif self._state == "reasoning" and self._buf:
            out.append(ReasoningDelta(self._buf if self._reasoned else self._buf.lstrip()))
        elif self._state == "body" and self._buf:
            out += self._to_body(self._buf)
        self._buf = ""
        out += self._body.close()
        self.calls.close()
        return self._record(out)

    def _feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if self._state == "maybe":
                assert self._markers is not None
                start = self._markers[0]
                head = self._buf.lstrip()
                if head.startswith(start):
                    self._buf = head[len(start):]
                    self._state = "reasoning"
                    continue
                if start.startswith(head):  # (empty included) it may still come
                    return out
                self._state = "body"
                continue
            if self._state == "reasoning":
                assert self._markers is not None
                end = self._markers[1]
                at = self._buf.find(end)
                if at >= 0:
                    piece = self._buf[:at].rstrip()
                    if not self._reasoned:
                        piece = piece.lstrip()
                    if piece:
                        out.append(ReasoningDelta(piece))
                    self._buf = self._buf[at + len(end):]
                    self._state, self._after_reasoning = "body", True
                    continue
                keep = held_prefix(self._buf, end)
                body = self._buf[:len(self._buf) - keep]
                piece = body.rstrip()  # trailing space may be the block's end
                if not self._reasoned:
                    piece = piece.lstrip()
                if piece:
                    out.append(ReasoningDelta(piece))
                    self._reasoned = True
                    self._buf = body[len(body.rstrip()):] + self._buf[len(body):]
                return out
            # body
            text, self._buf = self._buf, ""
            if self._after_reasoning:
                text = text.lstrip()
                if not text:
                    return out
                self._after_reasoning = False
            out += self._to_body(text)
            return out

    def _to_body(self, text: str) -> list[Delta]:
        return self._body.feed(text) if text else []

    def _record(self, deltas: list[Delta]) -> list[Delta]:
        out = self.output
        merged: list[Delta] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if not d.text:
                    continue
                out.content += d.text
            elif isinstance(d, ReasoningDelta):
                if not d.text:
                    continue
                out.reasoning += d.text
            merged.append(d)
        out.tool_calls = self.calls.calls
        return merged
