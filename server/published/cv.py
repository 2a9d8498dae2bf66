"""Cross-validation of the Mac fit on every published row: leave one source out and leave one chip
out, each fold refitted without the held-out group, for batch 1, batched throughput and the gain
(batched / batch 1 from the same source and setup), overall and per engine. Every row is predicted
by simulating what its source ran (server.published.sim)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from batchsim.server.perf import mac_fit, macs
from batchsim.server.perf.gpu_fit import GpuFit
from batchsim.server.perf.reference import DecodeRow
from batchsim.server.published.fit import explained, fit_published
from batchsim.server.published.sim import MacModel, engine_name, predict_tok_s

KINDS = ("b1", "batched", "gain")
FOLDS: dict[str, Callable[[Any], str]] = {
    "leave_one_source_out": lambda r: r.src,
    "leave_one_chip_out": lambda r: r.chip,
}
Fitter = Callable[[Sequence[Any], macs.Catalog], MacModel]  # (training rows, catalog) -> fit


def kind(row: Any) -> str:
    return "b1" if row.batch == 1 else "batched"


def _setup(row: Any) -> tuple:
    """What a batched row and its batch-1 partner share: the source ran the same thing."""
    return (row.src, row.model, row.weights, row.chip, row.gpu_cores, row.engine,
            row.prompt_tokens, row.generated_tokens, row.decode_only)


def gain_pairs(rows: Sequence[Any]) -> list[tuple[int, int]]:
    """(batched row, its batch-1 row) index pairs: same source and setup."""
    b1 = {}
    for i, r in enumerate(rows):
        if r.batch == 1:
            b1.setdefault(_setup(r), i)
    return [(i, b1[_setup(r)]) for i, r in enumerate(rows) if r.batch > 1 and _setup(r) in b1]


def gain(rows: Sequence[Any], tok_s: Sequence[float], i: int, j: int) -> float:
    """Aggregate tok/s at the batched row's batch over batch-1 tok/s."""
    per_request = rows[i].measures == "per_request"
    return tok_s[i] * (rows[i].batch if per_request else 1) / tok_s[j]


def errors(rows: Sequence[Any], predicted: Sequence[float]) -> dict[str, list[tuple[int, float]]]:
    """Relative errors by KINDS: (row index, predicted / measured - 1); a gain at its batched
    row."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    for i, r in enumerate(rows):
        out[kind(r)].append((i, predicted[i] / r.tok_s - 1.0))
    measured = [r.tok_s for r in rows]
    for i, j in gain_pairs(rows):
        out["gain"].append((i, gain(rows, predicted, i, j) / gain(rows, measured, i, j) - 1.0))
    return out


def summary(errs: Iterable[float]) -> dict[str, float | int | None]:
    mags = [abs(e) for e in errs]
    if not mags:
        return {"n": 0, "median_abs": None, "worst_abs": None}
    return {"n": len(mags), "median_abs": round(statistics.median(mags), 4),
            "worst_abs": round(max(mags), 4)}


def report(rows: Sequence[Any], predicted: Sequence[float],
           keep: Sequence[bool] | None = None) -> dict[str, Any]:
    """{b1, batched, gain: summary} overall, the same per engine profile that priced the rows
    (sim.engine_name: mlx-lm at batch > 1 is mlx-lm-batch) under `by_engine`, and (given
    `keep`) over the kept rows only under `explained_only` (a gain: both its rows kept)."""
    errs = errors(rows, predicted)
    out: dict[str, Any] = {k: summary(e for _, e in errs[k]) for k in KINDS}
    if keep is not None:
        partner = dict(gain_pairs(rows))
        out["explained_only"] = {k: summary(e for i, e in errs[k] if keep[i] and (
            k != "gain" or keep[partner[i]])) for k in KINDS}
    priced = [engine_name(r) for r in rows]  # a gain: its batched row's
    out["by_engine"] = {
        eng: {k: summary(e for i, e in errs[k] if priced[i] == eng) for k in KINDS}
        for eng in sorted(set(priced))}
    return out


def fold_catalog(catalog: macs.Catalog, train: Sequence[Any], sources: set[str]) -> macs.Catalog:
    """The catalog as a fold may use it. A chip figure estimated from published rows (a chip citing
    one of `sources`, the published set's: the M5 FP16 peaks, from mlxcel_m5max_batch's TTFT) is
    withheld from a fold without that source's rows: its FP16 peak there is its unfitted prior
    (Mac.fp16_unfitted_tflops: an M5's Neural Accelerators at macs.NAX_FP16_PER_FP32 x its FP32
    peak; M1-M4, the FP32 peak). Nothing else differs: every rate derived from the FP16 peak (qmv's
    share of it included) comes from the same code as the shipped model's (gpu_fit.mac_profile)."""
    have = {r.src for r in train}
    chips = tuple(dataclasses.replace(m, fp16_tflops=m.fp16_unfitted_tflops)
                  if (set(m.src) & sources) - have else m for m in catalog.chips)
    return dataclasses.replace(catalog, chips=chips)


def held_out(rows: Sequence[Any], catalog: macs.Catalog, key: Callable[[Any], str],
             fitter: Fitter, priors_used: list[str | None] | None = None) -> list[float]:
    """Each row's tok/s predicted by a fit on the rows of every other group (same key), both on
    the fold's catalog; into `priors_used`, the engine kind whose prior priced each row (None: its
    engine was fitted)."""
    predicted = [0.0] * len(rows)
    sources = {r.src for r in rows}
    for group in sorted({key(r) for r in rows}):
        train = [r for r in rows if key(r) != group]
        cat = fold_catalog(catalog, train, sources)
        fit = fitter(train, cat)
        for i, r in enumerate(rows):
            if key(r) == group:
                predicted[i] = predict_tok_s(r, cat, fit)
                if priors_used is not None:
                    priors_used[i] = fit.prior_of(engine_name(r))
    return predicted


