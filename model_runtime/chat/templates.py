"""A model's jinja chat template, rendered as transformers and llama.cpp render it.

Same environment as transformers' and llama-cpp-python's: sandboxed, ``trim_blocks`` and
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` filter, and the variables ``bos_token``,
``eos_token``, ``raise_exception``, ``strftime_now``, ``add_generation_prompt`` (plus
``tools`` and any other the caller passes). The result holds special-token *texts*;
tokenize it with special tokens parsed.

A template that starts its text with the BOS token's text, for a model whose tokenizer adds
BOS itself, would give two BOS tokens: that text is dropped (as llama.cpp's server does).
(tests/unit/test_chat_formats.py)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "RenderCancelled", "TemplateError", "TemplateSource"]


class TemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed to render."""


class RenderCancelled(Exception):
    """The caller of a rendering went away: the rest was not rendered."""


#: Pieces of output rendered between two checks of ``cancelled`` (a message is a few).
CANCEL_CHECK_PIECES = 512


class TemplateSource(Protocol):
    """What a loaded model tells of its template (``llama_backend.LlamaModel``)."""

    bos_token: int
    eos_token: int
    add_bos: bool

    def chat_template(self) -> str | None: ...

    def token_text(self, token: int) -> str: ...


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True,
                                       lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """One compiled chat template and the special-token texts it is rendered with."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 add_bos: bool = False) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None

    @classmethod
    def of_model(cls, model: TemplateSource) -> ChatTemplate | None:
        """The template of a loaded model, or None when its GGUF has none."""
        source = model.chat_template()
        if source is None:
            return None
        return cls(source,
                   bos_token=model.token_text(model.bos_token) if model.bos_token >= 0 else "",
                   eos_token=model.token_text(model.eos_token) if model.eos_token >= 0 else "",
                   add_bos=model.add_bos)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
               variables: Mapping[str, Any] | None = None,
               cancelled: Callable[[], bool] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``, when given and not empty).
        Raises :class:`TemplateError` when the template refuses them, and
        :class:`RenderCancelled` when ``cancelled`` (asked every few hundred pieces of
        output) turns true."""
        extra = dict(variables or {})
        if tools:
            extra["tools"] = list(tools)
        try:
            pieces = self._template.generate(
                **extra, messages=list(messages), bos_token=self.bos_token,
                eos_token=self.eos_token, raise_exception=_raise_exception,
                strftime_now=_strftime_now, add_generation_prompt=add_generation_prompt)
            out: list[str] = []
            for piece in pieces:
                out.append(piece)
                if cancelled is not None and len(out) % CANCEL_CHECK_PIECES == 0 and \
                        cancelled():
                    raise RenderCancelled(f"cancelled after {len(out)} pieces")
            text = "".join(out)
        except (TemplateError, RenderCancelled):
            raise
        except Exception as exc:  # jinja's errors, and a template's own (e.g. a bad index)
            raise TemplateError(f"the chat template failed on these messages: "
                                f"{type(exc).__name__}: {exc}") from None
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return str(text)
