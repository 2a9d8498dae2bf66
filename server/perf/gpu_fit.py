"""A Mac GPU step's fitted terms (configs/reference/mlx-fit.yaml, written by `batchsim fit-macs
--write` from the published measurements in configs/reference/published.yaml) and the device
profile of a catalog Mac built from them: achievable bandwidth by weight format, a fixed time per
layer and per forward pass (kernel dispatch, synchronisation), prefill compute efficiency. Pure
Python; the fit itself is server.perf.mac_fit."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import yaml
from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.server.perf.macs import Mac
from batchsim.server.perf.profile import DeviceProfile
from batchsim.server.perf.qmv import GENERATION_OF_CHIP, gpu_family, has_neural_accelerators

FIT_PATH = CONFIG_DIR / "reference" / "mlx-fit.yaml"
FORMATS = ("float", "q8", "q4")  # float: float16 / bfloat16 weights (the same GEMV kernels)


def fit_format(quantize_bits: int | None) -> str:
    """The bandwidth column a weight format streams like."""
    if quantize_bits is None:
        return "float"
    if quantize_bits not in (4, 8):
        raise ConfigError(f"quantize: {quantize_bits} is not allowed; allowed: 4, 8")
    return f"q{quantize_bits}"


@dataclasses.dataclass(frozen=True)
class GpuFit:
    """The terms every catalog Mac's profile shares (each Mac brings its own peaks)."""

    bandwidth_efficiency: dict[str, float]  # by format (FORMATS): fraction of peak GB/s
    layer_overhead_us: float  # per layer per forward pass
    forward_overhead_us: float  # per forward pass
    compute_efficiency: float  # fraction of the catalog FP16 peak large prefill matmuls reach
    # Routed MoE experts' gathered mat-vecs: this fraction of the format's bandwidth above.
    expert_bandwidth_efficiency: float
    fitted_on: str  # what the terms were fitted on (rows, chips, models, the reference file)
    compute_fitted_on: str = ""  # the prefill rows compute_efficiency was fitted on
    # Leave-one-chip-out / leave-one-model-out |error| of batch-1 decode tok/s (median, worst).
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    # Work that grows with the rows (StepTime's attention_rows_s, token_ops_s, sampling_s; 0: not
    # fitted): decode attention's fixed cost per row past the first per layer and its K/V read's
    # fraction of peak bandwidth (0: the weights' for the format), elementwise kernels' cost per
    # token per layer, sampling per sampled row.
    attention_row_us: float = 0.0
    kv_bandwidth_efficiency: float = 0.0
    token_layer_us: float = 0.0
    sampling_row_us: float = 0.0
    # Quantized GEMMs' arithmetic ceiling as a fraction of the chip's FP16 peak, keyed by bits
    # (absent: compute_efficiency, the float one); a Mac's profile gets quantized_gemm_gflops
    # from it. Their bytes already have their own rate: bandwidth_efficiency by format.
    quantized_gemm_efficiency: dict[int, float] = dataclasses.field(default_factory=dict)
    # Two-die Ultra chips: extra fixed time per layer per forward pass, and a slowdown added to
    # 1 / bandwidth efficiency (published Ultra decode rates fall short of their peak bandwidth).
    ultra_layer_us: float = 0.0
    ultra_bandwidth_slowdown: float = 0.0
    # ... and extra fixed time per routed-expert layer per forward pass: an MoE layer's small
    # gathered expert reads, spread over both dies' memory, wait on latency more than bandwidth
    # (published M1 Ultra MoE decode rates; its dense ones fit without it).
    ultra_moe_layer_us: float = 0.0
    # MLX's quantized matrix-vector kernel over several rows (server.perf.qmv): its arithmetic as a
    # fraction of the chip's FP16 peak (0: those rows priced as a GEMM). Fitted in [1/30, 1]
    # (published.solve MAX_SLOWDOWN). It sat at its bound 1 in the fits of 81290df and 58445e6: qmv
    # at the full FP16 rate while dequantizing every weight again per row, implausible, a sign that
    # other terms mispriced the few-row steps. It left the bound (0.83) when host work began to
    # scale by CPU generation (804992b: the M1-M5 rows' host time no longer one constant), and
    # fitted 0.79 once rows were priced with their own MLX's kernels (00c4dc1); 0.49 while the
    # Ultra term below was fitted per generation, and the shipped fit's value since 0d9b162 (one
    # M1/M2 Ultra term, no per-generation one) is in configs/reference/mlx-fit.yaml.
    quantized_gemv_row_efficiency: float = 0.0
    # ... and on an M1/M2 Ultra, added to its 1 / efficiency: published M1 Ultra batched rows
    # scale worse than any other chip's (also mlx-lm's few-row verify forwards on an M2 Ultra
    # against an M3 Max, ml-explore/mlx-examples issue 1281); whether by its two dies or by its
    # generation (no published one-die M1/M2 batched row says) is not known. An M3-or-later Ultra
    # (Apple GPU family 9 on: Dynamic Caching) has no such term: qmv's grid, M x N/8 threadgroups
    # (mlx/backend/metal/quantized.cpp qmv, v0.31.1), fills both dies as it fills one die's cores,
    # and the M3 Ultra rows fit the one-die chips' rate (their own term, fitted until 575be2e,
    # was 0.0 on all rows; with mlx-swift's M3 Ultra rows held out, the 4 rapid-mlx M3 Ultra rows
    # alone, whose qmv rows are 8% of their step, set it to 1.6: macprovider's llama and qwen3
    # M3 Ultra rows then -19..-24%).
    # Only M1 Ultra rows are batched among M1/M2 Ultras: with the M1 Ultra held out (leave one
    # chip out) its term has no rows, and those rows are over-predicted.
    ultra_gemv_row_slowdown: float = 0.0
    # A top-p sampler's passes over a sampled row's logits (engines.top_p_bytes_per_logit: MLX's
    # argsort, then gathers, a scan and a scatter) take this many times their bytes' time at the
    # peak bandwidth (StepTime.top_p_s), fitted from 1 up to qmv's cap (published.solve) on the
    # rows whose source states a top_p (only published rows: no shipped engine sets one); 0: no
    # fitted rate (StepCost.top_p_s prices them as elementwise bytes). One factor blended over
    # three sampler codes (mlx-lm's apply_top_p, Rapid-MLX's fused one, which has no scatter, and
    # ekryski's mlx-swift-lm TopPSampler) and over all of a row's bytes, the sort's (100 of
    # mlx-lm's 172 B per float16 logit of a 151,936-token row) and the elementwise and gather
    # passes' alike: not the sort's own rate. Why a sort pays more than its bytes: a row of more
    # than 2048 values takes MLX's multi-block sort, each merge pass mb_block_partition, then
    # mb_block_merge staging tiles in threadgroup memory between barriers (mlx/backend/metal/
    # sort.cpp multi_block_sort, kernels/sort.h, v0.32.0). MLX's own timings (ml-explore/mlx PR
    # 1831, "benchmarks on M2", dtype not stated) are of its single-block sort (a 1024-value row
    # is one 256 x 4 block): (1024, 1024) 1.51 ms and (4096, 1024) 4.54 ms over a floor of about
    # 0.46 ms a call ((160,) 0.467, (1024, 4) 0.457); the 3072 rows between them take 3.03 ms for
    # about 25 MB read and written as float32, about 12x their time at 100 GB/s (no M2 has less).
    top_p_slowdown: float = 0.0
    # The fixed costs per layer and per forward pass are MLX encoding each kernel's dispatch on the
    # CPU while the GPU runs the last ones: they scale as (1 / Mac.cpu_speed) ** cpu_exponent, its
    # CPU generation's single-core score relative to the reference one (configs/macs.yaml
    # cpu_single_core); 0: the same on every Mac.
    cpu_exponent: float = 0.0

    def __post_init__(self) -> None:
        missing = [f for f in FORMATS if f not in self.bandwidth_efficiency]
        if missing or any(not 0 < v <= 1 for v in self.bandwidth_efficiency.values()):
            raise ValueError(f"bandwidth_efficiency needs {', '.join(FORMATS)} in (0, 1]")
        if not 0 < self.compute_efficiency <= 1 or not 0 < self.expert_bandwidth_efficiency <= 1:
            raise ValueError("compute_efficiency and expert_bandwidth_efficiency must be in (0, 1]")
        fractions = [self.kv_bandwidth_efficiency, self.quantized_gemv_row_efficiency,
                     *self.quantized_gemm_efficiency.values()]
        if any(not 0 <= v <= 1 for v in fractions):
            raise ValueError("kv_bandwidth_efficiency and the quantized GEMM and GEMV row "
                             "efficiencies must be in [0, 1]")
        if min(self.attention_row_us, self.token_layer_us, self.sampling_row_us,
               self.ultra_layer_us, self.ultra_bandwidth_slowdown, self.ultra_moe_layer_us,
               self.ultra_gemv_row_slowdown, self.cpu_exponent, self.top_p_slowdown) < 0:
            raise ValueError("attention_row_us, token_layer_us, sampling_row_us, the Ultra terms, "
                             "cpu_exponent and top_p_slowdown must be >= 0")

    def summary(self) -> str:
        eff = ", ".join(f"{f} {v:.2f}" for f, v in self.bandwidth_efficiency.items())
        return (f"bandwidth {eff} (MoE experts x{self.expert_bandwidth_efficiency:.2f}); fixed "
                f"{self.layer_overhead_us:.1f} us/layer + "
                f"{self.forward_overhead_us:.0f} us/forward; compute {self.compute_efficiency:.2f}"
                + self._row_summary())

    def _row_summary(self) -> str:
        """The per-row terms and quantized ceilings, where fitted (nothing when all are zero)."""
        terms = [(self.attention_row_us, "attention {:.2f} us/row/layer"),
                 (self.token_layer_us, "{:.3f} us/token/layer"),
                 (self.sampling_row_us, "sampling {:.1f} us/row"),
                 (self.kv_bandwidth_efficiency, "K/V reads {:.2f}"),
                 (self.top_p_slowdown, "top-p sampler bytes x{:.2f} peak time"),
                 (self.ultra_layer_us, "Ultra +{:.1f} us/layer"),
                 (self.ultra_moe_layer_us, "Ultra +{:.1f} us/MoE layer")]
        shown = [form.format(v) for v, form in terms if v]
        shown += [f"q{b} GEMM {e:.2f} of FP16" for b, e in self.quantized_gemm_efficiency.items()]
        if self.quantized_gemv_row_efficiency:
            shown.append(f"qmv rows {self.quantized_gemv_row_efficiency:.3f} of FP16")
        if self.ultra_gemv_row_slowdown:
            shown.append(f"M1/M2 Ultra qmv rows +{self.ultra_gemv_row_slowdown:.2f} slowdown")
        if self.cpu_exponent:
            shown.append(f"fixed costs x (1 / CPU speed)^{self.cpu_exponent:.1f}")
        return f"; {', '.join(shown)}" if shown else ""


