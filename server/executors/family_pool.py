"""The decode pool for models whose layers cache different things (sliding windows, linear-attention
states, MLA latents, quantized K/V): one store per layer (family_stores), the same row bookkeeping
as the dense pool (pool_layout.PoolLayout: joins take the next row, leaves move the last rows into
the holes, only a geometry change reallocates), and the same interface as kv_pool.DecodePool, so
the MLX executor runs one forward pass per decode step whatever the family.

A row of capacity C holds C tokens of each full/MLA layer, min(C, W) of each sliding layer and the
fixed state of each linear layer: exactly CacheLayout.seq_bytes(C), the scheduler's price."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.kv_layout import PoolGeometry
from batchsim.server.executors.family_cache import LayerCache, layout
from batchsim.server.executors.family_stores import DecodeStep, make_store
from batchsim.server.executors.pool_layout import PoolLayout


class FamilyPool:
    def __init__(self, layers: list[LayerCache]):
        self.layers = layers
        self.stores = [make_store(spec) for spec in layers]
        self.layout = PoolLayout(layout(layers))
        self.lengths: list[int] = []  # tokens cached per row, aligned with layout.row_ids

    def __len__(self) -> int:
        return len(self.layout.row_ids)

    @property
    def row_ids(self) -> list[int]:
        return self.layout.row_ids

    @property
    def geometry(self) -> PoolGeometry:
        return self.layout.geometry

    def arrays(self) -> list[mx.array]:
        return [a for s in self.stores for a in s.parts]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    # -- membership ----------------------------------------------------------------------------
    def remove(self, request_ids: set[int]) -> None:
        """Drop rows; fill holes below the new row count with the surviving rows above it."""
        moves = self.layout.leave(request_ids)
        if moves.holes:
            src, dst = mx.array(moves.movers), mx.array(moves.holes)
            arrays = self.arrays()
            moved = [a[src] for a in arrays]
            mx.eval(moved)  # detach from the pool arrays so the scatter below updates them in place
            for a, m in zip(arrays, moved):
                a[dst] = m
            for h, m in zip(moves.holes, moves.movers):
                self.lengths[h] = self.lengths[m]
        del self.lengths[len(self.layout.row_ids):]

    def add(self, request_id: int, layer_caches: list | None, length: int) -> None:
        """Copy a prefilled request (its private caches, one per layer) into the next row."""
        row = self.layout.join(request_id, length)
        if layer_caches is not None and length:
            for store, cache in zip(self.stores, layer_caches):
                store.join(row, cache, length)
        self.lengths.append(length)

    # -- geometry ------------------------------------------------------------------------------
    def resize(self, geometry: PoolGeometry) -> None:
        """Reallocate to the scheduler's geometry, keeping rows [0, B) and their tokens."""
        if geometry == self.layout.geometry:
            return
        if self.lengths and geometry.capacity_tokens < max(self.lengths):
            raise RuntimeError(f"geometry {geometry} cannot hold the pool's rows")
        self.layout.resize(geometry)
        for store in self.stores:
            store.resize(geometry.rows, geometry.capacity_tokens)
        mx.eval(self.arrays())

    # -- decode --------------------------------------------------------------------------------
    def layer_views(self) -> list:
        """Per-layer caches for one decode forward over rows [0, B); lengths advance by one."""
        step = DecodeStep(self.lengths, self.geometry.capacity_tokens)
        if step.width > self.geometry.capacity_tokens:
            raise RuntimeError(f"row of {step.width} tokens exceeds capacity {self.geometry}")
        views = [store.view(step) for store in self.stores]
        self.lengths = [n + 1 for n in self.lengths]
        return views
