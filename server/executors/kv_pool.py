"""The decode pool: per layer one K and one V array of shape (rows, kv_heads, capacity, head_dim)
holding every decoding request, left-aligned (row i's tokens at positions [0, len_i)).

Joins copy one request's prefilled cache into a spare row; leaves move the last row into the hole;
neither copies the whole pool (mlx-lm's BatchKVCache.extend/filter do). Only a geometry change
(decided by the scheduler, see scheduler.kv_layout) reallocates. Which row moves where is decided
by pool_layout, which the simulator prices; this module applies it to the arrays.

`layer_views()` hands the model one cache object per layer with mlx-lm's cache API (`offset`,
`update_and_fetch`, `make_mask`, `state`, `nbytes`), so the model's own attention runs unchanged:
the new token's K/V are scattered into each row at its own position and attention reads
rows [0, B) up to the longest row, with a mask for the shorter ones. When every row holds the same
number of tokens (always at batch 1), the step writes one column with a slice update and needs no
mask, as mlx-lm's own KVCache does: the same values, without the scatter and the masking.
"""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.kv_layout import PoolGeometry
from batchsim.server.executors.pool_layout import PoolLayout, Resize
from batchsim.server.executors.row_pool import RowPool
from mlx_lm.models.cache import _BaseCache


class PoolLayerView(_BaseCache):
    """One layer of the pool, as the model's attention sees it during one decode forward pass."""

    def __init__(self, pool: DecodePool, layer: int, positions: mx.array | int,
                 mask: mx.array | None, width: int):
        self._pool = pool
        self._layer = layer
        # (B,) per-row RoPE positions; one int when every row is at the same position (no mask)
        self.offset = positions
        self._mask = mask
        self._width = width

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, layer, width = self._pool, self._layer, self._width
        b = keys.shape[0]
        k, v = pool.keys[layer], pool.values[layer]
        if self._mask is None:  # aligned rows: one column, as mlx-lm's KVCache writes it
            k[:b, :, width - 1 : width] = keys
            v[:b, :, width - 1 : width] = values
        else:
            rows = pool.row_index(b)
            k[rows, :, self.offset] = keys[:, :, 0, :]
            v[rows, :, self.offset] = values[:, :, 0, :]
        return k[:b, :, :width], v[:b, :, :width]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != 1 or window_size is not None:
            raise NotImplementedError("the decode pool serves one-token decode steps")
        return self._mask

    @property
    def state(self):
        return self._pool.keys[self._layer], self._pool.values[self._layer]

    @property
    def nbytes(self) -> int:
        return self._pool.keys[self._layer].nbytes + self._pool.values[self._layer].nbytes


class DecodePool(RowPool):
    """The layout (pool_layout.PoolLayout) decides which row moves where; this applies it."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype):
        super().__init__(PoolLayout(2 * num_layers * kv_heads * head_dim * dtype.size))
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self._arange_cache: dict[int, mx.array] = {}

    def row_index(self, b: int) -> mx.array:
        idx = self._arange_cache.get(b)
        if idx is None:
            idx = self._arange_cache[b] = mx.arange(b)
        return idx

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def _write_row(self, row: int, layer_caches: list, length: int) -> None:
        """`layer_caches`: mlx-lm KVCache, one per layer."""
        for layer, cache in enumerate(layer_caches):
            self.keys[layer][row : row + 1, :, :length] = cache.keys[..., :length, :]
            self.values[layer][row : row + 1, :, :length] = cache.values[..., :length, :]

    def _reallocate(self, change: Resize) -> None:
        geometry = change.new
        if geometry.rows == 0:
            self.keys, self.values = [], []
        elif change.old.rows == 0:
            shape = (geometry.rows, self.kv_heads, geometry.capacity_tokens, self.head_dim)
            self.keys = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
            self.values = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        else:
            self.keys = [self._reshape(a, geometry) for a in self.keys]
            self.values = [self._reshape(a, geometry) for a in self.values]

    def _reshape(self, a: mx.array, g: PoolGeometry) -> mx.array:
        rows, cap = min(a.shape[0], g.rows), min(a.shape[2], g.capacity_tokens)
        a = a[:rows, :, :cap]
        pad = [(0, g.rows - rows), (0, 0), (0, g.capacity_tokens - cap), (0, 0)]
        return mx.pad(a, pad) if any(p[1] for p in pad) else mx.contiguous(a)

    # -- decode --------------------------------------------------------------------------------
    def layer_views(self) -> list[PoolLayerView]:
        """Per-layer caches for one decode forward over rows [0, B); lengths advance by one."""
        lengths = self.lengths
        width = max(lengths) + 1
        if width > self.geometry.capacity_tokens:
            raise RuntimeError(f"row of {width} tokens exceeds capacity {self.geometry}")
        if min(lengths) == width - 1:  # every row at one position: nothing to mask
            positions, mask = width - 1, None
        else:
            positions = mx.array(lengths)
            mask = (mx.arange(width)[None] <= positions[:, None])[:, None, None, :]
        views = [PoolLayerView(self, layer, positions, mask, width) for layer in range(self.num_layers)]
        self.lengths = [n + 1 for n in self.lengths]
        return views
