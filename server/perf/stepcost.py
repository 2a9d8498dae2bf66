"""Seconds per forward pass of the real executor's work, from a model's shapes and a device profile.

With a calibrated profile each term is measured on the device: the linear layers from a fitted
GEMM model, attention per K/V byte (decode) or FLOP (prefill), elementwise ops per byte, and
fixed costs per layer and per forward pass. Without one (a Mac from the catalog) it falls back to
the roofline: bytes at the achievable bandwidth vs FLOPs at the achievable matmul rate."""

from __future__ import annotations

from functools import lru_cache

from batchsim.server.perf.costmodel import Calibration, DeviceProfile, compute_dtype
from batchsim.server.models.spec import ModelSpec, dtype_bytes


def weight_format(dtype: str, quantize_bits: int | None) -> str:
    return f"q{quantize_bits}" if quantize_bits else dtype


def weight_bytes_per_element(fmt: str) -> float:
    """Bytes per weight as stored (affine quantization adds fp16 scale and bias per 64 weights)."""
    if fmt.startswith("q"):
        return int(fmt[1:]) / 8 + 4 / 64
    return dtype_bytes(fmt)


class StepCost:
    def __init__(self, spec: ModelSpec, profile: DeviceProfile, dtype: str, quantize_bits: int | None):
        self.spec = spec
        self.profile = profile
        self.cal: Calibration | None = profile.calibration
        self.fmt = weight_format(dtype, quantize_bits)
        self.act_dtype = compute_dtype(dtype, quantize_bits)
        self.act_bytes = dtype_bytes(self.act_dtype)
        self.kv_bytes_per_token = spec.kv_bytes_per_token(self.act_dtype)
        self.gemm = None
        if self.cal is not None:
            if self.fmt not in self.cal.gemm:
                raise ValueError(f"profile {profile.name} has no GEMM calibration for {self.fmt}; "
                                 f"calibrated: {', '.join(self.cal.gemm)}")
            self.gemm = self.cal.gemm[self.fmt]
        self.layer_shapes = spec.layer_linear_shapes  # (out, in) per layer
        self._decode_cached = lru_cache(maxsize=None)(self._decode_parts)
        self._elementwise_s = lru_cache(maxsize=4096)(self._elementwise_s)  # per instance
        self.linear_layers_s = lru_cache(maxsize=4096)(self.linear_layers_s)  # per instance
        self._prefill_dense_s = lru_cache(maxsize=8192)(self._prefill_dense_s)

    # -- building blocks -----------------------------------------------------------------------
    def _linear_s(self, m: int, k: int, n: int) -> float:
        if self.gemm is not None:
            return self.gemm.seconds(m, k, n)
        p = self.profile
        moved = k * n * weight_bytes_per_element(self.fmt) + m * (k + n) * self.act_bytes
        return max(moved / p.bytes_per_s, 2 * m * k * n / p.flops_per_s(self.act_dtype))

    def linear_layers_s(self, m: int) -> float:
        """Every linear layer of one forward pass over m rows (lm head excluded)."""
        per_layer = sum(self._linear_s(m, i, o) for o, i in self.layer_shapes)
        return per_layer * self.spec.num_layers

    def lm_head_s(self, m: int) -> float:
        return self._linear_s(m, self.spec.hidden_size, self.spec.vocab_size)

    def elementwise_bytes(self, m: int, logits: bool) -> float:
        s = self.spec
        per_layer = 6 * s.hidden_size + 3 * s.intermediate_size + 2 * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        total = m * s.num_layers * per_layer * self.act_bytes
        return total + (m * s.vocab_size * 4 if logits else 0)

    def _elementwise_s(self, m: int, logits: bool) -> float:
        nbytes = self.elementwise_bytes(m, logits)
        if self.cal is not None:
            return nbytes * self.cal.elementwise_ns_per_byte * 1e-9
        return nbytes / self.profile.bytes_per_s

    def _fixed_s(self) -> float:
        if self.cal is not None:
            return (self.spec.num_layers * self.cal.layer_overhead_us + self.cal.forward_overhead_us) * 1e-6
        return self.profile.forward_overhead_s

    def decode_attention_bytes(self, batch: int, width: int) -> int:
        """K and V every layer's attention reads: all rows padded to the longest (width)."""
        return batch * width * self.kv_bytes_per_token

    def decode_attention_scores(self, batch: int, width: int) -> int:
        """Scores a decode step's attention computes: one per layer, row, query head and position."""
        s = self.spec
        return s.num_layers * batch * s.num_heads * width

    def prefill_attention_flops(self, n: int, start: int) -> int:
        s = self.spec
        return 4 * s.num_layers * s.num_heads * s.head_dim * n * (start + n)

    def prefill_score_bytes(self, n: int, start: int) -> int:
        """The attention scores a chunk writes and rereads (mask, softmax): heads x n x context."""
        s = self.spec
        return s.num_layers * s.num_heads * n * (start + n) * 4

    # -- a forward pass ------------------------------------------------------------------------
    def _decode_parts(self, batch: int) -> tuple[float, float]:
        """(seconds independent of width, seconds per token of width) for a decode forward."""
        base = (self.linear_layers_s(batch) + self.lm_head_s(batch)
                + self._elementwise_s(batch, logits=True) + self._fixed_s())
        per_width = self.decode_attention_bytes(batch, 1)
        if self.cal is not None:
            ns = (per_width * self.cal.attention_decode_ns_per_byte
                  + self.decode_attention_scores(batch, 1) * self.cal.attention_decode_ns_per_score)
            return base, ns * 1e-9
        return base, per_width / self.profile.bytes_per_s

    def decode_parts(self, batch: int) -> tuple[float, float]:
        """(seconds independent of the attention width, seconds per token of width)."""
        return self._decode_cached(batch)

    def decode_forward_s(self, batch: int, width: int) -> float:
        base, per_width = self._decode_cached(batch)
        return base + per_width * width

    def _prefill_dense_s(self, n: int, sample: bool) -> float:
        """The part of a prefill chunk that does not depend on its start (no attention)."""
        t = self.linear_layers_s(n) + self._elementwise_s(n, logits=False) + self._fixed_s()
        if sample:
            t += self.lm_head_s(1) + self._elementwise_s(1, logits=True) - self._elementwise_s(1, False)
        return t

    def prefill_forward_s(self, n: int, start: int, sample: bool) -> float:
        t = self._prefill_dense_s(n, sample)
        flops = self.prefill_attention_flops(n, start)
        if self.cal is not None:
            return t + (flops * self.cal.attention_prefill_ns_per_flop + self.prefill_score_bytes(
                n, start) * self.cal.attention_prefill_ns_per_score_byte) * 1e-9
        kv_read = (start + n) * self.kv_bytes_per_token
        return t + max(flops / self.profile.flops_per_s(self.act_dtype), kv_read / self.profile.bytes_per_s)

    def copy_s(self, nbytes: float) -> float:
        gbs = self.cal.copy_gbs if self.cal is not None else self.profile.bandwidth_gbs * self.profile.bandwidth_efficiency / 2
        return nbytes / (gbs * 1e9)

    @property
    def step_overhead_s(self) -> float:
        return self.cal.step_overhead_us * 1e-6 if self.cal is not None else 0.0
