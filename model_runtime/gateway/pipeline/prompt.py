"""A chat rendered with its worker's model template: the prompt, its save boundary, the
grammar and how to read the output (``plan_chat``), refusals named as 400s. Pure: it runs
on a thread of the gateway or in its helper process (offload.py)."""

from __future__ import annotations

from collections.abc import Callable

from ...chat.formats import ChatFormat
from ...chat.grammars import SchemaError
from ...chat.messages import ChatInputError
from ...chat.prompt import PromptPlan, grammar_cost, plan_chat
from ...chat.templates import ChatTemplate, TemplateError
from ..errors import bad_param
from .request import GenRequest

__all__ = ["HEAVY_GRAMMAR", "render_light", "render_plan"]

# A chat whose grammar's schemas hold more symbols than this (grammar_budget's count) is
# rendered in the helper: converting them takes the GIL for milliseconds (a schema at the
# budget's edge, tens of them), which on a thread would be the event loop's.
HEAVY_GRAMMAR = 20_000


def render_plan(req: GenRequest, template: ChatTemplate | None, fmt: ChatFormat | None,
                cancelled: Callable[[], bool] | None = None) -> PromptPlan | None:
    """A chat rendered with its model's template: the prompt, its save boundary, the
    grammar and how to read the output. Refusals are 400s naming their place."""
    if req.chat is None:
        return None
    if template is None or fmt is None:
        raise bad_param("messages", f"The model '{req.model}' has no chat template: use "
                                    "/v1/completions with a prompt.")
    try:
        return plan_chat(template, fmt, req.chat, cancelled)
    except ChatInputError as exc:
        raise bad_param(exc.param, exc.message) from None
    except SchemaError as exc:  # (the message without its place: the API names it)
        raise bad_param(exc.param, exc.detail) from None
    except TemplateError as exc:
        raise bad_param("messages", f"The model's chat template refused these messages: "
                                    f"{exc}") from None


def render_light(req: GenRequest, template: ChatTemplate | None, fmt: ChatFormat | None,
                 cancelled: Callable[[], bool], heavy_too: bool) -> tuple[bool, PromptPlan | None]:
    """:func:`render_plan`, unless the grammar of ``req``'s schemas holds over
    :data:`HEAVY_GRAMMAR` symbols and not ``heavy_too``: (False, None) then, for the
    helper to render it. Its budget is checked first either way: a 400 naming the first
    bound or place over it, before anything is built."""
    if req.chat is not None and not heavy_too:
        try:
            if grammar_cost(req.chat) > HEAVY_GRAMMAR:
                return False, None
        except SchemaError as exc:
            raise bad_param(exc.param, exc.detail) from None
    return True, render_plan(req, template, fmt, cancelled)
