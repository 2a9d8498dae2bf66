"""A decode-only row whose source admits its rows one step apart (published.yaml `staggered`:
macprovider's ContinuousBatchScheduler, one row admitted and prefilled per pump iteration and a
one-token window while a row queues) is priced over its ramp, as its timed window ran."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.perf import macs
from batchsim.server.perf.engines import load_engine
from batchsim.server.perf.gpu_fit import load_fit
from batchsim.server.perf.reference import load_published
from batchsim.server.published import sim

ROW = "mlxswift-sched-m3ultra-qwen3-30b-a3b-q4-b4"


def _row(row_id: str = ROW):
    return next(r for r in load_published().rows if r.id == row_id)


@pytest.mark.parametrize("batch, calls", [(1, 1), (2, 3), (4, 7)])
def test_the_ramp_has_the_window_calls_the_source_printed(batch, calls):
    """The runbook: '1-row used 1 window call, 2-row used 3, 4-row used 7'. Each step below the
    full batch is its own one-token window; the full batch's steps are one window."""
    steps = sim.stagger_steps(batch, 128)
    assert sum(n for _, n in steps) == 128 + batch - 1
    assert sum(rows * n for rows, n in steps) == batch * 128  # every row its 128 tokens
    assert sum((rows - 1) * n for rows, n in steps) == (batch - 1) * 127  # fit.py's closed form
    assert sum(n for rows, n in steps if rows < batch) + 1 == calls
    assert sim.stagger_steps(4, 128) == ((1, 2), (2, 2), (3, 2), (4, 125))


def test_a_staggered_row_is_priced_over_its_ramp():
    row, catalog = _row(), macs.load_catalog()
    assert row.staggered and not row.unexplained
    model = sim.MacModel(load_fit(), {"mlx-swift": load_engine("mlx-swift")})
    cost = sim.row_cost(row, catalog, model)
    width = sim.context_tokens(row)
    ramp_s = (2 * sum(cost.step_time(r, width).total_s for r in (1, 2, 3))
              + 125 * cost.step_time(4, width).total_s)
    assert sim.priced(row, catalog, model).decode.total_s == pytest.approx(ramp_s / 128)
    assert sim.predict_tok_s(row, catalog, model) == pytest.approx(4 * 128 / ramp_s)
    plain = dataclasses.replace(row, staggered=False)
    assert sim.predict_tok_s(plain, catalog, model) == pytest.approx(
        4 / cost.step_time(4, width).total_s)
    assert sim.predict_tok_s(row, catalog, model) < sim.predict_tok_s(plain, catalog, model)


def test_only_a_decode_only_row_is_staggered():
    with pytest.raises(ValueError, match="staggered"):
        dataclasses.replace(_row(), decode_only=False)


def test_only_a_batched_aggregate_row_is_staggered():
    """A ramp of rows joining one step apart has nothing to ramp at batch 1, and its arithmetic
    (tokens of every row over the ramp's steps) is an aggregate's (r5)."""
    with pytest.raises(ValueError, match="batch > 1"):
        dataclasses.replace(_row(), measures="per_request")
    with pytest.raises(ValueError, match="batch > 1"):
        dataclasses.replace(_row(), batch=1, measures="per_request")
