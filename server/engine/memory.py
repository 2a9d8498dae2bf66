"""What a real run holds beyond weights and KV, and the limits that keep it near the budget.

MLX memory = weights + KV (the scheduler holds it to the KV budget) + a step's transient arrays
(prefill activations) + MLX's buffer cache (freed buffers kept for reuse). The last two were
unbounded by the budget: the cache limit was a fixed 4 GiB (a server with a 50 MB budget grew to
3 GiB), and a long prefill chunk's activations were in no account. Here both get a bound:

    MLX memory <= weights + KV budget + PREFILL_TRANSIENT_BYTES + mlx_cache_limit_bytes(KV budget)

Only real executors are limited: a simulator has no activations and keeps its chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchsim.scheduler.pool_geometry import KV_STEP

# Transient memory one prefill chunk may use: the chunk is shortened until its estimate fits.
PREFILL_TRANSIENT_BYTES = 512 << 20
# MLX's buffer cache: a floor for reuse across steps (activations, sampled logits), an eighth of
# the KV budget for pool regrowth, and never more than the fixed 4 GiB it replaces.
MLX_CACHE_FLOOR_BYTES = 32 << 20
MLX_CACHE_MAX_BYTES = 4 << 30
# Live arrays of hidden-state width a layer holds at once (input, norm, q, k, v, attention out,
# residual, ...) and of MLP width (gate, up, their product): counted high on purpose.
HIDDEN_COPIES, MLP_COPIES = 8, 3
SCORE_COPIES = 3  # attention scores, their softmax and the mask, float32


def mlx_cache_limit_bytes(kv_budget_bytes: int) -> int:
    return min(MLX_CACHE_MAX_BYTES, MLX_CACHE_FLOOR_BYTES + max(kv_budget_bytes, 0) // 8)


def prefill_token_bytes(spec: Any, dtype_bytes: int, context_tokens: int, scores: bool) -> int:
    """Transient bytes per prefill token of one layer's forward pass (layers run one after another,
    so one layer's arrays are live at a time), attending to `context_tokens`. scores: attention
    materializes them (heads x context per token: MLX's CPU backend; Metal's fused kernel not)."""
    widths = HIDDEN_COPIES * spec.hidden_size + MLP_COPIES * spec.intermediate_size
    return dtype_bytes * widths + scores * 4 * SCORE_COPIES * spec.num_heads * context_tokens


def prefill_step_cap(spec: Any, dtype_bytes: int, prefill_step_size: int, scores: bool) -> int:
    """The largest prefill chunk (a multiple of KV_STEP, at least one) whose transient memory at
    the model's full context stays under PREFILL_TRANSIENT_BYTES; never above the configured one.
    (At the floor of one KV_STEP a long-context model on the CPU backend may still exceed it.)"""
    per_token = prefill_token_bytes(spec, dtype_bytes, spec.max_context, scores)
    fits = PREFILL_TRANSIENT_BYTES // per_token // KV_STEP * KV_STEP
    return max(KV_STEP, min(prefill_step_size, fits))


def _proc_status_bytes(key: str) -> int | None:
    """A memory line of /proc/self/status (Linux) in bytes, None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now."""
    return _proc_status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory so far."""
    return _proc_status_bytes("VmHWM")
