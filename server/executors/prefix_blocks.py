"""The MLX executor's prefix cache: per cached block (scheduler/prefix_cache.py), every layer's K
and V of its PAGE_TOKENS tokens, copied out of the prefill cache that computed them. A request
admitted with a cached prefix starts from a prefill cache holding copies of those blocks, so it
prefills only the rest. Full-attention and MLA layers only (the scheduler reuses nothing else)."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.plan import CacheOps
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS, round_up
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
    def __init__(self) -> None:
        self.blocks: dict[int, list[tuple[mx.array, mx.array]]] = {}  # hash -> per layer (K, V)
        self.nbytes = 0

    def evict(self, ops: CacheOps | None) -> None:
        if ops is not None:
            for h in ops.evict:
                self.nbytes -= sum(k.nbytes + v.nbytes for k, v in self.blocks.pop(h))

    def store(self, ops: CacheOps | None, caches: dict[int, list]) -> None:
        """Copy each stored block out of its request's prefill cache (request id -> layers)."""
        if ops is None or not ops.store:
            return
        new = []
        for rid, i, h in ops.store:
            a, b = i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS
            layers = [(mx.contiguous(c.keys[..., a:b, :]), mx.contiguous(c.values[..., a:b, :]))
                      for c in caches[rid]]
            self.blocks[h] = layers
            self.nbytes += sum(k.nbytes + v.nbytes for k, v in layers)
            new.append(layers)
        mx.eval(new)

    def prefill_cache(self, hashes: tuple[int, ...]) -> list[AlignedKVCache]:
        """Per layer, a prefill cache holding these blocks' tokens, in round_up(tokens, KV_STEP)."""
        tokens = len(hashes) * PAGE_TOKENS
        pad = round_up(tokens, KV_STEP) - tokens
        out = []
        for layer in range(len(self.blocks[hashes[0]])):
            c = AlignedKVCache()
            c.keys = _grown(mx.concatenate([self.blocks[h][layer][0] for h in hashes], axis=2), pad)
            c.values = _grown(mx.concatenate([self.blocks[h][layer][1] for h in hashes], axis=2),
                              pad)
            c.offset = tokens
            out.append(c)
        mx.eval([(c.keys, c.values) for c in out])
        return out

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0
