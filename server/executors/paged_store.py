"""The paged layout's K/V store: one full-attention or MLA layer's tokens in PAGE_TOKENS-token
blocks, (num_blocks, heads, PAGE_TOKENS, dim), shared by every row through its block table
(block_pool.BlockPool). MLX has no paged-attention kernel, so a decode step gathers each row's
blocks (mx.take) into (B, heads, width, dim) for the model's own attention, masked as the padded
pool is (kv_store.DecodeStep). The gathered copy is laid out as the padded pool's rows: MLX's
CPU attention reads it in about half the time it takes on a (num_blocks, PAGE_TOKENS, heads, dim)
layout's transposed view (benchmarks/paged_gather.py)."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.server.executors.kv_store import DecodeStep, KVView, _reshape
from batchsim.server.models.arch_cache import Attention


class PagedStep:
    """What every paged layer shares in one decode step."""

    def __init__(self, tables: mx.array, positions: list, write_blocks: list):
        """positions: each row's new token's position (B,), or its n tokens' (B, n) in a verify
        step; write_blocks: the blocks they go to, alike."""
        self.tables = tables  # (B, blocks of the longest row): each row's blocks, padded
        self.write_blocks = mx.array(write_blocks)  # (B,) or (B, n): the new tokens' blocks
        self.write_slots = mx.array(positions) % PAGE_TOKENS  # their slots there

    def gather(self, a: mx.array, width: int) -> mx.array:
        """Rows' tokens [0, width) as (B, heads, width, dim)."""
        b, n = self.tables.shape
        g = mx.take(a, self.tables, axis=0)  # (B, n, heads, PAGE_TOKENS, dim)
        g = g.transpose(0, 2, 1, 3, 4).reshape(b, a.shape[1], n * PAGE_TOKENS, a.shape[3])
        return g[:, :, :width]


class PagedKVStore:
    """K and V of one full-attention or MLA layer in blocks."""

    def __init__(self, spec: Attention, dtype: mx.Dtype, kv_bits: int | None = None):
        if kv_bits is not None:
            raise ValueError("the paged layout holds unquantized K/V only")
        self.spec, self.dtype = spec, dtype
        self.parts: list[mx.array] = []  # K then V, (num_blocks, heads, PAGE_TOKENS, dim)
        self.view_class = PagedKVView

    def resize(self, rows: int, capacity: int) -> None:
        """Rows and capacity do not size blocks (resize_blocks does)."""

    def resize_blocks(self, num_blocks: int, src: list[int], dst: list[int]) -> None:
        """Hold `num_blocks` blocks, after moving blocks `src` into `dst` (BlockPool.resize)."""
        if num_blocks == 0:
            self.parts = []
            return
        if not self.parts:
            s = self.spec
            self.parts = [mx.zeros((num_blocks, s.heads, PAGE_TOKENS, d), self.dtype)
                          for d in (s.k_dim, s.v_dim)]
            return
        if src:
            moved = [mx.take(a, mx.array(src), axis=0) for a in self.parts]
            mx.eval(moved)
            for a, m in zip(self.parts, moved):
                a[mx.array(dst)] = m
        self.parts = [_reshape(a, num_blocks, None) for a in self.parts]

    def join(self, table: list[int], cache, length: int, shared: int = 0) -> None:
        """Copy a prefilled private KVCache's `length` tokens into the row's blocks `table`, less
        its first `shared` blocks (cached blocks it references)."""
        n = len(table) - shared
        if n <= 0:
            return
        idx = mx.array(table[shared:])
        start = shared * PAGE_TOKENS
        for a, c in zip(self.parts, (cache.keys, cache.values)):
            src = c[0, :, start:length, :]  # (heads, tokens, dim)
            if start + n * PAGE_TOKENS > length:
                src = mx.pad(src, [(0, 0), (0, start + n * PAGE_TOKENS - length), (0, 0)])
            heads, _, dim = src.shape
            a[idx] = src.reshape(heads, n, PAGE_TOKENS, dim).transpose(1, 0, 2, 3)

    def write_blocks(self, blocks: list[int], sources: list[tuple]) -> None:
        """Copy token block i of each source (a prefill KVCache, i) into the matching block."""
        idx = mx.array(blocks)
        for a, part in zip(self.parts, ("keys", "values")):
            a[idx] = mx.stack([getattr(c, part)[0, :, i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS, :]
                               for c, i in sources])  # (n, heads, PAGE_TOKENS, dim)

    def read_blocks(self, blocks: list[int]) -> tuple[mx.array, mx.array]:
        """K and V of these blocks' tokens in order, as a KVCache holds them: (1, heads, n, dim)."""
        idx = mx.array(blocks)
        out = []
        for a in self.parts:
            g = mx.take(a, idx, axis=0)  # (n blocks, heads, PAGE_TOKENS, dim)
            out.append(g.transpose(1, 0, 2, 3).reshape(1, a.shape[1], -1, a.shape[3]))
        return out[0], out[1]


class PagedKVView(KVView):
    """mlx-lm's cache API over the rows' blocks for one decode step."""

    def __init__(self, store: PagedKVStore, step: DecodeStep):
        super().__init__(store, step)  # type: ignore[arg-type]
        self._paged: PagedStep = step.paged

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        st, pg = self._step, self._paged
        k, v = self._store.parts
        if st.n == 1:
            k[pg.write_blocks, :, pg.write_slots] = keys[:, :, 0, :]
            v[pg.write_blocks, :, pg.write_slots] = values[:, :, 0, :]
        else:  # (B, n) blocks and slots: the indexed axes first, as numpy orders them
            k[pg.write_blocks, :, pg.write_slots] = keys.transpose(0, 2, 1, 3)
            v[pg.write_blocks, :, pg.write_slots] = values.transpose(0, 2, 1, 3)
        return pg.gather(k, st.width), pg.gather(v, st.width)
