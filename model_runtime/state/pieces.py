"""Entries as pieces: the cells a save stores, and the state a restore joins.

A plain-attention state is stored as runs of cells: an entry whose first ``base``
tokens another entry's chain already holds stores only the cells of tokens ``[base, n)``
(the planes form) and names that entry as its parent, so each shared prefix is
stored once; an entry with no parent stores the state as llama.cpp gave it (the state
form, no copy). A restore reads the chain, root first, takes from each piece the cells
up to where the next one starts (or the prompt stops), and joins them into the bytes
``llama_state_seq_set_data`` takes; a restore served by a root's cells alone hands
llama.cpp the stored bytes as they are. Pieces of the first piece format hold
cell-major runs (their layout says so) and join with planar ones.

A state with a tail (hybrid and sliding-window models: cells, then a part at its last
position that cannot be cut) is stored the same way, each piece's cells
followed by the tail of the state it ends: a checkpoint stores only its new cells and
its own tail, and a restore joins the chain's cells with the last piece's tail. Such a
state is served only whole (up to the end of its last piece). States that cannot be cut
at all (recurrent models) and entries of the previous version are whole states: one
blob, no cell layout.

Pure functions over bytes; llama.cpp's state format and the forms of runs are
described in model_runtime.state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgpack
import numpy as np

from kvcache.client import LoadedBlob

from .build import Scratch, build_state
from .cut import planes_bytes
from .layout import (
    FORM_PLANES,
    FORM_STATE,
    HEADER,
    U32,
    Layout,
    StateFormatError,
    form_of,
    run_size,
)
from .parse import parse, parse_state_run, window_of

__all__ = ["Cut", "JoinedState", "cut", "decode_layout", "encode_layout", "join",
           "stored_logits"]


def encode_layout(layout: Layout, form: str = FORM_PLANES) -> bytes:
    """The ``cell_layout`` a piece's blob carries, naming the form of its run."""
    return msgpack.packb(layout.to_dict(form), use_bin_type=True)


def decode_layout(data: bytes) -> tuple[Layout, str]:
    """The layout a piece's ``cell_layout`` names, and the form of its run."""
    try:
        d = msgpack.unpackb(data, raw=False)
        return Layout.from_dict(d), form_of(d)
    except StateFormatError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise StateFormatError(f"cell layout does not decode: {exc!r}") from None


@dataclass(frozen=True)
class Cut:
    """What a save of a state stores: the cells of tokens ``[base, n_cells)``."""

    payload: memoryview
    cell_layout: bytes
    n_cells: int


def cut(state: bytes | memoryview, base: int, end: int | None = None, *,
        tail: bool = False, window: int = 0) -> Cut:
    """The cells ``[base, end)`` of a captured state (``end``: all of them): the whole
    state is stored as it is (a view of ``state``, which must outlive the Cut), any other
    range as its planes. Raises StateFormatError for a state that is not one run of cells
    holding positions 0..n-1 (those are saved whole). With ``tail`` the state has one
    (see model_runtime.state): it follows the planes, and only a range ending at the state's end has
    it. With ``window`` the tail is a sliding window of that many positions, stored as
    the planes of its cells the range holds (Layout.window): a piece built on a parent
    that ends where it starts finds the rest of its window in its chain."""
    cells = parse(state, tail=tail or bool(window))
    if not cells.is_prefix:
        raise StateFormatError("the state's cells do not hold positions 0..n-1")
    n = cells.n_cells
    end = n if end is None else end
    if not 0 <= base < end <= n:
        raise ValueError(f"cells [{base}, {end}) outside a state of {n} cells")
    if (tail or window) and end != n:
        raise ValueError(f"a state with a tail holds it at cell {n}, not {end}")
    if window:
        held = window_of(cells, window)
        first = n - len(held.positions)  # the window's cells hold positions first..n-1
        own = planes_bytes(held, max(base, n - window) - first, n - first)
        layout = replace(cells.layout, window=window, window_layers=held.layout.layers)
        return Cut(_joined(planes_bytes(cells, base, n), own), encode_layout(layout),
                   n)
    if base == 0 and end == n:
        return Cut(memoryview(state).toreadonly(),
                   encode_layout(cells.layout, FORM_STATE), end)
    planes = planes_bytes(cells, base, end)
    # One copy more of the new cells with a tail: the tail is what makes the checkpoint.
    return Cut(_joined(planes, cells.tail) if tail else planes, encode_layout(cells.layout),
               end)


