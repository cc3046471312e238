"""A loaded GGUF model (:class:`LlamaModel`): its vocabulary (tokenize, detokenize, special
tokens), metadata and chat template source; and the check of a file's GGUF header made
before llama.cpp sees it."""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as _lc

from ..state.seams import SpecialToken, cut_points, is_seam
from .binding import LOG_ENV, Owner, ensure_backend
from .errors import LlamaError, ModelFileError, TokenizeCancelled
from .grammars import CompiledGrammars

__all__ = ["GGUF_MAGIC", "GGUF_VERSIONS", "LlamaModel", "check_gguf_file"]

#: Vocabulary types whose tokenizer handles each piece between special tokens alone
#: (llama_vocab::impl::tokenize): SPM (its space prefix follows a special token either
#: way), BPE, UGM, RWKV, PLaMo-2.
PIECEWISE_VOCAB_TYPES = frozenset({
    _lc.LLAMA_VOCAB_TYPE_SPM, _lc.LLAMA_VOCAB_TYPE_BPE, _lc.LLAMA_VOCAB_TYPE_UGM,
    _lc.LLAMA_VOCAB_TYPE_RWKV, _lc.LLAMA_VOCAB_TYPE_PLAMO2})

#: Characters tokenized at a time by :meth:`LlamaModel.tokenize_in_pieces` (~1 ms each).
TOKENIZE_PIECE_CHARS = 8192


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



class LlamaModel(Owner):
    """A loaded GGUF model: weights, vocabulary and metadata. Owns ``llama_model*``.

    Loaded on CPU with mmap; the weights are shared by every context made from it.
    """

    def __init__(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        ensure_backend(verbose)
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
        self.grammars = CompiledGrammars()  # compiled once, cloned per request
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
            self.grammars.close()
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
        whole. (tests/runtime/test_token_seams.py)"""
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
        :mod:`~model_runtime.state.seams`; tests/runtime/test_token_seams.py compares both ways)."""
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
