"""The one package that calls into llama.cpp (through llama-cpp-python's ctypes bindings).

Everything above it works with Python ints, bytes and numpy arrays; nothing else in the
project calls llama.cpp (:mod:`model_runtime.grammar` and :mod:`model_runtime.chat.grammars`
use llama-cpp-python's pure-Python JSON-Schema converter, no C).  The high-level
``llama_cpp.Llama`` class is deliberately not used: its ``save_state`` copies the whole
logits array and is 10-50x slower than the per-sequence state API, and it owns exactly one
sequence.

Objects, one module each:

* :class:`LlamaModel` (:mod:`.model`) owns a ``llama_model*`` (weights, vocabulary, the
  chat template's source, which :mod:`model_runtime.chat.templates` renders).
* :class:`LlamaContext` (:mod:`.context`) owns a ``llama_context*`` (the KV cache of
  ``n_seq_max`` sequences) plus a reusable batch, and exposes decode, logits,
  per-sequence KV edits and copies, and the per-sequence state API
  (``llama_state_seq_*``); its docstring lists the facts of llama.cpp it is built around.
* :class:`SamplerChain` (:mod:`.sampler`) owns one request's ``llama_sampler*`` chain and
  grammar, and samples from a row of scores the caller holds; :func:`grammar_refusal`
  serves :mod:`model_runtime.grammar`.
* :mod:`.binding`: what is process-wide: llama.cpp's backend and log, its build options,
  and :class:`~.binding.Owner`, the lifetime of each object above; :mod:`.errors`: what
  they raise.

None is thread-safe: one thread (the model thread) drives a context and its chains.

Logging: llama.cpp's log output is silenced by default (a no-op callback).  Set the
environment variable ``KVCACHE_LLAMA_LOG=1`` (read at first model load) or call
:func:`set_llama_logging` / pass ``LlamaModel(..., verbose=True)`` to send it to stderr.
The setting is process-wide, as llama.cpp's logger is.
"""

from .binding import (
    BATCH_VARIANT_OPTIONS,
    LOG_ENV,
    TILED_MM_ENV,
    batch_variant_options,
    build_options,
    compute_apart,
    max_parallel_sequences,
    set_llama_logging,
)
from .context import KV_CACHE_TYPES, ContextParams, LlamaContext
from .errors import (
    GrammarDeadEnd,
    LlamaDecodeError,
    LlamaError,
    LlamaLoadError,
    ModelFileError,
    TokenizeCancelled,
)
from .model import GGUF_MAGIC, GGUF_VERSIONS, LlamaModel, check_gguf_file
from .sampler import GRAMMAR_WALK, TOKEN_DATA, SamplerChain, grammar_refusal

__all__ = [
    "BATCH_VARIANT_OPTIONS",
    "GRAMMAR_WALK",
    "TILED_MM_ENV",
    "GGUF_MAGIC",
    "GGUF_VERSIONS",
    "KV_CACHE_TYPES",
    "LOG_ENV",
    "TOKEN_DATA",
    "ContextParams",
    "GrammarDeadEnd",
    "LlamaContext",
    "LlamaDecodeError",
    "LlamaError",
    "LlamaLoadError",
    "LlamaModel",
    "ModelFileError",
    "SamplerChain",
    "TokenizeCancelled",
    "batch_variant_options",
    "build_options",
    "compute_apart",
    "check_gguf_file",
    "grammar_refusal",
    "max_parallel_sequences",
    "set_llama_logging",
]
