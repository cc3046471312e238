"""The generic family's output: the JSON envelope its grammar makes the model write,
``{"response": ...}`` or ``{"tool_calls": [...]}``."""

from __future__ import annotations

from .body import Body, Calls
from .deltas import ContentDelta, Delta
from .json_stream import Event, JsonReader, Path, StringDecoder

__all__ = ["Envelope"]


class Envelope(Body):
    """The generic family's JSON envelope: ``{"response": …}`` streams as content (a
    string decoded, any other JSON value as written), ``{"tool_calls": […]}`` as calls.
    Output that is not the envelope is content as written."""

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._reader = JsonReader(self._watch)
        self._string: StringDecoder | None = None
        self._raw = ""  # everything fed, for the fallback
        self._emitted_raw = False
        self._fallback = False

    @staticmethod
    def _watch(path: Path) -> bool:
        return path == ("response",) or (len(path) == 3 and path[0] == "tool_calls" and
                                         path[2] in ("name", "arguments"))

    def feed(self, text: str) -> list[Delta]:
        if self._fallback or self._reader.done:
            return [ContentDelta(text)] if text.strip() or self._fallback else []
        self._raw += text
        events, used = self._reader.feed(text)
        if any(kind == "begin" and path == () and first != "{" for kind, path, first in events):
            self._fallback = True  # not the envelope (an object): the text as it is
            return [ContentDelta(self._raw)]
        out = self._handle(events)
        if self._reader.failed:
            self._fallback = True
            if not out and not self.calls.calls:  # nothing shown yet: the text as it is
                return [ContentDelta(self._raw)]
            return out + [ContentDelta(text[used:])]
        rest = text[used:]
        if self._reader.done and rest.strip():
            out.append(ContentDelta(rest))
        return out

    def _handle(self, events: list[Event]) -> list[Delta]:
        out: list[Delta] = []
        for kind, path, text in events:
            if path == ("response",):
                if kind == "begin":
                    self._string = StringDecoder() if text == '"' else None
                elif kind == "chars":
                    piece = self._string.feed(text) if self._string else text
                    if piece:
                        out.append(ContentDelta(piece))
                elif kind == "end" and self._string is not None:
                    piece = self._string.feed("", final=True)
                    if piece:
                        out.append(ContentDelta(piece))
        out += self.calls.handle(events, lambda p: (p[1], str(p[2]))
                                 if len(p) == 3 and p[0] == "tool_calls" else None)
        return out

    def close(self) -> list[Delta]:
        if self._fallback:
            return []
        out = self._handle(self._reader.close())
        if self._string is not None and not self._reader.done:
            piece = self._string.feed("", final=True)
            if piece:
                out.append(ContentDelta(piece))
        return out
