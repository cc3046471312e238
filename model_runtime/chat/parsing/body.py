"""What follows the reasoning, for every family: the tool calls as their parts are read
(:class:`Calls`), plain content (:class:`Body`), and the base of the bodies whose calls
are JSON read as it streams (:class:`StreamedCalls`: hermes_mistral, llama3)."""

from __future__ import annotations

import json
from collections.abc import Callable

from .deltas import ContentDelta, Delta, ParsedCall, ToolCallDelta
from .json_stream import Event, JsonReader, Path

__all__ = ["ARGUMENT_KEYS", "Body", "Calls", "StreamedCalls", "held_prefix",
           "watch_call_fields"]

ARGUMENT_KEYS = ("arguments", "parameters")


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (kept back: the
    next piece may complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Calls:
    """Tool calls as their parts are read. A call exists once its name is complete: its
    first delta carries its id and name (and the arguments written before the name,
    held until then). A call whose name never completes (the output was cut short
    there) is no call: nothing of it is ever given out, and its index is not used."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.calls: list[ParsedCall] = []  # the named calls, in the order they were named
        self._index: dict[object, int] = {}  # a call's key -> its index in ``calls``
        self._held: dict[object, list[str]] = {}  # arguments of a call not named yet

    def handle(self, events: list[Event],
               locate: Callable[[Path], tuple[object, str] | None]) -> list[Delta]:
        out: list[Delta] = []
        for kind, path, text in events:
            found = locate(path)
            if found is None:
                continue
            key, part = found
            index = self._index.get(key)
            if part == "name" and kind == "end" and index is None:
                try:
                    name = json.loads(text)
                except ValueError:
                    name = text
                held = "".join(self._held.pop(key, []))
                call = ParsedCall(self.new_id(), name if isinstance(name, str) else str(name),
                                  held)
                index = self._index[key] = len(self.calls)
                self.calls.append(call)
                out.append(ToolCallDelta(index, call.id, call.name, held))
            elif part in ARGUMENT_KEYS and kind == "chars":
                if index is None:
                    self._held.setdefault(key, []).append(text)
                else:
                    self.calls[index].arguments += text
                    out.append(ToolCallDelta(index, arguments=text))
        return out

    def close(self) -> None:
        """The output ended: arguments still waiting for their call's name were of a
        call cut short before its name was complete, and are dropped with it."""
        self._held.clear()


def watch_call_fields(depth: int) -> Callable[[Path], bool]:
    return lambda path: len(path) == depth and path[-1] in ("name", *ARGUMENT_KEYS)


class Body:
    """What follows the reasoning: content, and tool calls in one family's syntax."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def feed(self, text: str) -> list[Delta]:
        return [ContentDelta(text)] if text else []

    def close(self) -> list[Delta]:
        return []


class StreamedCalls(Body):
    """A body whose calls are JSON read as it streams (MarkedCalls, BareCalls)."""

    def __init__(self, calls: Calls) -> None:
        super().__init__(calls)
        self._buf = ""
        self._reader: JsonReader | None = None
        self._n_read = 0  # calls (or Mistral's arrays of them) read so far

    def _read_call(self, out: list[Delta]) -> bool | None:
        """Feed the buffer to the call being read: None when it is not JSON after all
        (the rest is content), False while it goes on, True once it is whole."""
        assert self._reader is not None
        events, used = self._reader.feed(self._buf)
        out.extend(self.calls.handle(events, self._locate))
        if self._reader.failed:
            return None
        self._buf = self._buf[used:]
        if not self._reader.done:
            return False
        self._n_read += 1
        return True

    def _locate(self, path: Path) -> tuple[object, str] | None:
        raise NotImplementedError
