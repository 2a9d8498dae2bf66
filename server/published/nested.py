"""Nested cross-validation of the Mac fit (issue 34): the fit's hyperparameters were chosen by
looking at the same all-row held-out errors `fit-macs` reports, so those are optimistic. Here each
outer held-out group (a source, or a chip) gets its hyperparameters chosen from a small declared
grid by an inner grouped CV on the other groups' rows only, is fitted on them with the chosen
values, and its rows are scored. Nothing of the outer group reaches its choice.

The grid (GRID) is the shipped values and, one at a time, the alternatives the history tried or
the constants' bracket: PRIOR_ROWS 0 (no pull towards the kind's prior: the fit before 9a0ed9a),
per-row sampling unshrunk (SHRUNK_DEVICE empty: before 58445e6), the M1/M2 Ultras' qmv slowdown
on M3-on Ultras too (m3_ultra_untaxed False: one term for every Ultra, as before 4afac0d; shipped
since 0d9b162: M1/M2 Ultras only), ENGINE_RIDGE 0.03 and 0.3 (shipped 0.1), the published fit's
HUBER_DELTA 0.05 and 0.2 (shipped 0.10; no other value of these two is in the history: the bracket
is declared here). The slowdown caps (MAX_SLOWDOWN) are not in the grid: a ninth candidate
would take the full run past its 20 CPU-minutes. The shipped fit and model are not changed:
`applied` sets a candidate's values for the duration of a fit and its predictions, then restores
them."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from batchsim.server.perf import gpu_fit, macs
from batchsim.server.published import cv, solve
from batchsim.server.published import fit as published_fit
from batchsim.server.published.sim import predict_tok_s

INNER_FOLDS = 3  # inner grouped folds: the training groups dealt round-robin in sorted order
NO_GENERATION = 10**9  # an Ultra generation no chip reaches: every Ultra takes the M1/M2 term
SAMPLING, M3_GENERATION = solve.SHRUNK_DEVICE, gpu_fit.ULTRA_M3_GENERATION  # as shipped


class Hyper(NamedTuple):
    """One candidate: the published fit's hyperparameters."""

    engine_ridge: float
    prior_rows: float
    huber_delta: float
    shrink_sampling: bool
    m3_ultra_untaxed: bool  # False: M3-on Ultras take the M1/M2 Ultras' qmv slowdown too

    def label(self) -> str:
        changed = [f"{k}={v}" for k, v in self._asdict().items() if getattr(SHIPPED, k) != v]
        return ", ".join(changed) or "shipped"


SHIPPED = Hyper(solve.ENGINE_RIDGE, solve.PRIOR_ROWS, solve.HUBER_DELTA,
                bool(solve.SHRUNK_DEVICE), True)
GRID = (SHIPPED, *(SHIPPED._replace(**{k: v}) for k, v in (
    ("prior_rows", 0.0), ("shrink_sampling", False), ("m3_ultra_untaxed", False),
    ("engine_ridge", 0.03), ("engine_ridge", 0.3), ("huber_delta", 0.05), ("huber_delta", 0.2))))

Predict = Callable[[Sequence[Any], Sequence[Any]], list[float]]  # (train, test) -> test's tok/s


@contextlib.contextmanager
def applied(h: Hyper) -> Iterator[None]:
    """The module constants the fit and its pricing read, at `h`'s values while inside."""
    values = {(solve, "ENGINE_RIDGE"): h.engine_ridge,
              (solve, "PRIOR_ROWS"): h.prior_rows,
              (solve, "HUBER_DELTA"): h.huber_delta,
              (solve, "SHRUNK_DEVICE"): SAMPLING if h.shrink_sampling else (),
              (gpu_fit, "ULTRA_M3_GENERATION"):
                  M3_GENERATION if h.m3_ultra_untaxed else NO_GENERATION}
    saved = {key: getattr(*key) for key in values}
    try:
        for (module, name), v in values.items():
            setattr(module, name, v)
        yield
    finally:
        for (module, name), v in saved.items():
            setattr(module, name, v)


