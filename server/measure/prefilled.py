"""Requests whose prompts already sit in private caches (random K/V, by layer kind), so that
calibration times decode steps without paying for their prefills."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from batchsim.scheduler.kv_layout import KV_STEP, round_up
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors import family_cache
from batchsim.server.executors.mlx_executor import MLXExecutor, SeqState
from batchsim.server.models.spec import ModelSpec
from mlx_lm.models.cache import ArraysCache, make_prompt_cache


def prefilled(model, ex: MLXExecutor, spec: ModelSpec, batch: int, width: int) -> None:
    """Requests whose prompts are already in private caches (random K/V): decode timing without
    paying for the prefills."""
    rng = np.random.default_rng(width)
    for rid in range(batch):
        cache = _dense_cache(model, ex, width) if ex.family is None else _family_cache(ex, width)
        mx.eval([c.state for c in cache])
        ids = rng.integers(0, spec.vocab_size, width).tolist()
        ex.seqs[rid] = SeqState(ids, SamplingParams(1 << 20, ignore_eos=True), cache)


def _dense_cache(model, ex: MLXExecutor, width: int) -> list:
    cache = make_prompt_cache(model)
    for c in cache:
        shape = (1, ex.kv_heads, round_up(width, KV_STEP), ex.head_dim)
        c.keys = mx.random.normal(shape).astype(ex.dtype)
        c.values = mx.random.normal(shape).astype(ex.dtype)
        c.offset = width
    return cache


def _family_cache(ex: MLXExecutor, width: int) -> list:
    """A family model's private caches after a `width`-token prompt, by layer kind: full and MLA
    layers every token, sliding layers their window's last tokens, linear layers their state."""
    cache = family_cache.new_private_cache(ex.family)
    for c, lay in zip(cache, ex.family):
        if lay.kv_bits is not None:
            raise ValueError("calibration times unquantized caches (kv_bits is not calibrated)")
        if isinstance(c, ArraysCache):
            for i, (shape, dt) in enumerate(lay.state_shapes):
                c[i] = mx.random.normal((1, *shape)).astype(dt)
            continue
        held = round_up(width, KV_STEP) if lay.kind == "kv" else min(width, lay.window)
        c.keys, c.values = (mx.random.normal((1, lay.heads, held, d)).astype(lay.dtype)
                            for d in (lay.k_dim, lay.v_dim))
        c.offset = width
        if lay.kind == "sliding":
            c._idx = held  # RotatingKVCache's write position: just past what it holds
    return cache
