"""The OpenAI API's answers: response bodies, streamed chunks, logprobs and usage;
:class:`Choice`, one choice being answered (its output parsed into content, reasoning and
tool calls as it streams), and :class:`OpenAIFormatter`, a request's answer from the
worker's events. Pure: the pipeline writes what these make.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ....chat.parsing import ContentDelta, Delta, OutputParser, ReasoningDelta, ToolCallDelta
from ....chat.prompt import PromptPlan
from ....v1 import runtime_pb2 as pb
from ...errors import ApiError
from ...pipeline.contract import Formatter, kvcache_details
from ...pipeline.request import served_text
from .adapter import OpenAICall

__all__ = ["DONE", "Choice", "OpenAIFormatter", "chunk", "finish_reason", "response_body",
           "sse", "text_chunk_template", "usage"]


def usage(done: pb.Completion, completion_tokens: int | None = None,
          finished: Sequence[pb.Completion] = ()) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` is the prompt tokens not recomputed (as OpenAI,
    vLLM, SGLang and llama.cpp's server report it). The prompt counts once, whatever n;
    a prediction's tokens count in every choice of ``finished`` (else ``done``'s)."""
    generated = len(done.tokens) if completion_tokens is None else completion_tokens
    cached = min(done.cache_delta.tokens_read, done.prompt_tokens)
    out: dict[str, Any] = {"prompt_tokens": done.prompt_tokens, "completion_tokens": generated,
                           "total_tokens": done.prompt_tokens + generated,
                           "prompt_tokens_details": {"cached_tokens": cached}}
    records = finished or (done,)
    predicted = sum(d.prediction_tokens for d in records)
    if predicted:  # predicted outputs: the prediction's tokens the output kept, and not
        accepted = sum(d.accepted_prediction_tokens for d in records)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": predicted - accepted}
    return out


def finish_reason(done: pb.Completion, tool_calls: bool = False) -> str:
    if done.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _piece(raw: bytes) -> tuple[str, list[int]]:
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob(lp: pb.TokenLogprob) -> dict[str, Any]:
    """One token in OpenAI's chat ``logprobs.content`` form."""
    text, raw = _piece(lp.piece)
    top = []
    for t in lp.top:
        t_text, t_raw = _piece(t.piece)
        top.append({"token": t_text, "logprob": t.logprob, "bytes": t_raw})
    return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}


def text_logprobs(lps: Sequence[pb.TokenLogprob], offset: int) -> dict[str, Any]:
    """Tokens in the completions endpoint's ``logprobs`` form; ``offset``: where the
    first one starts in the choice's text."""
    tokens, offsets, top = [], [], []
    for lp in lps:
        text = lp.piece.decode("utf-8", errors="replace")
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top.append({t.piece.decode("utf-8", errors="replace"): t.logprob for t in lp.top})
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": top, "text_offset": offsets}


