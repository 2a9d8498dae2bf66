"""How the published fit weighs its rows, measured (issue 34): each candidate weighting is fitted
in every fold of leave one source out and leave one chip out, exactly as `batchsim fit-macs` does
(cv.held_out, the published fitter, its fold catalogs), and scored like `fit-macs --json`'s `cv`.
None of them ships: the shipped fit weighs every explained row as one relative-error residual.

Candidates (VARIANTS):
- rows: as shipped (reproduces fit-macs's cv to the digit).
- src_keep_target: each source one vote within each target (batch 1, batched: a row weighs 1 /
  its source's rows of that target), each target's total kept at its row count.
- src_vote: each (source, target) one vote.
- target_equal: batch-1 and batched rows each half the total weight.
- gainrows: a batched row with a batch-1 partner (cv.gain_pairs) fitted as its relative error
  minus its partner's (to first order the gain's), instead of its own.
- both: every row as shipped, and each gain's difference row besides.
- b1only: the shipped model fitted on the batch-1 rows alone (terms only batched rows set stay at
  the seed's: qmv over rows priced as a GEMM, no per-row dispatch).

The fit's least squares is solve.fit_at's, given each variant's row weights (in its IRLS and its
Huber loss) and rows replaced by T @ rows (T: the gain transform). Prints one JSON line: per
variant and fold the {b1, batched, gain} summaries, all rows and explained only. About 1-2
CPU-minutes a variant:
    nice .venv/bin/python benchmarks/fit_weighting.py rows both > weighting.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform

import numpy as np
from batchsim.server.perf import mac_fit, macs
from batchsim.server.perf.gpu_fit import load_fit
from batchsim.server.perf.reference import load_published, load_reference
from batchsim.server.published import cv, solve
from batchsim.server.published import fit as published_fit
from batchsim.server.published.sim import MacModel

VARIANTS = ("rows", "src_keep_target", "src_vote", "target_equal", "gainrows", "both", "b1only")


def weights(rows, how: str) -> np.ndarray:
    """Each residual's weight (mean 1): the rows', then (both) the gains'."""
    if how in ("rows", "gainrows", "b1only"):
        return np.ones(len(rows))
    if how == "both":
        return np.ones(len(rows) + len(cv.gain_pairs(rows)))
    target = ["b1" if r.batch == 1 else "batched" for r in rows]
    masks = [np.array([t == k for t in target]) for k in ("b1", "batched")]
    if how == "target_equal":
        w = sum(m / m.sum() for m in masks if m.any())
    else:
        count = collections.Counter(zip((r.src for r in rows), target))
        w = np.array([1.0 / count[(r.src, t)] for r, t in zip(rows, target)])
        if how == "src_keep_target":
            for m in masks:
                w[m] *= m.sum() / w[m].sum() if m.any() else 1.0
    return w * len(rows) / w.sum()


def transform(rows, how: str) -> np.ndarray | None:
    pairs = cv.gain_pairs(rows)
    if how == "gainrows":
        t_mat = np.eye(len(rows))
        for i, j in pairs:
            t_mat[i, j] = -1.0
        return t_mat
    if how == "both":
        gains = np.zeros((len(pairs), len(rows)))
        for k, (i, j) in enumerate(pairs):
            gains[k, i], gains[k, j] = 1.0, -1.0
        return np.vstack([np.eye(len(rows)), gains])
    return None


def fitter(how: str, prefill) -> cv.Fitter:
    seed = cv.legacy_fitter(prefill)

    def fit(train, catalog):
        start = seed(train, catalog)
        train = [r for r in train if r.batch == 1] if how == "b1only" else list(train)
        kept = [r for r in train if published_fit.explained(r, start)]
        saved, published_fit.fit_at = published_fit.fit_at, functools.partial(
            solve.fit_at, transform=transform(kept, how), row_weights=weights(kept, how))
        try:
            return published_fit.fit_published(train, catalog, start)
        finally:
            published_fit.fit_at = saved

    return fit


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    args = p.parse_args(argv)
    catalog, rows = macs.load_catalog(), list(load_published().rows)
    prefill = mac_fit.prefill_rows(load_reference())
    start = MacModel(load_fit())
    keep = [published_fit.explained(r, start) for r in rows]
    out: dict = {"rows": len(rows), "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    for how in args.variants:
        reports = cv.cross_validate(rows, catalog, fitter(how, prefill), keep)[0]
        for fold, rep in reports.items():
            out[f"{how} {fold}"] = {"all": {k: rep[k] for k in cv.KINDS},
                                    "explained": rep["explained_only"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
