"""The performance model's named parts: they add up to the total, and the total is what the
simulated executor charges for the same step (calibrated profile and catalog roofline alike)."""

from __future__ import annotations

import pytest
from batchsim.scheduler.plan import NewRequest, PrefillChunk, StepPlan
from batchsim.scheduler.pool_geometry import EMPTY_POOL, PoolGeometry
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.stepcost import StepCost, StepTime

from tests.sim_profile import PROFILE


def _mac_profile():
    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == "M2 Max 38c"]
    return mac.profile(macs.bandwidth_efficiency(catalog, "Q4_0")[0],
                       macs.compute_efficiency(catalog)[0])


COSTS = {
    "calibrated": lambda: StepCost(zoo_spec("smollm2-135m"), PROFILE, "float32", None),
    "roofline": lambda: StepCost(zoo_spec("llama-3.1-8b"), _mac_profile(), "float16", 4),
    "roofline-kv4": lambda: StepCost(zoo_spec("llama-3.1-8b"), _mac_profile(), "float16", 4, 4),
    "calibrated-kv8": lambda: StepCost(zoo_spec("smollm2-135m"), PROFILE, "float32", None, 8),
}


def _plan(index, *, new=(), prefills=(), decode=(), positions=(), pool=EMPTY_POOL, steps=1):
    news = tuple(NewRequest(r, None, SamplingParams(max_tokens=64)) for r in new)
    return StepPlan(index, (), news, tuple(prefills), tuple(decode),
                    tuple(positions), pool, 0, steps)


def _parts_sum(t: StepTime) -> float:
    return (t.weights_s + t.matmul_s + t.attention_s + t.elementwise_s + t.fixed_s
            + t.step_overhead_s + t.copy_s + t.experts_s + t.attention_rows_s + t.token_ops_s
            + t.sampling_s + t.host_step_s + t.host_token_s)


@pytest.mark.parametrize("kind", sorted(COSTS))
def test_parts_add_up_to_what_the_simulator_charges(kind):
    cost = COSTS[kind]()
    ex = SimExecutor(cost)
    pool = PoolGeometry(2, 512)
    # Two prompts prefilled (no pool yet: no copies), then the pool built and joined (copies).
    a = PrefillChunk(0, 0, 300, True)
    b = PrefillChunk(1, 0, 180, True)
    first = ex.execute(_plan(0, new=(0, 1), prefills=(a, b))).step_durations_s
    assert first[0] == pytest.approx(cost.step_time(prefills=(a, b)).total_s, rel=1e-12)
    ex.execute(_plan(1, decode=(0, 1), positions=(300, 180), pool=pool))
    # A mixed step: a third prompt's chunk beside the two decoding rows (width = longest + 1).
    c = PrefillChunk(2, 0, 256, False)
    mixed = ex.execute(_plan(2, new=(2,), prefills=(c,), decode=(0, 1), positions=(301, 181),
                             pool=pool)).step_durations_s
    expected = cost.step_time(decode_rows=2, width=302, prefills=(c,))
    assert _parts_sum(expected) == pytest.approx(expected.total_s, rel=1e-12)
    assert mixed[0] == pytest.approx(expected.total_s, rel=1e-12)
    # Pure decode fast-forwarded over several steps: each step reads one more token.
    run = ex.execute(_plan(3, decode=(0, 1), positions=(302, 182), pool=pool, steps=4))
    for i, d in enumerate(run.step_durations_s):
        t = cost.step_time(decode_rows=2, width=303 + i)
        assert d == pytest.approx(t.total_s, rel=1e-12)
        assert d == pytest.approx(cost.decode_forward_s(2, 303 + i) + cost.step_overhead_s,
                                  rel=1e-12)
    assert len(run.step_durations_s) == 4


def test_parts_are_the_terms_of_each_kind():
    cal = COSTS["calibrated"]().step_time(decode_rows=4, width=100, copy_bytes=1e6)
    # Calibrated: the GEMM fit's two terms, measured overheads, copies at the measured rate.
    assert cal.weights_s > 0 and cal.matmul_s > 0 and cal.fixed_s > 0
    assert cal.step_overhead_s == pytest.approx(200e-6) and cal.copy_s == pytest.approx(1e6 / 5e9)
    roof = COSTS["roofline"]()
    one, many = roof.step_time(decode_rows=1, width=640), roof.step_time(decode_rows=512, width=640)
    # A catalog Mac: batch 1 streams weights (no compute-bound matmul), 512 rows are FLOP-bound.
    assert one.matmul_s == 0 and one.weights_s > 0.9 * one.total_s
    assert many.matmul_s > many.weights_s
    assert one.fixed_s == one.step_overhead_s == one.copy_s == 0
    assert many.attention_s == pytest.approx(512 * one.attention_s)


def test_parts_as_dict_carry_the_total():
    t = COSTS["calibrated"]().step_time(decode_rows=2, width=50)
    d = t.as_dict()
    assert d["total_s"] == t.total_s
    # Written out, in field order: these are summary and `size --explain` keys, so a part
    # renamed, removed or added must fail here (as_dict itself is built from StepTime's fields).
    parts = ["weights_s", "matmul_s", "attention_s", "elementwise_s", "fixed_s",
             "step_overhead_s", "copy_s", "experts_s", "comm_s", "attention_rows_s",
             "token_ops_s", "sampling_s", "host_step_s", "host_token_s", "gemv_rows_s",
             "draft_s", "host_request_s", "top_p_s"]
    assert list(d) == [*parts, "total_s"]
    assert [d[k] for k in parts] == list(t.values())


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-moe", "tiny-sliding"])
def test_prompts_of_one_length_are_priced_as_one_forward_pass(model):
    # The MLX executor prefills first chunks of one length together (prefill_groups.py): the
    # simulator charges one forward over 3 x 64 tokens (one fixed cost, each matrix read once),
    # between one prompt's price and three; a later chunk or another length stays alone.
    cost = StepCost(zoo_spec(model), PROFILE, "float32", None)
    one = cost.prefill_forward_s(64, 0, True)
    three = cost.prefill_forward_s(64, 0, True, rows=3)
    assert one < three < 3 * one
    assert 3 * one - three >= 2 * cost.prefill_time(64, 0, True).fixed_s * 0.999
    chunks = (PrefillChunk(0, 0, 64, True), PrefillChunk(1, 0, 64, True),
              PrefillChunk(2, 0, 64, True),
              PrefillChunk(3, 0, 40, True), PrefillChunk(4, 64, 64, True))
    ex = SimExecutor(cost)
    step = ex.execute(_plan(0, new=range(5), prefills=chunks)).step_durations_s[0]
    alone = cost.prefill_forward_s(40, 0, True) + cost.prefill_forward_s(64, 64, True)
    assert step == pytest.approx(cost.step_overhead_s + three + alone, rel=1e-12)
    assert step == pytest.approx(cost.step_time(prefills=chunks).total_s, rel=1e-12)
