"""What a request's prefill chunk and its admission may take, as pure functions: StepBudget (the
general path) and admit_plan.py (the plans made without one) both ask them, so both decide alike."""

from __future__ import annotations

from collections.abc import Callable

from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import KV_STEP, PoolGeometry, round_down


def chunk_fit(cache: CacheLayout, held_bytes: int, computed: int, gap: int, step_tokens: int,
              tokens_left: int, free_bytes: int, tighter: Callable[[int], PoolGeometry | None]
              ) -> tuple[int, PoolGeometry | None, int]:
    """The largest prefill chunk toward `gap` tokens after `computed` within `step_tokens` (the
    prefill step) and `tokens_left` whose cache growth fits: in `free_bytes`, else in a tighter
    pool (`tighter(need_bytes)`: the pool's spare rows and capacity dropped, None: none), else
    whole KV steps fewer; with that pool (None: the pool as it was) and that growth in bytes
    (what the request's private cache needs after the chunk, less the `held_bytes` it holds:
    negative where a sliding window's cache shrinks). (0, None, 0): none fits. Only a request's
    final chunk may end off a KV_STEP boundary (`computed` is unaligned after a prefix-cache
    hit)."""
    n = min(step_tokens, gap, tokens_left)
    if n != gap:
        n = round_down(computed + n, KV_STEP) - computed
    while n > 0:
        need = cache.private_bytes(computed, computed + n) - held_bytes
        if need <= free_bytes:
            return n, None, need
        geom = tighter(need)
        if geom is not None:
            return n, geom, need
        n = round_down(computed + n - 1, KV_STEP) - computed
    return 0, None, 0