def cross_validate(rows: Sequence[Any], catalog: macs.Catalog, fitter: Fitter,
                   keep: Sequence[bool] | None = None
                   ) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, list]]:
    """(report by fold, held-out predictions by fold, the engine prior each used by fold);
    `keep`: as report's."""
    used: dict[str, list] = {name: [None] * len(rows) for name in FOLDS}
    held = {name: held_out(rows, catalog, key, fitter, used[name]) for name, key in FOLDS.items()}
    return {name: report(rows, p, keep) for name, p in held.items()}, held, used


# -- the shipped fit and its evidence --------------------------------------------------------------
def as_decode_row(row: Any) -> DecodeRow:
    return DecodeRow(row.model, row.weights, row.chip, row.gpu_cores, row.memory_gb, row.tok_s,
                     row.prompt_tokens, row.generated_tokens, row.engine, row.src)


def own_prefill(rows: Sequence[Any], prefill: Sequence[DecodeRow]) -> list[DecodeRow]:
    """The prefill rows (mlx-decode.yaml's prompt rates) of `rows`' own runs: same source, chip,
    model and weights as one of them. A fold's rows never bring a held-out source's or chip's."""
    runs = {(r.src, r.chip, r.model, r.weights) for r in rows}
    return [p for p in prefill if (p.src, p.chip, p.model, p.weights) in runs]


def legacy_fitter(prefill: Sequence[DecodeRow]) -> Fitter:
    """The fit as it shipped before (mac_fit; mac_report.fit_reference's steps on the given rows):
    batch-1 rows only, no per-row or engine terms, its decode terms at the catalog's llama.cpp
    compute efficiency (a prior no MLX row touched), then the prefill compute efficiency fitted on
    the rows' own prefill rows (none: that prior stays)."""
    def fit(rows: Sequence[Any], catalog: macs.Catalog) -> MacModel:
        prior, _ = macs.compute_efficiency(catalog)
        b1 = mac_fit.fit_rows([as_decode_row(r) for r in rows if r.batch == 1], catalog, prior)
        ce = mac_fit.fit_compute(own_prefill(rows, prefill), catalog, b1)
        return MacModel(dataclasses.replace(b1, compute_efficiency=ce))

    return fit


def published_fitter(prefill: Sequence[DecodeRow]) -> Fitter:
    """Each fold starts from the batch-1 fit of its own rows (legacy_fitter: its compute
    efficiency from its own prefill rows), never from a fit on every reference row: those terms
    seed the first round (the roofline's binding side, the CPU exponent's pick) and stay where the
    fold's rows do not identify them (a compute rate its rows lack)."""
    seed = legacy_fitter(prefill)
    return lambda rows, catalog: fit_published(rows, catalog, seed(rows, catalog))


def describe(rows: Sequence[Any], path: str) -> str:
    b1 = sum(r.batch == 1 for r in rows)
    return (f"{path}: {len(rows)} rows ({b1} batch-1, {len(rows) - b1} batched), "
            f"{len({r.src for r in rows})} sources, {len({r.chip for r in rows})} chips, "
            f"{len({r.model for r in rows})} models, {len({r.engine for r in rows})} engines")


def _errors(cv: dict[str, Any]) -> dict[str, float]:
    """GpuFit.errors: each fold's batch-1 |error| (median, worst)."""
    out = {}
    for fold, rep in cv.items():
        for stat in ("median_abs", "worst_abs"):
            out[f"{fold}_{stat}"] = rep["b1"][stat]
    return out


def validate(rows: Sequence[Any], catalog: macs.Catalog, before: GpuFit,
             prefill: Sequence[DecodeRow], fitted_on: str) -> tuple[MacModel, dict[str, Any]]:
    """(the fit on every row with its held-out errors, `cv`): each fold's report for this fit and
    (under `before`) for the batch-1-only fit that shipped before, and every row's predictions
    (held out: both fits', so the two can be compared row by row).
    `prefill`: the reference set's prefill rows (mlx_fit.prefill_rows); each fold fits on its
    own."""
    start = MacModel(before)
    fitter = published_fitter(prefill)
    after = fitter(rows, catalog)  # what every fold runs, on every row: its errors are its own
    keep = [explained(r, start) for r in rows]
    cv, held, used = cross_validate(rows, catalog, fitter, keep)
    old_cv, old_held, _ = cross_validate(rows, catalog, legacy_fitter(prefill), keep)
    table = []
    for i, r in enumerate(rows):
        entry = {"id": r.id, "src": r.src, "engine": r.engine, "chip": r.chip, "model": r.model,
                 "weights": r.weights, "batch": r.batch, "measures": r.measures,
                 "decode_only": r.decode_only, "measured_tok_s": r.tok_s,
                 "explained": keep[i],
                 "before_tok_s": predict_tok_s(r, catalog, start),
                 "after_tok_s": predict_tok_s(r, catalog, after)}
        entry |= {f"{fold}_tok_s": held[fold][i] for fold in FOLDS}
        entry |= {f"before_{fold}_tok_s": old_held[fold][i] for fold in FOLDS}
        entry |= {f"{fold}_engine_prior": used[fold][i] for fold in FOLDS}
        table.append(entry)
    fit = dataclasses.replace(after.fit, errors=_errors(cv), fitted_on=fitted_on,
                              compute_fitted_on=fitted_on)
    return dataclasses.replace(after, fit=fit), {**cv, "before": old_cv, "rows": table}
