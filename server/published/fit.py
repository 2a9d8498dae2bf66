"""The Mac GPU step and the engines' host costs fitted on every published row
(configs/reference/published.yaml): batch 1 and batched, decode-only figures and servers' runs with
prefill, each priced by simulating what its source ran (server.published.sim).

A row's predicted seconds are StepCost's parts, each linear in one unknown: bytes at the peak
bandwidth times 1 / efficiency (the weights' by format; decode K/V reads their own; a top-p
sampler's passes their own; routed experts' also over g, their fraction), FLOPs at the peak compute
times 1 / efficiency (float, 4-bit, 8-bit matmuls), fixed time per layer and per forward pass,
sampling per sampled row (only rows whose engine calls its sampler per row carry it:
EngineProfile.sampler, a row's `sampler`), and each engine's host time per step and per generated
token (and an attention loop's per-row dispatches).
No per-row attention kernel cost on a catalog Mac: MLX's decode attention is one kernel over every
row (attention_row_us stays 0; the one source that wanted it, mlx_lm_1540, calls its sampler once
per row). For each g on a grid that is a least-squares problem on relative error (robust: Huber
weights; every time term kept >= 0; an engine's own terms shrunk towards zero, so what all engines
share goes to the device terms, and towards the mean of its kind's, servers' or libraries', by
PRIOR_ROWS over its rows: that mean is the prior of an engine the rows lack, and a one-row
engine's costs lie halfway to it; server.published.solve). The parts are recomputed under the new
fit and the fit repeated (a roofline's binding side may move)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
from batchsim.server.perf import kernels, macs
from batchsim.server.perf.engines import EngineProfile, load_engine
from batchsim.server.perf.gpu_fit import FORMATS, ULTRA_QMV_TERMS, fit_format, ultra_qmv_term
from batchsim.server.perf.mac_fit import EXPERT_GRID
from batchsim.server.perf.reference import row_mac
from batchsim.server.published.sim import (
    HostPrior,
    MacModel,
    engine_name,
    measured_s,
    model_spec,
    priced,
    row_cost,
    run_steps,
    tokens,
)
from batchsim.server.published.solve import TIMES, fit_at

DEVICE = (*FORMATS, "kv", "top_p", "c_float", "c_q8", "c_q4", "layer_s", "forward_s",
          "sampling_row_s",
          "ultra_layer_s", "ultra_bytes", "ultra_moe_layer_s", "c_qmv", *ULTRA_QMV_TERMS)
ROUNDS = 3  # refits with the parts recomputed under the last fit
# GpuFit.cpu_exponent's candidates (the least loss wins) and the columns it scales per row.
CPU_GRID = (0.0, 1.0, 2.0, 3.0)
CPU_COLUMNS = ("layer_s", "forward_s", "sampling_row_s", "step", "token")  # step:NAME, token:NAME
UNIT_US = 1e6  # count-type terms priced at 1 s each: their parts are then counts
def columns(rows: Sequence[Any]) -> list[str]:
    """The unknowns: the device's, each engine's host time per step and per token, and (an engine
    looping attention over rows, with batched rows) its own per-row dispatches."""
    engines = sorted({engine_name(r) for r in rows})
    batching = sorted({engine_name(r) for r in rows
                       if r.batch > 1 and load_engine(engine_name(r)).attention_loop})
    return [*DEVICE, *(f"step:{e}" for e in engines), *(f"token:{e}" for e in engines),
            *(f"row:{e}" for e in batching)]


def _unit(model: MacModel, rows: Sequence[Any]) -> MacModel:
    """`model` with every count-type term at 1 s (layers: per layer; forward: none)."""
    fit = dataclasses.replace(model.fit, layer_overhead_us=UNIT_US, forward_overhead_us=0.0,
                              attention_row_us=0.0, token_layer_us=0.0,
                              sampling_row_us=UNIT_US, ultra_layer_us=0.0,
                              ultra_bandwidth_slowdown=0.0, ultra_moe_layer_us=0.0,
                              quantized_gemv_row_efficiency=1.0, cpu_exponent=0.0,
                              top_p_slowdown=1.0,
                              **dict.fromkeys(ULTRA_QMV_TERMS, 0.0))
    engines = {e: dataclasses.replace(model.engine(e), host_step_us=UNIT_US, host_token_us=UNIT_US,
                                      row_dispatch_forwards=0.0)
               for e in {engine_name(r) for r in rows}}
    return MacModel(fit, engines)


@dataclasses.dataclass(frozen=True)
class Basis:
    """One row's predicted seconds under a fit, by column (at unit value)."""

    plain: dict[str, float]
    experts: float  # routed experts' seconds at the format's bandwidth (divided by g in the fit)
    fmt: str
    measured_s: float


