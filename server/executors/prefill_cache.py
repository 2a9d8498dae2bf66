"""What each layer of an mlx-lm model caches, read from the model's own `make_prompt_cache` after
one token (KVCache: full attention or MLA latent; RotatingKVCache: a sliding window; ArraysCache:
a linear-attention state) as arch_cache.Attention, the description the spec prices; and the private
caches a request prefills into before it joins the decode pool (decode_pool.py)."""

from __future__ import annotations

import copy

import mlx.core as mx
from batchsim.configs import ConfigError
from batchsim.server.models.arch_cache import KV_GROUP_SIZE, Attention, check_kv_bits
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)


class ConcatRotatingKVCache(RotatingKVCache):
    """A sliding-window cache for prefill chunks of any length, one token included: the chunk is
    appended to what was held, trimmed to window - 1 first (RotatingKVCache's multi-token path),
    so its bytes are the scheduler's CacheLayout.private_bytes."""

    def update_and_fetch(self, keys, values):
        return self._update_concat(keys, values)


def activation_dtype(model) -> mx.Dtype:
    """The dtype a loaded mlx-lm model computes in: its embedding's (a quantized one's scales)."""
    emb = model.model.embed_tokens
    scales = getattr(emb, "scales", None)
    return scales.dtype if scales is not None else emb.weight.dtype


def layers_of(model, dtype: mx.Dtype, kv_bits: int | None = None) -> list[Attention]:
    """Each layer's cache as arch_cache describes it, from one token through fresh mlx-lm caches;
    a cache in another dtype than `dtype` (the activations'), or one kv_bits cannot quantize, is
    refused."""
    caches = make_prompt_cache(model)
    for c in caches:
        if type(c) not in (KVCache, RotatingKVCache, ArraysCache):
            raise ConfigError(f"the mlx executor cannot batch a {type(c).__name__} layer cache "
                              "(it batches KVCache, RotatingKVCache and ArraysCache)")
        if isinstance(c, RotatingKVCache) and c.keep:
            raise ConfigError("the mlx executor cannot batch a RotatingKVCache with keep tokens")
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    layers = [_describe(c, layer, dtype) for c, layer in zip(caches, model.layers)]
    if kv_bits is not None:
        check_kv_bits(layers, kv_bits)
    return layers


def _describe(c, layer, dtype: mx.Dtype) -> Attention:
    if isinstance(c, ArraysCache):
        conv, state = c.cache
        if (conv.dtype, state.dtype) != (dtype, mx.float32):
            raise ConfigError(f"the mlx executor holds a linear-attention cache as {dtype} and "
                              f"float32 states; this one holds {conv.dtype} and {state.dtype}")
        return Attention("linear", conv_shape=tuple(conv.shape[1:]),
                         state_shape=tuple(state.shape[1:]))
    if c.keys.dtype != dtype:
        raise ConfigError(f"the mlx executor holds K/V as {dtype}; this cache holds {c.keys.dtype}")
    _, heads, _, k_dim = c.keys.shape
    v_dim = c.values.shape[-1]
    if isinstance(c, RotatingKVCache):
        return Attention("sliding", heads, k_dim, v_dim, window=c.max_size)
    kind = "mla" if hasattr(getattr(layer, "self_attn", None), "kv_lora_rank") else "full"
    return Attention(kind, heads, k_dim, v_dim)


def new_private_cache(layers: list[Attention], kv_bits: int | None = None) -> list:
    """Per layer, the cache one request prefills into before it joins the pool."""
    out: list = []
    for att in layers:
        if att.kind == "linear":
            out.append(ArraysCache(2))  # the conv state and the recurrent state
        elif att.kind == "sliding":
            out.append(ConcatRotatingKVCache(max_size=att.window))
        elif kv_bits is not None:
            out.append(QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=kv_bits))
        else:
            out.append(KVCache())
    return out


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
