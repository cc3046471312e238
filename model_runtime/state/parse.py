"""llama.cpp per-sequence KV states as runs of cells that can be cut and joined.

Pure functions over bytes (numpy, no llama.cpp calls).  With kv_layout (the headers'
structs and the :class:`Layout` describing a state besides its cells) and kv_build (the
bytes of runs joined, and the stream count of a header changed), the one place that
knows the byte layout of ``llama_state_seq_get_data``: this module reads and cuts
states; the rest of the project sees
opaque *runs of cells*: a run of ``n`` cells is ``n * layout.cell_width``
bytes, and two runs of the same layout join by plain byte concatenation.

The format (llama.cpp as vendored by llama-cpp-python 0.3.36, ``llama-context.cpp``
``state_seq_get_data`` and ``llama-kv-cache.cpp`` ``state_write``), little-endian::

    magic u32 = 0xAF143CD8, source seq_id i32, n_stream u32
    per stream: cell_count u32; when non-zero:
        per cell: pos i32, n_seq_id u32 (= 1), seq_id i32
        v_trans u32, n_layer u32
        per layer: k_type i32, k_size_row u64, cell_count K rows
        v_trans = 0, per layer: v_type i32, v_size_row u64, cell_count V rows
        v_trans = 1, per layer: v_type i32, v_size_el u32, n_embd_v_gqa u32, then per
                     channel that channel's element for every cell

``v_trans`` is 1 when flash attention is off.  Cells appear in KV-buffer order, which is
usually, but not always, position order.

Three forms of a run of ``n`` cells (:func:`run_size`), all consumed by
:func:`~model_runtime.state.build.build_state` (runs of any forms join in one state):

- planes (:func:`planes_bytes`, what pieces are stored in): llama.cpp's own data section
  restricted to the run, without headers: every layer's ``n`` K rows, then every layer's
  V as ``n`` rows or, transposed, ``n_embd_v_gqa`` channels of ``n`` elements.  Cutting
  and joining are plain copies of contiguous rows (no transpose), the cheapest for a
  restore.
- cells (:func:`cells_bytes`): each cell is its K row of every layer, then its V values
  of every layer, a transposed V untransposed (the cell's ``n_embd_v_gqa`` elements side
  by side), so every cell is one contiguous record.  Pieces written by kvcache 0.1's
  first piece format are in this form and stay readable.
- state: llama.cpp's own bytes of a state holding exactly positions ``0..n-1`` in order
  (what a root piece is stored as: saving it copies nothing, and restoring all of it
  hands llama.cpp the stored bytes as they are).  ``layout.state_size(n)`` bytes.

A state with a *tail* (``parse(state, tail=True)``): hybrid models (attention +
recurrent layers) write their attention cache and then the recurrent layers' state;
sliding-window models with full-attention layers write the full-attention cache and then
the window's (llama.cpp's ``llama_memory_hybrid`` / ``llama_kv_cache_iswa``
``state_write``). The first part is cells like any plain state's; the tail holds the state
at the sequence's last position only, so it cannot be cut: it is kept as opaque bytes and
written back after the cells (``build_state(..., tail=...)``). Its layout says so
(``Layout.tail``), so runs with a tail never join runs without.

Refused (:class:`StateFormatError`), because cutting them would be wrong or the bytes
cannot be rebuilt exactly: a second cache after the first unless a tail is asked for,
recurrent models, cells with more than one sequence id, cells
in more than one stream, per-cell extension data (M-RoPE / PLE models: the sizes no
longer add up), truncated states and trailing bytes.  A model whose sliding window
covers every layer writes one plain cache holding only the window's cells: it parses,
and its ``positions`` do not start at 0; callers cut only states with
:attr:`CellState.is_prefix`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .layout import (
    DATA_HEADER,
    FORM_CELLS,
    FORM_PLANES,
    FORM_STATE,
    MAX_STREAMS,
    META_WORDS,
    ROW_HEADER,
    STATE_MAGIC,
    TRANS_HEADER,
    U32,
    BytesLike,
    LayerLayout,
    Layout,
    StateFormatError,
    form_of,
    run_size,
)

__all__ = [
    "FORM_CELLS",
    "FORM_PLANES",
    "FORM_STATE",
    "STATE_MAGIC",
    "CellState",
    "LayerLayout",
    "Layout",
    "StateFormatError",
    "as_items",
    "cells_bytes",
    "form_of",
    "layout_of",
    "parse",
    "parse_state_run",
    "planes_bytes",
    "run_size",
    "window_of",
]

_CACHE_LINE = 64
# A state's header before its (first) cache, which begins with its stream count.
_MAGIC_AND_SEQ = struct.Struct("<Ii")  # magic, source seq_id
_NO_TAIL = np.zeros(0, dtype=np.uint8)
_NO_TAIL.flags.writeable = False


# --------------------------------------------------------------------------- parse


@dataclass(frozen=True, eq=False)
class CellState:
    """A parsed state: read-only numpy views into the caller's buffer, no payload copy.

    ``positions`` are in state (KV-buffer) order.  ``k_planes[l]`` is layer ``l``'s K
    as ``(n_cells, k_row)`` bytes.  ``v_planes[l]`` is ``(n_cells, v_row)`` bytes, or,
    with ``layout.v_trans``, ``(n_embd_v_gqa, n_cells)`` elements of ``v_size`` bytes.
    ``tail``: the bytes after the cells of a state parsed with ``tail=True``.
    """

    layout: Layout
    seq_id: int
    positions: np.ndarray
    k_planes: tuple[np.ndarray, ...]
    v_planes: tuple[np.ndarray, ...]
    tail: np.ndarray = field(default_factory=lambda: _NO_TAIL)

    @property
    def n_cells(self) -> int:
        return len(self.positions)

    @property
    def n_layer(self) -> int:
        return self.layout.n_layer

    @property
    def in_position_order(self) -> bool:
        """Whether the cells are stored by strictly increasing position."""
        return bool(np.all(self.positions[1:] > self.positions[:-1]))

    @property
    def is_prefix(self) -> bool:
        """Whether the cells hold positions 0..n-1 in order: cell ``i`` is token ``i``."""
        return bool(np.array_equal(self.positions, np.arange(self.n_cells)))


class _Reader:
    """Bounds-checked little-endian reads from a uint8 array."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.off = 0

    def remaining(self) -> int:
        return len(self.buf) - self.off

    def unpack(self, st: struct.Struct, what: str) -> tuple[int, ...]:
        self._need(st.size, what)
        values = st.unpack_from(self.buf.data, self.off)
        self.off += st.size
        return values

    def take(self, n_bytes: int, what: str) -> np.ndarray:
        self._need(n_bytes, what)
        out = self.buf[self.off : self.off + n_bytes]
        self.off += n_bytes
        return out

    def _need(self, n_bytes: int, what: str) -> None:
        if n_bytes > self.remaining():
            raise StateFormatError(
                f"state truncated: {what} needs {n_bytes} bytes at offset {self.off}, "
                f"{self.remaining()} left"
            )


