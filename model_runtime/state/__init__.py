"""llama.cpp's per-sequence state format, described once, and the states kvcache keeps.

The bytes ``llama_state_seq_get_data`` writes and ``llama_state_seq_set_data`` takes for
one sequence are documented nowhere but in llama.cpp's source (as vendored by
llama-cpp-python 0.3.36: ``llama-context.cpp`` ``state_seq_get_data``,
``llama-kv-cache.cpp`` ``state_write``), and they change between releases, hence the
library version in a model's KV layout. Little-endian::

    magic u32 = 0xAF143CD8, source seq_id i32, n_stream u32
    per stream: cell_count u32; when non-zero:
        per cell: pos i32, n_seq_id u32 (= 1), seq_id i32
        v_trans u32, n_layer u32
        per layer: k_type i32, k_size_row u64, cell_count K rows
        v_trans = 0, per layer: v_type i32, v_size_row u64, cell_count V rows
        v_trans = 1, per layer: v_type i32, v_size_el u32, n_embd_v_gqa u32, then per
                     channel that channel's element for every cell

``v_trans`` is 1 when flash attention is off. Cells appear in KV-buffer order, which is
usually, but not always, position order. A restore clears the sequence, takes exactly one
sequence id per cell, places the cells contiguously and checks the layer count, types, row
sizes and ``v_trans``. No call of llama.cpp's writes part of a sequence's cells, so
cutting and joining happen here, on our side of the API. A context whose KV cache is split
into streams (one per sequence) writes a cell count for each, all zero but the sequence's
own; such states are kept in the single-stream form a unified cache writes
(``build.to_single_stream``, and ``build.widen_streams`` back).

**Runs of cells.** Everything besides the cells (the headers' types and sizes, the stream
holding them) is a state's :class:`~.layout.Layout`, the same for every state of one model
and KV configuration. The rest of the project sees opaque *runs of cells*: a run of ``n``
cells of a layout, which joins with any other run of it. A run is kept in one of three
forms (``layout.FORM_*``, ``layout.run_size``), and runs of any forms join in one state:

- planes (``cut.planes_bytes``; what pieces are stored in): llama.cpp's own data section
  restricted to the run, without headers: every layer's ``n`` K rows, then every layer's V
  as ``n`` rows or, transposed, ``n_embd_v_gqa`` channels of ``n`` elements. Cutting and
  joining are plain copies of contiguous rows (no transpose), the cheapest for a restore.
- cells (``cut.cells_bytes``): each cell is its K row of every layer, then its V values of
  every layer, a transposed V untransposed, so every cell is one contiguous record of
  ``layout.cell_width`` bytes. Pieces of kvcache 0.1's first piece format are in this form
  and stay readable.
- state: llama.cpp's own bytes of a state holding exactly positions ``0..n-1`` in order
  (what a root piece is stored as: saving it copies nothing, and restoring all of it hands
  llama.cpp the stored bytes as they are). ``layout.state_size(n)`` bytes.

**Tails.** Hybrid models (attention and recurrent layers) write their attention cache and
then the recurrent layers' state; sliding-window models with full-attention layers write
the full-attention cache and then the window's (llama.cpp's ``llama_memory_hybrid`` and
``llama_kv_cache_iswa``). The first part is cells like any plain state's; the *tail* holds
the state at the sequence's last position only, so it cannot be cut: it is kept as opaque
bytes and written back after the cells (``parse.parse(state, tail=True)``,
``build.build_state(..., tail=...)``). Its layout says so (``Layout.tail``), so runs with a
tail never join runs without, and a state with one is served only whole.

**Windows.** A sliding window's tail is itself a cache like the first, holding the cells of
the last ``window`` positions (``parse.window_of``), each a function of the tokens up to it.
So a run of cells ``[base, end)`` of such a layout (``Layout.window``) keeps, after its
planes, the planes of the window's cells it adds, ``[max(base, end - window), end)``, and a
restore takes the rest of the window from the runs before it in its chain.

**Layout versions.** A layout is stored with every piece as a small dict whose version
names the form of the piece's run: 1 cells, 2 planes, 3 state; with a tail 4 planes, 5
state; with a window 6 planes. A reader refuses a version it does not know rather than
restore scrambled bytes, or take a tail for cells.

**Refused** (:class:`~.layout.StateFormatError`), because cutting them would be wrong or
their bytes could not be rebuilt exactly: a second cache after the first unless a tail is
asked for, recurrent models (their states are stored whole, as llama.cpp wrote them),
cells with more than one sequence id, cells in more than one stream, per-cell extension
data (M-RoPE and PLE models: the sizes no longer add up), truncated states and trailing
bytes. A model whose sliding window covers every layer writes one plain cache holding only
the window's cells: it parses, its positions do not start at 0, and it is never cut (only
states whose ``CellState.is_prefix`` holds are).

The modules, each built on those before it (pure functions over bytes, numpy, no calls
into llama.cpp):

- ``layout``: the headers' structs, the run forms and their versions, :class:`Layout`
  (data, no parsing);
- ``parse``: a state read, as read-only views of its cells, its tail and its window;
- ``cut``: runs of cells taken out of a parsed state, in the planes or cells form;
- ``build``: runs joined into llama.cpp's bytes, and a split cache's stream count changed;
- ``pieces``: what a save stores (a piece: the cells a parent entry does not hold) and the
  state a restore joins from a chain of pieces.

And beside them, for the runtime's handling of states: ``buffers`` (the memory a save
copies a state into, reused) and ``seams`` (where a prompt may be tokenized in two parts
with the tokens of the whole, so that a head whose state is kept keeps its tokens).
"""
