"""Fitting a Mac GPU step's terms on published batch-1 MLX measurements, and checking them.

The model is StepCost's own: a batch-1 decode step takes its bytes (weights, K/V, activations) at
the achievable bandwidth of its weight format, routed MoE experts' bytes at a fraction g of that,
plus a fixed time per layer and per forward pass:
    t = x_fmt * (t_peak + t_experts / g) + layers * layer_s + forward_s,   x_fmt = 1 / eff_fmt,
where t_peak and t_experts are StepCost's step at the chip's peak bandwidth with no fixed costs
(without and with the routed experts). For each g on a grid this is linear in (x_float, x_q8, x_q4,
layer_s, forward_s): a least-squares fit on relative error (robust: Huber weights) finds them, and
the g with the least loss wins. Batched predictions then follow from the same StepCost. Prefill
compute efficiency is fitted afterwards on the rows that publish a prompt rate (a 1-D search)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable
from functools import lru_cache

import numpy as np
from batchsim.server.models.spec import ModelSpec, zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.gpu_fit import FORMATS, GpuFit, fit_format, mac_profile
from batchsim.server.perf.kernels import kernel_layers
from batchsim.server.perf.reference import DecodeRow, ReferenceSet, row_mac
from batchsim.server.perf.stepcost import StepCost

HUBER_DELTA = 0.10  # relative error beyond which a row's weight falls (robust fit)
IRLS_ROUNDS = 8
PREFILL_CHUNK_TOKENS = 2048  # mlx-lm's prefill_step_size: prompts are run in chunks this long
MIN_PREFILL_TOKENS = 256  # shorter prompts measure latency, not the prefill rate
COMPUTE_GRID = np.linspace(0.05, 1.0, 96)
EXPERT_GRID = np.linspace(0.2, 1.0, 41)


@dataclasses.dataclass(frozen=True)
class Basis:
    """What the linear fit needs of one row."""

    row: DecodeRow
    fmt: str  # FORMATS
    peak_s: float  # StepCost's batch-1 step at peak bandwidth, no fixed costs, experts excluded
    experts_s: float  # its routed experts' part (MoE), likewise
    layers: int
    measured_s: float  # 1 / decode_tok_s


@lru_cache(maxsize=64)
def _spec(model: str) -> ModelSpec:
    return zoo_spec(model)


def row_cost(row: DecodeRow, catalog: macs.Catalog, fit: GpuFit | None,
             bandwidth_efficiency: float = 1.0) -> StepCost:
    """StepCost for a row's model on its Mac: the fit's profile, or (fit None) the peak roofline
    at `bandwidth_efficiency` with no fixed costs."""
    mac = row_mac(catalog, row.chip, row.gpu_cores)
    if fit is None:
        profile = mac.profile(bandwidth_efficiency, 1.0)
    else:
        profile = mac_profile(mac, fit, row.quantize_bits)
    return StepCost(_spec(row.model), profile, row.dtype, row.quantize_bits)


def basis(row: DecodeRow, catalog: macs.Catalog) -> Basis:
    step = row_cost(row, catalog, None).decode_time(1, row.width_tokens)
    return Basis(row, fit_format(row.quantize_bits), step.total_s - step.experts_s,
                 step.experts_s, kernel_layers(_spec(row.model), row.quantize_bits),
                 1.0 / row.decode_tok_s)


def predict_tok_s(row: DecodeRow, catalog: macs.Catalog, fit: GpuFit) -> float:
    return 1.0 / row_cost(row, catalog, fit).decode_time(1, row.width_tokens).total_s


# -- the linear fit --------------------------------------------------------------------------------
def _design(bases: list[Basis], fmts: list[str], expert_eff: float) -> np.ndarray:
    """Rows of [x_fmt columns..., layer_s, forward_s], each divided by the measured time."""
    a = np.zeros((len(bases), len(fmts) + 2))
    for i, b in enumerate(bases):
        a[i, fmts.index(b.fmt)] = b.peak_s + b.experts_s / expert_eff
        a[i, -2], a[i, -1] = b.layers, 1.0
        a[i] /= b.measured_s
    return a


def huber_weights(r: np.ndarray, delta: float) -> np.ndarray:
    """IRLS row weights (applied to the rows, so the square root of Huber's) for the absolute
    residuals `r`: 1 within `delta`, falling as delta / r beyond it."""
    return np.sqrt(np.where(r > delta, delta / np.maximum(r, 1e-12), 1.0))


def huber_loss(r: np.ndarray, delta: float, weights: np.ndarray | None = None) -> float:
    """Huber's loss, times 2 (r^2 within `delta`, then linear), summed over the residuals `r`
    (each times its weight, where `weights` are given)."""
    each = np.where(r > delta, delta * (2 * r - delta), r * r)
    return float((each if weights is None else weights * each).sum())


def _solve(a: np.ndarray, keep: list[int]) -> np.ndarray:
    """Huber-weighted least squares of a @ theta = 1 over the kept columns (others zero)."""
    theta, w = np.zeros(a.shape[1]), np.ones(a.shape[0])
    for _ in range(IRLS_ROUNDS):
        sol, *_ = np.linalg.lstsq(a[:, keep] * w[:, None], w, rcond=None)
        theta[:] = 0.0
        theta[keep] = sol
        w = huber_weights(np.abs(a @ theta - 1.0), HUBER_DELTA)
    return theta


@dataclasses.dataclass(frozen=True)
class DecodeTerms:
    bandwidth_efficiency: dict[str, float]  # by format (FORMATS)
    expert_bandwidth_efficiency: float
    layer_s: float
    forward_s: float


def _fit_at(bases: list[Basis], fmts: list[str], expert_eff: float) -> tuple[float, np.ndarray]:
    """(Huber loss, theta) of the linear fit with the experts' efficiency fixed."""
    return fit_design(_design(bases, fmts, expert_eff), len(fmts))


def fit_design(a: np.ndarray, first_fixed: int) -> tuple[float, np.ndarray]:
    """(Huber loss, theta) of a @ theta = 1. A negative term from column `first_fixed` on (the fixed
    costs) is dropped and the rest refitted."""
    keep = list(range(a.shape[1]))
    theta = _solve(a, keep)
    while any(theta[j] < 0 for j in keep[first_fixed:]):
        keep.remove(min(keep[first_fixed:], key=lambda j: theta[j]))
        theta = _solve(a, keep)
    return huber_loss(np.abs(a @ theta - 1.0), HUBER_DELTA), theta


def fit_decode(bases: list[Basis]) -> DecodeTerms:
    """The decode terms; a format absent from the rows gets the mean slowdown of the others, the
    experts' efficiency 1 when no row routes experts."""
    fmts = [f for f in FORMATS if any(b.fmt == f for b in bases)]
    grid = EXPERT_GRID if any(b.experts_s > 0 for b in bases) else np.array([1.0])
    expert_eff = min(grid, key=lambda g: _fit_at(bases, fmts, float(g))[0])
    theta = _fit_at(bases, fmts, float(expert_eff))[1]
    slow = {f: max(1.0, float(theta[i])) for i, f in enumerate(fmts)}
    mean = statistics.fmean(slow.values())
    return DecodeTerms({f: 1.0 / slow.get(f, mean) for f in FORMATS}, float(expert_eff),
                       float(theta[-2]), float(theta[-1]))


# -- prefill compute efficiency --------------------------------------------------------------------
def prefill_rows(ref: ReferenceSet) -> list[DecodeRow]:
    return [r for r in ref.rows if r.prefill_tok_s and (r.prompt_tokens or 0) >= MIN_PREFILL_TOKENS]


def prefill_s(cost: StepCost, prompt_tokens: int) -> float:
    """A prompt prefilled as mlx-lm does: chunks of PREFILL_CHUNK_TOKENS, the last one sampling."""
    total, start = 0.0, 0
    while start < prompt_tokens:
        n = min(PREFILL_CHUNK_TOKENS, prompt_tokens - start)
        total += cost.prefill_time(n, start, sample=start + n == prompt_tokens).total_s
        start += n
    return total


def fit_compute(rows: list[DecodeRow], catalog: macs.Catalog, fit: GpuFit) -> float:
    """The compute efficiency whose predicted prompt rates are closest (log error) to the rows'."""
    def loss(ce: float) -> float:
        trial = dataclasses.replace(fit, compute_efficiency=float(ce))
        errs = [np.log(prefill_s(row_cost(r, catalog, trial), r.prompt_tokens)
                       * r.prefill_tok_s / r.prompt_tokens) for r in rows]
        return float(np.sum(np.square(errs)))
    return float(min(COMPUTE_GRID, key=loss)) if rows else fit.compute_efficiency


# -- the whole fit and its checks ------------------------------------------------------------------
def describe(rows: Iterable[DecodeRow], path: str) -> str:
    rows = list(rows)
    chips, models = {r.chip for r in rows}, {r.model for r in rows}
    return f"{path}: {len(rows)} batch-1 rows, {len(chips)} chips, {len(models)} models"


def fit_rows(rows: list[DecodeRow], catalog: macs.Catalog, compute_efficiency: float,
             fitted_on: str = "") -> GpuFit:
    t = fit_decode([basis(r, catalog) for r in rows])
    return GpuFit(t.bandwidth_efficiency, t.layer_s * 1e6, t.forward_s * 1e6, compute_efficiency,
                  t.expert_bandwidth_efficiency, fitted_on)


def held_out_errors(rows: list[DecodeRow], catalog: macs.Catalog, key: Callable[[DecodeRow], str],
                    compute_efficiency: float) -> dict[int, float]:
    """Each row's relative tok/s error predicted by a fit that never saw its group (same key)."""
    out: dict[int, float] = {}
    for group in sorted({key(r) for r in rows}):
        train = [r for r in rows if key(r) != group]
        fit = fit_rows(train, catalog, compute_efficiency)
        for i, r in enumerate(rows):
            if key(r) == group:
                out[i] = predict_tok_s(r, catalog, fit) / r.decode_tok_s - 1.0
    return out


def error_summary(errors: Iterable[float]) -> dict[str, float]:
    mags = [abs(e) for e in errors]
    return {"median_abs": statistics.median(mags), "worst_abs": max(mags)} if mags else {}
