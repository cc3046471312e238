"""The Llama 3.x family's output: bare JSON call objects, or content."""

from __future__ import annotations

import re

from .body import Calls, StreamedCalls, watch_call_fields
from .deltas import ContentDelta, Delta
from .json_stream import WS, JsonReader, Path

__all__ = ["BareCalls"]


class BareCalls(StreamedCalls):
    """Llama 3.x: the whole output is one or more JSON call objects (a first key "name"
    or "type"), or it is content."""

    START = re.compile(r'\s*(<\|python_tag\|>)?\s*\{\s*"(name|type)"')
    UNDECIDED = re.compile(r'\s*(<\|python_tag\|>|<\|python_tag|<\|py?t?h?o?n?_?t?a?g?)?\s*'
                           r'(\{\s*("\w{0,4})?)?$')

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._state = "start"

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._buf:
            if self._state == "start":
                match = self.START.match(self._buf)
                if match is None:
                    if self.UNDECIDED.match(self._buf):
                        break
                    self._state = "content"
                    continue
                self._buf = self._buf[self._buf.index("{"):]
                self._next_call()
            elif self._state == "calls":
                whole = self._read_call(out)
                if whole is None:  # not JSON after all: the rest is content
                    self._state = "content"
                    continue
                if not whole:
                    break
                self._state = "between"
            elif self._state == "between":
                head = self._buf.lstrip(WS + ";")
                if not head:
                    self._buf = ""
                    break
                if head.startswith("{"):
                    self._buf = head
                    self._next_call()
                else:
                    self._buf = head
                    self._state = "content"
            else:
                out.append(ContentDelta(self._buf))
                self._buf = ""
        return out

    def _next_call(self) -> None:
        self._reader = JsonReader(watch_call_fields(1))
        self._state = "calls"

    def _locate(self, path: Path) -> tuple[object, str] | None:
        return (self._n_read, str(path[0])) if len(path) == 1 else None

    def close(self) -> list[Delta]:
        out: list[Delta] = []
        if self._state == "calls" and self._reader is not None:
            out += self.calls.handle(self._reader.close(), self._locate)
        elif self._state in ("start", "content") and self._buf:
            out.append(ContentDelta(self._buf))
        self._buf = ""
        return out
