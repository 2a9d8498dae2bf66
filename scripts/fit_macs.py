"""`batchsim fit-macs`: fit the Mac GPU step on every published MLX measurement in
configs/reference/published.yaml (batch 1 and batched, each predicted by simulating what its source
ran), and show how well it predicts them: every row before (the batch-1-only fit that shipped
before) and after, and its held-out prediction leaving its source, chip or model out; the
cross-validated errors of batch 1, batched throughput and the batching gain, overall and per
engine. The math lives in server.published (sim, fit, cv); here the flags and the tables."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

import yaml
from batchsim.configs import ConfigError
from batchsim.scripts.common import out, table
from batchsim.server.perf import gpu_fit, mac_fit, mac_report, macs
from batchsim.server.perf.engines import ENGINES_DIR, EngineProfile, engine_names, load_engine
from batchsim.server.perf.reference import PUBLISHED_PATH, load_published, load_reference
from batchsim.server.published import cv as mac_cv
from batchsim.server.published.sim import MacModel

ERRORS_ABS_TOL = 1e-4  # GpuFit.errors are written rounded to 4 places (cv.summary)


def add_parser(p: argparse.ArgumentParser) -> None:
    # Timed 2026-12-05 03:14 UTC on the 2-core Xeon VM at load 8-9: 4 min 48 s (`fit-macs --json`).
    p.description = (f"{p.description}. " if p.description else "") + (
        "Fits on every row of configs/reference/published.yaml, then refits once per held-out "
        "source and chip: about 5 minutes on a 2-core CPU. Prints every row measured, before, "
        "after and held out, and the held-out errors; nothing is written without --write.")
    p.add_argument("--write", action="store_true",
                   help=f"write the fit to {gpu_fit.FIT_PATH.name} (what every Mac profile uses); "
                        "without it the fit is compared with the shipped one")


def run(args: argparse.Namespace) -> dict:
    catalog, published = macs.load_catalog(), load_published()
    ref = load_reference()
    before = mac_report.fit_reference(ref, catalog)
    where = PUBLISHED_PATH.relative_to(PUBLISHED_PATH.parents[2]).as_posix()
    rows = list(published.rows)
    model, cv = mac_cv.validate(rows, catalog, before, mac_fit.prefill_rows(ref),
                                mac_cv.describe(rows, where))
    fit = model.fit
    try:
        shipped = shipped_model(model)
    except ConfigError:  # none yet (or unreadable): --write makes one
        shipped = None
    _print(model, cv)
    terms = shipped is not None and same_model(model, shipped)
    same = terms and same_errors(fit, shipped.fit)
    if args.write:
        written = [save_engine(e, fit.fitted_on).name for e in engine_profiles(model)]
        out.print(f"fit written to {gpu_fit.save_fit(fit)} and {', '.join(written)}", markup=False)
    elif not same:
        what = " in its held-out errors" if terms else ""
        out.print(f"the shipped fit differs from this one{what}: run `batchsim fit-macs "
                  "--write`", style="yellow")
    return {"fit": dataclasses.asdict(fit), "before_fit": dataclasses.asdict(before),
            "engines": {p.name: {"host_step_us": p.host_step_us, "host_token_us": p.host_token_us,
                                 "row_dispatch_forwards": p.row_dispatch_forwards,
                                 "host_basis": p.host_basis} for p in engine_profiles(model)},
            "engine_priors": {k: p._asdict() for k, p in model.priors.items()},
            "shipped_fit_matches": same, "written": args.write, "cv": cv}


def shipped_model(model: MacModel) -> MacModel:
    """The shipped fit and engine files of what `model` would write."""
    return MacModel(gpu_fit.load_fit(), {e.name: load_engine(e.name)
                                         for e in engine_profiles(model)})


def engine_profiles(model: MacModel) -> list[EngineProfile]:
    """What --write writes: every fitted engine, and every other engine of a kind with a prior
    (priced at it)."""
    return [model.engine(e) for e in engine_names()
            if e in model.engines or model.prior_of(e) is not None]


def _nums(obj: object) -> list[float]:
    """Every fitted number of a GpuFit or EngineProfile (text, flags and errors aside)."""
    out: list[float] = []
    for k, v in dataclasses.asdict(obj).items():
        if isinstance(v, dict) and k != "errors":
            out += [float(x) for _, x in sorted(v.items()) if isinstance(x, (int, float))]
        elif isinstance(v, float):
            out.append(v)
    return out


def same_model(a: MacModel, b: MacModel, rel: float = 1e-6) -> bool:
    """The fitted numbers agree (the text fields may differ)."""
    pairs = [(a.fit, b.fit), *((p, b.engine(p.name)) for p in engine_profiles(a))]
    return all(len(_nums(x)) == len(_nums(y)) and all(
        math.isclose(p, q, rel_tol=rel, abs_tol=1e-9) for p, q in zip(_nums(x), _nums(y)))
        for x, y in pairs)


def same_errors(a: gpu_fit.GpuFit, b: gpu_fit.GpuFit) -> bool:
    """The held-out errors agree (what `size` prints from the shipped fit), to their written 4
    places (one step of rounding apart: float noise): a stale errors block is a stale fit."""
    return a.errors.keys() == b.errors.keys() and all(
        math.isclose(a.errors[k], b.errors[k], abs_tol=ERRORS_ABS_TOL) for k in a.errors)


def save_engine(profile: EngineProfile, fitted_on: str) -> Path:
    """Write an engine's fitted host costs into its YAML (the rest of the file as it is)."""
    path = ENGINES_DIR / f"{profile.name}.yaml"
    text = path.read_text()
    for key in ("host_step_us", "host_token_us", "row_dispatch_forwards", "host_basis"):
        line = f"{key}: {json.dumps(getattr(profile, key))}"
        if re.search(rf"^{key}: ", text, flags=re.MULTILINE):
            text = re.sub(rf"^{key}: .*$", line, text, flags=re.MULTILINE)
        elif getattr(profile, key):  # a new fitted term: after the host costs
            text = re.sub(r"^(host_token_us: .*)$", rf"\1\n{line}", text, count=1,
                          flags=re.MULTILINE)
    source = yaml.safe_dump({"source": f"Fitted by `batchsim fit-macs --write` on {fitted_on}"},
                            width=100)
    text = re.sub(r"^source:.*?(?=^\S|\Z)", lambda _: source, text, flags=re.MULTILINE | re.DOTALL)
    path.write_text(text)
    load_engine.cache_clear()
    return path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _held(row: dict, fold: str) -> str:
    """A row's held-out error, and the engine prior that priced it (if one did)."""
    prior = row[f"{fold}_engine_prior"]
    return (_pct(row[f"{fold}_tok_s"] / row["measured_tok_s"] - 1)
            + (f" ({prior} prior)" if prior else ""))


