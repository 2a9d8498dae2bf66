"""The decode pool for models whose layers cache different things (sliding windows, linear-attention
states, MLA latents, quantized K/V): one store per layer (family_stores), the same row bookkeeping
as the dense pool (row_pool.RowPool over pool_layout.PoolLayout: joins take the next row, leaves
move the last rows into the holes, only a geometry change reallocates), and the same interface as
kv_pool.DecodePool, so the MLX executor runs one forward pass per decode step whatever the family.

A row of capacity C holds C tokens of each full/MLA layer, min(C, W) of each sliding layer and the
fixed state of each linear layer: exactly CacheLayout.seq_bytes(C), the scheduler's price."""

from __future__ import annotations

import mlx.core as mx
from batchsim.server.executors.family_cache import LayerCache, layout
from batchsim.server.executors.family_stores import DecodeStep, StateStore, make_store
from batchsim.server.executors.pool_layout import PoolLayout, Resize
from batchsim.server.executors.row_pool import RowPool


class FamilyPool(RowPool):
    def __init__(self, layers: list[LayerCache]):
        super().__init__(PoolLayout(layout(layers)))
        self.layers = layers
        self.stores = [make_store(spec) for spec in layers]

    def arrays(self) -> list[mx.array]:
        return [a for s in self.stores for a in s.parts]

    def _write_row(self, row: int, layer_caches: list, length: int) -> None:
        for store, cache in zip(self.stores, layer_caches):
            store.join(row, cache, length)

    def states(self) -> list:
        return [list(s.parts) for s in self.stores if isinstance(s, StateStore)]

    def _restore_states(self, states: list) -> None:
        for store, parts in zip((s for s in self.stores if isinstance(s, StateStore)), states):
            store.parts = parts

    def _reallocate(self, change: Resize) -> None:
        for store in self.stores:
            store.resize(change.new.rows, change.new.capacity_tokens)

    # -- decode --------------------------------------------------------------------------------
    def layer_views(self) -> list:
        """Per-layer caches for one decode forward over rows [0, B); lengths advance by one."""
        step = DecodeStep(self.lengths, self.geometry.capacity_tokens)
        if step.width > self.geometry.capacity_tokens:
            raise RuntimeError(f"row of {step.width} tokens exceeds capacity {self.geometry}")
        views = [store.view(step) for store in self.stores]
        self.lengths = [n + 1 for n in self.lengths]
        return views
