"""The whole Mac fit and its evidence, as plain data for `batchsim fit-macs`: the fitted terms,
leave-one-chip-out and leave-one-model-out errors, every reference row's prediction before (the
plain llama.cpp-efficiency roofline) and after (the fitted GPU step), the prefill rows, and the
batched figures the fit never saw."""

from __future__ import annotations

import dataclasses

from batchsim.server.perf import mac_fit, macs
from batchsim.server.perf.gpu_fit import GpuFit
from batchsim.server.perf.reference import REFERENCE_PATH, BatchedRow, DecodeRow, ReferenceSet
from batchsim.server.perf.stepcost import StepCost

LOO_KEYS = {"chip": lambda r: r.chip, "model": lambda r: r.model}


def fit_reference(ref: ReferenceSet, catalog: macs.Catalog) -> GpuFit:
    """Decode terms on every batch-1 row, then prefill compute efficiency on the prefill rows,
    then the held-out errors the shipped fit reports."""
    rows = list(ref.rows)
    where = REFERENCE_PATH.relative_to(REFERENCE_PATH.parents[2]).as_posix()
    start, _ = macs.compute_efficiency(catalog)
    fit = mac_fit.fit_rows(rows, catalog, start, mac_fit.describe(rows, where))
    prefill = mac_fit.prefill_rows(ref)
    fit = dataclasses.replace(fit, compute_efficiency=mac_fit.fit_compute(prefill, catalog, fit),
                              compute_fitted_on=f"{where}: {len(prefill)} prefill rows")
    errors = {}
    for name, key in LOO_KEYS.items():
        summary = mac_fit.error_summary(
            mac_fit.held_out_errors(rows, catalog, key, fit.compute_efficiency).values())
        errors |= {f"leave_one_{name}_out_{k}": round(v, 4) for k, v in summary.items()}
    return dataclasses.replace(fit, errors=errors)


def before_tok_s(row: DecodeRow, catalog: macs.Catalog) -> float:
    """The pre-fit prediction: the plain roofline at llama.cpp's median efficiency, no fixed
    costs."""
    eff, _ = macs.bandwidth_efficiency(catalog, macs.weight_format(row.quantize_bits))
    cost = mac_fit.row_cost(row, catalog, None, bandwidth_efficiency=eff)
    return 1.0 / cost.decode_time(1, row.width_tokens).total_s


def row_table(ref: ReferenceSet, catalog: macs.Catalog, fit: GpuFit) -> list[dict]:
    """Every reference row with its before/after predictions and held-out errors."""
    rows = list(ref.rows)
    held = {name: mac_fit.held_out_errors(rows, catalog, key, fit.compute_efficiency)
            for name, key in LOO_KEYS.items()}
    out = []
    for i, r in enumerate(rows):
        after = mac_fit.predict_tok_s(r, catalog, fit)
        out.append({
            "model": r.model, "weights": r.weights, "chip": r.chip, "gpu_cores": r.gpu_cores,
            "memory_gb": r.memory_gb, "engine": r.engine, "context_tokens": r.width_tokens,
            "measured_tok_s": r.decode_tok_s, "before_tok_s": before_tok_s(r, catalog),
            "after_tok_s": after, "after_err": after / r.decode_tok_s - 1.0,
            "leave_chip_out_err": held["chip"][i], "leave_model_out_err": held["model"][i],
            "src": ref.sources[r.src].split(" ")[0],
        })
    return out


def prefill_table(ref: ReferenceSet, catalog: macs.Catalog, fit: GpuFit) -> list[dict]:
    out = []
    for r in mac_fit.prefill_rows(ref):
        cost = mac_fit.row_cost(r, catalog, fit)
        predicted = r.prompt_tokens / mac_fit.prefill_s(cost, r.prompt_tokens)
        out.append({"model": r.model, "weights": r.weights, "chip": r.chip,
                    "prompt_tokens": r.prompt_tokens, "measured_tok_s": r.prefill_tok_s,
                    "predicted_tok_s": predicted, "err": predicted / r.prefill_tok_s - 1.0})
    return out


def batched_table(ref: ReferenceSet, catalog: macs.Catalog, fit: GpuFit) -> list[dict]:
    """Published batched figures beside the model's batch-1 and batch-B decode (pure decode, the
    server's prefill and ramp-up excluded: an upper bound on a server's figure)."""
    out = []
    for b in ref.batched:
        row = _as_decode_row(b)
        cost: StepCost = mac_fit.row_cost(row, catalog, fit)
        width = row.width_tokens
        one = 1.0 / cost.decode_time(1, width).total_s
        many = b.concurrent / cost.decode_time(b.concurrent, width).total_s
        out.append({"model": b.model, "weights": b.weights, "chip": b.chip,
                    "concurrent": b.concurrent, "measured_single_tok_s": b.single_tok_s,
                    "measured_total_tok_s": b.total_tok_s,
                    "measured_gain": b.total_tok_s / b.single_tok_s,
                    "predicted_single_tok_s": one, "predicted_total_tok_s": many,
                    "predicted_gain": many / one})
    return out


def _as_decode_row(b: BatchedRow) -> DecodeRow:
    return DecodeRow(b.model, b.weights, b.chip, b.gpu_cores, b.memory_gb, b.single_tok_s,
                     None, None, "", b.src)
