"""llama.cpp per-sequence KV states as runs of cells that can be cut and joined.

Pure functions over bytes (numpy, no llama.cpp calls).  With kv_layout (the headers'
structs and the :class:`Layout` describing a state besides its cells), the one place
that knows the byte layout of ``llama_state_seq_get_data``; the rest of the project sees
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
:func:`build_state` (runs of any forms join in one state):

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .kv_layout import (
    DATA_HEADER,
    FORM_CELLS,
    FORM_PLANES,
    FORM_STATE,
    HEADER,
    INT32_MAX,
    INT32_MIN,
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
    "Scratch",
    "StateFormatError",
    "build_state",
    "cells_bytes",
    "form_of",
    "is_single_stream",
    "layout_of",
    "parse",
    "parse_state_run",
    "planes_bytes",
    "run_size",
    "to_single_stream",
    "window_of",
    "widen_streams",
]

_CACHE_LINE = 64
_TRANSPOSE_BLOCK = 64  # cells per block when transposing V into llama.cpp's layout
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
    magic, seq_id, n_stream = r.unpack(HEADER, "header")
    if magic != STATE_MAGIC:
        raise StateFormatError(f"not a sequence state: magic {magic:#010x}")
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
    if r.remaining() and not tail:
        raise StateFormatError(_trailing_message(buf, r.off, n_stream))
    if found is None:
        raise StateFormatError("state holds no cells")
    stream, st = found
    layout = Layout(v_trans=st.v_trans, layers=st.layers, n_stream=n_stream, stream=stream,
                    tail=tail)
    rest = _readonly(buf[r.off:]) if tail else _NO_TAIL
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
            v_planes.append(_readonly(_elements(data, v_el).reshape(n_embd, n_cells)))
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


def _elements(data: np.ndarray, size: int) -> np.ndarray:
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
    section = np.empty(HEADER.size - U32.size + len(cells.tail), dtype=np.uint8)
    HEADER.pack_into(section.data, 0, STATE_MAGIC, cells.seq_id, 0)  # its n_stream follows
    section[HEADER.size - U32.size:] = cells.tail
    found = parse(section)
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
    Runs of any cuts passed to :func:`build_state` with ``forms=FORM_PLANES`` and the
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
            dst = _elements(out[off : off + size], x.v_size).reshape(x.n_embd_v_gqa, n)
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
    ``i``-th cell, and the runs of any cuts passed to :func:`build_state` with the same
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
            _untranspose(_elements(out[:, col : col + width], x.v_size), plane[:, cells])
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


# --------------------------------------------------------------------------- build


def build_state(
    layout: Layout,
    cells: BytesLike | Sequence[BytesLike],
    *,
    seq_id: int,
    positions: Sequence[int] | np.ndarray | None = None,
    first_pos: int = 0,
    forms: str | Sequence[str],
    takes: Sequence[int] | None = None,
    scratch: Scratch | None = None,
    tail: BytesLike | np.ndarray = b"",
    skips: Sequence[int] | None = None,
) -> memoryview:
    """llama.cpp's state bytes for ``cells`` (one run, or runs to join in order).

    ``forms`` names the form of every run (one string) or of each run in turn (always
    given: the cells and planes forms have the same size, so a wrong one would pass
    unnoticed);
    ``takes``, how many leading cells of each run to use (default: all of them).
    With ``scratch`` the bytes are built in its buffer (valid until its next use).
    Positions are ``first_pos, first_pos + 1, ...`` unless ``positions`` gives one per
    cell.  ``seq_id`` goes into the header and every cell, as llama.cpp writes it.  The
    result is a read-only buffer (``bytes()`` it to own a copy), ready for
    ``llama_state_seq_set_data``.  ``tail`` (a layout with a tail only) is written
    after the cells: the part of the state at the last cell that is not cells.
    ``skips``: how many leading cells of each planar run to pass over before its takes.
    """
    tail_bytes = np.frombuffer(tail, dtype=np.uint8)
    if len(tail_bytes) and not layout.tail:
        raise ValueError("a tail for a layout without one")
    runs = _runs(layout, cells, forms, takes, skips)
    n_cells = sum(run.n for run in runs)
    pos = _positions(positions, first_pos, n_cells)
    if not INT32_MIN <= seq_id <= INT32_MAX:
        raise ValueError(f"seq_id {seq_id} does not fit in int32")
    size = layout.state_size(n_cells) + len(tail_bytes)
    buf = scratch.take(size) if scratch is not None else np.empty(size, dtype=np.uint8)
    out = buf.data
    HEADER.pack_into(out, 0, STATE_MAGIC, seq_id, layout.n_stream)
    off = HEADER.size
    for s in range(layout.n_stream):
        count = n_cells if s == layout.stream else 0
        U32.pack_into(out, off, count)
        off += U32.size
        if count:
            off = _write_stream(out, buf, off, layout, runs, pos, seq_id)
    buf[off:] = tail_bytes
    assert off + len(tail_bytes) == len(buf)
    return out.toreadonly()


class Scratch:
    """A buffer reused by successive :func:`build_state` calls of one thread.

    A fresh 50 MB buffer costs more in page faults than the copy into it (on shared VMs,
    ~100 ms when the allocator hands back pages the process never touched); one buffer
    kept across restores is faulted in once. Not thread-safe: one owner at a time.
    """

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def take(self, size: int) -> np.ndarray:
        """A buffer of ``size`` bytes (its contents are whatever was there)."""
        if len(self._buf) < size:
            self._buf = np.empty(size, dtype=np.uint8)
        return self._buf[:size]


@dataclass(frozen=True)
class _Run:
    """Views of one run's planes: ``k[l]`` is ``(n, k_row)`` bytes; ``v[l]`` is ``(n,
    v_cell)`` bytes (a cell-major run, or rows), or, for a planar or state run of a
    transposed V, ``(n_embd_v_gqa, n)`` elements already in llama.cpp's orientation."""

    n: int
    k: list[np.ndarray]
    v: list[np.ndarray]
    v_in_channels: bool


