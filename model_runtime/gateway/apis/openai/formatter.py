"""The OpenAI API's answers: response bodies, streamed chunks, logprobs, usage and error
bodies, and :class:`Choice`, one choice being answered (its output parsed into content,
reasoning and tool calls as it streams). Pure: the routes (``app``) write what these make.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ....chat.parsing import ContentDelta, Delta, OutputParser, ReasoningDelta, ToolCallDelta
from ....v1 import runtime_pb2 as pb
from ...pipeline.request import GenRequest, served_text

__all__ = ["DONE", "Choice", "chunk", "finish_reason", "kvcache_details", "response_body",
           "sse", "usage"]


def usage(done: pb.Completion, completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` is the prompt tokens not recomputed (as OpenAI,
    vLLM, SGLang and llama.cpp's server report it). The prompt counts once, whatever n."""
    generated = len(done.tokens) if completion_tokens is None else completion_tokens
    cached = min(done.cache_delta.tokens_read, done.prompt_tokens)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": generated,
            "total_tokens": done.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kvcache_details(done: pb.Completion, worker: str, tenant: str) -> dict[str, Any]:
    """kvcache's own account of the request, beside OpenAI's fields."""
    t = done.timings
    return {"hit_kind": done.cache_hit_kind, "tier": done.cache_tier,
            "tokens_restored": done.cache_delta.tokens_read,
            "tokens_saved": done.cache_delta.tokens_saved,
            "ttft_ms": round(t.ttft_ms, 3), "restore_ms": round(t.restore_ms, 3),
            "prefill_ms": round(t.prefill_ms, 3), "decode_ms": round(t.decode_ms, 3),
            "finish_key": done.finish_key, "session_id": done.session_id,
            "worker": worker, "tenant": tenant}


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

    def __init__(self, index: int, parser: OutputParser | None) -> None:
        self.index = index
        self.parser = parser
        self.text = ""  # the raw text the model wrote
        self.logprobs: list[pb.TokenLogprob] = []
        self._offset = 0  # completions: where the next token's logprobs start

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Chat: the deltas this piece completes; completions: the piece itself."""
        self.text += text
        if self.parser is None:
            return [{"text": text}] if text else []
        return [delta_body(d) for d in self.parser.feed(text)]

    def close(self) -> list[dict[str, Any]]:
        if self.parser is None:
            return []
        return [delta_body(d) for d in self.parser.close()]

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
        if out.reasoning:
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


def response_body(req: GenRequest, choices: Sequence[Choice],
                  finished: Sequence[pb.Completion], extra: dict[str, Any],
                  completion_tokens: int) -> dict[str, Any]:
    """The whole answer; ``finished``: each choice's final record (the prompt's usage
    and cache use are the same in all of them)."""
    records = {getattr(d, "choice", 0): d for d in finished}
    done = finished[0]
    bodies = []
    for c in choices:
        logprobs = c.logprobs_body(c.logprobs, req.endpoint == "chat") if req.logprobs \
            else None
        reason = finish_reason(records.get(c.index, done), c.has_tool_calls)
        if req.endpoint == "chat":
            bodies.append({"index": c.index, "message": c.message(), "logprobs": logprobs,
                           "finish_reason": reason})
        else:
            bodies.append({"index": c.index, "text": c.text, "logprobs": logprobs,
                           "finish_reason": reason})
    body: dict[str, Any] = {
        "id": req.id, "object": "chat.completion" if req.endpoint == "chat"
        else "text_completion", "created": req.created, "model": req.model,
        "system_fingerprint": None, "choices": bodies,
        "usage": usage(done, completion_tokens), "kvcache": extra}
    if req.endpoint == "chat":
        body["service_tier"] = "default"
    return body


def chunk(req: GenRequest, text: str | None = None, *, first: bool = False,
          finish: str | None = None, usage_body: dict[str, Any] | None = None,
          extra: dict[str, Any] | None = None, delta: dict[str, Any] | None = None,
          index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: text or a parsed ``delta``, the closing chunk (``finish``), or
    the usage chunk (``usage_body``: no choices, as OpenAI sends it last when
    include_usage is set)."""
    choices: list[dict[str, Any]] = []
    if usage_body is None:
        if req.endpoint == "chat":
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
        "id": req.id, "object": "chat.completion.chunk" if req.endpoint == "chat"
        else "text_completion", "created": req.created, "model": req.model,
        "system_fingerprint": None, "choices": choices}
    if req.endpoint == "chat":
        out["service_tier"] = "default"
    if req.include_usage:
        out["usage"] = usage_body  # null on every chunk but the last, as OpenAI does
    if extra is not None:
        out["kvcache"] = extra
    return out


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