def _joined(cells: memoryview, after: memoryview | np.ndarray) -> memoryview:
    """A run of cells followed by what a piece keeps after them, as one read-only buffer."""
    return np.concatenate([np.frombuffer(cells, np.uint8),
                           np.frombuffer(after, np.uint8)]).data.toreadonly()


@dataclass(frozen=True)
class JoinedState:
    state: bytes | memoryview  # for llama_state_seq_set_data
    tokens: Sequence[int]  # the tokens it holds (maybe more than were asked for)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def join(chain: Sequence[LoadedBlob], n_tokens: int, seq_id: int,
         scratch: Scratch | None = None, n_stream: int = 1) -> JoinedState:
    """The state of the first ``n_tokens`` tokens of a chain (root first, as
    ``CacheClient.load_chain`` returns it; pieces past them are not read), for sequence
    ``seq_id``. Raises StateFormatError when the pieces do not fit together.

    A whole state, and a root stored in the state form that serves every cell asked
    for and holds at most twice as many, are returned as stored, with all their tokens:
    the caller cuts them after the restore (llama.cpp reads neither the sequence id in
    the header nor those of the cells, and setting and then freeing the extra cells costs
    less than building a copy). Otherwise the state is built: in ``scratch``'s
    buffer when given (valid until its next use). ``n_stream``: the KV streams of the
    context it is for (LlamaContext.state_streams): the cells go in the first, the
    others are written empty, so llama.cpp takes the bytes as they are.

    A chain with a tail (its layout says so) serves only all of its tokens: the cells
    of every piece up to the next one's start, then the last piece's tail."""
    if not chain:
        raise ValueError("an empty chain")
    if not chain[-1].meta.cell_layout:
        if len(chain) > 1:
            raise StateFormatError("a whole state cannot follow other pieces")
        return JoinedState(chain[0].payload, chain[0].meta.tokens)
    layout, _ = decode_layout(chain[0].meta.cell_layout)
    if layout.tail and n_tokens != len(chain[-1].meta.tokens):
        raise StateFormatError(f"a state with a tail serves all of its "
                               f"{len(chain[-1].meta.tokens)} tokens, not {n_tokens}")
    used: list[tuple[LoadedBlob, str, int, int]] = []  # (piece, form, cells taken, bytes)
    for i, blob in enumerate(chain):
        meta = blob.meta
        piece_layout, form = decode_layout(meta.cell_layout)
        # The stream a piece's cells came from does not matter: llama.cpp restores the
        # cells of any stream into the sequence's own (only states of a split cache that
        # are not made single-stream, those with a tail, say which one it was).
        if replace(piece_layout, stream=layout.stream) != layout:
            raise StateFormatError(f"piece {i} has another cell layout than its chain")
        own = len(meta.tokens) - meta.base
        if form == FORM_STATE and meta.base:
            raise StateFormatError(f"piece {i} is a whole state but has a parent")
        size = run_size(layout, form, own)
        expected = size + _window_bytes(layout, meta.base, len(meta.tokens))
        if len(blob.payload) != expected and not (layout.tail and not layout.window
                                                   and len(blob.payload) > size):
            raise StateFormatError(f"piece {i} holds {len(blob.payload)} bytes, not the "
                                   f"{size} of {own} cells" + (" and a tail" * layout.tail))
        if meta.base >= n_tokens:
            break  # this piece and the rest hold only later tokens
        end = chain[i + 1].meta.base if i + 1 < len(chain) else len(meta.tokens)
        used.append((blob, form, min(end, n_tokens) - meta.base, size))
    if sum(take for _, _, take, _ in used) != n_tokens:
        raise StateFormatError(f"the chain holds {sum(u[2] for u in used)} of "
                               f"{n_tokens} tokens")
    root, form, _, _ = used[0]
    if len(used) == 1 and form == FORM_STATE and layout.n_stream == n_stream \
            and len(root.meta.tokens) <= 2 * n_tokens:
        # Checked before llama.cpp takes it as it is (it would take any positions).
        if parse_state_run(root.payload, layout).layout.n_stream != n_stream:
            raise StateFormatError("a stored state does not match its cell layout")
        return JoinedState(root.payload, root.meta.tokens)
    if layout.n_stream == 1 and n_stream > 1:
        layout = replace(layout, n_stream=n_stream, stream=0)
    # A state-form run is parsed by build_state (its tail, if any, is skipped there); a
    # planar run is its cells' bytes, without the tail that follows them.
    runs = [blob.payload if form == FORM_STATE else blob.payload[:size]
            for blob, form, _, size in used]
    state = build_state(layout, runs, seq_id=seq_id, forms=[form for _, form, _, _ in used],
                        takes=[take for _, _, take, _ in used], scratch=scratch,
                        tail=_tail(layout, used, n_tokens, seq_id))
    return JoinedState(state, chain[-1].meta.tokens[:n_tokens])