def basis(row: Any, catalog: macs.Catalog, unit: MacModel, layers: float,
          current: MacModel) -> Basis:
    """`current`: the last fit, whose fixed cost per forward prices the engine's per-row
    dispatches (a product of two unknowns: linear in the engine's with the device's held)."""
    d, f = priced(row, catalog, unit)
    fit, fmt = unit.fit, fit_format(row.quantize_bits)
    eff, ce = fit.bandwidth_efficiency[fmt], fit.compute_efficiency
    cq = fit.quantized_gemm_efficiency.get(row.quantize_bits, ce) if row.quantize_bits else ce
    eng = engine_name(row)
    plain = {
        fmt: eff * (d.weights_s + d.elementwise_s + d.copy_s + f.weights_s + f.elementwise_s
                    + f.copy_s),
        "kv": (fit.kv_bandwidth_efficiency or eff) * d.attention_s,
        "top_p": d.top_p_s + f.top_p_s,  # at the peak bandwidth (the unit fit's slowdown 1)
        "c_float": ce * f.attention_s,
        f"c_{fmt}": cq * (d.matmul_s + f.matmul_s + f.experts_s),
        "layer_s": d.fixed_s + f.fixed_s,
        "forward_s": (d.fixed_s + f.fixed_s) / layers,
        "sampling_row_s": d.sampling_s + f.sampling_s,
        "c_qmv": d.gemv_rows_s + f.gemv_rows_s,  # at the FP16 peak (the unit fit's rate)
        f"step:{eng}": d.host_step_s + f.host_step_s,
        f"token:{eng}": d.host_token_s + f.host_token_s,
        f"row:{eng}": (_rows_past_first(row, catalog, unit)
                       * row_cost(row, catalog, current).loop_dispatch_s()),
    }
    if fmt == "float":
        plain["c_float"] += ce * (d.matmul_s + f.matmul_s + f.experts_s)
    if row.chip.endswith("Ultra"):  # two dies: their own extra terms
        plain["ultra_layer_s"], plain["ultra_bytes"] = plain["layer_s"], plain[fmt]
        if term := ultra_qmv_term(row.chip):  # M1/M2 Ultras (M3-on: none)
            plain[term] = plain["c_qmv"]
        if moe := row_cost(row, catalog, unit).layers.moe_layers / layers:  # MoE layers' share
            plain["ultra_moe_layer_s"] = moe * plain["layer_s"]
    experts = d.experts_s * eff * fit.expert_bandwidth_efficiency
    return Basis(plain, experts, fmt, measured_s(row))


def _rows_past_first(row: Any, catalog: macs.Catalog, model: MacModel) -> float:
    """Decode rows past the first of each batched forward in what the row's seconds count (an
    engine running the rows one at a time, or one graph each: none)."""
    cost = row_cost(row, catalog, model)
    if cost.serial or cost.row_graphs or not cost.engine.attention_loop:
        return 0
    if row.decode_only and row.staggered:  # per step as measured_s counts them (decode_step):
        out = tokens(row)[1]  # the ramp's batch * out rows over out + batch - 1 steps
        return (row.batch - 1) * (out - 1) / out
    if row.decode_only:
        return row.batch - 1
    return sum(max(s.decode_rows - 1, 0) * s.num_steps for s in run_steps(row, catalog, model))