def delta_body(delta: Delta) -> dict[str, Any]:
    """A parsed delta as OpenAI's ``choices[].delta``."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    if isinstance(delta, ReasoningDelta):
        return {"reasoning_content": delta.text}
    assert isinstance(delta, ToolCallDelta)
    call: dict[str, Any] = {"index": delta.index}
    if delta.id:  # a call's first delta names it, as OpenAI's do
        call.update(id=delta.id, type="function",
                    function={"name": delta.name, "arguments": delta.arguments})
    else:
        call["function"] = {"arguments": delta.arguments}
    return {"tool_calls": [call]}


class Choice:
    """One choice of a request as it is answered: text pieces in, OpenAI's deltas out
    (chat: parsed by ``parser``), and the whole at the end."""

    def __init__(self, index: int, parser: OutputParser | None,
                 include_reasoning: bool = True, stream_reasoning: bool = True) -> None:
        self.index = index
        self.parser = parser
        self.include_reasoning = include_reasoning  # False: reasoning left out
        # False (SGLang's stream_reasoning): the reasoning is held and given in one delta
        # where it ends
        self.stream_reasoning = stream_reasoning
        self._held = ""
        self.text = ""  # the raw text the model wrote
        self.logprobs: list[pb.TokenLogprob] = []
        self._offset = 0  # completions: where the next token's logprobs start

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Chat: the deltas this piece completes; completions: the piece itself."""
        self.text += text
        if self.parser is None:
            return [{"text": text}] if text else []
        return self._bodies(self.parser.feed(text), self.parser.past_reasoning)

    def close(self) -> list[dict[str, Any]]:
        if self.parser is None:
            return []
        return self._bodies(self.parser.close(), True)

    def _bodies(self, deltas: Sequence[Delta], reasoned: bool) -> list[dict[str, Any]]:
        if not self.include_reasoning:
            return [delta_body(d) for d in deltas if not isinstance(d, ReasoningDelta)]
        if self.stream_reasoning:
            return [delta_body(d) for d in deltas]
        out = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                self._held += d.text
                continue
            out += self._release()
            out.append(delta_body(d))
        return out + self._release() if reasoned else out

    def _release(self) -> list[dict[str, Any]]:
        held, self._held = self._held, ""
        return [delta_body(ReasoningDelta(held))] if held else []

    def logprobs_body(self, lps: Sequence[pb.TokenLogprob], chat: bool) -> dict[str, Any]:
        if chat:
            return {"content": [chat_logprob(lp) for lp in lps], "refusal": None}
        body = text_logprobs(lps, self._offset)
        self._offset += sum(len(t) for t in body["tokens"])
        return body

    @property
    def has_tool_calls(self) -> bool:
        return self.parser is not None and bool(self.parser.output.tool_calls)

    def message(self) -> dict[str, Any]:
        """The whole reply as OpenAI's ``message`` (after :meth:`close`)."""
        assert self.parser is not None
        out = self.parser.output
        message: dict[str, Any] = {"role": "assistant", "refusal": None,
                                   "content": out.content or (None if out.tool_calls else "")}
        if out.reasoning and self.include_reasoning:
            message["reasoning_content"] = out.reasoning
        if out.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in out.tool_calls]
        return message

    def served(self) -> str:
        """The reply as the routing text of the conversation's next turn holds it."""
        if self.parser is None:
            return self.text
        out = self.parser.output
        return served_text(out.content, [(c.name, c.arguments) for c in out.tool_calls])


def response_body(call: OpenAICall, choices: Sequence[Choice],
                  finished: Sequence[pb.Completion], extra: dict[str, Any],
                  completion_tokens: int) -> dict[str, Any]:
    """The whole answer; ``finished``: each choice's final record (the prompt's usage
    and cache use are the same in all of them)."""
    records = {getattr(d, "choice", 0): d for d in finished}
    done = finished[0]
    bodies = []
    for c in choices:
        logprobs = c.logprobs_body(c.logprobs, call.chat) if call.request.logprobs \
            else None
        reason = finish_reason(records.get(c.index, done), c.has_tool_calls)
        if call.chat:
            bodies.append({"index": c.index, "message": c.message(), "logprobs": logprobs,
                           "finish_reason": reason})
        else:
            bodies.append({"index": c.index, "text": c.text, "logprobs": logprobs,
                           "finish_reason": reason})
    body: dict[str, Any] = {
        "id": call.id, "object": "chat.completion" if call.chat
        else "text_completion", "created": call.created, "model": call.request.model,
        "system_fingerprint": None, "choices": bodies,
        "usage": usage(done, completion_tokens, finished), "kvcache": extra}
    if call.chat:
        body["service_tier"] = "default"
    return body


