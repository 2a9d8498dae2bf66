"""The decode pool: every decoding request's cache in one row of per-layer arrays, one store per
layer by its kind (kv_store.py: K/V of full-attention and MLA layers, sliding-window rings,
linear-attention states), so the MLX executor runs one forward pass per decode step whatever the
model. A dense model is the case where every layer is full attention.

Rows are kept by pool_rows.PoolLayout, which the simulator prices too: joins copy one request's
prefilled cache into the next row; leaves move the last rows into the holes; neither copies the
whole pool (mlx-lm's BatchKVCache.extend/filter do). Only a geometry change (decided by the
scheduler, see scheduler.pool_geometry) reallocates. A row of capacity C holds C tokens of each
full/MLA layer, min(C, W) of each sliding layer and the fixed state of each linear layer: exactly
CacheLayout.seq_bytes(C), the scheduler's price.

`layer_views()` hands the model one cache object per layer with mlx-lm's cache API, so the model's
own attention runs unchanged: the new token is scattered into each row at its own position and
attention reads rows [0, B) up to the longest row, masked for the shorter ones. When every row
holds the same number of tokens (always at batch 1), the step writes one column with a slice update
and needs no mask, as mlx-lm's own caches do.

Paged (`paged=True`): full-attention and MLA layers keep K/V in PAGE_TOKENS-token blocks, one block
pool per layer (paged_store.py), with one block table per row (block_pool.py); a row holds
row_blocks(length) blocks and the pool the scheduler's PoolGeometry.blocks. Sliding rings and
linear states stay per row. Leaves then move only those per-row arrays. The prefix cache keeps
its blocks in the same block pools (prefix_blocks.PoolPrefixBlocks): a row joining with a cached
prefix references those blocks and copies only the rest."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.pool_geometry import PAGE_TOKENS, PoolGeometry, row_blocks
from batchsim.server.executors.block_pool import BlockPool
from batchsim.server.executors.kv_store import DecodeStep, StateStore, make_store
from batchsim.server.executors.paged_store import PagedKVStore, PagedStep
from batchsim.server.executors.pool_rows import PoolLayout
from batchsim.server.models.arch_cache import Attention, cache_layout


class DecodePool:
    def __init__(self, layers: list[Attention], dtype: mx.Dtype, kv_bits: int | None = None,
                 paged: bool = False):
        self.layers = layers
        self.layout = PoolLayout(cache_layout(layers, dtype.size, kv_bits), paged)
        self.stores = [PagedKVStore(att, dtype, kv_bits) if paged and att.kind in ("full", "mla")
                       else make_store(att, dtype, kv_bits) for att in layers]
        self.paged = [s for s in self.stores if isinstance(s, PagedKVStore)]
        self.blocks = BlockPool()  # the paged layers' blocks and each row's table
        self._tables: mx.array | None = None  # blocks.tables as one array, until they change
        self.lengths: list[int] = []  # tokens cached per row, aligned with layout.row_ids
        self._aranges: dict[int, mx.array] = {}  # batch size -> mx.arange(B)

    def __len__(self) -> int:
        return len(self.layout.row_ids)

    @property
    def row_ids(self) -> list[int]:
        return self.layout.row_ids

    @property
    def geometry(self) -> PoolGeometry:
        return self.layout.geometry

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every array of the pool."""
        return [a for s in self.stores for a in s.parts]

    def row_arrays(self) -> list[mx.array]:
        """Every array whose first axis is the row (all but the paged layers' blocks)."""
        return [a for s in self.stores if not isinstance(s, PagedKVStore) for a in s.parts]

    # -- membership ----------------------------------------------------------------------------
    def remove(self, request_ids: set[int]) -> None:
        """Drop rows; fill holes below the new row count with the surviving rows above it."""
        leaving = [i for i, rid in enumerate(self.layout.row_ids) if rid in request_ids]
        moves = self.layout.leave(request_ids)
        if self.paged and leaving:
            self.blocks.remove_rows(leaving, moves.holes, moves.movers)
            self._tables = None
        if moves.holes:
            src, dst = mx.array(moves.movers), mx.array(moves.holes)
            arrays = self.row_arrays()
            moved = [a[src] for a in arrays]
            mx.eval(moved)  # detach from the pool arrays so the scatter below updates them in place
            for a, m in zip(arrays, moved):
                a[dst] = m
            for h, m in zip(moves.holes, moves.movers):
                self.lengths[h] = self.lengths[m]
        del self.lengths[len(self.layout.row_ids):]

    def add(self, request_id: int, layer_caches: list | None, length: int,
            shared: list[int] | None = None) -> None:
        """Copy a prefilled request (its private caches, one per layer) into the next row; paged,
        its first blocks are `shared` (cached blocks holding its prefix), referenced, not copied."""
        row = self.layout.join(request_id, length)
        n_shared = len(shared or ())
        if self.paged:
            self._tables = None
            table = self.blocks.add_row(length, shared)
        if layer_caches is not None and length:
            for store, cache in zip(self.stores, layer_caches):
                if isinstance(store, PagedKVStore):
                    store.join(table, cache, length, n_shared)
                else:
                    store.join(row, cache, length)
        self.lengths.append(length)

    # -- a decode step undone (lookahead.py) ---------------------------------------------------
    def states(self) -> list:
        """What a decode step replaces rather than writes past the rows' lengths."""
        return [list(s.parts) for s in self.stores if isinstance(s, StateStore)]

    def _restore_states(self, states: list) -> None:
        for store, parts in zip((s for s in self.stores if isinstance(s, StateStore)), states):
            store.parts = parts

    def undo_step(self, lengths: list[int], states: list, joined: list[int]) -> None:
        """Back to before a decode step that joined `joined` as the last rows: lengths, states."""
        self.lengths = list(lengths)
        self._restore_states(states)
        for row, n in enumerate(lengths if self.paged else ()):
            self.blocks.fit_row(row, n)  # the blocks the step took for its token go back
        self._tables = None
        self.remove(set(joined))

    # -- geometry ------------------------------------------------------------------------------
    def resize(self, geometry: PoolGeometry) -> None:
        """Reallocate to the scheduler's geometry, keeping rows [0, B) and their tokens."""
        if geometry == self.layout.geometry:
            return
        if self.lengths and geometry.capacity_tokens < max(self.lengths):
            raise RuntimeError(f"geometry {geometry} cannot hold the pool's rows")
        new = self.layout.resize(geometry).new
        for store in self.stores:
            store.resize(new.rows, new.capacity_tokens)
        if self.paged and new.blocks != self.blocks.num_blocks:
            src, dst = self.blocks.resize(new.blocks or 0)
            for store in self.paged:
                store.resize_blocks(new.blocks or 0, src, dst)
            self._tables = None
        mx.eval(self.arrays())

    def can_step(self, joining: list[int], shared: int = 0) -> bool:
        """Room for one more decode step with rows of `joining` tokens joining first (`shared` of
        their blocks cached blocks)."""
        geometry, blocks = self.geometry, self.blocks
        lengths = [*self.lengths, *joining]
        if not lengths or len(lengths) > geometry.rows:
            return False
        if max(lengths) + 1 > geometry.capacity_tokens:
            return False
        if not self.paged:
            return True
        held = sum(len(t) for t in blocks.tables)
        return sum(row_blocks(n + 1) for n in lengths) - shared - held <= blocks.num_free

    # -- decode --------------------------------------------------------------------------------
    def layer_views(self, n: int = 1) -> list:
        """Per-layer caches for one decode forward of `n` tokens per row over rows [0, B); lengths
        advance by n (a verify step then keeps what it accepted: keep())."""
        lengths = self.lengths
        rows = self._aranges.get(len(lengths))
        if rows is None:
            rows = self._aranges[len(lengths)] = mx.arange(len(lengths))
        step = DecodeStep(lengths, rows, self._paged_step(lengths, n) if self.paged else None, n)
        if step.width > self.geometry.capacity_tokens:
            raise RuntimeError(f"row of {step.width} tokens exceeds capacity {self.geometry}")
        views = [s.view_class(s, step) for s in self.stores]
        self.lengths = [x + n for x in lengths]
        return views

    def _paged_step(self, lengths: list[int], n: int = 1) -> PagedStep:
        """Each row's blocks for its next n tokens (allocated as rows cross a block), and the
        block tables as one array."""
        blocks = self.blocks
        for row, length in enumerate(lengths):
            if blocks.fit_row(row, length + n):
                self._tables = None
        tables = blocks.tables
        if self._tables is None:
            width = max(len(t) for t in tables)
            self._tables = mx.array([t + [0] * (width - len(t)) for t in tables])
        if n == 1:
            return PagedStep(self._tables, lengths,
                             [t[x // PAGE_TOKENS] for t, x in zip(tables, lengths)])
        at = [[x + i for i in range(n)] for x in lengths]  # a verify step's positions
        written = [[t[p // PAGE_TOKENS] for p in ps] for t, ps in zip(tables, at)]
        if any(blocks.refcount[ws[0]] > 1 for ws in written):  # later ones are new this step
            raise RuntimeError("a verify step would write into a shared block")
        return PagedStep(self._tables, at, written)

    def keep(self, lengths: list[int], kept: list[int]) -> None:
        """After a verify step from `lengths`: each row keeps its first kept[b] tokens; K/V past
        them are never read (masked, then overwritten), as after an undone step run ahead.
        Paged: blocks taken only for rejected drafts go back to the free list."""
        self.lengths = [x + k for x, k in zip(lengths, kept)]
        for row, length in enumerate(self.lengths if self.paged else ()):
            if self.blocks.fit_row(row, length):
                self._tables = None
