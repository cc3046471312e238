"""A llama.cpp context (:class:`LlamaContext`): the KV cache of ``n_seq_max`` sequences,
decoding into it, editing and copying its sequences, and their states.

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

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as _lc
import numpy as np

from .. import kernels
from ..state.build import is_single_stream, to_single_stream, widen_streams
from ..state.layout import HEADER, StateFormatError
from ..state.parse import parse, window_of
from .binding import Owner
from .errors import LlamaDecodeError, LlamaError, LlamaLoadError
from .model import LlamaModel

__all__ = ["KV_CACHE_TYPES", "ContextParams", "LlamaContext"]

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


class LlamaContext(Owner):
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
        cut) followed by a part that cannot (a tail: see model_runtime.state): a hybrid model's recurrent
        state, or the window cache of a sliding-window model with full-attention layers
        (llama.cpp writes ``llama_memory_hybrid``'s and ``llama_kv_cache_iswa``'s states
        so). Seen in a state of two tokens of sequence 0, left empty: a pure recurrent
        model's state does not parse as cells, and one whose window covers every layer
        writes one cache and no tail. A tail that reads as the cache of the window's
        positions (llama.cpp's sliding window, ``n_swa``) is that window."""
        self.decode([1, 2], [0, 1], [0, 0], [False, True])
        try:
            cells = parse(self.state_seq_get(0), tail=True)
        except StateFormatError:
            return False, 0
        finally:
            self.seq_clear(0)
        if not (cells.is_prefix and cells.n_cells == 2 and len(cells.tail) > 0):
            return False, 0
        try:
            window_of(cells, self.model.n_swa)
        except StateFormatError:
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
        # llama_cpp's type hints declare these pointer fields (its _fields_: POINTERs) as
        # ctypes arrays, and pos as an array of arrays: they are assigned pointers.
        b.token = self._tok.ctypes.data_as(i32p)  # type: ignore[assignment]
        b.embd = ctypes.POINTER(ctypes.c_float)()  # type: ignore[assignment]
        b.pos = self._pos.ctypes.data_as(i32p)  # type: ignore[assignment]
        b.n_seq_id = self._nseq.ctypes.data_as(i32p)  # type: ignore[assignment]
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p))  # type: ignore[assignment]
        b.logits = self._out.ctypes.data_as(  # type: ignore[assignment]
            ctypes.POINTER(ctypes.c_int8))
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
        :meth:`state_seq_set`. With ``out`` (a uint8 buffer; see model_runtime.state.buffers for
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
        if out is not None and out.ndim == 1 and len(out) >= size:
            buf = out[:size]
        else:
            buf = np.empty(size, dtype=np.uint8)
        got = int(
            _lc.llama_state_seq_get_data(
                ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq_id
            )
        )
        if got != size:
            raise LlamaError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
        if not self._canonical():
            return buf.data.toreadonly()
        try:
            return to_single_stream(buf.data, self._n_stream).toreadonly()
        except StateFormatError as exc:
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
        if len(src) < HEADER.size:
            return 0
        extra = 0
        if self._canonical() and is_single_stream(src):
            extra = 4 * (self._n_stream - 1)
            src = widen_streams(src, self._n_stream, self._scratch(len(src) + extra))
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
            # (The deterministic set computes it otherwise than llama.cpp as shipped, and
            # than that set did before its patch: "vec" keeps those states apart.)
            "flash_attn": "vec" if self.params.flash_attn
            and kernels.active() == kernels.DETERMINISTIC
            else str(self.params.flash_attn).lower(),
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
            # States of one kernel set are continued by another with other rounding: a
            # deterministic runtime never restores a fast one's (model_runtime/kernels.py).
            "kernels": kernels.active(),
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
