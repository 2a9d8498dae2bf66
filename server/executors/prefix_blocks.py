"""The MLX executor's prefix cache (scheduler/prefix_cache.py). A request admitted with a cached
prefix starts from a prefill cache holding copies of those blocks, so it prefills only the rest.
Full-attention and MLA layers only (the scheduler reuses nothing else).
- PrefixBlocks (padded layout): per cached block, every layer's K and V of its PAGE_TOKENS
  tokens, copied out of the prefill cache that computed them, beside the pool.
- PoolPrefixBlocks (paged layout): cached blocks are the decode pool's own blocks: copies of the
  blocks each prefill chunk completes, or a joining row's prompt blocks (adopted, no copy); a row
  joining references the cached blocks its request holds (no copy)."""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
from batchsim.scheduler.plan import CacheOps
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS, round_up
from batchsim.server.executors.decode_pool import DecodePool
from mlx_lm.models.cache import KVCache


class AlignedKVCache(KVCache):
    """A KVCache that holds round_up(tokens, KV_STEP) whatever its first chunk's start (mlx-lm's
    grows by whole steps from an unaligned offset): the scheduler's price for a prefill cache."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        end = prev + keys.shape[2]
        if end > self.keys.shape[2]:
            grow = round_up(end, KV_STEP) - prev
            self.keys = _grown(self.keys[..., :prev, :], grow)
            self.values = _grown(self.values[..., :prev, :], grow)
        self.offset = end
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]


def _grown(a: mx.array, tokens: int) -> mx.array:
    b, h, _, d = a.shape
    return mx.concatenate([a, mx.zeros((b, h, tokens, d), a.dtype)], axis=2)


class PrefixBlocks:
    """Each cached block is one flat MLX array of every layer's K and V (`layout`: their shapes
    and dtypes, the same for every block, checked; K and V of different float dtypes are held in
    the one that holds each exactly, as concatenate promotes: f16 and bf16 in f32, cast back on
    read): an array costs ~600 bytes beside its data, so 2 x layers arrays a block (3.2 KiB beside
    each of the tiny model's 8 KiB blocks) grew RSS past the cache's bytes."""

    def __init__(self) -> None:
        self.blocks: dict[int, mx.array] = {}  # hash -> the block, flat
        self.layout: list[tuple[tuple[int, ...], mx.Dtype]] = []  # K, V of layer 0, 1 ...
        self.spans: list[slice] = []  # where each of them lies in a flat block (with the layout)
        self.nbytes = 0

    def evict(self, ops: CacheOps | None) -> None:
        if ops is not None:
            for h in ops.evict:
                self.nbytes -= self.blocks.pop(h).nbytes

    def store(self, ops: CacheOps | None, caches: dict[int, list]) -> None:
        """Copy each stored block out of its request's prefill cache (request id -> layers)."""
        if ops is None or not ops.store:
            return
        new = []
        for rid, i, h in ops.store:
            a, b = i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS
            parts = [x[..., a:b, :] for c in caches[rid] for x in (c.keys, c.values)]
            self._check_layout([(x.shape, x.dtype) for x in parts])
            block = self.blocks[h] = mx.concatenate([x.reshape(-1) for x in parts])
            self.nbytes += block.nbytes
            new.append(block)
        mx.eval(new)

    def prefill_cache(self, hashes: tuple[int, ...]) -> list[AlignedKVCache]:
        """Per layer, a prefill cache holding these blocks' tokens, in round_up(tokens, KV_STEP)."""
        blocks = [self.blocks[h] for h in hashes]
        parts = [mx.concatenate([b[span].reshape(shape) for b in blocks], axis=2).astype(dtype)
                 for (shape, dtype), span in zip(self.layout, self.spans)]
        return _prefill_caches(list(zip(parts[::2], parts[1::2])))

    def _check_layout(self, layout: list[tuple[tuple[int, ...], mx.Dtype]]) -> None:
        """One layout for every block: prefill_cache slices each block by it."""
        if not self.layout:
            sizes = [math.prod(shape) for shape, _ in layout]
            ends = list(itertools.accumulate(sizes))
            self.layout, self.spans = layout, [slice(e - n, e) for n, e in zip(sizes, ends)]
        elif layout != self.layout:
            raise RuntimeError(f"a prefix block's K/V shapes or dtypes {layout} differ from the "
                               f"cached blocks' {self.layout}")

    def shared_blocks(self, hashes: tuple[int, ...]) -> list[int]:
        """Pool blocks a row joining with this hit references: none (the padded layout copies)."""
        return []

    def clear(self) -> None:
        self.blocks.clear()
        self.layout, self.spans = [], []
        self.nbytes = 0


def _prefill_caches(layers: list[tuple[mx.array, mx.array]]) -> list[AlignedKVCache]:
    """Per layer (K, V) of (1, heads, tokens, dim): prefill caches of round_up(tokens, KV_STEP)."""
    out = []
    for keys, values in layers:
        tokens = keys.shape[2]
        pad = round_up(tokens, KV_STEP) - tokens
        c = AlignedKVCache()
        c.keys, c.values, c.offset = _grown(keys, pad), _grown(values, pad), tokens
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


class PoolPrefixBlocks:
    """The paged layout's prefix cache: blocks of the decode pool (BlockPool.cached), one
    reference each, shared by the rows that reference them."""

    nbytes = 0  # the blocks are counted in the pool's arrays

    def __init__(self, pool: DecodePool):
        self.pool = pool

    def evict(self, ops: CacheOps | None) -> None:
        if ops is not None:
            for h in ops.evict:
                self.pool.blocks.uncache(h)

    def store(self, ops: CacheOps | None, caches: dict[int, list | None]) -> None:
        """Cache each stored block: block i of its request's row if it joined this step (no
        copy), else a copy out of its prefill cache (`caches`: request id -> layers, None once
        joined) into a free block, as the chunk that completed it ran."""
        if ops is None or not ops.store:
            return
        blocks, rows = self.pool.blocks, self.pool.row_ids
        copies = []
        for rid, i, h in ops.store:
            cache = caches[rid]
            if cache is None:
                blocks.cache(h, blocks.tables[rows.index(rid)][i])
            else:
                copies.append((blocks.cache_new(h), cache, i))
        if copies:
            self._check_every_layer_paged()
            for layer, s in enumerate(self.pool.paged):
                s.write_blocks([b for b, _, _ in copies], [(c[layer], i) for _, c, i in copies])

    def shared_blocks(self, hashes: tuple[int, ...]) -> list[int]:
        """The pool blocks a row joining with this hit references."""
        cached = self.pool.blocks.cached
        return [cached[h] for h in hashes]

    def prefill_cache(self, hashes: tuple[int, ...]) -> list[AlignedKVCache]:
        """Per layer, a prefill cache holding copies of these blocks' tokens."""
        blocks = self.shared_blocks(hashes)
        self._check_every_layer_paged()
        return _prefill_caches([s.read_blocks(blocks) for s in self.pool.paged])

    def _check_every_layer_paged(self) -> None:
        if len(self.pool.paged) != len(self.pool.stores):
            raise RuntimeError("a paged prefix cache needs every layer in blocks")

    def clear(self) -> None:
        """The pool's blocks go with the pool (the executor makes a new one)."""