def _window_bytes(layout: Layout, base: int, end: int) -> int:
    """Bytes of the window's cells a piece of cells ``[base, end)`` holds after them."""
    width = layout.window_layout().cell_width if layout.window else 0
    return layout.window_cells(base, end) * width


def _window_tail(layout: Layout, used: list[tuple[LoadedBlob, str, int, int]], n: int,
                 seq_id: int) -> memoryview:
    """The window's cache of a state of ``n`` tokens (the cells of positions
    ``max(0, n - window) .. n-1``), from the window cells each piece of the chain holds:
    those of positions it also gives the cells of, from where the window starts."""
    start = max(0, n - layout.window)
    runs, skips, takes = [], [], []
    for blob, _, take, size in used:
        base, end = blob.meta.base, len(blob.meta.tokens)
        held_from = end - layout.window_cells(base, end)
        lo, hi = max(start, base), base + take
        if hi <= lo:
            continue  # all of its cells are before the window
        if lo < held_from:
            raise StateFormatError(f"the window's cells from {lo} are not in the piece of "
                                   f"[{base}, {end}), which holds them from {held_from}")
        runs.append(blob.payload[size:size + _window_bytes(layout, base, end)])
        skips.append(lo - held_from)
        takes.append(hi - lo)
    section = build_state(layout.window_layout(), runs, seq_id=seq_id, forms=FORM_PLANES,
                          takes=takes, skips=skips, first_pos=start)
    # llama.cpp's window cache follows the first as a state's body does its header: its
    # stream count first (the magic and the sequence id are the state's, written once).
    return section[HEADER.size - U32.size:]


def _tail(layout: Layout, used: list[tuple[LoadedBlob, str, int, int]], n: int,
          seq_id: int) -> memoryview | np.ndarray | bytes:
    """What follows the cells of a state of ``n`` tokens joined from ``used`` (piece, form,
    cells taken, bytes of cells): nothing, the last piece's tail, or a window's cache."""
    if layout.window:
        return _window_tail(layout, used, n, seq_id)
    if not layout.tail:
        return b""
    last, form, _, size = used[-1]
    if form == FORM_STATE:
        return parse_state_run(last.payload, layout).tail
    return last.payload[size:]


def stored_logits(chain: Sequence[LoadedBlob], n_vocab: int) -> dict[int, np.ndarray]:
    """The scores a chain's pieces carry, by the length of the piece they end (pieces
    whose scores are not one float32 per vocabulary entry are ignored)."""
    found = {}
    for blob in chain:
        raw = blob.meta.logits
        if raw and len(raw) == 4 * n_vocab:
            found[len(blob.meta.tokens)] = np.frombuffer(raw, dtype="<f4")
    return found
