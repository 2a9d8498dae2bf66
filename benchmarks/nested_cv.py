"""Nested cross-validation of the Mac fit (issue 34; server.published.nested): for each held-out
source (leave one source out) and chip (leave one chip out), the fit's hyperparameters are chosen
from nested.GRID by an inner grouped CV (nested.INNER_FOLDS folds) on the other groups' rows only,
then fitted and scored on the held-out rows. Prints one JSON line: per fold kind the plain held-out
errors (the shipped hyperparameters: what `batchsim fit-macs --json` reports under `cv`) and the
nested ones, {n, median_abs, worst_abs} for b1 / batched / gain, and what each fold chose.
Progress goes to stderr. A full run fits about 55 x 26 times (about 20 CPU-minutes):

    nice .venv/bin/python benchmarks/nested_cv.py > nested.json
    nice .venv/bin/python benchmarks/nested_cv.py --folds leave_one_chip_out --limit 1  # timing
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from batchsim.server.perf import mac_fit, macs
from batchsim.server.perf.reference import load_published, load_reference
from batchsim.server.published import cv, nested


def _summaries(rows: list, predicted: list[float]) -> dict:
    errs = cv.errors(rows, predicted)
    return {k: cv.summary(e for _, e in errs[k]) for k in cv.KINDS}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folds", nargs="+", choices=list(cv.FOLDS), default=list(cv.FOLDS))
    p.add_argument("--limit", type=int, default=0,
                   help="hold out only the first N groups (sorted) of each fold kind: a timing")
    p.add_argument("--inner", type=int, default=nested.INNER_FOLDS, help="inner folds")
    args = p.parse_args(argv)
    if args.limit < 0 or args.inner < 2:
        p.error("--limit must be >= 0 and --inner >= 2")
    start_cpu, start_wall = time.process_time(), time.monotonic()
    catalog, rows = macs.load_catalog(), list(load_published().rows)
    predict_at = nested.published_predictor(catalog, mac_fit.prefill_rows(load_reference()),
                                            {r.src for r in rows})
    out: dict = {"grid": [h.label() for h in nested.GRID], "inner_folds": args.inner,
                 "rows": len(rows)}
    for fold in args.folds:
        key = cv.FOLDS[fold]
        groups = sorted({key(r) for r in rows})[:args.limit or None]
        res = nested.nested_held_out(
            rows, key, nested.GRID, predict_at, args.inner, groups,
            progress=lambda g, fold=fold: print(
                f"{fold} {g}: {time.process_time() - start_cpu:.0f} CPU s", file=sys.stderr,
                flush=True))
        held = [i for i, r in enumerate(rows) if key(r) in set(groups)]
        sub = [rows[i] for i in held]
        out[fold] = {"groups": len(groups),
                     "plain": _summaries(sub, [res.plain[i] for i in held]),
                     "nested": _summaries(sub, [res.nested[i] for i in held]),
                     "chosen": {g: {"chose": c["chose"].label(), "inner_scores": c["inner_scores"]}
                                for g, c in res.chosen.items()}}
    out |= {"cpu_s": round(time.process_time() - start_cpu, 1),
            "wall_s": round(time.monotonic() - start_wall, 1),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
            "loadavg_end": os.getloadavg()[0]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
