"""Entries as pieces: the cells a save stores, and the state a restore joins.

A plain-attention state is stored as runs of cells (kv_cells' planar form): an entry
whose first ``base`` tokens another entry's chain already holds stores only the cells
of tokens ``[base, n)`` and names that entry as its parent, so each shared prefix is
stored once. A restore reads the chain, root first, takes from each piece the cells up
to where the next one starts (or the prompt stops), and joins them into the bytes
``llama_state_seq_set_data`` takes. States that cannot be cut (sliding-window,
recurrent, hybrid models) and entries of the previous version are whole states: one
blob, no cell layout. Pieces of the first piece format hold cell-major runs (their
layout says so) and join with planar ones.

Pure functions over bytes; the byte layout of llama.cpp's states is kv_cells'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgpack

from kvcache.client import LoadedBlob

from . import kv_cells
from .kv_cells import Layout, StateFormatError

__all__ = ["Cut", "JoinedState", "cut", "decode_layout", "encode_layout", "join"]


def encode_layout(layout: Layout) -> bytes:
    """The ``cell_layout`` a piece's blob carries (its runs are planar)."""
    return msgpack.packb(layout.to_dict(kv_cells.FORM_PLANES), use_bin_type=True)


def decode_layout(data: bytes) -> tuple[Layout, str]:
    """The layout a piece's ``cell_layout`` names, and the form of its run."""
    try:
        d = msgpack.unpackb(data, raw=False)
        return Layout.from_dict(d), kv_cells.form_of(d)
    except StateFormatError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise StateFormatError(f"cell layout does not decode: {exc!r}") from None


@dataclass(frozen=True)
class Cut:
    """What a save of a state stores: the cells of tokens ``[base, n)``."""

    payload: memoryview
    cell_layout: bytes
    n_cells: int


def cut(state: bytes | memoryview, base: int) -> Cut:
    """The cells of a captured state from ``base`` on. Raises StateFormatError for a
    state that is not one run of cells holding positions 0..n-1 (those are saved whole)."""
    cells = kv_cells.parse(state)
    if not cells.is_prefix:
        raise StateFormatError("the state's cells do not hold positions 0..n-1")
    if not 0 <= base < cells.n_cells:
        raise ValueError(f"base {base} outside a state of {cells.n_cells} cells")
    return Cut(kv_cells.planes_bytes(cells, base, cells.n_cells), encode_layout(cells.layout),
               cells.n_cells)


@dataclass(frozen=True)
class JoinedState:
    state: bytes | memoryview  # for llama_state_seq_set_data
    n_tokens: int  # tokens it holds (a whole state may hold more than were asked for)


def join(chain: Sequence[LoadedBlob], n_tokens: int, seq_id: int,
         scratch: kv_cells.Scratch | None = None, n_stream: int = 1) -> JoinedState:
    """The state of the first ``n_tokens`` tokens of a chain (root first, as
    ``CacheClient.load_chain`` returns it; pieces past them are not read), for sequence
    ``seq_id``. A whole state is
    returned as it is: the caller cuts it after the restore. Raises StateFormatError
    when the pieces do not fit together. With ``scratch`` the state is built in its
    buffer (valid until the scratch's next use). ``n_stream``: the KV streams of the
    context it is for (LlamaContext.state_streams): the cells go in the first, the
    others are written empty, so llama.cpp takes the bytes as they are."""
    if not chain:
        raise ValueError("an empty chain")
    if not chain[-1].meta.cell_layout:
        if len(chain) > 1:
            raise StateFormatError("a whole state cannot follow other pieces")
        return JoinedState(chain[0].payload, len(chain[0].meta.tokens))
    layout, _ = decode_layout(chain[0].meta.cell_layout)
    width = layout.cell_width
    runs: list[memoryview] = []
    forms: list[str] = []
    takes: list[int] = []
    for i, blob in enumerate(chain):
        meta = blob.meta
        piece_layout, form = decode_layout(meta.cell_layout)
        if piece_layout != layout:
            raise StateFormatError(f"piece {i} has another cell layout than its chain")
        own = len(meta.tokens) - meta.base
        if len(blob.payload) != own * width:
            raise StateFormatError(f"piece {i} holds {len(blob.payload)} bytes, not "
                                   f"{own} cells of {width}")
        if meta.base >= n_tokens:
            break  # this piece and the rest hold only later tokens
        end = chain[i + 1].meta.base if i + 1 < len(chain) else len(meta.tokens)
        runs.append(blob.payload)
        forms.append(form)
        takes.append(min(end, n_tokens) - meta.base)
    if sum(takes) != n_tokens:
        raise StateFormatError(f"the chain holds {sum(takes)} of {n_tokens} tokens")
    if layout.n_stream == 1 and n_stream > 1:
        layout = replace(layout, n_stream=n_stream, stream=0)
    return JoinedState(
        kv_cells.build_state(layout, runs, seq_id=seq_id, forms=forms, takes=takes,
                             scratch=scratch), n_tokens)