def chunk(call: OpenAICall, text: str | None = None, *, first: bool = False,
          finish: str | None = None, usage_body: dict[str, Any] | None = None,
          extra: dict[str, Any] | None = None, delta: dict[str, Any] | None = None,
          index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: text or a parsed ``delta``, the closing chunk (``finish``), or
    the usage chunk (``usage_body``: no choices, as OpenAI sends it last when
    include_usage is set)."""
    choices: list[dict[str, Any]] = []
    if usage_body is None:
        if call.chat:
            body: dict[str, Any] = dict(delta or {})
            if first:
                body["role"] = "assistant"
            if text is not None:
                body["content"] = text
            choices = [{"index": index, "delta": body, "logprobs": logprobs,
                        "finish_reason": finish}]
        else:
            choices = [{"index": index, "text": text or "", "logprobs": logprobs,
                        "finish_reason": finish}]
    out: dict[str, Any] = {
        "id": call.id, "object": "chat.completion.chunk" if call.chat
        else "text_completion", "created": call.created, "model": call.request.model,
        "system_fingerprint": None, "choices": choices}
    if call.chat:
        out["service_tier"] = "default"
    if call.include_usage:
        out["usage"] = usage_body  # null on every chunk but the last, as OpenAI does
    if extra is not None:
        out["kvcache"] = extra
    return out


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
# Stands for a chunk's text in a rendered chunk (text_chunk_template): no model writes it.
_TEXT_MARK = "\x00\x01text\x01\x00"
_TEXT_MARK_JSON = json.dumps(_TEXT_MARK, ensure_ascii=False)


def text_chunk_template(call: OpenAICall, index: int) -> tuple[str, str] | None:
    """A choice's plain text chunk (a content delta, or a completion's text, without
    logprobs) as the text before and after its JSON string, so that a token's chunk is
    ``before + json.dumps(text) + after`` — the bytes :func:`chunk` and :func:`sse` make,
    without building and encoding the whole chunk once a token. None when the mark
    cannot be told apart (then each chunk is made whole)."""
    body = chunk(call, delta={"content": _TEXT_MARK}, index=index) if call.chat \
        else chunk(call, _TEXT_MARK, index=index)
    before, mark, after = sse(body).decode().partition(_TEXT_MARK_JSON)
    if not mark or _TEXT_MARK_JSON in after:
        return None
    return before, after


class OpenAIFormatter(Formatter):
    """A chat completion's or a completion's answer: each choice's text parsed (chat) as
    it comes; streamed, OpenAI's chunks (the role first, then deltas, each choice's
    finish_reason, the usage chunk when asked for, then ``[DONE]``); kvcache's details
    ride on the last chunk (the usage chunk when asked for, where clients read usage,
    else the last finish_reason chunk)."""

    def __init__(self, call: OpenAICall, plan: PromptPlan | None, worker: str,
                 tenant: str) -> None:
        super().__init__(call.request.stream)
        self.call = call
        self.worker = worker
        self.tenant = tenant
        self.choices = [Choice(i, plan.parser(call.separate_reasoning)
                               if plan is not None else None, call.include_reasoning,
                               call.stream_reasoning) for i in range(call.request.n)]
        # Each choice's plain text chunk, made once (the stream's most frequent chunk).
        self._text_templates = [text_chunk_template(call, i) if self.stream else None
                                for i in range(call.request.n)]

    def opening(self, prompt: pb.PromptDone | pb.Completion) -> bytes:
        if not self.call.chat:
            return b""
        return b"".join(sse(chunk(self.call, "", first=True, index=c.index))
                        for c in self.choices)  # OpenAI's first chunk names the role

    def text(self, event: pb.CompleteEvent) -> bytes:
        choice = self.choices[event.choice]
        if not self.stream:
            choice.feed(event.text)
            if event.HasField("logprob"):
                choice.logprobs.append(event.logprob)
            return b""
        chat = self.call.chat
        logprobs = choice.logprobs_body([event.logprob], chat) \
            if event.HasField("logprob") else None
        pieces = choice.feed(event.text)
        template = self._text_templates[choice.index]
        if logprobs is None and template is not None and len(pieces) == 1:
            text = pieces[0].get("content" if chat else "text")
            if text is not None and len(pieces[0]) == 1:
                return (template[0] + json.dumps(text, ensure_ascii=False)
                        + template[1]).encode()
        if not pieces and logprobs is not None:
            pieces = [{}] if chat else [{"text": ""}]
        out = []
        for piece in pieces:
            if chat:
                body = chunk(self.call, delta=piece, index=choice.index, logprobs=logprobs)
            else:
                body = chunk(self.call, piece["text"], index=choice.index, logprobs=logprobs)
            logprobs = None  # the token's logprobs ride on its first chunk
            out.append(sse(body))
        return b"".join(out)

    def choice_done(self, done: pb.Completion, extra: dict[str, Any] | None = None) -> bytes:
        choice = self.choices[done.choice]
        deltas = choice.close()
        if not self.stream:
            return b""
        out = [sse(chunk(self.call, delta=delta, index=choice.index)) for delta in deltas]
        out.append(sse(chunk(self.call, finish=finish_reason(done, choice.has_tool_calls),
                             index=choice.index, extra=extra)))
        return b"".join(out)

    def finish(self, finished: list[pb.Completion]) -> tuple[dict[str, Any], bytes]:
        done = finished[0]  # the prompt's usage and cache use are the same in each
        generated = sum(len(d.tokens) for d in finished)
        extra = kvcache_details(done, self.worker, self.tenant, self.gateway, finished)
        include_usage = self.call.include_usage
        closing = self.choice_done(finished[-1], None if include_usage else extra)
        if not self.stream:
            return response_body(self.call, self.choices, finished, extra, generated), b""
        if include_usage:
            closing += sse(chunk(self.call, usage_body=usage(done, generated, finished),
                                   extra=extra))
        return {}, closing + DONE

    def error(self, err: ApiError) -> bytes:
        return sse(err.body())

    def served(self) -> str:
        return self.choices[0].served()
