"""Runtime settings with their documented defaults, and the ranges they must lie in.

The ranges are checked here, when a :class:`RuntimeConfig` is made, so every entry point
(the command line, the Python API, ``model-runtime warm``) refuses a bad setting with the same
message before any model is loaded. llama.cpp itself would abort, hang or fail with no
reason given on several of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

# The largest request message the runtime's gRPC server accepts (a gateway refuses a
# larger one itself, with a 413, rather than sending it).
MAX_REQUEST_MESSAGE_BYTES = 16 << 20
# The trailing metadata a refused request's status carries its Refusal in (runtime.proto).
REFUSAL_METADATA_KEY = "model-runtime-refusal-bin"
# KV cache types llama.cpp stores without quantizing; the others need flash attention for V.
UNQUANTIZED_KV_TYPES = frozenset({"f32", "f16", "bf16"})


class SettingError(ValueError):
    """A setting outside its accepted range. ``setting`` names it (as a field or request
    parameter); ``rule`` says what is accepted, without the name."""

    def __init__(self, setting: str, rule: str) -> None:
        super().__init__(f"{setting} {rule}")
        self.setting = setting
        self.rule = rule


def check_int(setting: str, value: object, low: int, high: int | None = None) -> None:
    """``value`` must be an integer in [low, high] (no upper bound when ``high`` is None)."""
    # (compared as an int: numbers.Integral declares no comparisons, numpy's ints are one)
    ok = isinstance(value, Integral) and not isinstance(value, bool) and \
        low <= int(value) and (high is None or int(value) <= high)
    if not ok:
        accepted = f">= {low}" if high is None else f"from {low} to {high}"
        raise SettingError(setting, f"must be an integer {accepted}, got {value!r}")


def check_number(setting: str, value: object, low: float, *, above: bool = False,
                 high: float | None = None) -> None:
    """``value`` must be a finite number >= low (> low when ``above``), <= high if given.
    Written so that NaN fails too."""
    ok = (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
          and (float(value) > low if above else float(value) >= low)
          and (high is None or float(value) <= high))
    if not ok:
        accepted = f"{'>' if above else '>='} {low:g}"
        if high is not None:
            accepted += f" and <= {high:g}"
        raise SettingError(setting, f"must be a finite number {accepted}, got {value!r}")


def check_choice(setting: str, value: object, choices: set[str] | frozenset[str]) -> None:
    if value not in choices:
        raise SettingError(setting, f"must be one of {', '.join(sorted(choices))}; "
                                    f"got {value!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    # Context
    n_ctx: int = 4096  # tokens per sequence
    n_batch: int = 512  # tokens per llama_decode call, across all sequences
    n_seq_max: int = 4  # concurrent sequences (requests or pinned sessions)
    n_threads: int = 2
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    # Prefill is split into chunks so one long prompt does not starve decoding sequences.
    prefill_chunk: int = 256
    # Save points
    save_block: int = 256  # the cold save boundary is aligned to this many tokens
    trim: int = 32  # ... and lies at least this many tokens before the prompt's end
    min_save_tokens: int = 64  # states shorter than this are cheaper to recompute
    continued_interval: int = 512  # a `continued` save every N generated tokens (0: off)
    # States that cannot be cut (sliding-window, recurrent, hybrid models): a checkpoint
    # every N tokens of a prefill, so a prompt that diverges late in a long prefix still
    # finds a state near the divergence (0: off).
    checkpoint_interval: int = 1024
    # ... and one this many tokens before a prompt's end: the next prompt of an agent loop
    # is this one's text, the reply's and more, tokenized again, and the reply's first
    # characters may merge with this prompt's last tokens (a trailing space or newline),
    # which the state at the prompt's end then does not hold (0: off). llama.cpp's server
    # keeps a checkpoint 4 tokens before the end for the same reason.
    checkpoint_before_end: int = 4
    save_finish: bool = True
    save_evict: bool = True
    save_shutdown: bool = True
    shutdown_deadline_s: float = 10.0
    # Cache resolution
    # A finished sequence keeps its KV; a later prompt sharing a prefix with it reuses it
    # in place when that covers at least as much as the daemon's best state.
    reuse_live: bool = True
    session_resume_wait_ms: int = 500  # wait for a session's in-flight save
    # While requests run, the model thread holds their next batch this long for a new
    # request's cache answer (a lookup takes ~2 ms) so the request starts in that batch,
    # not one batch later (model_thread.py).
    resolve_wait_ms: int = 4
    # After a step, the model thread waits this long at most for the readers that keep up
    # to send the tokens it gave them, before the next step (request.HandOffs): sent
    # during it, they would take a core from llama.cpp's threads. 0: no wait.
    hand_off_ms: float = 1.0
    cache_timeout_s: float = 2.0  # a cache call slower than this is given up (cold)
    max_pending_saves: int = 8  # saves queued for the sender beyond this are dropped
    # A save waits this long for another writer's save of a longer shared prefix to be
    # published (then stores only what follows it); still in flight: dropped.
    in_flight_wait_ms: int = 1000
    # How often the daemon is probed, so an outage (and its end) is reported when it
    # happens rather than noticed in the hit rates.
    cache_check_interval_s: float = 2.0
    tenant: str = ""
    # Speculative decoding (speculation.py): "off", "ngram" (prompt lookup) or "draft" (a
    # draft model, given to the Runtime); a request may turn it on or off for itself.
    # It changes no token: every token is the one a run without it gives.
    speculative: str = "off"
    draft_max: int = 16  # drafted tokens verified at most per request and tick

    def __post_init__(self) -> None:
        # Imported here: the sampling settings share this module's checks, and they must
        # not load llama.cpp.
        from .llama_backend import KV_CACHE_TYPES, max_parallel_sequences

        for name in ("n_ctx", "n_batch", "n_threads", "prefill_chunk", "save_block",
                     "max_pending_saves", "draft_max"):
            check_int(name, getattr(self, name), 1)
        check_int("n_seq_max", self.n_seq_max, 1, max_parallel_sequences())
        for name in ("trim", "min_save_tokens", "continued_interval", "checkpoint_interval",
                     "checkpoint_before_end", "session_resume_wait_ms", "in_flight_wait_ms",
                     "resolve_wait_ms"):
            check_int(name, getattr(self, name), 0)
        check_number("shutdown_deadline_s", self.shutdown_deadline_s, 0)
        check_number("cache_timeout_s", self.cache_timeout_s, 0, above=True)
        check_number("hand_off_ms", self.hand_off_ms, 0)
        check_number("cache_check_interval_s", self.cache_check_interval_s, 0, above=True)
        check_choice("type_k", self.type_k, set(KV_CACHE_TYPES))
        check_choice("type_v", self.type_v, set(KV_CACHE_TYPES))
        if self.type_v not in UNQUANTIZED_KV_TYPES and not self.flash_attn:
            # llama.cpp refuses the context then, and says why only in its own log.
            raise SettingError("type_v", f"{self.type_v} is quantized, which needs flash "
                                         "attention (flash_attn); unquantized types: "
                                         f"{', '.join(sorted(UNQUANTIZED_KV_TYPES))}")
        if not isinstance(self.tenant, str):
            raise SettingError("tenant", f"must be a string, got {self.tenant!r}")
        check_choice("speculative", self.speculative, {"off", "ngram", "draft"})
