"""The padded layout's cached prefix blocks (PrefixBlocks) cost little beyond the bytes the cache
counts: each block is one MLX array, so its fixed cost (descriptor, Python object, malloc's
headers: ~600 bytes an array, which MLX's memory counts leave out) is paid once a block, not once
per layer's K and V (within BLOCK_BOOKKEEPING_BYTES with the scheduler's index, which the HTTP
soak counts); and a hit's prefill cache holds exactly the stored tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest
from batchsim.scheduler.plan import CacheOps
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.server.executors.prefix_blocks import BLOCK_BOOKKEEPING_BYTES, PrefixBlocks
from mlx_lm.models.cache import KVCache

LAYERS, HEADS, DIM = 2, 2, 16  # the tiny model's
BLOCKS = 64  # per prompt


def _prompt_caches(seed: int) -> list[KVCache]:
    caches = []
    for layer in range(LAYERS):
        c = KVCache()
        shape = (1, HEADS, BLOCKS * PAGE_TOKENS, DIM)
        c.keys = mx.random.normal(shape, key=mx.random.key(seed * 100 + 2 * layer))
        c.values = mx.random.normal(shape, key=mx.random.key(seed * 100 + 2 * layer + 1))
        c.offset = shape[2]
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def _store(blocks: PrefixBlocks, prompts: int) -> dict[int, list[KVCache]]:
    caches = {rid: _prompt_caches(rid) for rid in range(prompts)}
    ops = CacheOps((), tuple((rid, i, rid * BLOCKS + i) for rid in caches for i in range(BLOCKS)))
    blocks.store(ops, caches)
    return caches


def test_a_hit_prefill_cache_holds_the_stored_tokens_of_every_layer():
    blocks = PrefixBlocks()
    caches = _store(blocks, 2)
    hashes = (BLOCKS + 3, BLOCKS + 4, 5)  # two blocks of prompt 1, then one of prompt 0
    assert blocks.nbytes == 2 * BLOCKS * LAYERS * 2 * HEADS * PAGE_TOKENS * DIM * 4
    got = blocks.prefill_cache(hashes)
    for layer, c in enumerate(got):
        for name in ("keys", "values"):
            want = mx.concatenate([getattr(caches[h // BLOCKS][layer], name)[
                ..., h % BLOCKS * PAGE_TOKENS:(h % BLOCKS + 1) * PAGE_TOKENS, :] for h in hashes],
                axis=2)
            assert c.offset == 3 * PAGE_TOKENS
            assert mx.array_equal(getattr(c, name)[..., :c.offset, :], want).item()
    blocks.evict(CacheOps((5, BLOCKS + 3), ()))
    assert set(blocks.blocks) == set(range(2 * BLOCKS)) - {5, BLOCKS + 3}
    assert blocks.nbytes == (2 * BLOCKS - 2) * LAYERS * 2 * HEADS * PAGE_TOKENS * DIM * 4


# Every byte a cached block costs beside the KV bytes MLX counts, the Python objects included
# (PYTHONMALLOC=malloc: they come from malloc too): the scheduler's index, then the executor's
# copies of 32 prompts of BLOCKS blocks each.
_BLOCK_COST = """
import ctypes, sys
import mlx.core as mx
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import PrefixCache, token_block_hashes
from batchsim.server.executors.prefix_blocks import PrefixBlocks
from mlx_lm.models.cache import KVCache
LAYERS, HEADS, DIM, BLOCKS = {shape}
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
def prompt(rid):
    shape = (1, HEADS, BLOCKS * PAGE_TOKENS, DIM)
    caches = []
    for layer in range(LAYERS):
        c = KVCache()
        c.keys, c.values = mx.random.normal(shape), mx.random.normal(shape)
        c.offset = shape[2]
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches
def store(index, blocks, rids):
    caches = {{rid: prompt(rid) for rid in rids}}
    hashes = {{rid: token_block_hashes([rid] * BLOCKS * PAGE_TOKENS) for rid in rids}}
    mx.clear_cache()
    used, active, n = in_use(), mx.get_active_memory(), len(index.blocks)
    for rid in rids:
        index.store(rid, 0, hashes[rid], 1 << 40)
    blocks.store(index.take_ops(), caches)
    mx.clear_cache()
    n = len(index.blocks) - n
    counted = mx.get_active_memory() - active
    assert counted == n * index.block_bytes, counted
    return (in_use() - used - counted) / n
index, blocks = PrefixCache(LAYERS * 2 * HEADS * PAGE_TOKENS * DIM * 4), PrefixBlocks()
store(index, blocks, [0])  # MLX's buffer cache and the first arrays' allocations
print(store(index, blocks, range(1, 33)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_a_cached_block_costs_under_the_bookkeeping_bound_beside_its_bytes():
    script = _BLOCK_COST.format(shape=(LAYERS, HEADS, DIM, BLOCKS))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "PYTHONMALLOC": "malloc"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Measured ~0.96 KiB; 2 x LAYERS arrays a block cost ~3.2 KiB beside each 8 KiB block.
    assert float(proc.stdout) < BLOCK_BOOKKEEPING_BYTES, proc.stdout
