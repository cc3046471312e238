"""One chat request made ready for the runtime: the prompt text and its save boundary,
the constraint on the output, and how to read the output back.

The save boundary is the end of the leading system message(s) as the template renders
them with the tools (in the system message for the hermes, llama3 and generic families),
so a second request with the same system prompt and tools restores them. Every earlier
turn is rendered as the model wrote it where the family allows (see
:mod:`.formats`), so a tool round trip continues the previous turn's KV.
(tests/unit/test_chat_prompt.py)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .formats import ChatFormat, Family, template_messages
from .grammars import (
    Constraint,
    envelope_grammar,
    schema_grammar,
    schemas_cost,
    tool_call_grammar,
)
from .messages import (
    ChatInputError,
    ChatMessage,
    Tool,
    ToolCall,
    ToolChoice,
    check_tool_results,
    check_tools,
)
from .parsing import OutputParser
from .templates import ChatTemplate, TemplateError

__all__ = ["ChatRequest", "PromptPlan", "grammar_cost", "plan_chat"]

#: Where a lazy grammar starts, per family: the text that opens a tool call.
TRIGGERS: Mapping[Family, tuple[str, ...]] = {
    Family.HERMES: ("<tool_call>",), Family.MISTRAL: ("[TOOL_CALLS]",),
    Family.LLAMA3: ('{"name"', '{"type"')}


@dataclass(frozen=True)
class ChatRequest:
    messages: Sequence[ChatMessage]
    tools: Sequence[Tool] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    json_schema: Mapping[str, Any] | None = None  # response_format (json_object: an object)
    schema_param: str = "response_format"  # where the schema came from, for errors
    grammar: str | None = None  # llama.cpp's `grammar` (GBNF), as given
    variables: Mapping[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    # Save boundaries the caller asks for (Anthropic's cache_control): the ends of these
    # messages (indices into ``messages``), as the template renders them.
    breakpoints: Sequence[int] = ()
    # vLLM's: False renders the chat without the template's generation prompt (the
    # assistant turn's opening); ``continue_final_message`` (which needs it False) leaves
    # the last message, an assistant's, open: the prompt ends with its text, and the
    # reply continues it.
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class PromptPlan:
    fmt: ChatFormat
    text: str
    head_chars: int  # the save boundary, in characters of text (0: none)
    constraint: Constraint | None
    tools: bool  # tool calls may come
    envelope: bool  # the output is the generic family's JSON envelope
    inside_reasoning: bool  # the prompt opened a reasoning block
    # (breakpoint, the end of its message in characters of text), ascending; a message
    # the template cannot end a prompt with, or one at the text's end, has none.
    boundaries: tuple[tuple[int, int], ...] = ()

    def parser(self, separate_reasoning: bool = True) -> OutputParser:
        """The output's parser; ``separate_reasoning`` False (SGLang's): no reasoning
        block is read, the text as the model wrote it is the body (its markers too)."""
        if not separate_reasoning:
            return OutputParser(dataclasses.replace(self.fmt, reasoning=None),
                                tools=self.tools, envelope=self.envelope)
        return OutputParser(self.fmt, tools=self.tools, envelope=self.envelope,
                            inside_reasoning=self.inside_reasoning)


def _check(req: ChatRequest) -> None:
    check_tools(req.tools)
    choice = req.tool_choice
    if choice.forced and not req.tools:
        raise ChatInputError("tool_choice", f"tool_choice '{choice.mode}' needs tools.")
    if choice.mode == "function" and choice.name not in {t.name for t in req.tools}:
        raise ChatInputError("tool_choice", f"tool_choice names {choice.name!r}, which is "
                                            "not among the tools.")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise ChatInputError("continue_final_message", "Cannot set both "
                                 "'continue_final_message' and 'add_generation_prompt' to "
                                 "true: set 'add_generation_prompt' to false to continue "
                                 "the last message.")
        last = req.messages[-1] if req.messages else None
        if last is None or last.role != "assistant" or not last.content or last.tool_calls:
            raise ChatInputError("continue_final_message", "'continue_final_message' needs "
                                 "the last message to be an assistant message with text "
                                 "(and no tool calls): the reply continues it.")
    if req.grammar is not None and (req.json_schema is not None or
                                    (req.tools and choice.mode != "none")):
        raise ChatInputError("grammar", "'grammar' cannot be combined with tools or "
                                        "response_format.")


def grammar_cost(req: ChatRequest) -> int:
    """The symbols of the schemas ``req``'s grammar holds (the parameters of the tools it
    may call, its response format), checked against the grammar's budget before anything
    is rendered or built: :class:`SchemaError` naming the place over budget."""
    choice = req.tool_choice
    schemas = [(tool.parameters, f"tools[{i}].function.parameters")
               for i, tool in enumerate(req.tools) if choice.mode != "none" and
               (choice.mode != "function" or tool.name == choice.name)]
    if req.json_schema is not None:
        schemas.append((req.json_schema, req.schema_param))
    return schemas_cost(schemas)


def _constraint(req: ChatRequest, fmt: ChatFormat, envelope: bool, inside: bool,
                closed: bool = False) -> Constraint | None:
    choice = req.tool_choice
    selected = [t for t in req.tools if choice.mode != "function" or t.name == choice.name]
    parallel = req.parallel_tool_calls and choice.mode != "function"
    calling = bool(req.tools) and choice.mode != "none"
    reasoning = None if closed else fmt.reasoning  # a block the output may open
    if req.grammar is not None:
        return Constraint(req.grammar)
    if envelope:
        return Constraint(envelope_grammar(
            selected, reply=not choice.forced, calls=calling, parallel=parallel,
            content_schema=req.json_schema, reasoning=reasoning, inside_reasoning=inside))
    if calling and choice.mode == "auto" and req.json_schema is None:
        return Constraint(tool_call_grammar(fmt.family, selected, parallel=parallel),
                          TRIGGERS[fmt.family])
    if calling:
        content = req.json_schema if choice.mode == "auto" else None
        return Constraint(tool_call_grammar(fmt.family, selected, parallel=parallel,
                                            content_schema=content, reasoning=reasoning,
                                            inside_reasoning=inside))
    if req.json_schema is not None:
        return Constraint(schema_grammar(req.json_schema, req.schema_param,
                                         reasoning=reasoning, inside_reasoning=inside))
    return None


def plan_chat(template: ChatTemplate, fmt: ChatFormat, req: ChatRequest,
              cancelled: Callable[[], bool] | None = None) -> PromptPlan:
    """Render ``req`` with the model's template. Raises :class:`ChatInputError` for a bad
    combination or a tool result answering no call, :class:`SchemaError` for a schema
    that cannot be constrained, :class:`TemplateError` when the template refuses,
    :class:`~.templates.RenderCancelled` once ``cancelled`` turns true."""
    _check(req)
    grammar_cost(req)
    calls = check_tool_results(req.messages)
    generic = fmt.family is Family.GENERIC
    envelope = generic and bool(req.tools)
    variables = dict(req.variables)
    if fmt.family is Family.LLAMA3:  # tools in the system message, where they are cached
        variables.setdefault("tools_in_user_message", False)
    messages = template_messages(fmt, req.messages, calls,
                                 tools=req.tools if generic else (), envelope=envelope)
    tools = [t.as_openai() for t in req.tools] if req.tools and not generic else None
    text = template.render(messages, add_generation_prompt=req.add_generation_prompt,
                           tools=tools, variables=variables, cancelled=cancelled)
    if req.continue_final_message:
        text = _open_final(text, req.messages[-1].content)
    n_system = 0
    while n_system < len(messages) and messages[n_system]["role"] == "system":
        n_system += 1
    head_chars = 0
    if 0 < n_system < len(messages):
        try:
            head = template.render(messages[:n_system], add_generation_prompt=False,
                                   tools=tools, variables=variables, cancelled=cancelled)
            head_chars = len(os.path.commonprefix([head, text]))
        except TemplateError:  # a template that needs a user turn: no boundary
            head_chars = 0
    boundaries = _message_ends(template, fmt, req, calls, text, envelope, tools, variables,
                               cancelled) if req.breakpoints else ()
    inside = fmt.reasoning is not None and text.rstrip().endswith(fmt.reasoning[0])
    # A prompt that closed the reasoning block itself (``enable_thinking`` false) asks for
    # no reasoning: the grammar then starts at the answer.
    closed = fmt.reasoning is not None and text.rstrip().endswith(fmt.reasoning[1])
    return PromptPlan(fmt, text, head_chars, _constraint(req, fmt, envelope, inside, closed),
                      tools=bool(req.tools) and req.tool_choice.mode != "none",
                      envelope=envelope, inside_reasoning=inside, boundaries=boundaries)


def _open_final(text: str, content: str) -> str:
    """The prompt cut right after the last message's text, as vLLM (and transformers'
    ``continue_final_message``) cut it: the template's end of turn after it is left
    out, so the model goes on with the message. Templates that trim a message's text
    are met by looking for it trimmed too."""
    for needle in (content, content.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[:at + len(needle)]
    raise ChatInputError("continue_final_message", "The chat template does not render the "
                                                   "last message's text as it is, so it "
                                                   "cannot be left open.")


def _message_ends(template: ChatTemplate, fmt: ChatFormat, req: ChatRequest,
                  calls: Mapping[str, ToolCall], text: str, envelope: bool,
                  tools: list[dict[str, Any]] | None, variables: Mapping[str, Any],
                  cancelled: Callable[[], bool] | None) -> tuple[tuple[int, int], ...]:
    """Where ``text`` stops holding the breakpoints' messages: the chat up to each
    breakpoint rendered alone, and the part of it ``text`` shares."""
    ends: list[tuple[int, int]] = []
    generic = fmt.family is Family.GENERIC
    for index in sorted(set(req.breakpoints)):
        # The template's messages are not one per chat message (the generic family joins
        # tool results and adds a system message): the prefix is converted the same way.
        prefix = template_messages(fmt, req.messages[:index + 1], calls,
                                   tools=req.tools if generic else (), envelope=envelope)
        try:
            head = template.render(prefix, add_generation_prompt=False, tools=tools,
                                   variables=variables, cancelled=cancelled)
        except TemplateError:  # a template that cannot end there (it needs a user turn)
            continue
        at = len(os.path.commonprefix([head, text]))
        if 0 < at < len(text):
            ends.append((index, at))
    return tuple(ends)
