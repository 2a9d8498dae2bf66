"""`batchsim fit-macs`: fit the Mac GPU step (bandwidth by weight format, MoE experts' share, fixed
time per layer and forward pass, prefill compute efficiency) on the published batch-1 MLX
measurements in configs/reference/mlx-decode.yaml, and show how well it predicts them: every row
before and after, leave-one-chip-out and leave-one-model-out, the batched figures it never saw.
The math lives in server.perf.mac_fit / mac_report; here the flags and the tables."""

from __future__ import annotations

import argparse
import dataclasses
import math

from batchsim.configs import ConfigError
from batchsim.scripts.common import out, table
from batchsim.server.perf import gpu_fit, mac_report, macs
from batchsim.server.perf.reference import load_reference


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--write", action="store_true",
                   help=f"write the fit to {gpu_fit.FIT_PATH.name} (what every Mac profile uses); "
                        "without it the fit is compared with the shipped one")


def run(args: argparse.Namespace) -> dict:
    catalog, ref = macs.load_catalog(), load_reference()
    fit = mac_report.fit_reference(ref, catalog)
    try:
        shipped = gpu_fit.load_fit()
    except ConfigError:  # none yet (or unreadable): --write makes one
        shipped = None
    rows = mac_report.row_table(ref, catalog, fit)
    prefill = mac_report.prefill_table(ref, catalog, fit)
    batched = mac_report.batched_table(ref, catalog, fit)
    _print(fit, rows, prefill, batched)
    same = shipped is not None and _same(fit, shipped)
    if args.write:
        out.print(f"fit written to {gpu_fit.save_fit(fit)}")
    elif not same:
        out.print("[yellow]the shipped fit differs from this one: run `batchsim fit-macs --write`"
                  "[/yellow]")
    return {"fit": dataclasses.asdict(fit), "shipped_fit_matches": same, "written": args.write,
            "rows": rows, "prefill": prefill, "batched": batched}


def _same(a: gpu_fit.GpuFit, b: gpu_fit.GpuFit, rel: float = 1e-6) -> bool:
    """The fitted numbers agree (the text fields may differ)."""
    def nums(f: gpu_fit.GpuFit) -> list[float]:
        return [*f.bandwidth_efficiency.values(), f.layer_overhead_us, f.forward_overhead_us,
                f.compute_efficiency, f.expert_bandwidth_efficiency]
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-9) for x, y in zip(nums(a), nums(b)))


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def _print(fit: gpu_fit.GpuFit, rows: list[dict], prefill: list[dict], batched: list[dict]) -> None:
    out.print(table(
        "Batch-1 decode tok/s: published vs predicted (before: llama.cpp-efficiency roofline, no "
        "fixed costs; after: the fitted GPU step; held out: fitted without that chip / model)",
        ["model", "weights", "chip", "ctx", "engine", "measured", "before", "after", "err",
         "chip out", "model out"],
        [[r["model"], r["weights"], f"{r['chip']} {r['gpu_cores'] or ''}".strip(),
          r["context_tokens"], r["engine"], r["measured_tok_s"], r["before_tok_s"],
          r["after_tok_s"], _pct(r["after_err"]), _pct(r["leave_chip_out_err"]),
          _pct(r["leave_model_out_err"])] for r in rows]))
    out.print(table("Prefill tok/s (chunks of 2048; compute efficiency fitted here)",
                    ["model", "weights", "chip", "prompt", "measured", "predicted", "err"],
                    [[p["model"], p["weights"], p["chip"], p["prompt_tokens"], p["measured_tok_s"],
                      p["predicted_tok_s"], _pct(p["err"])] for p in prefill]))
    out.print(table("Batched serving (never fitted on): published server figures vs pure decode",
                    ["model", "weights", "chip", "B", "measured 1 / B", "gain", "predicted 1 / B",
                     "gain"],
                    [[b["model"], b["weights"], b["chip"], b["concurrent"],
                      f"{b['measured_single_tok_s']:.0f} / {b['measured_total_tok_s']:.0f}",
                      f"{b['measured_gain']:.2f}x",
                      f"{b['predicted_single_tok_s']:.0f} / {b['predicted_total_tok_s']:.0f}",
                      f"{b['predicted_gain']:.2f}x"] for b in batched]))
    e = fit.errors
    out.print(f"Fit: {fit.summary()}. {fit.fitted_on}; compute: {fit.compute_fitted_on}.")
    out.print(f"Held-out |error| of batch-1 tok/s: leave one chip out median "
              f"{100 * e['leave_one_chip_out_median_abs']:.0f}%, worst "
              f"{100 * e['leave_one_chip_out_worst_abs']:.0f}%; leave one model out median "
              f"{100 * e['leave_one_model_out_median_abs']:.0f}%, worst "
              f"{100 * e['leave_one_model_out_worst_abs']:.0f}%.")
