"""The Mac GPU step fitted on every published row (configs/reference/published.yaml): batch 1 and
batched, decode-only figures and servers' runs with prefill, each priced by simulating what its
source ran (server.perf.published_sim).

A row's predicted seconds are StepCost's parts, each linear in one unknown: bytes at the peak
bandwidth times x_fmt = 1 / efficiency of the weight format (routed experts' bytes also over g,
their fraction of it), FLOPs at the peak compute times x_compute = 1 / compute efficiency, and the
fixed times per layer and per forward pass. For each g on a grid that is a linear least-squares
problem on relative error (mac_fit.fit_design: robust, fixed costs kept >= 0); the parts are
recomputed under the new fit and the fit repeated (a roofline's binding side can change)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
from batchsim.server.perf import macs
from batchsim.server.perf.gpu_fit import FORMATS, GpuFit, fit_format
from batchsim.server.perf.mac_fit import EXPERT_GRID, fit_design
from batchsim.server.perf.published_sim import measured_s, model_spec, priced

COLUMNS = (*FORMATS, "compute", "layer_s", "forward_s")
ROUNDS = 3  # refits with the parts recomputed under the last fit


@dataclasses.dataclass(frozen=True)
class Basis:
    """One row's predicted seconds under a fit, split by unknown (at unit value)."""

    plain: np.ndarray  # seconds by COLUMNS
    experts: float  # routed experts' seconds at the format's bandwidth (divided by g in the fit)
    fmt: str
    measured_s: float


def basis(row: Any, catalog: macs.Catalog, fit: GpuFit) -> Basis:
    p = priced(row, catalog, fit)
    fmt = fit_format(row.quantize_bits)
    eff, ce = fit.bandwidth_efficiency[fmt], fit.compute_efficiency
    d, f = p.decode, p.prefill
    plain = np.zeros(len(COLUMNS))
    plain[COLUMNS.index(fmt)] = eff * (d.weights_s + d.attention_s + d.elementwise_s + d.copy_s
                                       + f.weights_s + f.elementwise_s + f.copy_s)
    plain[COLUMNS.index("compute")] = ce * (d.matmul_s + f.matmul_s + f.attention_s + f.experts_s)
    plain[COLUMNS.index("layer_s")] = p.forwards * model_spec(row.model).num_layers
    plain[COLUMNS.index("forward_s")] = p.forwards
    experts = d.experts_s * eff * fit.expert_bandwidth_efficiency
    return Basis(plain, experts, fmt, measured_s(row))


def _design(bases: Sequence[Basis], g: float) -> np.ndarray:
    a = np.array([b.plain for b in bases])
    for i, b in enumerate(bases):
        a[i, COLUMNS.index(b.fmt)] += b.experts / g
    return a / np.array([b.measured_s for b in bases])[:, None]


def _solve(bases: Sequence[Basis]) -> tuple[np.ndarray, float, list[int]]:
    """(theta by COLUMNS, g, the columns the rows determine) at the g of least loss."""
    full = _design(bases, 1.0)
    used = [j for j in range(len(COLUMNS)) if np.any(full[:, j] > 0)]
    fixed = [j for j in used if COLUMNS[j] in ("layer_s", "forward_s")]
    free = [j for j in used if j not in fixed]
    order = free + fixed
    grid = EXPERT_GRID if any(b.experts > 0 for b in bases) else np.array([1.0])

    def at(g: float) -> tuple[float, np.ndarray]:
        return fit_design(_design(bases, g)[:, order], len(free))

    g = float(min(grid, key=lambda x: at(float(x))[0]))
    theta = np.zeros(len(COLUMNS))
    theta[order] = at(g)[1]
    return theta, g, used


def _to_fit(theta: np.ndarray, g: float, used: list[int], start: GpuFit,
            fitted_on: str) -> GpuFit:
    """Efficiencies from the slowdowns (<= 1); a format the rows lack gets the others' mean, the
    compute efficiency stays at `start`'s when no row is compute bound."""
    slow = {f: max(1.0, float(theta[i])) for i, f in enumerate(FORMATS) if i in used}
    mean = statistics.fmean(slow.values())
    ci = COLUMNS.index("compute")
    ce = 1.0 / max(1.0, float(theta[ci])) if ci in used else start.compute_efficiency
    return dataclasses.replace(
        start, bandwidth_efficiency={f: 1.0 / slow.get(f, mean) for f in FORMATS},
        layer_overhead_us=float(theta[COLUMNS.index("layer_s")]) * 1e6,
        forward_overhead_us=float(theta[COLUMNS.index("forward_s")]) * 1e6,
        compute_efficiency=ce, expert_bandwidth_efficiency=g, fitted_on=fitted_on)


def fit_published(rows: Sequence[Any], catalog: macs.Catalog, start: GpuFit,
                  fitted_on: str = "") -> GpuFit:
    """The GPU step's terms fitted on `rows`, starting from `start` (whose other fields it keeps)."""
    fit = start
    for _ in range(ROUNDS):
        theta, g, used = _solve([basis(r, catalog, fit) for r in rows])
        fit = _to_fit(theta, g, used, start, fitted_on)
    return fit
