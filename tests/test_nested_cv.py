"""Nested cross-validation (server.published.nested, issue 34): each outer held-out group's
hyperparameters are chosen by an inner CV on the other groups' rows only, and the grid's first
candidate is the shipped fit (what fit-macs reports as plain)."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.perf import gpu_fit, mac_fit, macs
from batchsim.server.perf.reference import load_published, load_reference
from batchsim.server.published import cv, nested, solve


@dataclasses.dataclass(frozen=True)
class Row:
    """What cv.errors reads of a published row, and `base`: the tok/s a candidate scales."""

    src: str
    base: float
    tok_s: float
    batch: int = 1
    chip: str = "M2 Max"
    model: str = "m"
    weights: str = "4bit"
    gpu_cores: int = 38
    engine: str = "e"
    prompt_tokens: int = 128
    generated_tokens: int = 128
    decode_only: bool = True
    measures: str = "aggregate"


def _rows() -> list[Row]:
    """Six small sources measured at their base rate (candidate 1.0 is right for them), and one
    large source "x" at twice it (candidate 2.0 is right for x alone, and for most rows)."""
    rows = [Row(f"g{i}", 10.0 + i, 10.0 + i) for i in range(6)]
    return rows + [Row("x", 5.0 + i, 2 * (5.0 + i)) for i in range(20)]


def _predictor(calls: list):
    def predict_at(h: float):
        def predict(train, test):
            calls.append(({r.src for r in train}, {r.src for r in test}))
            return [h * r.base for r in test]
        return predict
    return predict_at


def test_the_outer_groups_rows_never_reach_its_choice():
    """Held out, "x" is scored at the candidate the other sources choose (1.0: its rows 50% off);
    a choice that saw x's rows (most of the rows) would take 2.0 and score x exactly."""
    rows, calls = _rows(), []
    key = cv.FOLDS["leave_one_source_out"]
    assert nested.choose(rows, key, (1.0, 2.0), _predictor([]))[0] == 2.0  # the leak's choice
    res = nested.nested_held_out(rows, key, (1.0, 2.0), _predictor(calls))
    assert res.chosen["x"]["chose"] == 1.0
    assert all(res.chosen[f"g{i}"]["chose"] == 2.0 for i in range(6))  # x's rows in their inner CV
    x = [i for i, r in enumerate(rows) if r.src == "x"]
    assert [res.nested[i] for i in x] == [rows[i].base for i in x]
    assert all(not train & test for train, test in calls)  # no fit priced a group it was fitted on
    # plain: every group at the grid's first candidate; nested: at its fold's choice
    assert res.plain == [r.base for r in rows]
    assert [res.nested[i] for i in range(6)] == [2 * rows[i].base for i in range(6)]


def test_inner_folds_deal_every_group_once():
    folds = nested.inner_folds(["d", "a", "c", "b", "e"], 3)
    assert folds == [{"a", "d"}, {"b", "e"}, {"c"}]
    assert nested.inner_folds(["a", "b"], 3) == [{"a"}, {"b"}]


def test_the_first_candidate_is_the_shipped_fit_and_applied_restores_it():
    assert nested.GRID[0] == nested.SHIPPED and len(set(nested.GRID)) == len(nested.GRID)
    shared = nested.SHIPPED._replace(engine_ridge=0.3, prior_rows=0.0, huber_delta=0.2,
                                     shrink_sampling=False, m3_ultra_untaxed=False)
    before = (solve.ENGINE_RIDGE, solve.PRIOR_ROWS, solve.HUBER_DELTA,
              solve.SHRUNK_DEVICE, gpu_fit.ultra_qmv_term("M3 Ultra"))
    with nested.applied(shared):
        assert (solve.ENGINE_RIDGE, solve.PRIOR_ROWS, solve.HUBER_DELTA,
                solve.SHRUNK_DEVICE) == (0.3, 0.0, 0.2, ())
        assert gpu_fit.ultra_qmv_term("M3 Ultra") == gpu_fit.ultra_qmv_term("M1 Ultra")
    assert (solve.ENGINE_RIDGE, solve.PRIOR_ROWS, solve.HUBER_DELTA,
            solve.SHRUNK_DEVICE, gpu_fit.ultra_qmv_term("M3 Ultra")) == before
    assert before[-1] != gpu_fit.ultra_qmv_term("M1 Ultra")


@pytest.mark.slow
def test_plain_is_what_fit_macs_holds_out():
    """At the shipped candidate a fold prices its held-out rows as cv.held_out does."""
    catalog, pub = macs.load_catalog(), load_published()
    rows = [r for s in ("mlx_examples_1029", "mlx_lm_benchmarks", "vllm_mlx_llm")
            for r in pub.by_src(s)][:30]
    prefill = mac_fit.prefill_rows(load_reference())
    key = cv.FOLDS["leave_one_source_out"]
    expected = cv.held_out(rows, catalog, key, cv.published_fitter(prefill))
    predict = nested.published_predictor(catalog, prefill, {r.src for r in rows})(nested.SHIPPED)
    group = key(rows[0])
    test = [r for r in rows if key(r) == group]
    got = predict([r for r in rows if key(r) != group], test)
    assert got == [expected[i] for i, r in enumerate(rows) if key(r) == group]