def published_predictor(catalog: macs.Catalog, prefill: Sequence[Any],
                        sources: set[str]) -> Callable[[Hyper], Predict]:
    """predict_at(h): a fit on `train` at `h` pricing `test`, as cv.held_out's published_fitter
    (the fold's catalog, its batch-1 seed on its own prefill rows). The seed reads none of `h`'s
    fit constants: one per training set and m3_ultra_untaxed, shared by the candidates. `sources`:
    every published source (cv.fold_catalog's)."""
    seed, seeds = cv.legacy_fitter(prefill), {}

    def predict_at(h: Hyper) -> Predict:
        def predict(train: Sequence[Any], test: Sequence[Any]) -> list[float]:
            cat = cv.fold_catalog(catalog, train, sources)
            with applied(h):
                key = (tuple(r.id for r in train), h.m3_ultra_untaxed)
                if key not in seeds:
                    seeds[key] = seed(train, cat)
                model = published_fit.fit_published(train, cat, seeds[key])
                return [predict_tok_s(r, cat, model) for r in test]

        return predict

    return predict_at


def inner_folds(groups: Sequence[str], k: int = INNER_FOLDS) -> list[set[str]]:
    """`groups` dealt round-robin in sorted order into min(k, len) folds."""
    ordered = sorted(groups)
    n = min(k, len(ordered))
    return [set(ordered[i::n]) for i in range(n)]


def score(rows: Sequence[Any], predicted: Sequence[float]) -> float:
    """What the choice minimises: the mean over b1, batched and gain (those the rows have) of the
    median |relative error|."""
    errs = cv.errors(rows, predicted)
    medians = [statistics.median(abs(e) for _, e in errs[k]) for k in cv.KINDS if errs[k]]
    return statistics.fmean(medians)


def inner_score(rows: Sequence[Any], key: Callable[[Any], str], predict: Predict,
                k: int = INNER_FOLDS) -> float:
    """score() of every row predicted by a fit on the other inner folds' rows."""
    predicted = [0.0] * len(rows)
    for fold in inner_folds({key(r) for r in rows}, k):
        test = [i for i, r in enumerate(rows) if key(r) in fold]
        train = [r for r in rows if key(r) not in fold]
        for i, p in zip(test, predict(train, [rows[i] for i in test])):
            predicted[i] = p
    return score(rows, predicted)


def choose(rows: Sequence[Any], key: Callable[[Any], str], grid: Sequence[Any],
           predict_at: Callable[[Any], Predict], k: int = INNER_FOLDS) -> tuple[Any, list[float]]:
    """(the candidate of least inner score, the first on a tie; every candidate's score) on
    `rows` alone."""
    scores = [inner_score(rows, key, predict_at(h), k) for h in grid]
    return grid[scores.index(min(scores))], scores


class Nested(NamedTuple):
    plain: list[float]  # held out at grid[0] (what fit-macs reports)
    nested: list[float]  # held out at the candidate its fold chose
    chosen: dict[str, dict[str, Any]]  # by held-out group: the choice and the inner scores


def nested_held_out(rows: Sequence[Any], key: Callable[[Any], str], grid: Sequence[Any],
                    predict_at: Callable[[Any], Predict], k: int = INNER_FOLDS,
                    groups: Sequence[str] | None = None,
                    progress: Callable[[str], None] = lambda _: None) -> Nested:
    """Each group's rows (of `groups`, default all) predicted by a fit on the others' at grid[0]
    (plain) and at the candidate an inner CV on the others' rows chose (nested; the plain fit
    reused where it chose grid[0]). Rows of a group not held out keep 0."""
    plain, nested = [0.0] * len(rows), [0.0] * len(rows)
    chosen: dict[str, dict[str, Any]] = {}
    for group in sorted(groups or {key(r) for r in rows}):
        test = [i for i, r in enumerate(rows) if key(r) == group]
        train = [r for r in rows if key(r) != group]
        held = [rows[i] for i in test]
        h, scores = choose(train, key, grid, predict_at, k)
        base = predict_at(grid[0])(train, held)
        out = base if h == grid[0] else predict_at(h)(train, held)
        for i, p, q in zip(test, base, out):
            plain[i], nested[i] = p, q
        chosen[group] = {"chose": h, "inner_scores": [round(s, 4) for s in scores]}
        progress(group)
    return Nested(plain, nested, chosen)
