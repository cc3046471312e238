"""Runs of cells cut out of a state: the cells of positions ``[start, end)``, in position
order, in the planes or the cells form (see model_runtime.state). Runs of any cuts passed
to :func:`~model_runtime.state.build.build_state` with the same positions give back the
state byte for byte.
"""

from __future__ import annotations

import numpy as np

from .layout import BytesLike
from .parse import CellState, as_items, parse

__all__ = ["cells_bytes", "planes_bytes"]

_CACHE_LINE = 64


def planes_bytes(state: BytesLike | np.ndarray | CellState, start: int, end: int) -> memoryview:
    """Cells ``[start, end)`` in position order, in the planes form:
    ``(end - start) * layout.cell_width`` bytes, a read-only buffer."""
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
    ``i``-th cell.
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
