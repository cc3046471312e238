"""What a parse gives out: deltas as the output streams, and the output they add up to."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ContentDelta", "Delta", "ParsedCall", "ParsedOutput", "ReasoningDelta",
           "ToolCallDelta"]


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
