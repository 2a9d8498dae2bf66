"""`batchsim fit-macs`: fit the Mac GPU step on every published MLX measurement in
configs/reference/published.yaml (batch 1 and batched, each predicted by simulating what its source
ran), and show how well it predicts them: every row before (the batch-1-only fit that shipped
before) and after, and its held-out prediction leaving its source, chip or model out; the
cross-validated errors of batch 1, batched throughput and the batching gain, overall and per
engine. The math lives in server.perf.published_fit / mac_cv; here the flags and the tables."""

from __future__ import annotations

import argparse
import dataclasses
import math

from batchsim.configs import ConfigError
from batchsim.scripts.common import out, table
from batchsim.server.perf import gpu_fit, mac_cv, mac_report, macs
from batchsim.server.perf.reference import PUBLISHED_PATH, load_published, load_reference


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--write", action="store_true",
                   help=f"write the fit to {gpu_fit.FIT_PATH.name} (what every Mac profile uses); "
                        "without it the fit is compared with the shipped one")


def run(args: argparse.Namespace) -> dict:
    catalog, published = macs.load_catalog(), load_published()
    before = mac_report.fit_reference(load_reference(), catalog)
    where = PUBLISHED_PATH.relative_to(PUBLISHED_PATH.parents[2]).as_posix()
    rows = list(published.rows)
    fit, cv = mac_cv.validate(rows, catalog, before, mac_cv.describe(rows, where))
    try:
        shipped = gpu_fit.load_fit()
    except ConfigError:  # none yet (or unreadable): --write makes one
        shipped = None
    _print(fit, cv)
    same = shipped is not None and _same(fit, shipped)
    if args.write:
        out.print(f"fit written to {gpu_fit.save_fit(fit)}")
    elif not same:
        out.print("[yellow]the shipped fit differs from this one: run `batchsim fit-macs --write`"
                  "[/yellow]")
    return {"fit": dataclasses.asdict(fit), "before_fit": dataclasses.asdict(before),
            "shipped_fit_matches": same, "written": args.write, "cv": cv}


def _same(a: gpu_fit.GpuFit, b: gpu_fit.GpuFit, rel: float = 1e-6) -> bool:
    """The fitted numbers agree (the text fields may differ)."""
    def nums(f: gpu_fit.GpuFit) -> list[float]:
        return [*f.bandwidth_efficiency.values(), f.layer_overhead_us, f.forward_overhead_us,
                f.compute_efficiency, f.expert_bandwidth_efficiency]
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-9) for x, y in zip(nums(a), nums(b)))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _stat(s: dict) -> str:
    if not s["n"]:
        return "-"
    return f"{100 * s['median_abs']:.0f}% / {100 * s['worst_abs']:.0f}% (n {s['n']})"


def _print(fit: gpu_fit.GpuFit, cv: dict) -> None:
    out.print(table(
        "Published tok/s vs predicted (before: the batch-1-only fit that shipped before; after: "
        "this fit; source / chip out: fitted without the row's source / chip)",
        ["id", "engine", "B", "measures", "measured", "before", "after", "source out", "chip out"],
        [[r["id"], r["engine"], r["batch"],
          r["measures"] + ("" if r["decode_only"] else " +prefill"), f"{r['measured_tok_s']:.1f}",
          _pct(r["before_tok_s"] / r["measured_tok_s"] - 1),
          _pct(r["after_tok_s"] / r["measured_tok_s"] - 1),
          _pct(r["leave_one_source_out_tok_s"] / r["measured_tok_s"] - 1),
          _pct(r["leave_one_chip_out_tok_s"] / r["measured_tok_s"] - 1)] for r in cv["rows"]]))
    body = []
    for fold in mac_cv.FOLDS:
        for label, rep in (("before", cv["before"][fold]), ("after", cv[fold])):
            body.append([fold, label, *(_stat(rep[k]) for k in mac_cv.KINDS)])
    out.print(table("Held-out |error|: median / worst", ["fold", "fit", *mac_cv.KINDS], body))
    engines = cv["leave_one_source_out"]["by_engine"]
    out.print(table("Leave one source out, by engine (after): median / worst",
                    ["engine", *mac_cv.KINDS],
                    [[e, *(_stat(rep[k]) for k in mac_cv.KINDS)] for e, rep in engines.items()]))
    out.print(f"Fit: {fit.summary()}. {fit.fitted_on}.")
