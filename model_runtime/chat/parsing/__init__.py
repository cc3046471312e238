"""A model's output read while it streams: content, reasoning and tool calls, per template
family. Pure: text in (the pieces the runtime streams), deltas out; the deltas of one
output add up to its parse (``OutputParser.output``), however the text was cut.

Each stage holds back only what it cannot place yet: the start of a marker
(``<tool_c``), an escape cut in two (``\\u00e``), whitespace that may end a reasoning
block. Tool-call arguments stream as the model writes them (OpenAI's argument chunks);
a call's first delta carries its id and name.
(tests/unit/test_chat_parsing.py)

Modules: ``output`` (:class:`OutputParser`: the reasoning block, then the body of the
output's family), one per template family's body (``generic``: the JSON envelope;
``hermes_mistral``: calls after a marker; ``llama3``: bare JSON calls), ``body`` (what
every family shares: plain content, tool calls as their parts are read), ``json_stream``
(JSON read in pieces) and ``deltas`` (what a parse gives out).
"""

from __future__ import annotations

from .deltas import (
    ContentDelta,
    Delta,
    ParsedCall,
    ParsedOutput,
    ReasoningDelta,
    ToolCallDelta,
)
from .json_stream import JsonReader
from .output import OutputParser

__all__ = ["ContentDelta", "Delta", "JsonReader", "OutputParser", "ParsedCall",
           "ParsedOutput", "ReasoningDelta", "ToolCallDelta"]
