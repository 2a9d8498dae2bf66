"""A weight format's bytes and measured ceilings, as the step cost prices them: the format's name
(q<bits> or the dtype), the bytes of one stored matrix, and the profile's quantized GEMV/GEMM
rates. StepCost (stepcost.py) prices its linear layers with them."""

from __future__ import annotations

from batchsim.server.models.arch import QUANT_GROUP_SIZE, quantized_matrix_bytes
from batchsim.server.models.spec import dtype_bytes
from batchsim.server.perf.profile import DeviceProfile


def weight_format(dtype: str, quantize_bits: int | None) -> str:
    return f"q{quantize_bits}" if quantize_bits else dtype


def matrix_weight_bytes(fmt: str, k: int, n: int) -> int:
    """Bytes of one (k -> n) weight matrix as stored: ModelSpec.weight_bytes's own formula (a
    quantized matrix's fp16 scales and biases per 64 inputs; an input dim 64 does not divide stays
    float16)."""
    if fmt.startswith("q"):
        return quantized_matrix_bytes(n, k, int(fmt[1:]))
    return k * n * dtype_bytes(fmt)


def weight_bytes_per_element(fmt: str) -> float:
    """Bytes per weight of a matrix whose input dim the quantization group divides."""
    return matrix_weight_bytes(fmt, QUANT_GROUP_SIZE, 1) / QUANT_GROUP_SIZE


def quantized_ceilings(profile: DeviceProfile,
                       quantize_bits: int | None) -> tuple[float | None, float | None]:
    """(bytes/s of a quantized GEMV, FLOP/s of a quantized GEMM) the profile has for this weight
    format (measured rates: no efficiency applied); None where it has none."""
    gemv = profile.quantized_gemv_gbs.get(quantize_bits) if quantize_bits else None
    gemm = profile.quantized_gemm_gflops.get(quantize_bits) if quantize_bits else None
    return (gemv * 1e9 if gemv else None), (gemm * 1e9 if gemm else None)
