"""The padded layout's cached prefix blocks (PrefixBlocks) cost little beyond the bytes the cache
counts: each block is one MLX array, so its fixed cost (descriptor, Python object, malloc's
headers: ~600 bytes an array, which MLX's memory counts leave out) is paid once a block, not once
per layer's K and V (within BLOCK_BOOKKEEPING_BYTES with the scheduler's index, which the HTTP
soak counts); and a hit's prefill cache holds exactly the stored tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from batchsim.scheduler.plan import CacheOps
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import BLOCK_BOOKKEEPING_BYTES
from batchsim.server.executors.prefix_blocks import PrefixBlocks
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
# copies of 32 prompts of BLOCKS blocks each; in PrefixBlocks' one array a block, and in the
# 2 x layers arrays a block it had before 005d11d (SplitBlocks), in the same process.
_BLOCK_COST = """
import ctypes, json, sys
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
class SplitBlocks:
    def __init__(self):
        self.blocks = {{}}
    def store(self, ops, caches):
        a = lambda i: slice(i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS)
        for rid, i, h in ops.store:
            self.blocks[h] = [(mx.contiguous(c.keys[..., a(i), :]),
                               mx.contiguous(c.values[..., a(i), :])) for c in caches[rid]]
        mx.eval(list(self.blocks.values()))
costs = []
for make, first in ((PrefixBlocks, 0), (SplitBlocks, 100)):
    index, blocks = PrefixCache(LAYERS * 2 * HEADS * PAGE_TOKENS * DIM * 4), make()
    store(index, blocks, [first])  # MLX's buffer cache and the first arrays' allocations
    costs.append(store(index, blocks, range(first + 1, first + 33)))
print(json.dumps(costs))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_a_cached_block_costs_under_the_bookkeeping_bound_beside_its_bytes():
    script = _BLOCK_COST.format(shape=(LAYERS, HEADS, DIM, BLOCKS))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "PYTHONMALLOC": "malloc"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    one, split = json.loads(proc.stdout)
    # Measured 953 B against 3,095 B (CPython 3.11.7, glibc, MLX 0.32.4; r1 had 959-960 B alone):
    # one array a block saves the fixed cost of 2 x LAYERS - 1 arrays, whatever the versions.
    assert one < split / 2, proc.stdout
    # The soak's allowance: a 6% margin over what these versions measure (re-measure on others).
    assert one < BLOCK_BOOKKEEPING_BYTES, proc.stdout


def _layers(dtypes: list[tuple[mx.Dtype, mx.Dtype]], dim: int = DIM) -> list[KVCache]:
    caches = []
    for layer, (k_dtype, v_dtype) in enumerate(dtypes):
        c = KVCache()
        shape = (1, HEADS, PAGE_TOKENS, dim)
        c.keys = mx.random.normal(shape, key=mx.random.key(2 * layer)).astype(k_dtype)
        c.values = mx.random.normal(shape, key=mx.random.key(2 * layer + 1)).astype(v_dtype)
        c.offset = PAGE_TOKENS
        caches.append(c)
    return caches


def test_k_and_v_of_different_dtypes_come_back_exact_in_their_own():
    """r1 finding 6: before 005d11d each part was its own array, so mixed dtypes worked."""
    blocks = PrefixBlocks()
    dtypes = [(mx.float16, mx.bfloat16), (mx.float32, mx.float16)]
    caches = _layers(dtypes)
    blocks.store(CacheOps((), ((0, 0, 7),)), {0: caches})
    got = blocks.prefill_cache((7,))
    for c, want in zip(got, caches):
        for name in ("keys", "values"):
            a, b = getattr(c, name)[..., :c.offset, :], getattr(want, name)
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()


def test_a_block_of_another_layout_is_refused_not_mis_sliced():
    """r1 finding 6: one layout slices every block (prefill_cache)."""
    blocks = PrefixBlocks()
    blocks.store(CacheOps((), ((0, 0, 7),)), {0: _layers([(mx.float32, mx.float32)] * LAYERS)})
    wider = _layers([(mx.float32, mx.float32)] * LAYERS, dim=2 * DIM)
    with pytest.raises(RuntimeError, match="differ from the cached blocks"):
        blocks.store(CacheOps((), ((1, 0, 8),)), {1: wider})
    blocks.clear()  # no blocks: any layout again
    blocks.store(CacheOps((), ((1, 0, 8),)), {1: wider})
