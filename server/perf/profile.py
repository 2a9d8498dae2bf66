"""What the cost model knows of a device: a roofline (peak bandwidth and matmul rate, the fractions
of them decode reaches) and, for a calibrated device, the terms `batchsim calibrate` measured.
The formulas that turn these into seconds live in server.perf.stepcost. Pure Python."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping

from batchsim.server.perf.qmv import mlx_release

# Assumed, not measured (no Metal here): mlx-lm's quantized attention dequantizes each K/V element
# it reads inside quantized_matmul (unpack: shift and mask; scale multiply; bias add).
KV_DEQUANT_OPS_PER_ELEMENT = 4

@dataclasses.dataclass(frozen=True)
class GemmFit:
    """Time of one linear layer (m x k) @ (k x n) on a device, fitted by `batchsim calibrate`:
    t = weight_ns(k*n) * k*n  +  flop_ns(m) * 2*m*k*n.
    The first term streams (and, on CPU BLAS, packs) the weights once per call, per weight
    element; small matrices pay more per element (call overhead), so it depends on the matrix
    size. The second is the arithmetic, whose cost per FLOP falls as more rows share the weights.
    Both tables are interpolated in log space and clamped at their ends."""

    weight_ns: dict[int, float]  # weights in the matrix (k*n) -> ns per weight element
    flop_ns: dict[int, float]  # rows m -> ns per FLOP

    def terms_ns(self, m: int, k: int, n: int) -> tuple[float, float]:
        """(ns streaming the weights, ns of arithmetic) of one call."""
        kn = k * n
        return log_interp(self.weight_ns, kn) * kn, log_interp(self.flop_ns, m) * 2 * m * kn

    def seconds(self, m: int, k: int, n: int) -> float:
        weights_ns, flops_ns = self.terms_ns(m, k, n)
        return (weights_ns + flops_ns) * 1e-9


def log_interp(table: Mapping[int, float] | Iterable[tuple[int, float]], x: float) -> float:
    """A table's value at x: linear in log(x) between its points, held past its ends."""
    pts = sorted(table.items() if isinstance(table, Mapping) else table)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, v0), (x1, v1) in itertools.pairwise(pts):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return v0 + w * (v1 - v0)
    return pts[-1][1]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `batchsim calibrate` measured on one device, beyond the roofline ceilings."""

    gemm: dict[str, GemmFit]  # by weight format: float32, float16, bfloat16, q4, q8
    attention_decode_ns_per_byte: float  # per K/V byte a decode step's attention reads
    attention_prefill_ns_per_flop: float  # per score/value FLOP of a prefill chunk's attention
    attention_prefill_ns_per_score_byte: float  # per byte of its (heads x n x context) scores
    elementwise_ns_per_byte: float  # norms, RoPE, activations, residuals, logits
    # per (llama-like) layer per forward pass (op dispatch, graph building)
    layer_overhead_us: float
    forward_overhead_us: float  # per forward pass
    copy_gbs: float  # KV pool copies: joins, compaction, regrowth
    step_overhead_us: float  # engine bookkeeping per step (scheduling, thread hand-off, sync)
    # Per attention score a decode step computes (layers x rows x query heads x width): without a
    # fused kernel (MLX's CPU backend) each score costs its matmul slice, mask, softmax and
    # transposes, whatever the head size: 20-30 ns each on a 2-core Xeon, 10-100x a K/V byte.
    attention_decode_ns_per_score: float = 0.0
    # MoE, measured alone on mlx-lm's SwitchGLU (server/measure/expert_cost.py): per routed
    # (token, expert) pair and expert matrix, what it costs beyond its multiply-adds, and per
    # multiply-add (pair x the matrix's in x out). With the per-MAC term set, a step's routed
    # experts cost these per pair plus their distinct weights streamed once; 0: not measured (the
    # GEMM model's price for each distinct expert, at GATHER_MATMUL_EFFICIENCY).
    experts_ns_per_pair: float = 0.0
    experts_ns_per_mac: float = 0.0
    # Per layer per forward pass of other architectures (model_type -> us), each measured alone
    # like layer_overhead_us on a layer of its own (server/measure/fixed_cost.py). An MoE
    # architecture's dense-FFN layers, and every layer of an architecture not listed, cost
    # layer_overhead_us.
    layer_overhead_us_by_arch: dict[str, float] = dataclasses.field(default_factory=dict)
    calibrated_on: tuple[str, ...] = ()
    measured_at: str = ""
    # The processor and BLAS it was measured on ("AMD EPYC, OpenBLAS ... Zen"): a cloud machine of
    # the same name can be another CPU on another day, and a profile does not carry over.
    device: str = ""
    # `speed_probe` timings (ms) at calibration time: `validate` reruns the probe to tell a stale
    # profile (the device got slower or faster since) from a wrong model.
    speed_probe_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    # Per-row and per-token terms (0: not measured; the step is priced as before): decode
    # attention's fixed cost per row past the first per layer, elementwise kernels' per token per
    # layer, sampling per sampled row.
    attention_row_ns: float = 0.0
    token_layer_ns: float = 0.0
    sampling_row_us: float = 0.0
    # batchsim's engine per sampled token beyond its step_overhead_us (recording, stop checks),
    # measured with the step overhead on real runs (0: not measured).
    host_token_us: float = 0.0


# host_scale's limit: a CPU 100x slower than the reference (the catalog's Macs: 0.79-2.56).
MAX_HOST_SCALE = 100.0


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
    # Fixed cost per layer per forward pass (a GPU's kernel dispatch and synchronisation), seconds.
    layer_overhead_s: float = 0.0
    # Routed MoE experts' gathered mat-vecs reach this fraction of the achievable bandwidth above
    # (index gathers, small per-expert tiles); 1.0 on a calibrated device (not measured there).
    expert_bandwidth_efficiency: float = 1.0
    # Fixed cost per routed-expert (MoE) layer per forward pass beyond layer_overhead_s, seconds
    # (two-die Macs: fitted; zero elsewhere).
    moe_layer_overhead_s: float = 0.0
    # What the profile's terms were fitted on ("" for a plain roofline or a hand-written profile).
    fitted_on: str = ""
    # 4/8-bit affine matmuls' own ceilings, keyed by bits (empty: the float ones): bytes of a
    # quantized GEMV at quantized_gemv_gbs, arithmetic of a quantized GEMM at quantized_gemm_gflops.
    quantized_gemv_gbs: dict[int, float] = dataclasses.field(default_factory=dict)
    quantized_gemm_gflops: dict[int, float] = dataclasses.field(default_factory=dict)
    # Operator-level terms measured by `batchsim calibrate` (None: the plain roofline above).
    calibration: Calibration | None = None
    # Per-row and per-token work of a roofline step (a calibrated device measures its own in
    # `calibration`): decode attention's fixed kernel cost per row past the first per layer, its
    # K/V read at this fraction of peak bandwidth (0: bandwidth_efficiency), elementwise kernels'
    # fixed cost per token per layer, and sampling per sampled row. All zero: the plain roofline.
    attention_row_s: float = 0.0
    kv_bandwidth_efficiency: float = 0.0
    token_layer_s: float = 0.0
    sampling_row_s: float = 0.0
    # GpuFit.top_p_slowdown: a top-p sampler's bytes over their time at the peak bandwidth.
    top_p_slowdown: float = 0.0
    # Apple GPU family ('g13d': server.perf.qmv) and the arithmetic rate of MLX's quantized
    # matrix-vector kernel over several rows (each row dequantizes and multiplies every weight):
    # a quantized layer over fewer rows than qmv.qmv_row_limit pays its FLOPs at this rate
    # (StepTime.gemv_rows_s: qmv's rows past the first, or qmv_wide's rows where they outlast the
    # weight stream), over more its qmm tiles' 32 rows. 0 or no family: a plain GEMM.
    gpu_family: str = ""
    quantized_gemv_row_gflops: float = 0.0
    # The MLX version whose qmv/qmm choice prices those layers (qmv.qmv_row_limit: its limits
    # changed in v0.32.1); "": the newest.
    mlx_version: str = ""
    # The share of peak_tflops["float16"] a quantized GEMM reaches off the Neural Accelerators where
    # that peak is theirs (an M5 running split-K qmm: server.perf.qmv); 1: every kernel reaches the
    # same peak (M1-M4 run FP16 at the FP32 shader rate).
    shader_flops_share: float = 1.0
    # How many times longer host-side work (kernel encoding, the engine's Python per step and per
    # token, a sampler call) takes here than on the reference CPU (gpu_fit: a catalog Mac's CPU
    # generation); 1: as measured or fitted.
    host_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.host_scale <= MAX_HOST_SCALE:  # it multiplies the engine's capped costs
            raise ValueError(f"host_scale must be >= 0 and at most {MAX_HOST_SCALE:g}, got "
                             f"{self.host_scale:g}")
        try:  # read once here (a file's profile: one line naming it), not at each layer priced
            mlx_release(self.mlx_version)
        except ValueError as exc:
            raise ValueError(f"mlx_version: {exc}") from None

    def tflops(self, dtype: str) -> float:
        try:
            return self.peak_tflops[dtype]
        except KeyError:
            raise ValueError(f"profile {self.name} has no peak for {dtype}") from None

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.bandwidth_efficiency

    @property
    def kv_bytes_per_s(self) -> float:
        """Decode attention's K/V read rate: its own efficiency, else the weights'."""
        efficiency = self.kv_bandwidth_efficiency or self.bandwidth_efficiency
        return self.bandwidth_gbs * 1e9 * efficiency

    @property
    def top_p_bytes_per_s(self) -> float:
        """A top-p sampler's pass rate: the peak bandwidth over top_p_slowdown (set: not 0)."""
        return self.bandwidth_gbs * 1e9 / self.top_p_slowdown

    def flops_per_s(self, dtype: str) -> float:
        return self.tflops(dtype) * 1e12 * self.compute_efficiency


