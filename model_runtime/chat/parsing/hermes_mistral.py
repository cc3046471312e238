"""The Hermes and Mistral families' output: content, then tool calls after a marker:
Hermes' ``<tool_call>{...}</tool_call>``, one call each, Mistral's
``[TOOL_CALLS][{...}, ...]``, an array of them (also unmarked at the very start)."""

from __future__ import annotations

import re

from ..formats import HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKER, Family
from .body import Calls, StreamedCalls, held_prefix, watch_call_fields
from .deltas import ContentDelta, Delta
from .json_stream import JsonReader, Path

__all__ = ["MarkedCalls"]


class MarkedCalls(StreamedCalls):
    """Content, then calls each a JSON object between markers (Hermes), or (Mistral) an
    array of them after one marker or at the very start."""

    def __init__(self, calls: Calls, family: Family) -> None:
        super().__init__(calls)
        self.family = family
        self.marker = HERMES_OPEN if family is Family.HERMES else MISTRAL_MARKER
        self._state = "start" if family is Family.MISTRAL else "content"

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._buf:
            if self._state == "start":  # Mistral: an array of calls may come unmarked
                head = self._buf.lstrip()
                if re.match(r"\[\s*$", head) or (head and self.marker.startswith(head)):
                    break
                if re.match(r"\[\s*\{", head):
                    self._buf = head
                    self._start_calls()
                    continue
                self._state = "content"
            if self._state == "content":
                # Space before a call is the template's, not content: held until known.
                at = self._buf.find(self.marker)
                if at < 0:
                    keep = held_prefix(self._buf, self.marker)
                    text = self._buf[:len(self._buf) - keep]
                    shown = text.rstrip()
                    if shown:
                        out.append(ContentDelta(shown))
                    self._buf = self._buf[len(shown):]
                    break
                if self._buf[:at].rstrip():
                    out.append(ContentDelta(self._buf[:at].rstrip()))
                self._buf = self._buf[at + len(self.marker):]
                self._start_calls()
            elif self._state == "calls":
                whole = self._read_call(out)
                if whole is None:  # not JSON after all: the rest is content
                    self._state = "content"
                    continue
                if not whole:
                    break
                self._state = "after" if self.family is Family.HERMES else "between"
            elif self._state == "after":  # Hermes: the closing marker, then maybe more
                head = self._buf.lstrip()
                if head.startswith(HERMES_CLOSE):
                    self._buf, self._state = head[len(HERMES_CLOSE):], "between"
                elif not head or HERMES_CLOSE.startswith(head):
                    self._buf = head
                    break
                else:  # no closing marker: tolerated
                    self._buf, self._state = head, "between"
            elif self._state == "between":  # space between calls is not content
                head = self._buf.lstrip()
                if head.startswith(self.marker):
                    self._buf, self._state = head, "content"
                elif not head or self.marker.startswith(head):
                    self._buf = head
                    break
                else:
                    self._buf, self._state = head, "content"
        return out

    def _start_calls(self) -> None:
        depth = 1 if self.family is Family.HERMES else 2
        self._reader = JsonReader(watch_call_fields(depth))
        self._state = "calls"

    def _locate(self, path: Path) -> tuple[object, str] | None:
        if self.family is Family.HERMES:
            if len(path) == 1:
                return (self._n_read, str(path[0]))
            return None
        if len(path) == 2:
            return ((self._n_read, path[0]), str(path[1]))
        return None

    def close(self) -> list[Delta]:
        out: list[Delta] = []
        if self._state == "calls" and self._reader is not None:
            out += self.calls.handle(self._reader.close(), self._locate)
        elif self._buf and self._state in ("content", "start"):
            out.append(ContentDelta(self._buf))
        elif self._buf.strip() and self._state in ("after", "between"):
            out.append(ContentDelta(self._buf.strip()))
        self._buf = ""
        return out