def _runs(
    layout: Layout,
    cells: BytesLike | Sequence[BytesLike],
    forms: str | Sequence[str],
    takes: Sequence[int] | None,
    skips: Sequence[int] | None = None,
) -> list[_Run]:
    items = [cells] if isinstance(cells, (bytes, bytearray, memoryview)) else list(cells)
    run_forms = [forms] * len(items) if isinstance(forms, str) else list(forms)
    if len(run_forms) != len(items) or (takes is not None and len(takes) != len(items)):
        raise ValueError(f"{len(items)} runs need as many forms and takes")
    width = layout.cell_width
    runs = []
    for i, (item, form) in enumerate(zip(items, run_forms, strict=True)):
        if form not in layout.versions():
            raise ValueError(f"unknown run form {form!r}" + (" with a tail" if layout.tail else ""))
        if form == FORM_STATE:
            runs.append(_state_run(layout, item, None if takes is None else takes[i], i))
            continue
        flat = np.frombuffer(item, dtype=np.uint8)
        if len(flat) % width:
            raise ValueError(f"run {i} has {len(flat)} bytes, not a multiple of {width}")
        n = len(flat) // width
        skip = 0 if skips is None else skips[i]
        take = n - skip if takes is None else takes[i]
        if not 0 <= take <= n - skip or (skip and form != FORM_PLANES):
            raise ValueError(f"run {i} holds {n} cells, {take} asked for after {skip}")
        if form == FORM_CELLS:
            runs.append(_cell_major_run(layout, flat.reshape(n, width)[:take]))
        else:
            runs.append(_planar_run(layout, flat, n, take, skip))
    return runs


def _cell_major_run(layout: Layout, run: np.ndarray) -> _Run:
    k = [run[:, col : col + width] for col, width in layout.k_columns()]
    v = [run[:, col : col + width] for col, width in layout.v_columns()]
    return _Run(len(run), k, v, v_in_channels=False)


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


def _state_run(layout: Layout, state: BytesLike, take: int | None, i: int) -> _Run:
    """A run stored as llama.cpp's bytes: its planes, viewed where they lie."""
    cs = parse_state_run(state, layout)
    take = cs.n_cells if take is None else take
    if not 0 <= take <= cs.n_cells:
        raise ValueError(f"run {i} holds {cs.n_cells} cells, {take} asked for")
    k = [plane[:take] for plane in cs.k_planes]
    v = [plane[:, :take] if layout.v_trans else plane[:take] for plane in cs.v_planes]
    return _Run(take, k, v, v_in_channels=layout.v_trans)


def _planar_run(layout: Layout, flat: np.ndarray, n: int, take: int, skip: int = 0) -> _Run:
    k, v, off = [], [], 0
    cells = slice(skip, skip + take)
    for x in layout.layers:
        k.append(flat[off : off + n * x.k_row].reshape(n, x.k_row)[cells])
        off += n * x.k_row
    for x in layout.layers:
        size = n * x.v_cell_bytes(layout.v_trans)
        plane = flat[off : off + size]
        if layout.v_trans:
            v.append(_elements(plane, x.v_size).reshape(x.n_embd_v_gqa, n)[:, cells])
        else:
            v.append(plane.reshape(n, x.v_size)[cells])
        off += size
    return _Run(take, k, v, v_in_channels=layout.v_trans)


def _positions(
    positions: Sequence[int] | np.ndarray | None, first_pos: int, n_cells: int
) -> np.ndarray:
    if positions is None:
        pos = np.arange(first_pos, first_pos + n_cells, dtype=np.int64)
    else:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(pos) != n_cells:
            raise ValueError(f"{len(pos)} positions for {n_cells} cells")
    if n_cells and (pos.min() < INT32_MIN or pos.max() > INT32_MAX):
        raise ValueError("positions do not fit in int32")
    return pos


