"""JSON read as it streams: :class:`JsonReader` says where each part of one value is
while its text comes in pieces, and :class:`StringDecoder` decodes a string's raw text
as it comes, holding back an escape cut in two (``\\u00e``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WS", "Event", "JsonReader", "Path", "StringDecoder"]

Path = tuple[object, ...]
Event = tuple[str, Path, str]  # ("begin", path, first char) | ("chars" | "end", path, text)
WS = " \t\r\n"
PRIMITIVE = set("-+.0123456789eEtruefalsn")


@dataclass
class _Frame:
    kind: str  # "obj" | "arr"
    path: Path
    state: str
    key: str = ""
    index: int = 0


class JsonReader:
    """One JSON value read from pieces, reporting where each part of it is: ``begin``
    and ``end`` of every value (with its path of keys and indices from the top), and
    the raw text of the values ``watch`` selects, in ``chars`` events as it comes and
    whole at their ``end``. Stops after the value: ``feed`` says how much it used.
    Text that is not JSON sets ``failed``."""

    def __init__(self, watch: Callable[[Path], bool]) -> None:
        self.watch = watch
        self.done = False
        self.failed = False
        self._stack: list[_Frame] = []
        self._mode = ""  # "" | "string" | "key" | "prim"
        self._escape = False
        self._key: list[str] = []
        self._scalar: Path = ()
        self._open: list[tuple[Path, list[str], list[str]]] = []  # watched: chunk, whole
        self._started = False

    def feed(self, text: str) -> tuple[list[Event], int]:
        events: list[Event] = []
        i = 0
        while i < len(text) and not self.done and not self.failed:
            if self._step(text[i], events):
                i += 1
        self._flush(events)
        return events, i

    def close(self) -> list[Event]:
        """The end of the text: a number or literal at the very end is complete."""
        events: list[Event] = []
        if self._mode == "prim":
            self._mode = ""
            self._value_ends(self._scalar, events)
            self._after_value()
        self._flush(events)
        return events

    # -- one character; False when it must be read again (it ended a number) -----------
    def _step(self, ch: str, events: list[Event]) -> bool:
        if self._mode in ("string", "key"):
            self._take(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                if self._mode == "key":
                    owner = self._stack[-1]  # the object whose key this string is
                    owner.key = json.loads('"' + "".join(self._key) + '"')
                    owner.state = "colon"
                else:
                    self._value_ends(self._scalar, events)
                    self._after_value()
                self._mode = ""
                return True
            if self._mode == "key":
                self._key.append(ch)
            return True
        if self._mode == "prim":
            if ch in PRIMITIVE:
                self._take(ch)
                return True
            self._mode = ""
            self._value_ends(self._scalar, events)
            self._after_value()
            return False
        if ch in WS:
            self._take(ch)
            return True
        frame = self._stack[-1] if self._stack else None
        if frame is None:
            if self._started:
                self.failed = True
                return True
            self._started = True
            self._begin((), ch, events)
            return True
        if (ch == "}" and frame.kind == "obj" and frame.state in ("key_or_close",
                                                                   "comma_or_close")) or \
                (ch == "]" and frame.kind == "arr" and frame.state in ("value_or_close",
                                                                        "comma_or_close")):
            self._take(ch)
            self._stack.pop()
            self._value_ends(frame.path, events)
            self._after_value()
        elif frame.state in ("value", "value_or_close"):
            sub = frame.key if frame.kind == "obj" else frame.index
            self._begin((*frame.path, sub), ch, events)
        elif frame.kind == "obj" and frame.state in ("key_or_close", "key") and ch == '"':
            self._take(ch)
            self._mode, self._key = "key", []
        elif frame.state == "colon" and ch == ":":
            self._take(ch)
            frame.state = "value"
        elif frame.state == "comma_or_close" and ch == ",":
            self._take(ch)
            if frame.kind == "obj":
                frame.state = "key"
            else:
                frame.state, frame.index = "value", frame.index + 1
        else:
            self.failed = True
        return True

    def _begin(self, path: Path, ch: str, events: list[Event]) -> None:
        if ch not in '{["' and ch not in PRIMITIVE:
            self.failed = True
            return
        events.append(("begin", path, ch))
        if self.watch(path):
            self._open.append((path, [], []))
        self._take(ch)
        if ch == "{":
            self._stack.append(_Frame("obj", path, "key_or_close"))
        elif ch == "[":
            self._stack.append(_Frame("arr", path, "value_or_close"))
        else:
            self._mode, self._scalar = ("string" if ch == '"' else "prim"), path

    def _take(self, ch: str) -> None:
        for _, chunk, whole in self._open:
            chunk.append(ch)
            whole.append(ch)

    def _value_ends(self, path: Path, events: list[Event]) -> None:
        if self._open and self._open[-1][0] == path:
            _, chunk, whole = self._open.pop()
            if chunk:
                events.append(("chars", path, "".join(chunk)))
            events.append(("end", path, "".join(whole)))
        else:
            events.append(("end", path, ""))

    def _after_value(self) -> None:
        if self._stack:
            self._stack[-1].state = "comma_or_close"
        else:
            self.done = True

    def _flush(self, events: list[Event]) -> None:
        for path, chunk, _ in self._open:
            if chunk:
                events.append(("chars", path, "".join(chunk)))
                chunk.clear()


_HIGH_SURROGATE_AT_END = re.compile(r"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})$")


def _escape_start(raw: str) -> int:
    """Where an escape cut short begins at the end of a JSON string's raw text (held
    back), or ``len(raw)``. A high surrogate's escape waits for its low half."""
    cut = len(raw)
    last = raw.rfind("\\")
    if last >= 0:
        run = last - len(raw[:last].rstrip("\\")) + 1  # backslashes ending at `last`
        tail = raw[last:]
        if run % 2 == 1 and (len(tail) < 2 or (tail[1] == "u" and len(tail) < 6)):
            cut = last
    high = _HIGH_SURROGATE_AT_END.search(raw[:cut])
    return high.start(1) if high else cut


def _ends_unescaped(raw: str, ch: str) -> bool:
    """Whether ``raw`` ends with ``ch`` not escaped by a backslash."""
    if not raw.endswith(ch):
        return False
    body = raw[:-1]
    return (len(body) - len(body.rstrip("\\"))) % 2 == 0


class StringDecoder:
    """A JSON string's raw text, quotes included, decoded as it comes."""

    def __init__(self) -> None:
        self._raw = ""
        self._opened = False

    def feed(self, chunk: str, final: bool = False) -> str:
        body = self._raw + chunk
        if not self._opened and body.startswith('"'):
            body, self._opened = body[1:], True
        closed = _ends_unescaped(body, '"')  # only the closing quote is not escaped
        if closed:
            body = body[:-1]
        cut = len(body) if final or closed else _escape_start(body)
        self._raw = body[cut:]
        try:
            return str(json.loads('"' + body[:cut] + '"'))
        except ValueError:  # not JSON's escapes after all: shown as written
            return body[:cut]
