"""A state read: llama.cpp's bytes of one sequence (the format is described in
model_runtime.state) validated and viewed as its cells, without copying them; its tail,
and a tail read as a sliding window's cache. Cutting runs out of a parsed state is
model_runtime.state.cut's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .layout import (
    DATA_HEADER,
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
)

__all__ = ["CellState", "as_items", "layout_of", "parse", "parse_state_run", "window_of"]

# A state's header before its (first) cache, which begins with its stream count.
_MAGIC_AND_SEQ = struct.Struct("<Ii")  # magic, source seq_id
_NO_TAIL = np.zeros(0, dtype=np.uint8)
_NO_TAIL.flags.writeable = False


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
