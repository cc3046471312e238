"""llama.cpp's per-sequence state bytes built from runs of cells (the inverse of
model_runtime.state.cut): the state of runs joined in order, with a tail after them
(``build_state``), and the stream count of a plain state's header changed (the
single-stream form of a split cache's state, and back). Pure functions over bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .layout import (
    DATA_HEADER,
    FORM_CELLS,
    FORM_PLANES,
    FORM_STATE,
    HEADER,
    INT32_MAX,
    INT32_MIN,
    META_WORDS,
    ROW_HEADER,
    STATE_MAGIC,
    TRANS_HEADER,
    U32,
    BytesLike,
    Layout,
    StateFormatError,
)
from .parse import as_items, parse_state_run

__all__ = ["Scratch", "build_state", "is_single_stream", "to_single_stream", "widen_streams"]

_TRANSPOSE_BLOCK = 64  # cells per block when transposing V into llama.cpp's layout


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
            v.append(as_items(plane, x.v_size).reshape(x.n_embd_v_gqa, n)[:, cells])
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
            dst = as_items(buf[off : off + n_cells * width], x.v_size)
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
        src = as_items(run.v[il], el)
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