def _design(bases: Sequence[Basis], cols: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(plain parts, routed experts' parts at g = 1), each row divided by its measured seconds."""
    a, e = np.zeros((len(bases), len(cols))), np.zeros((len(bases), len(cols)))
    index = {c: j for j, c in enumerate(cols)}
    for i, b in enumerate(bases):
        for k, v in b.plain.items():
            if k in index or not k.startswith("row:"):  # an engine without batched rows: none
                a[i, index[k]] += v / b.measured_s
        e[i, index[b.fmt]] = b.experts / b.measured_s
    return a, e


def _solve(bases: Sequence[Basis], cols: list[str]) -> tuple[float, dict[str, float], float]:
    """(loss, theta by column name for the columns the rows determine, g) at the g of least loss:
    a coarse pass over the grid, then the fine grid around its best."""
    plain, experts = _design(bases, cols)

    def loss(g: float) -> float:
        return fit_at(plain + experts / g, cols)[0]

    g = 1.0
    if experts.any():
        coarse = min(EXPERT_GRID[::5], key=loss)
        step = EXPERT_GRID[1] - EXPERT_GRID[0]
        g = float(min((x for x in EXPERT_GRID if abs(x - coarse) < 5 * step), key=loss))
    a = plain + experts / g
    least, theta = fit_at(a, cols)
    return least, {c: float(theta[j]) for j, c in enumerate(cols) if np.any(a[:, j] > 0)}, g


def _at_g(bases: Sequence[Basis], cols: list[str], g: float) -> np.ndarray:
    """The design with the routed experts at efficiency g."""
    plain, experts = _design(bases, cols)
    return plain + experts / g


def _at_cpu(bases: Sequence[Basis], speeds: Sequence[float], exponent: float) -> list[Basis]:
    """The bases (computed at cpu_exponent 0) with their fixed-cost columns at `exponent`."""
    return [dataclasses.replace(b, plain={**b.plain, **{c: v * s ** -exponent
                                                        for c, v in b.plain.items()
                                                        if c.partition(":")[0] in CPU_COLUMNS}})
            for b, s in zip(bases, speeds)]


def _to_model(theta: dict[str, float], g: float, start: MacModel, fitted_on: str) -> MacModel:
    """Efficiencies from the slowdowns (<= 1; a format the rows lack gets the others' mean, a
    compute or K/V rate they lack stays at `start`'s); time terms in us."""
    slow = {f: theta[f] for f in FORMATS if f in theta}
    mean = statistics.fmean(slow.values())
    s = start.fit

    def rate(col: str, default: float) -> float:
        return 1.0 / theta[col] if col in theta else default

    quant = {b: rate(f"c_q{b}", 0.0) for b in (4, 8) if f"c_q{b}" in theta}
    fit = dataclasses.replace(
        s, bandwidth_efficiency={f: 1.0 / slow.get(f, mean) for f in FORMATS},
        kv_bandwidth_efficiency=rate("kv", s.kv_bandwidth_efficiency),
        compute_efficiency=rate("c_float", s.compute_efficiency),
        quantized_gemm_efficiency={**s.quantized_gemm_efficiency, **quant},
        expert_bandwidth_efficiency=g, fitted_on=fitted_on,
        quantized_gemv_row_efficiency=rate("c_qmv", s.quantized_gemv_row_efficiency),
        top_p_slowdown=theta.get("top_p", 0.0),
        **{term: theta.get(term, 0.0) for term in ULTRA_QMV_TERMS},
        ultra_bandwidth_slowdown=theta.get("ultra_bytes", 0.0),
        **{name: 1e6 * theta.get(col, 0.0) for col, name in TIMES.items()})
    engines = {e: dataclasses.replace(start.engine(e), host_step_us=1e6 * theta.get(f"step:{e}", 0),
                                      host_token_us=1e6 * theta.get(f"token:{e}", 0),
                                      row_dispatch_forwards=theta.get(f"row:{e}", 0.0))
               for e in {c.split(":")[1] for c in theta if ":" in c}}
    return MacModel(fit, engines)


def priors(engines: dict[str, EngineProfile]) -> dict[str, HostPrior]:
    """Each engine kind's prior: the mean host costs (us per step, per token) of its fitted
    engines."""
    out = {}
    for kind in sorted({e.kind for e in engines.values()} - {""}):
        of = [e for e in engines.values() if e.kind == kind]
        out[kind] = HostPrior(statistics.fmean(e.host_step_us for e in of),
                              statistics.fmean(e.host_token_us for e in of), len(of))
    return out


def _with_priors(model: MacModel, rows: Sequence[Any]) -> MacModel:
    """`model` with its kinds' priors and each fitted engine's host_basis: its rows and the prior
    it was shrunk to."""
    model = dataclasses.replace(model, priors=priors(model.engines))
    engines = {}
    for name, e in model.engines.items():
        n = sum(engine_name(r) == name for r in rows)
        basis = f"fitted on {n} row{'s' * (n != 1)}"
        if e.kind in model.priors:
            basis += f", shrunk towards the {e.kind} prior, {model.priors[e.kind].describe()}"
        engines[name] = dataclasses.replace(e, host_basis=basis)
    return dataclasses.replace(model, engines=engines)


def explained(row: Any, model: MacModel) -> bool:
    """Whether the model has the terms the row needs. Not: a row published.yaml marks
    `unexplained` (with why); a batched row of an engine that runs this architecture as separate
    one-row forwards (how much of their fixed costs the GPU overlaps depends on the chip: 30% on
    an M1 Ultra, most on an M5 Max for mlxcel-server's qwen2)."""
    if row.unexplained:
        return False
    engine = model.engine_of(row)
    return not (row.batch > 1 and engine.batches
                and model_spec(row.model).model_type in engine.serial_model_types)


def fit_published(rows: Sequence[Any], catalog: macs.Catalog, start: MacModel,
                  fitted_on: str = "") -> MacModel:
    """The terms fitted on `rows` the model can explain, starting from `start` (whose other fields
    they keep)."""
    rows = [r for r in rows if explained(r, start)]
    model, cols = start, columns(rows)
    layers = [kernels.kernel_layers(model_spec(r.model), r.quantize_bits) for r in rows]
    speeds = [row_mac(catalog, r.chip, r.gpu_cores).cpu_speed for r in rows]
    grid = CPU_GRID  # the first round picks the CPU exponent, the others keep it
    for _ in range(ROUNDS):
        unit = _unit(model, rows)
        bases = [basis(r, catalog, unit, n, model) for r, n in zip(rows, layers)]
        g0 = model.fit.expert_bandwidth_efficiency  # the exponent's loss at the last round's g
        cpu = grid[0] if len(grid) == 1 else min(grid, key=lambda x: fit_at(
            _at_g(_at_cpu(bases, speeds, x), cols, g0), cols)[0])
        _, theta, g = _solve(_at_cpu(bases, speeds, cpu), cols)
        grid = (cpu,)
        model = _to_model(theta, g, dataclasses.replace(start, fit=dataclasses.replace(
            start.fit, cpu_exponent=cpu)), fitted_on)
    return _with_priors(model, rows)