def _write_stream(
    out: memoryview,
    buf: np.ndarray,
    off: int,
    layout: Layout,
    runs: list[_Run],
    pos: np.ndarray,
    seq_id: int,
) -> int:
    n_cells = len(pos)
    meta = buf[off : off + 4 * META_WORDS * n_cells].view("<i4").reshape(n_cells, META_WORDS)
    meta[:, 0] = pos
    meta[:, 1] = 1
    meta[:, 2] = seq_id
    off += meta.nbytes
    DATA_HEADER.pack_into(out, off, int(layout.v_trans), layout.n_layer)
    off += DATA_HEADER.size
    for il, x in enumerate(layout.layers):
        ROW_HEADER.pack_into(out, off, x.k_type, x.k_row)
        off += ROW_HEADER.size
        dst = buf[off : off + n_cells * x.k_row].reshape(n_cells, x.k_row)
        _copy_rows(dst, [run.k[il] for run in runs])
        off += dst.nbytes
    for il, x in enumerate(layout.layers):
        width = x.v_cell_bytes(layout.v_trans)
        if layout.v_trans:
            TRANS_HEADER.pack_into(out, off, x.v_type, x.v_size, x.n_embd_v_gqa)
            off += TRANS_HEADER.size
            dst = _elements(buf[off : off + n_cells * width], x.v_size)
            _copy_channels(dst.reshape(x.n_embd_v_gqa, n_cells), runs, il, x.v_size)
        else:
            ROW_HEADER.pack_into(out, off, x.v_type, x.v_size)
            off += ROW_HEADER.size
            _copy_rows(buf[off : off + n_cells * width].reshape(n_cells, width),
                       [run.v[il] for run in runs])
        off += n_cells * width
    return off


def _copy_rows(dst: np.ndarray, planes: list[np.ndarray]) -> None:
    """Each run's rows of one plane into consecutive rows of ``dst``."""
    row = 0
    for plane in planes:
        dst[row : row + len(plane)] = plane
        row += len(plane)


def _copy_channels(dst: np.ndarray, runs: list[_Run], il: int, el: int) -> None:
    """Each run's V of layer ``il`` into a transposed plane ``(n_embd_v_gqa, n_cells)``.

    A planar run is already in that orientation (a copy of row segments); a cell-major
    one is transposed in blocks of cells, so that one block's rows and columns stay in
    cache (about 3x faster than one whole-plane transpose).
    """
    cell = 0
    for run in runs:
        if run.v_in_channels:
            dst[:, cell : cell + run.n] = run.v[il]
            cell += run.n
            continue
        src = _elements(run.v[il], el)
        for b in range(0, len(src), _TRANSPOSE_BLOCK):
            block = src[b : b + _TRANSPOSE_BLOCK]
            dst[:, cell : cell + len(block)] = block.T
            cell += len(block)


# --------------------------------------------------------------------------- streams


def to_single_stream(raw: memoryview, n_stream: int) -> memoryview:
    """The single-stream form of a plain state of a split cache (``n_stream`` streams,
    all but the sequence's own holding a zero cell count): what a unified cache would
    have written. Made in place, no copy of the cells: the header is rewritten just
    before the owning stream's cells, over count words no longer needed, and the result
    is a slice of ``raw``. :class:`StateFormatError` for another header or cells in more
    than one stream."""
    magic, src_seq, found = HEADER.unpack_from(raw, 0)
    if magic != STATE_MAGIC or found != n_stream:
        raise StateFormatError(f"unexpected state header {magic:#x} n_stream={found}")
    words = np.frombuffer(raw, dtype="<u4", count=n_stream, offset=HEADER.size)
    nonzero = np.flatnonzero(words)
    k = int(nonzero[0]) if len(nonzero) else n_stream  # stream holding the cells
    if k == n_stream:  # an empty sequence
        return memoryview(HEADER.pack(magic, src_seq, 1) + U32.pack(0))
    after = 4 * (n_stream - 1 - k)  # the zero counts of the streams after it
    body_end = len(raw) - after
    if after and np.frombuffer(raw, dtype="<u4", offset=body_end).any():
        raise StateFormatError("state holds cells in more than one KV stream")
    start = 4 * k
    HEADER.pack_into(raw, start, magic, src_seq, 1)
    return raw[start:body_end]


def is_single_stream(state: BytesLike | np.ndarray) -> bool:
    """Whether ``state`` is a state in the single-stream form (its header says so)."""
    if len(state) < HEADER.size:
        return False
    magic, _, n_stream = HEADER.unpack_from(np.frombuffer(state, np.uint8).data, 0)
    return bool(magic == STATE_MAGIC and n_stream == 1)


def widen_streams(state: np.ndarray, n_stream: int, out: np.ndarray) -> np.ndarray:
    """A single-stream state as a split cache of ``n_stream`` streams takes it, written
    into ``out`` (``len(state) + 4 * (n_stream - 1)`` bytes): the cells in stream 0, then
    ``n_stream - 1`` empty streams (llama.cpp restores the cells into the sequence's own
    stream whatever their position)."""
    magic, src_seq, _ = HEADER.unpack_from(state.data, 0)
    out[: len(state)] = state
    out[len(state):] = 0
    HEADER.pack_into(out.data, 0, magic, src_seq, n_stream)
    return out
