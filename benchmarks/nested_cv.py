"""Nested cross-validation of the Mac fit (issue 34; server.published.nested): for each held-out
source (leave one source out) and chip (leave one chip out), the fit's hyperparameters are chosen
from nested.GRID by an inner grouped CV (nested.INNER_FOLDS folds) on the other groups' rows only,
then fitted and scored on the held-out rows. Prints one JSON line: per fold kind the plain held-out
errors (the shipped hyperparameters: what `batchsim fit-macs --json` reports under `cv`) and the
nested ones, {n, median_abs, worst_abs} for b1 / batched / gain, and what each fold chose.
Progress goes to stderr. A full run fits about 55 x 26 times (about 20 CPU-minutes):

    nice .venv/bin/python benchmarks/nested_cv.py --jobs 3 > nested.json
    nice .venv/bin/python benchmarks/nested_cv.py --folds leave_one_chip_out --limit 1  # timing
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import sys
import time

from batchsim.server.perf import mac_fit, macs
from batchsim.server.perf.reference import load_published, load_reference
from batchsim.server.published import cv, nested


def _summaries(rows: list, predicted: list[float]) -> dict:
    errs = cv.errors(rows, predicted)
    return {k: cv.summary(e for _, e in errs[k]) for k in cv.KINDS}


_WORK: dict = {}  # what every worker holds out from (set before the pool forks)


def _hold_out(task: tuple[str, str]) -> tuple[str, str, nested.Nested]:
    fold, group = task
    return fold, group, nested.nested_held_out(_WORK["rows"], cv.FOLDS[fold], nested.GRID,
                                               _WORK["predict_at"], _WORK["inner"], [group])


def _cpu_s() -> float:
    """This process's CPU seconds and its reaped workers'."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _fold_report(rows: list, fold: str, groups: list[str], done: dict) -> dict:
    key, index = cv.FOLDS[fold], {id(r): i for i, r in enumerate(rows)}
    sub = [r for r in rows if key(r) in set(groups)]
    plain, nest = ([getattr(done[key(r)], part)[index[id(r)]] for r in sub]
                   for part in ("plain", "nested"))
    return {"groups": len(groups), "plain": _summaries(sub, plain),
            "nested": _summaries(sub, nest),
            "chosen": {g: {"chose": done[g].chosen[g]["chose"].label(),
                           "inner_scores": done[g].chosen[g]["inner_scores"]}
                       for g in groups}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folds", nargs="+", choices=list(cv.FOLDS), default=list(cv.FOLDS))
    p.add_argument("--limit", type=int, default=0,
                   help="hold out only the first N groups (sorted) of each fold kind: a timing")
    p.add_argument("--inner", type=int, default=nested.INNER_FOLDS, help="inner folds")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (outer folds in each)")
    args = p.parse_args(argv)
    if args.limit < 0 or args.inner < 2 or args.jobs < 1:
        p.error("--limit must be >= 0, --inner >= 2 and --jobs >= 1")
    start_wall = time.monotonic()
    catalog, rows = macs.load_catalog(), list(load_published().rows)
    _WORK.update(rows=rows, inner=args.inner, predict_at=nested.published_predictor(
        catalog, mac_fit.prefill_rows(load_reference()), {r.src for r in rows}))
    groups = {f: sorted({cv.FOLDS[f](r) for r in rows})[:args.limit or None] for f in args.folds}
    tasks = [(f, g) for f in args.folds for g in groups[f]]
    done: dict[str, dict] = {f: {} for f in args.folds}
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for fold, group, res in pool.imap_unordered(_hold_out, tasks):
            done[fold][group] = res
            print(f"{fold} {group} ({sum(map(len, done.values()))}/{len(tasks)}): "
                  f"{time.monotonic() - start_wall:.0f} s", file=sys.stderr, flush=True)
        pool.close()
        pool.join()
    out: dict = {"grid": [h.label() for h in nested.GRID], "inner_folds": args.inner,
                 "rows": len(rows)}
    out |= {f: _fold_report(rows, f, groups[f], done[f]) for f in args.folds}
    out |= {"cpu_s": round(_cpu_s(), 1), "wall_s": round(time.monotonic() - start_wall, 1),
            "jobs": args.jobs,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
            "loadavg_end": os.getloadavg()[0]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
