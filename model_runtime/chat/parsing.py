"""A model's output read while it streams: content, reasoning and tool calls, per template
family. Pure: text in (the pieces the runtime streams), deltas out; the deltas of one
output add up to its parse (``OutputParser.output``), however the text was cut.

Each stage holds back only what it cannot place yet: the start of a marker
(``<tool_c``), an escape cut in two (``\\u00e``), whitespace that may end a reasoning
block. Tool-call arguments stream as the model writes them (OpenAI's argument chunks);
a call's first delta carries its id and name.
(tests/unit/test_chat_parsing.py)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .formats import HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKER, ChatFormat, Family

__all__ = ["ContentDelta", "Delta", "JsonReader", "OutputParser", "ParsedCall",
           "ParsedOutput", "ReasoningDelta", "ToolCallDelta"]

Path = tuple[object, ...]
Event = tuple[str, Path, str]  # ("begin", path, first char) | ("chars" | "end", path, text)
ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"
_PRIMITIVE = set("-+.0123456789eEtruefalsn")


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call ``index``: its first carries ``id`` and ``name``."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


@dataclass
class ParsedCall:
    id: str
    name: str = ""
    arguments: str = ""


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (kept back: the
    next piece may complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# --------------------------------------------------------------------------- JSON


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
            if ch in _PRIMITIVE:
                self._take(ch)
                return True
            self._mode = ""
            self._value_ends(self._scalar, events)
            self._after_value()
            return False
        if ch in _WS:
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
        if ch not in '{["' and ch not in _PRIMITIVE:
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


class _StringDecoder:
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


# --------------------------------------------------------------------------- calls


class _Calls:
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


def _watch_call_fields(depth: int) -> Callable[[Path], bool]:
    return lambda path: len(path) == depth and path[-1] in ("name", *ARGUMENT_KEYS)


# --------------------------------------------------------------------------- bodies


class _Body:
    """What follows the reasoning: content, and tool calls in one family's syntax."""

    def __init__(self, calls: _Calls) -> None:
        self.calls = calls

    def feed(self, text: str) -> list[Delta]:
        return [ContentDelta(text)] if text else []

    def close(self) -> list[Delta]:
        return []


class _StreamedCalls(_Body):
    """A body whose calls are JSON read as it streams (_MarkedCalls, _BareCalls)."""

    def __init__(self, calls: _Calls) -> None:
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


class _MarkedCalls(_StreamedCalls):
    """Content, then calls each a JSON object between markers (Hermes), or (Mistral) an
    array of them after one marker or at the very start."""

    def __init__(self, calls: _Calls, family: Family) -> None:
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
                    keep = _held_prefix(self._buf, self.marker)
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
        self._reader = JsonReader(_watch_call_fields(depth))
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


class _BareCalls(_StreamedCalls):
    """Llama 3.x: the whole output is one or more JSON call objects (a first key "name"
    or "type"), or it is content."""

    START = re.compile(r'\s*(<\|python_tag\|>)?\s*\{\s*"(name|type)"')
    UNDECIDED = re.compile(r'\s*(<\|python_tag\|>|<\|python_tag|<\|py?t?h?o?n?_?t?a?g?)?\s*'
                           r'(\{\s*("\w{0,4})?)?$')

    def __init__(self, calls: _Calls) -> None:
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
                head = self._buf.lstrip(_WS + ";")
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
        self._reader = JsonReader(_watch_call_fields(1))
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


class _Envelope(_Body):
    """The generic family's JSON envelope: ``{"response": …}`` streams as content (a
    string decoded, any other JSON value as written), ``{"tool_calls": […]}`` as calls.
    Output that is not the envelope is content as written."""

    def __init__(self, calls: _Calls) -> None:
        super().__init__(calls)
        self._reader = JsonReader(self._watch)
        self._string: _StringDecoder | None = None
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
                    self._string = _StringDecoder() if text == '"' else None
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


# --------------------------------------------------------------------------- reasoning


class OutputParser:
    """One output of one request, parsed as it streams.

    ``tools``: tool calls are read (in the family's syntax, or ``envelope`` for the
    generic family's JSON envelope); else everything after the reasoning is content.
    ``inside_reasoning``: the prompt opened the reasoning block (the output starts in it).
    """

    def __init__(self, fmt: ChatFormat, *, tools: bool = False, envelope: bool = False,
                 inside_reasoning: bool = False,
                 new_id: Callable[[], str] | None = None) -> None:
        self.calls = _Calls(new_id or fmt.new_call_id)
        body: _Body
        if envelope:
            body = _Envelope(self.calls)
        elif tools and fmt.family in (Family.HERMES, Family.MISTRAL):
            body = _MarkedCalls(self.calls, fmt.family)
        elif tools and fmt.family is Family.LLAMA3:
            body = _BareCalls(self.calls)
        else:
            body = _Body(self.calls)
        self._body = body
        self._markers = fmt.reasoning
        self._state = "reasoning" if inside_reasoning and fmt.reasoning else \
            "maybe" if fmt.reasoning else "body"
        self._buf = ""
        self._reasoned = False  # reasoning text given out (its leading space is dropped)
        self._after_reasoning = False  # the body's leading whitespace is dropped
        self.output = ParsedOutput()

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
                keep = _held_prefix(self._buf, end)
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
