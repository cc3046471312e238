"""The runtime's gRPC service: streaming completions, health and reflection."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, overload

import grpc
from grpc_health.v1 import health, health_pb2

from kvcache.auth import ServerAuth, add_tcp_port, refuse_unprotected_tcp, tcp_security
from kvcache.common import details, grpc_server
from kvcache.unix_socket import OwnedSocket

from . import kernels
from .completion_request import (
    CacheHints,
    CompletionRequest,
    Constraints,
    Input,
    Speculation,
)
from .config import MAX_REQUEST_MESSAGE_BYTES, REFUSAL_METADATA_KEY, SettingError
from .event_channel import ChannelEvents, EventChannel
from .llama_backend import batch_variant_options
from .request import Completion, PromptDone, RequestError, TokenEvent
from .runtime import Runtime
from .sampling import GrammarTrigger, Sampling, TokenLogprob, logit_bias_pairs
from .v1 import runtime_pb2 as pb
from .v1 import runtime_pb2_grpc as pb_grpc

log = logging.getLogger("model_runtime")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelRuntime"].full_name

ERROR_CODES = {
    "sticky_busy": grpc.StatusCode.FAILED_PRECONDITION,
    "prompt_too_long": grpc.StatusCode.INVALID_ARGUMENT,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "decode_failed": grpc.StatusCode.INTERNAL,
    "grammar_dead_end": grpc.StatusCode.INVALID_ARGUMENT,  # the request's grammar
    "cancelled": grpc.StatusCode.CANCELLED,  # the caller went away
}


@overload
def logprob_message(lp: TokenLogprob,
                    piece: Callable[[int], bytes] = ...) -> pb.TokenLogprob: ...


@overload
def logprob_message(lp: None, piece: Callable[[int], bytes] = ...) -> None: ...


def logprob_message(lp: TokenLogprob | None,
                    piece: Callable[[int], bytes] = lambda token: b"") -> pb.TokenLogprob | None:
    """``piece``: a token's text (the gateway shows each token's text, as OpenAI does)."""
    if lp is None:
        return None
    return pb.TokenLogprob(token=lp.token, logprob=lp.logprob, piece=piece(lp.token),
                           top=[pb.TopLogprob(token=t, logprob=v, piece=piece(t))
                                for t, v in lp.top])


def logprob_from_message(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token, m.logprob, tuple((t.token, t.logprob) for t in m.top))


def completion_message(c: Completion) -> pb.Completion:
    return pb.Completion(
        text=c.text, tokens=c.tokens, finish_reason=c.finish_reason, finish_key=c.finish_key,
        cache_hit_kind=c.cache_hit_kind,
        cache_delta=pb.CacheDelta(**c.cache_delta),
        timings=pb.Timings(**c.timings), prompt_tokens=c.prompt_tokens,
        session_id=c.session_id, cache_tier=c.cache_tier,
        saves=[pb.SaveRecord(**save) for save in c.saves],
        logprobs=[logprob_message(lp) for lp in c.logprobs], choice=c.choice,
        stop_sequence=c.stop_sequence, drafted_tokens=c.drafted_tokens,
        accepted_tokens=c.accepted_tokens, prediction_tokens=c.prediction_tokens,
        accepted_prediction_tokens=c.accepted_prediction_tokens)


def prompt_message(p: PromptDone) -> pb.PromptDone:
    return pb.PromptDone(prompt_tokens=p.prompt_tokens, cache_hit_kind=p.cache_hit_kind,
                         cache_tier=p.cache_tier, cache_delta=pb.CacheDelta(**p.cache_delta),
                         saves=[pb.SaveRecord(**save) for save in p.saves])


def completion_from_message(m: pb.Completion) -> Completion:
    """The inverse of :func:`completion_message`: a served record as the local one."""
    return Completion(
        text=m.text, tokens=list(m.tokens), finish_reason=m.finish_reason,
        finish_key=m.finish_key, cache_hit_kind=m.cache_hit_kind,
        cache_delta={"tokens_read": m.cache_delta.tokens_read,
                     "tokens_saved": m.cache_delta.tokens_saved},
        timings={f.name: getattr(m.timings, f.name) for f in pb.Timings.DESCRIPTOR.fields},
        prompt_tokens=m.prompt_tokens, session_id=m.session_id, cache_tier=m.cache_tier,
        saves=[{"reason": s.reason, "tokens": s.tokens, "key": s.key} for s in m.saves],
        logprobs=[logprob_from_message(lp) for lp in m.logprobs], choice=m.choice,
        stop_sequence=m.stop_sequence, drafted_tokens=m.drafted_tokens,
        accepted_tokens=m.accepted_tokens, prediction_tokens=m.prediction_tokens,
        accepted_prediction_tokens=m.accepted_prediction_tokens)


def input_from_message(request: pb.CompleteRequest) -> Input:
    """What a CompleteRequest asks to complete (its ``input`` oneof; none: an Input the
    runtime refuses)."""
    which = request.WhichOneof("input")
    if which == "prompt":
        return Input(prompt=request.prompt, system=request.system or None)
    if which == "tokens":
        return Input(tokens=tuple(request.tokens.ids))
    if which == "chat":
        return Input(messages=tuple({"role": m.role, "content": m.content}
                                    for m in request.chat.messages))
    return Input()


def request_from_message(request: pb.CompleteRequest) -> CompletionRequest:
    """The runtime's request a CompleteRequest stands for, made once here. A field left at
    proto3's zero means the default where zero is not a value of its own (max_tokens:
    not given; top_p: 1; n: 1; json_schema: none); seed, repeat_penalty, penalty_last_n,
    tenant and speculative are optional fields, their defaults when unset. Raises
    SettingError for a sampling setting out of range."""
    optional = {name: getattr(request, name) for name in (
        "seed", "repeat_penalty", "penalty_last_n", "tenant", "speculative")
        if request.HasField(name)}
    sampling = Sampling(
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p or 1.0,
        min_p=request.min_p, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=logit_bias_pairs(dict(request.logit_bias)),
        **{k: v for k, v in optional.items()
           if k in ("seed", "repeat_penalty", "penalty_last_n")})
    constraints = Constraints(
        max_tokens=request.max_tokens or None, until_context_full=request.until_context_full,
        stop=tuple(request.stop), keep_stop=request.keep_stop,
        ignore_eos=request.ignore_eos, special_tokens=request.special_tokens,
        grammar=request.grammar,
        json_schema=request.json_schema or None, json_object=request.json_object,
        grammar_triggers=tuple(GrammarTrigger(t.value, t.pattern)
                               for t in request.grammar_triggers))
    cache = CacheHints(
        prefix_tokens=request.prefix_tokens, prefix_chars=request.prefix_chars,
        boundary_chars=tuple(request.boundary_chars),
        boundary_ttl_seconds=tuple(request.boundary_ttl_seconds),
        session_id=request.session_id, parent_key=request.parent_key,
        continue_parent=request.continue_parent)
    return CompletionRequest(
        input_from_message(request), sampling, constraints, cache,
        tenant=optional.get("tenant"), n=request.n or 1, logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        speculation=Speculation(optional.get("speculative"), request.prediction),
        whole=request.whole)


def refuse(context: Any, exc: RequestError | ValueError) -> NoReturn:
    """End the call with the runtime's own error of the request: its status, a
    :class:`pb.Refusal` (code, the field refused, message) in the trailing metadata for
    programs (the gateway names the field in its API's terms), and "<code>: <message>" in
    the details for people. Messages are cut (``details``): one echoing a long field did
    not fit gRPC's 16 KiB of metadata, and the refusal arrived as RESOURCE_EXHAUSTED."""
    if isinstance(exc, RequestError):
        code, status = exc.code, ERROR_CODES.get(exc.code, grpc.StatusCode.UNKNOWN)
    else:  # a setting checked on its way in (SettingError, or llama.cpp's own checks)
        code, status = "invalid_argument", grpc.StatusCode.INVALID_ARGUMENT
    param = exc.setting if isinstance(exc, SettingError) else ""
    refusal = pb.Refusal(code=code, param=param, message=details(exc))
    context.set_trailing_metadata(((REFUSAL_METADATA_KEY, refusal.SerializeToString()),))
    context.abort(status, details(RuntimeError(f"{code}: {exc}")))
    raise AssertionError("unreachable")  # context.abort raises


def event_messages(batch: list[PromptDone | TokenEvent | Completion],
                   piece: Callable[[int], bytes]) -> Iterator[pb.CompleteEvent]:
    """The stream's messages for events that were ready at once: the text of tokens
    in a row of one choice (without logprobs) in one message, which carries when the
    first of them was decoded, so a reader that fell behind catches up in one step."""
    text: pb.CompleteEvent | None = None
    for event in batch:
        if isinstance(event, TokenEvent) and event.logprob is None and text is not None \
                and text.choice == event.choice:
            text.text += event.text
            text.token = max(event.token, 0)
            continue
        if text is not None:
            yield text
            text = None
        if isinstance(event, PromptDone):
            yield pb.CompleteEvent(prompt=prompt_message(event))
        elif isinstance(event, TokenEvent):
            if event.text or event.logprob is not None:  # (-1: held-back text, flushed)
                message = pb.CompleteEvent(
                    text=event.text, token=max(event.token, 0),
                    logprob=logprob_message(event.logprob, piece),
                    choice=event.choice, decoded_ns=event.decoded_ns)
                if event.logprob is None:
                    text = message  # more may join it
                else:
                    yield message
        else:
            yield pb.CompleteEvent(done=completion_message(event))
    if text is not None:
        yield text


class RuntimeService(pb_grpc.ModelRuntimeServicer):
    def __init__(self, runtime: Runtime, channel: EventChannel | None = None) -> None:
        self.runtime = runtime
        self.channel = channel  # where streamed requests that ask may have their events

    def piece(self, token: int) -> bytes:
        return self.runtime.model.token_to_piece(token, render_special=True)

    def Complete(self, request: pb.CompleteRequest, context: Any) -> Iterator[pb.CompleteEvent]:
        """A caller that goes away stops costing CPU: tokenizing its prompt stops at the
        next piece, and the request, queued or prefilling, ends at once (the RPC's
        termination callback cancels it: a prefill sends no event, so the stream alone
        would learn of it only at the first token). (tests/gateway/test_gateway_limits.py)"""
        rt = self.runtime
        on_channel = self._channel_events(request)
        try:
            req = rt.submit(request_from_message(request),
                            cancelled=lambda: not context.is_active(), events=on_channel)
            if not context.add_callback(lambda: rt.cancel(req)):
                rt.cancel(req)  # it terminated already
            for batch in rt.event_batches(req):
                if on_channel is None:
                    yield from event_messages(batch, self.piece)
        except (RequestError, ValueError) as exc:
            refuse(context, exc)
        if on_channel is not None:
            yield pb.CompleteEvent(channel_end=on_channel.sent)

    def _channel_events(self, request: pb.CompleteRequest) -> ChannelEvents | None:
        """Where a request that asks for the event channel has its events written (None:
        on the stream, as every other request)."""
        channel = self.channel
        if not request.channel_id or request.whole or channel is None or channel.closed:
            return None
        return ChannelEvents(channel, request.channel_id, lambda event: [
            message.SerializeToString() for message in event_messages([event], self.piece)])

    def CountTokens(self, request: pb.CompleteRequest, context: Any) -> pb.TokenCount:
        try:
            ids = self.runtime.prompt_tokens(input_from_message(request),
                                             cancelled=lambda: not context.is_active())
            return pb.TokenCount(tokens=len(ids), ids=ids)
        except RequestError as exc:
            refuse(context, exc)

    def Stats(self, request: pb.RuntimeStatsRequest, context: Any) -> pb.RuntimeStatsResponse:
        rt = self.runtime
        template = rt.template
        return pb.RuntimeStatsResponse(
            chat_template=template.source if template else "",
            bos_text=template.bos_token if template else "",
            eos_text=template.eos_token if template else "", add_bos=rt.model.add_bos,
            counters=rt.stats(), model_path=str(rt.model_path),
            model_fingerprint=rt.identity.model_fingerprint, kv_layout=rt.identity.kv_layout,
            n_seq_max=rt.ctx.n_seq_max, n_ctx=rt.ctx.n_ctx, cache_reachable=rt.cache_reachable(),
            batch_invariant=rt.batch_invariant, batch_variant_options=batch_variant_options(
                flash_attn=rt.config.flash_attn),
            kernels=rt.kernels, threads_wait=kernels.waiting(),
            latencies={name: pb.LatencySummary(**vars(summary))
                       for name, summary in rt.latencies().items()})


class RuntimeServer:
    """The runtime service on a unix socket and/or TCP. As with the cache daemon, TCP needs
    ``auth`` (a token or client certificates) unless ``insecure_tcp``; the unix socket is
    owner-only and goes without."""

    def __init__(self, runtime: Runtime, socket: OwnedSocket | None, listen: str | None,
                 auth: ServerAuth | None = None, insecure_tcp: bool = False,
                 channel: EventChannel | None = None) -> None:
        """``channel``: the event channel (default: the one the gateway that started this
        process gave it, if any: :meth:`EventChannel.inherited`). Only the unix socket's
        callers (its owner: the gateway) may have events written there; a TCP caller's
        ``channel_id`` is ignored, or it could write into the gateway's streams."""
        self.runtime = runtime
        self.auth = auth or ServerAuth()
        refuse_unprotected_tcp(listen, self.auth, insecure_tcp)
        self.channel = channel if channel is not None else EventChannel.inherited()
        self.health = health.HealthServicer()
        self.servers: list[grpc.Server] = []
        self.addresses: list[str] = []
        self.socket = socket
        if socket:
            self.servers.append(self._server([], RuntimeService(runtime, self.channel)))
            socket.bind(self.servers[-1])
            self.addresses.append(socket.address)
        if listen:
            self.servers.append(self._server(self.auth.interceptors(), RuntimeService(runtime)))
            self.addresses.append(add_tcp_port(self.servers[-1], listen, self.auth))

    def _server(self, interceptors: list[grpc.ServerInterceptor],
                service: RuntimeService) -> grpc.Server:
        return grpc_server(
            lambda server: pb_grpc.add_ModelRuntimeServicer_to_server(service, server),
            SERVICE_NAME, self.health, 16,
            [("grpc.max_receive_message_length", MAX_REQUEST_MESSAGE_BYTES)],
            interceptors, thread_name_prefix="runtime-rpc")

    def serve_forever(self) -> None:
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        signal.signal(signal.SIGINT, lambda *_: done.set())
        old = os.umask(0o077)
        try:
            for server in self.servers:
                server.start()
        finally:
            os.umask(old)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("model runtime (%s) listening on %s", self.runtime.model_path.name,
                 " and ".join(self.addresses))
        if self.servers and len(self.servers) > (1 if self.socket else 0):
            safe, how = tcp_security(self.auth)
            log.log(logging.INFO if safe else logging.WARNING, "TCP: %s", how)
        # Wake up regularly: a signal delivered to another thread (llama.cpp's, gRPC's)
        # only runs its Python handler once the main thread executes bytecode again.
        while not done.wait(0.2):
            pass
        log.info("shutting down: saving live sequences")
        self.health.enter_graceful_shutdown()
        # Stop the engine before the server: running requests then end with finish_reason
        # "shutdown", their sequences get the `shutdown` save and their streams the final
        # record. Stopping the server first cancelled them after the grace period, which
        # dropped their state (and the clients got UNAVAILABLE instead of a record).
        self.runtime.engine.close()
        for stopping in [server.stop(grace=2) for server in self.servers]:
            stopping.wait()
        self.runtime.close()
        if self.channel is not None:
            self.channel.close()
        if self.socket:
            self.socket.remove()
        log.info("model runtime stopped")
