"""The gateway's one request: what every API's adapter reads its requests into (an API's
own answer settings stay with its call, pipeline/contract.py), and what the pipeline runs
on a worker (:class:`GenRequest`). Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...chat.prompt import ChatRequest, PromptPlan
from ...v1 import runtime_pb2 as pb


@dataclass
class GenRequest:
    """One completion request, checked: its input (a chat, a prompt or token ids), how to
    sample, where its cache may come from, and how it is routed."""

    model: str
    stream: bool
    max_tokens: int | None  # None: until the context is full
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    session_id: str
    n: int = 1
    route_key: str = ""  # prompt_cache_key / user: a routing preference
    top_k: int = 0
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # completions (chat: in ``chat``)
    speculative: bool | None = None  # None: the worker's default
    prediction: str = ""  # OpenAI's predicted outputs: a draft source, verified
    # vLLM's and SGLang's: the stop string stays at the text's end (no_stop_trim), an
    # end-of-generation token does not end it (ignore_eos), control tokens show in it
    # (skip_special_tokens false)
    keep_stop: bool = False
    ignore_eos: bool = False
    special_tokens: bool = False
    chat: ChatRequest | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    # Cache hints. A chat's breakpoints (Anthropic's cache_control): chat message index ->
    # seconds its entry stays pinned (0: not pinned); the ends of those messages become
    # the save boundaries.
    breakpoint_ttls: dict[int, int] = field(default_factory=dict)
    # An earlier finish save to resume from (the Responses API's previous_response_id),
    # whose own tokens stand for the text they were generated as (continue_parent).
    parent_key: str = ""
    continue_parent: bool = False

    def to_proto(self, plan: PromptPlan | None = None) -> pb.CompleteRequest:
        """The runtime's request; a chat needs its ``plan`` (the prompt the gateway
        rendered with the worker's template)."""
        # A max_tokens given must fit with the prompt (the runtime refuses it otherwise, as
        # OpenAI does); none given: until the context is full.
        req = pb.CompleteRequest(
            session_id=self.session_id, max_tokens=self.max_tokens or 0,
            until_context_full=self.max_tokens is None, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=self.stop, logprobs=self.logprobs,
            top_logprobs=self.top_logprobs, keep_stop=self.keep_stop,
            ignore_eos=self.ignore_eos, special_tokens=self.special_tokens,
            whole=not self.stream)  # nothing to stream: the text comes with the end
        if self.seed is not None:
            req.seed = self.seed
        sampler: dict[str, Any] = {
            "n": self.n if self.n > 1 else None, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty or None,
            "frequency_penalty": self.frequency_penalty or None,
            "repeat_penalty": self.repeat_penalty, "penalty_last_n": self.repeat_last_n}
        for name, value in sampler.items():
            if value is not None:
                setattr(req, name, value)
        req.logit_bias.update(self.logit_bias)
        if self.speculative is not None:
            req.speculative = self.speculative
        if self.prediction:
            req.prediction = self.prediction
        grammar = self.grammar
        triggers: tuple[str, ...] = ()
        if plan is not None:
            req.prompt = plan.text
            req.prefix_chars = plan.head_chars
            if plan.constraint is not None:
                grammar, triggers = plan.constraint.grammar, plan.constraint.triggers
        elif self.tokens is not None:
            req.tokens.ids.extend(self.tokens)
        else:
            req.prompt = self.prompt or ""
        if grammar is not None:
            req.grammar = grammar
            for trigger in triggers:  # literals: the text that opens a tool call
                req.grammar_triggers.add(value=trigger)
        if plan is not None and self.breakpoint_ttls and plan.boundaries:
            # The client said where its prefixes end: those are the save boundaries, in
            # place of the system message's end, each pinned for its ttl.
            req.prefix_chars = 0
            req.boundary_chars.extend(chars for _, chars in plan.boundaries)
            req.boundary_ttl_seconds.extend(self.breakpoint_ttls[index]
                                            for index, _ in plan.boundaries)
        if self.parent_key:
            req.parent_key = self.parent_key
            req.continue_parent = self.continue_parent
        return req

    def routing_text(self, served: str | None = None) -> str:
        """The request as one string whose prefixes match those of a later request that
        continues it: the tools and a chat's messages (plus ``served``, the reply as the
        next turn will carry it), or a raw prompt (plus its completion). Used only to
        route, never sent."""
        if self.chat is not None:
            tools = json.dumps([t.as_openai() for t in self.chat.tools], sort_keys=True)
            parts = [f"{m.role}\x1f{m.content}\x1f" +
                     "".join(f"{c.name}{c.arguments}" for c in m.tool_calls) + "\x1e"
                     for m in self.chat.messages]
            if served is not None:
                parts.append(f"assistant\x1f{served}")
            return "\x00chat\x00" + tools + "\x00" + "".join(parts)
        if self.tokens is not None:
            return "\x00tokens\x00" + "".join(f"{t}," for t in self.tokens)
        return "\x00text\x00" + (self.prompt or "") + (served or "")


def served_text(content: str, calls: list[tuple[str, str]]) -> str:
    """A reply as :meth:`GenRequest.routing_text` writes an assistant turn."""
    return f"{content}\x1f" + "".join(f"{name}{args}" for name, args in calls) + "\x1e"