def parse(state: BytesLike | np.ndarray, *, tail: bool = False) -> CellState:
    """Validate ``state`` (bytes from ``llama_state_seq_get_data``) and view its cells.

    Raises :class:`StateFormatError` for anything but a single-sequence state of one
    plain attention KV cache with at least one cell; with ``tail``, any bytes may follow
    that cache (a hybrid or sliding-window model's tail, kept as ``CellState.tail``) and
    the layout says the state has a tail.
    """
    buf = np.frombuffer(state, dtype=np.uint8)
    r = _Reader(buf)
    magic, seq_id = r.unpack(_MAGIC_AND_SEQ, "header")
    if magic != STATE_MAGIC:
        raise StateFormatError(f"not a sequence state: magic {magic:#010x}")
    cells = _parse_cache(r, seq_id, tail)
    if r.remaining() and not tail:
        raise StateFormatError(_trailing_message(buf, r.off, cells.layout.n_stream))
    return cells


def _parse_cache(r: _Reader, seq_id: int, tail: bool) -> CellState:
    """One KV cache's part of a state, from its stream count on (what llama.cpp's
    ``llama_kv_cache::state_write`` writes); with ``tail``, what follows it is the tail."""
    (n_stream,) = r.unpack(U32, "stream count")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise StateFormatError(f"implausible stream count {n_stream}")
    found: tuple[int, _Stream] | None = None
    for s in range(n_stream):
        (n_cells,) = r.unpack(U32, f"cell count of stream {s}")
        if n_cells == 0:
            continue
        if found is not None:
            raise StateFormatError(f"cells in more than one stream ({found[0]} and {s})")
        found = s, _parse_stream(r, n_cells, seq_id)
    if found is None:
        raise StateFormatError("state holds no cells")
    stream, st = found
    layout = Layout(v_trans=st.v_trans, layers=st.layers, n_stream=n_stream, stream=stream,
                    tail=tail)
    rest = _readonly(r.buf[r.off:]) if tail else _NO_TAIL
    return CellState(layout, seq_id, st.positions, st.k_planes, st.v_planes, rest)


def _trailing_message(buf: np.ndarray, off: int, n_stream: int) -> str:
    n = len(buf) - off
    if n >= 4 and U32.unpack_from(buf.data, off)[0] == n_stream:
        return (
            f"{n} bytes follow the KV cache, starting like a second cache "
            "(sliding-window or hybrid model): such states cannot be cut"
        )
    return f"{n} trailing bytes after the KV cache"


