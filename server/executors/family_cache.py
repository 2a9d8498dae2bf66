"""What each layer of an mlx-lm model caches, learned by running one token through the model's own
`make_prompt_cache` (KVCache: full attention or MLA latent; RotatingKVCache: a sliding window;
ArraysCache: a linear-attention state), and the private caches a request prefills into.

The family pool (family_pool.py) holds every kind for decoding rows; this module says which kind
each layer is, with its shapes, and prices a row as the scheduler's CacheLayout does."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import mlx.core as mx
from batchsim.configs import ConfigError
from batchsim.scheduler.cache_layout import CacheLayout
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

KV_GROUP_SIZE = 64  # QuantizedKVCache's default group along head_dim


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache as the pool holds it. kv / sliding: K rows of heads x k_dim and V rows of
    heads x v_dim per token (MLA: heads 1, the latent and the RoPE key); state: fixed arrays."""

    kind: str  # "kv", "sliding" or "state"
    dtype: mx.Dtype
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: int = 0  # sliding: RotatingKVCache.max_size
    # state: (shape without the batch axis, dtype) per ArraysCache entry
    state_shapes: tuple[tuple[tuple[int, ...], mx.Dtype], ...] = ()
    kv_bits: int | None = None  # kv: K/V packed as QuantizedKVCache packs them

    @property
    def token_bytes(self) -> int:
        """kv / sliding: one token's K and V."""
        if self.kv_bits is None:
            return self.heads * (self.k_dim + self.v_dim) * self.dtype.size
        return self.heads * sum(quantized_dims(d, self.kv_bits)[0] * 4
                                + 2 * quantized_dims(d, self.kv_bits)[1] * self.dtype.size
                                for d in (self.k_dim, self.v_dim))

    @property
    def state_bytes(self) -> int:
        return sum(math.prod(shape) * dt.size for shape, dt in self.state_shapes)


def quantized_dims(dims: int, bits: int) -> tuple[int, int]:
    """(uint32 words, groups) per head row of `dims` elements at `bits`."""
    return dims * bits // 32, dims // KV_GROUP_SIZE


class ConcatRotatingKVCache(RotatingKVCache):
    """A sliding-window cache for prefill chunks of any length, one token included: the chunk is
    appended to what was held, trimmed to window - 1 first (RotatingKVCache's multi-token path),
    so its bytes are the scheduler's CacheLayout.private_bytes."""

    def update_and_fetch(self, keys, values):
        return self._update_concat(keys, values)


def probe(model, kv_bits: int | None = None) -> list[LayerCache]:
    """Each layer's cache kind and shapes, from one token through fresh mlx-lm caches."""
    caches = make_prompt_cache(model)
    for c in caches:
        if type(c) not in (KVCache, RotatingKVCache, ArraysCache):
            raise ConfigError(f"the mlx executor cannot batch a {type(c).__name__} layer cache "
                              "(it batches KVCache, RotatingKVCache and ArraysCache)")
        if isinstance(c, RotatingKVCache) and c.keep:
            raise ConfigError("the mlx executor cannot batch a RotatingKVCache with keep tokens")
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return [_describe(c, kv_bits) for c in caches]


def _describe(c, kv_bits: int | None) -> LayerCache:
    if isinstance(c, ArraysCache):
        shapes = tuple((tuple(a.shape[1:]), a.dtype) for a in c.cache)
        return LayerCache("state", c.cache[0].dtype, state_shapes=shapes)
    _, heads, _, k_dim = c.keys.shape
    v_dim = c.values.shape[-1]
    if isinstance(c, RotatingKVCache):
        if kv_bits is not None:
            raise ConfigError("kv_bits: mlx-lm cannot run a sliding layer on a quantized cache")
        return LayerCache("sliding", c.keys.dtype, heads, k_dim, v_dim, window=c.max_size)
    if kv_bits is not None and (k_dim != v_dim or k_dim % KV_GROUP_SIZE):
        raise ConfigError(f"kv_bits: the mlx executor quantizes K/V of equal widths, multiples of "
                          f"{KV_GROUP_SIZE} (this layer caches {k_dim} and {v_dim})")
    return LayerCache("kv", c.keys.dtype, heads, k_dim, v_dim, kv_bits=kv_bits)


def layout(layers: list[LayerCache]) -> CacheLayout:
    """The scheduler's pricing of what the pool and the private caches hold for these layers."""
    full = state = 0
    windows: dict[int, int] = {}
    for lay in layers:
        if lay.kind == "kv":
            full += lay.token_bytes
        elif lay.kind == "sliding":
            windows[lay.window] = windows.get(lay.window, 0) + lay.token_bytes
        else:
            state += lay.state_bytes
    return CacheLayout(full, tuple(sorted(windows.items())), state)


def new_private_cache(layers: list[LayerCache]) -> list:
    """Per layer, the cache one request prefills into before it joins the pool."""
    out: list = []
    for lay in layers:
        if lay.kind == "state":
            out.append(ArraysCache(len(lay.state_shapes)))
        elif lay.kind == "sliding":
            out.append(ConcatRotatingKVCache(max_size=lay.window))
        elif lay.kv_bits is not None:
            out.append(QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=lay.kv_bits))
        else:
            out.append(KVCache())
    return out


def is_plain_full_attention(model) -> bool:
    """Every layer a KVCache of standard attention (k_proj, n_kv_heads): the dense DecodePool's
    case. Anything else goes to the family pool."""
    attn = getattr(model.layers[0], "self_attn", None)
    return (all(type(c) is KVCache for c in make_prompt_cache(model))
            and hasattr(attn, "k_proj") and hasattr(attn, "n_kv_heads"))


def split_rows(caches: list, rows: int) -> list[list]:
    """Per row of a batch of `rows` prefilled together (prefill_groups.py), the layer caches
    holding that row alone: the same mlx-lm classes and bookkeeping, the row's own arrays."""
    return [[_row_of(c, i, rows) for c in caches] for i in range(rows)]


def _row_of(cache, i: int, rows: int):
    out = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(out, name, _take(value, i, rows))
    return out


def _take(value, i: int, rows: int):
    if isinstance(value, mx.array) and value.ndim and value.shape[0] == rows:
        return mx.contiguous(value[i : i + 1])
    if isinstance(value, (list, tuple)):
        return type(value)(_take(v, i, rows) for v in value)
    return value
