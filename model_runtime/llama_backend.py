"""The one module that calls into llama.cpp (through llama-cpp-python's ctypes bindings).

Everything above this module works with Python ints, bytes and numpy arrays; nothing
else in the project imports ``llama_cpp``.  The high-level ``llama_cpp.Llama`` class is
deliberately not used: its ``save_state`` copies the whole logits array and is 10-50x
slower than the per-sequence state API, and it owns exactly one sequence.

Objects:

* :class:`LlamaModel` owns a ``llama_model*`` (weights, vocabulary, chat template).
* :class:`LlamaContext` owns a ``llama_context*`` (the KV cache of ``n_seq_max``
  sequences) plus a reusable batch, and exposes decode, logits, per-sequence KV edits and
  copies, and the per-sequence state API (``llama_state_seq_*``).
* :class:`SamplerChain` owns one request's ``llama_sampler*`` chain and grammar, and
  samples from a row of scores the caller holds; :func:`grammar_refusal` and
  :func:`json_schema_to_gbnf` serve :mod:`model_runtime.grammar`.

None is thread-safe: one thread (the model thread) drives a context and its chains.

Logging: llama.cpp's log output is silenced by default (a no-op callback).  Set the
environment variable ``KVCACHE_LLAMA_LOG=1`` (read at first model load) or call
:func:`set_llama_logging` / pass ``LlamaModel(..., verbose=True)`` to send it to stderr.
The setting is process-wide, as llama.cpp's logger is.

Facts about llama.cpp 0.3.36 (vendored llama.cpp) this module is built around:

* Per-sequence capacity.  With ``kv_unified=false`` (llama.cpp's default) the KV cache has
  one *stream* per sequence, each of ``n_ctx / n_seq_max`` cells (rounded up to 256).
  With ``kv_unified=true`` all sequences share one stream of ``n_ctx`` cells.
  :class:`ContextParams` ``n_ctx`` means *per sequence*; see its docstring.
* State format.  A sequence state is ``magic u32, seq_id i32, n_stream u32`` followed by
  one ``cell_count u32`` per stream (and that stream's cells when non-zero).  So the raw
  bytes depend on ``n_stream`` (= ``n_seq_max`` unless unified) and a state taken from a
  context with a different stream count is rejected ("n_stream mismatch").  For plain
  attention models this module stores states in a canonical single-stream form (see
  :meth:`LlamaContext.state_seq_get`), so cached states do not depend on ``n_seq_max`` or
  ``kv_unified``.  ``n_ctx`` never changes the format; it only bounds how many cells fit.
* ``llama_state_seq_set_data`` never raises: it returns 0 on any rejection (bad magic,
  n_stream mismatch, K/V type or row size mismatch, V-transposition (flash attention)
  mismatch, layer count mismatch, not enough free cells) and clears the sequence.  It does
  *not* detect a state from a different model of the same shape.
* A restored sequence has no logits: re-decode its last token (after dropping that cell)
  to get fresh logits.  Sliding-window and recurrent models cannot be truncated after a
  restore (see :meth:`LlamaContext.can_truncate_restored`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import llama_cpp as _lc
import numpy as np

from . import kv_cells
from .token_seams import SpecialToken, cut_points, is_seam

__all__ = [
    "KV_CACHE_TYPES",
    "LOG_ENV",
    "TOKEN_DATA",
    "ContextParams",
    "GrammarDeadEnd",
    "LlamaContext",
    "LlamaDecodeError",
    "LlamaError",
    "TokenizeCancelled",
    "LlamaLoadError",
    "LlamaModel",
    "ModelFileError",
    "SamplerChain",
    "check_gguf_file",
    "grammar_refusal",
    "json_schema_to_gbnf",
    "max_parallel_sequences",
    "set_llama_logging",
]

LOG_ENV = "KVCACHE_LLAMA_LOG"

#: Vocabulary types whose tokenizer handles each piece between special tokens alone
#: (llama_vocab::impl::tokenize): SPM (its space prefix follows a special token either
#: way), BPE, UGM, RWKV, PLaMo-2.
PIECEWISE_VOCAB_TYPES = frozenset({
    _lc.LLAMA_VOCAB_TYPE_SPM, _lc.LLAMA_VOCAB_TYPE_BPE, _lc.LLAMA_VOCAB_TYPE_UGM,
    _lc.LLAMA_VOCAB_TYPE_RWKV, _lc.LLAMA_VOCAB_TYPE_PLAMO2})

#: Characters tokenized at a time by :meth:`LlamaModel.tokenize_in_pieces` (~1 ms each).
TOKENIZE_PIECE_CHARS = 8192

#: KV cache element types accepted for ``type_k`` / ``type_v`` (ggml type ids).
KV_CACHE_TYPES: Mapping[str, int] = {
    "f32": _lc.GGML_TYPE_F32,
    "f16": _lc.GGML_TYPE_F16,
    "bf16": 30,  # GGML_TYPE_BF16; not exported by the bindings
    "q8_0": _lc.GGML_TYPE_Q8_0,
    "q4_0": _lc.GGML_TYPE_Q4_0,
    "q4_1": _lc.GGML_TYPE_Q4_1,
    "q5_0": _lc.GGML_TYPE_Q5_0,
    "q5_1": _lc.GGML_TYPE_Q5_1,
    "iq4_nl": _lc.GGML_TYPE_IQ4_NL,
}


class LlamaError(RuntimeError):
    """A llama.cpp call failed."""


class TokenizeCancelled(LlamaError):
    """The caller of a tokenization in pieces went away: the rest was not tokenized."""


class LlamaLoadError(LlamaError):
    """A model or context could not be created."""


class ModelFileError(LlamaLoadError, ValueError):
    """The model file is not a GGUF model llama.cpp can load (missing the GGUF magic, an
    unsupported GGUF version, truncated or damaged). The message names the file."""


class LlamaDecodeError(LlamaError):
    """``llama_decode`` returned non-zero.

    Codes: 1 = no KV slot for the batch (cache full), 2 = aborted, -1 = invalid batch
    (e.g. positions not consecutive with the sequence's cells), < -1 = fatal.
    On error the memory is restored to its state before the call.
    """

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode failed with code {code}")
        self.code = code


# --------------------------------------------------------------------------- backend


class _LogSink(threading.local):
    """Where llama.cpp's log lines go: stderr when logging is on, and the calling
    thread's capture list while :func:`_capturing` runs (llama.cpp logs on the thread
    that called it, so a capture holds that call's lines alone)."""

    enabled = False  # process-wide, set by set_llama_logging (class attribute)
    lines: list[str] | None = None  # per thread


_sink = _LogSink()


@_lc.llama_log_callback
def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """The one log callback; a module global so the C callback outlives every caller."""
    line = text.decode("utf-8", errors="replace")
    if _sink.lines is not None:
        _sink.lines.append(line)
    if _LogSink.enabled:
        sys.stderr.write(line)


@contextlib.contextmanager
def _capturing() -> Iterator[list[str]]:
    """The log lines llama.cpp writes on this thread meanwhile (its reasons for a NULL)."""
    _sink.lines = lines = []
    try:
        yield lines
    finally:
        _sink.lines = None


_backend_lock = threading.Lock()
_backend_ready = False


def set_llama_logging(enabled: bool) -> None:
    """Send llama.cpp/ggml logs to stderr (``True``) or drop them (``False``). Process-wide."""
    _LogSink.enabled = enabled
    _lc.llama_log_set(_log, ctypes.c_void_p(0))


#: llama.cpp's CPU backend computes K-quant (Q2_K..Q6_K, IQ*) matrix products of 8 rows or
#: more with tiled kernels and smaller ones with vec_dot, which round otherwise: a token's
#: scores then depend on the size of the chunk it is decoded in (on Gemma-3-270M's Q4_K
#: weights by up to 3 in a logit, greedy output changing after a restore). The runtime
#: turns the tiled kernels off (this variable read once, at the first product) unless the
#: caller set it or ``GGML_CPU_TILED_MM_FORCE``: prefill of such models is slower, decode
#: (one row) is what it was.
TILED_MM_ENV = "GGML_CPU_TILED_MM"


def _ensure_backend(verbose: bool) -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            if TILED_MM_ENV not in os.environ and f"{TILED_MM_ENV}_FORCE" not in os.environ:
                os.environ[TILED_MM_ENV] = "0"
            env = os.environ.get(LOG_ENV, "").strip().lower()
            set_llama_logging(env not in ("", "0", "false", "no", "off"))
            _lc.llama_backend_init()
            _backend_ready = True
    if verbose:
        set_llama_logging(True)


def max_parallel_sequences() -> int:
    """The most sequences one context can hold (llama.cpp's compile-time limit)."""
    return int(_lc.llama_max_parallel_sequences())


#: Build options of llama.cpp's CPU backend whose kernels compute a token decoded alone (or
#: at some places in a batch) with other rounding than the same token inside a batch:
#: llamafile's sgemm (f16 attention products; on SmolLM2 the scores after a restored
#: prompt's last token, decoded alone, differed by up to 0.42) and the weight repacking of
#: Q4_0/Q4_K/IQ4_NL (matrix rows in groups of four: on Gemma-3's Q4_K weights, a
#: position's scores depended on the length of the chunk it was computed in).
BATCH_VARIANT_OPTIONS = ("LLAMAFILE", "REPACK")


def build_options() -> dict[str, str]:
    """What llama.cpp reports of its build (``llama_print_system_info``): CPU features and
    options, each ``name -> value`` (e.g. ``{"AVX2": "1", "LLAMAFILE": "1"}``)."""
    info = _lc.llama_print_system_info().decode("utf-8", errors="replace")
    options: dict[str, str] = {}
    for part in info.split("|"):
        name, sep, value = part.rpartition("=")
        if sep:
            options[name.split(":")[-1].strip()] = value.strip()
    return options


def batch_variant_options() -> list[str]:
    """The options of this llama.cpp build that make results depend on batching."""
    options = build_options()
    return [name for name in BATCH_VARIANT_OPTIONS if options.get(name) == "1"]


# --------------------------------------------------------------------------- params


@dataclass(frozen=True)
class ContextParams:
    """Settings of a :class:`LlamaContext`.

    ``n_ctx`` is the capacity of *each* sequence, in tokens.  With ``kv_unified=False``
    (the default) llama.cpp gives every sequence its own KV stream, so the context is
    created with ``n_ctx * n_seq_max`` cells and each sequence can always hold ``n_ctx``
    tokens regardless of the others (a restore never fails because another sequence is
    long).  Attention of a sequence then only scans its own stream.  With
    ``kv_unified=True`` all sequences share one stream of ``n_ctx`` cells: less memory,
    but the *sum* of all sequences is bounded by ``n_ctx`` and attention scans the shared
    buffer.  llama.cpp rounds per-stream sizes up to a multiple of 256.

    ``n_batch`` bounds the tokens of one :meth:`LlamaContext.decode` call; ``n_ubatch``
    the tokens of one physical compute step.  ``type_k``/``type_v`` are keys of
    :data:`KV_CACHE_TYPES`; quantized V needs ``flash_attn=True``.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 4
    n_threads: int = 1
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    kv_unified: bool = False

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.n_seq_max > _lc.llama_max_parallel_sequences():
            raise ValueError(f"n_seq_max > {_lc.llama_max_parallel_sequences()}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_CACHE_TYPES:
                raise ValueError(f"{name} must be one of {sorted(KV_CACHE_TYPES)}")


# --------------------------------------------------------------------------- model

GGUF_MAGIC = b"GGUF"
#: GGUF versions llama.cpp reads (version 1 is no longer supported).
GGUF_VERSIONS = (2, 3)
_GGUF_HEADER = struct.Struct("<4sI")


def check_gguf_file(path: Path) -> None:
    """Raise :class:`ModelFileError` unless ``path`` starts with a GGUF header llama.cpp
    reads. Checked before llama.cpp sees the file: it answers anything else with NULL and
    gives its reason only in its own log."""
    try:
        with open(path, "rb") as f:
            head = f.read(_GGUF_HEADER.size)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}") from None
    if not head:
        raise ModelFileError(f"{path} is empty, not a GGUF model")
    if head[: len(GGUF_MAGIC)] != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF model (it does not start with the "
                             f"GGUF magic {GGUF_MAGIC.decode()!r})")
    if len(head) < _GGUF_HEADER.size:
        raise ModelFileError(f"{path} is truncated: it ends inside the GGUF header")
    _, version = _GGUF_HEADER.unpack(head)
    if version not in GGUF_VERSIONS:
        raise ModelFileError(f"{path} is GGUF version {version}; llama.cpp reads versions "
                             f"{' and '.join(map(str, GGUF_VERSIONS))}")


def _read_string(fn: Any, *args: Any, initial: int = 256) -> str:
    """Call a llama.cpp ``(…, char *buf, size)`` string getter, growing the buffer."""
    size = initial
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, size)
        if n < 0:
            return ""
        if n < size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1


class _Owner:
    """Owns a llama.cpp object: ``close()`` frees it; usable as a context manager."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; prefer close()
        with contextlib.suppress(Exception):  # e.g. during interpreter shutdown
            self.close()


_O = TypeVar("_O", bound=_Owner)


class LlamaModel(_Owner):
    """A loaded GGUF model: weights, vocabulary and metadata. Owns ``llama_model*``.

    Loaded on CPU with mmap; the weights are shared by every context made from it.
    """

    def __init__(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        _ensure_backend(verbose)
        self.path = Path(path)
        self._model: Any = None
        if not self.path.is_file():
            raise FileNotFoundError(self.path)
        check_gguf_file(self.path)
        mparams = _lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = _lc.llama_model_load_from_file(os.fsencode(self.path), mparams)
        if not model:
            raise ModelFileError(f"llama.cpp could not load {self.path}: the GGUF file is "
                                 "truncated or damaged, or its architecture is unsupported "
                                 f"({LOG_ENV}=1 shows llama.cpp's reason)")
        self._model = model
        self._vocab = _lc.llama_model_get_vocab(model)
        self.n_layer: int = _lc.llama_model_n_layer(model)
        self.n_embd: int = _lc.llama_model_n_embd(model)
        self.n_head: int = _lc.llama_model_n_head(model)
        self.n_head_kv: int = _lc.llama_model_n_head_kv(model)
        self.n_ctx_train: int = _lc.llama_model_n_ctx_train(model)
        self.n_vocab: int = _lc.llama_vocab_n_tokens(self._vocab)
        self.n_swa: int = _lc.llama_model_n_swa(model)
        # Hybrid models (attention + recurrent layers) carry recurrent state too: their
        # restored states can no more be truncated than a pure recurrent model's.
        self.is_recurrent: bool = bool(
            _lc.llama_model_is_recurrent(model) or _lc.llama_model_is_hybrid(model)
        )
        self.rope_type: int = _lc.llama_model_rope_type(model)
        self.rope_freq_scale_train: float = _lc.llama_model_rope_freq_scale_train(model)
        self.description: str = _read_string(_lc.llama_model_desc, model)
        self.bos_token: int = _lc.llama_vocab_bos(self._vocab)
        self.eos_token: int = _lc.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(_lc.llama_vocab_get_add_bos(self._vocab))
        self._template_src: str | None = None
        raw = _lc.llama_model_chat_template(model, None)
        if raw:
            self._template_src = raw.decode("utf-8", errors="replace")

    # -- lifetime
    def close(self) -> None:
        """Free the model. Contexts made from it must be closed first."""
        if self._model is not None:
            _lc.llama_model_free(self._model)
            self._model = None
            self._vocab = None

    @property
    def handle(self) -> Any:
        """The raw ``llama_model*``; raises if closed. For this module's use."""
        if self._model is None:
            raise LlamaError("model is closed")
        return self._model

    # -- metadata
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value rendered as a string by llama.cpp, or None if absent."""
        k = key.encode()
        buf = ctypes.create_string_buffer(256)
        n = _lc.llama_model_meta_val_str(self.handle, k, buf, 256)
        if n < 0:
            return None
        if n >= 256:
            buf = ctypes.create_string_buffer(n + 1)
            n = _lc.llama_model_meta_val_str(self.handle, k, buf, n + 1)
        return buf.raw[:n].decode("utf-8", errors="replace")

    # -- vocabulary
    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Text to token ids. ``add_special`` adds BOS (if the model wants it);
        ``parse_special`` turns texts like ``<|im_start|>`` into their control token."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            arr = (_lc.llama_token * cap)()
            n = _lc.llama_tokenize(
                self._vocab_h(), data, len(data), arr, cap, add_special, parse_special
            )
            if n >= 0:
                return arr[:n]
            if -n <= cap:  # should not happen; avoid looping forever
                raise LlamaError(f"llama_tokenize failed ({n})")
            cap = -n

    def tokenize_in_pieces(self, text: str, *, add_special: bool = True,
                           cancelled: Callable[[], bool] | None = None,
                           piece_chars: int = TOKENIZE_PIECE_CHARS) -> list[int]:
        """``tokenize(text, parse_special=True)``, a piece of about ``piece_chars`` at a
        time, cut where llama.cpp cuts the text anyway (:func:`cut_points`): linear in
        the text's length, and ``cancelled`` is asked between pieces (true: raises
        :class:`TokenizeCancelled`). A vocabulary never tokenized in parts is tokenized
        whole. (tests/test_token_seams.py)"""
        specials = self.seam_specials
        cuts = cut_points(text, specials, piece_chars) if specials is not None and \
            len(text) > piece_chars else []
        bounds = [0, *cuts, len(text)]
        tokens: list[int] = []
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            if cancelled is not None and cancelled():
                raise TokenizeCancelled(f"cancelled after {start} of {len(text)} characters")
            tokens += self.tokenize(text[start:end], add_special=add_special and i == 0)
        return tokens

    def tokenize_after(self, head_tokens: Sequence[int], text: str, at: int,
                       cancelled: Callable[[], bool] | None = None) -> list[int] | None:
        """``tokenize(text)`` where ``head_tokens`` are ``tokenize(text[:at])``, tokenizing
        only ``text[at:]``; None where that could give other tokens (see
        :mod:`~model_runtime.token_seams`; tests/test_token_seams.py compares both ways)."""
        specials = self.seam_specials
        if specials is None or not is_seam(text, at, specials):
            return None
        return [*head_tokens, *self.tokenize_in_pieces(text[at:], add_special=False,
                                                       cancelled=cancelled)]

    @functools.cached_property
    def seam_specials(self) -> tuple[SpecialToken, ...] | None:
        """The tokens llama.cpp cuts a text at before tokenizing it (read once), or None
        where a text is never tokenized in parts: a vocabulary whose pieces are not
        tokenized each alone or that adds something at the end (WPM appends SEP; others
        may add EOS), or one with a special token whose text is not UTF-8 (llama.cpp
        matches its bytes, which no text of ours contains)."""
        vocab = self._vocab_h()
        if _lc.llama_vocab_type(vocab) not in PIECEWISE_VOCAB_TYPES or \
                _lc.llama_vocab_get_add_eos(vocab):
            return None
        cut = _lc.LLAMA_TOKEN_ATTR_CONTROL | _lc.LLAMA_TOKEN_ATTR_USER_DEFINED | \
            _lc.LLAMA_TOKEN_ATTR_UNKNOWN
        specials = []
        for token in range(self.n_vocab):
            attr = _lc.llama_vocab_get_attr(vocab, token)
            if attr & cut:
                try:
                    text = (_lc.llama_vocab_get_text(vocab, token) or b"").decode("utf-8")
                except UnicodeDecodeError:
                    return None
                specials.append(SpecialToken(text, bool(attr & _lc.LLAMA_TOKEN_ATTR_LSTRIP)))
        return tuple(specials)

    def token_to_piece(self, token: int, *, render_special: bool = False) -> bytes:
        """The raw bytes of one token (may be a partial UTF-8 sequence).

        Control tokens (BOS, ``<|im_end|>``, ...) render as ``b""`` unless
        ``render_special``.
        """
        self._check_token(token)
        buf = ctypes.create_string_buffer(64)
        n = _lc.llama_token_to_piece(self._vocab_h(), token, buf, 64, 0, render_special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _lc.llama_token_to_piece(self._vocab_h(), token, buf, -n, 0, render_special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, render_special: bool = False) -> str:
        """Token ids to text (UTF-8, invalid sequences replaced).

        Uses ``llama_detokenize`` so tokenizer-specific rules (leading-space removal,
        space cleaning) are applied exactly as llama.cpp does.  BOS/EOS are not stripped;
        control tokens render as nothing unless ``render_special``.
        """
        n = len(tokens)
        if n == 0:
            return ""
        for t in tokens:
            self._check_token(t)
        arr = (_lc.llama_token * n)(*tokens)
        cap = max(64, n * 8)
        while True:
            buf = ctypes.create_string_buffer(cap)
            k = _lc.llama_detokenize(self._vocab_h(), arr, n, buf, cap, False, render_special)
            if k >= 0:
                return buf.raw[:k].decode("utf-8", errors="replace")
            cap = -k

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ``<|im_end|>``, ...)."""
        return bool(_lc.llama_vocab_is_eog(self._vocab_h(), token))

    def is_control(self, token: int) -> bool:
        return bool(_lc.llama_vocab_is_control(self._vocab_h(), token))

    def token_text(self, token: int) -> str:
        """The vocabulary entry of a token as stored in the GGUF (e.g. ``<|im_end|>``)."""
        self._check_token(token)
        raw = _lc.llama_vocab_get_text(self._vocab_h(), token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def _vocab_h(self) -> Any:
        if self._model is None:
            raise LlamaError("model is closed")
        return self._vocab

    def _check_token(self, token: int) -> None:
        # llama.cpp indexes its vocabulary without bounds checks (it would abort/crash).
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token {token} outside vocabulary [0, {self.n_vocab})")

    # -- chat template
    def chat_template(self) -> str | None:
        """The GGUF's ``tokenizer.chat_template`` (jinja source), or None. Rendered by
        :mod:`model_runtime.chat.templates`."""
        return self._template_src


# --------------------------------------------------------------------------- context


class LlamaContext(_Owner):
    """A llama.cpp context: the KV cache of ``n_seq_max`` sequences and a decode batch.

    Sequence ids are ``0 .. n_seq_max-1``; anything else raises ``ValueError`` here
    (llama.cpp would abort the process on some paths).
    """

    def __init__(self, model: LlamaModel, params: ContextParams) -> None:
        self.model = model
        self.params = params
        self._ctx: Any = None
        self._plain_kv = model.n_swa == 0 and not model.is_recurrent
        cp = _lc.llama_context_default_params()
        n_seq = params.n_seq_max
        cp.n_ctx = params.n_ctx if params.kv_unified else params.n_ctx * n_seq
        cp.n_batch = params.n_batch
        cp.n_ubatch = min(params.n_ubatch, params.n_batch)
        cp.n_seq_max = n_seq
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads
        cp.type_k = KV_CACHE_TYPES[params.type_k]
        cp.type_v = KV_CACHE_TYPES[params.type_v]
        cp.flash_attn_type = (
            _lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if params.flash_attn
            else _lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cp.kv_unified = params.kv_unified
        cp.no_perf = True
        cp.embeddings = False
        ctx = _lc.llama_init_from_model(model.handle, cp)
        if not ctx:
            raise LlamaLoadError(f"llama.cpp could not create a context with {params}")
        self._ctx = ctx
        self._mem = _lc.llama_get_memory(ctx)
        self.n_seq_max: int = _lc.llama_n_seq_max(ctx)
        #: Tokens one sequence can hold (llama.cpp's n_ctx_seq).
        self.n_ctx: int = _lc.llama_n_ctx_seq(ctx)
        #: Cells of the whole KV cache (all sequences).
        self.n_ctx_total: int = _lc.llama_n_ctx(ctx)
        self.n_batch: int = _lc.llama_n_batch(ctx)
        # Number of KV streams, which is part of llama.cpp's raw state format.
        self._n_stream = 1 if params.kv_unified else self.n_seq_max
        self._alloc_batch(self.n_batch)
        self._want: np.ndarray = np.zeros(0, dtype=bool)
        self._scratch_buf = np.empty(0, dtype=np.uint8)
        # Sequences of a copy across KV streams that llama.cpp has not made yet (see
        # seq_copy): their data must not be read or replaced until the next decode.
        self._copies_pending: set[int] = set()
        #: Whether a sequence's state is cells followed by a tail (see state_has_tail), and
        #: the positions of its tail when that is a sliding window's cache (else 0).
        self.state_has_tail, self.state_window = (
            (False, 0) if self._plain_kv else self._probe_state_tail())

    def _probe_state_tail(self) -> tuple[bool, int]:
        """Whether this context's states are a plain attention cache (cells that can be
        cut) followed by a part that cannot (kv_cells' tail): a hybrid model's recurrent
        state, or the window cache of a sliding-window model with full-attention layers
        (llama.cpp writes ``llama_memory_hybrid``'s and ``llama_kv_cache_iswa``'s states
        so). Seen in a state of two tokens of sequence 0, left empty: a pure recurrent
        model's state does not parse as cells, and one whose window covers every layer
        writes one cache and no tail. A tail that reads as the cache of the window's
        positions (llama.cpp's sliding window, ``n_swa``) is that window."""
        self.decode([1, 2], [0, 1], [0, 0], [False, True])
        try:
            cells = kv_cells.parse(self.state_seq_get(0), tail=True)
        except kv_cells.StateFormatError:
            return False, 0
        finally:
            self.seq_clear(0)
        if not (cells.is_prefix and cells.n_cells == 2 and len(cells.tail) > 0):
            return False, 0
        try:
            kv_cells.window_of(cells, self.model.n_swa)
        except kv_cells.StateFormatError:
            return True, 0
        return True, self.model.n_swa

    def _alloc_batch(self, n: int) -> None:
        """A llama_batch whose arrays are numpy buffers owned by this object.

        Filling numpy slices is ~100x faster than per-token ctypes assignment, and owning
        the memory means nothing needs ``llama_batch_free``.  Every token belongs to
        exactly one sequence, so ``seq_id[i]`` points at ``_seq[i]``.
        """
        self._tok = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._nseq = np.ones(n, dtype=np.int32)
        self._seq = np.zeros(n, dtype=np.int32)
        self._out = np.zeros(n, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_ptrs = (i32p * n)(*(ctypes.cast(base + 4 * i, i32p) for i in range(n)))
        b = _lc.llama_batch()
        b.n_tokens = 0
        b.token = self._tok.ctypes.data_as(i32p)
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self._pos.ctypes.data_as(i32p)
        b.n_seq_id = self._nseq.ctypes.data_as(i32p)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p))
        b.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    # -- lifetime
    def close(self) -> None:
        if self._ctx is not None:
            _lc.llama_free(self._ctx)
            self._ctx = None
            self._mem = None

    def _h(self) -> Any:
        if self._ctx is None:
            raise LlamaError("context is closed")
        return self._ctx

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} outside [0, {self.n_seq_max})")

    # -- decode
    def decode(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int],
        want_logits: Sequence[bool],
    ) -> None:
        """One ``llama_decode`` over a batch that may mix sequences.

        Entry ``i`` is token ``tokens[i]`` at ``positions[i]`` of sequence ``seq_ids[i]``.
        Per sequence, positions must continue the sequence (``seq_pos_max + 1`` onwards,
        consecutive).  Logits are kept for the entries with ``want_logits[i]`` and read
        with :meth:`logits` (batch index ``i``) until the next decode.

        Raises ValueError for malformed input (including more than ``n_batch`` tokens)
        and :class:`LlamaDecodeError` when llama.cpp fails (e.g. code 1: cache full).
        """
        ctx = self._h()
        n = len(tokens)
        if not (len(positions) == len(seq_ids) == len(want_logits) == n):
            raise ValueError("tokens, positions, seq_ids and want_logits differ in length")
        if n == 0:
            raise ValueError("empty batch")
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        tok = np.asarray(tokens, dtype=np.int64)
        seq = np.asarray(seq_ids, dtype=np.int64)
        if tok.min() < 0 or tok.max() >= self.model.n_vocab:
            raise ValueError("token id outside the vocabulary")
        if seq.min() < 0 or seq.max() >= self.n_seq_max:
            raise ValueError(f"seq_id outside [0, {self.n_seq_max})")
        self._tok[:n] = tok
        self._pos[:n] = np.asarray(positions, dtype=np.int32)
        self._seq[:n] = seq
        want = np.asarray(want_logits, dtype=bool)
        self._out[:n] = want
        self._batch.n_tokens = n
        self._want = np.zeros(0, dtype=bool)
        rc = _lc.llama_decode(ctx, self._batch)
        if rc != 0:
            raise LlamaDecodeError(rc)
        self._copies_pending.clear()  # a decode makes them first
        self._want = want.copy()

    def logits(self, batch_index: int) -> np.ndarray:
        """A float32 copy of the logits of entry ``batch_index`` of the last decode."""
        if not (0 <= batch_index < len(self._want) and self._want[batch_index]):
            raise IndexError(f"no logits for batch index {batch_index} in the last decode")
        ptr = _lc.llama_get_logits_ith(self._h(), batch_index)
        if not ptr:
            raise LlamaError(f"llama.cpp has no logits for batch index {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    # -- KV edits
    def clear(self) -> None:
        """Empty every sequence."""
        _lc.llama_memory_clear(self._mem_h(), True)

    def seq_clear(self, seq_id: int) -> None:
        """Remove every cell of ``seq_id`` (never fails)."""
        self._check_seq(seq_id)
        _lc.llama_memory_seq_rm(self._mem_h(), seq_id, -1, -1)

    def seq_truncate(self, seq_id: int, n_keep: int) -> bool:
        """Keep positions ``[0, n_keep)`` of ``seq_id``; False if llama.cpp refuses.

        Recurrent models refuse partial removal.  Sliding-window models *accept* it even
        for a restored sequence, which holds only the last window of positions: the
        result is silently wrong (the window is short of the dropped position's
        predecessors; on Gemma-3 the sequence was seen to end up empty).  Check
        :meth:`can_truncate_restored` first.
        """
        self._check_seq(seq_id)
        if n_keep < 0:
            raise ValueError("n_keep must be >= 0")
        return bool(_lc.llama_memory_seq_rm(self._mem_h(), seq_id, n_keep, -1))

    def seq_copy(self, src: int, dst: int) -> None:
        """Make ``dst`` (which must be empty) hold what ``src`` holds: every cell, shared
        within one KV stream, copied across streams.

        Across streams (``kv_unified=False``, this module's default) llama.cpp copies the
        whole stream's buffers, and only at the start of the next :meth:`decode`: until
        then ``dst``'s cells are listed but hold ``src``'s old data, and a state taken of
        ``dst`` is wrong (measured). So the copy is made right before a decode that
        computes a token of ``dst`` (the runtime's copies of a prompt decode its last
        token), and until that decode the state API refuses both sequences.
        """
        self._check_seq(src)
        self._check_seq(dst)
        if src == dst or self.seq_pos_max(dst) >= 0:
            raise ValueError(f"seq_copy needs another, empty sequence: {src} -> {dst}")
        _lc.llama_memory_seq_cp(self._mem_h(), src, dst, -1, -1)
        if self._n_stream > 1:
            self._copies_pending.update((src, dst))

    def copy_pending(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is part of a copy llama.cpp makes at the next decode (its
        state can be neither read nor set until then)."""
        return seq_id in self._copies_pending

    def _check_no_pending_copy(self, seq_id: int) -> None:
        if seq_id in self._copies_pending:
            raise LlamaError(f"sequence {seq_id} is part of a copy llama.cpp makes at the "
                             "next decode; its state cannot be read or set before")

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position held for ``seq_id``, -1 when empty (> 0 after SWA pruning)."""
        self._check_seq(seq_id)
        return int(_lc.llama_memory_seq_pos_min(self._mem_h(), seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position held for ``seq_id``, -1 when empty."""
        self._check_seq(seq_id)
        return int(_lc.llama_memory_seq_pos_max(self._mem_h(), seq_id))

    def _mem_h(self) -> Any:
        self._h()
        return self._mem

    # -- state
    @property
    def state_streams(self) -> int:
        """The stream count of a state this context restores as it is: a single-stream
        plain-attention state is widened to it (one copy) by :meth:`state_seq_set`, so a
        caller building a state can write it so instead; other states are written and
        read with it as they are."""
        return self._n_stream

    def _canonical(self) -> bool:
        """Whether states are converted to/from the single-stream form (see state_seq_get)."""
        return self._plain_kv and self._n_stream > 1

    def state_seq_size(self, seq_id: int) -> int:
        """Size in bytes of what :meth:`state_seq_get` returns for ``seq_id`` now."""
        self._check_seq(seq_id)
        n = int(_lc.llama_state_seq_get_size(self._h(), seq_id))
        if n == 0:
            raise LlamaError("llama_state_seq_get_size failed")
        return n - 4 * (self._n_stream - 1) if self._canonical() else n

    def state_seq_get(self, seq_id: int, out: np.ndarray | None = None) -> memoryview:
        """The KV state of ``seq_id`` (read-only bytes-like), restorable with
        :meth:`state_seq_set`. With ``out`` (a uint8 buffer; see state_buffers.py for
        why) the state is written there and the result is a view of it, valid while
        ``out`` is not reused; a buffer too small for what llama.cpp writes (a split
        cache writes a few bytes more than :meth:`state_seq_size`) is not used.

        llama.cpp writes one cell count per KV stream; with a split (non-unified) cache
        every stream but the sequence's own holds a zero count.  For plain attention
        models those zero words are dropped and the header says ``n_stream = 1``: the
        result is byte-for-byte what a unified / single-sequence context would produce,
        and restores into any context of the same KV layout.  llama.cpp writes into one
        uninitialized buffer, the only copy.
        """
        self._check_seq(seq_id)
        self._check_no_pending_copy(seq_id)
        ctx = self._h()
        size = int(_lc.llama_state_seq_get_size(ctx, seq_id))
        if size == 0:
            raise LlamaError("llama_state_seq_get_size failed")
        if out is not None and out.dtype != np.uint8:
            raise ValueError(f"state_seq_get writes into a uint8 buffer, not {out.dtype}")
        fits = out is not None and out.ndim == 1 and len(out) >= size
        buf = out[:size] if fits else np.empty(size, dtype=np.uint8)
        got = int(
            _lc.llama_state_seq_get_data(
                ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq_id
            )
        )
        if got != size:
            raise LlamaError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
        if not self._canonical():
            return memoryview(buf).toreadonly()
        try:
            return kv_cells.to_single_stream(memoryview(buf), self._n_stream).toreadonly()
        except kv_cells.StateFormatError as exc:
            raise LlamaError(str(exc)) from None

    def _scratch(self, size: int) -> np.ndarray:
        """A reused buffer for widening states: a fresh one per restore costs more than
        the copy itself (new pages fault in, and on a VM may come back from the host)."""
        if len(self._scratch_buf) < size:
            self._scratch_buf = np.empty(size + size // 8, dtype=np.uint8)
        return self._scratch_buf[:size]

    def state_seq_set(self, seq_id: int, data: bytes | bytearray | memoryview) -> int:
        """Replace ``seq_id`` with a state from :meth:`state_seq_get`.

        Returns the number of bytes llama.cpp consumed, or 0 when it rejected the state
        (llama.cpp logs and returns 0 rather than raising).  The sequence is cleared
        first and stays empty on rejection.  (llama.cpp itself leaves the old cells in
        place for an empty state or a bad header, and clears them otherwise.)  The
        sequence has no logits afterwards: drop its last cell and re-decode that token.

        ``data`` is handed to llama.cpp without copying (it only reads it), except that
        a canonical single-stream state is widened to this context's stream count first
        (one copy) when the cache is split into several streams.
        """
        self._check_seq(seq_id)
        self._check_no_pending_copy(seq_id)
        ctx = self._h()
        _lc.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        src = np.frombuffer(data, dtype=np.uint8)
        if len(src) < kv_cells.HEADER.size:
            return 0
        extra = 0
        if self._canonical() and kv_cells.is_single_stream(src):
            extra = 4 * (self._n_stream - 1)
            src = kv_cells.widen_streams(src, self._n_stream, self._scratch(len(src) + extra))
        n = int(
            _lc.llama_state_seq_set_data(
                ctx, src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(src), seq_id
            )
        )
        if n == 0:
            _lc.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            return 0
        return n - extra

    # -- compatibility
    def kv_layout(self) -> dict[str, str]:
        """Every setting that decides whether a saved state is valid in this context.

        Part of the cache namespace.  Included: the KV element types; flash attention
        (it transposes V); the layer and KV-head geometry (row sizes); RoPE settings
        (K is cached *after* RoPE, and llama.cpp does not check them); SWA and
        recurrence; the llama.cpp build.  Not included: ``n_ctx`` (only bounds how many
        cells fit; an oversized state is rejected), ``n_batch``/threads, and — for
        plain attention models, whose states are canonicalized — ``n_seq_max`` and
        ``kv_unified``.  The model's identity (its weights) is not here: llama.cpp
        accepts a state from any model of the same shape, so the caller must add a
        fingerprint of the file.
        """
        m = self.model
        arch = m.meta("general.architecture") or ""
        n_embd_head_k = m.meta(f"{arch}.attention.key_length")
        n_embd_head_v = m.meta(f"{arch}.attention.value_length")
        head = m.n_embd // m.n_head if m.n_head else 0
        layout = {
            "arch": arch,
            "type_k": self.params.type_k,
            "type_v": self.params.type_v,
            "flash_attn": str(self.params.flash_attn).lower(),
            "n_layer": str(m.n_layer),
            "n_head_kv": str(m.n_head_kv),
            "n_embd_head_k": n_embd_head_k or str(head),
            "n_embd_head_v": n_embd_head_v or str(head),
            "rope_type": str(m.rope_type),
            "rope_freq_base": m.meta(f"{arch}.rope.freq_base") or "",
            "rope_freq_scale_train": repr(m.rope_freq_scale_train),
            "rope_dimension_count": m.meta(f"{arch}.rope.dimension_count") or "",
            "rope_scaling_type": m.meta(f"{arch}.rope.scaling.type") or "",
            "n_swa": str(m.n_swa),
            "is_recurrent": str(m.is_recurrent).lower(),
            # States with a tail are stored as pieces since this key: none of them builds
            # on a whole state stored before it (a whole state cannot start a chain).
            **({"state_tail": "window" if self.state_window else "1"}
               if self.state_has_tail else {}),
            "state_streams": "1"
            if (self._plain_kv or self._n_stream == 1)
            else f"split:{self._n_stream}",
            "llama_cpp_python": _lc.__version__,
        }
        return layout

    def computes_batches_alike(self, seq_id: int = 0) -> bool:
        """Whether a token's results are the same bit for bit whether it is decoded
        alone or at any place of a batch: compared on a few tokens of ``seq_id`` (which
        must be empty, and is left empty), split in three ways. When they are, a state
        restored or reused and continued gives what a cold prefill of the same tokens
        gives; llama.cpp's build decides (see :data:`BATCH_VARIANT_OPTIONS`)."""
        self._check_seq(seq_id)
        n_vocab = self.model.n_vocab
        tokens = [(7 * i + 3) % n_vocab for i in range(9)]
        rows = []
        for split in ((9,), (8, 1), (5, 4), (2, 3, 4)):
            self.seq_clear(seq_id)
            start = 0
            for n in split:
                end = start + n
                self.decode(tokens[start:end], list(range(start, end)), [seq_id] * n,
                            [i == len(tokens) - 1 for i in range(start, end)])
                start = end
            rows.append(self.logits(split[-1] - 1))
        self.seq_clear(seq_id)
        return all(np.array_equal(rows[0], row) for row in rows[1:])

    def can_truncate_restored(self) -> bool:
        """Whether a restored sequence may be shortened with :meth:`seq_truncate`.

        False for sliding-window models (a restored state holds only the last window;
        ``seq_rm`` then silently empties it) and for recurrent/hybrid models (their
        state is a summary of the whole prefix and cannot be cut).
        """
        return self._plain_kv


# --------------------------------------------------------------------------- sampling

#: llama.cpp's ``llama_token_data``: a candidate's id, score (logit) and probability.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA.itemsize == ctypes.sizeof(_lc.llama_token_data)


@functools.lru_cache(maxsize=4)
def _candidates_template(n_vocab: int) -> np.ndarray:
    """Every token as a candidate, in id order, score and probability 0 (read-only)."""
    template = np.zeros(n_vocab, dtype=TOKEN_DATA)
    template["id"] = np.arange(n_vocab, dtype=np.int32)
    template.flags.writeable = False
    return template


class GrammarDeadEnd(LlamaError):
    """The grammar allows no token here (none of the vocabulary continues it)."""


# The port's rule for a character of a JSON string lets control characters through (raw
# newlines, \x16: invalid JSON, seen in its output); llama.cpp's own converter excludes
# them, as JSON does. Excluded too: what llama.cpp's UTF-8 decoder takes for a character
# but is none (surrogates; "code points" beyond U+10FFFF, which it makes of any byte from
# 0xF5 on: invalid UTF-8, seen in its output as one character of a maxLength that Python
# decodes to four U+FFFD).
_PORT_JSON_CHAR = r'char ::= [^"\\] | '
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F\uD800-\uDFFF\U00110000-\UFFFFFFFF] | '


def json_schema_to_gbnf(schema_json: str, name: str = "root") -> str:
    """llama.cpp's JSON-Schema-to-GBNF converter (as llama-cpp-python ports it, with
    JSON strings' characters limited to those JSON and UTF-8 allow unescaped): the
    grammar of one JSON value valid for the schema, its rule named ``name``. Raises what
    the converter raises on a schema it cannot convert."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                raw_pattern=False)
    schema = converter.resolve_refs(json.loads(schema_json), "input")
    converter.visit(schema, "" if name == "root" else name)
    return "\n".join(_JSON_CHAR + line[len(_PORT_JSON_CHAR):]
                     if line.startswith(_PORT_JSON_CHAR) else line
                     for line in converter.format_grammar().split("\n"))


def grammar_refusal(model: LlamaModel, grammar: str) -> str | None:
    """Why llama.cpp refuses to make a sampler of ``grammar`` (its log lines), or None
    when it accepts it. The grammar is compiled and freed at once."""
    with _capturing() as lines:
        sampler = _lc.llama_sampler_init_grammar(model._vocab_h(), grammar.encode(), b"root")
    if sampler:
        _lc.llama_sampler_free(sampler)
        return None
    reasons = " ".join(line.strip() for line in lines if line.strip())
    return reasons or "it could not parse it"


class SamplerChain(_Owner):
    """One request's sampler: llama.cpp's sampler chain, and a grammar kept beside it.
    Owns both (``llama_sampler*``); :meth:`close` frees them. Not thread-safe: one thread
    samples, accepts and closes.

    The chain, in order: logit bias; the repeat penalty, over a window that starts with
    the last ``penalty_last_n`` tokens of ``history`` (the prompt); presence and frequency
    penalties over the tokens accepted since (generated only); then either the most
    likely token (``greedy``), or top-k, top-p, min-p, temperature and a draw from
    llama.cpp's generator seeded with ``seed`` (a uint32). Settings that do nothing are
    left out of the chain.

    :meth:`sample` works on a row of raw scores the caller holds (the runtime keeps them
    per sequence, and an exact cache hit has them from the store): every token becomes a
    candidate (built with numpy: a copy of an id template and one strided write of the
    scores), the chain picks one. With a grammar, as llama.cpp's own
    ``common_sampler_sample`` does: the grammar checks the chosen token alone (a few µs);
    only when it refuses it are all candidates masked by the grammar (milliseconds over a
    large vocabulary) and the chain applied again. :meth:`accept` then records the token
    in the chain (penalties) and the grammar.

    llama.cpp aborts the process when its grammar is fed a token it does not allow
    (``llama_sampler_accept`` throws through C), so nothing reaches the grammar that it
    has not allowed first: :meth:`accept` checks again, and raises instead.
    """

    live = 0  #: chains made and not yet closed, in this process (tests check for leaks)

    def __init__(self, model: LlamaModel, *, greedy: bool, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                 repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, penalty_last_n: int = 64,
                 logit_bias: Sequence[tuple[int, float]] = (), grammar: str = "",
                 grammar_active: bool = True, history: Sequence[int] = ()) -> None:
        self.model = model
        self.n_vocab = model.n_vocab
        self._chain: Any = None
        self._grammar: Any = None
        if not 0 <= seed < _lc.LLAMA_DEFAULT_SEED:
            raise ValueError(f"seed must be a uint32 below {_lc.LLAMA_DEFAULT_SEED:#x}")
        params = _lc.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain = _lc.llama_sampler_chain_init(params)
        SamplerChain.live += 1
        try:
            for sampler in self._samplers(greedy, temperature, top_k, top_p, min_p, seed,
                                          repeat_penalty, presence_penalty,
                                          frequency_penalty, max(0, penalty_last_n),
                                          logit_bias, history):
                _lc.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it
            if grammar:
                with _capturing() as lines:
                    self._grammar = _lc.llama_sampler_init_grammar(
                        model._vocab_h(), grammar.encode(), b"root")
                if not self._grammar:
                    raise LlamaError("llama.cpp refused the grammar: " +
                                     (" ".join(x.strip() for x in lines) or "no reason given"))
        except BaseException:
            self.close()
            raise
        #: Whether the grammar constrains the output (a lazy one starts inactive).
        self.grammar_active = bool(self._grammar) and grammar_active
        # A chain of llama.cpp's greedy sampler alone picks the first highest score, as
        # numpy's argmax does: the row is then not copied into candidates (~0.5 ms a token
        # over a 49k vocabulary, against ~0.03 ms for the argmax).
        self._argmax_only = greedy and not logit_bias and not (
            penalty_last_n and (repeat_penalty != 1.0 or presence_penalty or
                                frequency_penalty))
        self._candidates = np.empty(self.n_vocab, dtype=TOKEN_DATA)
        self._logit_column = self._candidates.view(np.float32).reshape(self.n_vocab, 3)[:, 1]
        self._array = _lc.llama_token_data_array(
            self._candidates.ctypes.data_as(_lc.llama_token_data_p), self.n_vocab, -1, False)
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        self._one_array = _lc.llama_token_data_array(
            self._one.ctypes.data_as(_lc.llama_token_data_p), 1, -1, False)

    def _samplers(self, greedy: bool, temperature: float, top_k: int, top_p: float,
                  min_p: float, seed: int, repeat_penalty: float, presence_penalty: float,
                  frequency_penalty: float, last_n: int, logit_bias: Sequence[tuple[int, float]],
                  history: Sequence[int]) -> Iterator[Any]:
        if logit_bias:
            biases = (_lc.llama_logit_bias * len(logit_bias))(
                *(_lc.llama_logit_bias(token, bias) for token, bias in logit_bias))
            yield _lc.llama_sampler_init_logit_bias(self.n_vocab, len(logit_bias), biases)
        if last_n and repeat_penalty != 1.0:
            repeat = _lc.llama_sampler_init_penalties(self.n_vocab, last_n, repeat_penalty,
                                                      0.0, 0.0)
            for token in history[-last_n:]:  # (before it joins the chain: prompt only)
                _lc.llama_sampler_accept(repeat, token)
            yield repeat
        if last_n and (presence_penalty or frequency_penalty):
            yield _lc.llama_sampler_init_penalties(self.n_vocab, last_n, 1.0,
                                                   frequency_penalty, presence_penalty)
        if greedy:  # (top-k, top-p, min-p and temperature never drop the best token)
            yield _lc.llama_sampler_init_greedy()
            return
        if top_k:
            yield _lc.llama_sampler_init_top_k(top_k)
        if top_p < 1.0:
            yield _lc.llama_sampler_init_top_p(top_p, 1)
        if min_p > 0.0:
            yield _lc.llama_sampler_init_min_p(min_p, 1)
        yield _lc.llama_sampler_init_temp(temperature)
        yield _lc.llama_sampler_init_dist(seed)

    @property
    def has_grammar(self) -> bool:
        return bool(self._grammar)

    def close(self) -> None:
        if self._grammar:
            _lc.llama_sampler_free(self._grammar)
        self._grammar = None
        if self._chain:
            _lc.llama_sampler_free(self._chain)
            SamplerChain.live -= 1
        self._chain = None

    def _h(self) -> Any:
        if not self._chain:
            raise LlamaError("sampler chain is closed")
        return self._chain

    # -- sampling

    def _fill(self, logits: np.ndarray, banned: Sequence[int]) -> None:
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"a row of {self.n_vocab} scores is needed, got {logits.shape}")
        np.copyto(self._candidates, _candidates_template(self.n_vocab))
        self._logit_column[...] = logits
        if banned:
            self._logit_column[np.asarray(banned, dtype=np.int64)] = -np.inf
        array = self._array
        array.data = self._candidates.ctypes.data_as(_lc.llama_token_data_p)
        array.size, array.selected, array.sorted = self.n_vocab, -1, False

    def _apply(self, sampler: Any) -> None:
        _lc.llama_sampler_apply(sampler, ctypes.byref(self._array))

    def _selected(self, why: str) -> int:
        array = self._array
        if not 0 <= array.selected < array.size:
            raise LlamaError("the sampler chain selected no token")
        chosen = array.data[array.selected]
        if not math.isfinite(chosen.logit):  # every candidate was at -inf
            raise GrammarDeadEnd(why)
        return int(chosen.id)

    def sample(self, logits: np.ndarray, banned: Sequence[int] = ()) -> int:
        """The chain's token for ``logits`` (raw scores, one per vocabulary entry), never
        one of ``banned``; with an active grammar, one the grammar allows. Nothing is
        recorded: :meth:`accept` the token taken. Raises :class:`GrammarDeadEnd` when no
        token is allowed at all (a -inf score for every one)."""
        chain = self._h()
        if self._argmax_only:
            token = self._argmax(logits, banned)
        else:
            self._fill(logits, banned)
            self._apply(chain)
            token = self._selected("no token is allowed here (the logit bias and the "
                                   "banned tokens leave none)")
        if not self.grammar_active or self.allows(token):
            return token
        self._fill(logits, banned)
        self._apply(self._grammar)
        self._apply(chain)
        return self._selected("the grammar allows no token here")

    def _argmax(self, logits: np.ndarray, banned: Sequence[int]) -> int:
        """What the greedy sampler alone would pick: the first highest score."""
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"a row of {self.n_vocab} scores is needed, got {logits.shape}")
        if banned:
            logits = logits.copy()
            logits[np.asarray(banned, dtype=np.int64)] = -np.inf
        token = int(np.argmax(logits))
        if not math.isfinite(float(logits[token])):
            raise GrammarDeadEnd("no token is allowed here (the banned tokens leave none)")
        return token

    def allows(self, token: int) -> bool:
        """Whether the grammar (active or not) allows ``token`` next; True without one."""
        if not self._grammar:
            return True
        self._one[0] = (token, 1.0, 0.0)
        one = self._one_array
        one.data = self._one.ctypes.data_as(_lc.llama_token_data_p)
        one.size, one.selected, one.sorted = 1, -1, False
        _lc.llama_sampler_apply(self._grammar, ctypes.byref(one))
        return bool(np.isfinite(self._one["logit"][0]))

    def accept(self, token: int, *, feed_grammar: bool = True) -> None:
        """Record the token taken: in the chain, and in the active grammar (which must
        allow it: checked, as llama.cpp would abort the process otherwise), unless not
        ``feed_grammar`` (:meth:`start_grammar` fed it). An end-of-generation token
        ends the output and is not fed to the grammar."""
        if feed_grammar and self.grammar_active and not self.model.is_eog(token):
            if not self.allows(token):
                raise LlamaError(f"the grammar does not allow token {token} here")
            _lc.llama_sampler_accept(self._grammar, token)
        _lc.llama_sampler_accept(self._h(), token)

    def start_grammar(self, tokens: Sequence[int]) -> bool:
        """Activate the grammar from its start with ``tokens`` as its first output (a lazy
        grammar's trigger and what followed it). False, the grammar left inactive and
        at its start, when they do not follow it."""
        if not self._grammar:
            return False
        _lc.llama_sampler_reset(self._grammar)
        for token in tokens:
            if self.model.is_eog(token) or not self.allows(token):
                _lc.llama_sampler_reset(self._grammar)
                return False
            _lc.llama_sampler_accept(self._grammar, token)
        self.grammar_active = True
        return True