@lru_cache(maxsize=4)
def load_fit(path: str | Path = FIT_PATH) -> GpuFit:
    return from_dict(GpuFit, load_yaml(path), str(path))


HEADER = """\
# Written by `batchsim fit-macs --write` (server/published/fit.py): the Mac GPU step's terms,
# fitted by least squares on every row of configs/reference/published.yaml (batch 1 and batched,
# each priced by simulating what its source ran), with the engines' host costs in configs/engines.
# Every catalog Mac's device profile uses them with its own peaks. Do not edit by hand:
# tests/test_mac_fit.py refits and compares.
"""


def save_fit(fit: GpuFit, path: Path = FIT_PATH) -> Path:
    body = yaml.safe_dump(dataclasses.asdict(fit), sort_keys=False, width=100)
    path.write_text(HEADER + body)
    load_fit.cache_clear()
    return path


def mac_profile(mac: Mac, fit: GpuFit, quantize_bits: int | None,
                bandwidth_efficiency: float | None = None,
                compute_efficiency: float | None = None) -> DeviceProfile:
    """The cost model's profile of a catalog Mac: its peaks, the fit's terms for this weight format
    (an efficiency given here replaces the fit's, e.g. `size --bandwidth-efficiency`)."""
    bw = fit.bandwidth_efficiency[fit_format(quantize_bits)]
    ultra = mac.chip.endswith("Ultra")
    if ultra:
        bw = 1.0 / (1.0 / bw + fit.ultra_bandwidth_slowdown)
    if compute_efficiency is None:
        compute_efficiency = fit.compute_efficiency
    profile = mac.profile(bw if bandwidth_efficiency is None else bandwidth_efficiency,
                          compute_efficiency)
    fp16_tflops = profile.tflops("float16")
    family = gpu_family(mac.chip)
    # An M5's FP16 peak is its Neural Accelerators': split-K qmm multiplies at the shader FP32 rate.
    # qmv's fitted rate stays a share of the FP16 peak (a CV fold's prior too: cv.fold_catalog),
    # though qmv runs on the shader ALUs (float accumulators): priced off fp32_tflops (branch
    # h7/qmv-shader-m5-peak, 271 rows; again at 8ecd4ea with the accelerators at 4x FP32: LOCO
    # batched / gain 17.1 / 15.1 -> 21.5 / 20.0%) the share is 0.39, 0.25 without the M5 batched
    # rows, which want ~0.7 of an M5's FP32 peak (mlx_swift_lm_42: M5 B=2 costs nothing over B=1).
    # No cited mechanism prices that: the FP16 peak fitted on mlxcel's TTFT (macs.yaml) stands in.
    shader = min(1.0, mac.fp32_tflops / fp16_tflops) if has_neural_accelerators(family) else 1.0
    host = mac.cpu_speed ** -fit.cpu_exponent  # CPU-side dispatch: by the CPU's generation
    layer_us = fit.layer_overhead_us * host + (fit.ultra_layer_us if ultra else 0.0)
    return dataclasses.replace(
        profile, layer_overhead_s=layer_us * 1e-6,
        moe_layer_overhead_s=(fit.ultra_moe_layer_us if ultra else 0.0) * 1e-6,
        expert_bandwidth_efficiency=fit.expert_bandwidth_efficiency,
        forward_overhead_s=fit.forward_overhead_us * host * 1e-6,
        fitted_on=f"{fit.fitted_on} ({fit.summary()})",
        attention_row_s=fit.attention_row_us * 1e-6, token_layer_s=fit.token_layer_us * 1e-6,
        sampling_row_s=fit.sampling_row_us * host * 1e-6, host_scale=host,
        top_p_slowdown=fit.top_p_slowdown,
        kv_bandwidth_efficiency=fit.kv_bandwidth_efficiency,
        quantized_gemm_gflops={b: e * fp16_tflops * 1e3
                               for b, e in fit.quantized_gemm_efficiency.items()},
        gpu_family=family, shader_flops_share=shader,
        quantized_gemv_row_gflops=_gemv_row_gflops(fit, fp16_tflops, mac.chip))


ULTRA_M3_GENERATION = 15  # Ultras of GPU generation 15 (M3) on: no Ultra qmv slowdown
ULTRA_QMV_TERMS = ("ultra_gemv_row_slowdown",)


def ultra_qmv_term(chip: str) -> str:
    """The GpuFit field of a chip's Ultra qmv slowdown ('' for a one-die chip or an M3-on
    Ultra)."""
    if not chip.endswith("Ultra"):
        return ""
    return "" if GENERATION_OF_CHIP.get(chip.split()[0], 0) >= ULTRA_M3_GENERATION else \
        ULTRA_QMV_TERMS[0]


def _gemv_row_gflops(fit: GpuFit, fp16_tflops: float, chip: str) -> float:
    """qmv's arithmetic rate over several rows (0: not fitted), an M1/M2 Ultra's slowdown added."""
    if not fit.quantized_gemv_row_efficiency:
        return 0.0
    term = ultra_qmv_term(chip)
    slowdown = 1.0 / fit.quantized_gemv_row_efficiency + (getattr(fit, term) if term else 0.0)
    return fp16_tflops * 1e3 / slowdown
