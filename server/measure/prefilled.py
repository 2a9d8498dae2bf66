"""Requests whose prompts already sit in private caches (random K/V, by layer kind), so that
calibration times decode steps without paying for their prefills."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from batchsim.scheduler.pool_geometry import KV_STEP, round_up
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors import prefill_cache
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.server.models.spec import ModelSpec


def prefilled(model, ex: MLXExecutor, spec: ModelSpec, batch: int, width: int) -> None:
    """Requests whose prompts are already in private caches (random K/V): decode timing without
    paying for the prefills."""
    if ex.kv_bits is not None:
        raise ValueError("calibration times unquantized caches (kv_bits is not calibrated)")
    rng = np.random.default_rng(width)
    for rid in range(batch):
        cache = _private_cache(ex, width)
        mx.eval([c.state for c in cache])
        ids = rng.integers(0, spec.vocab_size, width).tolist()
        ex.adopt_prefilled(rid, ids, SamplingParams(1 << 20, ignore_eos=True), cache)


def _private_cache(ex: MLXExecutor, width: int) -> list:
    """A request's private caches after a `width`-token prompt, by layer kind: full and MLA layers
    every token, sliding layers their window's last tokens, linear layers their state."""
    cache = prefill_cache.new_private_cache(ex.layers)
    for c, att in zip(cache, ex.layers):
        if att.kind == "linear":
            c[0] = mx.random.normal((1, *att.conv_shape)).astype(ex.dtype)
            c[1] = mx.random.normal((1, *att.state_shape)).astype(mx.float32)
            continue
        held = min(width, att.window) if att.kind == "sliding" else round_up(width, KV_STEP)
        c.keys, c.values = (mx.random.normal((1, att.heads, held, d)).astype(ex.dtype)
                            for d in (att.k_dim, att.v_dim))
        c.offset = width
        if att.kind == "sliding":
            c._idx = held  # RotatingKVCache's write position: just past what it holds
    return cache