def at_speed(profile: DeviceProfile, speed: float) -> DeviceProfile:
    """The same device running `speed` times as fast (0.9: every step takes 1/0.9 as long): what a
    shared machine's slow phase does to every term at once."""
    profile = dataclasses.replace(
        profile, bandwidth_gbs=profile.bandwidth_gbs * speed,
        peak_tflops={k: v * speed for k, v in profile.peak_tflops.items()},
        forward_overhead_s=profile.forward_overhead_s / speed,
        layer_overhead_s=profile.layer_overhead_s / speed,
        quantized_gemv_gbs={b: v * speed for b, v in profile.quantized_gemv_gbs.items()},
        quantized_gemm_gflops={b: v * speed for b, v in profile.quantized_gemm_gflops.items()},
        attention_row_s=profile.attention_row_s / speed,
        token_layer_s=profile.token_layer_s / speed, sampling_row_s=profile.sampling_row_s / speed)
    c = profile.calibration
    if c is None:
        return profile
    gemm = {f: GemmFit({kn: v / speed for kn, v in g.weight_ns.items()},
                       {m: v / speed for m, v in g.flop_ns.items()}) for f, g in c.gemm.items()}
    # Every float term is a time per unit of work, but copy_gbs, a rate; and so is every
    # per-architecture one: derived from the fields so that a term added later is scaled too.
    terms = {f.name: getattr(c, f.name) / speed for f in dataclasses.fields(c)
             if f.type == "float" and f.name != "copy_gbs"}
    by_arch = {f.name: {a: us / speed for a, us in getattr(c, f.name).items()}
               for f in dataclasses.fields(c) if f.name.endswith("_by_arch")}
    return dataclasses.replace(profile, calibration=dataclasses.replace(
        c, gemm=gemm, copy_gbs=c.copy_gbs * speed, **terms, **by_arch))


def compute_dtype(dtype: str, quantize_bits: int | None) -> str:
    """Quantized weights are multiplied in their scales' dtype: float16 here for every model.
    That dtype is the checkpoint's, not the model's: mlx-lm's converter saved float16 by default
    until ml-explore/mlx-lm 5c04f07f (2025-04-23, first tagged v0.24.1), then config.json's
    torch_dtype (bfloat16 for Llama 3.x, Qwen3), which the reference rows do not record."""
    return "float16" if quantize_bits else dtype
