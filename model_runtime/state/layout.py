"""The parts of llama.cpp's per-sequence state format (described in model_runtime.state)
that are not cells: the headers' structs, the forms a run of cells is stored in and the
layout versions naming them, and :class:`Layout`, everything besides the cells needed to
rebuild a state. Pure data, no parsing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DATA_HEADER",
    "FORM_CELLS",
    "FORM_PLANES",
    "FORM_STATE",
    "HEADER",
    "INT32_MAX",
    "INT32_MIN",
    "LAYOUT_VERSIONS",
    "MAX_STREAMS",
    "META_WORDS",
    "ROW_HEADER",
    "STATE_MAGIC",
    "TAIL_LAYOUT_VERSIONS",
    "WINDOW_LAYOUT_VERSIONS",
    "TRANS_HEADER",
    "U32",
    "BytesLike",
    "LayerLayout",
    "Layout",
    "StateFormatError",
    "form_of",
    "run_size",
]

STATE_MAGIC = 0xAF143CD8
FORM_CELLS, FORM_PLANES, FORM_STATE = "cells", "planes", "state"
# A layout dict's version names the form of the runs it describes, so a reader that
# knows only cell-major runs refuses planar ones instead of restoring scrambled bytes.
LAYOUT_VERSIONS = {FORM_CELLS: 1, FORM_PLANES: 2, FORM_STATE: 3}
_FORMS = {v: k for k, v in LAYOUT_VERSIONS.items()}
# Runs followed by a tail (Layout.tail) have versions of their own: a reader that does not
# know tails refuses them rather than taking a tail for cells.
TAIL_LAYOUT_VERSIONS = {FORM_PLANES: 4, FORM_STATE: 5}
_TAIL_FORMS = {v: k for k, v in TAIL_LAYOUT_VERSIONS.items()}
# A tail that is a sliding window's cells (Layout.window), stored as planes.
WINDOW_LAYOUT_VERSIONS = {FORM_PLANES: 6}
_WINDOW_FORMS = {v: k for k, v in WINDOW_LAYOUT_VERSIONS.items()}

BytesLike = bytes | bytearray | memoryview

HEADER = struct.Struct("<IiI")  # magic, source seq_id, n_stream
U32 = struct.Struct("<I")
DATA_HEADER = struct.Struct("<II")  # v_trans, n_layer
ROW_HEADER = struct.Struct("<iQ")  # type, row size (K planes; V planes when not transposed)
TRANS_HEADER = struct.Struct("<iII")  # v_type, v_size_el, n_embd_v_gqa
META_WORDS = 3  # pos, n_seq_id, seq_id: one i32/u32 each per cell
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# llama.cpp allows at most LLAMA_MAX_SEQ (256) sequences, hence streams.
MAX_STREAMS = 256


class StateFormatError(ValueError):
    """The bytes are not a single-sequence state of one plain attention KV cache."""


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class LayerLayout:
    """The state's description of one layer: K row and V geometry.

    ``v_size`` is llama.cpp's ``v_size_row`` when V is not transposed and its
    ``v_size_el`` when it is; ``n_embd_v_gqa`` is only written for a transposed V (0
    otherwise).
    """

    k_type: int
    k_row: int
    v_type: int
    v_size: int
    n_embd_v_gqa: int = 0

    def v_cell_bytes(self, v_trans: bool) -> int:
        """Bytes of V one cell holds in this layer."""
        return self.v_size * self.n_embd_v_gqa if v_trans else self.v_size


@dataclass(frozen=True)
class Layout:
    """Everything besides the cells needed to rebuild llama.cpp's bytes.

    Independent of the number of cells and of the sequence id, so every state of one
    model and KV configuration has the same layout, and runs of cells of equal layouts
    can be joined.  ``stream`` is the index of the stream holding the cells when the
    state has ``n_stream`` > 1 (a split KV cache); the other streams are empty.
    ``tail``: every state of this layout has a tail after its cells (see
    model_runtime.state), and every run stored with it is followed by the tail at its end.
    ``window``: the tail is a sliding window's cache, the cells of the last ``window``
    positions in ``window_layers`` (one more cache like the first), and a run of cells
    ``[base, end)`` is followed by the planes of the window's cells it holds,
    ``[max(base, end - window), end)`` (see :meth:`window_cells`).
    """

    v_trans: bool
    layers: tuple[LayerLayout, ...]
    n_stream: int = 1
    stream: int = 0
    tail: bool = False
    window: int = 0
    window_layers: tuple[LayerLayout, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise StateFormatError("layout has no layers")
        if not 1 <= self.n_stream <= MAX_STREAMS or not 0 <= self.stream < self.n_stream:
            raise StateFormatError(f"layout stream {self.stream} of {self.n_stream} is invalid")
        for i, layer in enumerate(self.layers):
            # The state stores types as i32 and these sizes in at most 32 bits.
            types_ok = all(0 <= t <= INT32_MAX for t in (layer.k_type, layer.v_type))
            sizes_ok = types_ok and 0 < layer.k_row < 2**32 and 0 < layer.v_size < 2**32
            embd_ok = 0 < layer.n_embd_v_gqa < 2**32 if self.v_trans else layer.n_embd_v_gqa == 0
            if not (sizes_ok and embd_ok):
                raise StateFormatError(f"layout layer {i} has invalid sizes: {layer}")
        if self.window or self.window_layers:
            if self.window < 1 or not self.tail:
                raise StateFormatError(f"layout window {self.window} without a tail")
            self.window_layout()  # its layers are checked as a layout's

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    def window_cells(self, base: int, end: int) -> int:
        """How many of the window's cells a run of cells ``[base, end)`` holds."""
        return end - max(base, end - self.window) if self.window else 0

    def window_layout(self) -> Layout:
        """The layout of the window's cache, as a state of its own."""
        return Layout(self.v_trans, self.window_layers, self.n_stream, self.stream)

    @property
    def cell_width(self) -> int:
        """Bytes per cell in the cell-major form: all K rows, then all V values."""
        return sum(x.k_row for x in self.layers) + sum(
            x.v_cell_bytes(self.v_trans) for x in self.layers
        )

    def state_size(self, n_cells: int) -> int:
        """Length of llama.cpp's state of ``n_cells`` cells with this layout."""
        size = HEADER.size + U32.size * self.n_stream
        if n_cells == 0:
            return size
        v_header = TRANS_HEADER.size if self.v_trans else ROW_HEADER.size
        per_layer_headers = ROW_HEADER.size + v_header
        return (
            size
            + 4 * META_WORDS * n_cells
            + DATA_HEADER.size
            + self.n_layer * per_layer_headers
            + n_cells * self.cell_width
        )

    def to_dict(self, form: str = FORM_PLANES) -> dict[str, Any]:
        """A small plain dict (ints and lists) for metadata, naming the ``form`` of the
        runs it goes with; see :meth:`from_dict` and :func:`form_of`."""
        versions = self.versions()
        if form not in versions:
            raise ValueError(f"unknown run form {form!r}" + (" with a tail" if self.tail else ""))
        d = {
            "version": versions[form],
            "v_trans": int(self.v_trans),
            "n_stream": self.n_stream,
            "stream": self.stream,
            "layers": _layer_rows(self.layers),
        }
        if self.window:
            d |= {"window": self.window, "window_layers": _layer_rows(self.window_layers)}
        return d

    def versions(self) -> dict[str, int]:
        """The layout versions of the run forms states of this layout are stored in."""
        if self.window:
            return WINDOW_LAYOUT_VERSIONS
        return TAIL_LAYOUT_VERSIONS if self.tail else LAYOUT_VERSIONS

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """The layout :meth:`to_dict` described; :class:`StateFormatError` if malformed."""
        try:
            form_of(d)
            if _as_int(d["v_trans"]) not in (0, 1):
                raise StateFormatError(f"layout v_trans {d['v_trans']} is not 0 or 1")
            windowed = d["version"] in _WINDOW_FORMS
            layout = cls(
                v_trans=bool(d["v_trans"]),
                layers=_layers_of(d["layers"]),
                n_stream=_as_int(d["n_stream"]),
                stream=_as_int(d["stream"]),
                tail=d["version"] in _TAIL_FORMS or windowed,
                window=_as_int(d["window"]) if windowed else 0,
                window_layers=_layers_of(d["window_layers"]) if windowed else (),
            )
            if windowed and layout.window < 1:
                raise StateFormatError(f"layout window {layout.window} is not positive")
            return layout
        except (KeyError, TypeError) as e:
            raise StateFormatError(f"malformed layout: {e!r}") from None

    def k_columns(self) -> list[tuple[int, int]]:
        """(offset, width) of each layer's K row within a cell."""
        return self._columns([x.k_row for x in self.layers], 0)

    def v_columns(self) -> list[tuple[int, int]]:
        """(offset, width) of each layer's V values within a cell, after all K rows."""
        widths = [x.v_cell_bytes(self.v_trans) for x in self.layers]
        return self._columns(widths, sum(x.k_row for x in self.layers))

    @staticmethod
    def _columns(widths: list[int], col: int) -> list[tuple[int, int]]:
        out = []
        for width in widths:
            out.append((col, width))
            col += width
        return out