class _Stream(NamedTuple):
    positions: np.ndarray
    k_planes: tuple[np.ndarray, ...]
    v_planes: tuple[np.ndarray, ...]
    v_trans: bool
    layers: tuple[LayerLayout, ...]


def _parse_stream(r: _Reader, n_cells: int, seq_id: int) -> _Stream:
    meta_bytes = r.take(4 * META_WORDS * n_cells, f"metadata of {n_cells} cells")
    meta = _readonly(meta_bytes.view("<i4").reshape(n_cells, META_WORDS))
    _check_seq_ids(meta, seq_id)
    v_trans, n_layer = r.unpack(DATA_HEADER, "v_trans and layer count")
    if v_trans > 1:
        raise StateFormatError(f"v_trans is {v_trans}, expected 0 or 1")
    if n_layer == 0 or n_layer * ROW_HEADER.size > r.remaining():
        raise StateFormatError(f"implausible layer count {n_layer}")
    k_heads, k_planes = [], []
    for il in range(n_layer):
        k_type, k_row = r.unpack(ROW_HEADER, f"K header of layer {il}")
        _check_size(k_row, f"K row size of layer {il}")
        k_planes.append(_rows(r, n_cells, k_row, f"K of layer {il}"))
        k_heads.append((k_type, k_row))
    v_heads, v_planes = [], []
    for il in range(n_layer):
        if v_trans:
            v_type, v_el, n_embd = r.unpack(TRANS_HEADER, f"V header of layer {il}")
            _check_size(v_el, f"V element size of layer {il}")
            _check_size(n_embd, f"V width of layer {il}")
            data = r.take(n_embd * n_cells * v_el, f"V of layer {il}")
            v_planes.append(_readonly(as_items(data, v_el).reshape(n_embd, n_cells)))
            v_heads.append((v_type, v_el, n_embd))
        else:
            v_type, v_row = r.unpack(ROW_HEADER, f"V header of layer {il}")
            _check_size(v_row, f"V row size of layer {il}")
            v_planes.append(_rows(r, n_cells, v_row, f"V of layer {il}"))
            v_heads.append((v_type, v_row, 0))
    layers = tuple(LayerLayout(*k, *v) for k, v in zip(k_heads, v_heads, strict=True))
    return _Stream(meta[:, 0], tuple(k_planes), tuple(v_planes), bool(v_trans), layers)


def _check_seq_ids(meta: np.ndarray, seq_id: int) -> None:
    # A restore takes exactly one seq id per cell; a rebuilt state writes the header's id
    # into every cell, so any other id could not be reproduced byte for byte.
    bad = np.flatnonzero(meta[:, 1] != 1)
    if len(bad):
        i = int(bad[0])
        raise StateFormatError(f"cell {i} has {int(meta[i, 1])} sequence ids, expected 1")
    bad = np.flatnonzero(meta[:, 2] != seq_id)
    if len(bad):
        i = int(bad[0])
        raise StateFormatError(f"cell {i} belongs to sequence {int(meta[i, 2])}, not {seq_id}")


def _check_size(value: int, what: str) -> None:
    if value == 0:
        raise StateFormatError(f"{what} is 0")


def _rows(r: _Reader, n_cells: int, row: int, what: str) -> np.ndarray:
    return _readonly(r.take(n_cells * row, what).reshape(n_cells, row))


def as_items(data: np.ndarray, size: int) -> np.ndarray:
    """``data`` viewed as items of ``size`` bytes (an unsigned int when one fits)."""
    dtype = np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype((np.void, size))
    return data.view(dtype)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def window_of(cells: CellState, window: int) -> CellState:
    """The tail of a state parsed with ``tail=True`` read as a sliding window's cache (a
    second cache like the first: llama.cpp's ``llama_kv_cache_iswa`` writes its
    full-attention cache, then its window's): the cells of the last ``window``
    positions, in the cache's order. :class:`StateFormatError` when the tail is not such a
    cache or holds other positions (a window of another kind)."""
    r = _Reader(cells.tail)
    found = _parse_cache(r, cells.seq_id, tail=False)
    if r.remaining():
        raise StateFormatError(f"{r.remaining()} bytes follow the window's cache")
    n = cells.n_cells
    if found.layout.v_trans != cells.layout.v_trans or found.layout.n_stream != \
            cells.layout.n_stream or not np.array_equal(
                np.sort(found.positions), np.arange(max(0, n - window), n)):
        raise StateFormatError(f"the tail is not the cache of the last {window} positions")
    return found


def layout_of(state: BytesLike | np.ndarray | CellState) -> Layout:
    """The :class:`Layout` of a state (parsed first unless already a CellState)."""
    return (state if isinstance(state, CellState) else parse(state)).layout


