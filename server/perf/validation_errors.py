"""Arithmetic of `batchsim validate` (pure, no MLX): the simulator's relative error per metric
against the median of a case's real runs, the runs' own spread, and the summary over cases."""

from __future__ import annotations

import numpy as np

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")
EXTRA = ("max_batch_size",)
# The cost model's error on the real runs' own steps (each real plan timed by the simulator too).
STEP = "step_time_err"
# What those predicted steps were made of: each part's share of their time (weights, attention,
# ...).
PARTS = "step_parts_share"


def median_run(runs: list[dict]) -> dict:
    """Per metric, the median over a case's real runs (each metric on its own)."""
    keys = set(METRICS + EXTRA + ("num_preemptions",))
    med = {k: float(np.median([r.get(k) or 0.0 for r in runs])) for k in keys}
    return med | {"run_dir": [r.get("run_dir") for r in runs]}


def repeat_stats(runs: list[dict], med: dict) -> dict:
    """How far one real run falls from the median of its repeats (mean |x / median - 1|): the
    machine's own noise, a floor under any simulator's error. Plus each run's values."""
    spread = {}
    for m in METRICS:
        devs = [abs((r.get(m) or 0.0) / med[m] - 1) if med[m] else 0.0 for r in runs]
        spread[m] = float(np.mean(devs))
    return {"repeat_abs_dev": spread,
            "real_runs": [{m: r.get(m) for m in METRICS + EXTRA} for r in runs]}


def compare(name: str, measured: dict, predicted: dict) -> dict:
    error = {}
    for m in METRICS + EXTRA:
        real, sim = measured.get(m) or 0.0, predicted.get(m) or 0.0
        error[m] = (sim - real) / real if real else (0.0 if sim == real else float("inf"))
    return {"case": name,
            "measured": {m: measured.get(m) for m in METRICS + EXTRA + ("num_preemptions",)},
            "predicted": {m: predicted.get(m) for m in METRICS + EXTRA + ("num_preemptions",)},
            "error": error, "sim_speedup": predicted.get("sim_speedup"),
            "real_run_dir": measured.get("run_dir"), "sim_run_dir": predicted.get("run_dir")}


def abs_err_stats(rows: list[dict], key: str) -> tuple[dict, dict, dict]:
    """Median and max |error| per metric over the cases, and the worst case per metric."""
    med, worst, case = {}, {}, {}
    for m in METRICS + EXTRA:
        errs = [abs(r[key][m]) for r in rows]
        med[m] = float(np.median(errs))
        i = int(np.argmax(errs))
        worst[m], case[m] = errs[i], rows[i]["case"]
    return med, worst, case


def summarize(rows: list[dict]) -> dict:
    med, worst, worst_case = abs_err_stats(rows, "error")
    speeds = [v for r in rows for v in r.get("device_speed_runs", [])]
    noise = {m: float(np.median([r["repeat_abs_dev"][m] for r in rows])) for m in METRICS}
    summary = {"cases": rows, "median_abs_err": med, "max_abs_err": worst, "worst_case": worst_case,
               "noise_floor": noise,
               "device_speed_range": [min(speeds), max(speeds)] if speeds else None}
    if rows and all("at_probed_speed" in r for r in rows):
        amed, aworst, acase = abs_err_stats(rows, "at_probed_speed")
        summary["at_probed_speed"] = {"median_abs_err": amed, "max_abs_err": aworst,
                                      "worst_case": acase}
    summary[STEP] = step_stats([r[STEP] for r in rows])
    if "at_probed_speed" in summary:
        probed = [r["at_probed_speed"].get(STEP) for r in rows]
        summary["at_probed_speed"][STEP] = step_stats(probed)
    return summary


def step_stats(errs: list[float | None]) -> dict | None:
    """The cost model's error on the real steps, over the cases: median (its bias) and |error|."""
    errs = [e for e in errs if e is not None]
    if not errs:
        return None
    return {"median": float(np.median(errs)), "median_abs": float(np.median(np.abs(errs))),
            "max_abs": float(np.max(np.abs(errs)))}