def _stat(s: dict) -> str:
    if not s["n"]:
        return "-"
    return f"{100 * s['median_abs']:.0f}% / {100 * s['worst_abs']:.0f}% (n {s['n']})"


def _print(model: MacModel, cv: dict) -> None:
    out.print(table(
        "Published tok/s vs predicted (before: the batch-1-only fit that shipped before; after: "
        "this fit; source / chip out: fitted without the row's source / chip)",
        ["id", "engine", "B", "measures", "measured", "before", "after", "source out", "chip out"],
        [[r["id"], r["engine"], r["batch"],
          r["measures"] + ("" if r["decode_only"] else " +prefill"), f"{r['measured_tok_s']:.1f}",
          _pct(r["before_tok_s"] / r["measured_tok_s"] - 1),
          _pct(r["after_tok_s"] / r["measured_tok_s"] - 1),
          *(_held(r, fold) for fold in mac_cv.FOLDS)] for r in cv["rows"]],
        keep=["id", "B", "measured", "after", "source out", "chip out"]))  # the errors first
    body = []
    for fold in mac_cv.FOLDS:
        for label, rep in (("before", cv["before"][fold]), ("after", cv[fold])):
            body.append([fold, label, *(_stat(rep[k]) for k in mac_cv.KINDS)])
    out.print(table("Held-out |error|: median / worst", ["fold", "fit", *mac_cv.KINDS], body))
    out.print(table("Held out by engine (after; the profile that priced the rows): median / "
                    "worst", ["engine", "fold", *mac_cv.KINDS],
                    [[e, fold, *(_stat(cv[fold]["by_engine"][e][k]) for k in mac_cv.KINDS)]
                     for e in cv["leave_one_source_out"]["by_engine"] for fold in mac_cv.FOLDS]))
    out.print(f"Fit: {model.fit.summary()}. {model.fit.fitted_on}. Engines' host us per step / "
              "token: " + ", ".join(f"{e} {p.host_step_us:.0f} / {p.host_token_us:.0f}"
                                    for e, p in sorted(model.engines.items())) + ". Priors of an "
              "engine without rows: " + ", ".join(f"{k} {p.describe()}"
                                                   for k, p in sorted(model.priors.items())) + ".")
