"""The one request the runtime takes (``Runtime.submit(request)``): what to complete
(:class:`Input`), how each token is drawn (:class:`~model_runtime.sampling.Sampling`), what
the output keeps to (:class:`Constraints`), what the cache may use (:class:`CacheHints`),
for whom (``tenant``), how many choices and what they report, and speculation
(:class:`Speculation`). The gRPC service makes one from a ``CompleteRequest`` message, once
(``service.request_from_message``); Python callers make one part by part, or with
:meth:`CompletionRequest.of` from the fields' names (``rt.complete(prompt=..., ...)``).

The parts hold what they are given: Runtime.submit checks them (a request's every part is
refused there with a message naming its field, as SettingError or RequestError), except
the sampling part, checked when it is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .sampling import GrammarTrigger, Sampling, logit_bias_pairs

Message = dict[str, str]


@dataclass(frozen=True)
class Input:
    """Exactly one of ``prompt`` (text, tokenized with the model's BOS; with ``system``
    rendered as a two-message chat), ``tokens`` or ``messages`` (rendered by the model's
    chat template)."""

    prompt: str | None = None
    tokens: Sequence[int] | None = None
    messages: Sequence[Message] | None = None
    system: str | None = None


@dataclass(frozen=True)
class Constraints:
    """What the output keeps to.

    ``max_tokens``         see ``runtime.generation_limit``: a prompt plus the max_tokens
                           given must fit the context; none given: 128 at most, or with
    ``until_context_full`` until the context is full.
    ``stop``               strings that end the output (not included in it, unless
                           ``keep_stop``: the one that ended it stays at its end).
    ``ignore_eos``         an end-of-generation token (EOS, ``<|im_end|>``, ...) does not
                           end the output: it goes on to ``max_tokens`` (none given: the
                           128 or the context's end above), or a stop string; or to the
                           end of a grammar (or schema) that lets nothing else follow.
    ``special_tokens``     control tokens (``<|im_end|>``, ...) show in the text, as
                           their vocabulary entries (else they render as nothing).

    Structured output (at most one of the three; refused before the request is queued,
    with a message naming the part that failed, when it cannot be used):

    ``grammar``            GBNF text (llama.cpp's grammar format, start rule ``root``):
                           the output follows it. An end-of-generation token is allowed
                           only where the grammar may end; one that cannot end within
                           ``max_tokens`` finishes with "length".
    ``json_schema``        a JSON Schema (a dict or its JSON text): the output is one JSON
                           value valid for it (objects, arrays, enums, const,
                           ``required``, ``additionalProperties``; properties not in
                           ``required`` may be left out, and no property beyond those
                           listed unless ``additionalProperties`` allows it: what OpenAI
                           calls ``strict``). Converted with llama.cpp's converter;
                           ``grammar.json_schema_grammar`` gives its GBNF.
    ``json_object``        the output is one JSON object.
    ``grammar_triggers``   a lazy grammar: the output is free until a trigger occurs (a
                           string is a literal; a :class:`GrammarTrigger` with
                           ``pattern=True`` a regular expression), then follows the
                           grammar from the trigger on (see GrammarTrigger). A token after
                           which the text from the trigger could not follow the grammar
                           is never sampled.
    """

    max_tokens: int | None = None
    until_context_full: bool = False
    stop: Sequence[str] = ()
    keep_stop: bool = False
    ignore_eos: bool = False
    special_tokens: bool = False
    grammar: str = ""
    json_schema: Mapping[str, Any] | str | None = None
    json_object: bool = False
    grammar_triggers: Sequence[str | GrammarTrigger] = ()


@dataclass(frozen=True)
class CacheHints:
    """What the cache may use, and where the prompt's states are saved.

    ``prefix_tokens``: a save boundary the caller declares (raw prompts and tokens).
    ``prefix_chars``: with a ``prompt`` rendered by the caller (the gateway renders chats
    itself), the save boundary at the end of its first ``prefix_chars`` characters (its
    system message and tools). ``boundary_chars``: more boundaries of such a prompt
    (cache_control breakpoints), each saved on its way (a ``cold`` save), and its entry
    pinned in the daemon for ``boundary_ttl_seconds[i]`` seconds (0: not pinned) when the
    request ends, whether it saved or restored it.

    ``session_id``: the conversation's live sequence, kept for its next turn.
    ``parent_key``: an earlier finish save to resume from (its finish_key in hex, or its
    bytes). ``continue_parent``: with ``parent_key`` and a ``prompt`` whose text begins
    with the text of the parent's state (a conversation rendered again after the reply
    that state ends with): that part is the state's tokens as the model generated them,
    never tokenized again, so a reuse covers all of it (``Runtime._continue``).
    """

    prefix_tokens: int = 0
    prefix_chars: int = 0
    boundary_chars: Sequence[int] = ()
    boundary_ttl_seconds: Sequence[int] = ()
    session_id: str = ""
    parent_key: str | bytes = b""
    continue_parent: bool = False


@dataclass(frozen=True)
class Speculation:
    """``speculative``: None for the runtime's ``config.speculative``; False: this request
    drafts nothing; True: it drafts (with the runtime's draft model if it has one, else by
    prompt lookup) whatever the runtime's default. ``prediction``: the text the output is
    expected to be (OpenAI's predicted outputs): its tokens are drafted first, also on a
    runtime whose default is off, unless ``speculative`` is False (text, tokenized as the
    output's text; or token ids). Neither changes a token of the output (see
    :mod:`.speculation`); the Completion reports the tokens drafted and accepted."""

    speculative: bool | None = None
    prediction: str | Sequence[int] = ""


@dataclass(frozen=True)
class CompletionRequest:
    """One request of the runtime (see the module's docstring for its parts).

    Sampling runs on llama.cpp's sampler chain, one per request (per choice), built when
    the request gets its sequence and freed when it ends. The chain, in order:
    ``logit_bias``, the penalties, ``top_k``, ``top_p``, ``min_p``, ``temperature``, then a
    draw seeded with ``seed``; a temperature of 0 (or below 1e-6) takes the most likely
    token instead (exactly what the raw scores' argmax gives):

    ``temperature``        0: greedy. ``top_k`` 0, ``top_p`` 1, ``min_p`` 0: off.
    ``seed``               None: a random draw. The draw's generator is llama.cpp's,
                           seeded with ``seed`` mod (2**32 - 1); choice ``i`` of ``n``
                           draws with ``seed + i``.
    ``repeat_penalty``     1: off. llama.cpp's rule: a token among the last
                           ``penalty_last_n`` tokens of prompt and output has its positive
                           score divided by it (a negative one multiplied).
    ``presence_penalty``   OpenAI's rule, over the last ``penalty_last_n`` generated tokens
    ``frequency_penalty``  only: a token's score loses ``presence_penalty`` if it occurs
                           there, and ``frequency_penalty`` per time.
    ``penalty_last_n``     the window: 64 by default; 0 turns the penalties off, -1 covers
                           the whole context.
    ``logit_bias``         (token id, bias) pairs added to those tokens' scores, from -100
                           to 100, or ``-math.inf`` to ban a token.

    ``logprobs``: each generated token's log probability under the raw scores (before any
    sampling setting), and the ``top_logprobs`` most likely at its place.

    ``n``: that many completions (choices) of the prompt. The prompt is computed, restored
    or reused in place once, on one sequence, and copied to ``n - 1`` more
    (``llama_memory_seq_cp``); every choice has its own chain (its own seed: ``seed + i``;
    without a seed, a random one each), grammar state, stop strings, logprobs and finish,
    and its first token is sampled from the same scores, the prompt end's. Events and
    Completions carry their ``choice`` index. A request of ``n`` takes ``n`` sequences at
    once: it waits until that many are free (and requests after it wait behind it), more
    than ``n_seq_max`` is refused (``invalid_argument``), and it cannot have a
    ``session_id``. The prompt counts once: every choice's Completion reports the same
    ``prompt_tokens`` and cache use, and the counters and metrics count the request once
    (by choice 0). Its saves: the prompt's (``cold`` and the prompt entry) once; each
    choice's ``continued`` and ``finish`` saves are its own, so whichever choice a client
    goes on with, its next turn is restored from that choice's state (a choice that ends
    at its very first token has none: its state is the prompt's, which cannot be read
    until the next decode makes the copies, counted ``saves_skipped_copy_pending``).
    Cancelling the request ends every choice.

    ``tenant``: the cache namespace's salt for this request (None: the runtime's
    ``config.tenant``). Tenants never share anything: not a saved state, not a live
    sequence, not a session.

    ``whole``: the caller reads the answer whole, not as it is generated (the gateway's
    requests without ``stream``): the text pieces come with the final record, in one
    step, instead of one by one (their reader, and its process, wake once, not once a
    token beside llama.cpp's threads). The events and the answer are the same.
    """

    input: Input
    sampling: Sampling = field(default_factory=Sampling)
    constraints: Constraints = field(default_factory=Constraints)
    cache: CacheHints = field(default_factory=CacheHints)
    tenant: str | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    speculation: Speculation = field(default_factory=Speculation)
    whole: bool = False

    @classmethod
    def of(cls, **fields: Any) -> CompletionRequest:
        """The request of these fields, each named as in its part (``prompt``,
        ``temperature``, ``max_tokens``, ``session_id``, ``tenant``, ...; ``logit_bias``
        as a mapping of token ids to biases). A name no part has is a TypeError."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
        top: dict[str, Any] = {}
        for name, value in fields.items():
            if name in TOP_FIELDS:
                top[name] = value
            elif name in OWNER:
                parts[OWNER[name]][name] = value
            else:
                raise TypeError(f"a completion request has no field {name!r}")
        if "logit_bias" in parts["sampling"]:
            parts["sampling"]["logit_bias"] = logit_bias_pairs(parts["sampling"]["logit_bias"])
        made = {name: PARTS[name](**values) for name, values in parts.items()}
        return cls(**made, **top)


# Each part's class, by the request's field that holds it.
PARTS: dict[str, Any] = {"input": Input, "sampling": Sampling, "constraints": Constraints,
                         "cache": CacheHints, "speculation": Speculation}
# Which part holds each of their fields (no two parts share a name).
OWNER = {f.name: part for part, kind in PARTS.items() for f in dataclasses.fields(kind)}
TOP_FIELDS = {f.name for f in dataclasses.fields(CompletionRequest)} - set(PARTS)
assert len(OWNER) == sum(len(dataclasses.fields(kind)) for kind in PARTS.values())
assert not TOP_FIELDS & set(OWNER)
