"""Roofline cost of decode and prefill work on a device profile. Pure Python: `size` uses it to
predict Macs batchsim does not run on, and the simulated executor to time step plans.

A step's time is the larger of moving its bytes (weights read once per forward pass, KV read by
attention, KV written) at the achievable bandwidth and doing its FLOPs at the achievable matmul
rate, plus a fixed per-forward overhead."""

from __future__ import annotations

import dataclasses

from server.modelspec import ModelSpec


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    # Peak unified-memory (or DRAM) bandwidth, GB/s (1e9 bytes).
    bandwidth_gbs: float
    # Peak matmul rate per dtype, TFLOP/s.
    peak_tflops: dict[str, float]
    # Fraction of peak bandwidth decode reaches (streaming weights, GEMV-shaped work).
    bandwidth_efficiency: float = 0.7
    # Fraction of peak matmul rate large GEMMs reach.
    compute_efficiency: float = 0.6
    # Fixed cost per forward pass (kernel launches, Python, graph building), seconds.
    forward_overhead_s: float = 0.0
    source: str = ""

    def tflops(self, dtype: str) -> float:
        try:
            return self.peak_tflops[dtype]
        except KeyError:
            raise ValueError(f"profile {self.name} has no peak for {dtype}") from None

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.bandwidth_efficiency

    def flops_per_s(self, dtype: str) -> float:
        return self.tflops(dtype) * 1e12 * self.compute_efficiency


def compute_dtype(dtype: str, quantize_bits: int | None) -> str:
    """Quantized weights are multiplied in their scales' dtype (float16 by default)."""
    return "float16" if quantize_bits else dtype


def decode_step_s(
    spec: ModelSpec,
    profile: DeviceProfile,
    dtype: str,
    quantize_bits: int | None,
    batch: int,
    kv_read_tokens: int,
) -> float:
    """One decode forward over `batch` sequences whose attention reads `kv_read_tokens` cached
    tokens in all (padded: batch x longest row)."""
    if batch <= 0:
        return 0.0
    kv_tok = spec.kv_bytes_per_token(compute_dtype(dtype, quantize_bits))
    moved = spec.weight_bytes(dtype, quantize_bits) + kv_read_tokens * kv_tok + batch * kv_tok
    dense = 2 * batch * (spec.num_matmul_params_per_layer * spec.num_layers + spec.num_lm_head_params)
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * kv_read_tokens
    cdt = compute_dtype(dtype, quantize_bits)
    return max(moved / profile.bytes_per_s, (dense + attention) / profile.flops_per_s(cdt)) + (
        profile.forward_overhead_s
    )


def decode_tok_s(
    spec: ModelSpec, profile: DeviceProfile, dtype: str, quantize_bits: int | None, batch: int,
    context_len: int,
) -> float:
    """Steady decode throughput of `batch` sequences at `context_len` tokens each."""
    step = decode_step_s(spec, profile, dtype, quantize_bits, batch, batch * context_len)
    return batch / step if step > 0 else 0.0