# --------------------------------------------------------------------------- cut


def planes_bytes(state: BytesLike | np.ndarray | CellState, start: int, end: int) -> memoryview:
    """Cells ``[start, end)`` in position order, in the planar form (see the module
    docstring): ``(end - start) * layout.cell_width`` bytes, a read-only buffer.
    Runs of any cuts passed to :func:`~model_runtime.state.build.build_state` with ``forms=FORM_PLANES`` and the
    same positions give back the state byte for byte."""
    cs, cells = _cut_range(state, start, end)
    layout, n = cs.layout, end - start
    out = np.empty(n * layout.cell_width, dtype=np.uint8)
    off = 0
    for plane, x in zip(cs.k_planes, layout.layers, strict=True):
        out[off : off + n * x.k_row].reshape(n, x.k_row)[...] = plane[cells]
        off += n * x.k_row
    for plane, x in zip(cs.v_planes, layout.layers, strict=True):
        size = n * x.v_cell_bytes(layout.v_trans)
        if layout.v_trans:
            dst = as_items(out[off : off + size], x.v_size).reshape(x.n_embd_v_gqa, n)
            dst[...] = plane[:, cells]
        else:
            out[off : off + size].reshape(n, x.v_size)[...] = plane[cells]
        off += size
    return _frozen_view(out)


def _cut_range(
    state: BytesLike | np.ndarray | CellState, start: int, end: int
) -> tuple[CellState, slice | np.ndarray]:
    """The parsed state and the indices of its cells ``[start, end)`` by position."""
    cs = state if isinstance(state, CellState) else parse(state)
    if not 0 <= start <= end <= cs.n_cells:
        raise ValueError(f"cell range [{start}, {end}) outside [0, {cs.n_cells}]")
    if cs.in_position_order:
        return cs, slice(start, end)
    return cs, np.argsort(cs.positions, kind="stable")[start:end]


def cells_bytes(state: BytesLike | np.ndarray | CellState, start: int, end: int) -> memoryview:
    """Cells ``[start, end)`` in position order, cell-major: ``(end - start) *
    layout.cell_width`` bytes (a read-only buffer; ``bytes()`` it to own a copy).

    For the usual state (cells stored in position order) cell ``i`` is the state's
    ``i``-th cell, and the runs of any cuts passed to :func:`~model_runtime.state.build.build_state` with the same
    positions give back the state byte for byte.
    """
    cs, cells = _cut_range(state, start, end)
    layout = cs.layout
    # numpy buffers, not bytes: a fresh 50 MB bytes object costs ~5x the copy itself in
    # page faults, numpy's large allocations do not.
    out = np.empty((end - start, layout.cell_width), dtype=np.uint8)
    for (col, width), plane in zip(layout.k_columns(), cs.k_planes, strict=True):
        out[:, col : col + width] = plane[cells]
    v_columns = layout.v_columns()
    for (col, width), plane, x in zip(v_columns, cs.v_planes, layout.layers, strict=True):
        if layout.v_trans:
            _untranspose(as_items(out[:, col : col + width], x.v_size), plane[:, cells])
        else:
            out[:, col : col + width] = plane[cells]
    return _frozen_view(out)


def _untranspose(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[cell, channel] = src[channel, cell]``.

    Read straight from ``src``, the transpose thrashes the cache whenever its row stride
    is a multiple of 4 KiB (2048 f16 cells: 4x slower); a staging copy whose row stride
    is an odd number of cache lines avoids that for a cheap contiguous copy.
    """
    n_embd, n_cells = src.shape
    item = src.dtype.itemsize
    if n_cells == 0 or _CACHE_LINE % item:
        dst[...] = src.T
        return
    lines = -(-n_cells * item // _CACHE_LINE) | 1
    staging = np.empty((n_embd, lines * _CACHE_LINE // item), dtype=src.dtype)[:, :n_cells]
    staging[...] = src
    dst[...] = staging.T


def _frozen_view(a: np.ndarray) -> memoryview:
    return a.reshape(-1).data.toreadonly()


def parse_state_run(state: BytesLike, layout: Layout) -> CellState:
    """A run stored in the state form, parsed: its cells must be of ``layout`` (layers
    and V orientation; the stream count may differ) and hold positions 0..n-1, as
    llama.cpp would otherwise take them as they are. :class:`StateFormatError` if not.
    With a layout with a tail, the run's tail follows its cells (``CellState.tail``)."""
    cs = parse(state, tail=layout.tail)
    if (cs.layout.v_trans, cs.layout.layers) != (layout.v_trans, layout.layers):
        raise StateFormatError("a state-form run of another layout")
    if not cs.is_prefix:
        raise StateFormatError("a state-form run that does not hold positions 0..n-1")
    return cs