def form_of(d: dict[str, Any]) -> str:
    """The form (:data:`FORM_CELLS`, :data:`FORM_PLANES` or :data:`FORM_STATE`) of the
    runs a layout dict goes with; :class:`StateFormatError` for a version this module
    does not know."""
    version = d.get("version") if isinstance(d, dict) else None
    forms = _FORMS | _TAIL_FORMS | _WINDOW_FORMS
    if isinstance(version, bool) or not isinstance(version, int) or version not in forms:
        raise StateFormatError(f"unsupported layout version {version!r}")
    return forms[version]


def run_size(layout: Layout, form: str, n_cells: int) -> int:
    """Bytes of a run of ``n_cells`` cells in ``form`` (a tail, if any, follows them)."""
    if form == FORM_STATE:
        return layout.state_size(n_cells)
    if form in (FORM_CELLS, FORM_PLANES):
        return n_cells * layout.cell_width
    raise ValueError(f"unknown run form {form!r}")


def _layer_rows(layers: tuple[LayerLayout, ...]) -> list[list[int]]:
    return [[x.k_type, x.k_row, x.v_type, x.v_size, x.n_embd_v_gqa] for x in layers]


def _layers_of(rows: Any) -> tuple[LayerLayout, ...]:
    if any(len(row) != 5 for row in rows):
        raise StateFormatError("layout layers need 5 numbers each")
    return tuple(LayerLayout(*(_as_int(v) for v in row)) for row in rows)


def _as_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise StateFormatError(f"layout value {v!r} is not an integer")
    return v
