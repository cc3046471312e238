"""Runtime settings with their documented defaults."""

from __future__ import annotations

from dataclasses import dataclass


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
    save_finish: bool = True
    save_evict: bool = True
    save_shutdown: bool = True
    shutdown_deadline_s: float = 10.0
    # Cache resolution
    # A finished sequence keeps its KV; a later prompt sharing a prefix with it reuses it
    # in place when that covers at least as much as the daemon's best state.
    reuse_live: bool = True
    session_resume_wait_ms: int = 500  # wait for a session's in-flight save
    cache_timeout_s: float = 2.0  # a cache call slower than this is given up (cold)
    max_pending_saves: int = 8  # saves queued for the sender beyond this are dropped
    tenant: str = ""
